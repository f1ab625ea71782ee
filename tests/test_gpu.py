"""CUDA paths: the engine in bfloat16 on a GPU, and KV leaving GPU memory over gRPC (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from test_engine_model import BLOCK, build_hf_checkpoint, engine_greedy, make_runner, prompts, rel_err

from engine.kv_cache import KVCache
from engine.loader import load_model
from engine.runner import ModelRunner
from kvstore.transfer.grpc import KVTransferClient, KVTransferServer
from kvstore.transfer.sink import TensorSink
from kvstore.transfer.wire import TransferHeader

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.timeout(120)
def test_bfloat16_engine_on_cuda_tracks_float32_on_cpu(tmp_path):
    build_hf_checkpoint(tmp_path, "llama")
    batch = prompts((9, 31))
    ref_runner, _ = make_runner(tmp_path)
    model, cfg = load_model(tmp_path, "bfloat16", "cuda")
    runner = ModelRunner(model, cfg, KVCache(cfg, 64, BLOCK, torch.bfloat16, "cuda"))
    _, ref = engine_greedy(ref_runner, batch, 1)
    _, got = engine_greedy(runner, batch, 1)
    assert rel_err(got.float().cpu(), ref) < 0.05


@pytest.mark.timeout(120)
def test_grpc_push_from_gpu_memory_arrives_intact():
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
