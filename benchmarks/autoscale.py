"""The autoscaler under a load step: a live ``tidepool serve`` (tiny model, 1 prefill + decode workers the
autoscaler keeps between 1 and --max-decode) gets a light load, then a heavy one, then the light one again.

    python benchmarks/autoscale.py --json autoscale.json

Its status is read every 0.5 s throughout. Reported per phase: streams sent / completed / lost, p99 TTFT,
the decode workers serving at its start and end and the most at once, and the autoscaler's measured decode
load (workers kept busy); overall: seconds from the heavy phase's start until the autoscaler wanted more
workers and until the first added one served, seconds from the last phase's start until the cluster was
back at one decode worker, and the decode worker-seconds used against the same run at --max-decode workers
throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from benchmarks._serve import Served, served  # noqa: E402
from benchmarks.chaos_load import LoadTally, run_load  # noqa: E402

_POLL_S = 0.5


async def watch(srv: Served, timeline: list[tuple[float, int, float, int]], start: float) -> None:
    """Append (seconds since ``start``, decode workers serving, measured decode load, wanted) until cancelled."""
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=10) as client:
        while True:
            status = (await client.get("/v1/cluster/status")).json()
            serving = sum(1 for w in status["workers"] if w["role"] == "decode" and w["alive"] and not w["draining"])
            plan = status["autoscaler"]["decode"]
            timeline.append((time.perf_counter() - start, serving, plan["load"] or 0.0, plan["wanted"] or 0))
            await asyncio.sleep(_POLL_S)


def first_after(timeline: list[tuple], since: float, holds) -> float | None:
    """Seconds from ``since`` until the first sample that ``holds``."""
    return next((t - since for t, *sample in timeline if t >= since and holds(*sample)), None)


async def run(srv: Served, phases: list[tuple[str, int, int]], max_tokens: int, settle_s: float) -> dict:
    timeline: list[tuple[float, int, float, int]] = []
    start = time.perf_counter()
    watcher = asyncio.create_task(watch(srv, timeline, start))
    rows, starts = [], []
    for name, requests, concurrency in phases:
        begun = time.perf_counter() - start
        starts.append(begun)
        tally = await run_load(srv.base_url, srv.model, requests, concurrency, max_tokens, LoadTally())
        ended = time.perf_counter() - start
        seen = [s for s in timeline if begun <= s[0] <= ended] or timeline[-1:]
        p99 = tally.p99_ttft_s()
        rows.append({"phase": name, "concurrency": concurrency, "sent": tally.sent, "completed": tally.completed,
                     "lost": tally.lost, "rejected_429": tally.rejected, "seconds": round(ended - begun, 1),
                     "p99_ttft_s": None if p99 is None else round(p99, 3),
                     "decode_workers_start_end_max": [seen[0][1], seen[-1][1], max(s[1] for s in seen)],
                     "decode_load_max": round(max(s[2] for s in seen), 2)})
    deadline = time.perf_counter() + settle_s  # the light load is over: wait for the cluster to shrink
    while timeline[-1][1] > 1 and time.perf_counter() < deadline:
        await asyncio.sleep(_POLL_S)
    watcher.cancel()
    used = sum((b[0] - a[0]) * a[1] for a, b in zip(timeline, timeline[1:], strict=False))
    heavy, last = starts[1], starts[2]
    return {"phases": rows, "timeline": timeline, "summary": {
        "wanted_more_after_s": first_after(timeline, heavy, lambda serving, load, wanted: wanted > 1),
        "added_serving_after_s": first_after(timeline, heavy, lambda serving, load, wanted: serving > 1),
        "back_to_one_after_s": first_after(timeline, last, lambda serving, load, wanted: serving == 1),
        "decode_worker_s": round(used, 1), "run_s": round(timeline[-1][0] - timeline[0][0], 1)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-decode", type=int, default=3, help="most decode workers the autoscaler may run")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="sequences one decode worker runs at once")
    parser.add_argument("--light", type=int, default=2, help="concurrent streams of the light phases")
    parser.add_argument("--heavy", type=int, default=16, help="concurrent streams of the heavy phase")
    parser.add_argument("--requests", type=int, default=40, help="streams per light phase (4x in the heavy one)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--window-s", type=float, default=10.0, help="--autoscale-window-s")
    parser.add_argument("--scale-down-delay-s", type=float, default=10.0)
    parser.add_argument("--json", help="write the phases, the timeline and the summary here")
    args = parser.parse_args()
    serve_args = ["--prefill", "1", "--decode", "1", "--autoscale-decode", f"1:{args.max_decode}",
                  "--max-num-seqs", str(args.max_num_seqs), "--autoscale-window-s", str(args.window_s),
                  "--scale-down-delay-s", str(args.scale_down_delay_s), "--threads-per-worker", "1",
                  "--ray-num-cpus", str(args.max_decode + 2), "--kv-transport", "grpc"]
    phases = [("light", args.requests, args.light), ("heavy", 4 * args.requests, args.heavy),
              ("light again", args.requests, args.light)]
    with served(serve_args) as srv:
        result = asyncio.run(run(srv, phases, args.max_tokens, settle_s=args.window_s + args.scale_down_delay_s
                                 + 60.0 * args.max_decode))
    summary = result["summary"]
    fixed = summary["run_s"] * args.max_decode
    summary["fixed_max_worker_s"] = round(fixed, 1)
    summary["worker_s_saved"] = round(1 - summary["decode_worker_s"] / fixed, 3) if fixed else None
    print(f"serve {' '.join(serve_args)}\nload average {load_average()}\n")
    headers = ["phase", "concurrency", "sent", "completed", "lost", "rejected_429", "seconds", "p99_ttft_s",
               "decode_workers_start_end_max", "decode_load_max"]
    print(format_table(headers, [[r[h] for h in headers] for r in result["phases"]]))
    print("\n" + "\n".join(f"{key}: {value}" for key, value in summary.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
