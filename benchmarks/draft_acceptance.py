"""How often a draft model's token is accepted, drafted greedily or sampled with the verification's own random
draw (what ``engine/draft_model.py`` does), against the bound of rejection sampling, for drafts of several
qualities, in one run.

SmolLM2-135M-Instruct (``benchmarks/pretrained.py``) samples answers with the engine (the chat prompts of
``benchmarks/speculative.py``); then, at every position of every answer, transformers gives the model's
distribution ``p`` and a draft's ``q``, both shaped by the request's temperature and top-p as the sampler
shapes them (``sampler.sampling_probs``). The drafts: the model's own first 10, 20 and 29 layers with its final
norm and head (the early exits ``--draft-layers`` drafts with: ``benchmarks/early_exit.py``), and all 30 layers
with weights rounded to bfloat16 (a draft nearly the model, the regime a trained draft aims for). Per position,
exactly (no sampling noise):

- greedy: ``p[argmax q]``, the chance the verification keeps a greedy draft token;
- coupled: the chance that ``argmax(p / E)`` and ``argmax(q / E)`` agree for one shared Exp(1) draw ``E``,
  which is ``sum_i 1 / sum_j max(p_j / p_i, q_j / q_i)`` (the i-th term is the chance both pick i), summed
  exactly over the whole vocabulary in O(V log V) (``coupled_acceptance``);
- rejection: ``sum_i min(p_i, q_i)``, what vLLM's rejection sampling of a draft sampled from ``q`` accepts, the
  most any single drafted token can be accepted with while the output keeps ``p``'s distribution. Coupling
  gives up a little of it (at least ``(1 - d) / (1 + d)`` for a total variation ``d``) to keep the output
  plain decoding's token for token, seeded sampling included.

The means are over positions (a first draft token's acceptance; later ones compound).

    python benchmarks/draft_acceptance.py [--tokens 128] [--json draft_acceptance.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, load_average  # noqa: E402
from benchmarks.pretrained import ensure_pretrained  # noqa: E402
from benchmarks.speculative import run, workloads  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampler import sampling_probs  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

EXITS = (10, 20, 29)


def coupled_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """The chance that one shared exponential draw samples the same token from ``p`` and ``q``. Given both
    pick token i, every other j's draw must exceed ``E_i * max(p_j / p_i, q_j / q_i)``; integrating over
    ``E_i`` gives ``p_i q_i / sum_j max(p_j q_i, q_j p_i)``. The j whose ratio ``q_j / p_j`` is above i's add
    ``p_i q_j``, the others ``q_i p_j`` (a tie adds the same either way), so with the tokens sorted by that
    ratio every denominator is a prefix sum of ``p`` and a suffix sum of ``q``."""
    p, q = p.double(), q.double()
    ratio = torch.where(p > 0, q / p.clamp(min=1e-300), torch.where(q > 0, torch.inf, 0.0))
    order = ratio.argsort()
    ps, qs = p[order], q[order]
    p_upto = ps.cumsum(0)  # sum of p_j over the j at or below i's ratio (i itself included)
    q_above = qs.sum() - qs.cumsum(0)  # sum of q_j over the j above it
    both = ps * qs
    terms = torch.where(both > 0, both / (ps * q_above + qs * p_upto), 0.0)
    return float(terms.sum())


def position_acceptance(p: torch.Tensor, q: torch.Tensor) -> dict[str, float]:
    """One position's acceptance, greedy, coupled and by rejection sampling (the module docstring)."""
    return {"greedy": float(p[q.argmax()]), "coupled": coupled_acceptance(p, q),
            "rejection": float(torch.minimum(p, q).sum())}


@torch.inference_mode()
def distributions(model, rounded, ids: list[int], answer_from: int) -> dict[str, torch.Tensor]:
    """The logits that predict each answer token (``ids`` from ``answer_from`` + 1 on), the model's and each
    draft's."""
    x = torch.tensor([ids])
    out = model(x, output_hidden_states=True)
    at = slice(answer_from, len(ids) - 1)
    head = lambda h: model.lm_head(model.model.norm(h[0, at]))  # noqa: E731  (an early exit's last steps)
    got = {"model": out.logits[0, at]} | {f"first {n} layers": head(out.hidden_states[n]) for n in EXITS}
    got["30 layers, bf16 weights"] = rounded(x).logits[0, at]
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128, help="max_tokens of each answer")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    import transformers

    model_dir = ensure_pretrained()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rounded = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for weight in rounded.parameters():
        weight.data = weight.data.to(torch.bfloat16).float()
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=1024))
    prompts = workloads(engine)
    top_p = SamplingParams(max_tokens=args.tokens, temperature=0.8, top_p=0.95, seed=1)
    settings = {
        "write a poem, T 0.8 top-p 0.95": (prompts["write a poem (sampled)"][0], top_p),
        "write a poem, T 1.0": (prompts["write a poem (sampled)"][0],
                                dataclasses.replace(top_p, temperature=1.0, top_p=1.0)),
        "repeat a passage, T 0.8 top-p 0.95": (prompts["repeat a passage"][0], top_p),
    }
    results = []
    for setting, (batch, params) in settings.items():
        sums: dict[str, dict[str, float]] = {}
        positions = 0
        for ids, answer in zip(batch, run(engine, batch, [params] * len(batch))["tokens"], strict=True):
            logits = distributions(model, rounded, [*ids, *answer], len(ids) - 1)
            probs = {name: sampling_probs(x.float(), [params] * x.shape[0]) for name, x in logits.items()}
            positions += probs["model"].shape[0]
            for name, q in probs.items():
                if name == "model":
                    continue
                for row in range(q.shape[0]):
                    for key, value in position_acceptance(probs["model"][row], q[row]).items():
                        sums.setdefault(name, {}).setdefault(key, 0.0)
                        sums[name][key] += value
        for name, total in sums.items():
            results.append({"setting": setting, "draft": name, "positions": positions,
                            **{key: round(value / positions, 4) for key, value in total.items()}})
    print(f"load average {load_average()}; {model_dir.name}, float32, answers of {args.tokens} tokens sampled by "
          f"the engine (4 prompts a setting); mean acceptance of a draft token per answer position")
    print(format_table(
        ["setting", "draft", "greedy", "coupled", "rejection", "coupled / greedy", "coupled / rejection"],
        [[r["setting"], r["draft"], r["greedy"], r["coupled"], r["rejection"], r["coupled"] / r["greedy"],
          r["coupled"] / r["rejection"]] for r in results]))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model_dir.name, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
