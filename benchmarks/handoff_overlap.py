"""Prefill plus KV handoff of one long prompt, with and without layer-wise streaming, per transport.

    python benchmarks/handoff_overlap.py --prompt-len 2048 --repeats 4 --json handoff_overlap.json

For each transport (gRPC, collective = gloo on CPU) and each mode (whole-request after prefill, layer-wise
during prefill) the script starts a real cluster, ``ClusterConfig(prefill=1, decode=1, kv_transport=...,
layerwise=...)``: two Ray actors with one core each. It then drives exactly the handoff the dispatcher
drives, without the gateway, routing or decoding: the decode worker reserves a lease, and the timed call is
the prefill worker's ``prefill()`` (compute the prompt, sample the first token, push the KV into the lease
and wait for the decode side's ack after checksum and import). Every prompt is fresh random tokens, so no
prefix cache hit shortens it; the first call of each cluster is a warm-up and is not counted.

Per request: T_call (the ``prefill()`` round trip), T_step (the engine step that computed the prompt, from
the worker's step times) and transfer_s (the worker's own figure: first byte leaving -> ack). Medians:

  T_prefill         = T_step without layer-wise (pure compute; no export or send runs during it)
  T_transfer_alone  = T_call - T_step without layer-wise (export + push + ack, all of it exposed)
  T_layerwise       = T_call with layer-wise
  hidden fraction   = (T_prefill + T_transfer_alone - T_layerwise) / T_transfer_alone

Because T_prefill + T_transfer_alone is the whole-request call, that fraction compares whole calls of two
separate runs: it charges layer-wise for any compute it slows down (exports inside the step, the sending
thread sharing the worker's core), but on a shared machine the compute itself drifts between runs by more
than the whole transfer costs. So the per-request figure is shown too, where each request's own compute
cancels out: exposed = T_call - T_step, and hidden per request = 1 - exposed(layer-wise) / exposed(whole).

exposed also holds what the call costs before the prompt's step starts (the Ray call's arrival, the look
for cached prefix blocks, admission) and after the worker answers (the return): the same in both modes,
and no part of the transfer. The worker's own figure leaves them out: after = the result's ``exposed_s``,
from the end of the step that computed the prompt to the decode side's ack (what the first token waits
for), and hidden after compute = 1 - after(layer-wise) / after(whole), medians of each mode.
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


async def measure(transport: str, layerwise: bool, prompt_len: int, repeats: int, seed: int) -> list[dict]:
    cluster = Cluster(ClusterConfig(prefill=1, decode=1, kv_transport=transport, layerwise=layerwise,
                                    threads_per_worker=1))
    await cluster.start()
    try:
        prefill, decode = (next(w for w in cluster.workers if w.role == role) for role in ("prefill", "decode"))
        vocab = 256  # byte tokens of the tiny model: any prompt is valid
        rng = random.Random(f"{seed}:{transport}:{layerwise}")
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # > 1: the KV is handed off
        samples = []
        for i in range(repeats + 1):
            request_id = f"overlap-{uuid.uuid4().hex[:8]}"
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            await decode.reserve(request_id, prompt_len, lease_s=300.0, wait_s=0.0, timeout_s=60.0,
                                 max_new_tokens=params.max_tokens)
            start = time.perf_counter()
            result = await prefill.prefill(request_id, prompt, params, decode.info.kv_target, None, 300.0)
            call_s = time.perf_counter() - start
            stats = await prefill.actor.stats.remote()  # the engine's EngineStats
            await decode.release(request_id)
            if i == 0:
                continue  # warm-up: first transfer opens the channel / connection
            samples.append({"call_s": call_s, "step_s": stats.recent_step_times_s[-1],
                            "transfer_s": result.transfer_s, "after_s": result.exposed_s,
                            "transfer_bytes": result.transfer_bytes,
                            "cached_tokens": result.num_cached_tokens})
        return samples
    finally:
        await cluster.stop()


def med(samples: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=4, help="timed prefills per configuration (after a warm-up)")
    p.add_argument("--transports", default="grpc,collective")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    ray.init(address="local", num_cpus=2, include_dashboard=False,  # every cluster below attaches to it
             log_to_driver=False)
    raw: dict[str, dict[str, list[dict]]] = {}
    try:
        for transport in args.transports.split(","):
            for layerwise in (False, True):
                mode = "layer-wise" if layerwise else "whole"
                print(f"{transport} {mode}: load average {load_average()}", flush=True)
                raw.setdefault(transport, {})[mode] = asyncio.run(
                    measure(transport, layerwise, args.prompt_len, args.repeats, args.seed))
    finally:
        ray.shutdown()

    rows, summary = [], {}
    for transport, modes in raw.items():
        whole, lw = modes["whole"], modes["layer-wise"]
        t_prefill = med(whole, "step_s")
        t_transfer = statistics.median(s["call_s"] - s["step_s"] for s in whole)
        t_layerwise = med(lw, "call_s")
        hidden = (t_prefill + t_transfer - t_layerwise) / t_transfer
        hidden_per_request = 1 - statistics.median(s["call_s"] - s["step_s"] for s in lw) / t_transfer
        hidden_after_compute = 1 - med(lw, "after_s") / med(whole, "after_s")
        summary[transport] = {"T_prefill_s": t_prefill, "T_transfer_alone_s": t_transfer,
                              "T_layerwise_s": t_layerwise, "hidden_fraction": hidden,
                              "hidden_fraction_per_request": hidden_per_request,
                              "hidden_fraction_after_compute": hidden_after_compute,
                              "transfer_bytes": whole[0]["transfer_bytes"]}
        for mode, samples in modes.items():
            rows.append([transport, mode, 1000 * med(samples, "call_s"), 1000 * med(samples, "step_s"),
                         1000 * statistics.median(s["call_s"] - s["step_s"] for s in samples),
                         1000 * med(samples, "after_s"), 1000 * med(samples, "transfer_s"),
                         samples[0]["transfer_bytes"] / 2**20,
                         *((hidden, hidden_per_request, hidden_after_compute) if mode == "layer-wise"
                           else ("", "", ""))])
    print(format_table(["transport", "mode", "T_call", "T_step", "exposed", "after", "transfer_s", "MiB", "hidden",
                        "hidden/req", "hidden/after"], rows))
    print(f"(ms, medians of {args.repeats}; {args.prompt_len}-token prompt; hidden = (T_prefill + "
          f"T_transfer_alone - T_layerwise) / T_transfer_alone across runs, hidden/req = 1 - exposed(layer-wise) "
          f"/ exposed(whole), hidden/after = 1 - after(layer-wise) / after(whole)); load average now "
          f"{load_average()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "samples": raw},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
