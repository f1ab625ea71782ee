"""Host-side helpers shared by the kernel launchers (no jitted code lives here, so reloading a kernel
module under ``TRITON_INTERPRET=1`` never depends on another module's decoration)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import torch

QUANTIZED_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)  # codes the attention kernels dequantize


class ExpertQuant(NamedTuple):
    """What a mixture of experts' quantized matrices come with. The float32 scales ``gate_up``
    ``[E, 2I, ceil(H / gate_up_k_block)]`` and ``down`` ``[E, H, ceil(I / down_k_block)]``, one per output
    row and k-block of input columns. fp8 codes (``engine/weight_quant.py``) have no zeros; integer ones
    (``engine/int_weights.py``: the k-block is the group; ``bits`` 4, two codes a byte, or 8) have uint8 zeros
    shaped as their scales, and with act-order each expert's input orders (int64 ``[E, H]`` and ``[E, I]``):
    its columns sorted into group order at load, its input gathered to match. ``int8_activations`` (W8A8,
    ``engine/w8a8.py``): int8 values ``[E, N, K]`` with a scale a row ``[E, N, 1]`` and no zeros, each row of
    a matrix's input quantized to int8 as it runs."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_k_block: int
    down_k_block: int
    gate_up_zero: torch.Tensor | None = None
    down_zero: torch.Tensor | None = None
    gate_up_perm: torch.Tensor | None = None
    down_perm: torch.Tensor | None = None
    bits: int = 8  # the codes' width: fp8's 8, integer codes' 4 or 8
    int8_activations: bool = False


def interpreting() -> bool:
    """True when ``@triton.jit`` builds interpreter functions (CPU emulation) instead of GPU kernels."""
    try:
        from triton import knobs
        return bool(knobs.runtime.interpret)
    except ImportError:  # triton < 3.4 has no knobs module; it reads the environment directly
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def upcast(dtype: torch.dtype) -> bool:
    """Whether a kernel should compute on fp32 copies of its tiles.

    The interpreter emulates bfloat16 arithmetic wrongly (a bf16 ``a + b`` or ``tl.dot`` comes back as
    garbage) while its conversions are exact, so bf16 tiles are upcast there. On a GPU every dtype keeps
    its native tensor-core path."""
    return interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 caches get exact dots: Triton's default tf32 would cost ~1e-3 relative error in the scores.
    For fp16/bf16 operands the setting has no effect ("tf32" is Triton's own default)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def default_tile(dtype: torch.dtype, head_dim: int) -> int:
    """Key (and query) tile length: 64 for 16-bit caches; 32 for fp32, whose pipelined K/V tiles at
    head_dim 128 would otherwise outgrow an SM's shared memory; half that past head_dim 128 (Gemma 3's
    256), whose 64-token tiles need 160 KiB of it (more than sm_86 gives a block) and spill registers."""
    tile = 32 if dtype == torch.float32 else 64
    return tile // 2 if head_dim > 128 else tile


def tile_size(name: str, n: int | None, dtype: torch.dtype, head_dim: int) -> int:
    """A kernel's tile: ``n``, or ``default_tile(dtype, head_dim)`` when None. Tiles are powers of two
    (``tl.arange``) and at least 16 (the smallest ``tl.dot`` side on GPUs)."""
    n = n or default_tile(dtype, head_dim)
    if n < 16 or n & (n - 1):
        raise ValueError(f"{name}={n} must be a power of two >= 16")
    return n


def score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """The attention kernels' (``scale_log2``, ``softcap_log2``): the softmax scale in base 2 (``exp2``), or
    with a soft-cap (> 0: each score becomes ``cap * tanh(score / cap)``, Gemma 2's) the scale over the cap,
    then the cap in base 2."""
    log2e = math.log2(math.e)
    return (scale / softcap, softcap * log2e) if softcap else (scale * log2e, 0.0)


def dtype_flags(dtype: torch.dtype) -> dict[str, bool | str]:
    """The attention kernels' dtype-dependent constexprs: ``UPCAST`` (``upcast``) and ``PREC``
    (``dot_precision``)."""
    return {"UPCAST": upcast(dtype), "PREC": dot_precision(dtype)}


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def slice_k(span: int, k: int, dtype: torch.dtype) -> int:
    """The K slice of one iteration of a quantized-weight matmul: at most 128 (32 for fp32), dividing the
    columns one scale covers (``span``: an fp8 k-block, an integer codes' group; a multiple of 16) unless one covers
    the row."""
    widest = 32 if dtype == torch.float32 else 128
    if span >= k:
        return widest
    return min(widest, span & -span)  # the largest power of two dividing span


def weight_matmul_launch(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], dict]:
    """What the quantized-weight matmul launchers (fp8, integer) share for ``x`` ``[M, K]`` times a weight ``[N, K]``:
    x with contiguous rows, the output ``[M, N]`` in x's dtype, the grid of ``BLOCK_M x BLOCK_N`` output tiles
    and the launch options (a decode batch's narrower tiles: more programs streaming the weight; 8 warps for
    large fp32 tiles, which spill at 4; the dtype flags)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    block_m = min(64, max(16, next_power_of_2(m)))
    block_n = 64 if m > 16 else 32
    options = {"BLOCK_M": block_m, "BLOCK_N": block_n, **dtype_flags(x.dtype),
               "num_warps": 8 if x.dtype == torch.float32 and block_m * block_n > 1024 else 4}
    grid = (-(-m // block_m), -(-n // block_n))
    return x, torch.empty(m, n, dtype=x.dtype, device=x.device), grid, options


@cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def fp8_codes_as_bytes(device: torch.device) -> bool:
    """Whether fp8 e4m3 codes go into the attention kernels as bytes (``QUANT`` 3): on GPUs before sm_89,
    where Triton has no e4m3 type. From sm_89 on (and in the interpreter) they are converted natively,
    one instruction per two codes against the bytes' four integer ops per code."""
    return device.type == "cuda" and _capability(device) < (8, 9)


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate one layer's K and V caches, each ``[num_blocks, block_size, kv_heads, head_dim]`` (any
    strides, head_dim contiguous); returns that shape."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         "[num_blocks, block_size, kv_heads, head_dim]")
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError("k_cache and v_cache must share dtype and device")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of the caches must be contiguous")
    nb, bs, hkv, d = k_cache.shape
    return nb, bs, hkv, d


@dataclass(frozen=True)
class QuantizedKV:
    """The rest of one layer of a quantized cache whose codes the attention kernels get as
    ``k_cache``/``v_cache``: int8 or fp8 codes ``[num_blocks, block_size, kv_heads, head_dim]``, or kivi2's
    packed 2-bit codes (uint8, four a byte: ``head_dim / 4`` wide), which come with zero points.

    Scales (and zero points) are fp16 ``[num_blocks, block_size, kv_heads, groups]``, each group covering
    ``head_dim / groups`` consecutive channels: one group per token and head (int8), the same for every
    token of a block (fp8, a token stride of 0), per channel (kivi2 keys, a token stride of 0) or per
    token and channel group (kivi2 values). A windowed format adds the windows, ``[slots, block_size,
    kv_heads, head_dim]`` in the attention dtype, and ``window_slot`` ``[num_blocks]`` (each block's window
    slot, -1: read its record)."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_zero: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    k_window: torch.Tensor | None = None
    v_window: torch.Tensor | None = None
    window_slot: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        """kivi2: 2-bit codes, four a byte, and zero points."""
        return self.k_zero is not None


def _cache_operands(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    quant: QuantizedKV | None) -> tuple[tuple, dict[str, int | bool | str]]:
    """What both attention kernels take besides q and their own arguments: the ``K, V`` codes, the ``KS,
    VS, KZ, VZ, KW, VW, SlotOf`` pointers and ``stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst,
    stride_vsh, stride_wb, stride_wt, stride_wh``, then the constexprs: ``dtype_flags`` of q's dtype,
    ``QUANT`` (0: none, 1: int8 or fp8, 2: kivi2, 3: fp8 as bytes, ``fp8_codes_as_bytes``), ``K_GROUP``,
    ``V_GROUP`` and ``WINDOWED``. ``q`` stands in for every pointer a cache has no use for (never read)."""
    dtype = dtype_flags(q.dtype)
    if quant is None:
        return (k_cache, v_cache) + (q,) * 7 + (0,) * 9, {**dtype, "QUANT": 0, "K_GROUP": 1, "V_GROUP": 1,
                                                            "WINDOWED": False}
    kind = 2 if quant.packed else 1
    if k_cache.dtype == torch.float8_e4m3fn and fp8_codes_as_bytes(k_cache.device):
        kind, k_cache, v_cache = 3, k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    ks, vs, kw = quant.k_scale, quant.v_scale, quant.k_window
    windowed = kw is not None
    kz, vz = (quant.k_zero, quant.v_zero) if quant.packed else (q, q)
    kw, vw, slot = (kw, quant.v_window, quant.window_slot) if windowed else (q, q, q)
    wstrides = (kw.stride(0), kw.stride(1), kw.stride(2)) if windowed else (0, 0, 0)
    head_dim = q.shape[2]
    return ((k_cache, v_cache, ks, vs, kz, vz, kw, vw, slot, *ks.stride()[:3], *vs.stride()[:3], *wstrides),
            {**dtype, "QUANT": kind, "K_GROUP": head_dim // ks.shape[3], "V_GROUP": head_dim // vs.shape[3],
             "WINDOWED": windowed})


def _check_quantized(q: torch.Tensor, k_cache: torch.Tensor, quant: QuantizedKV) -> None:
    nb, bs, hkv, width = k_cache.shape
    head_dim = q.shape[2]
    codes = (torch.uint8,) if quant.packed else QUANTIZED_CODE_DTYPES
    if k_cache.dtype not in codes:
        raise ValueError(f"quantized codes must be {' or '.join(map(str, codes))}, got {k_cache.dtype}")
    if width != (head_dim // 4 if quant.packed else head_dim):
        raise ValueError(f"codes {tuple(k_cache.shape)} do not hold head_dim {head_dim}")
    named = [("k_scale", quant.k_scale), ("v_scale", quant.v_scale)]
    if quant.packed:
        named += [("k_zero", quant.k_zero), ("v_zero", quant.v_zero)]
    for name, t in named:
        if (t is None or t.dim() != 4 or t.shape[:3] != (nb, bs, hkv) or head_dim % t.shape[3]
                or t.dtype != torch.float16 or (t.shape[3] > 1 and t.stride(3) != 1)):
            raise ValueError(f"{name} must be float16 [{nb}, {bs}, {hkv}, groups] with groups dividing "
                             f"head_dim {head_dim} and contiguous")
    if quant.packed and (quant.k_zero.stride() != quant.k_scale.stride()
                         or quant.v_zero.stride() != quant.v_scale.stride()):
        raise ValueError("zero points must be laid out like their scales")
    if quant.k_window is None:
        return
    kw, vw, slot = quant.k_window, quant.v_window, quant.window_slot
    if vw is None or slot is None:
        raise ValueError("a windowed cache needs k_window, v_window and window_slot")
    if kw.shape != vw.shape or kw.stride() != vw.stride() or kw.shape[1:] != (bs, hkv, head_dim):
        raise ValueError(f"windows {tuple(kw.shape)} / {tuple(vw.shape)} must share shape and strides "
                         f"[slots, {bs}, {hkv}, {head_dim}]")
    if kw.dtype != q.dtype or kw.stride(-1) != 1:
        raise ValueError(f"windows must be in the attention dtype {q.dtype} with a contiguous head_dim")
    if slot.shape != (nb,):
        raise ValueError(f"window_slot {tuple(slot.shape)} must be [{nb}]")


class AttentionInputs(NamedTuple):
    block_size: int
    kv_heads: int
    head_dim: int
    out: torch.Tensor
    operands: tuple  # _cache_operands'
    constexprs: dict[str, int | bool | str]
    options: dict[str, int]  # launch options (``launch_options``)


def launch_options(dtype: torch.dtype, quant: QuantizedKV | None, head_dim: int) -> dict[str, int]:
    """Warps and pipeline stages of an attention launch, from the compiled kernels' resources on sm_90
    (``tests/kernel_compile.py``, head_dim 128, 64-token key tiles):

    * 8 warps where a tile is dequantized (int8, fp8, kivi2) or scored in float32: at 4 warps decode holds
      236-255 registers a thread and fp8, kivi2 and fp32 split-K spill 88-400 B of them to local memory;
      8 halve each thread's share of the tile (128-214 registers, no spills). 16-bit caches keep 4 (101
      registers in decode), but for head_dims past 128 (Gemma 3's 256), whose rows take 8 as well.
    * kivi2 in one stage: its tiles come from three loads per element (codes, scales, zero points), whose
      staged copies in a software-pipelined key loop need ~100 KiB of shared memory, more than an
      sm_86/sm_89 GPU gives one block (99 KiB); one stage needs ~37 KiB."""
    options = {"num_warps": 8} if quant is not None or dtype == torch.float32 or head_dim > 128 else {}
    if quant is not None and quant.packed:
        options["num_stages"] = 1
    return options


def attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     out: torch.Tensor | None, quant: QuantizedKV | None = None) -> AttentionInputs:
    """The checks both paged attention launchers make, and what they launch with: one layer's caches
    (``check_paged_cache``), ``q`` ``[tokens, num_q_heads, head_dim]`` in their dtype (or, with
    ``quant``, codes and scales that fit) with whole kv-head groups, ``block_tables`` 2-D, and contiguous
    head_dims and table rows. ``out`` is allocated like ``q`` when None (a given one must be shaped like
    ``q``); operands and constexprs are ``_cache_operands``', options ``launch_options``'."""
    _, block_size, kv_heads, width = check_paged_cache(k_cache, v_cache)
    if q.dim() != 3 or q.shape[1] % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} must be [tokens, heads, head_dim] with heads a multiple of "
                         f"kv_heads={kv_heads}")
    head_dim = q.shape[2]
    if quant is not None:
        _check_quantized(q, k_cache, quant)  # the codes' dtype and width, scales, zero points, windows
    elif width != head_dim or q.dtype != k_cache.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit the cache's head_dim {width} and dtype "
                         f"{k_cache.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must be [batch, max_blocks]")
    if q.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q's head_dim and block_tables' last axis must be contiguous")
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be shaped like q with a contiguous head_dim")
    return AttentionInputs(block_size, kv_heads, head_dim, out,
                           *_cache_operands(q, k_cache, v_cache, quant), launch_options(q.dtype, quant, head_dim))
