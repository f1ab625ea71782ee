"""A gateway port taken between choosing it and binding it: the HTTP gateway's start fails with an OSError at
once, and the server's event loop keeps running (uvicorn's own sys.exit used to end a ThreadedServer's loop
thread, so start waited out its whole timeout and the test fixture's retry on fresh ports never ran)."""

from __future__ import annotations

import socket

import pytest
import uvicorn

from engine.config import EngineConfig
from services.config import ClusterConfig, GatewayConfig
from services.serve import ThreadedServer, _Uvicorn

pytestmark = pytest.mark.timeout(60)


async def _empty_app(scope, receive, send) -> None:
    raise AssertionError("never served")


def test_a_taken_http_port_fails_with_an_oserror_and_the_loop_keeps_running():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ThreadedServer(ClusterConfig(engine=EngineConfig(model="tiny")), GatewayConfig(http_port=port))
        try:
            server.server._http = _Uvicorn(uvicorn.Config(_empty_app, host="127.0.0.1", port=port,
                                                          log_level="critical", lifespan="off"))
            with pytest.raises(OSError, match=f"could not bind http://127.0.0.1:{port}"):
                server.run(server.server._serve_http(), 30)
            assert server.running and server.run(_answer(), 5) == 42  # the loop still runs coroutines
        finally:
            server.stop()


async def _answer() -> int:
    return 42
