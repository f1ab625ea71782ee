"""The streaming benchmarks that need neither Ray nor a GPU run on the current code and write their figures:
``benchmarks/output_delivery.py`` drives ``EngineLoop._deliver`` directly, so a change to what it delivers to
shows here, not on the next person's benchmark run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_the_output_delivery_benchmark_measures_both_ways_of_delivering_a_step(tmp_path):
    out = tmp_path / "output_delivery.json"
    subprocess.run([sys.executable, "benchmarks/output_delivery.py", "--batches", "4,16", "--steps", "5",
                    "--rounds", "1", "--step-ms", "0.5", "--json", str(out)], cwd=REPO, check=True, timeout=100)
    rows = json.loads(out.read_text())["results"]
    assert [row["batch"] for row in rows] == [4, 16]
    assert all(math.isfinite(row[way]) and row[way] > 0
               for row in rows for way in ("one_wakeup_each_us", "one_wakeup_a_step_us"))
