"""Helpers tests share: bounded waiting (never timing asserts), the live-server tests' worker block
counters, and checkpoints with a chat template of a test's own."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path


def free_blocks(server) -> int:
    return sum(w["free_blocks"] for w in server.worker_stats() if w["alive"])


def idle(server) -> bool:
    """No request queued, running or holding blocks anywhere (cached prefix blocks count as free).

    Load reports and the cleanup of a finished or failed request lag its end by a moment: wait for this.
    """
    return all(w["running"] == 0 and w["waiting"] == 0 and w["free_blocks"] == w["total_blocks"]
               for w in server.worker_stats() if w["alive"])


def wait_until(predicate: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def last_sequence(server, session_id: str):
    """The token ids a live server's session store keeps of the session's last turn."""
    import asyncio

    from services.sessions import SessionStore

    async def read():
        store = SessionStore(server.server.cluster.redis_url)
        try:
            return await store.last_sequence(session_id)
        finally:
            await store.close()

    return asyncio.run(read())


def checkpoint_with_template(source: Path, parent: Path, chat_template: str) -> Path:
    """A copy of the checkpoint ``source`` in ``parent`` whose tokenizer_config.json holds ``chat_template``."""
    model = parent / "small-llama"
    shutil.copytree(source, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    return model
