"""The host work of one decode step: what a GPU waits on between two replayed CUDA graphs.

A decode step on a GPU is a graph replay (``engine/cuda_graphs.py``) between two stretches of Python: the
engine schedules the batch, loads the step's inputs into the graph's static buffers, then, once the sampled
tokens are back, appends them, detokenizes, checks stop conditions, and registers full blocks. For a small
model that host work is a large part of the step (issue 12's 1.1B goal is a 2 ms step at batch 64). It is
measured here on the CPU, where it runs the same code: a random one-layer Llama (hidden 64) with the built-in
byte-level tokenizer, so the text is detokenized as a served request's is, decodes ``--batches`` requests of
``--prompt-len`` tokens on the torch backend; each decode step's time is split into the model's forward pass
(the device's work on a GPU, left out), the torch path's input preparation (which a replayed step does not
run), and the rest. Each step's chunks are also loaded into a ``DecodeGraphs``' static buffers (uncaptured),
timed apart: what a replayed step runs instead. The host work of a graphed step is therefore
``step - torch run + graph load``, reported per sequence, and ``ops`` counts the torch ops such a step runs
outside the graph (views left out; on a GPU each is about one kernel launch or copy). ``--async-scheduling``
runs the engine that way (``EngineConfig.async_scheduling``): the same host work, done while the device
computes the next step on a GPU, plus what feeding the tokens on the device costs; on the CPU nothing
overlaps, so the figures compare.
``--sampling`` gives every request more sampling parameters (JSON, ``SamplingParams`` fields), such as the
repetition penalty a checkpoint's generation config may ask for (Qwen2.5's: 1.05), or a logit bias.

    python benchmarks/engine_host.py --batches 64,256 --prompt-len 512 [--async-scheduling] \
        [--sampling '{"repetition_penalty": 1.05}'] --json engine_host.json

Timings are wall clock in one thread; the load average is recorded: run it on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks._report import format_table, load_average  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.cuda_graphs import DecodeGraphs  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tiny import CONFIG, write_tiny_checkpoint  # noqa: E402

# A random one-layer Llama with the built-in model's tokenizer: its forward pass costs little, so the host's share
# of a step stands out.
MICRO = dict(CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


class Timer:
    """Wall seconds spent in the methods it wraps, by label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner: object, name: str, label: str) -> None:
        """Time ``owner.name`` under ``label``."""
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
            return result
        setattr(owner, name, timed)


class OpCounter(TorchDispatchMode):
    """Counts the torch ops that compute (views left out) while on and not ``paused``: on a GPU, each is about
    one kernel launch or copy, paid in host time."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def measure(model_dir: Path, batch: int, prompt_len: int, steps: int, async_scheduling: bool = False,
            sampling: dict | None = None) -> dict:
    """Decode ``batch`` requests for ``steps`` steps once their prompts are in, each greedy past its end of
    sequence unless ``sampling`` (``SamplingParams`` fields) says otherwise; the split of a step, in ms."""
    config = EngineConfig(model=str(model_dir), attention_backend="torch", max_num_seqs=batch,
                          async_scheduling=async_scheduling)
    # The prompts are taken a few a step, so the first ones decode while the last are computed: room for those
    # tokens too (decode rows take some of the steps' token budget), so that no sequence ends while the decode
    # is measured.
    max_tokens = steps + 16 + 2 * batch * prompt_len // config.max_num_batched_tokens
    config.num_blocks = batch * -(-(prompt_len + max_tokens + 1) // 16)
    engine = Engine(config)
    params = SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **(sampling or {})})
    for i in range(batch):
        engine.add_request(str(i), [(7 * i + j) % 250 + 1 for j in range(prompt_len)], params)
    while engine.last_step is None or engine.last_step.prefill_chunks or engine.last_step.decode_seqs < batch:
        engine.step()
    max_blocks = -(-engine.max_model_len // engine.block_size)
    graphs = DecodeGraphs(engine.runner, batch, max_blocks, capture=False)  # its buffers are only loaded here
    timer = Timer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner.model, "forward", "forward")
    timer.wrap(graphs, "load", "graph_load")
    timer.wrap(engine.runner, "run", "torch_run")
    torch_run = engine.runner.run

    counter = OpCounter()

    def run_and_load(chunks, *args):  # the same chunks loaded into the graph's buffers, timed apart
        graphs.load(chunks, *args[1:])  # (with the tokens fed from the device, if any)
        counter.paused = True  # (a replayed graph runs the forward pass and its input preparation)
        try:
            return torch_run(chunks, *args)
        finally:
            counter.paused = False
    engine.runner.run = run_and_load
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
        if engine.last_step.decode_seqs != batch:
            raise RuntimeError(f"a step decoded {engine.last_step.decode_seqs} of {batch} sequences")
    total = time.perf_counter() - start - timer.seconds["graph_load"]  # (the engine did not wait for those)
    ms = {label: 1e3 * s / steps for label, s in timer.seconds.items()}
    counted = 4  # a few more steps, untimed, count the ops of a graphed step
    with counter:
        for _ in range(counted):
            engine.step()
    step_ms = 1e3 * total / steps
    host_ms = step_ms - ms["torch_run"] + ms["graph_load"]
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps, "step_ms": step_ms,
            "forward_ms": ms["forward"], "torch_prepare_ms": ms["torch_run"] - ms["forward"],
            "graph_load_ms": ms["graph_load"], "schedule_ms": ms["schedule"],
            "rest_ms": step_ms - ms["torch_run"] - ms["schedule"],
            "graphed_host_ms": host_ms, "graphed_host_us_per_seq": 1e3 * host_ms / batch,
            "graphed_step_ops": counter.ops / counted}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=lambda s: [int(n) for n in s.split(",")], default=[64, 256])
    parser.add_argument("--prompt-len", type=lambda s: [int(n) for n in s.split(",")], default=[512])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="each figure is the median of the rounds")
    parser.add_argument("--async-scheduling", action="store_true", help="run the engine with async scheduling")
    parser.add_argument("--sampling", type=json.loads, default={},
                        help='every request\'s further sampling parameters, e.g. {"repetition_penalty": 1.05}')
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a GPU server's engine thread has one core; the forward pass is left out anyway
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_checkpoint(Path(tmp), MICRO)
        for prompt_len in args.prompt_len:
            for batch in args.batches:
                rounds = [measure(Path(tmp), batch, prompt_len, args.steps, args.async_scheduling,
                                  args.sampling) for _ in range(args.rounds)]
                results.append({key: statistics.median(r[key] for r in rounds) for key in rounds[0]})
    headers = ["batch", "prompt", "step ms", "forward ms", "torch prepare ms", "schedule ms",
               "the rest ms", "graph load ms", "graphed host ms", "µs per sequence", "ops"]
    print(format_table(headers, [[r["batch"], r["prompt_len"], f"{r['step_ms']:.2f}", f"{r['forward_ms']:.2f}",
                                  f"{r['torch_prepare_ms']:.2f}", f"{r['schedule_ms']:.2f}",
                                  f"{r['rest_ms']:.2f}", f"{r['graph_load_ms']:.3f}",
                                  f"{r['graphed_host_ms']:.2f}", f"{r['graphed_host_us_per_seq']:.1f}",
                                  f"{r['graphed_step_ops']:.0f}"]
                                 for r in results]))
    print(f"load average: {load_average()}")
    out = {"results": results, "async_scheduling": args.async_scheduling,
           "sampling": args.sampling,
           "load_average": load_average()}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
