"""Drives one ``engine.Engine`` on a dedicated thread, so a Ray actor's event loop never blocks on a step.

The engine is not thread-safe: every call into it (add, abort, export, import, stats) runs on the engine thread
through ``call``/``acall``; a step's outputs are delivered to their requests' streams (callbacks, e.g. an
``OutputStream``'s or an asyncio queue's) on the actor's event loop, with one wake-up of the loop. The engine's
block events go to the block-event sink (the worker's pool link) from the engine thread, after every step and
every command. Step times are kept for the load reports the router reads.
A step that raises ends the requests it ran with an ``EngineStepError`` in their streams (their blocks
freed), and sets ``failure``: the worker reports itself unhealthy from then on, and is replaced.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.block_events import BlockEvent
from engine.engine import Engine, LayerHook
from engine.engine_stats import StepComposition
from engine.output import RequestOutput
from services.messages import EngineStepError

log = logging.getLogger(__name__)

# Where a request's outputs go, called on the event loop: each of its outputs, or the error that ends it.
StreamSink = Callable[[RequestOutput | EngineStepError], None]

_IDLE_WAIT_S = 0.05


class EngineLoop:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self._loop = loop
        self._commands: queue.SimpleQueue[tuple[Callable[..., Any], tuple, concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, StreamSink] = {}
        self._layer_hooks: list[LayerHook] = []
        self._block_event_sink: Callable[[list[BlockEvent]], None] | None = None
        self.step_times_s: collections.deque[float] = collections.deque(maxlen=32)
        self.steps = 0
        # The latest steps that ran a batch: (step number, what it computed, seconds), for the router's fits.
        self.step_log: collections.deque[tuple[int, StepComposition, float]] = collections.deque(maxlen=32)
        self.stats = engine.stats()  # refreshed on the engine thread, read by load reports without a call
        self.stats_at = time.time()  # when: a report covers the requests the engine had admitted by then
        self.on_stats: Callable[[], None] | None = None  # told on the engine thread each time stats are taken
        self.failure: str | None = None  # what broke a step, once one raised: the worker is unhealthy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- calls from other threads -------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the engine thread; the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, args, future))
        return future

    async def acall(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self.call(fn, *args))

    def open_stream(self, request_id: str, sink: StreamSink) -> None:
        """Register ``sink`` (before the request is added): it is called on the event loop with each of
        ``request_id``'s outputs, or the ``EngineStepError`` that ends it."""
        self._streams[request_id] = sink

    def open_queue(self, request_id: str) -> asyncio.Queue[RequestOutput | EngineStepError]:
        """``open_stream`` into a queue, for a caller that awaits the outputs one by one."""
        stream: asyncio.Queue[RequestOutput | EngineStepError] = asyncio.Queue()
        self.open_stream(request_id, stream.put_nowait)
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def add_layer_hook(self, hook: LayerHook) -> None:
        """``hook(layer, completing)`` runs on the engine thread after each layer's KV of a step is written;
        ``completing`` maps the prefill-only requests whose prompt completes in that step to their block
        tables (``engine.engine.LayerHook``)."""
        self._layer_hooks.append(hook)

    def remove_layer_hook(self, hook: LayerHook) -> None:
        self._layer_hooks.remove(hook)

    def set_block_event_sink(self, sink: Callable[[list[BlockEvent]], None] | None) -> None:
        """``sink(events)`` receives each non-empty batch of the engine's block events, on the engine
        thread. Events taken while no sink is set are dropped (e.g. those of the worker's profiling
        prompts, run before it links to the pool)."""
        self._block_event_sink = sink

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # ---- the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._drain_commands(block=not self.engine.has_unfinished()):
                self._take_stats()
            if not self.engine.has_unfinished():
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step(on_layer_done=self._on_layer_done if self._layer_hooks else None)
            except Exception as exc:  # the thread every request depends on must live on
                log.exception("engine step failed: failing its requests; this worker is now unhealthy")
                self._fail_step(exc)
                continue
            finally:
                self._publish_block_events()  # whatever the step registered or evicted, even if it failed
            seconds = time.perf_counter() - start
            self.step_times_s.append(seconds)
            self.steps += 1
            if self.engine.last_step is not None:
                self.step_log.append((self.steps, self.engine.last_step, seconds))
            self._take_stats()
            self._deliver([(self._streams.get(output.request_id), output) for output in outputs])

    def _take_stats(self) -> None:
        self.stats, self.stats_at = self.engine.stats(), time.time()
        if self.on_stats is not None:
            self.on_stats()

    def _fail_step(self, exc: Exception) -> None:
        """End the requests the failed step ran (the engine's running ones) and free their blocks."""
        self.failure = f"{type(exc).__name__}: {exc}"
        errors = []
        for request_id in {seq.request_id for seq in self.engine.scheduler.running}:
            stream = self._streams.pop(request_id, None)  # the abort notice that follows goes nowhere
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine's state is suspect now; the error still reaches the request
                log.exception("aborting %s after the failed step failed too", request_id)
            errors.append((stream, EngineStepError(f"the engine step running {request_id} failed: {self.failure}")))
        self._deliver(errors)

    def _deliver(self, items: list[tuple[StreamSink | None, RequestOutput | EngineStepError]]) -> None:
        """Hand a step's outputs to their streams (None: a stream closed) with one wake-up of the event
        loop: a wake-up each (a write to the loop's self-pipe under its lock) took the engine thread about 1.4 ms
        a step for a batch of 256, between one step and the next."""
        items = [(stream, item) for stream, item in items if stream is not None]
        if items:
            self._loop.call_soon_threadsafe(_put_all, items)

    def _on_layer_done(self, layer: int, completing: dict[str, list[int]]) -> None:
        for hook in list(self._layer_hooks):
            hook(layer, completing)

    def _publish_block_events(self) -> None:
        events = self.engine.take_block_events()
        sink = self._block_event_sink
        if events and sink is not None:
            try:
                sink(events)
            except Exception:  # the pool index resyncs; the engine thread must keep serving
                log.exception("block event sink failed")

    def _drain_commands(self, block: bool) -> bool:
        """Run every queued command; True when there was at least one."""
        try:
            item = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            fn, args, future = item
            if future.set_running_or_notify_cancel():
                try:
                    result, error = fn(*args), None
                except BaseException as exc:  # delivered to the caller, who knows what it means
                    result, error = None, exc
                # Before the caller resumes: the command's block events (insert_cached_blocks registers
                # blocks) are with the sink, or dropped if none is set yet, so none leaks to a later sink.
                self._publish_block_events()
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True


def _put_all(items: list[tuple[StreamSink, RequestOutput | EngineStepError]]) -> None:
    for sink, item in items:
        sink(item)
