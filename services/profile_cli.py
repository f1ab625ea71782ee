"""``tidepool profile``: measure a running deployment and write the cost profile ``tidepool simulate
--profile`` reads (router/profile.py defines it).

The gateway's ``GET /v1/cluster/profile`` returns what the cluster measured: the workers' start-up
profiles, the engine steps they ran since (each prefill step's chunks and duration, each decode step's
batch, context and duration) and the KV hand-offs between each pair of workers. With ``--calibrate`` the
command first drives a short load through the OpenAI API — prompts of several lengths, each followed by
prompts sharing most of it (prefix-cache hits), a few at a time (batched decode steps) — so a cluster that
has served little is measured over the shapes the fits need.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys

import httpx
import numpy as np

from engine.config import EngineConfig
from router.profile import Profile, fit_profile

PROFILE_PATH = "/v1/cluster/profile"
_TOKEN_IDS = range(10, 250)  # calibration prompts: ids every tokenizer has (byte-level ones included)


class ProfileError(RuntimeError):
    """The gateway could not be measured; the message is the whole story (no traceback)."""


async def _call(client: httpx.AsyncClient, method: str, path: str, body: dict | None = None) -> dict:
    try:
        response = await client.request(method, path, json=body)
    except httpx.ConnectError as e:
        raise ProfileError(f"cannot connect to {client.base_url} ({str(e) or 'connection refused'}); "
                           "is `tidepool serve` running there?") from None
    except httpx.TimeoutException:
        raise ProfileError(f"{method} {path} did not answer in time") from None
    except httpx.HTTPError as e:
        raise ProfileError(f"{method} {path}: {e}") from None
    if response.status_code == 401:
        raise ProfileError(f"{path}: HTTP 401; pass --api-key or set TIDEPOOL_API_KEY")
    if response.status_code != 200:
        raise ProfileError(f"{method} {path}: HTTP {response.status_code} {response.text[:200]!r}")
    return response.json()


def calibration_prompts(lengths: list[int], repeats: int, seed: int = 0) -> list[list[list[int]]]:
    """Groups of token-id prompts: per length, a fresh prompt, then ``repeats`` sharing its first 3/4."""
    rng = random.Random(seed)
    groups = []
    for n in lengths:
        base = [rng.choice(_TOKEN_IDS) for _ in range(n)]
        keep = 3 * n // 4
        groups.append([base] + [base[:keep] + [rng.choice(_TOKEN_IDS) for _ in range(n - keep)]
                                for _ in range(repeats)])
    return groups


async def calibrate(client: httpx.AsyncClient, model: str, groups: list[list[list[int]]], max_tokens: int) -> int:
    """Send each group's first prompt alone (so the rest find its prefix cached), then the rest at once."""
    sent = 0

    async def complete(prompt: list[int]) -> None:
        await _call(client, "POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0.0, "ignore_eos": True})

    for first, *rest in groups:
        await complete(first)
        await asyncio.gather(*(complete(p) for p in rest))
        sent += 1 + len(rest)
    return sent


async def measure(args: argparse.Namespace) -> tuple[dict, int]:
    """(the cluster's measured samples, calibration requests sent)."""
    api_key = args.api_key or os.environ.get("TIDEPOOL_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), headers=headers, timeout=args.timeout_s) as client:
        sent = 0
        if args.calibrate:
            card = (await _call(client, "GET", "/v1/models"))["data"][0]
            room = int(card.get("max_model_len") or 2048) - args.max_tokens - 1
            lengths = sorted({min(n, room) for n in args.lengths if n > 0})
            sent = await calibrate(client, card["id"], calibration_prompts(lengths, args.repeats), args.max_tokens)
        return await _call(client, "GET", PROFILE_PATH), sent


def _fit_error(profile: Profile, samples: dict) -> float:
    """Median relative error of the fitted prefill model on the measured prefill steps (nan: none)."""
    rows = np.array(samples["prefill_steps"], dtype=float).reshape(-1, 4)
    if not len(rows):
        return float("nan")
    return float(np.median(np.abs(rows[:, :3] @ profile.prefill.coef / rows[:, 3] - 1.0)))


def run_profile(args: argparse.Namespace) -> int:
    try:
        samples, sent = asyncio.run(measure(args))
        profile = fit_profile(samples, args.name or f"measured-{samples.get('model', 'cluster')}", args.max_batch)
        profile.save(args.out)
    except (ProfileError, ValueError, OSError) as e:
        print(f"tidepool profile: {e}", file=sys.stderr)
        return 1
    p, d, link = profile.prefill, profile.decode, profile.peer_link
    print(f"{args.out}: profile {profile.name!r} from the workers' start-up profiles and "
          f"{len(samples['prefill_steps'])} measured prefill steps, {len(samples['decode_steps'])} decode steps, "
          f"{len(samples['transfers'])} KV transfers" + (f" ({sent} calibration requests)" if args.calibrate else ""))
    print(f"  prefill: {p.per_token_s * 1e6:.1f} us/token + {p.per_pair_s * 1e9:.3f} ns/attention pair + "
          f"{p.fixed_s * 1e3:.1f} ms (median error on the measured steps {100 * _fit_error(profile, samples):.0f}%)")
    print(f"  decode step: {d.fixed_s * 1e3:.1f} ms + {d.per_seq_s * 1e3:.2f} ms/sequence + "
          f"{d.per_context_token_s * 1e6:.2f} us/context token")
    print(f"  peer link: {link.bandwidth_Bps / 1e9:.2f} GB/s, {link.latency_s * 1e3:.1f} ms latency")
    return 0


DESCRIPTION = ("Measure a running cluster (its gateway's GET /v1/cluster/profile, optionally after a short "
               "calibration load through the OpenAI API) and write the cost profile that "
               "`tidepool simulate --profile` reads.")


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure a running cluster into a profile for `tidepool simulate`",
                              description=DESCRIPTION)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's HTTP address")
    p.add_argument("--api-key", default=None, help="bearer key (default: $TIDEPOOL_API_KEY)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--name", default=None, help="the profile's name (default: measured-<model>)")
    p.add_argument("--calibrate", action="store_true",
                   help="first send prompts of --lengths, each followed by --repeats sharing most of it")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default="64,256,1024",
                   help="calibration prompt lengths in tokens, comma-separated (capped by the model's context)")
    p.add_argument("--repeats", type=int, default=3, help="calibration prompts sharing each length's prefix")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each calibration request generates")
    p.add_argument("--max-batch", type=int, default=EngineConfig.max_num_seqs,
                   help="the profile's decode batch limit (the engine's --max-num-seqs)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="seconds to wait for each answer")
    p.set_defaults(func=run_profile)
    return p
