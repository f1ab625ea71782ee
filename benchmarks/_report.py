"""How every benchmark here records its run: the machine's load and a plain text table. Standard library
only, so the scripts that run on a bare GPU machine (no httpx, Ray or Redis) can use it too."""

from __future__ import annotations

import os


def load_average() -> str:
    """The 1/5/15-minute load average, for the record: this machine is shared."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} (on {os.cpu_count()} cores)"


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain aligned text table (floats with two decimals), as every benchmark here prints."""
    cells = [[f"{v:.2f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda values: "  ".join(v.rjust(w) if i else v.ljust(w)  # noqa: E731
                                    for i, (v, w) in enumerate(zip(values, widths, strict=True)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])
