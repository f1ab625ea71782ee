"""Stable chained block hashes (DESIGN.md section 3).

``h[0] = H(salt || tokens[0:B])`` and ``h[i] = H(h[i-1] || tokens[iB:(i+1)B])``, 64-bit, over
little-endian int32 token bytes. The engine, the pool, the router and the load test all call this one
function, so a prefix hashes the same in every process and on every machine (never Python's ``hash()``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np


def salt_for(model_id: str, adapter_id: str | None = None, long_rope: bool = False,
             quantized_at_load: str | None = None, cache_salt: str | None = None) -> bytes:
    """The salt that namespaces hashes by model, by LoRA adapter (``engine/lora.py``), for a LongRoPE
    model by the factors its keys rotate with: a sequence longer than the original context rotates every
    position with the long ones (``engine.config.long_rope_applies``), so its blocks are not a short one's;
    by ``--quantization`` when it changed the weights as they loaded (their K/V is not the checkpoint's,
    so a pool or disk tier kept across a restart never mixes the two); and by a request's ``cache_salt``
    (vLLM's): only requests sending the same one share blocks, so another tenant can neither reuse a prompt's
    cached prefix nor learn from a cache hit's speed that someone sent it."""
    model = f"{model_id}#{quantized_at_load}" if quantized_at_load else model_id
    model = f"{model}#long-rope" if long_rope else model
    salt = (model if adapter_id is None else f"{model}+{adapter_id}").encode()
    # After a NUL and a digest of fixed length: no salt of another model or adapter spells the same bytes.
    return salt if cache_salt is None else salt + b"\0" + hashlib.sha256(cache_salt.encode()).digest()


def hash_block(parent: int | None, tokens: Sequence[int], salt: bytes) -> int:
    """Hash one full block given its parent's hash (``None`` for the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(salt if parent is None else struct.pack("<Q", parent))
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes, parent: int | None = None
) -> list[int]:
    """Chained hashes of every full block of ``token_ids``; a trailing partial block is not hashed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], salt)
        out.append(parent)
    return out
