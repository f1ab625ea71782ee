"""A private ``redis-server`` child on a free loopback port, owned by whoever starts it.

The launcher and the test fixture both use this, so neither depends on a Redis someone else runs.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis


class RedisServerError(RuntimeError):
    """redis-server is missing or did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """Starts ``redis-server`` on ``port`` (a free one by default); ``stop()`` ends it and its files."""

    def __init__(self, port: int | None = None, maxmemory_bytes: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerError("redis-server not found on PATH; install it (apt-get install redis-server)")
        self.port = port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="tidepool-redis-")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self._dir.name, "--logfile", ""]
        if maxmemory_bytes:
            args += ["--maxmemory", str(maxmemory_bytes)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RedisServerError(f"redis-server exited with code {self.process.returncode}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.05)
            self.stop()
            raise RedisServerError(f"redis-server did not answer on port {self.port} within {timeout_s}s")
        finally:
            client.close()

    def restart(self) -> None:
        """Kill and start again on the same port (used to test reconnects)."""
        self.kill()
        self.process = subprocess.Popen(self.process.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._dir.cleanup()

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
