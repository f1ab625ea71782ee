"""Train a small byte-level Llama on the Python standard library's own source, so KV-memory techniques
(issue 16: quantized KV, attention sinks + sliding window) are measured on a model that has learned
something: a random-weight model predicts uniform noise whatever its cache holds.

The corpus is every machine's: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (tests and
site-packages left out) in sorted order; a file is held out for evaluation when the CRC-32 of its
relative path is 0 mod 20, so the split is the same on every machine with the same Python. Each file is
one document, ``<|begin_of_text|>`` + its bytes + ``<|end_of_text|>``, with the built-in ``tiny``
model's byte-level tokenizer (token id == byte value). The model is a Llama (hidden 256, 4 layers,
4 heads / 2 KV heads, 3.3M parameters, 4,096 positions) trained from scratch with AdamW and a cosine
learning rate for a bounded time, at 256 tokens of context and then at 1,024 for the last 30%. It is
saved as a Hugging Face checkpoint (``<cache>/trained-stdlib``, loadable by ``engine.loader`` and by
``transformers``) with a ``training.json`` report; a rerun reuses it unless ``--force``.

Bits per byte = summed NLL (nats) of the byte targets / their count / ln 2; special tokens are context,
never scored, so the figure is per byte of source text.

    python benchmarks/train_tiny.py [--minutes 9] [--device cpu|cuda] [--tokens-per-step 2048] [--lr 0.002]
                                    [--weight-decay 0.1] [--force] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import load_average  # noqa: E402
from engine.loader import cache_dir  # noqa: E402
from engine.tiny import BOS, CONFIG, SPECIAL_TOKENS, write_tiny_checkpoint  # noqa: E402

MODEL_NAME = "trained-stdlib"
REPORT_FILE = "training.json"  # written last: its presence marks a complete checkpoint
BYTE_VOCAB = 256
END_OF_TEXT = SPECIAL_TOKENS.index("<|end_of_text|>") + BYTE_VOCAB
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
HELD_OUT_MOD = 20


@dataclass
class TrainArgs:
    out: Path
    minutes: float = 9.0  # the whole run: training gets what the corpus, model and two evaluations leave
    max_steps: int | None = None  # stop (and end the cosine schedule) here if it comes first
    corpus_limit: int | None = None  # use only the first N files of the sorted list
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    seq_len: int = 1024  # context of the last phase and of evaluation
    short_seq_len: int = 256
    long_fraction: float = 0.3
    tokens_per_step: int = 2048
    lr: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    eval_tokens: int = 32768
    device: str = "cpu"
    threads: int = 2
    seed: int = 0


def default_out() -> Path:
    return cache_dir() / MODEL_NAME


def corpus_files(limit: int | None = None) -> tuple[Path, list[Path]]:
    """(stdlib root, its source files in sorted order, at most ``limit``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts))
    return root, files[:limit]


def split_files(root: Path, files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files); at least one of each when there are two files."""
    held = [p for p in files if zlib.crc32(p.relative_to(root).as_posix().encode()) % HELD_OUT_MOD == 0]
    if not held and len(files) > 1:
        held = files[-1:]
    held_set = set(held)
    return [p for p in files if p not in held_set], held


def encode_document(data: bytes) -> list[int]:
    return [BOS, *data, END_OF_TEXT]


def token_stream(files: list[Path]) -> torch.Tensor:
    """All documents back to back, int64."""
    bos, end = torch.tensor([BOS]), torch.tensor([END_OF_TEXT])
    return torch.cat([t for p in files for t in
                      (bos, torch.from_numpy(np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int64)), end)])


def held_out_documents(limit: int | None = None) -> list[list[int]]:
    """The held-out files as token lists, in order (what kv_quality.py scores)."""
    root, files = corpus_files(limit)
    return [encode_document(p.read_bytes()) for p in split_files(root, files)[1]]


def byte_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    """(summed NLL in nats, count) over the byte targets (ids < 256) of ``logits`` [n, vocab]."""
    targets = targets.to(logits.device)
    keep = targets < BYTE_VOCAB
    nll = F.cross_entropy(logits[keep].float(), targets[keep], reduction="sum")
    return nll.item(), int(keep.sum())


def bits_per_byte(nll: float, count: int) -> float:
    return nll / max(count, 1) / math.log(2)


def zlib_bits_per_byte(args: TrainArgs, eval_tokens: int) -> float:
    """The peer: bits per byte of ``zlib -9`` on the bytes the held-out evaluation scores."""
    root, files = corpus_files(args.corpus_limit)
    held = token_stream(split_files(root, files)[1])[1:eval_tokens + 1]
    data = bytes(held[held < BYTE_VOCAB].tolist())
    return 8 * len(zlib.compress(data, 9)) / len(data)


def model_config(args: TrainArgs) -> dict:
    """The tiny model's config.json with this model's sizes (same vocabulary and special tokens)."""
    theta = 10000.0
    return {**CONFIG, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
            "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads, "head_dim": args.hidden // args.heads,
            "max_position_embeddings": 4096, "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}}


def build_model(config: dict, device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa")).to(device)


@torch.no_grad()
def evaluate(model: torch.nn.Module, stream: torch.Tensor, ctx: int, device: str) -> float:
    """Bits per byte of ``stream`` in consecutive windows of ``ctx`` predicted tokens."""
    model.eval()
    nll, count = 0.0, 0
    for begin in range(0, len(stream) - 1, ctx):
        window = stream[begin:begin + ctx + 1].to(device)
        logits = model(input_ids=window[None, :-1]).logits[0]
        n, c = byte_nll(logits, window[1:])
        nll, count = nll + n, count + c
    model.train()
    return bits_per_byte(nll, count)


def learning_rate(args: TrainArgs, step: int, progress: float) -> float:
    """Linear warm-up, then cosine from ``lr`` to ``lr / 10`` over the progress of the run."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def sample_batch(stream: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` windows of ``seq_len + 1`` tokens (inputs and shifted targets): BOS, then text from a
    random offset. Every context starts with BOS, as a served prompt does, so the model meets the same
    first token in training and at inference (the token StreamingLLM's sinks keep)."""
    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=gen)
    bos = torch.tensor([BOS], dtype=stream.dtype)
    return torch.stack([torch.cat([bos, stream[s:s + seq_len]]) for s in starts.tolist()])


def optimizer(model: torch.nn.Module, args: TrainArgs) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (never on norm weights)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def train(args: TrainArgs, log: Callable[[str], None] = print) -> dict:
    """Train, evaluate and save; returns the report (also written to ``training.json``)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    load_before, run_start = load_average(), time.perf_counter()
    root, files = corpus_files(args.corpus_limit)
    train_files, held_files = split_files(root, files)
    stream, held = token_stream(train_files), token_stream(held_files)[:args.eval_tokens + 1]
    config = model_config(args)
    model = build_model(config, args.device)
    eval_start = time.perf_counter()
    initial = evaluate(model, held, args.seq_len, args.device)
    eval_s = time.perf_counter() - eval_start  # the final evaluation will take about as long
    log(f"{sum(p.numel() for p in model.parameters()):,} parameters; {len(train_files)} training files "
        f"({len(stream):,} tokens), {len(held_files)} held out; untrained: {initial:.3f} bits/byte")
    opt, gen = optimizer(model, args), torch.Generator().manual_seed(args.seed)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=args.device.startswith("cuda"))
    step, tokens, start = 0, 0, time.perf_counter()
    budget_s = max(1.0, args.minutes * 60 - (start - run_start) - eval_s)
    while True:
        progress = (time.perf_counter() - start) / budget_s
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        if progress >= 1:
            break
        seq_len = args.seq_len if progress >= 1 - args.long_fraction else args.short_seq_len
        batch = sample_batch(stream, seq_len, max(1, args.tokens_per_step // seq_len), gen).to(args.device)
        for group in opt.param_groups:
            group["lr"] = learning_rate(args, step, progress)
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + batch[:, 1:].numel()
        if step % 50 == 0:
            log(f"step {step} ctx {seq_len} loss {loss.item() / math.log(2):.3f} bits/token "
                f"{time.perf_counter() - start:.0f}s")
    train_s = time.perf_counter() - start
    final = evaluate(model, held, args.seq_len, args.device)
    report = {
        "model": str(args.out), "parameters": sum(p.numel() for p in model.parameters()),
        "config": {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads",
                                          "max_position_embeddings")},
        "corpus": {"python": platform.python_version(), "train_files": len(train_files),
                   "train_tokens": len(stream), "held_out_files": len(held_files)},
        "steps": step, "tokens_trained": tokens, "train_seconds": round(train_s, 1),
        "run_seconds": round(time.perf_counter() - run_start, 1),
        "tokens_per_second": round(tokens / train_s, 1), "eval_context": args.seq_len,
        "eval_tokens": len(held) - 1, "untrained_bits_per_byte": round(initial, 4),
        "held_out_bits_per_byte": round(final, 4), "device": args.device, "threads": args.threads,
        "torch": torch.__version__, "load_average_before": load_before, "load_average_after": load_average(),
        "args": {k: str(v) for k, v in asdict(args).items()},
    }
    save(model, config, args.out, report)
    return report


def save(model: torch.nn.Module, config: dict, out: Path, report: dict) -> None:
    """Hugging Face layout (tiny's tokenizer files), then the report that marks it complete."""
    shutil.rmtree(out, ignore_errors=True)  # a partial or --force'd earlier checkpoint
    weights = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    write_tiny_checkpoint(out, config, weights)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))


def ensure_trained(args: TrainArgs, force: bool = False, log: Callable[[str], None] = print) -> dict:
    """The report of the checkpoint at ``args.out``, training it first when absent (or ``force``)."""
    report_path = args.out / REPORT_FILE
    if report_path.exists() and not force:
        log(f"{args.out} exists; reusing it (--force to retrain)")
        return json.loads(report_path.read_text())
    threads = torch.get_num_threads()
    try:
        return train(args, log)
    finally:  # set_num_threads is process-wide: leave the caller's setting as it was
        torch.set_num_threads(threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=f"checkpoint dir (default <cache>/{MODEL_NAME})")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--corpus-limit", type=int, default=None, help="first N stdlib files only")
    for name in ("minutes", "eval_tokens", "device", "threads", "seed", "tokens_per_step", "lr", "weight_decay"):
        default = getattr(TrainArgs, name)  # a larger batch (and rate) suits a GPU: --tokens-per-step
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=f"default {default}")
    p.add_argument("--force", action="store_true", help="retrain even if the checkpoint exists")
    p.add_argument("--json", type=Path, default=None, help="write the report here too")
    a = p.parse_args()
    args = TrainArgs(out=a.out or default_out(), **{k: v for k, v in vars(a).items()
                                                    if k not in ("out", "force", "json")})
    report = ensure_trained(args, a.force)
    report["zlib_bits_per_byte"] = round(zlib_bits_per_byte(args, report["eval_tokens"]), 4)
    print(f"{report['model']}: held-out {report['held_out_bits_per_byte']:.3f} bits/byte "
          f"(untrained {report['untrained_bits_per_byte']:.3f}, zlib -9 {report['zlib_bits_per_byte']:.3f}); "
          f"{report['steps']} steps, "
          f"{report['tokens_trained']:,} tokens in {report['train_seconds']:.0f}s "
          f"({report['tokens_per_second']:.0f} tok/s) on {report['device']}, {report['run_seconds']:.0f}s in all; "
          f"load average {report['load_average_before']} -> {report['load_average_after']}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
