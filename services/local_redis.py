"""A private ``redis-server`` child on a free loopback port, owned by whoever starts it.

The launcher and the test fixture both use this, so neither depends on a Redis someone else runs. The
launcher's Redis has a password (``requirepass``; the URL carries it) and a watcher: a server that dies is
restarted on the same port with the same password, and clients reconnect on their own. Its data is not
persisted, so a restart empties it (the KV pool rebuilds itself; chat sessions start over). The server's
settings go to a config file in its private directory, never on the command line, where ``ps`` shows
them to every user of the machine.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from urllib.parse import quote

import redis

log = logging.getLogger(__name__)

_RESTART_BACKOFF_S = (0.1, 0.5, 1.0, 2.0)  # between failed restarts; the last one repeats


class RedisServerError(RuntimeError):
    """redis-server is missing or did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RedisTLS:
    """A TLS listener instead of plain TCP: the server's certificate and key, and the CA that signed it
    (clients verify the server with it; the URL names it as ``ssl_ca_certs``)."""

    cert_file: str
    key_file: str
    ca_file: str


class LocalRedis:
    """Starts ``redis-server`` on ``port`` (a free one by default); ``stop()`` ends it and its files.

    ``password``: required from every client (``requirepass``). ``tls``: serve ``rediss://`` only.
    ``restart_on_exit``: a watcher thread restarts a server that exits (killed, crashed) until ``stop()``.
    """

    def __init__(self, port: int | None = None, maxmemory_bytes: int | None = None, password: str | None = None,
                 tls: RedisTLS | None = None, restart_on_exit: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerError("redis-server not found on PATH; install it (apt-get install redis-server)")
        self.port = port or free_port()
        self.password, self.tls = password, tls
        self.restarts = 0  # times the watcher brought the server back
        self._dir = tempfile.TemporaryDirectory(prefix="tidepool-redis-")  # mode 0700: the config is private
        self._args = [binary, self._write_config(maxmemory_bytes)]
        self._lock = threading.Lock()  # one (re)start at a time; stop() waits for a restart in progress
        self._stopped = threading.Event()
        self._watcher: threading.Thread | None = None
        self.process = self._spawn()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        if restart_on_exit:
            self._watcher = threading.Thread(target=self._watch, name=f"redis-watch-{self.port}", daemon=True)
            self._watcher.start()

    def _write_config(self, maxmemory_bytes: int | None) -> str:
        lines = ["bind 127.0.0.1", 'save ""', "appendonly no", f"dir {self._dir.name}", 'logfile ""']
        if self.tls is None:
            lines.append(f"port {self.port}")
        else:
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {self.tls.cert_file}",
                      f"tls-key-file {self.tls.key_file}", f"tls-ca-cert-file {self.tls.ca_file}",
                      "tls-auth-clients no"]
        if self.password:
            lines.append(f"requirepass {self.password}")
        if maxmemory_bytes:
            lines.append(f"maxmemory {maxmemory_bytes}")
        path = os.path.join(self._dir.name, "redis.conf")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        return path

    @property
    def url(self) -> str:
        """``redis://`` (``rediss://`` with TLS) with the password, and with TLS the CA to verify against."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={quote(self.tls.ca_file, safe='/')}"

    def _spawn(self) -> subprocess.Popen:
        # A process group of its own: a terminal's Ctrl-C signals the foreground group, and the launcher's
        # graceful shutdown still needs Redis while requests in flight finish; stop() ends the server.
        return subprocess.Popen(self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
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
            raise RedisServerError(f"redis-server did not answer on port {self.port} within {timeout_s}s")
        finally:
            client.close()

    def _watch(self) -> None:
        """Wait on the server; when it exits without ``stop()``, start it again (same port, password)."""
        failures = 0
        while not self._stopped.is_set():
            process = self.process
            process.wait()  # also reaps it: a dead server never lingers as a zombie
            with self._lock:
                if self._stopped.is_set() or self.process is not process:  # stopping, or restart() ran
                    continue
                log.warning("private redis-server on port %d exited with code %s; restarting it",
                            self.port, process.returncode)
                try:
                    self._start_again()
                    self.restarts += 1
                    failures = 0
                    continue
                except RedisServerError as exc:
                    failures += 1
                    log.error("restarting redis-server on port %d failed (%s); trying again", self.port, exc)
            self._stopped.wait(_RESTART_BACKOFF_S[min(failures, len(_RESTART_BACKOFF_S)) - 1])

    def _start_again(self) -> None:
        self._end(self.process, kill=True)
        self.process = self._spawn()
        try:
            self._wait_ready()
        except RedisServerError:
            self._end(self.process, kill=True)
            raise

    def restart(self) -> None:
        """Kill and start again on the same port (used to test reconnects)."""
        with self._lock:
            self._start_again()

    def kill(self) -> None:
        """End the server abruptly, as a crash would (the watcher, if any, restarts it)."""
        self._end(self.process, kill=True)

    @staticmethod
    def _end(process: subprocess.Popen, kill: bool = False) -> None:
        if process.poll() is None:
            if kill:
                process.kill()
            else:
                process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            self._end(self.process)
        if self._watcher is not None:
            self._watcher.join(timeout=30)
        self._dir.cleanup()

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
