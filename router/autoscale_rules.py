"""The autoscaler's settings and its rule over time, shared by the live autoscaler (``services/autoscaler.py``)
and the simulator's (``router/sim_autoscaler.py``), so a simulated run sizes a cluster the way a live one
would grow and shrink it. How many workers the load needs is ``router/planner.py``'s arithmetic.

The rule, per role: below the planned count, add the missing workers at once; above it, drain one worker
once the count has stayed below for ``scale_down_delay_s``, then start that wait again. A role whose last
change is still under way (workers starting, one draining) changes nothing meanwhile.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass
class AutoscaleConfig:
    """The autoscaler: off while ``bounds`` is empty."""

    bounds: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (min, max) workers
    window_s: float = 30.0  # the load is measured over this much of the past
    utilization: float = 0.7  # the share of a worker's time the load may take before another is added
    scale_down_delay_s: float = 120.0  # a role must want fewer workers this long before one is drained
    drain_timeout_s: float = 60.0  # what runs on a drained worker gets this long, then resumes elsewhere

    def check(self, start: dict[str, int]) -> None:
        """ValueError naming the flag when the settings contradict each other or the workers started
        (``start``: role -> count)."""
        for role, (low, high) in self.bounds.items():
            if role not in start:
                raise ValueError(f"--autoscale-{role}: this cluster serves {' and '.join(start)} workers")
            if not 1 <= low <= high:
                raise ValueError(f"--autoscale-{role} {low}:{high}: give MIN:MAX with 1 <= MIN <= MAX")
            if not low <= start[role] <= high:
                raise ValueError(f"--{role} {start[role]} is outside --autoscale-{role} {low}:{high}")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"--autoscale-utilization must be in (0, 1], got {self.utilization:g}")
        if self.window_s <= 0:
            raise ValueError(f"--autoscale-window-s must be positive, got {self.window_s:g}")
        for flag, value in (("--scale-down-delay-s", self.scale_down_delay_s),
                            ("--autoscale-drain-timeout-s", self.drain_timeout_s)):
            if value < 0:
                raise ValueError(f"{flag} must be at least 0, got {value:g}")


def parse_bounds(text: str) -> tuple[int, int]:
    """``MIN:MAX`` as two ints (argparse's ``type``)."""
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX (two whole numbers), got {text!r}") from None


def add_autoscale_arguments(p: argparse.ArgumentParser, roles: tuple[str, ...]) -> None:
    """The autoscaler's flags (``tidepool serve`` and ``tidepool simulate``), with AutoscaleConfig's defaults."""
    a = AutoscaleConfig()
    for role in roles:
        p.add_argument(f"--autoscale-{role}", type=parse_bounds, default=None, metavar="MIN:MAX",
                       help=f"let the autoscaler keep between MIN and MAX {role} workers, as the measured load "
                            "needs (default: a fixed count)")
    p.add_argument("--autoscale-window-s", type=float, default=a.window_s,
                   help="seconds of load the autoscaler plans from")
    p.add_argument("--autoscale-utilization", type=float, default=a.utilization,
                   help="share of a worker's time the load may take before the autoscaler adds one")
    p.add_argument("--scale-down-delay-s", type=float, default=a.scale_down_delay_s,
                   help="seconds the load must stay low before the autoscaler drains a worker")


def autoscale_from_args(args: argparse.Namespace, roles: tuple[str, ...], **more) -> AutoscaleConfig:
    """The AutoscaleConfig ``add_autoscale_arguments``' flags describe (``more``: its other fields)."""
    return AutoscaleConfig(bounds={role: bounds for role in roles
                                   if (bounds := getattr(args, f"autoscale_{role}")) is not None},
                           window_s=args.autoscale_window_s, utilization=args.autoscale_utilization,
                           scale_down_delay_s=args.scale_down_delay_s, **more)


class ScaleRule:
    """When to add and when to drain, per role (see the module doc)."""

    def __init__(self, scale_down_delay_s: float) -> None:
        self.scale_down_delay_s = scale_down_delay_s
        self._low_since: dict[str, float] = {}  # role -> when its count first wanted fewer workers

    def change(self, role: str, wanted: int, current: int, now: float) -> int:
        """Workers to add (> 0), -1 to drain one now, or 0. Call it only for a role with no change under way."""
        missing = wanted - current
        if missing >= 0:
            self._low_since.pop(role, None)
            return missing
        since = self._low_since.setdefault(role, now)
        if now - since < self.scale_down_delay_s:
            return 0
        del self._low_since[role]
        return -1
