"""What one worker costs to start, through the launcher that starts, replaces and adds workers
(services/placement.py): seconds until it serves (placed, its engine built and profiled) and the CPU the
machine spends meanwhile. Plain, as Tidepool starts workers, and with a Ray runtime env
(``ClusterConfig.extra_env``), with which Ray starts each worker through a setup process of its own (how
every worker started before). One worker at a time, as a replacement starts, alternating the two ways on
one local Ray instance.

    python benchmarks/worker_start.py --workers 4 --json worker_start.json

The CPU figure is the whole machine's busy time over each start (/proc/stat), so run it on an otherwise
quiet machine (the load average is recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from benchmarks._report import format_table, load_average  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from services.config import ClusterConfig  # noqa: E402
from services.messages import Role  # noqa: E402
from services.placement import WorkerLauncher  # noqa: E402

WAYS = {"plain": {}, "runtime env": {"TIDEPOOL_BENCH": "1"}}  # the extra_env each way starts workers with


def busy_cpu_s() -> float:
    """CPU seconds the machine has been busy (user, nice and system time over every core)."""
    with open("/proc/stat") as stat:
        user, nice, system = map(int, stat.readline().split()[1:4])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def start_one(engine: EngineConfig, extra_env: dict[str, str], worker_id: str) -> tuple[float, float]:
    """(seconds until one colocated worker serves, machine CPU seconds meanwhile); the worker is stopped."""
    launcher = WorkerLauncher(ClusterConfig(engine=engine, colocated=1, extra_env=extra_env), "bench", None, 1,
                              secrets.token_hex(8), may_grow=False)
    cpu, start = busy_cpu_s(), time.perf_counter()
    try:
        asyncio.run(launcher.launch(worker_id, Role.COLOCATED))
        return time.perf_counter() - start, busy_cpu_s() - cpu
    finally:
        launcher.kill_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a checkpoint directory or the built-in tiny model")
    parser.add_argument("--workers", type=int, default=4, help="workers started each way")
    parser.add_argument("--settle-s", type=float, default=3.0, help="idle time before each start")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    engine = EngineConfig(model=args.model, num_blocks=256)
    samples: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    try:
        for i in range(args.workers):
            for way, extra_env in WAYS.items():
                time.sleep(args.settle_s)  # the previous worker's exit and Ray's own bookkeeping settle
                samples[way].append(start_one(engine, extra_env, f"w{i}-{way.replace(' ', '-')}"))
    finally:
        ray.shutdown()

    results = [{"way": way, "workers": len(runs),
                "start_s_median": statistics.median(s for s, _ in runs),
                "cpu_s_median": statistics.median(c for _, c in runs)} for way, runs in samples.items()]
    plain, runtime_env = results
    report = {"model": args.model, "load_average": load_average(), "results": results,
              "runtime_env_cpu_ratio": runtime_env["cpu_s_median"] / plain["cpu_s_median"],
              "runtime_env_start_ratio": runtime_env["start_s_median"] / plain["start_s_median"],
              "runtime_env_extra_cpu_s": runtime_env["cpu_s_median"] - plain["cpu_s_median"]}
    print(f"load average {report['load_average']}")
    print(format_table(["way", "workers", "start s (median)", "CPU s (median)"],
                       [[r["way"], r["workers"], r["start_s_median"], r["cpu_s_median"]] for r in results]))
    print(f"a runtime env: {report['runtime_env_start_ratio']:.2f}x the start time, "
          f"{report['runtime_env_cpu_ratio']:.2f}x the CPU ({report['runtime_env_extra_cpu_s']:+.2f} s a worker)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
