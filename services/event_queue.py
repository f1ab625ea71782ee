"""The queue between a stream's token events and their consumer, which joins the events of a choice its
consumer has not taken yet into one (as vLLM's ``RequestOutputCollector`` merges outputs).

A consumer slower than its producer (a gateway turning events into chunks while the workers step faster, a
client reading slowly) then takes one event for all that piled up, with every token in it, and stays current
at a cost per turn instead of falling further behind at a cost per token. A consumer that keeps up sees each
event as it was sent.
"""

from __future__ import annotations

import asyncio
import time

from services.messages import TokenEvent, join_events


class _Run(list):
    """Two or more waiting token events of one choice, joined when taken."""


class TokenEventQueue(asyncio.Queue):
    """An ``asyncio.Queue`` of token events and other items (a stream's end, its failure): a token event put
    while earlier ones of its choice wait, none finishing it, is taken with them as one. Nothing is joined
    across another item, which ends the stream. (``_put`` and ``_get`` are asyncio.Queue's hooks, as
    ``PriorityQueue``'s.) ``last_put``: when an item last came (``time.monotonic``), or the queue was made."""

    def __init__(self) -> None:
        super().__init__()
        self.last_put = time.monotonic()

    def _put(self, item: object) -> None:
        self.last_put = time.monotonic()
        waiting = self._queue
        if isinstance(item, TokenEvent):
            for k in range(len(waiting) - 1, -1, -1):  # (nothing waits while the consumer keeps up)
                earlier = waiting[k]
                last = earlier[-1] if isinstance(earlier, _Run) else earlier
                if not isinstance(last, TokenEvent):
                    break
                if last.index == item.index:
                    if last.finish_reason is None:
                        if isinstance(earlier, _Run):
                            earlier.append(item)
                        else:
                            waiting[k] = _Run([earlier, item])
                        return
                    break
        waiting.append(item)

    def _get(self) -> object:
        item = self._queue.popleft()
        return join_events(item) if isinstance(item, _Run) else item
