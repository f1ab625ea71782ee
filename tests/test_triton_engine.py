"""The Triton attention backend wired into the engine (engine/triton_attention.py), run on CPU by the
Triton interpreter: greedy tokens equal the torch path's token for token through the whole engine
(mixed decode and prefill rows in one step, chunked prefill, prefix-cache hits, GQA, speculative decoding's
drafts, a mixture of experts), embeddings equal the torch path's, the runner's logits
equal the torch path's on one mixed step, how "auto" resolves, and which configurations are refused.
Also the KV-cache sizing arithmetic of engine/device_memory.py (plain numbers; the CUDA profiling pass
is in test_gpu)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# Before anything imports triton (transformers' Llama does): @triton.jit picks the interpreter or GPU
# compilation at decoration, once per process (see test_kernels).
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_engine_loop import GREEDY, prompt, write_model  # noqa: E402
from test_engine_model import build_hf_checkpoint, longrope, prompts  # noqa: E402

from engine.config import EngineConfig, IntQuant  # noqa: E402
from engine.cuda_graphs import DecodeGraphs, graph_batch_sizes  # noqa: E402
from engine.device_memory import GIB, engine_num_blocks, kv_cache_bytes_for_device, sample_largest_step  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.int_weights import write_int_checkpoint  # noqa: E402
from engine.kernels import common, triton_available  # noqa: E402
from engine.kv_cache import KVCache, num_blocks_for  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.runner import ModelRunner, SeqChunk  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.triton_attention import attention_backend  # noqa: E402
from engine.w8a8 import W8A8_RELEASES  # noqa: E402

INTERPRETED = triton_available() and common.interpreting()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="needs triton imported under TRITON_INTERPRET=1 (run this file on its own)")

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("triton-engine"))  # 4 query heads over 2 KV heads, head_dim 16


def drive(engine: Engine, arrivals: dict[int, list[tuple]], max_tokens: int):
    """Run to completion, adding ``arrivals[step]`` (request id, prompt, and optionally its LoRA adapter) before
    that step; returns (tokens per request, cached prompt tokens per request, each step's (decode rows,
    [(prefill tokens, tokens before them)]))."""
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    steps: list[tuple[int, list[tuple[int, int]]]] = []
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid, ids, *lora in arrivals.get(step, []):
            engine.add_request(rid, ids, params, lora=lora[0] if lora else None)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
        if (s := engine.last_step) is not None:
            steps.append((s.decode_seqs, [(n, pos) for _, n, pos in s.prefill_chunks]))
        step += 1
    return tokens, cached, steps


@needs_interpreter
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "kivi2"])
def test_engine_greedy_tokens_equal_torch_backend(model_dir, kv_cache_dtype: str):
    """Three prompts of mixed lengths batched together (one long enough to be chunked), then a repeat of
    one of them (a prefix-cache hit) and a new prompt joining while the others decode; plain, int8 (the
    write kernel's codes) and kivi2 (packed codes, the blocks still filling read from their windows, as
    fp8's are; test_kernels covers fp8's dequantization), against the torch path on the same format."""
    a, b, c = prompt(5, 1), prompt(19, 2), prompt(37, 3)
    arrivals = {0: [("a", a), ("b", b), ("c", c)], 3: [("b-again", b + prompt(3, 4)), ("d", prompt(11, 5))]}
    runs = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(model=str(model_dir), block_size=8, num_blocks=64,
                                     max_num_batched_tokens=32, attention_backend=backend,
                                     kv_cache_dtype=kv_cache_dtype))
        assert engine.attention_backend == backend
        runs[backend] = drive(engine, arrivals, max_tokens=6)
    tokens, cached, steps = runs["triton"]
    assert tokens == runs["torch"][0]
    assert all(len(t) == 6 for t in tokens.values()) and len(tokens) == 5
    # the test covered what it claims: decode and prefill rows in one step, a chunk after its own earlier
    # chunk (c is longer than the token budget), and a prompt after a cached prefix
    assert any(decode and prefills for decode, prefills in steps)
    assert any(pos > 0 for _, prefills in steps for _, pos in prefills)
    # b's two full blocks of 8; kivi2 recomputes its residual block (the second), kept exact as a cold run has it
    assert cached["b-again"] == (8 if kv_cache_dtype == "kivi2" else 16)


@needs_interpreter
def test_embeddings_on_triton_equal_torch_beside_decoding_rows_chunked_and_after_a_cached_prefix(model_dir):
    """Embedding requests (``Engine.add_embedding_request``) read the final-norm hidden rows of a step the
    kernels computed: one chunked past the token budget while a generation decodes, one after its prefix
    cached, one of a single token."""
    long = prompt(37, 10)
    arrivals = {0: [("g", prompt(9, 11), None), ("e-long", long, 12)], 3: [("e-again", long + prompt(4, 12), None),
                                                                         ("e-one", prompt(1, 13), None)]}
    vectors = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(model=str(model_dir), block_size=8, num_blocks=64, max_num_batched_tokens=32,
                                     attention_backend=backend))
        out, step = {}, 0
        while step <= max(arrivals) or engine.has_unfinished():
            for rid, ids, dims in arrivals.get(step, []):
                if rid == "g":
                    engine.add_request(rid, ids, SamplingParams(max_tokens=8, **GREEDY))
                else:
                    engine.add_embedding_request(rid, ids, dims)
            out |= {o.request_id: o for o in engine.step() if o.finished}
            step += 1
        vectors[backend] = {rid: o.embedding for rid, o in out.items() if rid != "g"}
        assert out["e-again"].num_cached_tokens == 32 and len(out["e-long"].embedding) == 12
    for rid, want in vectors["torch"].items():
        torch.testing.assert_close(torch.tensor(vectors["triton"][rid]), torch.tensor(want), atol=1e-5, rtol=0)


@needs_interpreter
def test_runner_logits_of_one_mixed_step_equal_torch_backend(model_dir):
    """One pass holding decode rows, a fresh prompt and a chunk after cached context (block size 8, tables
    not in position order): float32 logits agree with the torch path to 1e-5."""
    model, cfg = load_model(model_dir, "float32", "cpu")
    runners = {b: ModelRunner(model, cfg, KVCache(cfg, 32, 8, torch.float32, "cpu"), attention_backend=b)
               for b in ("torch", "triton")}
    p0, p1, p2, p3 = prompt(9, 6), prompt(20, 7), prompt(13, 8), prompt(30, 9)
    t0, t1, t2, t3 = [3, 1], [7, 2, 30], [9, 4], [11, 12, 13, 14]
    first = [SeqChunk(p0, 0, t0), SeqChunk(p1, 0, t1), SeqChunk(p3[:17], 0, t3)]
    mixed = [SeqChunk(p2, 0, t2), SeqChunk([5], 9, t0), SeqChunk(p3[17:], 17, t3), SeqChunk([6], 20, t1)]
    logits = {}
    for backend, runner in runners.items():
        logits[backend] = (runner.run(first), runner.run(mixed))
    for got, want in zip(logits["triton"], logits["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@needs_interpreter
def test_decode_steps_through_the_graph_buffers_equal_eager_steps(model_dir):
    """DecodeGraphs' padded pass over static buffers (what CUDA captures; run uncaptured here): three
    sequences padded to a batch of 4, then four, then one alone, with the prefill steps between them run
    eagerly: the greedy tokens equal the eager Triton path's, and the caches end up equal, so no padded
    row wrote anything (an int8 cache's write kernel skips them as well: test_kernels). So does a run with
    async scheduling, whose decode steps take the last step's tokens into the buffers on the device."""
    arrivals = {0: [("a", prompt(5, 1)), ("b", prompt(19, 2)), ("c", prompt(9, 3))], 4: [("d", prompt(11, 5))]}
    engines = {}
    for mode in ("eager", "graphs", "graphs, async"):
        engine = Engine(EngineConfig(model=str(model_dir), block_size=8, num_blocks=64,
                                     max_num_batched_tokens=32, max_num_seqs=8, attention_backend="triton",
                                     async_scheduling=mode.endswith("async")))
        if mode != "eager":
            engine.runner.enable_decode_graphs(8, 512 // 8, capture=False)
        engines[mode] = (engine, drive(engine, arrivals, max_tokens=8))
    (eager, (want, _, _)), (graphed, (got, _, steps)) = engines["eager"], engines["graphs"]
    assert got == want and all(len(t) == 8 for t in got.values())
    ahead, (got_ahead, _, _) = engines["graphs, async"]
    replayed = [sum(e.runner.graphs.replays.values()) for e in (ahead, graphed)]
    assert got_ahead == want and replayed[0] == replayed[1]
    # (every request ends by its length, which async scheduling knows ahead: no row is computed past an end)
    torch.testing.assert_close(ahead.kv_cache.data, graphed.kv_cache.data, atol=1e-5, rtol=0)
    replays = graphed.runner.graphs.replays
    # every step of one-token chunks went through the buffers (a prompt's last chunk of one token included:
    # it is a decode row to attention), and only those
    assert {1, 4} <= set(replays) and sum(replays.values()) == sum(all(n == 1 for n, _ in p) for _, p in steps)
    # (to float32 rounding: a padded batch's matmuls round differently; a padded row's write would not)
    torch.testing.assert_close(graphed.kv_cache.data, eager.kv_cache.data, atol=1e-5, rtol=0)
    assert graph_batch_sizes(8) == [1, 2, 4, 8] and graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_graph_buffers_hold_each_steps_tables_as_its_rows_change(model_dir):
    """DecodeGraphs.load keeps a host mirror of the block tables and rewrites a row only where it changed: over
    steps whose rows grow by a block, change in place (a copy-on-write, a window's dropped block), shrink, move
    to another row as a batch loses a sequence, and become padding, every row's table up to the step's width is
    the chunk's own, block 0 past its end, and a padding sequence reads block 0 and writes nothing."""
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, num_blocks=64, max_num_seqs=4,
                                 attention_backend="torch"))
    graphs = DecodeGraphs(engine.runner, 4, 16, capture=False, query_len=3)
    a, b, c = [1, 2, 3], [7, 8], [9]  # live tables, changed in place as the block manager changes them

    def grown(table: list[int], *blocks: int) -> list[int]:
        table.extend(blocks)
        return table

    def replaced(table: list[int], index: int, block: int) -> list[int]:
        table[index] = block
        return table

    steps = [
        lambda: [(a, 9, 5), (b, 5, 6), (c, 2, 7)],
        lambda: [(grown(a, 4), 12, 5), (b, 6, 6), (c, 3, 7)],  # a row grows by a block
        lambda: [(replaced(a, 1, 20), 13, 5), (replaced(grown(b, 11), 0, -1), 8, 6), (c, 3, 7)],  # in place
        lambda: [(b, 9, 6), (c, 3, 7)],  # the first sequence ended: the others move up a row
        lambda: [([30, 31, 32, 33, 34], 17, 1), (grown(c, 5), 4, 2), (b, 10, 3), ([2], 1, 4)],
        lambda: [(c, 5, 2), (b, 11, 3), ([2, 6], 5, 4)],  # the last row, which held a table, is padding now
    ]
    for make_step in steps:
        step = make_step()
        chunks = [SeqChunk([token], pos, table) for table, pos, token in step]
        size, q = graphs.load(chunks)
        n, B = len(chunks), engine.block_size
        width = max(pos // B + 1 for _, pos, _ in step)
        assert (size, q) == (4 if n > 2 else 2, 1)
        for i, (table, pos, token) in enumerate(step):
            assert graphs.tables[i, :width].tolist() == (table + [0] * width)[:width]
            assert graphs.input_ids[i] == token and graphs.positions[i] == pos and graphs.context_lens[i] == pos + 1
            assert graphs.slots[i] == table[pos // B] * B + pos % B
        for i in range(n, size):  # padding sequences
            assert graphs.tables[i, 0] == 0 and graphs.slots[i] == -1 and graphs.context_lens[i] == 1
    drafted = [SeqChunk([5, 6, 7], 6, [3, 4, 9]), SeqChunk([8], 3, [2])]  # a draft to verify, beside a decode row
    drafted[0].drafted = True
    assert graphs.load(drafted) == (2, 3)
    assert graphs.input_ids[:6].tolist() == [5, 6, 7, 8, 0, 0] and graphs.positions[:6].tolist() == [6, 7, 8, 3, 0, 0]
    assert graphs.slots[:6].tolist() == [18, 19, 36, 11, -1, -1] and graphs.context_lens[:2].tolist() == [9, 6]
    assert graphs.tables[:2, :3].tolist() == [[3, 4, 9], [2, 0, 0]]


@needs_interpreter
def test_speculative_decoding_on_triton_equals_plain_torch_decoding(model_dir):
    """Drafts (n-gram prompt lookup) verified through the prefill kernel over cached context: through the
    drafted steps' graph buffers when no sequence drafts more than 2 tokens (each padded to 1 + 2 rows, decode
    rows among them), eagerly when one drafts 3, beside decode steps replayed through the plain graph
    buffers: the greedy tokens equal the torch path's without drafts."""
    looped = prompt(6, 1) * 4
    arrivals = {0: [("a", looped), ("b", prompt(9, 2) * 3)], 2: [("c", looped + prompt(3, 3))]}
    want = drive(Engine(EngineConfig(model=str(model_dir), block_size=8, num_blocks=64,
                                     attention_backend="torch")), arrivals, max_tokens=24)[0]
    engine = Engine(EngineConfig(model=str(model_dir), block_size=8, num_blocks=64, attention_backend="triton",
                                 num_speculative_tokens=3))
    engine.runner.enable_decode_graphs(8, 512 // 8, capture=False, query_len=3)
    compositions, step = [], engine.step

    def recorded_step(*args):
        outputs = step(*args)
        compositions.append(engine.last_step)
        return outputs

    engine.step = recorded_step
    assert drive(engine, arrivals, max_tokens=24)[0] == want
    assert engine.stats().speculation.accepted_tokens > 0
    graphs = engine.runner.graphs
    # each step of decode rows only went through the plain buffers, and each step of decode rows and drafts
    # of at most 2 tokens through the drafted steps' buffers; "c"'s prompt after its cached prefix is a chunk
    # of neither kind
    steps = [s for s in compositions if s is not None]
    assert sum(graphs.replays.values()) == sum(not s.prefill_chunks for s in steps)
    verifying = [s for s in steps if s.prefill_chunks and s.drafted_seqs == len(s.prefill_chunks)]
    fitting = sum(all(n <= 3 for _, n, _ in s.prefill_chunks) for s in verifying)  # query_len 3: 1 + 2 drafts
    assert 0 < sum(graphs.draft_replays.values()) == fitting < len(verifying)  # and some verified eagerly


@needs_interpreter
def test_a_draft_model_on_triton_through_its_graph_buffers_equals_plain_torch_decoding(model_dir):
    """A draft model (the checkpoint itself) on the Triton backend, its one-token passes through its own decode
    graph buffers (uncaptured: the CPU's way), the target's drafted steps through theirs: the greedy tokens
    equal the torch path's without drafts, and every draft is accepted."""
    arrivals = {0: [("a", prompt(6, 1) * 4), ("b", prompt(9, 2) * 3)]}
    want = drive(Engine(EngineConfig(model=str(model_dir), block_size=8, num_blocks=64,
                                     attention_backend="torch")), arrivals, max_tokens=16)[0]
    engine = Engine(EngineConfig(model=str(model_dir), block_size=8, num_blocks=64, attention_backend="triton",
                                 num_speculative_tokens=3, speculative_model=str(model_dir)))
    engine.runner.enable_decode_graphs(8, 512 // 8, capture=False, query_len=4)
    engine.proposer.runner.enable_decode_graphs(8, 512 // 8, capture=False)
    assert drive(engine, arrivals, max_tokens=16)[0] == want
    stats = engine.stats().speculation
    assert stats.accepted_tokens >= 0.9 * stats.draft_tokens > 0
    assert sum(engine.proposer.runner.graphs.replays.values()) > 0  # the draft's one-token passes
    assert sum(engine.runner.graphs.draft_replays.values()) > 0


def runs_by_backend(model_dir, arrivals: dict, max_tokens: int, graph_batch: int = 2,
                    **options) -> tuple[dict, Engine]:
    """The greedy tokens of ``arrivals`` (``drive``) on the torch backend and on Triton, and that Triton engine.
    Its decode steps of up to ``graph_batch`` sequences go through the static graph buffers (uncaptured: the
    CPU's way) and larger ones run eagerly, as a GPU runs a batch above its largest graph: the run must have
    taken both ways, so one interpreted run covers both (the interpreter is the suite's largest cost)."""
    runs = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(model=str(model_dir), block_size=8, attention_backend=backend, **options))
        if backend == "triton":
            engine.runner.enable_decode_graphs(graph_batch, 256 // 8, capture=False)
        runs[backend], _, steps = drive(engine, arrivals, max_tokens=max_tokens)
    # the Triton run's steps of one-token chunks after some context (what DecodeGraphs.fits takes): their sizes
    decode_only = [decode + len(prefills) for decode, prefills in steps
                   if all(n == 1 and pos > 0 for n, pos in prefills)]
    assert sum(engine.runner.graphs.replays.values()) == sum(rows <= graph_batch for rows in decode_only) > 0
    assert any(rows > graph_batch for rows in decode_only)  # and some ran eagerly
    return runs, engine


@needs_interpreter
def test_lora_adapters_on_triton_equal_torch_also_through_the_graph_buffers(tmp_path):
    """Sequences of two adapters join a base-model batch that decodes through the static graph buffers, where
    the grouped LoRA kernels read each row's slot: the greedy tokens equal the torch path's (per-adapter
    matmuls), the three together eagerly, the base alone and the two adapters' rows replayed. An adapter of a
    lower rank loaded into a freed slot reads nothing of the one before it."""
    from test_lora import ALL_PROJECTIONS, peft_adapter

    hf = build_hf_checkpoint(tmp_path / "base", "llama")
    peft_adapter(hf, tmp_path / "crab", ALL_PROJECTIONS, rank=8, seed=1)
    peft_adapter(hf, tmp_path / "kelp", ["q_proj", "v_proj"], rank=2, seed=2)
    peft_adapter(hf, tmp_path / "clam", ["q_proj"], rank=2, seed=3)
    p, q, r = prompts((20, 9, 13))
    modules = {"crab": str(tmp_path / "crab"), "kelp": str(tmp_path / "kelp")}
    runs, engine = runs_by_backend(tmp_path / "base", {0: [("base", p)], 3: [("crab", q, "crab"), ("kelp", r, "kelp")]},
                                   10, num_blocks=32, lora_modules=modules, max_cpu_loras=3)
    assert runs["torch"] == runs["triton"]

    engine.unload_adapter("crab")
    engine.load_adapter("clam", str(tmp_path / "clam"))
    assert engine.lora_slots.slot_of("clam") == 1  # crab's slot, rank 8 before
    clam = Engine(EngineConfig(model=str(tmp_path / "base"), block_size=8, num_blocks=32,
                               lora_modules={"clam": str(tmp_path / "clam")}))
    arrivals = {0: [("clam", q, "clam"), ("kelp", r, "kelp")]}
    assert drive(engine, arrivals, 6)[0] == drive(clam, {0: arrivals[0][:1]}, 6)[0] | {"kelp": runs["torch"]["kelp"][:6]}


@needs_interpreter
def test_adapters_drafts_verified_through_the_graph_buffers_equal_torch_decoding(tmp_path):
    """Sequences of two adapters and of the base model verify n-gram drafts through the drafted steps' graph
    buffers (each row's adapter slot read by the grouped LoRA kernels, the padding rows' -1): the greedy
    tokens equal the torch path's without drafts."""
    from test_lora import ALL_PROJECTIONS, peft_adapter

    hf = build_hf_checkpoint(tmp_path / "base", "llama")
    peft_adapter(hf, tmp_path / "crab", ALL_PROJECTIONS, rank=4, seed=1)
    peft_adapter(hf, tmp_path / "kelp", ["q_proj", "v_proj"], rank=2, seed=2)
    modules = {"crab": str(tmp_path / "crab"), "kelp": str(tmp_path / "kelp")}
    looped = prompts((6,))[0] * 4
    arrivals = {0: [("crab", looped, "crab"), ("kelp", looped, "kelp"), ("base", looped)]}
    config = dict(model=str(tmp_path / "base"), block_size=8, num_blocks=48, lora_modules=modules)
    want = drive(Engine(EngineConfig(**config, attention_backend="torch")), arrivals, 16)[0]
    engine = Engine(EngineConfig(**config, attention_backend="triton", num_speculative_tokens=3))
    engine.runner.enable_decode_graphs(4, 256 // 8, capture=False, query_len=4)
    assert drive(engine, arrivals, 16)[0] == want
    assert sum(engine.runner.graphs.draft_replays.values()) > 0 and engine.stats().speculation.accepted_tokens > 0


@needs_interpreter
@pytest.mark.parametrize("quantization", [None, "fp8", "awq", "gptq_int8", "w8a8"])
def test_mixture_of_experts_on_triton_equals_torch_also_through_the_graph_buffers(tmp_path, quantization):
    """Mixtral's experts through the fused MoE kernels, between the fused residual norms: the greedy tokens
    equal the torch path's (its loop over experts), with decode steps run eagerly and through the static
    graph buffers (the kernels never read back to the host, so such steps can be captured); with fp8
    experts too (quantized as they load), an AWQ checkpoint's 4-bit ones and a GPTQ one's 8-bit ones (the
    kernels scale the codes' partial sums, the loop dequantizes each expert's matrices), and a w8a8 one's int8
    ones (each row of their input quantized in one launch, int32 sums scaled once; the loop's w8a8_linear)."""
    build_hf_checkpoint(tmp_path, "mixtral")
    if quantization in ("awq", "gptq_int8", "w8a8"):
        raw = json.loads((tmp_path / "config.json").read_text())
        quant = {"awq": IntQuant("awq", 16), "gptq_int8": IntQuant("gptq", 16, bits=8),
                 "w8a8": W8A8_RELEASES}[quantization]
        write_int_checkpoint(tmp_path, load_file(tmp_path / "model.safetensors"), raw, quant)
    a, b, c = prompts((7, 20, 9))  # in its vocabulary of 128
    runs, engine = runs_by_backend(tmp_path, {0: [("a", a), ("b", b)], 2: [("c", c)]}, 5, num_blocks=32,
                                   quantization=quantization if quantization == "fp8" else None)
    experts = next(layer.mlp.experts for layer in engine.model.model.layers if hasattr(layer.mlp, "experts"))
    assert experts.gate_up_proj.dtype == {None: torch.float32, "fp8": torch.float8_e4m3fn, "awq": torch.uint8,
                                          "gptq_int8": torch.uint8, "w8a8": torch.int8}[quantization]
    assert runs["triton"] == runs["torch"]
    assert all(len(t) == 5 for t in runs["torch"].values())


@needs_interpreter
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_sliding_window_model_on_triton_equals_torch_also_through_the_graph_buffers(tmp_path,
                                                                                      kv_cache_dtype: str):
    """Mistral v0.1's sliding window (here 20 tokens, blocks of 8) in the kernels: prompts past the window,
    chunked (a 32-token budget) and decoding on past it, their blocks behind every window given back
    (-1 in the tables, never read): the greedy tokens equal the torch path's, eagerly and with decode steps
    through the static graph buffers."""
    build_hf_checkpoint(tmp_path, "mistral", sliding_window=20)
    a, b, c = prompts((7, 45, 26))
    runs, engine = runs_by_backend(tmp_path, {0: [("a", a), ("b", b)], 3: [("c", c)]}, 16, num_blocks=64,
                                   max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype)
    assert engine.window is not None and engine.window.window == 20
    assert runs["triton"] == runs["torch"]
    assert all(len(t) == 16 for t in runs["torch"].values())


@needs_interpreter
def test_a_window_on_some_layers_only_on_triton_equals_torch_also_through_the_graph_buffers(tmp_path):
    """Qwen's use_sliding_window on layer 1 of 2 (12 positions): the kernels take that layer's window, the
    other layer's attention stays whole; the greedy tokens equal the torch path's (its masks narrowed to the
    window), eagerly and through the graph buffers."""
    build_hf_checkpoint(tmp_path, "qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=1)
    a, b = prompts((30, 9))
    runs, _ = runs_by_backend(tmp_path, {0: [("a", a), ("b", b)]}, 16, graph_batch=1, num_blocks=32,
                              max_num_batched_tokens=16)
    assert runs["triton"] == runs["torch"]


@needs_interpreter
@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_gemma_on_triton_equals_torch_also_through_the_graph_buffers(tmp_path, arch):
    """Gemma's layers on the kernels: its norms fused with the residual adds (scaling by the float32 1 +
    weight before the cast), its softmax scale in the attention kernels, a sliding layer beside a full one
    (Gemma 3's on a RoPE of its own; Gemma 2's attention scores soft-capped in the kernels); greedy tokens
    equal the torch path's, eagerly and through the graph buffers."""
    build_hf_checkpoint(tmp_path, arch)
    a, b = prompts((30, 9))
    runs, _ = runs_by_backend(tmp_path, {0: [("a", a), ("b", b)]}, 16, graph_batch=1, num_blocks=32,
                              max_num_batched_tokens=16)
    assert runs["triton"] == runs["torch"]


@needs_interpreter
def test_longrope_with_a_partial_rotary_factor_on_triton_equals_torch_also_through_the_graph_buffers(tmp_path):
    """Phi-3's LongRoPE (an original context of 32) with half of each head rotated, as Phi-4-mini rotates
    three quarters: a prompt past the original context and two that pass it while decoding (computed again
    with the long factors), rotated in place by the kernel over the leading dimensions only; decode steps
    through the static graph buffers take the long factors by position alone. The greedy tokens equal the
    torch path's."""
    build_hf_checkpoint(tmp_path, "phi3", **longrope(0.5))
    a, b, c = prompts((20, 45, 26))
    runs, _ = runs_by_backend(tmp_path, {0: [("a", a), ("b", b)], 3: [("c", c)]}, 16, num_blocks=64,
                              max_num_batched_tokens=32)
    assert runs["triton"] == runs["torch"]
    assert all(len(t) == 16 for t in runs["torch"].values())


def test_triton_with_sinks_and_graphs_of_a_windowed_format_are_refused(model_dir):
    with pytest.raises(ValueError, match="kv_sinks"):
        EngineConfig(model=str(model_dir), attention_backend="triton", kv_window=64, kv_sinks=4)
    EngineConfig(model=str(model_dir), attention_backend="triton", kv_window=64)  # a plain window runs on it
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model=str(model_dir), attention_backend="flash")
    model, cfg = load_model(model_dir, "float32", "cpu")
    runner = ModelRunner(model, cfg, KVCache(cfg, 8, 8, torch.float32, "cpu", "fp8"), attention_backend="triton")
    with pytest.raises(ValueError, match="auto or int8 cache"):  # fp8 and kivi2 window pools plan on the host
        runner.enable_decode_graphs(4, 8, capture=False)


def test_auto_backend_is_triton_on_cuda_without_attention_sinks():
    """Resolution only reads the config (no device is touched), so the CUDA cases are checked here too."""
    assert attention_backend(EngineConfig(model="tiny")) == "torch"
    assert attention_backend(EngineConfig(model="tiny", attention_backend="torch", device="cuda")) == "torch"
    assert attention_backend(EngineConfig(model="tiny", device="cuda", kv_window=128, kv_sinks=4)) == "torch"
    for kv_cache_dtype in ("auto", "int8", "fp8", "kivi2"):
        config = EngineConfig(model="tiny", device="cuda", kv_cache_dtype=kv_cache_dtype)
        assert attention_backend(config) == ("triton" if triton_available() else "torch")
    windowed = EngineConfig(model="tiny", device="cuda", kv_window=128)  # a plain sliding window
    assert attention_backend(windowed) == ("triton" if triton_available() else "torch")


@needs_interpreter
def test_explicit_triton_on_cpu_needs_the_interpreter(monkeypatch):
    assert attention_backend(EngineConfig(model="tiny", attention_backend="triton")) == "triton"
    monkeypatch.setattr(common, "interpreting", lambda: False)  # as in a process without TRITON_INTERPRET
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attention_backend(EngineConfig(model="tiny", attention_backend="triton"))


# ---- KV cache sized from the device (engine/device_memory.py) --------------------------------------

def test_kv_cache_bytes_are_the_utilization_share_minus_what_is_used():
    assert kv_cache_bytes_for_device(80 * GIB, 20 * GIB, 0.9) == 52 * GIB
    assert kv_cache_bytes_for_device(1000, 0, 1.0) == 1000
    with pytest.raises(ValueError, match=r"need 75\.00 GiB of 80\.00 GiB at gpu_memory_utilization 0\.9.*"
                                         "lower max_num_batched_tokens or raise --gpu-memory-utilization"):
        kv_cache_bytes_for_device(80 * GIB, 75 * GIB, 0.9)
    with pytest.raises(ValueError):
        kv_cache_bytes_for_device(80 * GIB, 72 * GIB, 0.9)  # exactly nothing left
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="tiny", gpu_memory_utilization=1.5)


@pytest.mark.parametrize("k, draft, batched, rows", [(0, None, 2048, (3, 512)), (4, None, 2048, (15, 512)),
                                                     (4, "tiny", 2048, (15, 512)), (0, None, 100, (3, 100))])
def test_the_sampler_profile_samples_every_row_a_full_batch_verifies_beside_the_prompt_logprob_rows(
        k, draft, batched, rows):
    """The profile's sampling step (run here on the CPU; on CUDA its peak counts in the budget): a full batch's
    rows, k + 1 a sequence when it drafts, through every transform (and a draft model's draws), after the most
    prompt-logprob rows a step scores (no more than its tokens)."""
    config = EngineConfig(model="tiny", max_num_seqs=3, num_speculative_tokens=k, speculative_model=draft,
                          max_num_batched_tokens=batched)
    assert sample_largest_step(config, 1000) == rows


def test_cpu_keeps_the_byte_budget_and_num_blocks_overrides(model_dir):
    model, cfg = load_model(model_dir, "float32", "cpu")
    config = EngineConfig(model=str(model_dir), kv_cache_bytes=1 << 20, gpu_memory_utilization=0.1)
    # a block: 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB; 1 MiB holds 128
    assert engine_num_blocks(model, cfg, config, "torch") == num_blocks_for(cfg, config) == 128
    config = EngineConfig(model=str(model_dir), num_blocks=7)
    assert engine_num_blocks(model, cfg, config, "torch") == 7
