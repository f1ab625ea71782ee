"""Errors the engine raises to its callers (workers and gateways turn them into 400 / 429 answers).

Each one crosses a process boundary when a worker raises it (Ray pickles it to the caller), so each one
that takes its own arguments pickles them (``__reduce__``): rebuilt from its message alone, it would fail
in the caller, which would then see Ray's "failed to deserialize" instead of the error.
"""

from __future__ import annotations


class FieldError(ValueError):
    """A value refused for what one named ``field`` holds (the message says what to fix)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):
        return type(self), (self.field, self.message)


class InvalidRequestError(FieldError):
    """A request the engine refuses before it takes any resource; ``field`` names the bad parameter."""


class OutOfBlocksError(RuntimeError):
    """A block reservation that the free KV blocks cannot meet right now (retry later or elsewhere)."""

    def __init__(self, needed: int, free: int, kept: int = 0):
        kept_text = f" (and {kept} kept for running sequences to grow into)" if kept else ""
        super().__init__(f"need {needed} KV blocks{kept_text}, {free} free")
        self.needed = needed
        self.free = free
        self.kept = kept

    def __reduce__(self):
        return type(self), (self.needed, self.free, self.kept)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file or tensor."""


class LoRAAdapterError(CheckpointError):
    """A LoRA adapter (``--lora-modules``) that cannot be loaded; the message names it and what is wrong."""


class UnsupportedModelError(FieldError):
    """A checkpoint config this engine does not implement; ``field`` names the config.json key."""
