"""LoRA adapters in the engine (engine/lora.py): PEFT adapters served beside the base model, mixed in one
batch, each sequence's tokens as PEFT generates them, and each adapter's blocks apart in the prefix cache."""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_model import BLOCK, build_hf_checkpoint, prompts

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import CheckpointError, InvalidRequestError
from engine.output import FinishReason
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(hf, path, targets: list[str] | str, rank: int, seed: int, **config) -> peft.PeftModel:
    """A PEFT LoRA adapter of ``hf`` with random A and B (PEFT starts B at zero, which would change nothing),
    saved to ``path``; the returned model runs it as PEFT does."""
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=rank, target_modules=targets, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    return model.eval()


def run(engine: Engine, requests: dict[str, tuple[list[int], str | None]], later: dict | None = None
        ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Greedy tokens and prefix-cache hits of each request (prompt, adapter); ``later`` join after 3 steps."""
    for rid, (ids, lora) in requests.items():
        engine.add_request(rid, ids, GREEDY, lora=lora)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished():
        if (steps := steps + 1) == 3:
            for rid, (ids, lora) in (later or {}).items():
                engine.add_request(rid, ids, GREEDY, lora=lora)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    return tokens, cached


def reference(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch, targets", [
    ("llama", ALL_PROJECTIONS),
    ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),  # Phi-3's packed projections, as PEFT names them
    ("qwen3_moe", ALL_PROJECTIONS[:4]),  # attention only: PEFT adapts a mixture's experts for MLP targets
])
def test_a_batch_mixing_adapters_and_the_base_model_generates_as_peft_does(tmp_path, arch, targets):
    hf = build_hf_checkpoint(tmp_path / "base", arch)
    a = peft_adapter(hf, tmp_path / "a", targets, rank=8, seed=1, lora_alpha=16)
    # q and v only, another rank, rsLoRA's scaling, and a per-module alpha
    b = peft_adapter(hf, tmp_path / "b", ["q_proj", "v_proj"] if arch != "phi3" else ["qkv_proj"], rank=4, seed=2,
                     lora_alpha=8, use_rslora=True, alpha_pattern={"v_proj" if arch != "phi3" else "qkv_proj": 3})
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), block_size=BLOCK, num_blocks=64,
                                 max_num_batched_tokens=32, lora_modules={"a": str(tmp_path / "a"),
                                                                           "b": str(tmp_path / "b")}))
    p, q = prompts((21, 9))
    requests = {"base": (p, None), "a": (p, "a"), "b": (p, "b"), "a-other": (q, "a")}
    tokens, _ = run(engine, requests, later={"b-late": (q, "b")})  # joins a batch already decoding
    want = {"base": reference(hf, p), "a": reference(a, p), "b": reference(b, p), "a-other": reference(a, q),
            "b-late": reference(b, q)}
    assert tokens == want
    assert len({tuple(want[r]) for r in ("base", "a", "b")}) == 3  # each adapter changes the output


@pytest.mark.timeout(120)
def test_an_adapters_blocks_are_its_own_prefix_cache_hits_and_no_one_elses(tmp_path):
    hf = build_hf_checkpoint(tmp_path / "base", "llama")
    peft_adapter(hf, tmp_path / "a", ALL_PROJECTIONS, rank=4, seed=1)
    peft_adapter(hf, tmp_path / "b", ALL_PROJECTIONS, rank=4, seed=2)
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), block_size=BLOCK, num_blocks=64,
                                 lora_modules={"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}))
    (p,) = prompts((40,))
    first, _ = run(engine, {"a": (p, "a")})
    again, cached = run(engine, {"a-again": (p, "a"), "b": (p, "b"), "base": (p, None)})
    assert cached == {"a-again": 2 * BLOCK, "b": 0, "base": 0}
    assert again["a-again"] == first["a"]  # its own blocks: the same tokens
    assert engine.prefix_salt("a") != engine.prefix_salt("b") != engine.prefix_salt(None)
    assert engine.cached_prefix_len(p, engine.prefix_salt("a")) == 2 * BLOCK



def edit_adapter(src, dst, edit) -> None:
    """A copy of the adapter at ``src`` in ``dst`` with ``edit(config, tensors)`` applied."""
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(src / "adapter_model.safetensors")
    edit(config, tensors)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, dst / "adapter_model.safetensors")


@pytest.mark.timeout(120)
def test_adapters_the_layers_cannot_run_are_refused_with_what_is_wrong(tmp_path):
    hf = build_hf_checkpoint(tmp_path / "base", "qwen3_moe")
    good = tmp_path / "good"
    peft_adapter(hf, good, ["q_proj", "v_proj"], rank=2, seed=1)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = {
        "dora": (lambda c, t: c.update(use_dora=True), "DoRA"),
        "saved": (lambda c, t: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
        "shape": (lambda c, t: t.update({key: torch.zeros(2, 32)}), r"do not fit the model \(expected \[r, 64\]"),
        "experts": (lambda c, t: t.update({key.replace("self_attn.q_proj", "mlp.gate_proj"): torch.zeros(2, 64)}),
                    "layer 0's mlp.gate_up_proj is a mixture of experts"),
        "moe": (lambda c, t: t.update({key.replace("self_attn.q_proj", "mlp.experts"): torch.zeros(2, 64)}),
                "adapts a mixture of experts' experts"),
        "unknown": (lambda c, t: t.update({key.replace("q_proj", "rotary"): torch.zeros(2, 64)}), "not a lora_A"),
        "half": (lambda c, t: t.pop(key), "lora_A and lora_B must both be present"),
    }
    for name, (edit, message) in cases.items():
        edit_adapter(good, tmp_path / name, edit)
        with pytest.raises(CheckpointError, match=message):
            Engine(EngineConfig(model=str(tmp_path / "base"), num_blocks=16, lora_modules={name: str(tmp_path / name)}))
    with pytest.raises(CheckpointError, match="adapter_config.json not found"):
        Engine(EngineConfig(model=str(tmp_path / "base"), num_blocks=16, lora_modules={"none": str(tmp_path)}))
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), num_blocks=16, lora_modules={"good": str(good)},
                                 max_cpu_loras=3))
    for name in ("shape", "experts"):  # refused while serving: no pair of it is left on any layer
        with pytest.raises(CheckpointError, match=cases[name][1]):
            engine.load_adapter(name, str(tmp_path / name))
    assert not any(2 in m.lora for m in engine.model.modules() if hasattr(m, "lora")) and list(engine.loras) == ["good"]
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'other' is loaded \\(loaded: good\\)"):
        engine.add_request("r", [1, 2, 3], GREEDY, lora="other")
    assert not engine.has_unfinished()


@pytest.mark.timeout(120)
def test_more_adapters_than_slots_take_turns_and_generate_as_peft_does(tmp_path):
    """Three adapters and one slot (``max_loras=1``, vLLM's rule): a waiting sequence whose adapter gets no slot
    is passed over for the base model's and waits until no running sequence holds the slot's adapter; on
    a decode engine an imported sequence is held likewise. Every answer is PEFT's."""
    hf = build_hf_checkpoint(tmp_path / "base", "llama")
    refs = {name: peft_adapter(hf, tmp_path / name, ALL_PROJECTIONS, rank=4, seed=seed)
            for seed, name in enumerate(("a", "b", "c"), start=1)}
    modules = {name: str(tmp_path / name) for name in refs}
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), block_size=BLOCK, num_blocks=64, lora_modules=modules,
                                 max_loras=1))
    assert (engine.max_cpu_loras, engine.lora_slots.resident) == (3, {"a": 1})
    p, q = prompts((21, 9))
    requests = {"a": (p, "a"), "b": (p, "b"), "base": (q, None), "c": (q, "c"), "a-again": (q, "a")}
    steps: list[set[str]] = []  # the adapters of each step's sequences
    step = engine.step

    def recorded_step(*args):
        steps.append({s.lora for s in engine.scheduler.running if s.lora})
        return step(*args)

    engine.step = recorded_step
    tokens, _ = run(engine, requests)
    want = {rid: reference(refs[lora] if lora else hf, ids) for rid, (ids, lora) in requests.items()}
    assert tokens == want
    assert max(len(s) for s in steps) == 1 and engine.lora_slots.swaps >= 2
    assert engine.stats().waiting_loras == ()

    # the decode side: two imported sequences of two adapters, one slot
    prefill = Engine(EngineConfig(model=str(tmp_path / "base"), block_size=BLOCK, num_blocks=64, lora_modules=modules))
    decode = Engine(EngineConfig(model=str(tmp_path / "base"), block_size=BLOCK, num_blocks=64, lora_modules=modules,
                                 max_loras=1))
    imported = {}
    for rid in ("b", "c"):
        prefill.add_request(rid, p, GREEDY, prefill_only=True, lora=rid)
        (first,) = prefill.step()
        tensor = prefill.kv_cache.export_blocks(prefill.request_block_ids(rid))
        prefill.release(rid)
        reserved = decode.reserve_blocks(rid, len(p))
        decode.kv_cache.import_blocks(reserved, tensor)
        decode.add_imported_request(rid, p, first.new_token_ids[0], GREEDY, reserved, lora=rid)
        imported[rid] = first.new_token_ids
    # "b" took the slot from idle "a" at once; "c" waits for "b" to finish
    assert [s.lora for s in decode.scheduler.held] == ["c"] and decode.lora_slots.resident == {"b": 1}
    stats = decode.stats()
    assert (stats.running_loras, stats.waiting_loras, stats.num_waiting) == (("b",), ("c",), 1)
    while decode.has_unfinished():
        for out in decode.step():
            imported[out.request_id] += out.new_token_ids
    assert imported == {rid: reference(refs[rid], p) for rid in ("b", "c")}


@pytest.mark.timeout(120)
def test_an_adapter_loaded_while_serving_takes_a_free_slot_and_unloading_aborts_its_requests(tmp_path):
    hf = build_hf_checkpoint(tmp_path / "base", "llama")
    a = peft_adapter(hf, tmp_path / "a", ALL_PROJECTIONS, rank=4, seed=1)
    peft_adapter(hf, tmp_path / "b", ["q_proj"], rank=2, seed=2)
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), block_size=BLOCK, num_blocks=64,
                                 lora_modules={"b": str(tmp_path / "b")}, max_loras=2))
    engine.load_adapter("a", str(tmp_path / "a"))
    assert engine.lora_slots.resident == {"b": 1, "a": 2}
    engine.load_adapter("a", str(tmp_path / "a"))  # the same adapter again: nothing to do
    assert engine.lora_slots.resident == {"b": 1, "a": 2}
    with pytest.raises(CheckpointError, match="another adapter of that name is loaded"):
        engine.load_adapter("a", str(tmp_path / "b"))
    (p,) = prompts((21,))
    assert run(engine, {"a": (p, "a")})[0]["a"] == reference(a, p)
    engine.add_request("b-running", p, GREEDY, lora="b")
    # the load report names the adapters of the waiting and of the running requests (vLLM's lora_requests_info)
    assert (engine.stats().waiting_loras, engine.stats().running_loras) == (("b",), ())
    engine.step()
    assert (engine.stats().waiting_loras, engine.stats().running_loras) == ((), ("b",))
    assert engine.adapter_requests("b") == ["b-running"]
    assert engine.unload_adapter("b") == ["b-running"]  # aborted: the next step reports it
    (out,) = engine.step()
    assert (out.request_id, out.finish_reason) == ("b-running", FinishReason.ABORT) and not engine.has_unfinished()
    assert all(1 not in m.lora for m in engine.model.modules() if hasattr(m, "lora"))  # slot 1's pairs are gone
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'b' is loaded"):
        engine.add_request("b-again", p, GREEDY, lora="b")
    engine.load_adapter("b2", str(tmp_path / "b"))
    assert engine.lora_slots.slot_of("b2") == 1  # the free slot again
    with pytest.raises(CheckpointError, match="2 adapters are loaded, as many as --max-cpu-loras 2 allows"):
        engine.load_adapter("c", str(tmp_path / "b"))
    # the slots are allocated at start, up to a rank: an adapter needing more is refused by name
    small = Engine(EngineConfig(model=str(tmp_path / "base"), num_blocks=16, max_loras=1, max_lora_rank=2))
    with pytest.raises(CheckpointError, match="rank 4 is above --max-lora-rank 2"):
        small.load_adapter("a", str(tmp_path / "a"))
    with pytest.raises(CheckpointError, match="no LoRA slots"):
        Engine(EngineConfig(model=str(tmp_path / "base"), num_blocks=16)).load_adapter("a", str(tmp_path / "a"))
