"""Errors the engine raises to its callers (workers and gateways turn them into 400 / 429 answers)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses before it takes any resource; ``field`` names the bad parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class OutOfBlocksError(RuntimeError):
    """A block reservation that the free KV blocks cannot meet right now (retry later or elsewhere)."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"need {needed} KV blocks, {free} free")
        self.needed = needed
        self.free = free
