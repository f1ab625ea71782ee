"""Quantize and dequantize K/V blocks to and from the records of ``engine/kv_format.py``.

Records are rows of bytes (``[..., record_bytes]`` uint8); each field is read and written through a typed
view of its byte range, so nothing is copied to reach it. All math runs in float32; dequantized values are
written into the caller's buffer in the attention dtype. Every scale is rounded to fp16 before the codes
are computed, so codes and stored scale agree, and a zero scale (an all-zero group) is stored as 1.
"""

from __future__ import annotations

import torch

from engine.kv_format import Field, RecordLayout

TORCH_DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "float8_e4m3fn": torch.float8_e4m3fn,
                "float16": torch.float16}
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8 e4m3fn
FP16_MAX = 65504.0
TWO_BIT_MAX = 3.0


def field_view(records: torch.Tensor, f: Field) -> torch.Tensor:
    """Typed view ``[..., *f.shape]`` of field ``f`` in records ``[..., record_bytes]`` (no copy)."""
    return records[..., f.offset:f.offset + f.nbytes].view(TORCH_DTYPES[f.dtype]).unflatten(-1, f.shape)


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    s = scale.clamp(max=FP16_MAX).to(torch.float16)
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: (codes ``x.shape`` int8, fp16 scales ``x.shape[:-1]``)."""
    x = x.float()
    scale = _fp16_scale(x.abs().amax(-1) / INT8_MAX)
    codes = (x / scale.float()[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [n, B, H, D] -> (e4m3 codes, one fp16 scale per block and head ``[n, H]``)."""
    x = x.float()
    scale = _fp16_scale(x.abs().amax(dim=(1, 3)) / FP8_MAX)
    codes = (x / scale.float()[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def quantize_2bit(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 2-bit over ``dim``: (codes 0..3 uint8 ``x.shape``, fp16 scale, fp16 zero), the last two
    reduced over ``dim`` (kept as size 1). ``x ~ codes * scale + zero``; zero is the group's minimum."""
    x = x.float()
    zero = x.amin(dim, keepdim=True).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    scale = _fp16_scale((x.amax(dim, keepdim=True) - zero.float()) / TWO_BIT_MAX)
    codes = ((x - zero.float()) / scale.float()).round_().clamp_(0, TWO_BIT_MAX).to(torch.uint8)
    return codes, scale, zero


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes 0..3 -> [..., D / 4] bytes; code 4j + i sits at bits 2i of byte j."""
    c = codes.unflatten(-1, (-1, 4))
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


_TABLES: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _table(name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each byte's value(s): one e4m3 value ("fp8", [256]) or four 2-bit codes ("2bit", [256, 4])."""
    key = (name, dtype, device)
    if key not in _TABLES:
        byte = torch.arange(256, dtype=torch.uint8)
        table = (byte.view(torch.float8_e4m3fn).float() if name == "fp8"
                 else (byte.long()[:, None] >> torch.tensor([0, 2, 4, 6])) & 3)
        _TABLES[key] = table.to(device, dtype)
    return _TABLES[key]


def _lookup(name: str, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode code bytes straight into contiguous ``out`` by table lookup: on CPU several times faster than
    torch's float8 cast or shift-and-mask unpacking."""
    table = _table(name, out.dtype, out.device)
    index = codes.view(torch.uint8).int().reshape(-1)
    return torch.index_select(table, 0, index, out=out.view(-1, *table.shape[1:])).view(out.shape)


def _encode_one(layout: RecordLayout, kind: str, x: torch.Tensor, records: torch.Tensor) -> None:
    """Quantize ``x`` [n, B, H, D] (K when ``kind`` is "k", else V) into the fields of ``records`` [n, R]."""
    def put(name: str, value: torch.Tensor) -> None:
        field_view(records, layout.field(f"{kind}_{name}")).copy_(value)

    if layout.kv_format == "int8":
        codes, scale = quantize_int8(x)
        put("codes", codes)
        put("scale", scale)
    elif layout.kv_format == "fp8":
        codes, scale = quantize_fp8(x)
        put("codes", codes)
        put("scale", scale)
    elif kind == "k":  # kivi2 keys: per channel, over the block's tokens
        codes, scale, zero = quantize_2bit(x, dim=1)
        put("codes", pack_2bit(codes))
        put("scale", scale.squeeze(1))
        put("zero", zero.squeeze(1))
    else:  # kivi2 values: per token, in groups of channels
        codes, scale, zero = quantize_2bit(x.unflatten(-1, (-1, layout.value_group)), dim=-1)
        put("codes", pack_2bit(codes.flatten(-2)))
        put("scale", scale.squeeze(-1))
        put("zero", zero.squeeze(-1))


def encode_blocks(layout: RecordLayout, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Whole blocks ``k``, ``v`` [n, B, H, D] -> records [n, record_bytes] uint8."""
    records = torch.zeros(k.shape[0], layout.record_bytes, dtype=torch.uint8, device=k.device)
    _encode_one(layout, "k", k, records)
    _encode_one(layout, "v", v, records)
    return records


def write_tokens(layout: RecordLayout, records: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    """int8 only (its scales are per token): quantize rows ``k``, ``v`` [T, H, D] into token ``offsets``
    of ``blocks`` of one layer's records [num_blocks, R]."""
    for kind, x in (("k", k), ("v", v)):
        codes, scale = quantize_int8(x)
        field_view(records, layout.field(f"{kind}_codes"))[blocks, offsets] = codes
        field_view(records, layout.field(f"{kind}_scale"))[blocks, offsets] = scale


def decode_into(layout: RecordLayout, records: torch.Tensor, kind: str, out: torch.Tensor) -> torch.Tensor:
    """Dequantize K (``kind`` "k") or V of records [n, R] into contiguous ``out`` [n, B, H, D] (any float
    dtype)."""
    def get(name: str) -> torch.Tensor:
        return field_view(records, layout.field(f"{kind}_{name}"))

    if layout.kv_format == "int8":
        out.copy_(get("codes")).mul_(get("scale")[..., None])
    elif layout.kv_format == "fp8":
        _lookup("fp8", get("codes"), out).mul_(get("scale")[:, None, :, None])
    elif kind == "k":
        _lookup("2bit", get("codes"), out).mul_(get("scale")[:, None]).add_(get("zero")[:, None])
    else:
        grouped = _lookup("2bit", get("codes"), out).unflatten(-1, (-1, layout.value_group))
        grouped.mul_(get("scale")[..., None]).add_(get("zero")[..., None])
    return out
