"""Embeddings: how a checkpoint pools its last hidden states into one vector (``/v1/embeddings``).

Decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral, SFR-Embedding) take the final-norm hidden
state of the prompt's last token, L2-normalized, as the sentence-transformers config they ship says
(``modules.json``: a Pooling module with ``pooling_mode_lasttoken``, then Normalize). A checkpoint without
that config pools the same way (vLLM's default for a decoder). Only the last token is pooled: its hidden state
needs no other position's, so a prompt's cached prefix is reused as for generation. A checkpoint that asks for
another pooling (mean, CLS, a Dense head after it) is served for generation, and its embeddings are refused.

Matryoshka ``dimensions``: the vector is cut to its first ``dimensions`` values before it is normalized, as
Qwen3-Embedding's card and vLLM do (``Engine._embed``). Torch-free: the gateway checks requests with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import CheckpointError, InvalidRequestError

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# a Pooling module config's mode flags, by the name a refusal gives them
_MODE_NAMES = {"pooling_mode_lasttoken": "last token", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_cls_token": "CLS token", "pooling_mode_max_tokens": "max",
               "pooling_mode_mean_sqrt_len_tokens": "mean / sqrt(length)", "pooling_mode_weightedmean_tokens":
               "weighted mean"}


@dataclass(frozen=True)
class Pooling:
    """The checkpoint's pooling: the last token's final-norm hidden state, ``normalize``d or not.
    ``refused``: why this checkpoint's embeddings are not served (None: they are)."""

    normalize: bool = True
    refused: str | None = None

    def check(self, dimensions: int | None, hidden_size: int) -> None:
        """InvalidRequestError when this model's embeddings are refused, or ``dimensions`` is not a length
        its vectors can be cut to."""
        if self.refused is not None:
            raise InvalidRequestError("model", f"this model's embeddings are not served: {self.refused}")
        if dimensions is not None and not 1 <= dimensions <= hidden_size:
            raise InvalidRequestError("dimensions", f"must be in [1, {hidden_size}] (the model's hidden size), "
                                                    f"got {dimensions}")


def read_pooling(model_dir: Path) -> Pooling:
    """The pooling ``model_dir``'s sentence-transformers config asks for (``modules.json``); without one,
    the last token, normalized."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return Pooling()
    try:
        modules = json.loads(modules_file.read_text())
        types = [m["type"] for m in modules]
        pooling = next((m for m in modules if m["type"] == _POOLING_MODULE), None)
        config = {} if pooling is None else json.loads((model_dir / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{modules_file}: not a sentence-transformers module list ({exc})") from None
    normalize = _NORMALIZE_MODULE in types
    modes = [name for flag, name in _MODE_NAMES.items() if config.get(flag)]
    if modes and modes != ["last token"]:
        return Pooling(normalize, f"its sentence-transformers pooling is {' + '.join(modes)}; Tidepool pools the "
                                  f"last token only")
    if extra := [t.rsplit(".", 1)[-1] for t in types if t.startswith("sentence_transformers.models.")
                 and t not in (_POOLING_MODULE, _NORMALIZE_MODULE, "sentence_transformers.models.Transformer")]:
        return Pooling(normalize, f"its sentence-transformers modules include {', '.join(extra)}, which Tidepool "
                                  f"does not run")
    return Pooling(normalize)
