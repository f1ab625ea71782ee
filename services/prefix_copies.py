"""The prefix copies a routing decision asks for, in the dispatcher's terms: the peer fetch a prefill
worker makes before computing the prompt (``PrefixFetch``: the holder's handle and how long it may wait for
blocks it is still computing), and the hot-prefix replications the conductor starts beside a request.
A pool read is no decision's: every worker weighs it itself (``services/pool_link.py``)."""

from __future__ import annotations

from router.conductor import Conductor, Decision
from services.background import BackgroundTasks
from services.messages import PrefixFetch
from services.worker_client import WorkerClient


class PrefixCopies:
    def __init__(self, workers: dict[str, WorkerClient], conductor: Conductor, block_size: int,
                 timeout_s: float) -> None:
        self.workers, self.conductor = workers, conductor  # workers: the dispatcher's own, kept current
        self.block_size, self.timeout_s = block_size, timeout_s
        self.running = BackgroundTasks("a hot-prefix copy")

    def fetch_for(self, decision: Decision, salt: bytes, source: str | None = None,
                  blocks: int = 0) -> PrefixFetch | None:
        """The peer copy ``decision`` asks for (of ``blocks`` from ``source``, when given) of blocks hashed under
        ``salt``; None without one."""
        source = source or decision.fetch_from
        holder = self.workers.get(source) if source is not None else None
        if holder is None:  # "pool", or a holder that is gone since
            return None
        return PrefixFetch(source, blocks or decision.cached_blocks, self.conductor.copy_wait_s(decision),
                           holder.actor, salt)

    def replicate(self, decision: Decision, tokens: list[int], salt: bytes) -> None:
        """Start the hot-prefix copies the conductor asked for, in the background: they only warm a cache,
        and the requests wanting them are routed by what the index shows once they landed."""
        for copy in decision.replicate:
            fetch, taker = self.fetch_for(decision, salt, copy.src, copy.blocks), self.workers.get(copy.dst)
            if fetch is None or taker is None:
                continue
            self.running.spawn(taker.copy_prefix(tokens[: copy.blocks * self.block_size + 1], fetch,
                                                 self.timeout_s))
