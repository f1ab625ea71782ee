"""``tidepool serve``: the cluster plus the HTTP and gRPC gateways, stopped together on Ctrl-C/SIGTERM.

Stopping is graceful and bounded: both gateways stop accepting at once, requests in flight get up to
``GatewayConfig.shutdown_timeout_s`` to finish, whatever is left is cancelled by the dispatcher (its
streams end, and its cleanup, which calls the workers, is awaited), then the cluster stops: supervisor,
dispatcher, workers, Ray, Redis. The gateways' own cancellation (uvicorn's graceful timeout, gRPC's
grace) comes later, only as a backstop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn

from services.cluster import Cluster
from services.cluster_status import worker_rows
from services.config import ClusterConfig, GatewayConfig
from services.gateway.background_responses import BackgroundResponses
from services.gateway.grpc import start_grpc_server
from services.gateway.http import create_app
from services.response_store import ResponseStore
from services.sessions import SessionStore

log = logging.getLogger(__name__)

_CLEANUP_WAIT_S = 3.0  # for cancelled requests' cleanup (abort, free blocks) before the workers go
_BACKSTOP_S = _CLEANUP_WAIT_S + 2.0  # the gateways cancel what is still open this long after the drain


class _Uvicorn(uvicorn.Server):
    """uvicorn without signal handlers of its own: ``Server`` takes SIGINT/SIGTERM for both gateways."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Server:
    """One running Tidepool: ``await start()``, then ``await serve_until_stopped()`` or ``await stop()``."""

    def __init__(self, cluster_config: ClusterConfig, gateway: GatewayConfig) -> None:
        self.cluster = Cluster(cluster_config)
        self.gateway = gateway
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task | None = None
        self._grpc = None
        self.sessions: SessionStore | None = None
        self.responses: ResponseStore | None = None
        self._background: BackgroundResponses | None = None  # the HTTP gateway's background responses
        self._stopping: asyncio.Task | None = None
        self._stop_requested = False

    def _on_signal(self) -> None:
        self._stop_requested = True  # a signal during start is acted on once the gateways are up
        if self._http is not None and self._http.started and self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())  # serve_until_stopped waits for it

    @property
    def http_url(self) -> str:
        return f"http://{self.gateway.host}:{self.gateway.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.gateway.host}:{self.gateway.grpc_port}"

    async def start(self, install_signal_handlers: bool = True) -> None:
        try:
            dispatcher = await self.cluster.start()
            if install_signal_handlers:  # after ray.init, which sets its own SIGTERM handler
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, self._on_signal)
            self.sessions = SessionStore(self.cluster.redis_url, ttl_s=self.gateway.session_ttl_s)
            if self.gateway.response_ttl_s > 0:
                self.responses = ResponseStore(self.cluster.redis_url, ttl_s=self.gateway.response_ttl_s)
            app = create_app(dispatcher, self.sessions, self.responses, self.gateway, self.cluster.scaler,
                             self.cluster.autoscaler,
                             self.cluster.lora_updates if self.gateway.allow_runtime_lora_updating else None)
            self._background = app.state.background_responses
            self._grpc = await start_grpc_server(dispatcher, self.sessions, self.gateway)
            config = uvicorn.Config(app, host=self.gateway.host, port=self.gateway.http_port,
                                    log_level="warning", lifespan="off",
                                    timeout_graceful_shutdown=self.gateway.shutdown_timeout_s + _BACKSTOP_S)
            self._http = _Uvicorn(config)
            self._http_task = asyncio.create_task(self._serve_http())
            while not self._http.started:
                if self._http_task.done():
                    self._http_task.result()  # surfaces a bind error
                await asyncio.sleep(0.02)
            if self._stop_requested:
                self._on_signal()
        except BaseException:
            await self.stop()
            raise

    async def _serve_http(self) -> None:
        """uvicorn's serve, its startup failure (the port taken: it logs the error and calls ``sys.exit``) as
        an OSError. A SystemExit leaving a task ends the event loop running it, not the task alone: in a
        ``ThreadedServer`` that loop's thread died and ``start`` waited out its timeout."""
        try:
            await self._http.serve()
        except SystemExit:
            raise OSError(f"the HTTP gateway could not bind {self.http_url}: the port is taken") from None

    async def serve_until_stopped(self) -> None:
        """Serve until Ctrl-C/SIGTERM (or until the HTTP server ends), then stop everything this server
        started."""
        try:
            if self._http_task is not None:
                await asyncio.wait([self._http_task])
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop gracefully (see the module doc); safe to call again, or while a stop is under way."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        # Both gateways stop accepting now; they finish once their requests have.
        closing = []
        if self._http is not None:
            self._http.should_exit = True
            if self._http_task is not None:
                closing.append(self._http_task)
        if self._grpc is not None:
            closing.append(self._grpc.stop(grace=self.gateway.shutdown_timeout_s + _BACKSTOP_S))
        gateways = asyncio.gather(*closing, return_exceptions=True)
        if self.cluster.dispatcher is not None:
            await self.cluster.dispatcher.drain(self.gateway.shutdown_timeout_s, _CLEANUP_WAIT_S)
        for result in await gateways:
            if isinstance(result, Exception):
                log.warning("a gateway stopped with an error: %r", result)
        self._http = self._grpc = None
        if self._background is not None:  # the generations left are cancelled, and kept as such
            await self._background.stop()
            self._background = None
        for store in (self.sessions, self.responses):
            if store is not None:
                await store.close()
        self.sessions = self.responses = None
        await self.cluster.stop()


class ThreadedServer:
    """A ``Server`` on its own event loop thread, for tests and benchmarks in one process."""

    def __init__(self, cluster_config: ClusterConfig, gateway: GatewayConfig) -> None:
        self.server = Server(cluster_config, gateway)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tidepool-server", daemon=True)
        self._thread.start()

    def start(self, timeout_s: float = 300.0) -> ThreadedServer:
        self.run(self.server.start(install_signal_handlers=False), timeout_s)
        return self

    # what a client of this server needs
    @property
    def http_url(self) -> str:
        return self.server.http_url

    @property
    def grpc_target(self) -> str:
        return self.server.grpc_target

    @property
    def api_key(self) -> str | None:
        return self.server.gateway.api_key

    @property
    def max_body_bytes(self) -> int:
        return self.server.gateway.max_body_bytes

    @property
    def dispatcher(self):
        return self.server.cluster.dispatcher

    @property
    def model_id(self) -> str:
        """The model's name in the APIs."""
        return self.dispatcher.served_model_names[0]

    def worker_stats(self) -> list[dict]:
        return worker_rows(self.dispatcher)

    def run(self, coro, timeout_s: float = 60.0):
        """Run a coroutine on the server's loop (e.g. a dispatcher call) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        if not self.running:
            return  # stopped already
        self.run(self.server.stop(), 120.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
