"""The batched sampler: penalties, logit bias, greedy, temperature, min-p, top-k, top-p, per-request seeds.

Every row is sampled independently of the others in the batch: penalties, bias, temperature, top-k and
top-p act per row, and random draws come from the row's own ``torch.Generator`` when the request has a
seed, so a seeded request gives the same tokens whatever it is batched with. Sampling uses the
exponential-race form ``argmax(p / q)`` with ``q ~ Exp(1)``, which draws from ``p`` with one random number
per vocabulary entry and no cumulative sums (the same trick vLLM uses). Penalties and bias come first
(greedy rows see them too), in vLLM's order: repetition, frequency, presence, then the bias, then the
tokens a row may not sample yet (its stop tokens, before ``min_tokens``). Truncation follows vLLM's order
too: temperature, then min-p, then top-k and top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.output import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.to_device import device_index, device_values, host_copy
from engine.token_counts import PenaltyCounts


def make_generator(seed: int | None, index: int, device: torch.device | str) -> torch.Generator | None:
    """The private random stream of sample ``index`` of a seeded request (None: the global stream)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((seed + index * 0x9E3779B97F4A7C15) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def skip_draws(generator: torch.Generator, count: int, vocab_size: int) -> None:
    """Advance a sample's random stream past ``count`` tokens' draws (``sample`` takes one vocabulary-wide
    draw per token): tokens sampled elsewhere, or a draft's positions after its first rejected token."""
    for _ in range(count):
        torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)


@dataclass
class Draws:
    """A sample's random draws for its next tokens, taken ahead of sampling them: a draft model samples each
    draft position with the draw its verification will use (``engine/draft_model.py``)."""

    values: torch.Tensor  # [count, vocab]: the Exp(1) draw of each of the next ``count`` tokens, in order
    # A seeded sample's stream state after 0..count of them, the stream itself left where it was; None: drawn
    # from the global stream (taken, and nothing to give back)
    states: list[torch.Tensor] | None

    def take(self, generator: torch.Generator | None, used: int) -> None:
        """Advance a seeded sample's stream past the first ``used`` draws: those of the tokens it kept."""
        if self.states is not None and generator is not None:
            generator.set_state(self.states[used])


def draw_ahead(generator: torch.Generator | None, count: int, vocab_size: int, device: torch.device | str) -> Draws:
    """The next ``count`` tokens' draws of a sample (``sample`` takes one vocabulary-wide draw per token): from
    its own stream when it is seeded, which is then left as it was, else from the global stream."""
    if generator is None:
        return Draws(torch.empty(count, vocab_size, device=device).exponential_(), None)
    start = generator.get_state()
    values = torch.empty(count, vocab_size, device=device)
    states = [start]
    for row in values:
        row.exponential_(generator=generator)
        states.append(generator.get_state())
    generator.set_state(start)
    return Draws(values, states)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1)  # ascending: the kept tokens are at the end
    if any(k > 0 for k in top_k):
        k = device_values([k if 0 < k < vocab else vocab for k in top_k], torch.long, logits.device)
        kth = ordered.gather(1, (vocab - k).unsqueeze(1))
        ordered.masked_fill_(ordered < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        p = device_values(top_p, logits.dtype, logits.device)
        cum = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        ordered.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def _apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) each row's tokens less likely than its ``min_p`` times its most likely token's
    probability: ``p_i < min_p * p_max`` is ``logit_i < logit_max + log(min_p)``, no softmax needed."""
    floor = device_values(min_p, logits.dtype, logits.device).log().unsqueeze(1)  # log 0: -inf
    return logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + floor, float("-inf"))


def bad_word_bans(sequences: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete one of the bad ``sequences`` after ``output`` (vLLM's bad_words): each
    sequence's last token where the output ends with the rest of it (a one-token sequence: always)."""
    bans = set()
    for words in sequences:
        head = len(words) - 1
        if head == 0 or (len(output) >= head and output[-head:] == list(words[:-1])):
            bans.add(words[-1])
    return sorted(bans)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], penalties: PenaltyCounts | None = None,
                    banned: list[list[int]] | None = None) -> torch.Tensor:
    """``logits`` with each row's penalties and logit bias applied, and the tokens outside its
    allowed_token_ids and its ``banned[r]`` ones ruled out (a copy; the input stays raw).

    ``penalties``: the counts of the rows with penalties (``TokenCounts.penalties``). The repetition penalty
    covers the prompt and the output (HF's ``RepetitionPenaltyLogitsProcessor``); presence and frequency
    penalties only the output (OpenAI). They are applied to all those rows at once."""
    rows = [r for r, p in enumerate(params)
            if p.logit_bias or p.allowed_token_ids is not None or (banned and banned[r])]
    if penalties is None:
        if any(p.has_penalties for p in params):
            raise ValueError("penalties need each penalized row's token counts (TokenCounts.penalties)")
        if not rows:
            return logits
    out = logits.clone() if penalties is None else _penalized(logits, params, penalties)
    biased: list[list[int]] = [[], []]  # (row, token) of each bias
    biases: list[float] = []
    allowed_rows: list[int] = []  # the rows with allowed_token_ids
    allowed: list[list[int]] = [[], []]  # (index in allowed_rows, token) of each token they allow
    ruled_out: list[list[int]] = [[], []]  # (row, token) of each banned token
    for r in rows:
        p = params[r]
        for token, bias in p.logit_bias:
            biased[0].append(r)
            biased[1].append(token)
            biases.append(bias)
        if p.allowed_token_ids is not None:
            allowed[0] += [len(allowed_rows)] * len(p.allowed_token_ids)
            allowed[1] += p.allowed_token_ids
            allowed_rows.append(r)
        if banned and banned[r]:
            ruled_out[0] += [r] * len(banned[r])
            ruled_out[1] += banned[r]
    device = logits.device  # (each of the three for all rows at once, as a few ops)
    if biases:
        out.index_put_(device_index(biased, device), device_values(biases, out.dtype, device), accumulate=True)
    if allowed_rows:
        index = device_values(allowed_rows, torch.long, device)
        keep = torch.zeros(len(allowed_rows), out.shape[-1], dtype=torch.bool, device=device)
        keep[device_index(allowed, device)] = True
        out.index_copy_(0, index, out.index_select(0, index).masked_fill_(~keep, float("-inf")))
    if ruled_out[0]:
        out[device_index(ruled_out, device)] = float("-inf")
    return out


def _penalized(logits: torch.Tensor, params: list[SamplingParams], penalties: PenaltyCounts) -> torch.Tensor:
    """A copy of ``logits`` with the repetition, frequency and presence penalties of ``penalties``' rows."""
    chosen = [params[r] for r in penalties.rows]
    figures = device_values([[p.repetition_penalty for p in chosen], [p.frequency_penalty for p in chosen],
                             [p.presence_penalty for p in chosen]], logits.dtype, logits.device).unsqueeze(-1)
    every = len(chosen) == logits.shape[0]  # (rows are in order: then they are all of them)
    scores = logits if every else logits.index_select(0, penalties.row_index)
    # A repetition penalty of 1, or a zero frequency or presence penalty, leaves a score as it is, exactly: each
    # kind runs only when some row has it (and one does: ``scores`` is a new tensor then, never ``logits``).
    if any(p.repetition_penalty != 1.0 for p in chosen):
        repeated = torch.where(scores < 0, scores * figures[0], scores / figures[0])
        scores = torch.where(penalties.seen, repeated, scores)
    if any(p.frequency_penalty or p.presence_penalty for p in chosen):
        counts = penalties.output_counts
        scores = scores - (figures[1] * counts + figures[2] * (counts > 0).to(scores.dtype))
    return scores if every else logits.index_copy(0, penalties.row_index, scores)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row of ``logits`` is sampled from: its temperature (1 for a greedy row), then
    min-p, top-k and top-p (penalties and bias are the caller's: ``apply_penalties``)."""
    temps = device_values([1.0 if p.greedy else p.temperature for p in params], logits.dtype, logits.device)
    scaled = logits / temps.unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        scaled = _apply_min_p(scaled, [p.min_p for p in params])
    top_k, top_p = [p.top_k for p in params], [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           penalties: PenaltyCounts | None = None, banned: list[list[int]] | None = None,
           draws: list[torch.Tensor | None] | None = None) -> list[int]:
    """One token per row of float32 ``logits [rows, vocab]``; ``penalties`` holds the token counts of the rows
    with penalties (none needed otherwise), and ``banned`` the tokens each row may not sample (see
    ``apply_penalties``). ``draws[r]``, where given, is row r's random draw (``draw_ahead``), used instead of
    one from its generator."""
    return sample_tokens(logits, params, generators, penalties, banned, draws).tolist()


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                  penalties: PenaltyCounts | None = None, banned: list[list[int]] | None = None,
                  draws: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """``sample``'s tokens as a tensor on the logits' device, left there, sampled without waiting for the
    device."""
    logits = apply_penalties(logits, params, penalties, banned)
    greedy = [p.greedy for p in params]
    if all(greedy):
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, params)
    given = [] if draws is None else [row for row, d in enumerate(draws) if d is not None]
    q = torch.empty_like(probs)
    if len(given) < len(params):
        q.exponential_()
    if given:
        q[given] = torch.stack([draws[row] for row in given])
    for row, g in enumerate(generators):
        if g is not None and (draws is None or draws[row] is None):  # seeded rows draw only from their own stream
            q[row].exponential_(generator=g)
    tokens = (probs / q).argmax(dim=-1)
    if any(greedy):
        tokens = torch.where(device_values(greedy, torch.bool, logits.device), logits.argmax(dim=-1), tokens)
    return tokens


def top_logprobs(logits: torch.Tensor, token_ids: list[int], counts: list[int | None]
                 ) -> list[TokenLogprobs | None]:
    """Per row: the sampled token's logprob, its rank and the row's ``counts[row]`` most likely tokens, from
    the model's raw distribution (before penalties, temperature, top-k and top-p, as vLLM reports them); None
    for a row whose count is None (its request asked for no logprobs)."""
    if all(n is None for n in counts):  # (most steps: no copy of the tokens to the device for nothing)
        return [None] * len(counts)
    figures = LogprobFigures.of(logits, device_values(token_ids, torch.long, logits.device), counts)
    return figures.token_logprobs(token_ids)


@dataclass
class LogprobFigures:
    """``top_logprobs``' figures, as tensors (on the logits' device until ``to_host``): an async-scheduled step
    computes them behind its sampling and reads them once its tokens reach the host."""

    counts: list[int | None]  # every row's (None: it asked for none)
    rows: list[int]  # the rows that asked, in order
    chosen: torch.Tensor  # [len(rows)]: the sampled token's logprob
    ranks: torch.Tensor  # [len(rows)]: its place, 1 = the most likely (ties share the best)
    top_ids: torch.Tensor  # [len(rows), k]: the k most likely tokens, k the largest count
    top_values: torch.Tensor  # [len(rows), k]: their logprobs

    @classmethod
    def of(cls, logits: torch.Tensor, tokens: torch.Tensor, counts: list[int | None]) -> LogprobFigures | None:
        """The figures of ``tokens`` (one a row, on the logits' device) for the rows with a count (None: no row
        has one)."""
        rows = [row for row, n in enumerate(counts) if n is not None]
        if not rows:
            return None
        index = device_values(rows, torch.long, logits.device)
        logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)
        top_values, top_ids = logprobs.topk(max(counts[row] for row in rows), dim=-1)
        chosen = logprobs.gather(1, tokens.index_select(0, index)[:, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        return cls(counts, rows, chosen[:, 0], ranks, top_ids, top_values)

    def to_host(self) -> LogprobFigures:
        """The tensors copied to the host without waiting for the device (``to_device.host_copy``)."""
        return LogprobFigures(self.counts, self.rows, host_copy(self.chosen), host_copy(self.ranks),
                              host_copy(self.top_ids), host_copy(self.top_values))

    def token_logprobs(self, token_ids: list[int]) -> list[TokenLogprobs | None]:
        """Each row's ``TokenLogprobs`` of its token ``token_ids[row]`` (None for a row that asked for none)."""
        out: list[TokenLogprobs | None] = [None] * len(self.counts)
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        top_ids, top_values = self.top_ids.tolist(), self.top_values.tolist()
        for i, row in enumerate(self.rows):
            n = self.counts[row]
            out[row] = TokenLogprobs(token_ids[row], chosen[i], tuple(zip(top_ids[i][:n], top_values[i][:n],
                                                                          strict=True)), ranks[i])
        return out
