"""An early exit of a checkpoint: its first N decoder layers with its embedding, final norm, head and tokenizer,
written as a checkpoint of its own. The speculative-decoding benchmarks draft with it (``--speculative-model``)
where no smaller model of the same vocabulary is at hand; a model not trained to exit there drafts poorly, so
it measures what drafting costs more than what a trained draft gains. Needs only safetensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def early_exit_checkpoint(model_dir: Path, num_layers: int, out: Path) -> Path:
    """``model_dir``'s first ``num_layers`` layers, as a checkpoint directory at ``out``."""
    config = json.loads((model_dir / "config.json").read_text())
    if not 0 < num_layers < config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers must be between 1 and {config['num_hidden_layers'] - 1}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",
                                                                               "model.safetensors.index.json"):
            shutil.copy(path, out / path.name)
    kept = {}
    for path in model_dir.glob("*.safetensors"):
        kept |= {name: t for name, t in load_file(path).items()
                 if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    save_file(kept, out / "model.safetensors")
    return out
