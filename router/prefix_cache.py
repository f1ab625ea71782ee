"""An in-memory prefix index and the LRU block caches that feed it (the simulator's stand-in for the
KV pool's index, and the benchmark's million-block index).

Hashes are chained (kvstore.hashing; the trace's hash ids behave the same), so a holder matches a prompt
up to the first block it lacks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    """block hash -> holders; holders are kept as tuples (most blocks have one holder: small and flat)."""

    def __init__(self) -> None:
        self._holders: dict[int, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, holder: str, hashes: Iterable[int]) -> None:
        for h in hashes:
            cur = self._holders.get(h, ())
            if holder not in cur:
                self._holders[h] = (*cur, holder)

    def remove(self, holder: str, hashes: Iterable[int]) -> None:
        for h in hashes:
            cur = self._holders.get(h, ())
            if holder in cur:
                rest = tuple(x for x in cur if x != holder)
                if rest:
                    self._holders[h] = rest
                else:
                    del self._holders[h]

    def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """{holder: number of leading blocks of ``hashes`` it holds} for every holder of the first block."""
        first = self._holders.get(hashes[0]) if hashes else None
        if not first:
            return {}
        live, out, prev = set(first), {}, first
        for i in range(1, len(hashes)):
            cur = self._holders.get(hashes[i], ())
            if cur == prev:  # same holders as the block before: nobody drops out (the common case)
                continue
            prev = cur
            gone = [w for w in live if w not in cur]
            for w in gone:
                out[w] = i
                live.discard(w)
            if not live:
                return out
        for w in live:
            out[w] = len(hashes)
        return out


class BlockCache:
    """One holder's blocks with a capacity, evicting least recently used; mirrored into a PrefixIndex."""

    def __init__(self, holder: str, capacity_blocks: int, index: PrefixIndex):
        self.holder, self.capacity, self.index = holder, capacity_blocks, index
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def leading(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` this cache holds."""
        for i, h in enumerate(hashes):
            if h not in self._lru:
                return i
        return len(hashes)

    # Parents are refreshed last so they stay more recent than their children: evicting a child first
    # keeps the rest of the prefix usable, evicting a parent would strand every block after it.
    def touch(self, hashes: Sequence[int]) -> None:
        for h in reversed(hashes):
            if h in self._lru:
                self._lru.move_to_end(h)

    def clear(self) -> None:
        """Forget every block (the holder is gone)."""
        self.index.remove(self.holder, list(self._lru))
        self._lru.clear()

    def insert(self, hashes: Sequence[int]) -> None:
        if self.capacity <= 0:
            return
        new = []
        for h in reversed(hashes[: self.capacity]):
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._lru[h] = None
                new.append(h)
        self.index.add(self.holder, new)
        evicted = []
        while len(self._lru) > self.capacity:
            evicted.append(self._lru.popitem(last=False)[0])
        self.index.remove(self.holder, evicted)
