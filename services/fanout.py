"""A request with n > 1 choices: its n sub-request streams, interleaved into one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.messages import TokenEvent


async def interleave(streams: list[AsyncIterator[TokenEvent]]) -> AsyncIterator[TokenEvent]:
    """Every stream's events as they come, once each has produced its first (so every choice is routed,
    and a rejection surfaces, before the first event). The first error ends it; however it ends, every
    stream is closed, which runs its cleanup (abort, free blocks)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[TokenEvent]) -> None:
        try:
            async for event in stream:
                await queue.put(event)
            await queue.put(None)
        except BaseException as exc:
            await queue.put(exc)

    tasks: list[asyncio.Task] = []
    try:
        firsts = [await anext(s) for s in streams]
        tasks = [asyncio.create_task(pump(s)) for s in streams]
        for event in firsts:
            yield event
        pending = len(tasks)  # every pump sends an end marker, even for a stream already finished
        while pending:
            item = await queue.get()
            if item is None:
                pending -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()
