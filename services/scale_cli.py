"""``tidepool scale``: set how many workers of each role a running cluster has. It reads the workers from the
gateway (``GET /v1/cluster/status``), adds the missing ones (``POST /v1/cluster/workers``) and then drains
the extra ones (``DELETE /v1/cluster/workers/{id}``), so capacity shifted from one role to another is
there before it is taken away. The workers drained are those with the least running on them."""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from services.cluster_status import drain_order
from services.status import StatusError, call_gateway, fetch_status

WORKERS_PATH = "/v1/cluster/workers"
_ADD_TIMEOUT_S = 900.0  # placement (the server's --placement-timeout) plus the worker's start and profile


def plan(workers: list[dict], wanted: dict[str, int]) -> tuple[list[str], list[str]]:
    """(roles to add, one entry per worker; ids to drain) that bring each role in ``wanted`` to its count.
    A role counts its workers not draining, dead ones included (the server replaces those); the ones drained
    are the dead, then the least busy, then the newest."""
    add, drain = [], []
    for role, count in wanted.items():
        kept = [w for w in workers if w["role"] == role and not w.get("draining")]
        add += [role] * max(0, count - len(kept))
        kept.sort(key=drain_order)
        drain += [w["id"] for w in kept[:max(0, len(kept) - count)]]
    return add, drain


def run_scale(args: argparse.Namespace) -> int:
    wanted = {role: n for role, n in (("prefill", args.prefill), ("decode", args.decode),
                                      ("colocated", args.colocated)) if n is not None}
    if not wanted:
        print("tidepool scale: give --prefill, --decode or --colocated", file=sys.stderr)
        return 2
    if any(n < 1 for n in wanted.values()):
        print("tidepool scale: every role keeps at least one worker", file=sys.stderr)
        return 2
    key = args.api_key or os.environ.get("TIDEPOOL_API_KEY")
    try:
        add, drain = plan(fetch_status(args.url, key, args.timeout_s)["workers"], wanted)
    except StatusError as e:
        print(f"tidepool scale: {e}", file=sys.stderr)
        return 1
    if not add and not drain:
        print("tidepool scale: nothing to change")
        return 0
    failed = 0
    with ThreadPoolExecutor(max(len(add), len(drain), 1)) as pool:
        for step, items in (("add", add), ("drain", drain)):
            calls = [pool.submit(_add if step == "add" else _drain, args, key, item) for item in items]
            for item, call in zip(items, calls, strict=True):
                try:
                    print(call.result(), flush=True)
                except StatusError as e:
                    failed += 1
                    print(f"tidepool scale: {step} {item}: {e}", file=sys.stderr)
    return 1 if failed else 0


def _add(args: argparse.Namespace, key: str | None, role: str) -> str:
    row = call_gateway(args.url, WORKERS_PATH, key, _ADD_TIMEOUT_S, "POST", json={"role": role})
    return f"added {row['id']} ({role}) on {row['node']} {row['device']}"


def _drain(args: argparse.Namespace, key: str | None, worker_id: str) -> str:
    done = call_gateway(args.url, f"{WORKERS_PATH}/{worker_id}", key, args.drain_timeout_s + 60.0, "DELETE",
                        params={"timeout_s": args.drain_timeout_s})
    resumed = f", {done['resumed']} requests resumed elsewhere" if done["resumed"] else ""
    return f"drained {worker_id} ({done['role']}) after {done['waited_s']:.1f} s{resumed}"


DESCRIPTION = (
    "Set how many prefill, decode (or colocated) workers a running cluster has: missing workers are added "
    "(placed by Ray as at start), then extra ones drained: routed nothing more, given --drain-timeout-s for "
    "what runs on them (the rest resumes on other workers), and stopped."
)


def add_scale_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("scale", help="add or drain workers of a running cluster", description=DESCRIPTION)
    p.add_argument("--prefill", type=int, default=None, help="prefill workers wanted")
    p.add_argument("--decode", type=int, default=None, help="decode workers wanted")
    p.add_argument("--colocated", type=int, default=None, help="colocated workers wanted")
    p.add_argument("--drain-timeout-s", type=float, default=60.0,
                   help="seconds a drained worker's requests get to finish before they resume elsewhere")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's HTTP address")
    p.add_argument("--api-key", default=None, help="bearer key (default: $TIDEPOOL_API_KEY)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="seconds to wait for the status answer")
    p.set_defaults(func=run_scale)
    return p
