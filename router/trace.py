"""Mooncake-format traces (DESIGN.md section 3): one JSON object a line,
``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``, one hash id per
512-token block of the input; equal ids mean equal prefix content.

The whole file is checked before anything runs; every bad line is reported with its line number.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512
_MAX_REPORTED = 20


class TraceError(ValueError):
    """A trace file that can't be replayed; the message lists the offending lines."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int(row: dict, key: str, minimum: int) -> int:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key!r} must be an integer, got {v!r}")
    if v < minimum:
        raise ValueError(f"{key!r} must be >= {minimum}, got {v}")
    return v


def parse_row(text: str, block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRequest:
    row = json.loads(text)
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    ts = row.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"'timestamp' must be a non-negative number of ms, got {ts!r}")
    n_in, n_out = _int(row, "input_length", 1), _int(row, "output_length", 1)
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in ids):
        raise ValueError("'hash_ids' must be a list of integers")
    if len(ids) != math.ceil(n_in / block_tokens):
        raise ValueError(f"'hash_ids' has {len(ids)} ids, input_length {n_in} needs "
                         f"{math.ceil(n_in / block_tokens)} (one per {block_tokens}-token block)")
    return TraceRequest(ts / 1000.0, n_in, n_out, tuple(ids))


def load_trace(path: str | Path, max_requests: int | None = None,
               block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRequest]:
    """All requests of the trace in arrival order (the first ``max_requests`` of them if given).

    Raises TraceError naming every malformed line (up to 20) before returning anything."""
    rows, errors = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                rows.append(parse_row(text, block_tokens))
            except ValueError as e:  # json.JSONDecodeError is a ValueError too
                errors.append(f"{path}:{lineno}: {e}")
    if errors:
        more = f"\n... and {len(errors) - _MAX_REPORTED} more" if len(errors) > _MAX_REPORTED else ""
        raise TraceError(f"{len(errors)} malformed trace line(s):\n" + "\n".join(errors[:_MAX_REPORTED]) + more)
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep file order
    return rows[:max_requests] if max_requests is not None else rows
