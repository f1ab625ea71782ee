"""KV transfer bandwidth between two Ray actors, per backend, against limits measured in the same run.

Backends: gRPC (a stream of 1 MiB chunks), the torch collective (gloo on CPU, pipelined messages of
up to 4 MiB of whole layers) and ipc (the whole payload in a /dev/shm segment the sender reuses, copied in
by the receiver: ``kvstore/transfer/ipc.py``, same node only); with ``--layerwise`` gRPC and the collective
send layer by layer, as layer-wise streaming does (ipc always hands the whole payload over). All three
checksum every byte (CRC-32C) on both sides, and all land where a decode worker's do: straight
in the reserved blocks of a paged KV cache (scattered block ids, as in a cache in use), through the same
``engine/kv_import.py`` writer, with no staging copy. Limits: memcpy of the same bytes inside one actor, a
plain loopback TCP socket (no checksum) between the same two actors receiving into one contiguous buffer,
the crc32c column, what checksumming the bytes once costs here, and each transport's own ceiling: grpc-raw
streams the same 1 MiB messages between the actors' own gRPC client and server, gloo-raw sends the same 4 MiB
messages over a plain gloo group, both with nothing done to them (no checksum, no placing; the receiver
drops them). A second table gives the CPU time both actors spent per byte: where the cores are fewer than
the busy threads, that, not the link, sets the rate. Goals (issue 13): the collective at least 90% of
loopback TCP, gRPC at least 60%.

Each transfer is timed from the sender's first byte to the receiver holding (and, for our backends,
having checksummed and placed) the last one, on CLOCK_MONOTONIC, which every process on one host shares:
run both actors on one machine. GB/s is 1e9 bytes per second; the median of ``--repeats`` runs is reported.
The KV is bf16 of 32 layers x 4 KV heads x 64 channels, 16-token blocks (512 KiB a block): sizes are
rounded to whole blocks.

    python benchmarks/transfer_bw.py --sizes 1,4,16,64,256 --json transfer_bw.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import ray
import ray.cloudpickle
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks._transfer  # noqa: E402
from benchmarks._transfer import (  # noqa: E402
    BLOCK_SIZE,
    SHAPE,
    BlockSink,
    blocks_for,
    kv_header,
    raw_gloo_group,
    raw_gloo_recv,
    raw_gloo_send,
)
from engine.kv_cache import KVCache  # noqa: E402
from engine.kv_import import BlockImport  # noqa: E402
from kvstore.transfer.collective import CollectiveChannel  # noqa: E402
from kvstore.transfer.grpc import OPTIONS, SEND_CHUNK_BYTES, KVTransferClient, KVTransferServer  # noqa: E402
from kvstore.transfer.ipc import PayloadShare, SegmentPool, SharedPayload, copy_shared  # noqa: E402
from kvstore.transfer.wire import TransferHeader, as_bytes, checksum  # noqa: E402

BACKENDS = ("grpc", "collective", "ipc")
LIMITS = ("memcpy", "crc32c", "tcp", "grpc-raw", "gloo-raw")
TRANSFERS = LIMITS[2:] + BACKENDS  # the ones between the two actors
# The same transport with nothing done to the bytes; for ipc, the copy it is made of.
RAW_PEER = {"grpc": "grpc-raw", "collective": "gloo-raw", "ipc": "memcpy"}
_RAW_METHOD = "/bench.Raw/Push"
# benchmarks/ is no installed package, so an actor could not import the shared module by name from any
# directory but the repository's: it travels with the actors instead.
ray.cloudpickle.register_pickle_by_value(benchmarks._transfer)


@ray.remote(num_cpus=1)
class Receiver:
    """The decode side: a paged KV cache with reserved blocks, a KVTransferServer, the decode end of a
    collective channel, and a TCP listener."""

    def __init__(self, max_blocks: int) -> None:
        torch.set_num_threads(1)
        # Twice the blocks any transfer needs, pre-faulted like a cache in use; a transfer's blocks are every
        # other one, shuffled, so no two neighbours in the payload are neighbours in the cache.
        self.cache = KVCache(SHAPE, 2 * max_blocks, BLOCK_SIZE, torch.bfloat16, "cpu")
        self.cache.data.fill_(1)
        self.ids = list(range(0, 2 * max_blocks, 2))
        random.Random(0).shuffle(self.ids)
        self.sink = BlockSink(self.cache, self.reserved)
        self.server = KVTransferServer(self.sink).start()
        self.channel = CollectiveChannel("decode", "tcp://127.0.0.1:0", backend="gloo", timeout_s=120)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.conn: socket.socket | None = None
        self.out = torch.empty(0, dtype=torch.uint8)
        self.raw_done, self.raw_server = threading.Event(), grpc.server(futures.ThreadPoolExecutor(1),
                                                                        options=OPTIONS)
        handler = grpc.stream_unary_rpc_method_handler(self.count)  # no (de)serializers: raw bytes
        self.raw_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            _RAW_METHOD.split("/")[1], {"Push": handler}),))
        self.raw_port = self.raw_server.add_insecure_port("127.0.0.1:0")
        self.raw_server.start()
        self.raw_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.raw_group = None

    def count(self, messages, _context) -> bytes:
        """grpc-raw: take every message and drop it."""
        for _ in messages:
            pass
        self.raw_done.set()
        return b""

    def endpoints(self) -> dict[str, object]:
        return {"grpc": self.server.target, "collective": self.channel.init_method,
                "tcp": self.listener.getsockname()[1], "grpc-raw": f"127.0.0.1:{self.raw_port}",
                "gloo-raw": self.raw_store.port}

    def reserved(self, header: TransferHeader) -> list[int]:
        return self.ids[:header.shape[2]]

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The TCP peer's contiguous destination (pre-faulted)."""
        if len(self.out) != nbytes:
            self.out = torch.ones(nbytes, dtype=torch.uint8)
        return self.out

    def local_s(self, backend: str, nbytes: int) -> float:
        """One actor alone: copy the bytes into a buffer, or checksum them."""
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = self.buffer(nbytes)
        start = time.perf_counter()
        if backend == "memcpy":
            dst.copy_(src)
        else:
            checksum(as_bytes(src))
        return time.perf_counter() - start

    def expect(self) -> None:
        """Before each transfer: clear the gRPC flags and start counting this process's CPU time (all
        threads: the gRPC server's and gloo's included)."""
        self.sink.done.clear()
        self.sink.error = None
        self.raw_done.clear()
        self.cpu_start = time.process_time()

    def receive(self, backend: str, header: TransferHeader) -> tuple[float, float]:
        """Receive one transfer; returns (the monotonic time the last byte was in place, CPU seconds this
        process spent since ``expect``)."""
        if backend == "tcp":
            if self.conn is None:
                self.conn, _ = self.listener.accept()
            view, got = as_bytes(self.buffer(header.total_bytes)), 0
            while got < len(view):
                n = self.conn.recv_into(view[got:], min(len(view) - got, 4 << 20))
                if n == 0:
                    raise ConnectionError("sender closed")
                got += n
        elif backend == "grpc":
            if not self.sink.done.wait(120) or self.sink.error:
                raise RuntimeError(self.sink.error or "no gRPC transfer within 120 s")
        elif backend == "grpc-raw":
            if not self.raw_done.wait(120):
                raise RuntimeError("no raw gRPC stream within 120 s")
        elif backend == "gloo-raw":
            self.raw_group = self.raw_group or raw_gloo_group(self.raw_store, 0)  # joins with the sender's
            raw_gloo_recv(self.raw_group, header.total_bytes)
        else:
            arrival = BlockImport(self.cache, self.reserved(header))
            self.channel.recv_into(header, arrival)
            arrival.finish()
        return time.monotonic(), time.process_time() - self.cpu_start

    def receive_shared(self, header: TransferHeader, shared: SharedPayload) -> tuple[float, float]:
        """ipc: copy a payload the sender shares into the reserved blocks, as a decode worker's
        ``receive_shared`` does; returns what ``receive`` does."""
        arrival = BlockImport(self.cache, self.reserved(header))
        copy_shared(shared, arrival)
        arrival.finish()
        return time.monotonic(), time.process_time() - self.cpu_start

    def received_crc(self, backend: str, header: TransferHeader) -> int:
        """CRC-32C of what the last transfer left: the TCP buffer, or the reserved blocks in payload order."""
        if backend == "tcp":
            return checksum(as_bytes(self.buffer(header.total_bytes)))
        return checksum(as_bytes(self.cache.export_blocks(self.reserved(header))))


@ray.remote(num_cpus=1)
class Sender:
    """The prefill side: a TCP connection, a KVTransferClient and the prefill end of the channel."""

    def __init__(self, endpoints: dict[str, object], receiver) -> None:
        torch.set_num_threads(1)
        self.receiver, self.segments = receiver, SegmentPool()  # ipc: the receiver's actor, reused segments
        self.client = KVTransferClient(endpoints["grpc"])
        self.channel = CollectiveChannel("prefill", endpoints["collective"], backend="gloo", timeout_s=120)
        self.sock = socket.create_connection(("127.0.0.1", endpoints["tcp"]))
        self.raw_channel = grpc.insecure_channel(endpoints["grpc-raw"], options=OPTIONS)
        self.raw_push = self.raw_channel.stream_unary(_RAW_METHOD)
        self.raw_store = dist.TCPStore("127.0.0.1", endpoints["gloo-raw"], is_master=False)
        self.raw_group = None
        self.source = torch.empty(0)

    def make_source(self, header: TransferHeader) -> int:
        """A random payload of ``header``'s shape; returns its CRC-32C."""
        self.source = torch.rand(header.shape).to(torch.bfloat16)
        return checksum(as_bytes(self.source))

    def send_shared(self, header: TransferHeader) -> tuple[float, float, float, float]:
        """ipc, as a prefill worker hands KV to a decode worker on its node: share the source, have the
        receiver copy it in (its return is the ack); returns (start, CPU seconds sending, then what the
        receiver's ``receive_shared`` returned)."""
        start, cpu_start = time.monotonic(), time.process_time()
        with PayloadShare(self.source, self.segments) as share:
            end, receive_cpu = ray.get(self.receiver.receive_shared.remote(header, share.shared))
        return start, time.process_time() - cpu_start, end, receive_cpu

    def send(self, backend: str, header: TransferHeader) -> tuple[float, float]:
        """Send one transfer of the current source; returns (the monotonic time of its start, CPU seconds
        this process spent sending)."""
        assert self.source.numel() * 2 == header.total_bytes, "make_source first"
        start, cpu_start = time.monotonic(), time.process_time()
        if backend == "tcp":
            self.sock.sendall(as_bytes(self.source))
        elif backend == "grpc":
            self.client.push(header, self.source, timeout_s=120)
        elif backend == "grpc-raw":
            view = as_bytes(self.source)
            self.raw_push(bytes(view[i:i + SEND_CHUNK_BYTES]) for i in range(0, len(view), SEND_CHUNK_BYTES))
        elif backend == "gloo-raw":
            self.raw_group = self.raw_group or raw_gloo_group(self.raw_store, 1)
            raw_gloo_send(self.raw_group, self.source)
        else:
            self.channel.send(header, self.source)
        return start, time.process_time() - cpu_start


def measure(sender, receiver, backend: str, num_blocks: int, repeats: int, tag: str,
            layerwise: bool) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds of both actors together) of each of ``repeats`` transfers; a local
    limit (memcpy, crc32c) runs on one thread, so its CPU time is its wall time."""
    seconds, cpu = [], []
    for rep in range(repeats):
        header = kv_header(f"{tag}-{backend}-{num_blocks}-{rep}", num_blocks, layerwise)
        if backend in ("memcpy", "crc32c"):
            seconds.append(ray.get(receiver.local_s.remote(backend, header.total_bytes)))
            cpu.append(seconds[-1])
            continue
        ray.get(receiver.expect.remote())
        if backend == "ipc":  # the sender calls the receiver itself, which takes no other call meanwhile
            start, send_cpu, end, receive_cpu = ray.get(sender.send_shared.remote(header))
        else:
            done = receiver.receive.remote(backend, header)
            start, send_cpu = ray.get(sender.send.remote(backend, header))
            end, receive_cpu = ray.get(done)
        seconds.append(end - start)
        cpu.append(send_cpu + receive_cpu)
    return seconds, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,16,64,256", help="payload sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layerwise", action="store_true", help="one message (stream) per layer")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    blocks = blocks_for(args.sizes)

    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=max(2, os.cpu_count() or 2))
    receiver = Receiver.remote(max(blocks))
    sender = Sender.remote(ray.get(receiver.endpoints.remote()), receiver)
    ray.get(sender.make_source.remote(kv_header("warmup", 2, args.layerwise)))
    for backend in TRANSFERS:  # warm up: connect sockets, channels and the gloo group
        measure(sender, receiver, backend, 2, 1, "warmup", args.layerwise)

    rows, cpu_rows = [], []
    print(f"cpus={os.cpu_count()} layers={SHAPE.num_layers} dtype=bfloat16 layerwise={args.layerwise} "
          f"repeats={args.repeats} (median GB/s; gRPC, collective and ipc into scattered KV blocks)")
    print(f"{'MiB':>6} " + " ".join(f"{b:>20}" for b in LIMITS + BACKENDS))
    for num_blocks in blocks:
        header = kv_header("size", num_blocks, args.layerwise)
        nbytes, expected = header.total_bytes, ray.get(sender.make_source.remote(header))
        medians, cpu_ns = {}, {}
        for backend in LIMITS + BACKENDS:
            seconds, cpu = measure(sender, receiver, backend, num_blocks, args.repeats, "run", args.layerwise)
            if backend in ("tcp", *BACKENDS) and ray.get(receiver.received_crc.remote(backend, header)) != expected:
                raise RuntimeError(f"{backend} delivered other bytes")
            medians[backend] = nbytes / statistics.median(seconds) / 1e9
            cpu_ns[backend] = statistics.median(cpu) / nbytes * 1e9
            rows.append({"size_bytes": nbytes, "backend": backend, "seconds": seconds, "cpu_seconds": cpu,
                         "cpu_ns_per_byte_median": cpu_ns[backend],
                         "gbps_median": medians[backend], "gbps_best": nbytes / min(seconds) / 1e9,
                         "vs_tcp": medians[backend] / medians["tcp"] if "tcp" in medians else None,
                         "vs_raw": medians[backend] / medians[RAW_PEER[backend]] if backend in BACKENDS else None})
        print(f"{nbytes / (1 << 20):>6g} " + " ".join(
            f"{medians[b]:>9.2f} ({medians[b] / medians['tcp']:>5.0%} tcp)" if b in BACKENDS
            else f"{medians[b]:>20.2f}" for b in LIMITS + BACKENDS))
        cpu_rows.append(f"{nbytes / (1 << 20):>6g} " + " ".join(
            f"{cpu_ns[b]:>5.2f} x{cpu_ns[b] * medians[b]:.1f}" + (f" ({cpu_ns['tcp'] / cpu_ns[b]:>4.0%} tcp)" if
                                                                  b in BACKENDS else "").ljust(11)
            for b in TRANSFERS))
    # On a machine with fewer cores than busy threads the rate is CPU-bound: then what a backend can reach
    # against TCP is TCP's CPU time per byte over its own.
    print("\nCPU time of both actors per byte moved (ns/B, median), x the cores it kept busy on average, and "
          "TCP's CPU time per byte over the backend's")
    print(f"{'MiB':>6} " + " ".join(f"{b:>21}" for b in TRANSFERS))
    print("\n".join(cpu_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "layers": SHAPE.num_layers, "dtype": "bfloat16",
                       "layerwise": args.layerwise, "destination": "scattered KV cache blocks",
                       "repeats": args.repeats, "results": rows}, f, indent=1)
    ray.shutdown()


if __name__ == "__main__":
    main()
