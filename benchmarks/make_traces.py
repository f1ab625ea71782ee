"""Prefill-bound Mooncake-format traces, generated deterministically from a seed (DESIGN.md section 3:
``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``, one id per 512-token block,
equal ids = equal prefix content). The generator is committed, not the traces.

Two kinds, both with long prompts, short answers and heavy prefix reuse:

* ``docqa``: questions about shared documents (or long system prompts). A document's popularity is Zipf
  over the documents; the arrival rate alternates calm and bursts, and a burst brings a fresh document
  that many users ask about at once (a trending item), so its first requests arrive while it is still
  being prefilled for the first time.
* ``agent``: agent sessions. Each starts with one of a few shared tool/system prompts (Zipf) and appends
  a tool result and the model's answer every step, a few seconds apart, so each step's prompt is the
  previous step's prompt plus a few thousand new tokens. Session starts come in bursts.

Run from the repository root:
    python -m benchmarks.make_traces --kind docqa --seed 0 --out docqa.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from router.trace import TRACE_BLOCK_TOKENS as BLOCK


@dataclass(frozen=True)
class Spec:
    kind: str
    requests: int
    rate: float  # mean arrivals a second over calm and bursts, at the trace's own pace
    prefixes: int  # shared documents or system prompts
    zipf: float  # popularity exponent of the shared prefixes
    prefix_tokens: tuple[float, float, int, int]  # log-normal median, sigma, then clip to [min, max]
    suffix_tokens: tuple[float, float, int, int]  # the request's own part (question / one step's new tokens)
    output_tokens: tuple[float, float, int, int]
    burst_every_s: float = 60.0  # mean calm spell between two bursts
    burst_s: float = 10.0  # how long a burst lasts
    burst_factor: float = 4.0  # arrival rate in a burst over the calm rate
    trending_share: float = 0.5  # docqa: share of a burst's requests that ask about its fresh document
    steps: tuple[int, int] = (3, 16)  # agent: steps of one session
    step_gap_s: tuple[float, float] = (4.0, 0.5)  # agent: log-normal median and sigma between steps


KINDS = {
    "docqa": Spec("docqa", requests=6000, rate=4.0, prefixes=400, zipf=1.1, prefix_tokens=(12_000, 0.6, 2048, 49_152),
                  suffix_tokens=(300, 0.8, 32, 2000), output_tokens=(120, 0.7, 8, 600)),
    "agent": Spec("agent", requests=6000, rate=4.0, prefixes=24, zipf=1.0, prefix_tokens=(4000, 0.4, 1024, 8192),
                  suffix_tokens=(1500, 0.8, 200, 8000), output_tokens=(150, 0.6, 16, 800)),
}


def _lognormal(rng: np.random.Generator, spec: tuple[float, float, int, int], size: int | None = None):
    median, sigma, lo, hi = spec
    return np.clip(np.rint(median * rng.lognormal(0.0, sigma, size)), lo, hi).astype(int)


def _zipf_weights(n: int, a: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** a
    return w / w.sum()


def _arrivals(spec: Spec, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n arrival times of a Poisson process whose rate switches between calm and bursts (mean rate
    spec.rate), by thinning a process at the burst rate; and the burst each falls in (-1: calm)."""
    burst_share = spec.burst_s / (spec.burst_s + spec.burst_every_s)
    peak = spec.burst_factor * spec.rate / (1 - burst_share + burst_share * spec.burst_factor)
    times, bursts, t, k = [], [], 0.0, 0
    burst_start = rng.exponential(spec.burst_every_s)
    while len(times) < n:
        t += rng.exponential(1.0 / peak)
        while t >= burst_start + spec.burst_s:  # past burst k: the next one starts after a calm spell
            burst_start += spec.burst_s + rng.exponential(spec.burst_every_s)
            k += 1
        in_burst = t >= burst_start
        if in_burst or rng.random() < 1.0 / spec.burst_factor:
            times.append(t)
            bursts.append(k if in_burst else -1)
    return np.array(times), np.array(bursts)


class _Ids:
    """Fresh hash ids: equal ids only where content is shared."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _row(t: float, blocks: list[int], tail_tokens: int, out: int, ids: _Ids) -> dict:
    """A request whose prompt is ``blocks`` (whole shared blocks) plus ``tail_tokens`` of its own."""
    tail = ids.take(-(-tail_tokens // BLOCK))
    return {"timestamp": int(round(t * 1000)), "input_length": len(blocks) * BLOCK + tail_tokens,
            "output_length": int(out), "hash_ids": blocks + tail}


def docqa(spec: Spec, rng: np.random.Generator) -> Iterator[dict]:
    ids = _Ids()
    weights = _zipf_weights(spec.prefixes, spec.zipf)
    docs = [ids.take(int(n) // BLOCK) for n in _lognormal(rng, spec.prefix_tokens, spec.prefixes)]
    trending: dict[int, list[int]] = {}
    times, bursts = _arrivals(spec, rng, spec.requests)
    for t, b in zip(times, bursts, strict=True):
        if b >= 0 and rng.random() < spec.trending_share:
            if b not in trending:
                trending[b] = ids.take(int(_lognormal(rng, spec.prefix_tokens)) // BLOCK)
            doc = trending[b]
        else:
            doc = docs[rng.choice(spec.prefixes, p=weights)]
        yield _row(t, doc, int(_lognormal(rng, spec.suffix_tokens)), int(_lognormal(rng, spec.output_tokens)), ids)


def agent(spec: Spec, rng: np.random.Generator) -> Iterator[dict]:
    ids = _Ids()
    weights = _zipf_weights(spec.prefixes, spec.zipf)
    prompts = [ids.take(int(n) // BLOCK) for n in _lognormal(rng, spec.prefix_tokens, spec.prefixes)]
    mean_steps = (spec.steps[0] + spec.steps[1]) / 2
    # Session starts at rate/mean_steps; each session then issues its steps a few seconds apart. Twice the
    # sessions needed on average, so the first ``requests`` steps in time are all there.
    starts, _ = _arrivals(replace(spec, rate=spec.rate / mean_steps), rng, int(2 * spec.requests / mean_steps) + 8)
    rows = []
    for start in starts:
        context = list(prompts[rng.choice(spec.prefixes, p=weights)])
        t = start
        for _ in range(rng.integers(spec.steps[0], spec.steps[1] + 1)):
            new, out = int(_lognormal(rng, spec.suffix_tokens)), int(_lognormal(rng, spec.output_tokens))
            rows.append(_row(t, context, new, out, ids))
            # The next step's prompt holds this one's (tool result + answer) as whole shared blocks.
            context = context + rows[-1]["hash_ids"][len(context):] + ids.take(out // BLOCK)
            t += float(rng.lognormal(np.log(spec.step_gap_s[0]), spec.step_gap_s[1]))
    rows.sort(key=lambda r: r["timestamp"])
    yield from rows[: spec.requests]


def generate(kind: str, seed: int = 0, requests: int | None = None, rate: float | None = None) -> list[dict]:
    """The rows of a ``kind`` trace; the same arguments give the same rows."""
    if kind not in KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; known: {', '.join(KINDS)}")
    spec = replace(KINDS[kind], **{k: v for k, v in (("requests", requests), ("rate", rate)) if v is not None})
    rows = list((docqa if kind == "docqa" else agent)(spec, np.random.default_rng(seed)))
    t0 = rows[0]["timestamp"]
    return [{**r, "timestamp": r["timestamp"] - t0} for r in rows]


def reuse_share(rows: list[dict]) -> float:
    """Share of prompt blocks already seen in an earlier request's prefix: the cache hit rate of an
    infinite cache shared by every worker (the ceiling any router can reach)."""
    seen: set[int] = set()
    hit = total = 0
    for r in rows:
        ids = r["hash_ids"]
        n = next((i for i, h in enumerate(ids) if h not in seen), len(ids))
        hit, total = hit + n, total + len(ids)
        seen.update(ids)
    return hit / max(total, 1)


def write(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def describe(rows: list[dict], kind: str) -> str:
    inputs = np.array([r["input_length"] for r in rows])
    return (f"{len(rows)} {kind} requests over {rows[-1]['timestamp'] / 1000:.0f} s, input tokens mean "
            f"{inputs.mean():.0f} / max {inputs.max()}, output mean {np.mean([r['output_length'] for r in rows]):.0f}, "
            f"reusable prompt blocks {100 * reuse_share(rows):.1f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", required=True, choices=list(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=None, help="requests to generate (default: the kind's)")
    ap.add_argument("--rate", type=float, default=None, help="mean requests/s at the trace's own pace")
    ap.add_argument("--out", required=True, help="JSONL file to write")
    args = ap.parse_args(argv)
    rows = generate(args.kind, args.seed, args.requests, args.rate)
    write(rows, args.out)
    print(f"{args.out}: {describe(rows, args.kind)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
