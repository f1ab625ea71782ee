"""A checkpoint's default sampling parameters: its ``generation_config.json``, applied as vLLM applies it.

Model authors publish the sampling a model is meant to run with there (Qwen3's temperature 0.6, top-p 0.95,
top-k 20, say). As vLLM does with ``--generation-config auto`` (its default), a request that leaves one of
``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty`` unset gets the file's value, and
``max_new_tokens`` caps the length of a request that sets no ``max_tokens``; what a request sets always
wins. ``do_sample`` is not read (vLLM does not either): a temperature in the file is used as given.
``--generation-config vllm`` ignores the file (the API's own defaults); a directory reads that directory's
``generation_config.json`` instead of the model's; ``--override-generation-config JSON`` sets fields over
whichever was read (vLLM's flag). Torch-free: the gateway loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.config import read_json
from engine.errors import CheckpointError, InvalidRequestError
from engine.sampling_params import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
OVERRIDABLE = (*SAMPLING_FIELDS, "max_new_tokens")


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, float | int] = field(default_factory=dict)  # values for the fields a request leaves unset
    max_tokens: int | None = None  # max_new_tokens: the most a request without max_tokens generates

    @classmethod
    def load(cls, source: str, model_dir: Path, overrides: dict | None = None) -> GenerationDefaults:
        """``source``: "auto" (``model_dir``'s file), "vllm" (none) or a directory holding the file; the
        ``overrides`` (fields of ``OVERRIDABLE``) go over what it gives. A file that is missing or sets none of
        the fields gives no defaults; CheckpointError for a value no request could take (naming the file or
        the flag, and the field)."""
        overrides = overrides or {}
        unknown = sorted(set(overrides) - set(OVERRIDABLE))
        if unknown:
            raise CheckpointError(f"--override-generation-config: {', '.join(unknown)} is not one of "
                                  f"{', '.join(OVERRIDABLE)}")
        directory = model_dir if source in ("auto", "vllm") else Path(source)
        if source not in ("auto", "vllm") and not directory.is_dir():
            raise CheckpointError(f"--generation-config {source}: not a directory (or 'auto' / 'vllm')")
        path = directory / "generation_config.json"
        raw = {**({} if source == "vllm" else read_json(path) or {}), **overrides}
        where = f"{path} with --override-generation-config" if overrides else str(path)
        sampling = {name: raw[name] for name in SAMPLING_FIELDS if raw.get(name) is not None}
        max_tokens = raw.get("max_new_tokens")
        try:
            SamplingParams(max_tokens=1 if max_tokens is None else max_tokens, **sampling).validate()
        except InvalidRequestError as exc:
            name = "max_new_tokens" if exc.field == "max_tokens" else exc.field
            raise CheckpointError(f"{where}: {name} {exc.message}") from None
        return cls(sampling, max_tokens)

    def apply(self, given: dict[str, object]) -> dict[str, object]:
        """A request's sampling fields (None: left unset) with the defaults under them."""
        return {**self.sampling, **{name: value for name, value in given.items() if value is not None}}

    def describe(self) -> str:
        """One line for the server's log: what requests get unless they say otherwise."""
        shown = dict(self.sampling) | ({} if self.max_tokens is None else {"max_tokens": self.max_tokens})
        return ", ".join(f"{k}={v}" for k, v in shown.items()) or "none"
