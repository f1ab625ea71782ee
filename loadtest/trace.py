"""Mooncake-format trace reader (DESIGN.md section 3).

Each JSONL row is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`` with one
hash id per 512-token block. The whole file is checked before a single request is sent, so a bad line
costs seconds, not a half-finished benchmark; errors name the file and line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A malformed trace line; ``line`` is 1-based."""

    def __init__(self, path: str, line: int, message: str):
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line


@dataclass
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_row(text: str, block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRow:
    """Parse one trace line; raises ValueError naming the offending field."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError("expected a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    ts, n_in, n_out, ids = row["timestamp"], row["input_length"], row["output_length"], row["hash_ids"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a non-negative number of ms, got {ts!r}")
    if not _is_int(n_in) or n_in < 1:
        raise ValueError(f"input_length must be a positive integer, got {n_in!r}")
    if not _is_int(n_out) or n_out < 1:
        raise ValueError(f"output_length must be a positive integer, got {n_out!r}")
    if not isinstance(ids, list) or not all(_is_int(h) and h >= 0 for h in ids):
        raise ValueError("hash_ids must be a list of non-negative integers")
    if len(ids) != math.ceil(n_in / block_tokens):
        raise ValueError(
            f"{len(ids)} hash_ids for input_length {n_in}: expected ceil({n_in}/{block_tokens}) = "
            f"{math.ceil(n_in / block_tokens)}"
        )
    return TraceRow(float(ts), n_in, n_out, list(ids))


def read_trace(path: str | Path, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRow]:
    """Read and validate every line of a trace (blank lines are skipped); raises TraceError."""
    rows: list[TraceRow] = []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                rows.append(parse_row(text, block_tokens))
            except ValueError as e:
                raise TraceError(str(path), lineno, str(e)) from None
    if not rows:
        raise TraceError(str(path), 0, "trace is empty")
    return rows
