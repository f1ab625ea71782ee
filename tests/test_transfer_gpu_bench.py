"""benchmarks/transfer_gpu.py on the host (its ``--device cpu`` smoke run): two spawned processes, ipc (a
/dev/shm segment there, CUDA IPC on a GPU: test_gpu.py), gloo and gRPC into scattered KV blocks, each
delivery checked by the benchmark itself; and the check seeing bytes left out."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from kvstore.transfer.grpc import KVTransferClient
from kvstore.transfer.wire import as_bytes, checksum

REPO = Path(__file__).resolve().parents[1]


def load_bench():
    """The benchmark under its package name, which its spawned processes import it by."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module("benchmarks.transfer_gpu")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.timeout(180)
def test_cpu_smoke_run_delivers_every_byte_by_every_backend(tmp_path):
    bench = load_bench()
    out = tmp_path / "transfer_gpu.json"
    returned = bench.main(["--device", "cpu", "--sizes", "1,2", "--repeats", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    assert (result["device"], result["layers"], result["dtype"], result["repeats"]) == ("cpu", 32, "bfloat16", 2)
    references = {"d2d": None, "pinned_d2h": None, "ipc": "d2d", "gloo": "pinned_d2h", "grpc": "pinned_d2h"}
    for size_bytes, blocks in ((1 << 20, 2), (2 << 20, 4)):
        rows = {row["backend"]: row for row in result["results"] if row["size_bytes"] == size_bytes}
        assert set(rows) == set(references)
        assert bench.kv_header("x", blocks).total_bytes == size_bytes
        # The same payload's CRC-32C, which every run's destination matched (else the run raised).
        assert len({row["crc32c"] for row in rows.values()}) == 1
        for backend, row in rows.items():
            assert len(row["seconds"]) == 2 and all(positive(s) for s in row["seconds"])
            assert positive(row["gbps_median"]) and row["gbps_best"] >= row["gbps_median"]
            assert row["reference"] == references[backend]
            if row["reference"] is None:
                assert row["vs_reference"] is None
            else:
                link = rows[row["reference"]]["gbps_median"]
                assert row["vs_reference"] == pytest.approx(row["gbps_median"] / link)
    assert len(result["results"]) == 10


@pytest.mark.timeout(60)
def test_the_receivers_check_sees_bytes_left_out():
    """A push lands in the reserved blocks and the check matches; after ``prepare`` (what every run starts
    from) the same check fails, so a transfer that wrote nothing cannot pass."""
    bench = load_bench()
    threads = torch.get_num_threads()
    receiver = bench.Receiver("cpu", 4, None)
    try:
        header = bench.kv_header("check", 3)
        payload = torch.rand(header.shape).to(torch.bfloat16)
        receiver.prepare()
        KVTransferClient(receiver.server.target).push(header, payload, timeout_s=30)
        assert receiver.receive("grpc", header) > 0
        assert receiver.received_crc(header) == checksum(as_bytes(payload))
        receiver.prepare()
        assert receiver.received_crc(header) != checksum(as_bytes(payload))
    finally:
        receiver.server.stop()
        receiver.channel.close()
        torch.set_num_threads(threads)
