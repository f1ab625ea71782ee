"""Engine model vs transformers: greedy tokens and float32 logits for every supported architecture (the
mixtures of experts too, also through the whole engine), parameter counts, batch independence, chunked
prefill over cached context, block waste, and the built-in tiny model."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.kv_cache import KVCache
from engine.loader import load_model, resolve_model_dir
from engine.runner import ModelRunner, SeqChunk
from engine.sampling_params import SamplingParams

BLOCK = 16
PROMPT_LENS = (5, 17, 40, 33)
NEW_TOKENS = 32
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
ARCHS = {
    # GQA + Llama 3 RoPE scaling with a short original context, so scaled frequencies are exercised.
    "llama": (transformers.LlamaConfig, dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),  # q/k/v bias, tied lm_head
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),  # q/k norm
    # YaRN, as Qwen3 is served past 32k tokens: an original context of 16 positions, so the prompts run
    # past it; DeepSeek's mscale pair sets the attention factor
    "qwen3_yarn": (transformers.Qwen3Config, dict(head_dim=32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.5})),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, num_key_value_heads=1)),  # MQA
    # Phi-3 / Phi-4: q/k/v and gate/up packed in the checkpoint itself
    "phi3": (transformers.Phi3Config, dict(sliding_window=None, bos_token_id=1, eos_token_id=2,
                                           pad_token_id=0)),
    # Phi-4-mini's partial rotary embedding: RoPE turns the first half of each head (8 of 16 dimensions)
    "phi3_partial_rotary": (transformers.Phi3Config, dict(sliding_window=None, bos_token_id=1, eos_token_id=2,
                                                          pad_token_id=0, partial_rotary_factor=0.5)),
    # Mixtures of experts (engine/moe.py): 4 experts, 2 per token, so the routing decides every output.
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    # The first layer dense, the second sparse; a gated shared expert; top-k scores not renormalized.
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                    shared_expert_intermediate_size=96, decoder_sparse_step=2,
                                                    norm_topk_prob=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                                    norm_topk_prob=True, mlp_only_layers=[1], head_dim=32)),
    # Gemma 3 (text): Gemma's norms (1 + weight) around each sublayer, scaled embeddings, GeGLU, a softmax scale
    # of its own (query_pre_attn_scalar 24 against head_dim 32); a sliding layer (window 12: the prompts and
    # their answers run past it) on plain RoPE of its own base, then a full one on linearly scaled RoPE
    "gemma3": (transformers.Gemma3TextConfig, dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=12, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Gemma 2: the same layers with one RoPE, a sliding layer then a full one, its attention scores and logits
    # soft-capped (caps low enough that these random weights' scores and logits pass them)
    "gemma2": (transformers.Gemma2Config, dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=12,
                                               attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
}


class SimpleAllocator:
    """Hands out blocks from a free list; enough for the tests' batches (the engine has the real one)."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks))
        self.allocated = 0

    def table(self, num_tokens: int) -> list[int]:
        n = math.ceil(num_tokens / BLOCK)
        self.allocated += n
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def build_hf_checkpoint(path, arch: str, **overrides) -> transformers.PreTrainedModel:
    """Tiny random HF model with every weight (norms and biases too) perturbed, saved to ``path``."""
    config_cls, extra = ARCHS[arch]
    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    return model


def make_runner(model_dir, num_blocks: int = 64) -> tuple[ModelRunner, ModelConfig]:
    model, cfg = load_model(model_dir, "float32", "cpu")
    return ModelRunner(model, cfg, KVCache(cfg, num_blocks, BLOCK, torch.float32, "cpu")), cfg


def prompts(n_lens=PROMPT_LENS, vocab: int = 128) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in n_lens]


def engine_greedy(runner: ModelRunner, batch: list[list[int]], new_tokens: int):
    """Prefill every prompt in one call, then decode all sequences together, greedily."""
    alloc = SimpleAllocator(runner.kv_cache.num_blocks)
    tables = [alloc.table(len(p) + new_tokens) for p in batch]
    logits = runner.run([SeqChunk(p, 0, t) for p, t in zip(batch, tables, strict=True)])
    first_logits = logits.clone()
    out = [[int(x)] for x in logits.argmax(-1)]
    for _ in range(new_tokens - 1):
        chunks = [SeqChunk([o[-1]], len(p) + len(o) - 1, t) for p, o, t in zip(batch, out, tables, strict=True)]
        for o, x in zip(out, runner.run(chunks).argmax(-1), strict=True):
            o.append(int(x))
    return out, first_logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_tokens_and_logits_match_transformers(tmp_path, arch):
    hf = build_hf_checkpoint(tmp_path, arch)
    runner, cfg = make_runner(tmp_path)
    assert cfg.architecture == type(hf).__name__
    batch = prompts()
    tokens, logits = engine_greedy(runner, batch, NEW_TOKENS)
    with torch.no_grad():
        for i, p in enumerate(batch):
            ids = torch.tensor([p])
            ref_logits = hf(ids).logits[0, -1]
            assert rel_err(logits[i], ref_logits) < 1e-4
            ref = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
            assert tokens[i] == ref, f"{arch} prompt {i}"


@pytest.mark.timeout(120)
def test_a_multimodal_gemma3_checkpoints_language_model_generates_as_transformers_does(tmp_path):
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration: a vision tower and projector beside the language
    model, whose tensors sit under ``language_model.model.`` (what save_pretrained writes) or, in checkpoints
    saved from transformers' newer classes, ``model.language_model.``. The engine loads the language model
    alone, from either, and a text prompt's greedy tokens and logits are transformers' (which never soft-caps
    this class's logits, whatever its text config says)."""
    from safetensors.torch import load_file, save_file

    _, extra = ARCHS["gemma3"]
    config = transformers.Gemma3Config(
        text_config={**COMMON, **extra, "final_logit_softcapping": 0.5}, mm_tokens_per_image=4,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14))
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    hf.save_pretrained(tmp_path / "saved")
    (tmp_path / "renamed").mkdir()
    for name in ("config.json", "generation_config.json"):
        (tmp_path / "renamed" / name).write_bytes((tmp_path / "saved" / name).read_bytes())
    tensors = load_file(tmp_path / "saved" / "model.safetensors")
    assert any(k.startswith("vision_tower.") for k in tensors)
    save_file({k.replace("language_model.model.", "model.language_model."): v for k, v in tensors.items()},
              tmp_path / "renamed" / "model.safetensors")
    batch = prompts()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in batch]
        first = [hf(input_ids=torch.tensor([p])).logits[0, -1] for p in batch]
    for layout in ("saved", "renamed"):
        runner, cfg = make_runner(tmp_path / layout)
        assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.layer_windows == (12, 0)
        tokens, logits = engine_greedy(runner, batch, NEW_TOKENS)
        assert tokens == want, layout
        assert all(rel_err(logits[i], first[i]) < 1e-4 for i in range(len(batch))), layout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_parameter_count_matches_transformers(tmp_path, arch):
    """What the capacity planner counts as weights: every expert's, whichever ones a token takes."""
    hf = build_hf_checkpoint(tmp_path, arch)
    assert ModelConfig.from_dir(tmp_path).num_parameters() == sum(p.numel() for p in hf.parameters())


@pytest.mark.timeout(120)
def test_engine_serves_a_mixture_of_experts_as_transformers_generates(tmp_path):
    """Qwen3-MoE through the whole engine (scheduler, chunked prefill, a prefix-cache hit, speculative
    decoding's drafts verified several tokens a step): every request's greedy tokens equal transformers'."""
    hf = build_hf_checkpoint(tmp_path, "qwen3_moe")
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64, max_num_batched_tokens=32,
                                 num_speculative_tokens=3))
    looped = prompts((9,))[0] * 4  # repeats itself, so n-gram lookup has drafts to propose
    requests = {"a": prompts((40,))[0], "b": looped, "c": looped[:20] + prompts((5,))[0]}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for rid in ("a", "b"):
        engine.add_request(rid, requests[rid], params)
    steps = 0
    while engine.has_unfinished():
        if (steps := steps + 1) == 4:  # b's prompt is in the prefix cache by now
            engine.add_request("c", requests["c"], params)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    with torch.no_grad():
        for rid, ids in requests.items():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
            assert got[rid] == want, rid
    assert cached["c"] == BLOCK and engine.stats().speculation.drafts > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch, window, block", [("mistral", 20, 8), ("mixtral", 16, 16), ("phi3", 19, 8)])
def test_a_models_sliding_window_runs_as_transformers_runs_it(tmp_path, arch, window, block):
    """Mistral v0.1's, Mixtral's and Phi-3's sliding-window attention (each query sees the last W tokens):
    prompts longer than the window, decoding past it, a window that is no multiple of the block: greedy
    tokens equal transformers', and blocks wholly behind every window are given back as they move on."""
    hf = build_hf_checkpoint(tmp_path, arch, sliding_window=window)
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=block, num_blocks=64, max_num_batched_tokens=32))
    assert engine.window is not None and (engine.window.window, engine.window.sinks) == (window, 0)
    assert engine.max_model_len == COMMON["max_position_embeddings"]  # the model's window is no streaming one
    batch = prompts((9, 45, 30))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(batch):
        engine.add_request(str(i), ids, params)
    got: dict[str, list[int]] = {}
    most_blocks = 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        most_blocks = max(most_blocks, engine.block_manager.num_blocks - engine.block_manager.num_free_blocks)
    with torch.no_grad():
        for i, ids in enumerate(batch):
            want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
            assert got[str(i)] == want, i
    full = sum(math.ceil((len(ids) + 24) / block) for ids in batch)
    assert most_blocks < full  # what full attention would hold at the end


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_sliding_window_on_some_layers_only_runs_as_transformers_runs_it(tmp_path, arch):
    """Qwen's use_sliding_window with max_window_layers 1 of 2: layer 0 attends to everything, layer 1 to its
    last 12 positions. Prompts past the window, chunked (16 tokens a step) and after a cached prefix, then
    decoding on: greedy tokens equal transformers', and no block is given back (layer 0 reads them all)."""
    hf = build_hf_checkpoint(tmp_path, arch, use_sliding_window=True, sliding_window=12, max_window_layers=1)
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64, max_num_batched_tokens=16))
    assert (engine.model_config.layer_windows, engine.window) == ((0, 12), None)
    a, b = prompts((30, 9))
    requests = {"a": a, "b": b, "a-again": a[:24] + b}  # a-again: a's first block cached, then chunks
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for rid, ids in requests.items():
        engine.add_request(rid, ids, params)
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
                cached[out.request_id] = out.num_cached_tokens
    with torch.no_grad():
        for rid, ids in requests.items():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
            assert got[rid] == want, rid
    assert cached["a-again"] == BLOCK  # a's first block


@pytest.mark.timeout(30)
def test_which_layers_slide_is_read_as_transformers_reads_it_and_a_kv_window_is_refused_beside_it(tmp_path):
    """Which layers slide, read as transformers reads it; --kv-window refused beside a model's own windows,
    and --kv-sinks beside soft-capped attention scores (the sink attention does not cap them)."""
    from engine.config import UnsupportedModelError

    qwen = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 256,
            "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}

    def windows(**overrides) -> tuple:
        cfg = ModelConfig.from_dict({k: v for k, v in {**qwen, **overrides}.items() if v is not None})
        return cfg.sliding_window, cfg.layer_windows

    assert windows() == (None, (0, 64, 64, 64))
    assert windows(max_window_layers=0) == (64, None)  # every layer: the engine's own window, as Mistral's
    # without max_window_layers, transformers' default: the layers from the 28th on
    assert windows(max_window_layers=None, num_hidden_layers=30) == (None, (0,) * 28 + (64, 64))
    assert windows(use_sliding_window=False) == windows(sliding_window=512) == (None, None)
    assert windows(layer_types=["full_attention", "sliding_attention"] * 2) == (None, (0, 64, 0, 64))
    assert windows(architectures=["Qwen2MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, max_window_layers=3) == (None, (64, 0, 64, 0))  # even layers below 3
    assert windows(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32) == (64, None)  # Qwen3-MoE slides in every layer
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        ModelConfig.from_dict({**qwen, "layer_types": ["sliding_attention"]})
    build_hf_checkpoint(tmp_path / "qwen", "qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=1)
    with pytest.raises(ValueError, match="serve it without --kv-window"):
        Engine(EngineConfig(model=str(tmp_path / "qwen"), kv_window=64))
    build_hf_checkpoint(tmp_path / "gemma2", "gemma2", sliding_window=None)  # full attention, scores soft-capped
    with pytest.raises(ValueError, match="serve it without --kv-sinks"):
        Engine(EngineConfig(model=str(tmp_path / "gemma2"), kv_window=32, kv_sinks=4))
    build_hf_checkpoint(tmp_path / "mistral", "mistral", sliding_window=32)
    with pytest.raises(ValueError, match="longer than the model's sliding window of 32"):
        Engine(EngineConfig(model=str(tmp_path / "mistral"), kv_window=64))


@pytest.mark.timeout(60)
def test_mixed_batch_logits_equal_each_sequence_alone(tmp_path):
    build_hf_checkpoint(tmp_path, "qwen3")
    runner, _ = make_runner(tmp_path)
    batch = prompts((9, 31, 3, 20))
    alone = [engine_greedy(runner, [p], 3) for p in batch]
    # One step mixing decode rows (sequences 0, 1 after their prefill) and prefill chunks (2, 3).
    alloc = SimpleAllocator(runner.kv_cache.num_blocks)
    tables = [alloc.table(len(p) + 3) for p in batch]
    first = runner.run([SeqChunk(batch[0], 0, tables[0]), SeqChunk(batch[1], 0, tables[1])])
    mixed = runner.run([SeqChunk(batch[2], 0, tables[2]),
                        SeqChunk([int(first[0].argmax())], len(batch[0]), tables[0]),
                        SeqChunk(batch[3], 0, tables[3]),
                        SeqChunk([int(first[1].argmax())], len(batch[1]), tables[1])])
    for i in range(2):
        assert torch.allclose(first[i], alone[i][1][0], rtol=0, atol=1e-5)
    assert torch.allclose(mixed[0], alone[2][1][0], rtol=0, atol=1e-5)
    assert torch.allclose(mixed[2], alone[3][1][0], rtol=0, atol=1e-5)
    for row, i in ((1, 0), (3, 1)):  # decode logits == the second step of that sequence alone
        _, t = engine_greedy(runner, [batch[i] + [alone[i][0][0][0]]], 1)
        assert torch.allclose(mixed[row], t[0], rtol=0, atol=1e-5)


@pytest.mark.timeout(60)
def test_chunked_prefill_over_cached_context_matches_full_prefill(tmp_path):
    build_hf_checkpoint(tmp_path, "llama")
    runner, _ = make_runner(tmp_path)
    (p,) = prompts((45,))
    full = runner.run([SeqChunk(p, 0, [0, 1, 2])])
    # Same prompt in three chunks (block-aligned and not) into other blocks, run one per call.
    table = [5, 3, 9]
    for start, end in ((0, 16), (16, 37), (37, 45)):
        last = runner.run([SeqChunk(p[start:end], start, table)])
    assert torch.allclose(last, full, rtol=0, atol=1e-5)


@pytest.mark.timeout(30)
def test_block_waste_of_mixed_batch_under_4_percent():
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(200, 2000, (64,), generator=gen).tolist()
    alloc = SimpleAllocator(10_000)
    for n in lens:
        alloc.table(n)
    allocated_slots = alloc.allocated * BLOCK
    waste = (allocated_slots - sum(lens)) / allocated_slots
    assert waste < 0.04


@pytest.mark.timeout(120)
def test_tiny_model_loads_in_transformers_and_matches(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDEPOOL_CACHE_DIR", str(tmp_path))
    model_dir = resolve_model_dir("tiny")
    runner, cfg = make_runner(model_dir, num_blocks=16)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.num_kv_heads < cfg.num_heads
    assert 40e6 < cfg.num_parameters() < 60e6
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    batch = prompts((12, 30), vocab=cfg.vocab_size)
    tokens, logits = engine_greedy(runner, batch, 8)
    with torch.no_grad():
        for i, p in enumerate(batch):
            ids = torch.tensor([p])
            assert rel_err(logits[i], hf(ids).logits[0, -1]) < 1e-4
            assert tokens[i] == hf.generate(ids, max_new_tokens=8, do_sample=False)[0, len(p):].tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ["qwen2", "mixtral", "qwen3_moe", "gemma3"])  # router scores in float32 or cast; Gemma norms
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_bfloat16_model_and_cache_track_float32(tmp_path, device, arch):
    build_hf_checkpoint(tmp_path, arch)
    batch = prompts((7, 26))
    ref_runner, _ = make_runner(tmp_path)
    model, cfg = load_model(tmp_path, "bfloat16", device)
    runner = ModelRunner(model, cfg, KVCache(cfg, 64, BLOCK, torch.bfloat16, device))
    _, ref = engine_greedy(ref_runner, batch, 1)
    _, got = engine_greedy(runner, batch, 1)
    assert got.dtype == torch.float32 and rel_err(got.cpu(), ref) < 0.05


def longrope(partial_rotary_factor: float = 1.0) -> dict:
    """Phi-3 config fields for LongRoPE with an original context of 32 and ``partial_rotary_factor`` of each
    16-dimension head rotated (a factor per rotated pair). A new dict each call: transformers' config
    writes into the rope parameters it is given."""
    half = int(16 * partial_rotary_factor) // 2
    return dict(sliding_window=None, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                original_max_position_embeddings=32, partial_rotary_factor=partial_rotary_factor,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5][:half],
                                 "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0][:half]})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.5])
def test_longrope_switches_to_its_long_factors_as_transformers_generates(tmp_path, partial_rotary_factor):
    """LongRoPE (Phi-3 128k, Phi-3.5) with an original context of 32: prompts longer than it rotate every
    position with the long factors; shorter ones switch when decoding passes it, the whole sequence computed
    again as transformers does, in a batch with the others and with speculative drafts; one resumed with
    output tokens that carry it past is long from the start. A long prompt takes no short prompt's cached
    blocks, and does take another long prompt's."""
    hf = build_hf_checkpoint(tmp_path, "phi3", **longrope(partial_rotary_factor))
    assert ModelConfig.from_dir(tmp_path).long_rope_from == 32
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=BLOCK, num_blocks=64, max_num_batched_tokens=32,
                                 num_speculative_tokens=3))
    short, long, _ = prompts((5, 40, 0))
    looped = (short * 7)[:20]  # repeats itself: n-gram drafts up to the switch
    requests = {"short": short, "long": long, "looped": looped, "short-prefix": long[:31],
                "long-prefix": long[:33] + short}
    params = {rid: SamplingParams(max_tokens=1 if rid == "short-prefix" else 24, temperature=0.0, ignore_eos=True)
              for rid in requests}  # short-prefix stops before the original context: it keeps short blocks
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def run(rids):
        for rid in rids:
            engine.add_request(rid, requests[rid], params[rid])
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
                cached[out.request_id] = out.num_cached_tokens

    run(["short", "looped", "short-prefix"])  # short-prefix registers long[:16], rotated with the short factors
    assert engine.stats().speculation.drafts > 0
    run(["long"])
    assert cached["long"] == 0  # the same tokens, rotated with the short factors: not its blocks
    run(["long-prefix"])
    assert cached["long-prefix"] == 32  # long's first two blocks, long-rotated
    # Resumed after 15 tokens elsewhere (past the original context with them): computed long from the start.
    with torch.no_grad():
        earlier = hf.generate(torch.tensor([looped]), max_new_tokens=15, do_sample=False)[0, len(looped):].tolist()
    engine.add_request("resumed", looped, params["looped"], output_ids=earlier)
    assert engine.requests["resumed"][0].hash_salt == engine.prefix_salt(None, len(looped) + 15) != \
        engine.prefix_salt(None, len(looped))
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert earlier + got.pop("resumed") == got["looped"]
    with torch.no_grad():
        for rid, ids in requests.items():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=params[rid].max_tokens,
                               do_sample=False)[0, len(ids):].tolist()
            assert got[rid] == want, rid
