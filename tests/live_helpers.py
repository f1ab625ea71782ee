"""Helpers tests share: bounded waiting (never timing asserts), the live-server tests' worker block
counters, checkpoints with a chat template of a test's own, greedy chats (whole or streamed), what one
engine in the test's process produces for prompts a cluster serves, and a worker run in the test's process
(its requests' events read off its token feed, as a gateway reads them)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import openai
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from services.messages import Role, TokenEvent
from services.token_feed import decode_batch
from services.worker import Worker, WorkerSpec


def free_blocks(server) -> int:
    return sum(w["free_blocks"] for w in server.worker_stats() if w["alive"])


def idle(server) -> bool:
    """No request queued, running or holding blocks anywhere (cached prefix blocks count as free).

    Load reports and the cleanup of a finished or failed request lag its end by a moment: wait for this. The
    reports are asked for now: the periodic refresh's latest may have been taken before the request began.
    """
    server.run(server.dispatcher.refresh_loads())
    return all(w["running"] == 0 and w["waiting"] == 0 and w["free_blocks"] == w["total_blocks"]
               for w in server.worker_stats() if w["alive"])


def one_engine_outputs(model_dir, prompts: dict, params: SamplingParams) -> dict:
    """The tokens ``prompts`` (key -> token ids) get from one engine in this process, all batched together:
    what a cluster serving the same checkpoint must produce for each, whichever workers serve it."""
    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=1024))
    for key, prompt in prompts.items():
        engine.add_request(repr(key), prompt, params)
    out = {key: [] for key in prompts}
    by_id = {repr(key): key for key in prompts}
    while engine.has_unfinished():
        for output in engine.step():
            out[by_id[output.request_id]].extend(output.new_token_ids)
    return out


def colocated_spec(model_dir: Path, **fields) -> WorkerSpec:
    """A colocated worker's spec for a worker built in the test's process (no Redis, gRPC transport)."""
    return WorkerSpec("colocated-0", Role.COLOCATED, EngineConfig(model=str(model_dir), num_blocks=64, max_num_seqs=2),
                      None, 1, "grpc", True, 16, 0, None, 0, "secret", "unused: no Redis", **fields)


async def request_events(worker: Worker, request_id: str, *args) -> AsyncIterator[TokenEvent]:
    """``worker.generate(emit, request_id, *args)``'s events as its gateway receives them: on a token feed (one
    of the request's own), through the worker's stream methods; a failure raises. Closing it stops the request."""
    feed = worker.feed(request_id)
    await worker.start_stream(request_id, request_id, (request_id, *args))
    try:
        async for batch in feed:
            for _, item in decode_batch(batch):
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        await feed.aclose()


def run_keeping_torch_threads(main: Callable[[], Awaitable[None]]) -> None:
    """``asyncio.run(main())``, then torch's thread count as it was (a worker built in this process sets its own)."""
    threads = torch.get_num_threads()
    try:
        asyncio.run(main())
    finally:
        torch.set_num_threads(threads)


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


# ---- greedy chats against a live server (ignore_eos: exactly max_tokens tokens) ----------------------------

def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0, timeout=180)


def user_message(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def greedy(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


def greedy_chat(server, text: str, max_tokens: int) -> str:
    resp = openai_client(server).chat.completions.create(model=server.model_id, messages=user_message(text),
                                                         **greedy(max_tokens))
    return resp.choices[0].message.content


class Streams:
    """Greedy streamed chats, one thread each; ``wait_started`` until every stream has its first text."""

    def __init__(self, server, texts: list[str], max_tokens: int) -> None:
        self.texts: list[list[str]] = [[] for _ in texts]
        self.errors: list[BaseException] = []
        self._first = [threading.Event() for _ in texts]
        self._threads = [threading.Thread(target=self._run, args=(server, i, t, max_tokens), daemon=True)
                         for i, t in enumerate(texts)]
        for thread in self._threads:
            thread.start()

    def _run(self, server, i: int, text: str, max_tokens: int) -> None:
        try:
            stream = openai_client(server).chat.completions.create(
                model=server.model_id, messages=user_message(text), stream=True, **greedy(max_tokens))
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    self.texts[i].append(chunk.choices[0].delta.content)
                    self._first[i].set()
        except BaseException as exc:
            self.errors.append(exc)
            self._first[i].set()

    def wait_started(self) -> bool:
        return all(event.wait(120) for event in self._first)

    def join(self) -> list[str]:
        for thread in self._threads:
            thread.join(200)
        assert not self.errors, self.errors
        return ["".join(parts) for parts in self.texts]
