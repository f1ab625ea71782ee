"""``tidepool status``: every worker of a running cluster (role, node, device, queue, KV blocks, alive or
dead) and the Redis and router state, read from the gateway's ``GET /v1/cluster/status``."""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

STATUS_PATH = "/v1/cluster/status"


class StatusError(RuntimeError):
    """The gateway could not be reached or gave no status; the message is the whole story (no traceback)."""


def fetch_status(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict:
    return call_gateway(url, STATUS_PATH, api_key, timeout_s)


def call_gateway(url: str, path: str, api_key: str | None = None, timeout_s: float = 10.0, method: str = "GET",
                 **request) -> dict:
    """The JSON answer of one call to the gateway at ``url`` (``request``: httpx's json=, params=); StatusError
    with the whole story when there is none."""
    endpoint = url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.request(method, endpoint, headers=headers, timeout=timeout_s, **request)
    except httpx.ConnectError as e:
        raise StatusError(f"cannot connect to {url} ({str(e) or 'connection refused'}); "
                          "is `tidepool serve` running there?") from None
    except httpx.TimeoutException:
        raise StatusError(f"{endpoint} did not answer within {timeout_s:g} s") from None
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise StatusError(f"{endpoint}: {e}") from None
    if response.status_code == 401:
        raise StatusError(f"{endpoint}: HTTP 401; pass --api-key or set TIDEPOOL_API_KEY")
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if not response.is_success:
        error = answer.get("error") if isinstance(answer, dict) else None
        said = error.get("message") if isinstance(error, dict) else response.text[:200]
        raise StatusError(f"{endpoint}: HTTP {response.status_code} {said!r}")
    if answer is None:
        raise StatusError(f"{endpoint}: the answer is not JSON")
    return answer


def _num(value) -> str:
    return "-" if value is None else str(value)


def _kv_blocks(worker: dict) -> str:
    free, total = worker.get("free_blocks"), worker.get("total_blocks")
    if free is None or not total:
        return "-"
    used = total - free
    return f"{used}/{total} ({100 * used / total:.0f}%)"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in (headers, *rows)]


def _time_ratios(worker: dict) -> str:
    """Its measured steps over the router's models, as "1.00/1.00" ("-" from a gateway without them)."""
    ratios = (worker.get("prefill_time_ratio"), worker.get("decode_time_ratio"))
    return "-" if None in ratios else "/".join(f"{r:.2f}" for r in ratios)


def _report_age(worker: dict) -> str:
    """How old the router's view of the worker is, as "0.04s" ("-": no report yet, or an older gateway)."""
    age = worker.get("report_age_s")
    return "-" if age is None else f"{age:.2f}s"


def render_status(status: dict) -> str:
    """The human view: a header, Redis, router and autoscaler lines, then one row per worker (dead ones say
    DEAD)."""
    redis, router = status.get("redis", {}), status.get("router", {})
    workers = status.get("workers", [])
    lines = [
        f"model {status.get('model', '?')}   policy {status.get('policy', '?')}   "
        f"KV transport {status.get('kv_transport', '?')}",
        f"redis   {redis.get('url', '?')}   {'up' if redis.get('up') else 'DOWN'}   "
        f"{_num(redis.get('indexed_blocks'))} indexed blocks",
        f"router  policy {router.get('policy', '?')}   {_num(router.get('rejections'))} rejections",
        *(f"lora    adapters {', '.join(lora['adapters']) or 'none'}   {_num(lora.get('slots'))} slots a worker   "
          f"running {', '.join(lora.get('running', [])) or 'none'}" for lora in [status.get("lora")] if lora),
        *(f"autoscaler  {role} {plan.get('min')}..{plan.get('max')}   load {_num(plan.get('load'))} workers busy   "
          f"wants {_num(plan.get('wanted'))}" for role, plan in status.get("autoscaler", {}).items()),
        "",
    ]
    rows = [
        [str(w.get("id", "?")), str(w.get("role", "?")), _num(w.get("node")), _num(w.get("device")),
         f"{_num(w.get('waiting'))}/{_num(w.get('running'))}", _kv_blocks(w), _time_ratios(w), _report_age(w),
         "draining" if w.get("draining") else "alive" if w.get("alive") else "DEAD"]
        for w in workers
    ]
    lines += _table(["WORKER", "ROLE", "NODE", "DEVICE", "QUEUE wait/run", "KV BLOCKS used/total",
                     "STEP TIME prefill/decode", "REPORT AGE", "STATE"], rows)
    dead = sum(1 for w in workers if not w.get("alive"))
    lines += ["", f"{len(workers)} workers: {len(workers) - dead} alive, {dead} dead"]
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    try:
        status = fetch_status(args.url, args.api_key or os.environ.get("TIDEPOOL_API_KEY"), args.timeout_s)
    except StatusError as e:
        print(f"tidepool status: {e}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else render_status(status))
    return 0


DESCRIPTION = (
    "Show every worker of a running cluster (role, node, device, queue, KV blocks, step times against the "
    "router's models, alive or dead) and the "
    "Redis and router state, as the gateway reports them at GET /v1/cluster/status."
)


def add_status_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("status", help="show every worker, the KV pool and the router of a running cluster",
                              description=DESCRIPTION)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's HTTP address")
    p.add_argument("--api-key", default=None, help="bearer key (default: $TIDEPOOL_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the status JSON instead of the table")
    p.add_argument("--timeout-s", type=float, default=10.0, help="seconds to wait for the gateway's answer")
    p.set_defaults(func=run_status)
    return p
