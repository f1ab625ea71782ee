"""Benchmarks that need neither Ray nor a GPU run on the current code and write their figures, so a change to
what they drive shows here, not on the next person's benchmark run: ``benchmarks/output_delivery.py`` drives
``EngineLoop._deliver`` directly; ``benchmarks/engine_host.py`` splits the engine's decode steps into the forward
pass, the torch path's input preparation and the rest, and loads each step's chunks into a ``DecodeGraphs``'
buffers (it fails if a step decodes fewer than the batch); ``benchmarks/detokenize.py`` streams text through the
detokenizer both ways; ``benchmarks/w8a8.py`` times the W8A8 matmul beside the others and the engine on each
checkpoint it writes; ``benchmarks/embeddings.py`` times the engine's embeddings against sentence-transformers'
loop on transformers, their vectors compared."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, args: list[str], tmp_path: Path) -> list[dict]:
    """The ``results`` that ``benchmarks/<script>`` writes with ``args``."""
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, f"benchmarks/{script}", *args, "--json", str(out)], cwd=REPO, check=True,
                   timeout=100)
    return json.loads(out.read_text())["results"]


@pytest.mark.timeout(120)
def test_the_output_delivery_benchmark_measures_both_ways_of_delivering_a_step(tmp_path):
    rows = run_benchmark("output_delivery.py", ["--batches", "4,16", "--steps", "5", "--rounds", "1",
                                                "--step-ms", "0.5"], tmp_path)
    assert [row["batch"] for row in rows] == [4, 16]
    assert all(math.isfinite(row[way]) and row[way] > 0
               for row in rows for way in ("one_wakeup_each_us", "one_wakeup_a_step_us"))


@pytest.mark.timeout(120)
def test_the_host_benchmark_splits_a_decode_step_and_loads_the_graph_buffers(tmp_path):
    rows = run_benchmark("engine_host.py", ["--batches", "3,8", "--prompt-len", "20", "--steps", "6",
                                            "--rounds", "1"], tmp_path)
    penalized = run_benchmark("engine_host.py", ["--batches", "3", "--prompt-len", "20", "--steps", "6",
                                                 "--rounds", "1", "--sampling", '{"repetition_penalty": 1.1}'],
                              tmp_path)
    assert [(row["batch"], row["prompt_len"], row["steps"]) for row in rows] == [(3, 20, 6), (8, 20, 6)]
    # the ops a graphed step runs outside its graph: the same at either batch, more with penalties
    assert 0 < rows[0]["graphed_step_ops"] == rows[1]["graphed_step_ops"] < penalized[0]["graphed_step_ops"]
    for row in rows:
        assert 0 < row["forward_ms"] < row["step_ms"] and row["graph_load_ms"] > 0 and row["schedule_ms"] > 0
        parts = row["forward_ms"] + row["torch_prepare_ms"] + row["schedule_ms"] + row["rest_ms"]
        assert parts == pytest.approx(row["step_ms"])
        assert row["graphed_host_ms"] == pytest.approx(row["step_ms"] - row["forward_ms"] - row["torch_prepare_ms"]
                                                       + row["graph_load_ms"])
        assert row["graphed_host_us_per_seq"] == pytest.approx(1e3 * row["graphed_host_ms"] / row["batch"])


@pytest.mark.timeout(120)
def test_the_detokenize_benchmark_streams_the_docs_both_ways(tmp_path):
    (row,) = run_benchmark("detokenize.py", ["--chars", "5000", "--rounds", "1"], tmp_path)
    # the script exits non-zero if either way hands out other text than the whole decode
    assert row["tokenizer"].startswith("tiny") and row["tokens"] > 4000  # one token a byte, less the context
    assert row["window_us_per_token"] > 0 and row["stream_us_per_token"] > 0
    assert row["speedup"] == pytest.approx(row["window_us_per_token"] / row["stream_us_per_token"])


@pytest.mark.timeout(120)
def test_the_w8a8_benchmark_times_every_path_and_every_checkpoint(tmp_path):
    """Every matmul path at every row count, and the engine on the 16-bit, W8A16 and W8A8 checkpoints."""
    from benchmarks import w8a8

    result = w8a8.main(["--shape", "tiny-test", "--layers", "1", "--repeats", "1", "--prefill", "2",
                        "--prompt-len", "16", "--new-tokens", "3", "--json", str(tmp_path / "w8a8.json")])
    assert json.loads((tmp_path / "w8a8.json").read_text()) == result
    assert sorted(result["matmul_s"]) == ["1", "16", "256"]
    assert all(set(paths) == {"float32", "bfloat16", "w8a16", "w8a8", "int8_gemm"}
               for paths in result["matmul_s"].values())
    assert list(result["engine"]) == ["16-bit, float32", "16-bit, bfloat16", "w8a16, float32", "w8a8, float32",
                                      "w8a8, bfloat16", "16-bit, w8a8_int8"]
    figures = [*(s for paths in result["matmul_s"].values() for s in paths.values()),
               *(v for row in result["engine"].values() for v in row.values())]
    assert all(math.isfinite(v) and v > 0 for v in figures)


@pytest.mark.timeout(120)
def test_the_embeddings_benchmark_gets_the_peers_vectors_and_computes_a_shared_instruction_once(tmp_path):
    from benchmarks import embeddings

    result = embeddings.main(["--shape", "tiny-test", "--layers", "1", "--inputs", "8", "--instruction-tokens",
                              "16", "--repeats", "1", "--json", str(tmp_path / "embeddings.json")])
    assert json.loads((tmp_path / "embeddings.json").read_text()) == result
    documents, queries = result["workloads"]["documents"], result["workloads"]["queries"]
    for row in (documents, queries):
        assert row["max_abs_diff"] < 1e-4 and row["min_cosine"] > 0.9999
        assert row["speedup"] == pytest.approx(row["sentence_transformers_way"]["seconds"] / row["tidepool"]["seconds"])
    assert documents["tidepool"]["tokens_computed"] == documents["tokens"]
    # the instruction is one block: the first query computes it, the seven others wait a step and find it cached
    assert queries["tidepool"]["tokens_computed"] == queries["tokens"] - 7 * 16
