"""Each penalized sequence's token counts, kept on the device from step to step.

Repetition, frequency and presence penalties read a sequence's whole history: which tokens its prompt holds and
how often each one came in its output. Rebuilt row by row at every step, that was a host pass over each history
and about fifteen small device ops a row: at batch 64, more host time than the rest of a graphed decode step. Here
each penalized sequence owns a row of two vocabulary-wide tables on the device, its output's counts and its
prompt's tokens, filled once from its history and then brought up to date with only the tokens it gained since
(one a step when decoding), in one op for the whole batch. The sampler reads a batch's rows with one gather
(``sampler.apply_penalties``), as vLLM keeps these counts on the GPU.

A row's tokens that its history does not hold (the draft tokens before a position being verified, or a draft
model's draft so far) are added to the gathered copy only (``extra``). The tables' rows are taken at the first
penalized request, ``capacity`` of them, and doubled if ever more sequences hold one; the owner (the engine, a
draft model) gives a sequence's row back when it finishes, is aborted or is preempted (``forget``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sampling_params import SamplingParams
from engine.to_device import device_index, device_values


class TokenHistory(Protocol):
    """A sequence as the penalties see it (``scheduler.Sequence``, ``speculative.DraftRequest``)."""

    seq_id: int
    token_ids: list[int]  # its prompt, then its output
    num_prompt_tokens: int
    params: SamplingParams


@dataclass
class PenaltyCounts:
    """What ``sampler.apply_penalties`` reads for a batch's rows that have penalties."""

    rows: list[int]  # the logits rows, in order
    row_index: torch.Tensor  # the same, on the device
    output_counts: torch.Tensor  # [len(rows), vocab] float32: each token's count in the row's output
    seen: torch.Tensor  # [len(rows), vocab] bool: in the row's prompt or output (the repetition penalty's set)


@dataclass
class _Slot:
    index: int  # its row of the tables
    counted: int  # how many tokens of its history the row holds


class TokenCounts:
    """The output counts and prompt tokens of every sequence with penalties, one table row each, by seq_id."""

    def __init__(self, vocab_size: int, device: torch.device | str, capacity: int):
        self.vocab_size, self.device, self.capacity = vocab_size, torch.device(device), capacity
        self.output: torch.Tensor | None = None  # int32 [rows, vocab]; None until a penalized request comes
        self.in_prompt: torch.Tensor | None = None  # bool [rows, vocab]
        self._slots: dict[int, _Slot] = {}
        self._free: list[int] = []
        self._one = torch.ones((), dtype=torch.int32, device=self.device)

    def penalties(self, histories: list[TokenHistory],
                  extra: tuple[list[int], torch.Tensor] | None = None) -> PenaltyCounts | None:
        """The counts of each row of a batch whose sequence (``histories[r]``) has penalties; None when none
        has. A sequence may have several rows. ``extra``: (rows, their tokens on the device): output tokens
        added to those rows' counts only, one per entry (a row may repeat), each row having penalties."""
        rows = [r for r, h in enumerate(histories) if h.params.has_penalties]
        if not rows:
            return None
        taken: list[int] = []  # rows newly taken, to clear
        prompt_at: list[list[int]] = [[], []]  # (table row, token) of the prompts of sequences new here
        output_at: list[list[int]] = [[], []]  # (table row, token) of output tokens not counted yet
        table_rows = []
        for r in rows:
            h = histories[r]
            slot = self._slots.get(h.seq_id)
            if slot is None:
                slot = self._slots[h.seq_id] = _Slot(self._take(), h.num_prompt_tokens)
                taken.append(slot.index)
                prompt_at[0] += [slot.index] * h.num_prompt_tokens
                prompt_at[1] += h.token_ids[:h.num_prompt_tokens]
            end = len(h.token_ids)
            if slot.counted < end:
                new = h.token_ids[slot.counted:end]
                output_at[0] += [slot.index] * len(new)
                output_at[1] += new
                slot.counted = end
            table_rows.append(slot.index)
        if taken:
            index = device_values(taken, torch.long, self.device)
            self.output[index] = 0
            self.in_prompt[index] = False
        if prompt_at[0]:
            self.in_prompt[device_index(prompt_at, self.device)] = True
        if output_at[0]:
            self.output.index_put_(device_index(output_at, self.device), self._one, accumulate=True)
        table_index, row_index = device_index([table_rows, rows], self.device)
        counts = self.output.index_select(0, table_index)
        if extra is not None and extra[0]:
            position = {r: i for i, r in enumerate(rows)}
            at = device_values([position[r] for r in extra[0]], torch.long, self.device)
            counts.index_put_((at, extra[1]), self._one, accumulate=True)
        seen = self.in_prompt.index_select(0, table_index) | (counts > 0)
        return PenaltyCounts(rows, row_index, counts.float(), seen)

    def forget(self, seq_id: int) -> None:
        """Give ``seq_id``'s row back (finished, aborted or preempted: a preempted one is counted again)."""
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot.index)

    def __len__(self) -> int:
        """How many sequences hold a row."""
        return len(self._slots)

    def _take(self) -> int:
        """A free table row; the tables are made (``capacity`` rows) or doubled when none is left."""
        if not self._free:
            size = 0 if self.output is None else self.output.shape[0]
            grown = max(self.capacity, 2 * size)
            output = torch.zeros(grown, self.vocab_size, dtype=torch.int32, device=self.device)
            in_prompt = torch.zeros(grown, self.vocab_size, dtype=torch.bool, device=self.device)
            if self.output is not None:
                output[:size], in_prompt[:size] = self.output, self.in_prompt
            self.output, self.in_prompt = output, in_prompt
            self._free = list(range(grown - 1, size - 1, -1))
        return self._free.pop()
