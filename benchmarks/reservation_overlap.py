"""Time to first token when the decode worker has no room yet: its wait overlapped with the prefill, or first.

    python benchmarks/reservation_overlap.py --prompt-len 2048 --repeats 3 --json reservation_overlap.json

A real cluster (``ClusterConfig(prefill=1, decode=1)``: two Ray actors, one core each). Before each request a
reservation ``hog`` takes every free block of the decode worker, and is released ``D`` seconds after the
request starts, as a finishing sequence would free its blocks; so the request's own reservation waits ``D``
for room. Two ways of running the same request, alternated, each timed to its first token (the prefill
worker's answer, after its KV reached the lease and was acknowledged):

  overlapped   what the dispatcher does (``services/attempt.py``): ``reserve`` answers at once that the lease
               waits, the prompt is computed meanwhile, and the KV push waits for the lease
  serial       the same calls in the order the dispatcher used before: ``reserve``, wait for the lease
               (``DecodeWorker.wait_for_lease``), then ``prefill``

With a prefill that takes ``P`` (the engine step, measured per request) and a transfer ``X``, serial takes
about ``D + P + X`` and overlapped ``max(D, P) + X``: ``hidden = (serial - overlapped) / min(D, P)`` is the
share of the overlappable time that the overlap saves (1.0 at best). ``D`` is set from the prefill measured
in the same run (``--wait-factors`` times it). Every prompt is fresh random tokens (no prefix cache hit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from services.cluster import Cluster  # noqa: E402
from services.config import ClusterConfig  # noqa: E402

_PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # > 1: the KV is handed off


async def first_token_s(prefill, decode, prompt: list[int], wait_s: float, overlapped: bool) -> tuple[float, float]:
    """(seconds to the first token, the prefill's engine step) of one request while ``hog`` holds every free
    block of ``decode`` for ``wait_s`` more seconds."""
    request_id = f"overlap-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    freeing = asyncio.create_task(asyncio.sleep(wait_s))
    freeing.add_done_callback(lambda _: asyncio.create_task(decode.release("hog")))
    try:
        reserved = await decode.reserve(request_id, len(prompt), 300.0, 60.0, 60.0, _PARAMS.max_tokens)
        assert not reserved, "the decode worker had room: the hog did not take every block"
        if not overlapped:
            await decode.actor.wait_for_lease.remote(request_id, 60.0)
        await prefill.prefill(request_id, prompt, _PARAMS, decode.info.kv_target, None, 300.0,
                              lease_pending=overlapped)
        seconds = time.perf_counter() - start
        stats = await prefill.actor.stats.remote()
        return seconds, stats.recent_step_times_s[-1]
    finally:
        await freeing
        await decode.release(request_id)


async def unhindered_step_s(prefill, decode, prompt: list[int]) -> float:
    """The prefill's engine step for a request whose lease has room at once (warm-up, and the measure of P)."""
    request_id = f"warm-{uuid.uuid4().hex[:8]}"
    assert await decode.reserve(request_id, len(prompt), 300.0, 0.0, 60.0, _PARAMS.max_tokens)
    try:
        await prefill.prefill(request_id, prompt, _PARAMS, decode.info.kv_target, None, 300.0)
    finally:
        await decode.release(request_id)
    return (await prefill.actor.stats.remote()).recent_step_times_s[-1]


async def hog(decode) -> None:
    """Take every free block of ``decode`` (released by ``first_token_s``)."""
    while (load := await decode.load(10.0)).num_running or load.waiting_leases:
        await asyncio.sleep(0.05)
    assert await decode.reserve("hog", load.free_blocks * decode.info.block_size, 300.0, 0.0, 60.0)


async def measure(prompt_len: int, repeats: int, factors: list[float], seed: int) -> dict:
    cluster = Cluster(ClusterConfig(prefill=1, decode=1, kv_transport="grpc", threads_per_worker=1))
    await cluster.start()
    try:
        prefill, decode = (next(w for w in cluster.workers if w.role == role) for role in ("prefill", "decode"))
        rng = random.Random(seed)
        fresh = lambda: [rng.randrange(256) for _ in range(prompt_len)]  # noqa: E731 (byte tokens: any is valid)
        # Warm-up (channels, first-call costs), which also measures the prefill that sets the waits.
        prefill_s = statistics.median([await unhindered_step_s(prefill, decode, fresh()) for _ in range(3)])
        results = []
        for factor in factors:
            wait_s = factor * prefill_s
            samples: dict[str, list[tuple[float, float]]] = {"serial": [], "overlapped": []}
            for _ in range(repeats):
                for mode in ("serial", "overlapped"):  # alternated: drift on a shared machine hits both
                    await hog(decode)
                    samples[mode].append(await first_token_s(prefill, decode, fresh(), wait_s, mode == "overlapped"))
            serial = statistics.median(s for s, _ in samples["serial"])
            overlapped = statistics.median(s for s, _ in samples["overlapped"])
            step = statistics.median(p for mode in samples.values() for _, p in mode)
            results.append({"wait_factor": factor, "wait_s": wait_s, "prefill_step_s": step,
                            "serial_ttft_s": serial, "overlapped_ttft_s": overlapped,
                            "hidden_fraction": (serial - overlapped) / min(wait_s, step), "samples": samples})
        return {"prefill_s": prefill_s, "results": results}
    finally:
        await cluster.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3, help="timed requests per mode and wait")
    p.add_argument("--wait-factors", default="0.5,1,2", help="the decode worker's wait, as multiples of the prefill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    print(f"load average {load_average()}", flush=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run = asyncio.run(measure(args.prompt_len, args.repeats,
                                  [float(f) for f in args.wait_factors.split(",")], args.seed))
    finally:
        ray.shutdown()
    rows = [[f"{r['wait_factor']:g} x prefill", 1000 * r["wait_s"], 1000 * r["prefill_step_s"],
             1000 * r["serial_ttft_s"], 1000 * r["overlapped_ttft_s"],
             1000 * (r["serial_ttft_s"] - r["overlapped_ttft_s"]), r["hidden_fraction"]] for r in run["results"]]
    print(format_table(["decode wait", "D", "P", "serial TTFT", "overlapped TTFT", "saved", "hidden"], rows))
    print(f"(ms, medians of {args.repeats}; {args.prompt_len}-token prompt; hidden = saved / min(D, P); "
          f"load average now {load_average()})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **run}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
