"""A decode worker's receiving side in the test's own process: a tiny-model engine on its engine thread,
a ``HandoffReceiver`` (gRPC server included) and one lease of reserved blocks, all stopped on exit."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine import Engine
from services.engine_loop import EngineLoop
from services.kv_receiver import HandoffReceiver

SECRET = "receiver-test"


@dataclass
class LeasedReceiver:
    engine: Engine
    loop: EngineLoop
    receiver: HandoffReceiver
    blocks: list[int]  # reserved for the lease's request


@contextlib.asynccontextmanager
async def leased_receiver(request_id: str, num_tokens: int, **engine_options) -> AsyncIterator[LeasedReceiver]:
    """Inside a running event loop: the receiver holds a 60 s lease of ``num_tokens`` positions for
    ``request_id`` (the built-in tiny model, 16 blocks, plus ``engine_options``)."""
    engine = Engine(EngineConfig(model="tiny", num_blocks=16, **engine_options))
    loop = EngineLoop(engine, asyncio.get_running_loop())
    receiver = HandoffReceiver("decode-0", engine, loop, secret=SECRET)
    try:
        blocks = await loop.acall(engine.reserve_blocks, request_id, num_tokens)
        receiver.add_lease(request_id, blocks, time.monotonic() + 60)
        yield LeasedReceiver(engine, loop, receiver, blocks)
    finally:
        receiver.stop()
        loop.stop()
