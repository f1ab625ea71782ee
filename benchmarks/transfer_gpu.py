"""KV transfer between two processes on one GPU, per backend, against the link it runs over (issue 13).

Two processes started with torch.multiprocessing (spawn; no Ray): a sender with a random bf16 payload in
device memory, a receiver whose KV cache on the same device every transfer lands in (``engine/kv_import.py``,
scattered, shuffled blocks). ipc: the sender shares its payload (``kvstore/transfer/ipc.py``: CUDA IPC; with
--device cpu a /dev/shm segment) over a pipe; the receiver maps it, copies it into the blocks on its own
stream, checks it, acks, as a decode worker's ``receive_shared`` does. gloo: the collective on CPU
(the payload leaves device memory piece by piece). grpc: a push from device memory to a loopback
KVTransferServer. References, same run, in the sender: d2d (a device to device copy) for ipc,
pinned_d2h (into pinned host memory) for gloo and grpc; goals: ipc >= 50% of d2d at 256 MiB, grpc
>= 50% of pinned_d2h.

A transfer is timed from the sender's start to the bytes being in the receiver's blocks on CLOCK_MONOTONIC
(both processes share it), a reference until its copy is synchronised; GB/s (1e9 B/s): median of --repeats.
Each run's destination is overwritten before it and checked (CRC-32C) after it. transfer_bw.py's KV shape
(sizes rounded to 512 KiB blocks). --device cpu: a smoke run, d2d and pinned_d2h plain copies.

    python benchmarks/transfer_gpu.py --json transfer_gpu.json
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
if importlib.util.find_spec("tidepool") is None:  # a bare checkout: the generated gRPC modules' package
    sys.path.insert(0, str(REPO / "proto"))

from benchmarks._transfer import BLOCK_SIZE, SHAPE, BlockSink, blocks_for, kv_header  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.kv_import import BlockImport  # noqa: E402
from kvstore.transfer.collective import CollectiveChannel  # noqa: E402
from kvstore.transfer.grpc import KVTransferClient, KVTransferServer  # noqa: E402
from kvstore.transfer.ipc import PayloadShare, SegmentPool, copy_shared  # noqa: E402
from kvstore.transfer.wire import TransferHeader, as_bytes, checksum  # noqa: E402

TRANSFERS = {"ipc": "d2d", "gloo": "pinned_d2h", "grpc": "pinned_d2h"}  # backend: its reference link
REFERENCES = ("d2d", "pinned_d2h")
TIMEOUT_S = 120.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Receiver:
    """The decode side: a KV cache with reserved blocks, a gRPC server, a gloo channel, the IPC pipe."""

    def __init__(self, device: str, max_blocks: int, ipc) -> None:
        torch.set_num_threads(1)
        self.device, self.ipc = torch.device(device), ipc
        # Twice the blocks needed; a transfer's are every other one, shuffled: no neighbours stay neighbours.
        self.cache = KVCache(SHAPE, 2 * max_blocks, BLOCK_SIZE, torch.bfloat16, self.device)
        self.ids = list(range(0, 2 * max_blocks, 2))
        random.Random(0).shuffle(self.ids)
        self.sink = BlockSink(self.cache, self.reserved)
        self.server = KVTransferServer(self.sink).start()  # on loopback: no secret needed
        self.channel = CollectiveChannel("decode", "tcp://127.0.0.1:0", backend="gloo", timeout_s=TIMEOUT_S)

    def endpoints(self) -> dict[str, str]:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {"grpc": self.server.target, "gloo": self.channel.init_method, "device": name}

    def reserved(self, header: TransferHeader) -> list[int]:
        return self.ids[:header.shape[2]]

    def prepare(self) -> None:
        """Before a transfer: every block 1.0 (rand never draws it), so a byte left out fails the check."""
        self.cache.data.fill_(1)
        sync(self.device)  # gRPC's copies run on a side stream, which this fill does not order
        self.sink.done.clear()
        self.sink.error = None

    def receive(self, backend: str, header: TransferHeader) -> float:
        """Receive one transfer into the reserved blocks; returns the monotonic time they held it."""
        if backend == "grpc":
            if not self.sink.done.wait(TIMEOUT_S) or self.sink.error:
                raise RuntimeError(self.sink.error or f"no gRPC transfer within {TIMEOUT_S} s")
        elif backend == "gloo":
            arrival = BlockImport(self.cache, self.reserved(header))
            self.channel.recv_into(header, arrival)
            arrival.finish()
        else:
            try:
                return self._receive_ipc(header)
            except Exception as exc:
                self.ipc.send(f"failed: {exc!r}")  # not the ack: the sender stops waiting
                raise
        return time.monotonic()

    def _receive_ipc(self, header: TransferHeader) -> float:
        if not self.ipc.poll(TIMEOUT_S):
            raise TimeoutError(f"no shared payload within {TIMEOUT_S} s")
        request_id, shared = self.ipc.recv()
        if request_id != header.request_id or shared.shape != header.shape:
            raise RuntimeError(f"got {request_id} {list(shared.shape)} for {header.request_id}")
        arrival = BlockImport(self.cache, self.reserved(header))
        copy_shared(shared, arrival)  # mapped, copied, checked and unmapped before the ack
        arrival.finish()
        sync(self.device)
        end = time.monotonic()
        self.ipc.send(request_id)
        return end

    def received_crc(self, header: TransferHeader) -> int:
        """CRC-32C of the reserved blocks, in payload order."""
        return checksum(as_bytes(self.cache.export_blocks(self.reserved(header))))


class Sender:
    """The prefill side: the payload, a gRPC client, a gloo channel, the IPC pipe, the references."""

    def __init__(self, device: str, ipc) -> None:
        torch.set_num_threads(1)
        self.device, self.ipc = torch.device(device), ipc
        self.segments = SegmentPool()  # host segments reused as a prefill worker's are
        atexit.register(self.segments.close)

    def connect(self, endpoints: dict[str, str]) -> None:
        self.client = KVTransferClient(endpoints["grpc"])
        self.channel = CollectiveChannel("prefill", endpoints["gloo"], backend="gloo", timeout_s=TIMEOUT_S)

    def make_source(self, header: TransferHeader) -> int:
        """A random payload of ``header``'s shape, the references' destinations; returns its CRC-32C."""
        self.source = torch.rand(header.shape, device=self.device).to(torch.bfloat16)
        self.copy = torch.ones_like(self.source)
        self.host = torch.ones(header.shape, dtype=torch.bfloat16, pin_memory=self.device.type == "cuda")
        return checksum(as_bytes(self.source))

    def reference(self, link: str) -> tuple[float, int]:
        """One copy of the payload into device memory (d2d) or pinned host memory (pinned_d2h): its
        seconds, and the CRC-32C of what it left there."""
        dst = self.copy if link == "d2d" else self.host
        dst.fill_(1)  # so that the check sees this copy's bytes
        sync(self.device)
        start = time.perf_counter()
        dst.copy_(self.source, non_blocking=True)
        sync(self.device)
        return time.perf_counter() - start, checksum(as_bytes(dst))

    def send(self, backend: str, header: TransferHeader) -> float:
        """Send the payload; returns the monotonic time of the start."""
        start = time.monotonic()
        if backend == "grpc":
            self.client.push(header, self.source, timeout_s=TIMEOUT_S)
        elif backend == "gloo":
            self.channel.send(header, self.source)
        else:  # the share stays open, its bytes unchanged, until the receiver acks (ipc.py's lifetime rule)
            with PayloadShare(self.source, self.segments) as share:
                self.ipc.send((header.request_id, share.shared))
                ack = self.ipc.recv() if self.ipc.poll(TIMEOUT_S) else f"no ack within {TIMEOUT_S} s"
            if ack != header.request_id:
                raise RuntimeError(f"ipc of {header.request_id}: {ack}")
        return start


def _serve(cls: type, conn, args: tuple) -> None:
    """A child process: ``cls(*args)``, then each (method, args) until None, answered (ok, result)."""
    try:
        target = cls(*args)
        conn.send((True, None))
    except Exception:
        conn.send((False, traceback.format_exc()))
        return
    while (message := conn.recv()) is not None:
        name, call_args = message
        try:
            conn.send((True, getattr(target, name)(*call_args)))
        except Exception:
            conn.send((False, traceback.format_exc()))


class Process:
    """``cls(*args)`` in a spawned process, called method by method over a pipe (answers in call order)."""

    def __init__(self, cls: type, *args) -> None:
        ctx = mp.get_context("spawn")
        self.name = cls.__name__
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(cls, child, args), daemon=True)
        self._process.start()
        child.close()

    def post(self, name: str, *args) -> None:
        self._conn.send((name, args))

    def result(self, timeout_s: float = 2 * TIMEOUT_S):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the {self.name} process did not answer within {timeout_s} s")
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"in the {self.name} process:\n{value}")
        return value

    def call(self, name: str, *args):
        self.post(name, *args)
        return self.result()

    def close(self) -> None:  # the process's servers and channels end with it
        with contextlib.suppress(OSError):  # it is gone already
            self._conn.send(None)
        self._process.join(10)
        if self._process.is_alive():  # still inside a call that failed elsewhere
            self._process.kill()
            self._process.join()


def measure(sender: Process, receiver: Process, backend: str, num_blocks: int, repeats: int,
            expected: int, tag: str) -> list[float]:
    """``repeats`` runs of one backend (or reference); each delivery checked against ``expected``."""
    seconds = []
    for rep in range(repeats):
        header = kv_header(f"{tag}-{backend}-{num_blocks}-{rep}", num_blocks)
        if backend in REFERENCES:
            took, got = sender.call("reference", backend)
        else:
            receiver.call("prepare")
            receiver.post("receive", backend, header)
            try:
                start = sender.call("send", backend, header)
            finally:  # the receiver's answer, or its own error
                end = receiver.result()
            took, got = end - start, receiver.call("received_crc", header)
        seconds.append(took)
        if got != expected:
            raise RuntimeError(f"{backend} delivered other bytes ({num_blocks} blocks, run {rep})")
    return seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,16,64,256", help="payload sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu: a smoke run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    on_cuda = torch.device(args.device).type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        parser.error("no CUDA device here: --device cpu runs the same transfers on the host")
    blocks = blocks_for(args.sizes)
    backends = list(TRANSFERS)
    receiver_ipc, sender_ipc = mp.get_context("spawn").Pipe()
    receiver = Process(Receiver, args.device, max(blocks), receiver_ipc)
    sender = Process(Sender, args.device, sender_ipc)  # both start (import torch, init CUDA) at once
    try:
        receiver.result()
        sender.result()
        endpoints = receiver.call("endpoints")
        sender.call("connect", endpoints)
        warmup = sender.call("make_source", kv_header("warmup", 2))
        for backend in backends:  # connect gRPC, form the gloo group, open a first IPC mapping
            measure(sender, receiver, backend, 2, 1, warmup, "warmup")
        rows = []
        print(f"device={endpoints['device']} layers={SHAPE.num_layers} dtype=bfloat16 repeats={args.repeats} "
              "(median GB/s; into the other process's scattered KV blocks, vs the reference link)")
        print(f"{'MiB':>6} " + " ".join(f"{b:>12}" for b in REFERENCES) + " "
              + " ".join(f"{b:>24}" for b in backends))
        for num_blocks in blocks:
            header = kv_header("size", num_blocks)
            nbytes, expected = header.total_bytes, sender.call("make_source", header)
            medians = {}
            for backend in REFERENCES + tuple(backends):
                seconds = measure(sender, receiver, backend, num_blocks, args.repeats, expected, "run")
                medians[backend] = nbytes / statistics.median(seconds) / 1e9
                reference = TRANSFERS.get(backend)
                rows.append({"backend": backend, "size_bytes": nbytes, "crc32c": expected, "seconds": seconds,
                             "gbps_median": medians[backend], "gbps_best": nbytes / min(seconds) / 1e9,
                             "reference": reference,
                             "vs_reference": medians[backend] / medians[reference] if reference else None})
            print(f"{nbytes / (1 << 20):>6g} " + " ".join(f"{medians[b]:>12.2f}" for b in REFERENCES) + " "
                  + " ".join(f"{medians[b]:>9.2f} ({medians[b] / medians[TRANSFERS[b]]:>4.0%} "
                             f"{TRANSFERS[b]:>10})" for b in backends))
    finally:
        sender.close()
        receiver.close()
    result = {"device": endpoints["device"], "layers": SHAPE.num_layers, "dtype": "bfloat16",
              "repeats": args.repeats, "destination": "scattered KV cache blocks of another process",
              "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
