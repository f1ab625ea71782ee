"""KV transfer bandwidth between two Ray actors, per backend, against limits measured in the same run.

Backends: gRPC (a stream of 1 MiB chunks) and the torch collective (gloo on CPU, pipelined messages of
up to 4 MiB of whole layers); with ``--layerwise`` both send layer by layer, as layer-wise streaming
does. Both checksum every byte on both sides. Limits: memcpy of the same bytes inside one actor, and a
plain loopback TCP socket (no checksum) between the same two actors; the crc32c column is what
checksumming the bytes once costs here. Goal: every backend at least 50% of loopback TCP.

Each transfer is timed from the sender's first byte to the receiver holding (and, for our backends,
having checksummed) the last one, on CLOCK_MONOTONIC, which every process on one host shares: run both
actors on one machine. GB/s is 1e9 bytes per second; the median of ``--repeats`` runs is reported.

    python benchmarks/transfer_bw.py --sizes 1,4,16,64,256 --json transfer_bw.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import ray
import torch

from kvstore.transfer.collective import CollectiveChannel
from kvstore.transfer.grpc import KVTransferClient, KVTransferServer
from kvstore.transfer.sink import TensorSink
from kvstore.transfer.wire import TransferHeader, as_bytes, checksum

BACKENDS = ("grpc", "collective")  # both stream the payload layer by layer
LIMITS = ("memcpy", "crc32c", "tcp")
LAYERS = 32  # a Llama-7B-like layer count: messages are at most size/32 each


def kv_header(request_id: str, nbytes: int, layerwise: bool) -> TransferHeader:
    return TransferHeader.describe(request_id, "bench", (LAYERS, nbytes // LAYERS // 2), torch.bfloat16,
                                   layerwise=layerwise)


@ray.remote(num_cpus=1)
class Receiver:
    """The decode side: a TCP listener, a KVTransferServer and the decode end of a collective channel."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.sink = TensorSink()
        self.server = KVTransferServer(self.sink).start()
        self.channel = CollectiveChannel("decode", "tcp://127.0.0.1:0", backend="gloo", timeout_s=120)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.conn: socket.socket | None = None
        self.out: dict[int, torch.Tensor] = {}

    def endpoints(self) -> dict[str, object]:
        return {"grpc": self.server.target, "collective": self.channel.init_method,
                "tcp": self.listener.getsockname()[1]}

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The reserved destination (pre-faulted, like KV blocks already in use)."""
        if nbytes not in self.out:
            self.out = {nbytes: torch.ones(LAYERS, nbytes // LAYERS // 2, dtype=torch.bfloat16)}
        return self.out[nbytes]

    def local_s(self, backend: str, nbytes: int) -> float:
        """One actor alone: copy the bytes into the reserved buffer, or checksum them."""
        src = torch.rand(LAYERS, nbytes // LAYERS // 2).to(torch.bfloat16)
        dst = self.buffer(nbytes)
        start = time.perf_counter()
        if backend == "memcpy":
            dst.copy_(src)
        else:
            checksum(as_bytes(src))
        return time.perf_counter() - start

    def expect(self, header: TransferHeader) -> None:
        self.sink.expect(header.request_id, self.buffer(header.total_bytes))

    def receive(self, backend: str, header: TransferHeader) -> float:
        """Receive one transfer; returns the monotonic time the last byte was in place."""
        out = self.buffer(header.total_bytes)
        if backend == "tcp":
            if self.conn is None:
                self.conn, _ = self.listener.accept()
            view, got = memoryview(out.view(-1).view(torch.uint8).numpy()), 0
            while got < len(view):
                n = self.conn.recv_into(view[got:], min(len(view) - got, 4 << 20))
                if n == 0:
                    raise ConnectionError("sender closed")
                got += n
        elif backend.startswith("grpc"):
            outcome = self.sink.wait(header.request_id, 120)
            if not outcome.committed:
                raise RuntimeError(outcome.reason)
        else:
            self.channel.recv(header, out=out)
        return time.monotonic()

    def sum_of(self, nbytes: int) -> float:
        return float(self.buffer(nbytes).float().sum())


@ray.remote(num_cpus=1)
class Sender:
    """The prefill side: a TCP connection, a KVTransferClient and the prefill end of the channel."""

    def __init__(self, endpoints: dict[str, object]) -> None:
        torch.set_num_threads(1)
        self.client = KVTransferClient(endpoints["grpc"])
        self.channel = CollectiveChannel("prefill", endpoints["collective"], backend="gloo", timeout_s=120)
        self.sock = socket.create_connection(("127.0.0.1", endpoints["tcp"]))
        self.source = torch.empty(0)

    def make_source(self, nbytes: int) -> float:
        self.source = torch.rand(LAYERS, nbytes // LAYERS // 2).to(torch.bfloat16)
        return float(self.source.float().sum())

    def send(self, backend: str, header: TransferHeader) -> float:
        """Send one transfer of the current source; returns the monotonic time of its start."""
        assert self.source.numel() * 2 == header.total_bytes, "make_source first"
        start = time.monotonic()
        if backend == "tcp":
            self.sock.sendall(memoryview(self.source.view(-1).view(torch.uint8).numpy()))
        elif backend.startswith("grpc"):
            self.client.push(header, self.source, timeout_s=120)
        else:
            self.channel.send(header, self.source)
        return start


def measure(sender, receiver, backend: str, nbytes: int, repeats: int, tag: str,
            layerwise: bool) -> list[float]:
    seconds = []
    for rep in range(repeats):
        header = kv_header(f"{tag}-{backend}-{nbytes}-{rep}", nbytes, layerwise)
        if backend in ("memcpy", "crc32c"):
            seconds.append(ray.get(receiver.local_s.remote(backend, nbytes)))
            continue
        if backend.startswith("grpc"):
            ray.get(receiver.expect.remote(header))
        done = receiver.receive.remote(backend, header)
        start = ray.get(sender.send.remote(backend, header))
        seconds.append(ray.get(done) - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,16,64,256", help="payload sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layerwise", action="store_true", help="one message (stream) per layer")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes.split(",")]

    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(2, os.cpu_count() or 2))
    receiver = Receiver.remote()
    sender = Sender.remote(ray.get(receiver.endpoints.remote()))
    ray.get(sender.make_source.remote(1 << 20))
    for backend in LIMITS[2:] + BACKENDS:  # warm up: connect sockets, channels and the gloo group
        measure(sender, receiver, backend, 1 << 20, 1, "warmup", args.layerwise)

    rows = []
    print(f"cpus={os.cpu_count()} layers={LAYERS} dtype=bfloat16 layerwise={args.layerwise} "
          f"repeats={args.repeats} (median GB/s)")
    print(f"{'MiB':>6} " + " ".join(f"{b:>20}" for b in LIMITS + BACKENDS))
    for nbytes in sizes:
        expected = ray.get(sender.make_source.remote(nbytes))
        medians = {}
        for backend in LIMITS + BACKENDS:
            seconds = measure(sender, receiver, backend, nbytes, args.repeats, "run", args.layerwise)
            if backend not in ("memcpy", "crc32c") and ray.get(receiver.sum_of.remote(nbytes)) != expected:
                raise RuntimeError(f"{backend} delivered other bytes")
            medians[backend] = nbytes / statistics.median(seconds) / 1e9
            rows.append({"size_bytes": nbytes, "backend": backend, "seconds": seconds,
                         "gbps_median": medians[backend], "gbps_best": nbytes / min(seconds) / 1e9,
                         "vs_tcp": medians[backend] / medians["tcp"] if "tcp" in medians else None})
        print(f"{nbytes / (1 << 20):>6g} " + " ".join(
            f"{medians[b]:>9.2f} ({medians[b] / medians['tcp']:>5.0%} tcp)" if b in BACKENDS
            else f"{medians[b]:>20.2f}" for b in LIMITS + BACKENDS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "layers": LAYERS, "dtype": "bfloat16", "layerwise": args.layerwise,
                       "repeats": args.repeats, "results": rows}, f, indent=1)
    ray.shutdown()


if __name__ == "__main__":
    main()
