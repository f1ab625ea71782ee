"""The held-out text of ``benchmarks/train_tiny.py`` (stdlib files whose path's CRC-32 is 0 mod 20) as token
documents for any checkpoint, and how many bytes of that text each token stands for, so bits per byte
compare across tokenizers.

A model with the built-in byte-level tokenizer (one token per byte, the trained model's) reads each file as
training framed it: BOS, its bytes, end-of-text. Any other model reads the file's text through its own
``tokenizer.json`` (special tokens as its tokenizer adds them). Bytes per token come from the tokenizer's
byte-level alphabet (GPT-2's: one vocabulary character per byte, as in Llama-3, Qwen2/3 and SmolLM2); a
special token stands for no text and is never scored. SentencePiece vocabularies are refused by name.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from benchmarks.train_tiny import corpus_files, split_files
from benchmarks.train_tiny import held_out_documents as byte_documents
from engine.tiny import bytes_to_unicode


def _tokenizer_json(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "tokenizer.json").read_text())


def is_byte_tokenizer(model_dir: str | Path) -> bool:
    """Whether the checkpoint's tokenizer is the built-in one: token id == byte value, no merges."""
    model = _tokenizer_json(model_dir)["model"]
    return not model.get("merges") and model.get("vocab") == {c: b for b, c in bytes_to_unicode().items()}


@cache
def token_bytes(model_dir: str) -> torch.Tensor:
    """Bytes of text per token id (int64, one entry per id up to the largest); 0 for special tokens."""
    spec = _tokenizer_json(model_dir)
    if (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{model_dir}: bits per byte needs a byte-level BPE tokenizer (decoder "
                         f"{(spec.get('decoder') or {}).get('type')!r})")
    vocab, added = spec["model"]["vocab"], spec.get("added_tokens", [])
    table = torch.zeros(max([*vocab.values(), *(t["id"] for t in added)]) + 1, dtype=torch.int64)
    for token, token_id in vocab.items():
        table[token_id] = len(token)  # one alphabet character per byte
    for t in added:  # added tokens are plain text, not alphabet characters; special ones stand for none
        table[t["id"]] = 0 if t.get("special") else len(t["content"].encode())
    return table


def held_out_documents(model_dir: str | Path, limit: int | None = None) -> list[list[int]]:
    """The held-out files, in order, as ``model_dir``'s tokens (``limit``: of the first N stdlib files)."""
    if is_byte_tokenizer(model_dir):
        return byte_documents(limit)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    root, files = corpus_files(limit)
    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in split_files(root, files)[1]]
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=True)]
