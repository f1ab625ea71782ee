"""``benchmarks/engine_host.py`` runs on the current code: the engine's decode steps split into the forward pass,
the torch path's input preparation and the rest, each step's chunks loaded into a ``DecodeGraphs``' buffers
(the benchmark fails if a step decodes fewer than the batch), and the graphed step's host work derived."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_the_host_benchmark_splits_a_decode_step_and_loads_the_graph_buffers(tmp_path):
    out = tmp_path / "engine_host.json"
    subprocess.run([sys.executable, "benchmarks/engine_host.py", "--batches", "3,8", "--prompt-len", "20",
                    "--steps", "6", "--rounds", "1", "--json", str(out)], cwd=REPO, check=True, timeout=100)
    rows = json.loads(out.read_text())["results"]
    assert [(row["batch"], row["prompt_len"], row["steps"]) for row in rows] == [(3, 20, 6), (8, 20, 6)]
    for row in rows:
        assert 0 < row["forward_ms"] < row["step_ms"] and row["graph_load_ms"] > 0 and row["schedule_ms"] > 0
        parts = row["forward_ms"] + row["torch_prepare_ms"] + row["schedule_ms"] + row["rest_ms"]
        assert parts == pytest.approx(row["step_ms"])
        assert row["graphed_host_ms"] == pytest.approx(row["step_ms"] - row["forward_ms"] - row["torch_prepare_ms"]
                                                       + row["graph_load_ms"])
        assert row["graphed_host_us_per_seq"] == pytest.approx(1e3 * row["graphed_host_ms"] / row["batch"])
