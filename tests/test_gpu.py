"""On CUDA (skipped without it): KV leaving GPU memory over gRPC, the KV cache sized from device memory, and
the Triton attention backend (with a sliding window too), fused MoE and fp8 weight kernels compiled for the
device (the bf16 engine on CUDA is in test_engine_model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.timeout(120)
def test_grpc_push_from_gpu_memory_arrives_intact():
    pytest.importorskip("grpc")  # the engine tests below run on a bare CUDA machine without it
    from kvstore.transfer.grpc import KVTransferClient, KVTransferServer
    from kvstore.transfer.sink import TensorSink
    from kvstore.transfer.wire import TransferHeader

    source = torch.randn(4, 2, 8, 16, 2, 64, device="cuda").to(torch.bfloat16)
    header = TransferHeader.describe("gpu-push", "tiny", source.shape, source.dtype)
    sink = TensorSink()
    out = torch.empty(source.shape, dtype=source.dtype)
    sink.expect("gpu-push", out)
    server = KVTransferServer(sink).start()
    try:
        KVTransferClient(server.target).push(header, source, timeout_s=60)
        assert sink.wait("gpu-push", 60).committed
    finally:
        server.stop()
    assert torch.equal(out, source.cpu())


# ---- the engine on CUDA: KV cache sized from device memory, the Triton attention backend ----------

def _engine_config(model_dir, **kwargs):
    from engine.config import EngineConfig

    return EngineConfig(model=str(model_dir), device="cuda", block_size=8, **kwargs)


@pytest.mark.timeout(300)
def test_kv_cache_takes_the_device_memory_left_below_the_utilization(tmp_path):
    """num_blocks unset: the profiled budget holds the weights and the KV cache under utilization x total,
    leaves the KV cache nearly all of what was free below that line, and too small a share is refused."""
    from test_engine_loop import GREEDY, prompt, write_model

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    model_dir = write_model(tmp_path)
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    engine = Engine(_engine_config(model_dir, dtype="bfloat16", gpu_memory_utilization=0.3))
    kv_bytes = engine.kv_cache.data.nbytes
    assert engine.stats().total_blocks == engine.kv_cache.num_blocks  # what load reports and status show
    assert torch.cuda.memory_allocated() <= 0.3 * total
    assert kv_bytes >= 0.3 * total - (total - free_before) - (1 << 30)  # the tiny model needs far below 1 GiB
    engine.add_request("r", prompt(20, 1), SamplingParams(max_tokens=4, **GREEDY))
    while engine.has_unfinished():
        engine.step()
    del engine
    torch.cuda.empty_cache()
    with pytest.raises(ValueError, match="lower max_num_batched_tokens or raise --gpu-memory-utilization"):
        Engine(_engine_config(model_dir, gpu_memory_utilization=1e-4))


@pytest.mark.timeout(120)
def test_the_profile_sees_the_samplers_largest_step():
    """A drafted full batch's rows, sampled with every transform and a draft model's draws beside a step's
    prompt-logprob rows: at its peak at least those rows' logits, the sampled rows' logits, their masked copy,
    the draws and the penalised copy are on the device at once, beside the penalty count tables of every
    sequence, the draft model's too (int32 counts and a bool prompt mask a vocabulary entry), and the profile
    counts them against the utilization."""
    from engine.config import EngineConfig
    from engine.device_memory import sample_largest_step

    config = EngineConfig(model="tiny", device="cuda", max_num_seqs=64, num_speculative_tokens=4,
                          speculative_model="tiny")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    rows, prompt_rows = sample_largest_step(config, 32000)
    torch.cuda.synchronize()
    tables = 2 * config.max_num_seqs * 32000 * (4 + 1)
    assert torch.cuda.max_memory_allocated() - before >= (prompt_rows + 4 * rows) * 32000 * 4 + tables


def ran_in_a_compiling_process(test: str) -> bool:
    """Skips without triton. If another test module put this process's triton in interpreter mode, runs
    ``test`` (of this file) in a fresh process, asserts it passed and returns True; else False."""
    from engine.kernels import triton_available

    if not triton_available():
        pytest.skip("triton is not importable")
    from engine.kernels.common import interpreting

    if not interpreting():
        return False
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test}"],
                            cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=580)
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout + result.stderr
    return True


@pytest.mark.timeout(600)
def test_embeddings_on_cuda_beside_graph_replayed_decoding_equal_the_cpu_engines(tmp_path):
    """Compiled kernels, decode steps replayed from CUDA graphs between the embedding steps: float32 vectors
    (one chunked, one after its prefix cached) equal the CPU engine's."""
    if ran_in_a_compiling_process("test_embeddings_on_cuda_beside_graph_replayed_decoding_equal_the_cpu_engines"):
        return
    from test_engine_loop import GREEDY, prompt, write_model

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    model_dir = write_model(tmp_path)
    long = prompt(45, 3)
    vectors, replays = {}, 0
    for config in (EngineConfig(model=str(model_dir), block_size=8, num_blocks=128, max_num_batched_tokens=32),
                   _engine_config(model_dir, num_blocks=128, max_num_batched_tokens=32)):
        engine = Engine(config)
        engine.add_request("g", prompt(7, 1), SamplingParams(max_tokens=24, **GREEDY))
        engine.add_embedding_request("e-long", long)
        done, step = {}, 0
        while engine.has_unfinished():
            if step == 6:
                engine.add_embedding_request("e-again", long + prompt(3, 4))
            done |= {o.request_id: o for o in engine.step() if o.finished}
            step += 1
        vectors[config.device] = {rid: torch.tensor(o.embedding) for rid, o in done.items() if rid != "g"}
        assert done["e-again"].num_cached_tokens == 40
        if engine.runner.graphs is not None:
            replays = sum(engine.runner.graphs.replays.values())
    assert replays > 0
    for rid, want in vectors["cpu"].items():
        torch.testing.assert_close(vectors["cuda"][rid], want, atol=1e-4, rtol=0)


@pytest.mark.timeout(600)
def test_triton_backend_on_cuda_matches_torch_backend(tmp_path):
    """Compiled kernels (not the interpreter): float32 greedy tokens equal the torch path's for mixed
    lengths, chunked prefill and a prefix-cache hit, eagerly and with decode steps replayed from CUDA
    graphs (the default), and on int8 (graphs too), fp8 and kivi2 caches; auto picks triton on CUDA."""
    if ran_in_a_compiling_process("test_triton_backend_on_cuda_matches_torch_backend"):
        return
    from test_engine_loop import GREEDY, prompt, run, write_model

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    model_dir = write_model(tmp_path)
    params = SamplingParams(max_tokens=8, **GREEDY)
    b = prompt(19, 2)
    requests = {"a": (prompt(5, 1), params), "b": (b, params), "c": (prompt(45, 3), params),
                "b-again": (b + prompt(4, 4), params)}  # joins at step 2, after b's blocks are cached
    runs, replays = {}, None
    for backend, eager in (("torch", True), ("auto", True), ("auto", False)):
        engine = Engine(_engine_config(model_dir, num_blocks=128, max_num_batched_tokens=32,
                                       attention_backend=backend, enforce_eager=eager))
        runs[engine.attention_backend, eager] = run(engine, requests, arrivals=[0, 0, 0, 2])
        if not eager:  # decode steps replayed from captured CUDA graphs
            replays = sum(engine.runner.graphs.replays.values())
    assert set(runs) == {("torch", True), ("triton", True), ("triton", False)}
    assert runs["triton", True] == runs["torch", True] and all(len(t) == 8 for t in runs["torch", True].values())
    assert runs["triton", False] == runs["torch", True] and replays > 0
    for kv_cache_dtype in ("int8", "fp8", "kivi2"):  # codes dequantized in the compiled kernels
        got = {}
        for backend in ("torch", "auto"):
            engine = Engine(_engine_config(model_dir, num_blocks=128, max_num_batched_tokens=32,
                                           attention_backend=backend, kv_cache_dtype=kv_cache_dtype))
            got[engine.attention_backend] = run(engine, requests, arrivals=[0, 0, 0, 2])
            graphs = engine.runner.graphs  # int8 steps are captured; fp8's and kivi2's windows plan on the host
            assert (graphs is not None and sum(graphs.replays.values()) > 0) == (
                engine.attention_backend == "triton" and kv_cache_dtype == "int8")
        assert got["triton"] == got["torch"], kv_cache_dtype


@pytest.mark.timeout(600)
def test_async_scheduled_steps_on_cuda_graphs_match_synchronous_ones_and_never_wait_for_the_device(tmp_path):
    """Async scheduling on compiled kernels and captured decode graphs: float32 tokens, greedy and seeded with
    top-p, some with logprobs, penalties, min_tokens, a logit bias and bad words, or allowed token ids, equal
    the synchronous engine's, requests joining while others
    decode; and once every request decodes, a step neither copies from pageable memory nor synchronizes a
    stream (torch's sync debug mode raises on either): the host never waits for the device's step in flight."""
    if ran_in_a_compiling_process(
            "test_async_scheduled_steps_on_cuda_graphs_match_synchronous_ones_and_never_wait_for_the_device"):
        return
    from test_engine_loop import GREEDY, prompt, run, write_model

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    model_dir = write_model(tmp_path)
    def params(i: int) -> SamplingParams:
        sampling = GREEDY if i % 2 else dict(temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
        # what the sampler applies to all rows at once: bans (min_tokens' stop tokens, bad words), a bias, allowed ids
        rules = [dict(min_tokens=6, stop_token_ids=[9]), {}, dict(allowed_token_ids=list(range(40, 200))), {}, {},
                 dict(logit_bias=[(3, 1.5)], bad_words_token_ids=[[7], [4, 5]])][i]
        return SamplingParams(max_tokens=16 + i, logprobs=i % 3 or None,
                              repetition_penalty=1.3 if i == 3 else 1.0, frequency_penalty=0.5 if i == 4 else 0.0,
                              **sampling, **rules)

    requests = {f"r{i}": (prompt(7 + 11 * i, i), params(i)) for i in range(6)}
    runs, replays = {}, {}
    for async_scheduling in (False, True):
        engine = Engine(_engine_config(model_dir, num_blocks=128, max_num_batched_tokens=64,
                                       async_scheduling=async_scheduling))
        runs[async_scheduling] = run(engine, requests, arrivals=[0, 0, 0, 3, 3, 5])
        replays[async_scheduling] = sum(engine.runner.graphs.replays.values())
    assert runs[True] == runs[False] and replays[True] > 0
    engine = Engine(_engine_config(model_dir, num_blocks=128, max_num_batched_tokens=256,
                                   async_scheduling=True))
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    engine.step()  # every prompt
    engine.step()  # the first decode step, fed the prompts' tokens from the device
    before = sum(engine.runner.graphs.replays.values())
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum(engine.runner.graphs.replays.values()) == before + 8


@pytest.mark.timeout(600)
def test_an_async_scheduled_step_with_a_prompt_in_it_does_not_wait_for_the_device_either(tmp_path):
    """A prompt joining decoding sequences makes an eager step (one with prompt tokens replays no graph): its
    inputs and attention metadata reach the device from pinned memory too, so under torch's sync debug mode
    that step and the decode steps around it raise nothing."""
    if ran_in_a_compiling_process(
            "test_an_async_scheduled_step_with_a_prompt_in_it_does_not_wait_for_the_device_either"):
        return
    from test_engine_loop import GREEDY, prompt, write_model

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    engine = Engine(_engine_config(write_model(tmp_path), num_blocks=128, max_num_batched_tokens=256,
                                   async_scheduling=True))
    params = SamplingParams(max_tokens=16, **GREEDY)
    for i in range(3):
        engine.add_request(f"r{i}", prompt(9 + 5 * i, i), params)
    engine.step()  # the prompts
    engine.step()  # the first decode step
    engine.add_request("joining", prompt(40, 9), params)
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.step()
        mixed = engine.last_step
        engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert mixed.decode_seqs == 3 and [n for _, n, _ in mixed.prefill_chunks] == [40]


@pytest.mark.timeout(600)
def test_speculative_steps_on_cuda_replay_graphs_and_match_torch_decoding(tmp_path):
    """n-gram drafts verified in captured graphs of their own (each sequence padded to 1 + 3 rows) beside
    plain decode graphs: the float32 greedy tokens equal the torch backend's without drafts; so do a draft
    model's (the checkpoint itself, on the Triton backend, its one-token passes replayed from graphs of its own),
    and its seeded samples at temperature 1 equal the plain engine's, nearly every draft token accepted: the
    draws taken ahead on the device are the ones its stream gives the sampler."""
    if ran_in_a_compiling_process("test_speculative_steps_on_cuda_replay_graphs_and_match_torch_decoding"):
        return
    from test_engine_loop import GREEDY, prompt, run, write_model

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    model_dir = write_model(tmp_path)
    params = SamplingParams(max_tokens=24, **GREEDY)
    requests = {"a": (prompt(6, 1) * 4, params), "b": (prompt(9, 2) * 3, params), "c": (prompt(11, 3), params)}
    want = run(Engine(_engine_config(model_dir, num_blocks=128, attention_backend="torch")), requests)
    engine = Engine(_engine_config(model_dir, num_blocks=128, num_speculative_tokens=3))
    assert run(engine, requests) == want
    assert engine.stats().speculation.accepted_tokens > 0 and sum(engine.runner.graphs.draft_replays.values()) > 0
    engine = Engine(_engine_config(model_dir, num_blocks=128, num_speculative_tokens=3,
                                   speculative_model=str(model_dir)))
    assert run(engine, requests) == want
    assert engine.stats().speculation.accepted_tokens > 0 and sum(engine.runner.graphs.draft_replays.values()) > 0
    assert sum(engine.proposer.runner.graphs.replays.values()) > 0  # the draft's one-token passes, captured too
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    sampled = {name: (ids, seeded) for name, (ids, _) in requests.items()}
    want = run(Engine(_engine_config(model_dir, num_blocks=128)), sampled)
    engine = Engine(_engine_config(model_dir, num_blocks=128, num_speculative_tokens=3,
                                   speculative_model=str(model_dir)))
    assert run(engine, sampled) == want
    stats = engine.stats().speculation
    assert stats.accepted_tokens >= 0.9 * stats.draft_tokens > 0


@pytest.mark.timeout(600)
def test_lora_adapters_on_cuda_match_the_torch_backend_also_in_the_decode_graphs(tmp_path):
    """Two LoRA adapters and the base model in one batch on CUDA (no PEFT there: the adapters are written in its
    format by the benchmark's writer): the compiled path's greedy tokens equal the torch backend's, and every
    decode step replays a captured graph, the grouped LoRA kernels in it, whichever adapters its rows have;
    with one slot for the two adapters (``max_loras=1``), they take turns, swapped in from pinned host memory
    between replays, to the same tokens."""
    if ran_in_a_compiling_process("test_lora_adapters_on_cuda_match_the_torch_backend_also_in_the_decode_graphs"):
        return
    from test_engine_loop import GREEDY, prompt, write_model

    from benchmarks.lora_batch import write_adapter
    from engine.config import ModelConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    model_dir = write_model(tmp_path / "base")
    adapters = {name: str(tmp_path / name) for name in ("crab", "kelp")}
    for seed, path in enumerate(adapters.values()):
        write_adapter(Path(path), ModelConfig.from_dir(model_dir), rank=8, seed=seed, scale=0.2)
    params = SamplingParams(max_tokens=12, **GREEDY)
    runs, replays = {}, {}
    for backend, slots in (("torch", None), ("auto", None), ("auto", 1)):
        engine = Engine(_engine_config(model_dir, num_blocks=128, attention_backend=backend, lora_modules=adapters,
                                       max_loras=slots))
        engine.add_request("base", prompt(19, 1), params)
        tokens: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished():
            if (steps := steps + 1) == 5:  # the base model decoded alone until now
                engine.add_request("crab", prompt(9, 2), params, lora="crab")
                engine.add_request("kelp", prompt(9, 2), params, lora="kelp")
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        runs[engine.attention_backend, slots] = tokens
        if engine.runner.graphs is not None:
            replays[slots] = sum(engine.runner.graphs.replays.values())
        if slots == 1:
            assert engine.lora_slots.swaps >= 1
    assert runs["triton", None] == runs["torch", None] == runs["triton", 1]
    assert runs["torch", None]["crab"] != runs["torch", None]["kelp"]
    # steps 2-4 (the base model alone) and 6-16 (with the adapters' rows); step 5 computes their prompts
    assert replays[None] == 14 and replays[1] > 14


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch, overrides", [
    ("qwen3_moe", {}), ("mistral", {"sliding_window": 20}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1})],
    ids=["qwen3_moe", "mistral_sliding_window", "qwen2_window_on_some_layers"])
def test_moe_and_sliding_window_models_on_cuda_graphs_match_torch_backend(tmp_path, request, arch, overrides):
    """Qwen3-MoE through the compiled fused MoE kernels, Mistral v0.1's sliding window in the compiled
    attention kernels (its blocks behind the window given back), and Qwen's window on its second layer only,
    in float32 with decode steps replayed from CUDA graphs (captured: nothing reads back to the host): the
    torch path's greedy tokens."""
    if ran_in_a_compiling_process(request.node.name):
        return
    _graphed_triton_generates_as_torch(tmp_path, arch, overrides)


def _graphed_triton_generates_as_torch(tmp_path, arch: str, overrides: dict) -> None:
    """``arch``'s tiny checkpoint: greedy tokens through the compiled kernels and CUDA graphs equal the torch
    path's, and decode steps were replayed."""
    from test_engine_loop import GREEDY
    from test_engine_model import build_hf_checkpoint, prompts

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    build_hf_checkpoint(tmp_path, arch, **overrides)
    params = SamplingParams(max_tokens=24, **GREEDY)
    runs = {}
    for backend in ("torch", "auto"):
        engine = Engine(_engine_config(tmp_path, num_blocks=128, max_num_batched_tokens=32, attention_backend=backend))
        for i, ids in enumerate(prompts((5, 19, 45))):
            engine.add_request(str(i), ids, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        runs[engine.attention_backend] = tokens
    assert runs["triton"] == runs["torch"] and all(len(t) == 24 for t in runs["torch"].values())
    assert sum(engine.runner.graphs.replays.values()) > 0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch, layout", [("llama", "block"), ("llama", "online"), ("qwen3_moe", "block"),
                                          ("qwen2", "awq"), ("llama", "gptq"), ("llama", "gptq_act_order"),
                                          ("qwen3_moe", "gptq"), ("qwen3_moe", "gptq_act_order_16"),
                                          ("qwen2", "gptq_int8"), ("qwen3_moe", "compressed_int8_act_order_16"),
                                          ("qwen2", "compressed_w8a8"), ("qwen3_moe", "compressed_w8a8")])
def test_quantized_weights_on_cuda_graphs_generate_as_on_the_cpu(tmp_path, request, arch, layout):
    """The fp8 and integer matmuls and the fp8 and integer MoE kernels compiled for the device, in prefill and
    in decode steps replayed from CUDA graphs (block-wise fp8 checkpoints, --quantization fp8 on a 16-bit one,
    AWQ and 4- and 8-bit GPTQ and compressed-tensors checkpoints, act-order's input gathers inside the graphs,
    each expert's too; W8A8's rows quantized in one launch and its int8 matmul, cuBLASLt's, on a decode batch
    padded to its 17 rows, and W8A8 experts' int8 tiles in the fused MoE kernel): float32 greedy
    tokens equal the CPU torch path's, which are transformers' on the same weights
    (tests/test_weight_quant.py, tests/test_int_weights.py)."""
    if ran_in_a_compiling_process(request.node.name):
        return
    from test_engine_model import BLOCK, build_hf_checkpoint, prompts
    from test_int_weights import quantize_checkpoint as quantize_integers
    from test_weight_quant import NEW_TOKENS, quantize_checkpoint

    from benchmarks.kv_quality import greedy_tokens
    from engine.config import EngineConfig
    from engine.engine import Engine

    build_hf_checkpoint(tmp_path, arch)
    if layout == "block":
        quantize_checkpoint(tmp_path, "block")
    elif layout != "online":  # an integer format of tests/test_int_weights.py
        quantize_integers(tmp_path, layout)
    quantization = "fp8" if layout == "online" else None
    batch = prompts((5, 19, 45))
    engines = [Engine(EngineConfig(model=str(tmp_path), device=device, block_size=BLOCK, num_blocks=64,
                                   quantization=quantization)) for device in ("cpu", "cuda")]
    assert greedy_tokens(engines[0], batch, NEW_TOKENS) == greedy_tokens(engines[1], batch, NEW_TOKENS)
    assert sum(engines[1].runner.graphs.replays.values()) > 0


@pytest.mark.timeout(60)
def test_a_layer_leaves_the_device_without_syncing_the_compute_stream():
    """wire.leave_device: a layer copied to pinned host memory on a side stream (gRPC) or handed over in
    device memory (NCCL), each with an event; through a LayerFeed both arrive exactly."""
    from kvstore.transfer.wire import LayerFeed, leave_device

    layers = [torch.randn(2, 3, 16, 4, 64, device="cuda").to(torch.bfloat16) for _ in range(4)]
    copy_stream = torch.cuda.Stream()
    for stream in (copy_stream, None):
        feed = LayerFeed()
        for layer in layers:
            feed.put(*leave_device(layer * 1, stream))  # a fresh tensor, as an export is
        feed.close()
        got = list(feed)
        assert all(t.is_pinned() for t in got) if stream is not None else all(t.is_cuda for t in got)
        assert all(torch.equal(g.cuda(), want) for g, want in zip(got, layers, strict=True))


# ---- CUDA IPC: another process maps the KV in place ------------------------------------------------

def _map_and_copy(conn) -> None:
    """The receiving process: copy each payload shared over ``conn`` into device memory of its own
    (``copy_shared``: mapped, copied, checked, unmapped), answering with what it copied, or the error."""
    from kvstore.transfer.ipc import copy_shared
    from kvstore.transfer.wire import as_bytes

    class Own:
        def write(self, offset: int, data: torch.Tensor) -> None:
            assert offset == 0 and data.is_cuda
            self.tensor = data.clone()  # on the current stream, which the mapping made wait for the sender's

    while (shared := conn.recv()) is not None:
        own = Own()
        try:
            copy_shared(shared, own)
        except Exception as exc:
            conn.send(repr(exc))
            continue
        conn.send((str(own.tensor.dtype), tuple(own.tensor.shape), bytes(as_bytes(own.tensor))))


@pytest.mark.timeout(180)
def test_cuda_ipc_another_process_copies_the_shared_kv_exactly_and_sees_it_changed():
    """A bf16 slice (at an offset in its allocation) shared right after the kernels that fill it, with no
    synchronisation: the other process maps it, copies it into its own device tensor, and gets every byte.
    A second share whose bytes change before the copy is refused by the check."""
    import torch.multiprocessing as mp

    from kvstore.transfer.ipc import PayloadShare
    from kvstore.transfer.wire import as_bytes

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_map_and_copy, args=(child_conn,), daemon=True)
    child.start()
    try:
        base = torch.randn(4, 32, 2, 8, 16, 4, 64, device="cuda").to(torch.bfloat16) * 3
        source = base[1:3]
        with PayloadShare(source) as share:  # open, the bytes unchanged, until the child's answer
            assert share.shared.shape == tuple(source.shape) and share.shared.dtype == torch.bfloat16
            assert share.shared.nbytes == source.numel() * 2 and share.shared.segment is None
            conn.send(share.shared)
            assert conn.poll(120), "the receiving process did not answer"
            copied = conn.recv()
        with PayloadShare(source) as share:
            source.add_(1)  # breaks the lifetime rule: the receiver reads other bytes than were checked
            conn.send(share.shared)
            assert conn.poll(120), "the receiving process did not answer"
            changed = conn.recv()
        conn.send(None)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert copied == ("torch.bfloat16", tuple(source.shape), bytes(as_bytes(source - 1)))
    assert "ChecksumMismatch" in changed
    assert child.exitcode == 0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_gemma_models_on_cuda_graphs_match_torch_backend(tmp_path, request, arch):
    """Gemma 3's and Gemma 2's layers with their 256-wide heads, on the smaller tiles such heads take (Gemma 2's
    scores soft-capped in the kernels), as the previous test runs its models. Last in the file: the checks above
    matter more to a GPU run cut short."""
    if ran_in_a_compiling_process(request.node.name):
        return
    _graphed_triton_generates_as_torch(tmp_path, arch, {"head_dim": 256, "query_pre_attn_scalar": 256})
