"""Mooncake-format traces (DESIGN.md section 3): one JSON object a line,
``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``, one hash id per
512-token block of the input; equal ids mean equal prefix content.

The one reader of the simulator and the load test. The whole file is checked before anything runs, so
a bad line costs seconds, not a half-finished benchmark; every bad line is reported with its line number.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_MAX_REPORTED = 20


class TraceError(ValueError):
    """A trace that can't be replayed. ``errors`` holds every ``(line, message)`` found (1-based lines;
    0 for the file as a whole) and ``line`` the first bad one; the message names file and line of each."""

    def __init__(self, path: str | Path, errors: list[tuple[int, str]]):
        self.path, self.errors, self.line = str(path), errors, errors[0][0]
        shown = [f"{path}:{line}: {msg}" if line else f"{path}: {msg}" for line, msg in errors[:_MAX_REPORTED]]
        if len(errors) > _MAX_REPORTED:
            shown.append(f"... and {len(errors) - _MAX_REPORTED} more")
        head = [f"{len(errors)} malformed trace lines:"] if len(errors) > 1 else []
        super().__init__("\n".join(head + shown))


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_row(text: str, block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRequest:
    """Parse one trace line; raises ValueError naming the offending field."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    missing = [k for k in _FIELDS if k not in row]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    ts, n_in, n_out, ids = (row[k] for k in _FIELDS)
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a non-negative number of ms, got {ts!r}")
    if not _is_int(n_in) or n_in < 1:
        raise ValueError(f"input_length must be a positive integer, got {n_in!r}")
    if not _is_int(n_out) or n_out < 1:
        raise ValueError(f"output_length must be a positive integer, got {n_out!r}")
    if not isinstance(ids, list) or not all(_is_int(h) and h >= 0 for h in ids):
        raise ValueError("hash_ids must be a list of non-negative integers")
    if len(ids) != math.ceil(n_in / block_tokens):
        raise ValueError(f"{len(ids)} hash_ids for input_length {n_in}: expected ceil({n_in}/{block_tokens}) = "
                         f"{math.ceil(n_in / block_tokens)}")
    return TraceRequest(ts / 1000.0, n_in, n_out, tuple(ids))


def load_trace(path: str | Path, max_requests: int | None = None,
               block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRequest]:
    """All requests of the trace in arrival order (the first ``max_requests`` of them if given); blank
    lines are skipped. Raises TraceError naming every malformed line before returning anything."""
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be at least 1, got {max_requests}")
    rows: list[TraceRequest] = []
    errors: list[tuple[int, str]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                rows.append(parse_row(text, block_tokens))
            except ValueError as e:
                errors.append((lineno, str(e)))
    if errors:
        raise TraceError(path, errors)
    if not rows:
        raise TraceError(path, [(0, "no requests")])
    rows.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep file order
    return rows[:max_requests] if max_requests is not None else rows
