"""Chaos run (issue 14): faults, overload and hostile input against a live ``tidepool serve`` (tiny model,
1 prefill + 1 decode worker, its own Redis) under a bounded streaming load.

    python benchmarks/chaos.py --requests 40 --concurrency 8 --fuzz-http 1000 --fuzz-grpc 500 --json out.json

Scenarios: kill -9 the decode worker, the prefill worker, the private redis-server; idle and garbage TCP
streams on the KV-transfer port; a second decode worker added (``tidepool scale``), then the busier one
drained with no time for its streams (they resume on the other); a burst of 10x the load's concurrency; generated HTTP bodies and gRPC
requests (benchmarks/fuzz_inputs.py). For each: requests sent / completed / rejected (429 with
Retry-After) / 503 with Retry-After (no live worker of a role) / other 5xx / lost, KV blocks still held
once the server is idle, and seconds from the fault until /health is 200 and a probe request completes.
Last, seconds from SIGTERM until the server exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from benchmarks._serve import Served, served  # noqa: E402
from benchmarks.chaos_load import LoadTally, run_load, time_to_recover  # noqa: E402
from benchmarks.fuzz_inputs import fuzz_grpc, fuzz_http  # noqa: E402


# ---- the server's processes ------------------------------------------------------------------------------
def _children(srv: Served) -> list[psutil.Process]:
    return psutil.Process(srv.process.pid).children(recursive=True)


def find_process(srv: Served, marker: str) -> psutil.Process:
    """The server's descendant whose command line names ``marker`` (Ray titles actors ``ray::ClassName``)."""
    for proc in _children(srv):
        with contextlib.suppress(psutil.Error):
            if marker in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                return proc
    raise LookupError(f"no live process of the server named {marker!r}")


def listening_ports(proc: psutil.Process) -> list[int]:
    return sorted({c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN})


def status(srv: Served) -> dict:
    return httpx.get(srv.base_url + "/v1/cluster/status", timeout=10).json()


def held_blocks(srv: Served, wait_s: float = 60.0) -> int:
    """KV blocks live workers still hold once nothing runs or waits (waits up to ``wait_s`` for idle)."""
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            workers = [w for w in status(srv)["workers"] if w["alive"]]
            held = sum(w["total_blocks"] - w["free_blocks"] for w in workers)
            busy = sum(w["running"] + w["waiting"] for w in workers)
            if (held == 0 and busy == 0) or time.monotonic() > deadline:
                return held
        time.sleep(0.25)


# ---- faults ----------------------------------------------------------------------------------------------
def kill_marker(marker: str):
    def inject(srv: Served) -> str:
        proc = find_process(srv, marker)
        proc.send_signal(signal.SIGKILL)
        return f"SIGKILL {marker} pid {proc.pid}"
    return inject


def add_decode(srv: Served) -> str:
    """A decode worker added while the load runs (``tidepool scale``)."""
    workers = sum(w["role"] == "decode" for w in status(srv)["workers"]) + 1
    done = subprocess.run([sys.executable, "-m", "services.cli", "scale", "--url", srv.base_url, "--decode",
                           str(workers)], capture_output=True, text=True, timeout=600)
    return f"tidepool scale --decode {workers}: {(done.stdout + done.stderr).strip()} (exit {done.returncode})"


def drain_busiest_decode(timeout_s: float):
    """The decode worker with the most streams drained while the load runs, its streams given ``timeout_s``
    (0: they resume on another worker at once)."""
    def inject(srv: Served) -> str:
        workers = [w for w in status(srv)["workers"] if w["role"] == "decode" and w["alive"]]
        busiest = max(workers, key=lambda w: w["running"])
        done = httpx.delete(f"{srv.base_url}/v1/cluster/workers/{busiest['id']}", params={"timeout_s": timeout_s},
                            timeout=timeout_s + 60).json()
        return f"drained {busiest['id']} ({busiest['running']} running) with timeout_s={timeout_s:g}: {done}"
    return inject


def hostile_streams(connections: int = 40):
    """Idle TCP connections, random bytes, and an HTTP/2 preface followed by junk frames, on every port the
    decode worker listens on (its KV-transfer server among them); the idle ones stay open during the load."""
    opened: list[socket.socket] = []

    def inject(srv: Served) -> str:
        ports = listening_ports(find_process(srv, "DecodeWorker"))
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        for i in range(connections):
            for port in ports:
                with contextlib.suppress(OSError):
                    sock = socket.create_connection(("127.0.0.1", port), timeout=2)
                    if i % 3 == 1:
                        sock.sendall(os.urandom(4096))
                    elif i % 3 == 2:
                        sock.sendall(preface + b"\x00\x10\x00\x00\x00\x00\x00\x00\x01" + os.urandom(4096))
                    opened.append(sock)
        return f"{len(opened)} idle/garbage connections on decode worker ports {ports}"

    inject.cleanup = lambda: [s.close() for s in opened]  # type: ignore[attr-defined]
    return inject


# ---- one scenario ----------------------------------------------------------------------------------------
async def scenario(srv: Served, name: str, inject, requests: int, concurrency: int, max_tokens: int) -> dict:
    """Start the load, inject the fault once a quarter of it has completed (streams in flight), wait for the
    load and for recovery."""
    tally = LoadTally()
    load = asyncio.create_task(run_load(srv.base_url, srv.model, requests, concurrency, max_tokens, tally))
    note, recovery, in_flight = "", None, None
    if inject is not None:
        while tally.completed < max(1, requests // 4) and not load.done():
            await asyncio.sleep(0.05)
        fault_at, in_flight = time.perf_counter(), tally.in_flight
        note = await asyncio.to_thread(inject, srv)
        recovery = asyncio.create_task(time_to_recover(srv.base_url, srv.model, fault_at))
    await load
    recover_s = await recovery if recovery is not None else None
    if hasattr(inject, "cleanup"):
        inject.cleanup()
    held = await asyncio.to_thread(held_blocks, srv)
    p99 = tally.p99_ttft_s()
    return {"scenario": name, "sent": tally.sent, "in_flight_at_fault": in_flight, "completed": tally.completed,
            "rejected_429": tally.rejected, "503_retry_after": tally.unavailable, "5xx": tally.server_errors,
            "lost": tally.lost,
            "blocks_held_after": held, "recover_s": None if recover_s is None else round(recover_s, 2),
            "p99_ttft_s": None if p99 is None else round(p99, 3), "5xx_statuses": tally.error_statuses,
            "note": note}


def fuzz_rows(srv: Served, http_cases: int, grpc_cases: int) -> list[dict]:
    rows = []
    for name, run, n in (("fuzz http", lambda n: fuzz_http(srv.base_url, srv.model, n), http_cases),
                         ("fuzz grpc", lambda n: fuzz_grpc(srv.grpc_target, srv.model, n), grpc_cases)):
        if n <= 0:
            continue
        start = time.perf_counter()
        tally = run(n)
        healthy = httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
        rows.append({"scenario": name, "cases": tally.cases, "failed": tally.failed,
                     "answers": {str(k): v for k, v in sorted(tally.answers.items(), key=str)},
                     "failures": tally.failures, "healthy_after": healthy,
                     "blocks_held_after": held_blocks(srv), "seconds": round(time.perf_counter() - start, 1)})
    return rows


def sigterm_to_exit(srv: Served, limit_s: float = 120.0) -> float | None:
    start = time.perf_counter()
    srv.process.send_signal(signal.SIGTERM)
    with contextlib.suppress(Exception):
        srv.process.wait(limit_s)
        return round(time.perf_counter() - start, 2)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="streams per scenario (the burst sends 10x)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--fuzz-http", type=int, default=1000, help="generated HTTP cases (0: skip)")
    parser.add_argument("--fuzz-grpc", type=int, default=500, help="generated gRPC cases (0: skip)")
    parser.add_argument("--only", nargs="*", help="run only these scenarios (names as in the table)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    faults = [("baseline", None), ("kill decode", kill_marker("DecodeWorker")),
              ("kill prefill", kill_marker("PrefillWorker")), ("kill redis", kill_marker("redis-server")),
              ("kv port junk", hostile_streams()), ("add decode", add_decode),
              ("drain decode", drain_busiest_decode(0.0))]
    rows, fuzz, exit_s = [], [], None
    started = time.perf_counter()
    # Ray gets a logical CPU more than the two workers' threads: room for the decode worker "add decode" starts.
    with served(["--prefill", "1", "--decode", "1", "--threads-per-worker", "1", "--ray-num-cpus", "3",
                 "--shutdown-timeout", "20"]) as srv:
        srv.model = httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for name, inject in faults:
            if not args.only or name in args.only:
                rows.append(asyncio.run(scenario(srv, name, inject, args.requests, args.concurrency,
                                                 args.max_tokens)))
                print(f"{name}: {rows[-1]}", flush=True)
        if not args.only or "burst" in args.only:
            burst = 10 * args.concurrency
            rows.append(asyncio.run(scenario(srv, "burst 10x", None, max(burst, args.requests), burst,
                                             args.max_tokens)))
            print(f"burst: {rows[-1]}", flush=True)
        fuzz = fuzz_rows(srv, args.fuzz_http, args.fuzz_grpc)
        exit_s = sigterm_to_exit(srv)
    headers = ["scenario", "sent", "in_flight_at_fault", "completed", "rejected_429", "503_retry_after", "5xx", "lost",
               "blocks_held_after", "recover_s", "p99_ttft_s"]
    print(format_table(headers, [[r[h] if r[h] is not None else "-" for h in headers] for r in rows]))
    for r in rows:
        if r["note"] or r["5xx_statuses"]:
            statuses = f"; 5xx statuses {r['5xx_statuses']}" if r["5xx_statuses"] else ""
            print(f"{r['scenario']}: {r['note']}{statuses}")
    for f in fuzz:
        print(f"{f['scenario']}: {f['cases']} cases, {f['failed']} failed, answers {f['answers']}, healthy after "
              f"{f['healthy_after']}, blocks held {f['blocks_held_after']}, {f['seconds']} s")
        for failure in f["failures"]:
            print(f"  failing case: {failure}")
    print(f"SIGTERM to exit: {exit_s} s; whole run {time.perf_counter() - started:.0f} s; "
          f"load average {load_average()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"scenarios": rows, "fuzz": fuzz, "sigterm_to_exit_s": exit_s,
                                               "load_average": load_average()}, indent=2))


if __name__ == "__main__":
    main()
