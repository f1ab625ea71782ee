"""Received KV written straight into reserved blocks, as it arrives: no staging copy of the payload.

A payload (``KVCache.export_blocks`` of n blocks) is ``[layers, kinds, n + window_columns, *block]`` in C
order, so its bytes are a run of columns, each one block of one layer and kind (K, V, or a quantized
record). ``BlockImport.write`` maps an arriving byte range onto those columns and copies it into
``data[layer, kind, block_ids[j]]``: whole columns of one (layer, kind) with one indexed row assignment
(numpy's on the host, a memcpy per block; torch's on a GPU), a piece of a column (a chunk cut mid-block)
with a slice copy. Window columns (fp8/kivi2's open last block) are kept
aside and applied by ``finish``, which must run on the engine thread when the cache has windows, since it
changes the window pool's bookkeeping.

The blocks are reserved and in no sequence's table until the caller commits, so bytes written before a
failed checksum are never read: the caller frees the blocks instead. Writes touch only these blocks, so
they may run on a transport thread while the engine computes on others. On CUDA, host bytes (gRPC) are
copied on a side stream, neither waiting behind nor stalling a forward pass launched after the import began
(the stream starts after the device work queued before it); ``finish`` waits for them.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kv_cache import KVCache
from kvstore.transfer.wire import flat_bytes


class BlockImport:
    """One payload's bytes, written in order (or any order) into ``block_ids`` of ``cache``."""

    def __init__(self, cache: KVCache, block_ids: list[int]) -> None:
        layers, kinds = cache.data.shape[:2]
        self.cache, self.block_ids = cache, list(block_ids)
        self.num_blocks = len(block_ids)
        self.columns = self.num_blocks + cache.window_columns  # per (layer, kind) row
        self.column_bytes = cache.data[0, 0, 0].numel() * cache.data.element_size()
        self.total_bytes = layers * kinds * self.columns * self.column_bytes
        # [layer * kind, block, bytes]: every dtype alike (bfloat16 included), each block a contiguous row.
        rows = cache.data.view(torch.uint8).view(layers * kinds, cache.num_blocks, self.column_bytes)
        window = torch.zeros(layers * kinds, cache.window_columns, self.column_bytes, dtype=torch.uint8)
        self._window = window if cache.window_columns else None
        # On the host, numpy's row assignment is a memcpy per block (torch's uint8 index_copy_ goes byte
        # by byte, ~30x slower); on a GPU, torch's, on a side stream.
        self._on_host = cache.device.type == "cpu"
        if self._on_host:
            self._rows, self._window_rows = rows.numpy(), window.numpy()
            self._index = np.asarray(self.block_ids, dtype=np.int64)
            self._stream = None
        else:
            self._rows, self._window_rows = rows, window
            self._index = torch.as_tensor(self.block_ids, dtype=torch.long, device=cache.device)
            self._stream = torch.cuda.Stream(cache.device)
            # A reserved block was free, but a step queued before may still write it (under async scheduling a
            # sequence that ended computes a token more): the side stream's copies come after that work.
            self._stream.wait_stream(torch.cuda.current_stream(cache.device))

    @property
    def needs_engine_thread(self) -> bool:
        """Whether ``finish`` changes engine state (the window pool) and so must run on its thread."""
        return self.cache.windows is not None

    def write(self, offset: int, data: memoryview | bytes | torch.Tensor) -> None:
        """Copy ``data``, the payload's bytes from ``offset``, into the blocks (and window columns)."""
        flat = flat_bytes(data)
        size = len(flat)
        if offset < 0 or offset + size > self.total_bytes:
            raise ValueError(f"{size} B at offset {offset} overrun a {self.total_bytes} B payload")
        # A device tensor (a collective's receive buffer) is copied on the current stream, which its
        # receive is ordered on and the buffer's next receive waits for; host bytes go on the side stream.
        with torch.cuda.stream(None if flat.is_cuda else self._stream):  # None: the current stream
            src, pos, width = self._source(flat), 0, self.column_bytes
            while pos < size:
                column, within = divmod(offset + pos, width)
                row, j = divmod(column, self.columns)
                whole = 0 if within else min((size - pos) // width,
                                             (self.num_blocks if j < self.num_blocks else self.columns) - j)
                if whole == 0:  # a piece of one column: the chunk starts or ends inside it
                    take = min(width - within, size - pos)
                    self._column(row, j)[within:within + take] = src[pos:pos + take]
                    pos += take
                    continue
                part = src[pos:pos + whole * width].reshape(whole, width)
                if j < self.num_blocks:
                    self._rows[row][self._index[j:j + whole]] = part
                else:
                    self._window_rows[row, j - self.num_blocks:j - self.num_blocks + whole] = part
                pos += whole * width

    def finish(self) -> None:
        """Every byte is written and checked: wait for the copies and apply the window columns."""
        if self._stream is not None:
            self._stream.synchronize()
        if self._window is not None:
            self.cache.import_windows(slice(None), self.block_ids, self._window.flatten(1))

    def _source(self, flat: torch.Tensor) -> np.ndarray | torch.Tensor:
        """The bytes where the blocks are: a host array view, or (at most) one copy to the device."""
        return flat.cpu().numpy() if self._on_host else flat.to(self.cache.device)

    def _column(self, row: int, j: int) -> np.ndarray | torch.Tensor:
        if j < self.num_blocks:
            return self._rows[row, self.block_ids[j]]
        return self._window_rows[row, j - self.num_blocks]
