"""Integer weights: AWQ, GPTQ and compressed-tensors checkpoints (``quantization_config.quant_method``
``"awq"``, ``"gptq"``, or ``"compressed-tensors"`` with ``format: "pack-quantized"``), for the decoder's
projections (q/k/v, o, gate/up, down): W4A16, and GPTQ's and compressed-tensors' W8A16 (``IntQuant.bits``).

A projection ``[out, in]`` is held as ``weight`` uint8 ``[out, in / 2]`` with 4-bit codes (column 2j in the low
nibble of byte j, 2j + 1 in the high one) or ``[out, in]`` with 8-bit ones, ``weight_scale`` float32
``[out, groups]`` and ``weight_zero`` uint8 ``[out, groups]``: ``w[n, k] = (code - zero) * scale`` of k's group
of ``group_size`` columns. Every checkpoint layout is converted into that one as it loads (row by row, so q/k/v
and gate/up pack as 16-bit ones do). A checkpoint packs ``w = 32 / bits`` codes an int32 (8 or 4), code i of a
word in bits ``i * bits ..``:

* AWQ (AutoAWQ's GEMM version, 4-bit only): ``qweight`` int32 ``[in, out / 8]``, eight output columns a word,
  nibble i holding column ``AWQ_ORDER[i]`` of its eight; ``qzeros`` int32 ``[groups, out / 8]`` packed the
  same way; ``scales`` ``[groups, out]``.
* GPTQ: ``qweight`` int32 ``[in / w, out]``, w input rows a word in order; ``qzeros`` int32 ``[groups, out / w]``
  in order, each zero minus 1 in the original format (``IntQuant.zero_offset``); ``scales`` ``[groups, out]``;
  ``g_idx`` ``[in]``, each column's group: ``k // group_size``, or with ``desc_act`` (act-order) the groups of
  ``group_size`` columns each in the order GPTQ quantized them.
* compressed-tensors (llm-compressor, RedHat's w4a16 and w8a16 releases): ``weight_packed`` int32
  ``[out, in / w]``, w input columns a word in order, each code the signed value plus ``mid_code`` (8, or 128);
  ``weight_scale`` ``[out, groups]``; ``weight_shape`` ``[out, in]``; ``weight_zero_point`` int32
  ``[out / w, groups]`` (w rows a word, plus ``mid_code`` too) only when asymmetric: a symmetric checkpoint's
  zeros are all ``mid_code``; ``weight_g_idx`` ``[in]`` with ``actorder: group``, as GPTQ's. Its
  ``int-quantized`` format holds ``weight`` int8 ``[out, in]``, each the signed value (the code minus 128), and
  ``weight_zero_point`` int8 ``[out, groups]`` the same way. RedHat's w8a8 releases hold it symmetric with a
  scale a row beside int8 activations scaled a token: their projections and experts keep the int8 values as
  they are and run W8A8 (``engine/w8a8.py``); any other int-quantized checkpoint runs as here.

Act-order groups are put in place once a model has loaded (``sort_columns``): each projection's columns
sorted by group, and its input gathered the same way (``weight_input_perm``) before the matmul, as vLLM's GPTQ
kernels do. The projections packed into one matrix share their input, so q/k/v (and gate/up) must share
their g_idx, which GPTQ's order (from the input's statistics) gives them.

The matmul dequantizes and keeps the activations in ``--dtype``: the torch path into ``--dtype``
((code - zero) * scale in float32, then cast: transformers' AWQ and GPTQ modules compute the same product in
fp16, exactly, as every fp16 scale times an integer of at most 9 bits is), the Triton kernel
(``engine/kernels/int_gemm.py``) a tile at a time on the GPU, so a decode step reads half a byte (or one) a
weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine import kernels
from engine.config import IntQuant, ModelConfig
from engine.errors import CheckpointError
from engine.weight_quant import quantized_linear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight
_AWQ_COLUMNS = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])  # column c's nibble


def unpack_words(words: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """int32 words -> their ``32 / bits`` codes (int32), code i (bits ``i * bits ..``) the i-th of a word's
    along ``dim`` (0 or 1), which grows by as much."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    mask = (1 << bits) - 1
    if dim == 1:
        return ((words.unsqueeze(2) >> shifts) & mask).reshape(words.shape[0], -1)
    return ((words.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask).reshape(-1, words.shape[1])


def pack_words(codes: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """The inverse of ``unpack_words``: codes -> int32 words of ``32 / bits`` along ``dim`` (for writing
    checkpoints: tests and benchmarks)."""
    c, per_word = codes.to(torch.int64), 32 // bits
    c = c.reshape(-1, per_word, c.shape[1]).transpose(1, 2) if dim == 0 else c.reshape(c.shape[0], -1, per_word)
    words = (c << torch.arange(0, 32, bits, device=c.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AWQ's words ``[rows, cols / 8]`` -> codes ``[rows, cols]`` in column order."""
    codes = unpack_words(words, 1, 4)
    return codes.reshape(codes.shape[0], -1, 8)[:, :, _AWQ_COLUMNS.to(codes.device)].reshape(codes.shape)


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of ``awq_unpack`` (for writing checkpoints: tests and benchmarks)."""
    return pack_words(codes.reshape(codes.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].reshape(codes.shape), 1, 4)


def codes_from_checkpoint(words: torch.Tensor, quant: IntQuant) -> torch.Tensor:
    """A checkpoint's packed codes (``qweight``, ``weight_packed``) -> the model's ``weight`` (uint8
    ``[out, in / per_byte]``)."""
    if not quant.packed:  # int8: the signed values
        return (words.to(torch.int16) + quant.mid_code).to(torch.uint8)
    if quant.layout == "compressed-tensors":
        return pack_codes(unpack_words(words, 1, quant.bits), quant.bits)
    return pack_codes((awq_unpack(words) if quant.layout == "awq" else unpack_words(words, 0, quant.bits)).T,
                      quant.bits)


def zeros_from_checkpoint(words: torch.Tensor, quant: IntQuant) -> torch.Tensor:
    """A checkpoint's packed zeros (``qzeros``, ``weight_zero_point``) -> the model's ``weight_zero`` (uint8
    ``[out, groups]``)."""
    if not quant.packed:
        return (words.to(torch.int16) + quant.mid_code).to(torch.uint8)
    if quant.layout == "compressed-tensors":
        return unpack_words(words, 0, quant.bits).to(torch.uint8)
    zeros = awq_unpack(words) if quant.layout == "awq" else unpack_words(words, 1, quant.bits) + quant.zero_offset
    if zeros.max() > 255:  # GPTQ's original format cannot store an 8-bit zero of 0: its -1 wraps to 255, read 256
        raise CheckpointError("an 8-bit zero of 256 (stored 255 in GPTQ's original format) is out of range")
    return zeros.T.to(torch.uint8)


def scales_from_checkpoint(scales: torch.Tensor, quant: IntQuant) -> torch.Tensor:
    """A checkpoint's scales (AWQ's and GPTQ's ``[groups, out]``, compressed-tensors' ``[out, groups]``) -> the
    model's ``weight_scale`` (float32 ``[out, groups]``)."""
    return (scales if quant.layout == "compressed-tensors" else scales.T).to(torch.float32)


def check_weight_shape(shape: torch.Tensor, rows: int, cols: int) -> None:
    """compressed-tensors' ``weight_shape`` must be the projection's ``[rows, cols]``."""
    if shape.tolist() != [rows, cols]:
        raise CheckpointError(f"weight_shape is {shape.tolist()}, config.json implies {[rows, cols]}")


def check_g_idx(g_idx: torch.Tensor, quant: IntQuant) -> None:
    """Without act-order a ``g_idx`` must put column k in group ``k // group_size``."""
    cols = g_idx.shape[0]
    expected = torch.arange(cols, device=g_idx.device) // (quant.group_size or cols)
    if not torch.equal(g_idx.to(torch.int64), expected):
        raise CheckpointError("g_idx is not k // group_size, and quantization_config does not say act-order "
                              "(desc_act, actorder)")


def act_order_perm(g_idx: torch.Tensor, quant: IntQuant, current: torch.Tensor) -> torch.Tensor:
    """An act-order ``g_idx`` -> the input permutation that puts each group's columns together, in group
    order. ``current``: what an earlier projection of the same packed matrix set (-1s: none), which it must
    equal."""
    cols = g_idx.shape[0]
    groups = g_idx.to(torch.int64)
    if groups.min() < 0 or not torch.equal(torch.bincount(groups, minlength=quant.groups(cols)),
                                           torch.full((quant.groups(cols),), quant.group_size, device=g_idx.device)):
        raise CheckpointError(f"g_idx must put {quant.group_size} columns in each of {quant.groups(cols)} groups")
    perm = torch.argsort(groups, stable=True)
    if current[0] >= 0 and not torch.equal(current, perm):
        raise CheckpointError("g_idx differs from another projection's on the same input (q/k/v or gate/up): "
                              "they cannot share one input order")
    return perm


def sort_columns(packed: torch.Tensor, perm: torch.Tensor, bits: int) -> torch.Tensor:
    """A loaded act-order weight (uint8 ``[out, in / per_byte]``, columns in the checkpoint's order) with its
    columns in ``perm``'s order."""
    return pack_codes(unpack_codes(packed, bits)[:, perm], bits)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[rows, cols]`` -> uint8 ``[rows, cols * bits / 8]``: 8-bit ones a byte each, 4-bit ones two, column
    2j low, 2j + 1 high."""
    codes = codes.to(torch.uint8)
    return codes if bits == 8 else codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``pack_codes``: uint8 ``[rows, cols * bits / 8]`` -> codes uint8 ``[rows, cols]``."""
    if bits == 8:
        return packed
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


# Writing checkpoints (tests and benchmarks): the inverse of loading them.

def quantize_groups(weight: torch.Tensor, group_size: int, bits: int = 4,
                    symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` -> (codes uint8 ``[out, in]``, float32 scales and uint8 zeros ``[out, groups]``):
    round to nearest with each group's range mapped onto ``0 .. 2^bits - 1``, as AutoAWQ quantizes once it has
    scaled the weights; ``symmetric``: the zero at ``2^(bits - 1)`` and each group's absmax at half the codes'
    range (GPTQ's sym=True, llm-compressor's symmetric schemes)."""
    out, cols = weight.shape
    top = (1 << bits) - 1
    w = weight.to(torch.float32).reshape(out, -1, group_size or cols)
    if symmetric:
        scales = w.abs().amax(dim=2, keepdim=True).clamp_(min=1e-5) * 2 / top
        zeros = torch.full_like(scales, 1 << (bits - 1))
    else:
        low, high = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True)
        scales = (high - low).clamp_(min=1e-5) / top
        zeros = (-low / scales).round_().clamp_(0, top)
    codes = (w / scales).round_().add_(zeros).clamp_(0, top)
    return codes.reshape(out, cols).to(torch.uint8), scales.squeeze(2), zeros.squeeze(2).to(torch.uint8)


def checkpoint_tensors(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, quant: IntQuant,
                       g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A projection's codes ``[out, in]``, scales and zeros ``[out, groups]`` -> the tensors a checkpoint in
    ``quant``'s layout holds for it, by suffix (AWQ's and GPTQ's ``qweight``, ``qzeros``, fp16 ``scales``, GPTQ's
    ``g_idx``; compressed-tensors' ``weight_packed``, ``weight_scale``, ``weight_shape`` and, asymmetric,
    ``weight_zero_point``, with act-order ``weight_g_idx``; unpacked, ``weight`` int8 in place of
    ``weight_packed`` and ``weight_shape``). ``g_idx``: each column's group with act-order
    (default: ``k // group_size``)."""
    cols = codes.shape[1]
    if g_idx is None:
        g_idx = torch.arange(cols, device=codes.device) // (quant.group_size or cols)
    g_idx = g_idx.to(torch.int32)
    stored, bits = zeros.to(torch.int32) - quant.zero_offset, quant.bits
    if (stored < 0).any():
        raise ValueError("a zero of 0 cannot be stored with zero_offset 1 (GPTQ's original format)")
    if quant.layout == "compressed-tensors":
        if not quant.zero_points and (zeros != quant.mid_code).any():
            raise ValueError(f"a symmetric compressed-tensors checkpoint stores no zeros: each must be "
                             f"{quant.mid_code}")
        tensors = {"weight_scale": scales.to(torch.float16)}
        if quant.packed:
            tensors |= {"weight_packed": pack_words(codes, 1, bits), "weight_shape": torch.tensor(list(codes.shape))}
        else:  # int-quantized: the signed values, an int8 each
            tensors["weight"] = (codes.to(torch.int16) - quant.mid_code).to(torch.int8)
        if quant.act_order:
            tensors["weight_g_idx"] = g_idx
        if quant.zero_points:
            tensors["weight_zero_point"] = pack_words(stored, 0, bits) if quant.packed else \
                (stored - quant.mid_code).to(torch.int8)
        return tensors
    tensors = {"scales": scales.T.to(torch.float16).contiguous()}
    if quant.layout == "awq":
        return {**tensors, "qweight": awq_pack(codes.T), "qzeros": awq_pack(stored.T)}
    return {**tensors, "qweight": pack_words(codes.T, 0, bits), "qzeros": pack_words(stored.T, 1, bits),
            "g_idx": g_idx}


def checkpoint_config(quant: IntQuant) -> dict:
    """The ``quantization_config`` AutoAWQ, GPTQModel or llm-compressor writes for ``quant``'s layout."""
    group = quant.group_size or -1
    if quant.layout == "compressed-tensors":
        weights = {"num_bits": quant.bits, "type": "int", "symmetric": not quant.zero_points,
                   "group_size": quant.group_size or None, "strategy": "group" if quant.group_size else "channel",
                   "actorder": "group" if quant.act_order else None}
        # the w8a8 releases' activations: int8, scaled a token as they run (engine/w8a8.py)
        activations = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                       "strategy": "token"} if quant.int8_activations else None
        return {"quant_method": "compressed-tensors", "format": "pack-quantized" if quant.packed else "int-quantized",
                "quantization_status": "compressed", "config_groups": {"group_0": {
                    "targets": ["Linear"], "weights": weights, "input_activations": activations}},
                "ignore": ["lm_head"], "kv_cache_scheme": None}
    if quant.layout == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": quant.bits, "group_size": group, "desc_act": quant.act_order, "sym": False,
            "checkpoint_format": "gptq" if quant.zero_offset else "gptq_v2"}


def widest_group(config: ModelConfig, widest: int = 128) -> int:
    """The largest power of two up to ``widest`` that divides every projection's input columns (AWQ's and
    GPTQ's usual 128 where it can)."""
    group = widest
    while group > 16 and any(inp % group for _, inp, _ in config.projection_shapes()):
        group //= 2
    return group


def write_int_checkpoint(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict, quant: IntQuant) -> None:
    """A 16- or 32-bit checkpoint's ``tensors`` and ``config.json`` contents written to ``out_dir`` with every
    decoder projection (``*_proj.weight``, and Mixtral's experts' ``w1``/``w2``/``w3``) quantized to
    ``quant.bits`` in its layout (``quantize_groups``, on the tensors' device), as one ``model.safetensors``."""
    out = {}
    for name, tensor in tensors.items():
        if not (name.endswith("_proj.weight") or name.endswith((".w1.weight", ".w2.weight", ".w3.weight"))):
            out[name] = tensor.cpu()
            continue
        packed = checkpoint_tensors(*quantize_groups(tensor, quant.group_size, quant.bits, not quant.zero_points),
                                    quant)
        out.update({name.removesuffix("weight") + suffix: t.cpu() for suffix, t in packed.items()})
    save_file(out, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({**config, "quantization_config": checkpoint_config(quant)}))


def dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               dtype: torch.dtype) -> torch.Tensor:
    """(code - zero) x scale in float32, then cast to ``dtype``: ``[out, in]`` (each group's zero and scale
    broadcast over its columns: this runs every step on the CPU path)."""
    rows, groups = scales.shape
    codes = unpack_codes(packed, bits).to(torch.float32).view(rows, groups, -1)
    return ((codes - zeros.to(torch.float32)[:, :, None]) * scales[:, :, None]).view(rows, -1).to(dtype)


def int_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantize(...).T + bias`` (``weight_quant.quantized_linear``)."""
    return quantized_linear(x, bias, packed.shape[0],
                            lambda rows: kernels.int_matmul(rows, packed, scales, zeros, bits),
                            lambda dtype: dequantize(packed, scales, zeros, bits, dtype))
