"""The built-in ``tiny`` model: a ~50M-parameter Llama with GQA, deterministic random weights and a
byte-level tokenizer, written as a real Hugging Face checkpoint directory so it takes the same loading
path as a user's checkpoint (and loads in ``transformers`` for parity checks).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

SEED = 0
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot|>", "<|system|>", "<|user|>",
                  "<|assistant|>"] + [f"<|reserved_{i}|>" for i in range(10)]  # 256 + 16 = 272 ids
BOS, EOS_IDS = 256, [257, 258]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|eot|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 256 + len(SPECIAL_TOKENS), "hidden_size": 768, "intermediate_size": 2048,
    "num_hidden_layers": 8, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
    "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "bos_token_id": BOS, "eos_token_id": EOS_IDS, "dtype": "float32", "initializer_range": 0.02,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE tokenizers."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    # One token per byte (id == byte value) and no merges: every string round-trips exactly.
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok.to_str()


def _weights(c: dict) -> dict[str, torch.Tensor]:
    """Seeded random weights of a Llama of config ``c``."""
    h, inter = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    gen = torch.Generator().manual_seed(SEED)
    # Same init as transformers: normal(0, initializer_range) matrices, RMSNorm weights of one.
    return {name: torch.ones(shape) if len(shape) == 1
            else torch.randn(shape, generator=gen) * c["initializer_range"]
            for name, shape in shapes.items()}


def write_dir_atomically(path: Path, marker: str, fill: Callable[[Path], None], replace: bool = False) -> None:
    """Have ``fill`` write a directory into a private temp dir, then rename it to ``path``, so processes
    racing to create it never see half of one: the loser of a race discards its copy (``marker``, a file
    a complete directory has, tells a lost race from a failure). ``replace`` first removes whatever is at
    ``path`` (an incomplete or stale directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        fill(tmp)
        if replace:
            shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
    except OSError:
        if not (path / marker).exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_tiny_checkpoint(path: Path, config: dict | None = None,
                          weights: dict[str, torch.Tensor] | None = None) -> None:
    """The built-in checkpoint at ``path``, written atomically (``write_dir_atomically``). ``config`` and
    ``weights`` default to the built-in model's (seeded random weights of ``config`` without ``weights``);
    other byte-level Llamas pass theirs to share its tokenizer files (benchmarks/train_tiny.py,
    benchmarks/engine_host.py)."""
    config = config or CONFIG

    def fill(tmp: Path) -> None:
        save_file(_weights(config) if weights is None else weights, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "tokenizer.json").write_text(_tokenizer_json())
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
            "eos_token": "<|eot|>", "pad_token": "<|end_of_text|>", "chat_template": CHAT_TEMPLATE,
            "model_max_length": config["max_position_embeddings"], "clean_up_tokenization_spaces": False,
        }, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": BOS, "eos_token_id": EOS_IDS, "do_sample": False}, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))

    write_dir_atomically(path, "config.json", fill)
