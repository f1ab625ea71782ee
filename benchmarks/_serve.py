"""Start and stop a server subprocess for the benchmarks: ``tidepool serve`` (or any command that serves
HTTP) on free loopback ports, ready once ``/health`` answers 200.

    with served(["--colocated", "1"]) as srv:
        run_benchmark(BenchConfig(model=srv.model, base_url=srv.base_url, ...))

The server runs in its own process group; stopping sends it SIGINT (what Ctrl-C does, so Ray, Redis and the
workers are torn down by the server itself), then ends whatever of its group is left (SIGKILL if it hangs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    process: subprocess.Popen
    base_url: str
    model: str
    log_path: Path
    grpc_target: str | None = None  # Tidepool's gRPC API, when the server is ours

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def tidepool_command(args: list[str], http_port: int, grpc_port: int) -> list[str]:
    return [sys.executable, "-m", "services.cli", "serve", "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), *args]


def start(command: list[str], base_url: str, model: str, timeout_s: float = 600.0,
          health_path: str = "/health", env: dict[str, str] | None = None) -> Served:
    """Run ``command`` (output to a log file) and wait until ``base_url + health_path`` answers 200."""
    log = Path(tempfile.mkstemp(prefix="bench-serve-", suffix=".log")[1])
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
    served = Served(process, base_url, model, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{served.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + health_path, timeout=2.0).status_code == 200:
                return served
        time.sleep(0.5)
    stop(served)
    raise TimeoutError(f"server not healthy after {timeout_s:.0f}s:\n{served.log_tail()}")


def stop(served: Served, grace_s: float = 60.0) -> None:
    if served.process.poll() is None:
        served.process.send_signal(signal.SIGINT)
        try:
            served.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            served.process.kill()
            served.process.wait()
    with contextlib.suppress(ProcessLookupError):  # children that outlived it (none when it stopped cleanly)
        os.killpg(served.process.pid, signal.SIGKILL)
    served.log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def served(serve_args: list[str], timeout_s: float = 600.0) -> Iterator[Served]:
    """A ``tidepool serve`` with ``serve_args`` on free ports, serving the built-in tiny model by default."""
    port, grpc_port = free_port(), free_port()
    model = serve_args[serve_args.index("--model") + 1] if "--model" in serve_args else "tiny"
    srv = start(tidepool_command(serve_args, port, grpc_port), f"http://127.0.0.1:{port}", model, timeout_s)
    srv.grpc_target = f"127.0.0.1:{grpc_port}"
    try:
        yield srv
    finally:
        stop(srv)


@contextlib.contextmanager
def served_command(command: list[str], port: int, model: str, health_path: str,
                   timeout_s: float = 600.0) -> Iterator[Served]:
    """Any other OpenAI-compatible server (a peer to compare with), started and stopped the same way."""
    srv = start(command, f"http://127.0.0.1:{port}", model, timeout_s, health_path)
    try:
        yield srv
    finally:
        stop(srv)


def add_chat_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, users: int, turns: int) -> None:
    """The load-test harness's multi-turn ``chat`` workload, as the chat benchmarks take it."""
    parser.add_argument("--users", type=int, default=users)
    parser.add_argument("--turns", type=int, default=turns)
    parser.add_argument("--message-len", type=int, default=256, help="tokens of each user message")
    parser.add_argument("--answer-len", type=int, default=32, help="tokens of each answer")
    parser.add_argument("--system-len", type=int, default=256, help="tokens of system prompt shared by all users")
    parser.add_argument("--user-rate", type=float, default=1.0, help="users (conversations) starting per second")
    parser.add_argument("--think-time-s", type=float, default=1.0)


def chat_workload(args: argparse.Namespace) -> dict:
    """``BenchConfig`` fields of the ``chat`` workload ``add_chat_arguments`` parsed."""
    return dict(workload="chat", num_users=args.users, turns=args.turns, think_time_s=args.think_time_s,
                input_len=args.message_len, output_len=args.answer_len, prefix_len=args.system_len,
                request_rate=args.user_rate)
