"""Llama-family decoder (Llama, Mistral, Phi-3, Qwen2, Qwen3, and the mixtures of experts Mixtral, Qwen2-MoE
and Qwen3-MoE: ``engine/moe.py``) over a paged KV cache.

Tokens of every sequence in a batch are flattened into one ``[T, hidden]`` row set, so the linear layers
run once for the whole batch with no padding. Only attention looks at sequence boundaries: each prefill
chunk attends over its own context with SDPA, and all 1-token decode rows (placed first) share one
batched SDPA call over their context, gathered block by block and padded to the longest table. That is
the torch attention path (CPU, quantized caches, attention sinks, and the reference); with the Triton
backend (``engine/triton_attention.py``) the runner sets ``AttentionMetadata.paged`` instead, the
kernels rotate q and k and read the cache blocks in place, and each residual add is fused into the
RMSNorm after it.
Parameter names follow Hugging Face except that q/k/v and gate/up are packed into one matrix each (one
matmul instead of three or two); the loader packs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels
from engine.config import IntQuant, ModelConfig, MoEConfig, Quant
from engine.int_weights import int_linear
from engine.kernels.common import ExpertQuant
from engine.lora import LoRABatch, lora_delta
from engine.moe import route, routed_experts
from engine.streaming_window import sink_window_attention
from engine.triton_attention import PagedAttentionMeta, paged_attention
from engine.w8a8 import w8a8_linear
from engine.weight_quant import fp8_linear


@dataclass
class PrefillMeta:
    """One multi-token chunk: rows [begin, end) of the flattened batch."""

    begin: int
    end: int
    ctx_blocks: torch.Tensor | None  # blocks holding positions [0, end position) if some were cached
    mask: torch.Tensor | None  # [n, len(ctx_blocks) * block_size] causal mask offset by the cached length
    sink_cols: torch.Tensor | None = None  # attention sinks past a gap (engine/streaming_window.py): [S, 1]


@dataclass
class AttentionMetadata:
    """Rows [0, num_decode) are the 1-token decode chunks; prefill chunks follow."""

    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) for each row's K/V
    prefills: list[PrefillMeta]
    num_decode: int = 0
    decode_blocks: torch.Tensor | None = None  # [num_decode * max_blocks] block tables, padded with 0
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size] real context
    # Gather destinations for K and V, each [>= blocks gathered at once, block_size, kv_heads, head_dim]:
    # one pair reused by every layer (and by the runner across steps), since a fresh multi-MB tensor per
    # layer and step costs more in page faults than the copy itself.
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None
    # Attention sinks (engine/streaming_window.py): which decode columns are sinks, and each row's cos/sin
    # at its cache position (the sinks' view of the query); None where no row has evicted tokens.
    decode_sink_cols: torch.Tensor | None = None
    sink_cos: torch.Tensor | None = None
    sink_sin: torch.Tensor | None = None
    # The Triton backend's block tables and lengths; when set, only slot_mapping and num_decode above are.
    paged: PagedAttentionMeta | None = None
    # LongRoPE: the rows of sequences longer than the original context, which rotate with the long factors at
    # every position (``CausalLM.rope_tables``); None: no such row.
    long_rope_rows: torch.Tensor | None = None
    # LoRA adapters (``engine/lora.py``): each row's adapter in this step; None: every row is the base model's.
    lora: LoRABatch | None = None
    # The torch path's masks narrowed to a layer's sliding window (``ModelConfig.layer_windows``), made by the
    # first such layer of the step: (which mask, window) -> mask
    window_masks: dict[tuple, torch.Tensor] = field(default_factory=dict)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, the factor cos and sin are scaled by), with Llama 3's wavelength-dependent
    scaling, YaRN's or LongRoPE's when configured, computed as transformers computes them (over the rotated
    dimensions only with a partial rotary factor)."""
    dim = cfg.rotary_dim or cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq, 1.0
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"], 1.0
    if s["rope_type"] == "yarn":
        return _yarn_inv_freq(cfg.rope_theta, dim, s), s["attention_factor"]
    if s["rope_type"] == "longrope":  # the short factors; CausalLM keeps the long ones beside them
        return longrope_inv_freq(cfg, "short_factor"), s["attention_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen = old_len / s["low_freq_factor"]
    high_wavelen = old_len / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def longrope_inv_freq(cfg: ModelConfig, factors: str) -> torch.Tensor:
    """LongRoPE's inverse frequencies with its ``factors`` ("short_factor" or "long_factor"), computed as
    transformers computes them: 1 / (factor * theta ** (2i / dim))."""
    dim = cfg.rotary_dim or cfg.head_dim
    powers = cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (torch.tensor(cfg.rope_scaling[factors], dtype=torch.float32) * powers)


def _yarn_inv_freq(base: float, dim: int, s: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023): the fast-rotating dimensions keep their frequencies, the slow ones are
    divided by the factor, with a linear ramp between the dimensions that turn ``beta_fast`` and
    ``beta_slow`` times over the original context."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp  # the share of each dimension's original frequency
    return (1.0 / (s["factor"] * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, 1, head_dim]`` (broadcast over heads) exactly as transformers builds them: float32
    position * inv_freq (``[head_dim / 2]``, or one row per position), times ``scale`` (YaRN's or LongRoPE's
    attention factor), then cast."""
    freqs = positions.float()[:, None] * (inv_freq if inv_freq.dim() == 2 else inv_freq[None, :])
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)  # (x * 1.0 is x exactly)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` rotated by cos/sin over its first ``cos.shape[-1]`` dimensions (all of them but with a partial
    rotary factor), the rest passed through, as transformers' Phi-3 does."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot = x[..., :d]
    return torch.cat((rot * cos + rotate_half(rot) * sin, x[..., d:]), dim=-1)


class PagedKV(Protocol):
    """One layer's paged K/V for one step (``engine/kv_cache.py``: plain, or quantized and dequantized)."""

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's K/V rows ``[T, kv_heads, head_dim]`` at their slots."""

    def gather(self, kind: int, block_ids: torch.Tensor, batch: int, buf: torch.Tensor) -> torch.Tensor:
        """K (``kind`` 0) or V of whole blocks -> ``[batch, kv_heads, S, head_dim]`` in the attention dtype,
        written into the front of ``buf`` (``[>= len(block_ids), block_size, kv_heads, head_dim]``)."""


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class Linear(nn.Module):
    """``nn.Linear`` minus its random init: the loader overwrites every weight, and skipping the init
    keeps model construction instant (even under ``torch.device``). ``lora_stacks``: every LoRA adapter slot's
    A and B (``engine/lora_slots.py``; None: no adapter may target this layer), and ``lora`` views of those of
    the loaded adapters by slot, added on the rows of each adapter a step names. With an fp8 ``quant``
    (``engine/weight_quant.py``) the weight is fp8 codes with float32 ``weight_scale`` ``[out, in / k_block]``;
    with an integer one (``engine/int_weights.py``) 4-bit codes two a byte ``[out, in / 2]`` or 8-bit ones
    ``[out, in]`` (``weight_bits``), with float32 ``weight_scale`` and uint8 ``weight_zero`` ``[out, groups]``,
    and with act-order ``weight_input_perm`` ``[in]``, the order the columns are sorted into (the input is
    gathered to match); with int8 activations (W8A8, ``engine/w8a8.py``) int8 values ``[out, in]`` with float32
    ``weight_scale`` ``[out, 1]`` and no zeros."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant: Quant = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = _frozen(torch.empty(out_features, dtype=dtype)) if bias else None
        self.weight_scale: nn.Parameter | None = None
        self.weight_zero: nn.Parameter | None = None
        self.weight_input_perm: nn.Parameter | None = None
        self.k_block = 0
        self.weight_bits = 0  # integer codes' width (4 or 8)
        if quant is None:
            self.weight = _frozen(torch.empty(out_features, in_features, dtype=dtype))
        elif isinstance(quant, IntQuant) and quant.int8_activations:
            self.weight = _frozen(torch.empty(out_features, in_features, dtype=torch.int8))
            self.weight_scale = _frozen(torch.empty(out_features, 1))
        elif isinstance(quant, IntQuant):
            groups, self.weight_bits = quant.groups(in_features), quant.bits
            self.weight = _frozen(torch.empty(out_features, in_features // quant.per_byte, dtype=torch.uint8))
            self.weight_scale = _frozen(torch.empty(out_features, groups))
            self.weight_zero = _frozen(torch.empty(out_features, groups, dtype=torch.uint8))
            if quant.act_order:  # -1s until the checkpoint's g_idx sets it (int_weights.act_order_perm)
                self.weight_input_perm = _frozen(torch.full((in_features,), -1, dtype=torch.int64))
        else:
            self.weight = _frozen(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
            self.k_block = quant.k_block or in_features
            self.weight_scale = _frozen(torch.empty(out_features, -(-in_features // self.k_block)))
        self.lora: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lora_stacks: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if self.weight_zero is not None:
            rows = x if self.weight_input_perm is None else x.index_select(-1, self.weight_input_perm)
            out = int_linear(rows, self.weight, self.weight_scale, self.weight_zero, self.weight_bits, self.bias)
        elif self.weight_scale is None:
            out = F.linear(x, self.weight, self.bias)
        elif self.weight.dtype == torch.int8:
            out = w8a8_linear(x, self.weight, self.weight_scale, self.bias)
        else:
            out = fp8_linear(x, self.weight, self.weight_scale, self.k_block, self.bias)
        if lora is None or self.lora_stacks is None:
            return out
        if lora.index is not None:  # a decode step on the Triton backend: every slot in two launches
            return kernels.lora_grouped(out, x, *self.lora_stacks, lora.index)
        return lora_delta(out, x, self.lora, lora.rows) if self.lora else out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, gemma: bool = False):
        """``gemma``: Gemma's norm, whose float32 ``weight`` holds 1 + the checkpoint's (the loader adds the 1)
        and scales the float32 row before the cast back."""
        super().__init__()
        self.gemma = gemma
        self.weight = _frozen(torch.empty(dim, dtype=torch.float32 if gemma else dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as transformers (float32 statistics, cast back, then scale; Gemma's scales
        # first).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight).to(dtype) if self.gemma else self.weight * x32.to(dtype)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
               softcap: float) -> torch.Tensor:
    """SDPA of q ``[B, H, M, D]`` over k/v ``[B, Hkv, N, D]``, ``mask`` the keys each query sees (None:
    causal); with ``softcap`` (> 0, Gemma 2's) each score is ``softcap * tanh(score / softcap)``, which SDPA
    cannot do, so the scores are taken as transformers' eager attention takes them (softmax in float32)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype) @ v


def _windowed(meta: AttentionMetadata, key: tuple, mask: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` (each row visible up to its query's position, as the runner builds them) narrowed to each
    query's last ``window`` positions, itself included (transformers' sliding-window mask); once a step."""
    if (key, window) not in meta.window_masks:
        last = mask.sum(-1, keepdim=True) - 1  # each row's query position: its last visible column
        cols = torch.arange(mask.shape[-1], device=mask.device)
        meta.window_masks[key, window] = mask & (cols > last - window)
    return meta.window_masks[key, window]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, window: int = 0, prefix: str = ""):
        """``window``: this layer's sliding window when the model's layers differ (Qwen's
        ``use_sliding_window``); 0: the step's attention (full, or the engine's window)."""
        super().__init__()
        self.window = window
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale or cfg.head_dim ** -0.5
        self.softcap = cfg.attn_logit_softcapping or 0.0
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, dtype,
                               cfg.quant_for(f"{prefix}.qkv_proj"))
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, dtype, cfg.quant_for(f"{prefix}.o_proj"))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, cfg.gemma) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, cfg.gemma) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: PagedKV,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x, meta.lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if meta.paged is not None:  # Triton backend: rotate, write and attend in place
            d = cos.shape[-1]  # the rotated dimensions: views of them are rotated in place
            kernels.apply_rope(q[..., :d], k[..., :d], cos, sin)
            paged = meta.paged if not self.window else replace(meta.paged, window=self.window)
            out = paged_attention(q, k, v, kv, paged, meta.num_decode, self.scale, self.softcap)
            return self.o_proj(out.view(T, self.q_size), meta.lora)
        q_sink = None if meta.sink_cos is None else apply_rotary(q, meta.sink_cos, meta.sink_sin)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kv.write(k, v)
        out = torch.empty_like(q)
        for p in meta.prefills:
            # 4-D [1, heads, n, D] views: CPU SDPA only takes its fused (flash) kernel for 4-D inputs.
            qs = q[None, p.begin:p.end].transpose(1, 2)
            if p.ctx_blocks is None:  # nothing cached before this chunk: its own K/V is the context
                ks, vs = k[None, p.begin:p.end].transpose(1, 2), v[None, p.begin:p.end].transpose(1, 2)
                mask = None  # causal
                if self.window:
                    causal = torch.ones(p.end - p.begin, p.end - p.begin, dtype=torch.bool, device=q.device).tril()
                    mask = _windowed(meta, ("fresh", p.begin), causal, self.window)
                o = _attention(qs, ks, vs, mask, self.scale, self.softcap)
            else:
                ks = kv.gather(0, p.ctx_blocks, 1, meta.k_buf)
                vs = kv.gather(1, p.ctx_blocks, 1, meta.v_buf)
                if p.sink_cols is None:
                    mask = p.mask if not self.window else _windowed(meta, ("chunk", p.begin), p.mask, self.window)
                    o = _attention(qs, ks, vs, mask, self.scale, self.softcap)
                else:
                    o = sink_window_attention(qs, q_sink[None, p.begin:p.end].transpose(1, 2), ks, vs, p.mask,
                                              p.sink_cols, self.scale)
            out[p.begin:p.end] = o[0].transpose(0, 1)
        if meta.num_decode:
            n = meta.num_decode
            kd = kv.gather(0, meta.decode_blocks, n, meta.k_buf)
            vd = kv.gather(1, meta.decode_blocks, n, meta.v_buf)
            if meta.decode_sink_cols is None:
                mask = meta.decode_mask if not self.window else _windowed(meta, ("decode",), meta.decode_mask,
                                                                          self.window)
                o = _attention(q[:n, :, None], kd, vd, mask, self.scale, self.softcap)  # [n, H, 1, D]
            else:
                o = sink_window_attention(q[:n, :, None], q_sink[:n, :, None], kd, vd, meta.decode_mask,
                                          meta.decode_sink_cols, self.scale)
            out[:n] = o[:, :, 0]
        return self.o_proj(out.view(T, self.q_size), meta.lora)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 quants: tuple[Quant, Quant] = (None, None), gelu: bool = False):
        """``quants``: gate/up's and down's quantization (None: held in ``dtype``); ``gelu``: GeGLU with the
        tanh-approximated GELU (Gemma's), else SwiGLU."""
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, dtype, quants[0])
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype, quants[1])
        self.gelu = gelu

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, lora).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up, lora)


class SparseMoE(nn.Module):
    """A layer's experts (``engine/moe.py``), with Qwen2-MoE's gated shared expert when configured. Names
    follow transformers 5: ``gate`` is the router, ``experts.gate_up_proj`` ``[E, 2I, H]`` and
    ``experts.down_proj`` ``[E, H, I]`` pack every expert's matrices; quantized, each comes with ``_scale``
    (and integer codes' ``_zero``, and act-order ``_input_perm`` ``[E, in]``) as ``Linear``'s weight does; W8A8
    ones are int8 values with a scale a row, as ``Linear``'s."""

    def __init__(self, hidden_size: int, moe: MoEConfig, dtype: torch.dtype, quant: Quant = None,
                 shared_quants: tuple[Quant, Quant] = (None, None)):
        super().__init__()
        self.config = moe
        e, i = moe.num_experts, moe.intermediate_size
        self.gate = Linear(hidden_size, e, False, dtype)  # the router stays in dtype, as fp8 releases keep it
        self.experts = nn.Module()
        integer = isinstance(quant, IntQuant)
        self.code_bits = quant.bits if integer else 8
        self.int8_activations = integer and quant.int8_activations  # W8A8 (engine/w8a8.py): int8 values, no zeros
        per_byte = quant.per_byte if integer else 1
        weights = (dtype if quant is None else torch.int8 if self.int8_activations else torch.uint8 if integer
                   else torch.float8_e4m3fn)
        self.experts.gate_up_proj = _frozen(torch.empty(e, 2 * i, hidden_size // per_byte, dtype=weights))
        self.experts.down_proj = _frozen(torch.empty(e, hidden_size, i // per_byte, dtype=weights))
        # each matrix's k-block: fp8's (engine/weight_quant.py), integer codes' group (engine/int_weights.py)
        self.k_blocks: tuple[int, int] | None = None
        if quant is not None:
            block = quant.group_size if integer else quant.k_block
            self.k_blocks = (block or hidden_size, block or i)
            shapes = ((e, 2 * i, -(-hidden_size // self.k_blocks[0])), (e, hidden_size, -(-i // self.k_blocks[1])))
            self.experts.gate_up_proj_scale, self.experts.down_proj_scale = (_frozen(torch.empty(s)) for s in shapes)
            if integer and not self.int8_activations:
                self.experts.gate_up_proj_zero, self.experts.down_proj_zero = (
                    _frozen(torch.empty(s, dtype=torch.uint8)) for s in shapes)
            if integer and quant.act_order:  # -1s until the checkpoint's g_idx sets them (int_weights.act_order_perm)
                self.experts.gate_up_proj_input_perm, self.experts.down_proj_input_perm = (
                    _frozen(torch.full((e, cols), -1, dtype=torch.int64)) for cols in (hidden_size, i))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(hidden_size, moe.shared_expert_intermediate_size, dtype, shared_quants)
            self.shared_expert_gate = Linear(hidden_size, 1, False, dtype)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``fused``: the Triton kernels (``engine/kernels/moe_experts.py``: two launches, no host sync)
        instead of the torch loop over experts."""
        scores, ids = route(self.gate(x), self.config.top_k, self.config.renormalize)
        if not self.config.float32_scores:
            scores = scores.to(x.dtype)
        experts = kernels.fused_moe if fused else routed_experts
        out = experts(x, scores, ids, self.experts.gate_up_proj, self.experts.down_proj, self.expert_quant())
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def expert_quant(self) -> ExpertQuant | None:
        """The quantized experts' scales (and integer codes' zeros and act-order input orders); None in
        ``dtype``."""
        if self.k_blocks is None:
            return None
        experts = self.experts
        zeros = getattr(experts, "gate_up_proj_zero", None), getattr(experts, "down_proj_zero", None)
        perms = getattr(experts, "gate_up_proj_input_perm", None), getattr(experts, "down_proj_input_perm", None)
        return ExpertQuant(experts.gate_up_proj_scale, experts.down_proj_scale, *self.k_blocks, *zeros, *perms,
                           bits=self.code_bits, int8_activations=self.int8_activations)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP. Norm names are the checkpoint's: Llama's ``post_attention_layernorm`` is
    the MLP's input norm; Gemma's normalizes the attention output, ``pre_feedforward_layernorm`` the MLP's
    input and ``post_feedforward_layernorm`` its output."""

    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.gemma)  # noqa: E731
        self.input_layernorm = norm()
        layer = f"model.layers.{index}"
        self.self_attn = Attention(cfg, dtype, cfg.layer_windows[index] if cfg.layer_windows else 0,
                                   f"{layer}.self_attn")
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if cfg.gemma:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        if cfg.moe is not None and index in cfg.moe.layers:
            shared = tuple(cfg.quant_for(f"{layer}.mlp.shared_expert.{p}") for p in ("gate_up_proj", "down_proj"))
            self.mlp: nn.Module = SparseMoE(cfg.hidden_size, cfg.moe, dtype, cfg.quant_for(f"{layer}.mlp.experts"),
                                            shared)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype,
                           (cfg.quant_for(f"{layer}.mlp.gate_up_proj"), cfg.quant_for(f"{layer}.mlp.down_proj")),
                           gelu=cfg.gemma)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv: PagedKV, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pre-norm attention and MLP, each added to the residual stream; writes every row's K/V into
        ``kv``, this layer's paged cache. Returns (output, residual): with the torch path the output is
        the new residual stream itself and the residual None; with the Triton kernels each residual add
        is fused into the norm after it (vLLM's fused_add_rms_norm), so the output is the MLP's, still to
        be added to the returned residual (by the next layer's input norm, or the caller)."""
        gemma = self.pre_feedforward_layernorm is not None
        mlp_norm = self.pre_feedforward_layernorm if gemma else self.post_attention_layernorm
        if meta.paged is None:
            attn = self.self_attn(self.input_layernorm(h), cos, sin, kv, meta)
            h = h + (self.post_attention_layernorm(attn) if gemma else attn)
            out = self._mlp(mlp_norm(h), meta)
            return h + (self.post_feedforward_layernorm(out) if gemma else out), None
        if residual is None:  # the first layer: the embeddings are the residual stream
            residual, x = h, self.input_layernorm(h)
        else:
            x = _add_norm(h, residual, self.input_layernorm)
        attn = self.self_attn(x, cos, sin, kv, meta)
        x = _add_norm(self.post_attention_layernorm(attn) if gemma else attn, residual, mlp_norm)
        out = self._mlp(x, meta)
        return (self.post_feedforward_layernorm(out) if gemma else out), residual

    def _mlp(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The dense MLP with the step's LoRA rows, or the experts (the fused kernels with the Triton backend)."""
        if isinstance(self.mlp, SparseMoE):
            return self.mlp(x, fused=meta.paged is not None)
        return self.mlp(x, meta.lora)


def _add_norm(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``residual += x``, then ``norm`` of it, in one kernel (vLLM's fused_add_rms_norm)."""
    return kernels.fused_add_rms_norm(x, residual, norm.weight, norm.eps, scale_first=norm.gemma)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)  # used as a lookup table
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.gemma)


class CausalLM(nn.Module):
    """Create under ``torch.device(device)``, fill with the loader, then call ``init_rope``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq: torch.Tensor | None = None
        self.rope_scale = 1.0  # what cos and sin are multiplied by (YaRN's or LongRoPE's attention factor)
        self.long_inv_freq: torch.Tensor | None = None  # LongRoPE's long factors' (``rope_tables``)
        self.local_inv_freq: torch.Tensor | None = None  # Gemma 3's sliding layers' (plain RoPE, their own base)
        # Gemma's embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype as transformers does
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype)) if cfg.gemma else None

    def init_rope(self, device: torch.device | str) -> None:
        inv_freq, self.rope_scale = rope_inv_freq(self.config)
        self.inv_freq = inv_freq.to(device)
        if self.config.long_rope_from is not None:
            self.long_inv_freq = longrope_inv_freq(self.config, "long_factor").to(device)
        if self.config.local_rope_theta is not None:
            local = replace(self.config, rope_theta=self.config.local_rope_theta, rope_scaling=None)
            self.local_inv_freq = rope_inv_freq(local)[0].to(device)

    def rope_tables(self, positions: torch.Tensor, long_rows: torch.Tensor | None, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of each row. LongRoPE, as transformers runs it: a sequence longer than the original context
        rotates every position with the long factors (``long_rows``: its rows; None: no such row), one shorter
        with the short ones. A row past that context is always such a sequence's (the engine computes a
        sequence again as it passes it), which is all a decode graph, without ``long_rows``, relies on."""
        if self.long_inv_freq is None:
            return rope_cos_sin(positions, self.inv_freq, dtype, self.rope_scale)
        long = positions >= self.config.long_rope_from
        if long_rows is not None:
            long |= long_rows
        inv_freq = torch.where(long[:, None], self.long_inv_freq, self.inv_freq)
        return rope_cos_sin(positions, inv_freq, dtype, self.rope_scale)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_layers: Sequence[PagedKV], logit_rows: torch.Tensor,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden rows -> float32 logits of ``logit_rows``; writes every row's K/V into ``kv_layers`` (one
        per layer, ``KVCache.for_step``), calling ``on_layer_done(layer)`` once a layer is done (its K/V
        written)."""
        return self.logits(self.final_hidden(input_ids, positions, meta, kv_layers, logit_rows, on_layer_done))

    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     kv_layers: Sequence[PagedKV], rows: torch.Tensor,
                     on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """The final-norm hidden states of ``rows`` (what the LM head reads, and an embedding pools), in the
        model's dtype; the K/V and ``on_layer_done`` as ``forward``."""
        h = F.embedding(input_ids, self.model.embed_tokens.weight)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        rope = self.rope_tables(positions, meta.long_rope_rows, h.dtype)
        local = rope if self.local_inv_freq is None else rope_cos_sin(positions, self.local_inv_freq, h.dtype)
        residual = None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, *(local if layer.self_attn.window else rope), kv_layers[i], meta)
            if on_layer_done is not None:
                on_layer_done(i)
        h = h[rows] if residual is None else residual[rows] + h[rows]
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final-norm hidden rows."""
        logits = self.lm_head(hidden)
        if cap := self.config.final_logit_softcapping:  # Gemma 2's, in the model's dtype as transformers caps
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
