"""Cost profiles: the measured (or derived) speeds and capacities of one kind of worker.

A profile is what live profiling writes (`Profile.save`) and what the simulator and the conductor's
estimator start from (`Profile.load`, or a named preset). The presets below are derived analytically
from hardware peaks and model shapes, with every assumption written next to its number.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from router.estimator import (
    DEFAULT_PEER_LINK,
    DEFAULT_POOL_LINK,
    DecodeModel,
    Estimator,
    Link,
    PrefillModel,
    TransferModel,
)


@dataclass
class Profile:
    name: str
    kv_bytes_per_token: int
    prefill: PrefillModel
    decode: DecodeModel
    peer_link: Link  # worker <-> worker (prefix fetch and the prefill -> decode KV hand-off)
    pool_link: Link  # worker <-> shared pool tier
    prefill_cache_tokens: int  # prefix cache of one prefill worker (host memory)
    decode_kv_tokens: int  # KV capacity of one decode worker
    decode_block_size: int = 16
    max_batch: int = 256
    pool_tokens: int = 0  # capacity of the shared pool tier; 0 = no pool tier
    layers: int = 1  # pieces the prefill -> decode KV hand-off streams in (1: sent after the prefill)
    notes: dict[str, str] = field(default_factory=dict)

    def estimator(self) -> Estimator:
        return Estimator(self.prefill, self.decode, TransferModel(self.peer_link, self.pool_link),
                         self.kv_bytes_per_token, layers=self.layers)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        parts = {"prefill": PrefillModel, "decode": DecodeModel, "peer_link": Link, "pool_link": Link}
        try:
            kwargs = {k: (parts[k](**v) if k in parts else v) for k, v in data.items()}
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"bad profile: {e}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from e
        return cls.from_dict(data)


def llama3_70b_a800() -> Profile:
    """Llama-3-70B on one 8 x A800-80GB instance (tensor parallel 8), the Mooncake paper's setting.

    Model: 80 layers, hidden 8192, 64 query heads, 8 KV heads, head_dim 128, 70.6 B parameters.
    KV per token = 2 x 80 layers x 8 heads x 128 x 2 bytes = 327,680 B (the paper's "320 KB").

    Prefill is compute bound. Dense FLOPs per token = 2 x 70.6e9 = 1.41e11. Causal attention does
    QK^T and AV for each (query, key) pair: 2 x 2 x 64 heads x 128 x 80 layers = 2.62e6 FLOPs a pair.
    8 A800s give 8 x 312 TFLOPS (bf16 dense) = 2.50 PFLOPS; at 45 % MFU (TP-8 all-reduces, attention
    kernels) that is 1.12 PFLOPS, so per_token = 1.41e11 / 1.12e15 = 1.26e-4 s (about 7,900 tokens/s
    without cache) and per_pair = 2.62e6 / 1.12e15 = 2.33e-9 s. An 8k prompt takes about 1.1 s and a
    128k one about 35 s (over the 30 s TTFT SLO without cache, which is why Mooncake adds chunked
    pipeline parallelism for such prompts). fixed = 20 ms of scheduling, launch and sampling.

    Decode is memory-bandwidth bound. 8 x 2.04 TB/s HBM at 70 % achieved = 11.4 TB/s. Each step reads
    the 141 GB of bf16 weights once (12.4 ms) plus about 8 ms of TP-8 all-reduces (160 per step),
    launches and sampling: fixed = 20 ms. Each context token's KV (327,680 B) is read once a step:
    per_context_token = 327,680 / 11.4e12 = 2.9e-8 s. Each sequence adds 1.41e11 FLOPs a step; the
    step really costs max(memory, compute) and the compute stays hidden below a batch of ~100, so a
    linear fit over the batches that occur (32-256) gets half the compute slope: per_seq = 6e-5 s.
    A full instance (100 sequences x 13k tokens) steps in about 64 ms, inside a 100 ms TBT SLO.

    Memory: 640 GB HBM - 141 GB weights - 64 GB activations and workspace = 435 GB of KV, i.e.
    1.33 M tokens a decode instance. Each prefill node keeps a prefix cache in host DRAM: 800 GB of it
    holds 2.44 M tokens. Links: 8 x 200 Gb/s RDMA NICs (200 GB/s), 100 GB/s achieved, 1 ms setup.
    The pool tier is off: in the paper the KV store is the instances' own DRAM, which the per-worker
    caches already model (peer fetch); `pool_tokens` adds a shared tier for what-if runs. The KV
    hand-off to the decode instance streams layer by layer (80 layers) while the prefill computes.
    """
    kv = 2 * 80 * 8 * 128 * 2
    eff_flops = 8 * 312e12 * 0.45
    hbm = 8 * 2.039e12 * 0.70
    return Profile(
        name="llama3-70b-a800",
        kv_bytes_per_token=kv,
        prefill=PrefillModel(per_pair_s=2.62e6 / eff_flops, per_token_s=2 * 70.6e9 / eff_flops, fixed_s=0.020),
        decode=DecodeModel(fixed_s=0.020, per_seq_s=6e-5, per_context_token_s=kv / hbm),
        peer_link=Link(bandwidth_Bps=100e9, latency_s=0.001),
        pool_link=Link(bandwidth_Bps=25e9, latency_s=0.002),
        prefill_cache_tokens=int(800e9 // kv),
        decode_kv_tokens=int(435e9 // kv),
        decode_block_size=16,
        max_batch=256,
        pool_tokens=0,
        layers=80,
        notes={"source": "derived from A800 peaks and Llama-3-70B shapes; see router/profile.py"},
    )


PRESETS = {"llama3-70b-a800": llama3_70b_a800}


def fit_profile(samples: dict, name: str, max_batch: int) -> Profile:
    """A profile fitted to what a running cluster measured: the body of ``GET /v1/cluster/profile``.

    ``samples`` holds ``kv_bytes_per_token``, ``block_size``, ``workers`` ([{"role", "total_blocks"}]),
    ``startup`` ({"prefill": [[new, cached, s]], "decode": [[batch, context, s]]}: the workers' start-up
    profiles), ``prefill_steps`` ([[attention pairs, new tokens, chunks, s]]: engine steps, each the sum of
    its chunks' features), ``decode_steps`` ([[batch, context, s]]) and ``transfers`` ([[src, dst, bytes,
    s]]: KV hand-offs). The pool link is not measured there: it keeps the estimator's default.
    """
    try:
        startup = samples["startup"]
        pre = [PrefillModel.features(n, c) for n, c, _ in startup["prefill"]] + [
            np.asarray(r[:3], dtype=float) for r in samples["prefill_steps"]]
        pre_s = [r[2] for r in startup["prefill"]] + [r[3] for r in samples["prefill_steps"]]
        dec = [tuple(r[:3]) for r in startup["decode"]] + [tuple(r[:3]) for r in samples["decode_steps"]]
        transfers = [(r[2], r[3]) for r in samples["transfers"]]
        block, kv = int(samples["block_size"]), int(samples["kv_bytes_per_token"])
        workers = samples["workers"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a cluster profile sample set: {e!r}") from e
    if not pre or not dec:
        raise ValueError("no prefill or no decode samples to fit")

    def tokens(roles: tuple[str, ...]) -> int:
        return min((int(w["total_blocks"]) * block for w in workers if w["role"] in roles), default=0)

    return Profile(
        name=name, kv_bytes_per_token=kv,
        prefill=PrefillModel.fit_rows(np.array(pre), np.array(pre_s)), decode=DecodeModel.fit(dec),
        peer_link=Link.fit(transfers, DEFAULT_PEER_LINK), pool_link=DEFAULT_POOL_LINK,
        prefill_cache_tokens=tokens(("prefill", "colocated")), decode_kv_tokens=tokens(("decode", "colocated")),
        decode_block_size=block, max_batch=max_batch,
        notes={"source": f"measured by tidepool profile: {len(pre)} prefill and {len(dec)} decode samples "
                         f"(start-up profiles and engine steps), {len(transfers)} KV transfers"},
    )


def resolve_profile(preset: str | None, profile_path: str | None) -> Profile:
    """The profile named by ``--preset`` or read from ``--profile`` (exactly one of them)."""
    if (preset is None) == (profile_path is None):
        raise ValueError("give exactly one of --preset and --profile")
    if profile_path is not None:
        return Profile.load(profile_path)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    return PRESETS[preset]()
