"""The batched sampler: greedy, temperature, top-k, top-p, per-request seeds.

Every row is sampled independently of the others in the batch: temperature, top-k and top-p act per
row, and random draws come from the row's own ``torch.Generator`` when the request has a seed, so a
seeded request gives the same tokens whatever it is batched with. Sampling uses the exponential-race
form ``argmax(p / q)`` with ``q ~ Exp(1)``, which draws from ``p`` with one random number per
vocabulary entry and no cumulative sums (the same trick vLLM uses).
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def make_generator(seed: int | None, index: int, device: torch.device | str) -> torch.Generator | None:
    """The private random stream of sample ``index`` of a seeded request (None: the global stream)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((seed + index * 0x9E3779B97F4A7C15) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1)  # ascending: the kept tokens are at the end
    if any(k > 0 for k in top_k):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        kth = ordered.gather(1, (vocab - k).unsqueeze(1))
        ordered.masked_fill_(ordered < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device)
        cum = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        ordered.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of float32 ``logits [rows, vocab]``."""
    greedy = [p.greedy for p in params]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()
    temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)],
                         dtype=logits.dtype, device=logits.device)
    scaled = logits / temps.unsqueeze(1)
    top_k, top_p = [p.top_k for p in params], [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    q = torch.empty_like(probs).exponential_()
    for row, g in enumerate(generators):
        if g is not None:  # seeded rows draw only from their own stream
            q[row].exponential_(generator=g)
    tokens = (probs / q).argmax(dim=-1)
    if any(greedy):
        mask = torch.tensor(greedy, device=logits.device)
        tokens = torch.where(mask, logits.argmax(dim=-1), tokens)
    return tokens.tolist()


def top_logprobs(logits: torch.Tensor, token_ids: list[int], counts: list[int | None]
                 ) -> list[dict[int, float] | None]:
    """Per row: {sampled token: logprob} plus the row's ``counts[row]`` most likely tokens, from the
    model's raw distribution (before temperature / top-k / top-p, as vLLM reports them); None for a row
    whose count is None (its request asked for no logprobs)."""
    out: list[dict[int, float] | None] = [None] * len(counts)
    want = [row for row, n in enumerate(counts) if n is not None]
    if not want:
        return out
    logprobs = logits[want].log_softmax(dim=-1)
    k = max(counts[row] for row in want)
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen = logprobs.gather(1, torch.tensor([token_ids[row] for row in want], device=logits.device)[:, None])
    for i, row in enumerate(want):
        n = counts[row]
        entry = dict(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True)) if n else {}
        entry[token_ids[row]] = chosen[i, 0].item()
        out[row] = entry
    return out
