"""Windows: blocks kept in the attention dtype next to their records (fp8 and kivi2 caches).

Those formats scale over a whole block, so a block is quantized once, when its last token is written;
until then its K/V live here, in ``data`` ``[layers, 2, slots, block_size, kv_heads, head_dim]``, and
``slot_of[block]`` names the block's slot (-1: the block's record is what counts). Each sequence also
keeps its last ``residual_blocks`` full blocks here (KIVI's full-precision residual): their records are
written when they fill, but attention reads the window until the sequence is that many blocks past.
So a sequence of n tokens keeps the blocks from table index ``keep_from(n)`` on.

A step's ``WritePlan`` routes each written row into its block's window when the sequence keeps that
block, and every row of a block the step completes into that block's new record; blocks the step's
sequences no longer keep lose their windows. Slots come from a free list; when it runs dry, windows of
blocks no longer in use (``block_in_use``, the block manager's view) are reclaimed, and only then does
the pool grow. A block's window is replaced or dropped whenever the block's contents are imported or
copied, and dropped when the block becomes shareable (registered in the prefix cache), since another
sequence must read it as its record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kv_format import residual_start

# One sequence's part of a step: (block table, first position written, positions computed after the step).
Span = tuple[list[int], int, int]


@dataclass
class WritePlan:
    """Where one step's rows go (rows index the step's flattened tokens)."""

    open_rows: torch.Tensor  # rows whose block its sequence keeps: written into the block's window ...
    open_slots: torch.Tensor  # ... slot
    open_offsets: torch.Tensor  # ... at this token offset
    done_blocks: torch.Tensor  # [C] blocks whose last token is written in this step (sorted)
    done_rows: torch.Tensor  # rows landing in those blocks ...
    done_index: torch.Tensor  # ... index into done_blocks
    done_offsets: torch.Tensor
    carried: torch.Tensor  # indexes into done_blocks of blocks that had a window (earlier tokens) ...
    carried_slots: torch.Tensor  # ... and those windows' slots


class WindowPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, slots: int,
                 block_in_use: Callable[[int], bool] | None = None, residual_blocks: int = 0):
        self.block_size, self.residual_blocks = block_size, residual_blocks
        self.block_in_use = block_in_use
        self.data = torch.zeros(num_layers, 2, max(1, slots), block_size, num_kv_heads, head_dim, dtype=dtype,
                                device=device)
        self.slot_of = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        self._free = list(range(self.data.shape[2] - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.data.shape[2]

    def keep_from(self, num_tokens: int) -> int:
        """First table index a sequence of ``num_tokens`` computed tokens keeps in windows."""
        return residual_start(num_tokens, self.block_size, self.residual_blocks)

    def slot(self, block: int) -> int:
        return int(self.slot_of[block])

    def ensure(self, block: int) -> int:
        """The block's slot, taking a free one if it has none."""
        slot = self.slot(block)
        if slot < 0:
            if not self._free:
                self._reclaim()
            if not self._free:
                self._grow()
            slot = self._free.pop()
            self.slot_of[block] = slot
        return slot

    def release(self, blocks: list[int]) -> None:
        """Drop the windows of ``blocks`` (those without one are skipped): one read of their slots, so a
        device pool syncs once, not once a block."""
        blocks = list(dict.fromkeys(blocks))
        if not blocks:
            return
        index = torch.tensor(blocks, dtype=torch.long, device=self.slot_of.device)
        self._free += [slot for slot in self.slot_of[index].tolist() if slot >= 0]
        self.slot_of[index] = -1

    def copy(self, src: int, dst: int) -> None:
        """Copy-on-write: ``dst`` gets a copy of ``src``'s window (or loses its own if ``src`` has none)."""
        if self.slot(src) < 0:
            self.release([dst])
            return
        d = self.ensure(dst)  # may grow the pool: take src's slot afterwards
        self.data[:, :, d] = self.data[:, :, self.slot(src)]

    def plan(self, slot_mapping: torch.Tensor, spans: list[Span]) -> WritePlan:
        """Where the rows at ``slot_mapping`` go, from each sequence's ``Span`` (every row lies in one)."""
        B = self.block_size
        keep: set[int] = set()
        passed: set[int] = set()  # blocks a sequence kept before the step and no longer does
        for table, start, end in spans:
            first = self.keep_from(end)
            keep.update(table[first:-(-end // B)])
            passed.update(table[self.keep_from(start):first])
        blocks, offsets = slot_mapping // B, slot_mapping % B
        done = torch.unique(blocks[offsets == B - 1])
        done_slots = self.slot_of[done]  # before any slot is taken: only windows with earlier tokens carry
        carried = (done_slots >= 0).nonzero().squeeze(1)
        # Only blocks written now take a window, so a window only ever holds K/V written through it (a kept
        # block written before, such as a prefix hit under a short chunk, keeps what it has).
        written = torch.unique(blocks)
        kept = written[torch.isin(written, torch.tensor(sorted(keep), dtype=torch.long, device=blocks.device))]
        for block in kept.tolist():
            self.ensure(block)
        in_window, in_done = torch.isin(blocks, kept), torch.isin(blocks, done)
        if not bool((in_window | in_done).all()):
            raise ValueError("a row lies outside every span: its block is neither kept nor completed")
        open_rows, done_rows = in_window.nonzero().squeeze(1), in_done.nonzero().squeeze(1)
        plan = WritePlan(open_rows, self.slot_of[blocks[open_rows]], offsets[open_rows], done, done_rows,
                         torch.searchsorted(done, blocks[done_rows]), offsets[done_rows], carried,
                         done_slots[carried])
        # After the kept blocks took their slots, so the released windows stay intact (and are read for
        # the completed blocks' earlier tokens) for the rest of this step; the next plan may reuse them.
        self.release(sorted(b for b in passed - keep if b >= 0))  # -1: a table entry dropped (NO_BLOCK)
        return plan

    def overlay(self, layer: int, kind: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Replace gathered blocks ``out`` [n, B, H, D] that have a window by the window's contents."""
        slots = self.slot_of[block_ids]
        hit = (slots >= 0).nonzero().squeeze(1)
        if hit.numel():
            out[hit] = self.data[layer, kind].index_select(0, slots[hit])

    def _reclaim(self) -> None:
        if self.block_in_use is None:
            return
        held = (self.slot_of >= 0).nonzero().squeeze(1).tolist()
        self.release([b for b in held if not self.block_in_use(b)])

    def _grow(self) -> None:
        old = self.data
        self.data = torch.zeros(old.shape[0], old.shape[1], 2 * old.shape[2], *old.shape[3:], dtype=old.dtype,
                                device=old.device)
        self.data[:, :, :old.shape[2]] = old
        self._free = list(range(self.data.shape[2] - 1, old.shape[2] - 1, -1))
