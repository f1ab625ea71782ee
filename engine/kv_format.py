"""KV cache formats (``--kv-cache-dtype``): what one block of one layer holds, and its size in bytes.

* ``auto``  — K and V in the attention dtype, ``[block_size, kv_heads, head_dim]`` each (no quantization).
* ``int8``  — symmetric int8 codes with one fp16 scale per token and KV head.
* ``fp8``   — float8 e4m3 codes with one fp16 scale per block and KV head (amax / 448).
* ``kivi2`` — KIVI's asymmetric 2-bit scheme (Liu et al., 2024): keys per channel over the block's tokens
  (an fp16 scale and zero point per head and channel), values per token in groups of ``VALUE_GROUP``
  channels (an fp16 scale and zero point per group); four 2-bit codes a byte, packed along head_dim.

A quantized block of one layer is one record of bytes, K fields then V fields, each field 16-byte
aligned (``RecordLayout``). fp8 and kivi2 scales span the whole block, so the block a sequence is still
filling stays in the attention dtype (its *window*) until its last token is written, and is quantized
then; int8 quantizes each token as it is written. A windowed format may also keep the last
``residual_blocks`` full blocks of each sequence in windows (KIVI's full-precision residual): their
records are written when they fill, as every block's are, but attention reads the window until the
sequence has moved ``residual_blocks`` blocks past. Torch-free, so ``tidepool kv-calc`` stays instant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FORMATS = ("auto", "int8", "fp8", "kivi2")
WINDOWED = ("fp8", "kivi2")  # formats whose partial block stays in the attention dtype
# Default full blocks kept in the attention dtype behind the one being filled. kivi2's 2-bit codes cost
# most on the most recent tokens, where attention looks hardest (docs/BENCHMARKS.md measures the residual's
# effect); fp8's error is small enough without one.
RESIDUAL_BLOCKS = {"fp8": 0, "kivi2": 1}
RESIDUAL_HELP = ("fp8, kivi2: full blocks each sequence keeps in full precision behind the one it fills "
                 "(KIVI's residual; default: kivi2 1, fp8 0)")
VALUE_GROUP = 32  # kivi2: channels per value scale (KIVI's group size); else head_dim, if 32 doesn't divide it
ALIGN = 16
FIELD_DTYPE_BYTES = {"int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float16": 2}


@dataclass(frozen=True)
class Field:
    name: str  # "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"
    dtype: str  # a key of FIELD_DTYPE_BYTES
    shape: tuple[int, ...]  # per block
    offset: int  # bytes into the record

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * FIELD_DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one quantized block of one layer: ``fields`` at offsets, ``record_bytes`` in all."""

    kv_format: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    fields: tuple[Field, ...]
    record_bytes: int

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    @property
    def value_group(self) -> int:
        return value_group(self.head_dim)


def check_format(kv_format: str) -> str:
    if kv_format not in FORMATS:
        raise ValueError(f"unknown KV cache dtype {kv_format!r}; supported: {', '.join(FORMATS)}")
    return kv_format


def residual_blocks(kv_format: str, requested: int | None = None) -> int:
    """Full blocks each sequence keeps in windows behind the one it fills: ``requested``, or the format's
    default (0 for an unwindowed format); ValueError for a negative count, or any for an unwindowed format."""
    if check_format(kv_format) not in WINDOWED:
        if requested:
            raise ValueError(f"kv_residual_blocks applies to the windowed KV cache dtypes "
                             f"({', '.join(WINDOWED)}), not {kv_format!r}")
        return 0
    if requested is None:
        return RESIDUAL_BLOCKS[kv_format]
    if requested < 0:
        raise ValueError(f"kv_residual_blocks must be >= 0, got {requested}")
    return requested


def residual_start(num_tokens: int, block_size: int, residual: int) -> int:
    """First block index a sequence of ``num_tokens`` computed tokens keeps exact: the block the next token
    goes to and the ``residual`` full blocks before it. The window pool keeps windows from there on, and the
    prefix cache neither registers nor hands out those blocks."""
    return max(0, num_tokens // block_size - residual)


def value_group(head_dim: int) -> int:
    return VALUE_GROUP if head_dim % VALUE_GROUP == 0 else head_dim


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def record_layout(kv_format: str, block_size: int, num_kv_heads: int, head_dim: int) -> RecordLayout:
    """The record of a quantized format (``auto`` has none: its blocks are plain tensors)."""
    B, H, D = block_size, num_kv_heads, head_dim
    if check_format(kv_format) == "auto":
        raise ValueError("the auto format stores plain tensors, not records")
    if kv_format == "int8":
        per_kv = [("codes", "int8", (B, H, D)), ("scale", "float16", (B, H))]
        specs = [(f"{kv}_{n}", dt, s) for kv in "kv" for n, dt, s in per_kv]
    elif kv_format == "fp8":
        per_kv = [("codes", "float8_e4m3fn", (B, H, D)), ("scale", "float16", (H,))]
        specs = [(f"{kv}_{n}", dt, s) for kv in "kv" for n, dt, s in per_kv]
    else:
        if D % 4:
            raise ValueError(f"kivi2 packs four 2-bit codes a byte along head_dim; {D} is not divisible by 4")
        groups = D // value_group(D)
        specs = [("k_codes", "uint8", (B, H, D // 4)), ("k_scale", "float16", (H, D)),
                 ("k_zero", "float16", (H, D)), ("v_codes", "uint8", (B, H, D // 4)),
                 ("v_scale", "float16", (B, H, groups)), ("v_zero", "float16", (B, H, groups))]
    fields, offset = [], 0
    for name, dtype, shape in specs:
        f = Field(name, dtype, shape, offset)
        fields.append(f)
        offset = _align(offset + f.nbytes)
    return RecordLayout(kv_format, B, H, D, tuple(fields), offset)


def block_layer_bytes(kv_format: str, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype_bytes: int) -> int:
    """Bytes of K and V of one block in one layer, scales included."""
    if check_format(kv_format) == "auto":
        return 2 * block_size * num_kv_heads * head_dim * dtype_bytes
    return record_layout(kv_format, block_size, num_kv_heads, head_dim).record_bytes


def window_layer_bytes(kv_format: str, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int, residual: int = 0) -> int:
    """Bytes of one sequence's windows in one layer: the block it fills and ``residual`` full blocks, K and
    V in the attention dtype; 0 if unwindowed."""
    one = 2 * block_size * num_kv_heads * head_dim * dtype_bytes
    return (residual + 1) * one if kv_format in WINDOWED else 0
