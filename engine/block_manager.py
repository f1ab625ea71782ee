"""Paged KV block allocation: free lists, reference counts, prefix caching, LRU reuse, copy-on-write.

Modelled on vLLM v1's block pool + KV cache manager. A full block whose K/V has been computed is
registered under its chained hash (``kvstore.hashing``), together with its token ids so that a hash
hit is confirmed before it is trusted. A freed registered block keeps its contents and hash: it waits
in an LRU list and a later prompt with the same prefix picks it up again; it is only overwritten when
no never-registered block is free, least recently freed first. Registering and evicting are queued as
``BlockStored`` / ``BlockRemoved`` events, in order; ``take_events`` hands them out (the worker forwards
them to the KV pool).

A sequence whose cache keeps its last ``residual_blocks`` full blocks in full precision (the windows of
``engine/kv_window.py``) registers a full block only once it has moved that far past it, or when it frees
it: until then no other sequence may share it, since they would read it as its record. For the same
reason a prompt never takes those blocks from the prefix cache (``max_prefix_blocks``): a cold run has
them in full precision, so they are recomputed. Each block registered is passed to ``on_register``.

Blocks are reference counted: samples of an ``n > 1`` request share the prompt's blocks after a fork,
and the first write into a shared, partly filled block copies it (``take_copies`` hands the pending
(src, dst) copies to the engine, which applies them to the cache before the next forward pass). A sliding
attention window (``engine/streaming_window.py``) ``drop``s blocks it has passed: their table entries
become ``NO_BLOCK``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from engine.block_events import BlockEvent, BlockRemoved, BlockStored
from engine.errors import OutOfBlocksError
from engine.kv_format import residual_start
from kvstore.hashing import hash_block

NO_BLOCK = -1  # a block table entry whose block was dropped (behind a sequence's attention window)


@dataclass
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chain hashes of the table's first full blocks
    num_slots: int = 0  # token positions the table holds (for the waste count)
    registered: int = 0  # leading hashed blocks offered to the prefix cache; the rest are its residual
    pending: list[tuple[int, ...]] = field(default_factory=list)  # token ids of hashes[registered:]
    salt: bytes | None = None  # what its chain hashes are salted with (None: the manager's)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, salt: bytes, enable_prefix_caching: bool = True,
                 record_events: bool = False, residual_blocks: int = 0,
                 on_register: Callable[[list[int]], None] | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks, self.block_size, self.salt = num_blocks, block_size, salt
        self.enable_prefix_caching = enable_prefix_caching
        self.residual_blocks, self.on_register = residual_blocks, on_register
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id, for registered blocks
        self.free_plain = list(range(num_blocks - 1, -1, -1))  # stack; block 0 is handed out first
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; LRU first
        self.seqs: dict[Hashable, _SeqBlocks] = {}
        self._copies: list[tuple[int, int]] = []
        # Only a worker that publishes to the pool takes the events; elsewhere they would pile up.
        self.record_events = record_events
        self._events: list[BlockEvent] = []

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.seqs[seq_id].table

    def hashes_of(self, block_ids: Sequence[int]) -> list[int | None]:
        """Registered hash of each block (None for a partial or unregistered block)."""
        return [self.block_hash[b] for b in block_ids]

    def max_prefix_blocks(self, num_tokens: int) -> int:
        """The most leading blocks a prompt of ``num_tokens`` takes from the prefix cache: at least one token
        is computed, so the last position yields logits, and so is every block its residual keeps."""
        B = self.block_size
        return max(0, min((num_tokens - 1) // B, residual_start(num_tokens, B, self.residual_blocks)))

    def cached_prefix(self, token_ids: Sequence[int], max_blocks: int | None = None, salt: bytes | None = None
                      ) -> tuple[list[int], list[int]]:
        """(block ids, hashes) of the longest run of leading full blocks found in the prefix cache, their
        chain salted with ``salt`` (None: the manager's); no side effects (``allocate(..., prefix=...)``
        takes the references)."""
        blocks: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        B = self.block_size
        n = len(token_ids) // B if max_blocks is None else min(max_blocks, len(token_ids) // B)
        parent = None
        for i in range(n):
            tokens = tuple(token_ids[i * B:(i + 1) * B])
            parent = hash_block(parent, tokens, salt or self.salt)
            block = self.cached.get(parent)
            if block is None or self.block_tokens[block] != tokens:  # miss, or a hash collision
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def first_new_block_hash(self, token_ids: Sequence[int], prefix_hashes: list[int], salt: bytes | None = None
                             ) -> int | None:
        """The chain hash of the full block of ``token_ids`` right after a cached prefix (``prefix_hashes``,
        ``cached_prefix``'s) under ``salt``; None when there is no such block, or no prefix cache."""
        B, i = self.block_size, len(prefix_hashes)
        if not self.enable_prefix_caching or (i + 1) * B > len(token_ids):
            return None
        parent = prefix_hashes[-1] if prefix_hashes else None
        return hash_block(parent, tuple(token_ids[i * B:(i + 1) * B]), salt or self.salt)

    def usage(self) -> tuple[int, int]:
        """(allocated slots, used slots) over referenced blocks; waste = 1 - used / allocated."""
        B = self.block_size
        used: dict[int, int] = {}
        for s in self.seqs.values():
            for i, b in enumerate(s.table):
                if b == NO_BLOCK:
                    continue
                used[b] = max(used.get(b, 0), min(B, max(0, s.num_slots - i * B)))
        allocated = sum(1 for r in self.ref if r > 0) * B
        return allocated, sum(used.values())

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, num_computed: int, num_new: int,
                 prefix: tuple[list[int], list[int]] | None = None, salt: bytes | None = None) -> bool:
        """Grow ``seq_id``'s table to hold ``num_computed + num_new`` tokens, writes starting at
        ``num_computed``. A sequence's first call may adopt a cached ``prefix`` (from ``cached_prefix``, with
        the same ``salt``, which its blocks are registered under). False, with nothing changed, when the
        free blocks don't suffice."""
        s = self.seqs.get(seq_id)
        total = self.blocks_for(num_computed + num_new)
        if s is None:
            blocks, hashes = prefix or ([], [])
            revived = sum(1 for b in blocks if self.ref[b] == 0)  # free-cached blocks we take back
            if total - len(blocks) + revived > self.num_free_blocks:
                return False
            for b in blocks:
                self._take(b)
            s = self.seqs[seq_id] = _SeqBlocks(list(blocks), list(hashes), registered=len(blocks), salt=salt)
        else:
            B, table = self.block_size, s.table
            cow = num_computed % B != 0 and self.ref[table[num_computed // B]] > 1
            if total - len(table) + cow > self.num_free_blocks:
                return False
            if cow:  # the next write lands in a block another sample still reads: copy it first
                i = num_computed // B
                src, (dst,) = table[i], self._pop_free(1)
                self._copies.append((src, dst))
                self._release(src)
                table[i] = dst
        if total > len(s.table):
            s.table.extend(self._pop_free(total - len(s.table)))
        s.num_slots = max(s.num_slots, num_computed + num_new)
        return True

    def reserve(self, seq_id: Hashable, num_tokens: int, keep_free: int = 0, dropped: range = range(0)
                ) -> list[int]:
        """Blocks for ``num_tokens`` positions that K/V will be imported into (disaggregated decode), leaving
        at least ``keep_free`` blocks free; table ``dropped`` indices (behind an attention window: the
        hand-off does not carry them) stay ``NO_BLOCK``. Returns the blocks taken, in table order."""
        needed = self.blocks_for(num_tokens) - len(dropped)
        if needed + keep_free > self.num_free_blocks:
            raise OutOfBlocksError(needed, self.num_free_blocks, keep_free)
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        taken = iter(self._pop_free(needed))
        table = [NO_BLOCK if i in dropped else next(taken) for i in range(self.blocks_for(num_tokens))]
        self.seqs[seq_id] = _SeqBlocks(table, [], num_tokens)
        return [b for b in table if b != NO_BLOCK]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """``child_id`` shares every block of ``parent_id`` (copy-on-write on the first divergent write)."""
        p = self.seqs[parent_id]
        for b in p.table:
            if b != NO_BLOCK:
                self.ref[b] += 1
        self.seqs[child_id] = _SeqBlocks(list(p.table), list(p.hashes), p.num_slots, p.registered,
                                         list(p.pending), p.salt)

    def free(self, seq_id: Hashable) -> None:
        """Register the residual's blocks no other sample shares, then drop the sequence's references; the
        tail is freed first so it is evicted before its prefix."""
        s = self.seqs.pop(seq_id, None)
        if s is not None:
            self._register(s, len(s.hashes), final=True)
            for b in reversed(s.table):
                if b != NO_BLOCK:
                    self._release(b)

    def drop(self, seq_id: Hashable, indices: range) -> None:
        """Release the sequence's blocks at table ``indices`` (no query of it reads them again); a registered
        block stays cached. Windows drop one growing run, so the walk back from its end stops at the first
        entry dropped before."""
        table = self.seqs[seq_id].table
        for i in reversed(indices):
            if table[i] == NO_BLOCK:
                break
            self._release(table[i])
            table[i] = NO_BLOCK

    def salt_hashes(self, seq_id: Hashable, salt: bytes | None) -> None:
        """Register ``seq_id``'s blocks under ``salt`` from now on (a reservation, before its first hash, learns
        its request's)."""
        s = self.seqs[seq_id]
        if s.hashes:
            raise ValueError(f"sequence {seq_id!r} already hashed blocks under another salt")
        s.salt = salt

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write (src, dst) block copies, to apply before the next forward pass."""
        copies, self._copies = self._copies, []
        return copies

    def _record(self, event: BlockEvent) -> None:
        if self.record_events:
            self._events.append(event)

    def take_events(self) -> list[BlockEvent]:
        """Block events since the last call, oldest first; the queue is cleared."""
        events, self._events = self._events, []
        return events

    # -- prefix cache ----------------------------------------------------------------------------
    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Hash the sequence's full blocks whose K/V is now computed (positions < num_computed) and register
        those behind its residual."""
        if not self.enable_prefix_caching:
            return
        s, B = self.seqs[seq_id], self.block_size
        full = min(num_computed // B, len(s.table))
        if s.registered >= full:  # no block filled since the last call, none waiting to register: a decode step's
            return  # usual case
        parent = s.hashes[-1] if s.hashes else None
        for i in range(len(s.hashes), full):
            tokens = tuple(token_ids[i * B:(i + 1) * B])
            parent = hash_block(parent, tokens, s.salt or self.salt)
            s.hashes.append(parent)
            s.pending.append(tokens)
        self._register(s, min(full, residual_start(num_computed, B, self.residual_blocks)))

    def insert(self, token_ids: Sequence[int], num_blocks: int, salt: bytes | None = None) -> list[tuple[int, int]]:
        """Register the first ``num_blocks`` full blocks of ``token_ids`` as cached, unreferenced blocks (fetched
        from the KV pool), their chain salted with ``salt`` (None: the manager's). Returns (index among those
        blocks, block id) for each block that was not cached yet; the caller writes their K/V. Stops early when
        blocks run out."""
        B = self.block_size
        parent, held, placed = None, [], []
        if not self.enable_prefix_caching:
            return placed
        for i in range(min(num_blocks, len(token_ids) // B)):
            tokens = tuple(token_ids[i * B:(i + 1) * B])
            parent = hash_block(parent, tokens, salt or self.salt)
            existing = self.cached.get(parent)
            if existing is not None and self.block_tokens[existing] == tokens:
                self._take(existing)
                held.append(existing)
                continue
            if existing is not None or not self.free_plain and not self.free_cached:
                break  # a colliding hash, or no room: the rest of the chain is useless without this block
            (block,) = self._pop_free(1)
            self._store(block, parent, tokens)
            held.append(block)
            placed.append((i, block))
        self._stored([b for _, b in placed])
        for b in reversed(held):
            self._release(b)
        return placed

    # -- internals -------------------------------------------------------------------------------
    def _register(self, s: _SeqBlocks, upto: int, final: bool = False) -> None:
        """Offer the hashed blocks ``s.registered .. upto`` to the prefix cache. A block computed twice (two
        prompts raced) is swapped for the registered copy, unless ``final`` (the sequence is being freed);
        ``final`` leaves a block another sample still holds to that sample."""
        count = upto - s.registered
        if count <= 0:
            return
        todo, s.pending = s.pending[:count], s.pending[count:]
        stored: list[int] = []
        for i, tokens in enumerate(todo, start=s.registered):
            block, h = s.table[i], s.hashes[i]
            if block == NO_BLOCK or self.block_hash[block] is not None:
                continue
            existing = self.cached.get(h)
            if existing is None:
                if not (final and self.ref[block] > 1):
                    self._store(block, h, tokens)
                    stored.append(block)
            elif not final and self.ref[block] == 1 and self.block_tokens[existing] == tokens:
                self._take(existing)
                s.table[i] = existing
                self._release(block)
        s.registered = upto
        self._stored(stored)

    def _store(self, block: int, h: int, tokens: tuple[int, ...]) -> None:
        self.cached[h] = block
        self.block_hash[block], self.block_tokens[block] = h, tokens

    def _stored(self, blocks: list[int]) -> None:
        """Announce newly registered blocks: a ``BlockStored`` event and ``on_register``."""
        if blocks:
            self._record(BlockStored([self.block_hash[b] for b in blocks]))
            if self.on_register is not None:
                self.on_register(blocks)

    def _take(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free_cached[block]
        self.ref[block] += 1

    def _release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if self.block_hash[block] is None:
                self.free_plain.append(block)
            else:
                self.free_cached[block] = None  # most recently freed: evicted last

    def _pop_free(self, n: int) -> list[int]:
        """``n`` free blocks: never-registered ones first, then the least recently freed cached ones."""
        out, evicted = [], []
        for _ in range(n):
            if self.free_plain:
                block = self.free_plain.pop()
            else:
                block, _ = self.free_cached.popitem(last=False)
                h = self.block_hash[block]
                del self.cached[h]
                self.block_hash[block] = self.block_tokens[block] = None
                evicted.append(h)
            self.ref[block] = 1
            out.append(block)
        if evicted:
            self._record(BlockRemoved(evicted))
        return out
