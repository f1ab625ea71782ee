"""KV leaving GPU memory over gRPC (skipped without CUDA; the bf16 engine on CUDA is in test_engine_model)."""

from __future__ import annotations

import pytest
import torch

from kvstore.transfer.grpc import KVTransferClient, KVTransferServer
from kvstore.transfer.sink import TensorSink
from kvstore.transfer.wire import TransferHeader

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


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
