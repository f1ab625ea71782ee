"""Issues 12 and 13's goals against what one `make gpu-check` run measured: one line a goal, met or not.

Reads what ``benchmarks/gpu_check.sh`` leaves in its folder (``engine_gpu.json``, ``engine_gpu_async.json``,
``transfer_gpu.json``, ``gpu_tests.xml``) and prints each goal with the figure it is judged on, so the run
that a lent GPU allows is read the same way every time; a goal whose figure the run lacks (a step that failed, timed out or was
not run) says so rather than passing. ``--json`` writes the same as data.

    python benchmarks/gpu_goals.py gpu-results [--json gpu-results/goals.json]
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

TINY, LLAMA8B = "tinyllama-1.1b", "llama-3-8b"
MiB = 1 << 20


@dataclass
class Verdict:
    issue: int
    goal: str
    figure: str  # what was measured, or why there is nothing
    met: bool | None  # None: not measured


def _read(folder: Path, name: str) -> dict | None:
    """A benchmark's JSON, if it ran on a GPU: a ``--device cpu`` smoke run's figures judge nothing."""
    path = folder / name
    result = json.loads(path.read_text()) if path.is_file() else None
    return None if result is None or str(result.get("device", "")).startswith("cpu") else result


def _batch(engine: dict | None, shape: str, batch: int) -> dict | None:
    return (engine or {}).get("shapes", {}).get(shape, {}).get("batches", {}).get(str(batch))


def _transfer(transfer: dict | None, backend: str, size_mib: int) -> dict | None:
    rows = (transfer or {}).get("results", [])
    return next((r for r in rows if r["backend"] == backend and round(r["size_bytes"] / MiB) == size_mib), None)


def _judge(issue: int, goal: str, row: dict | None, missing: str,
           figure: Callable[[dict], tuple[str, bool] | None]) -> Verdict:
    judged = figure(row) if row is not None else None
    if judged is None:
        return Verdict(issue, goal, missing, None)
    return Verdict(issue, goal, *judged)


def _tiny_step(row: dict) -> tuple[str, bool] | None:
    step = row.get("median_decode_step_ms")
    return None if step is None else (f"{step:.2f} ms", step <= 2.0)


def _vs_generate(row: dict) -> tuple[str, bool] | None:
    ratio = row.get("speedup_vs_hf")
    return None if ratio is None else (f"x{ratio:.1f} ({row['tokens_per_s']:.0f} vs {row['hf_tokens_per_s']:.0f} "
                                       "tok/s)", ratio >= 10.0)


def _vs_roofline(row: dict) -> tuple[str, bool] | None:
    step, roof = row.get("median_decode_step_ms"), row.get("roofline_decode_step_ms")
    if step is None or not roof:
        return None
    return f"{step:.2f} ms = {step / roof:.2f}x the roofline's {roof:.2f} ms", step <= 1.6 * roof


def _mfu(row: dict) -> tuple[str, bool]:
    return f"{row['prefill_mfu']:.1%} ({row['prefill_tokens_per_s']:.0f} prompt tok/s)", row["prefill_mfu"] >= 0.70


def _share(row: dict) -> tuple[str, bool] | None:
    ratio = row.get("vs_reference")
    return None if ratio is None else (f"{row['gbps_median']:.1f} GB/s = {ratio:.0%} of {row['reference']}",
                                       ratio >= 0.5)


def _tests(xml: Path) -> Verdict:
    goal = "the `gpu` tests pass (fp32 greedy parity with transformers on CUDA among them)"
    if not xml.is_file():
        return Verdict(12, goal, "not run (no gpu_tests.xml)", None)
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    ran = counts["tests"] - counts["skipped"]
    bad = counts["failures"] + counts["errors"]
    figure = f"{ran - bad} of {ran} passed, {counts['skipped']} skipped"
    return Verdict(12, goal, figure, None if ran == 0 else bad == 0)


def goals(folder: Path) -> list[Verdict]:
    engine, transfer = _read(folder, "engine_gpu.json"), _read(folder, "transfer_gpu.json")
    engine_async = _read(folder, "engine_gpu_async.json")
    no_engine = "not measured on a GPU (engine_gpu.json lacks it)"
    no_transfer = "not measured on a GPU (transfer_gpu.json lacks it)"
    return [
        _judge(12, "1.1B shape, batch 64: median decode step <= 2.0 ms", _batch(engine, TINY, 64), no_engine,
               _tiny_step),
        _judge(12, "1.1B shape, batch 64, --async-scheduling: median decode step <= 2.0 ms",
               _batch(engine_async, TINY, 64), "not measured on a GPU (engine_gpu_async.json lacks it)",
               _tiny_step),
        _judge(12, "1.1B shape, batch 64: >= 10x transformers generate tok/s", _batch(engine, TINY, 64), no_engine,
               _vs_generate),
        _judge(12, "8B shape, batch 64: decode step within 1.6x of its roofline", _batch(engine, LLAMA8B, 64),
               no_engine, _vs_roofline),
        # The issue's 8 x 512 prompt tokens in one step: the benchmark's batch 16 puts 16 x 512 in one step
        # (its step budget is 8,192 tokens), the nearest it runs.
        _judge(12, "8B shape, prefill (16 x 512 tokens a step): >= 70% MFU", _batch(engine, LLAMA8B, 16), no_engine,
               _mfu),
        _tests(folder / "gpu_tests.xml"),
        _judge(13, "CUDA IPC, 256 MiB between two processes: >= 50% of the d2d copy", _transfer(transfer, "ipc", 256),
               no_transfer, _share),
        _judge(13, "gRPC from device memory, 256 MiB: >= 50% of the pinned d2h copy",
               _transfer(transfer, "grpc", 256), no_transfer, _share),
    ]


def main(argv: list[str] | None = None) -> list[Verdict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="what benchmarks/gpu_check.sh wrote (e.g. gpu-results)")
    parser.add_argument("--json", type=Path, help="write the verdicts here")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder: give the one `make gpu-check` wrote")
    verdicts = goals(args.folder)
    for v in verdicts:
        mark = {True: "met", False: "NOT met", None: "-"}[v.met]
        print(f"#{v.issue}  {mark:<8} {v.goal}: {v.figure}")
    if args.json:
        args.json.write_text(json.dumps([asdict(v) for v in verdicts], indent=1))
    return verdicts


if __name__ == "__main__":
    main()
