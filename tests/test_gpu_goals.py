"""benchmarks/gpu_goals.py reads what the GPU benchmarks really write: a CPU smoke run of each judges no
goal, and the same files carrying GPU-sized figures are judged met or not met goal by goal."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import engine_gpu, gpu_goals, transfer_gpu

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """The two benchmarks' own JSON from their CPU smoke runs (tiny shape, 1 MiB transfers), the engine's
    with and without async scheduling."""
    folder = tmp_path_factory.mktemp("gpu-results")
    async_run = ["--async-scheduling", "--skip-hf"]
    for name, extra in (("engine_gpu.json", []), ("engine_gpu_async.json", async_run)):
        engine_gpu.main(["--device", "cpu", "--shapes", "tiny-test", "--batches", "16,64", "--prompt-len", "16",
                         "--new-tokens", "4", "--json", str(folder / name), *extra])
    transfer_gpu.main(["--device", "cpu", "--sizes", "1", "--repeats", "1", "--json", str(folder / "transfer_gpu.json")])
    return folder


def test_a_cpu_smoke_run_judges_no_goal(smoke_runs):
    verdicts = gpu_goals.goals(smoke_runs)
    assert [v.issue for v in verdicts] == [12, 12, 12, 12, 12, 12, 13, 13]
    assert all(v.met is None for v in verdicts)
    assert all("not measured on a GPU" in v.figure or "no gpu_tests.xml" in v.figure for v in verdicts)


def _as_gpu_run(smoke_runs, folder, tiny_step_ms: float, speedup: float, step_over_roofline: float, mfu: float,
                ipc_share: float, grpc_share: float, failures: int) -> None:
    """The smoke run's files, written as if an H200 had measured these figures (every other key as written;
    the async-scheduled decode step 0.1 ms under the synchronous one)."""
    engine_async = json.loads((smoke_runs / "engine_gpu_async.json").read_text())
    assert engine_async["async_scheduling"]
    row = engine_async["shapes"]["tiny-test"]["batches"]["64"]
    engine_async.update(device="NVIDIA H200", shapes={gpu_goals.TINY: {"batches": {"64": {
        **row, "median_decode_step_ms": tiny_step_ms - 0.1}}}})
    (folder / "engine_gpu_async.json").write_text(json.dumps(engine_async))
    engine = json.loads((smoke_runs / "engine_gpu.json").read_text())
    row16, row64 = (engine["shapes"]["tiny-test"]["batches"][b] for b in ("16", "64"))
    tiny = {**row64, "median_decode_step_ms": tiny_step_ms, "speedup_vs_hf": speedup,
            "tokens_per_s": 1000.0 * speedup, "hf_tokens_per_s": 1000.0}
    big = {**row64, "median_decode_step_ms": step_over_roofline * row64["roofline_decode_step_ms"]}
    engine.update(device="NVIDIA H200", shapes={
        gpu_goals.TINY: {"batches": {"64": tiny}},
        gpu_goals.LLAMA8B: {"batches": {"16": {**row16, "prefill_mfu": mfu}, "64": big}}})
    (folder / "engine_gpu.json").write_text(json.dumps(engine))
    transfer = json.loads((smoke_runs / "transfer_gpu.json").read_text())
    shares = {"ipc": ipc_share, "grpc": grpc_share}
    for row in transfer["results"]:
        row["size_bytes"] = 256 * gpu_goals.MiB
        row["vs_reference"] = shares.get(row["backend"], row["vs_reference"])
    transfer["device"] = "cuda:0"
    (folder / "transfer_gpu.json").write_text(json.dumps(transfer))
    (folder / "gpu_tests.xml").write_text(  # the shape pytest's --junitxml writes
        f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" '
        f'failures="{failures}" skipped="1" tests="6" time="1.0"></testsuite></testsuites>')


@pytest.mark.parametrize("met", [True, False])
def test_each_goal_is_judged_on_its_own_figure(smoke_runs, tmp_path, met):
    if met:
        _as_gpu_run(smoke_runs, tmp_path, 1.9, 11.0, 1.5, 0.75, 0.6, 0.55, failures=0)
    else:
        _as_gpu_run(smoke_runs, tmp_path, 2.2, 9.0, 1.7, 0.65, 0.4, 0.45, failures=1)
    out = tmp_path / "goals.json"
    verdicts = gpu_goals.main([str(tmp_path), "--json", str(out)])
    assert [v.met for v in verdicts] == [met] * 8, verdicts
    assert json.loads(out.read_text())[0]["met"] is met
    figures = [v.figure for v in verdicts]
    assert figures[:2] == (["1.90 ms", "1.80 ms"] if met else ["2.20 ms", "2.10 ms"])
    assert figures[5] == ("5 of 5 passed, 1 skipped" if met else "4 of 5 passed, 1 skipped")
    assert math.isclose(float(figures[3].split(" = ")[1].split("x")[0]), 1.5 if met else 1.7)
