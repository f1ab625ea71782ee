"""How much attention a checkpoint gives its first tokens: the attention-sink effect StreamingLLM builds on.

Xiao et al. (2023) find that trained LLMs put a large share of attention weight on the first token(s) in
most layers, whatever those tokens say, so evicting them breaks a sliding window and keeping a few
("sinks") repairs it. A model that never learned to park attention there loses little when a window
evicts them, and sinks have nothing to repair. This tells which case a checkpoint is, for the window/sinks
figures of ``benchmarks/kv_quality.py`` (c): on the same held-out document, within the trained context,
the weight that queries past the window give the first N tokens, per layer, against an even spread.

    python benchmarks/attention_mass.py [--model DIR] [--sinks 4] [--window 256]

``--model`` takes any checkpoint with a byte-level tokenizer: ``benchmarks/pretrained.py``'s SmolLM2-135M
is one that has sinks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.held_out import held_out_documents  # noqa: E402
from benchmarks.train_tiny import REPORT_FILE, default_out  # noqa: E402


def first_tokens_share(model_dir: str, tokens: list[int], sinks: int, from_pos: int) -> list[float]:
    """Per layer: the attention weight the queries at positions >= ``from_pos`` give the first ``sinks``
    tokens, averaged over heads and queries; full attention over ``tokens`` in transformers (eager)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = model.eval()(input_ids=torch.tensor([tokens]), output_attentions=True)
    return [a[0, :, from_pos:, :sinks].sum(-1).mean().item() for a in out.attentions]


def even_share(num_tokens: int, sinks: int, from_pos: int) -> float:
    """The same share if every query spread its weight evenly over the tokens it sees."""
    shares = [min(sinks, p + 1) / (p + 1) for p in range(from_pos, num_tokens)]
    return sum(shares) / len(shares)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(default_out()), help="checkpoint (default: train_tiny.py's)")
    p.add_argument("--sinks", type=int, default=4, help="first tokens whose share is measured")
    p.add_argument("--window", type=int, default=256, help="queries from this position on are measured")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    trained = Path(args.model) / REPORT_FILE
    context = json.loads(trained.read_text())["eval_context"] if trained.exists() else 1024
    # kv_quality.py's stream, within the trained context
    tokens = max(held_out_documents(args.model), key=len)[:context]
    shares = first_tokens_share(args.model, tokens, args.sinks, args.window)
    even = even_share(len(tokens), args.sinks, args.window)
    print(f"model {args.model}: queries at positions {args.window}..{len(tokens) - 1} of a held-out document; "
          f"attention weight on the first {args.sinks} tokens (an even spread would give {even:.4f})")
    for layer, share in enumerate(shares):
        print(f"layer {layer}: {share:.4f} ({share / even:.2f}x even)")


if __name__ == "__main__":
    main()
