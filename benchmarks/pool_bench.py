"""KV pool benchmark: the Redis index and payload tier against redis-benchmark on the same server, the
disk tier against plain file I/O of the same bytes, and the router's in-memory mirror at cluster scale.

    python benchmarks/pool_bench.py [--json out.json] [--quick] [--disk-dir DIR]

1. ``redis-benchmark`` GET/SET (one client, like ours) with small values and with block-sized values,
   on a private redis-server this script starts: the server's own ceiling for this machine.
2. ``KVPool.longest_prefix`` on 100-block chains over 8 workers: lookups/s and latency (one Lua call each).
3. ``RedisTier.put_blocks`` / ``get_blocks`` of KV blocks (default Llama-3-8B-sized, 2 MiB bf16): MB/s.
4. ``RedisTier.get_prefix`` of a 128-block prompt (the read every prefill makes before computing): one
   Redis lacks entirely, against one GET round trip of a missing key; one whose first 16 blocks Redis
   holds, against a ``get_blocks`` of just those 16. Median latency of each, in the same run.
5. ``DiskTier.put_blocks`` / ``get_prefix`` of the same blocks in prefix runs against plain open/write/read
   of the same encoded bytes, one file per block and one sequential file: MB/s, writes ending in ``sync``.
   Cold reads drop the files from the page cache first (``posix_fadvise(DONTNEED)``, on both sides);
   warm reads are page-cache reads on both sides.
6. ``PoolMirror.longest_prefix`` with 1,000 workers and 1M indexed blocks, loaded into Redis and rebuilt
   by the mirror: p50/p99 latency (goal p99 < 1 ms) and the rebuild time.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.disk_tier import DiskTier  # noqa: E402
from kvstore.events import PoolMirror  # noqa: E402
from kvstore.payload import RedisTier, encode_block  # noqa: E402
from kvstore.pool import KVPool  # noqa: E402
from kvstore.transfer.wire import checksum  # noqa: E402
from services.local_redis import LocalRedis  # noqa: E402


def percentiles(samples_s: list[float], prefix: str = "") -> dict[str, float]:
    xs = sorted(samples_s)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3  # noqa: E731
    return {f"{prefix}p50_ms": pick(0.50), f"{prefix}p99_ms": pick(0.99), f"{prefix}max_ms": xs[-1] * 1e3}


def timed_lookups(lookup, queries) -> dict[str, float]:
    """Wall-clock percentiles, and the thread's CPU time per lookup (what is left when other processes
    on a busy machine preempt the benchmark mid-lookup)."""
    wall, cpu = [], []
    for q in queries:
        t, c = time.perf_counter(), time.thread_time()
        lookup(q)
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
    return {**percentiles(wall), **percentiles(cpu, "cpu_")}


def redis_benchmark(port: int, value_bytes: int, requests: int) -> dict[str, dict[str, float]]:
    """redis-benchmark GET/SET with one client: {"SET": {rps, MB_s, p50_ms, p99_ms}, "GET": {...}}."""
    out = subprocess.run(["redis-benchmark", "-p", str(port), "-t", "set,get", "-n", str(requests), "-c", "1",
                          "-d", str(value_bytes), "--csv"], check=True, capture_output=True, text=True).stdout
    rows = {}
    for row in csv.DictReader(io.StringIO(out)):
        rps = float(row["rps"])
        rows[row["test"]] = {"rps": rps, "MB_s": rps * value_bytes / 1e6,
                             "p50_ms": float(row["p50_latency_ms"]), "p99_ms": float(row["p99_latency_ms"])}
    return rows


def bench_lookup(url: str, lookups: int) -> dict[str, float]:
    pool = KVPool(url, "bench", 16, ttl_s=600)
    rng = random.Random(0)
    chains = [[rng.getrandbits(64) for _ in range(100)] for _ in range(64)]
    workers = [f"w{i}" for i in range(8)]
    for w in workers:
        pool.heartbeat(w)
    for c in chains:  # each chain fully on one worker, a prefix of it on two others
        pool.publish_stored(rng.choice(workers), c)
        for w in rng.sample(workers, 2):
            pool.publish_stored(w, c[:rng.randrange(1, 100)])
    start = time.perf_counter()
    latency = timed_lookups(pool.longest_prefix, [chains[i % len(chains)] for i in range(lookups)])
    wall = time.perf_counter() - start
    pool.close()
    return {"lookups_per_s": lookups / wall, "blocks_per_s": 100 * lookups / wall, **latency}


def bench_payload(url: str, shape: tuple[int, ...], total_bytes: int, batch: int) -> dict[str, float]:
    pool = KVPool(url, "bench-payload", shape[2], ttl_s=600)
    tier = RedisTier(pool, max_bytes=4 * total_bytes)
    block = torch.randn(shape).to(torch.bfloat16)
    block_bytes = block.numel() * block.element_size()
    n = max(batch, total_bytes // block_bytes // batch * batch)
    hashes = [random.getrandbits(64) for _ in range(n)]
    start = time.perf_counter()
    for i in range(0, n, batch):
        assert tier.put_blocks(hashes[i:i + batch], [block] * batch)
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, n, batch):
        assert all(b is not None for b in tier.get_blocks(hashes[i:i + batch]))
    get_s = time.perf_counter() - start
    pool.client.flushdb()
    pool.close()
    moved = n * block_bytes / 1e6
    return {"block_bytes": block_bytes, "blocks": n, "batch": batch,
            "put_MB_s": moved / put_s, "get_MB_s": moved / get_s}


def bench_prefix_read(url: str, shape: tuple[int, ...], prompt_blocks: int, held_blocks: int,
                      prompts: int) -> dict[str, float]:
    """What a prefill's look into the Redis tier costs for a fresh prompt and for one with a held prefix
    (e.g. a system prompt), against the least that could answer each: one round trip, and reading the held
    blocks alone."""
    pool = KVPool(url, "bench-prefix", shape[2], ttl_s=600)
    tier = RedisTier(pool, max_bytes=4 * held_blocks * 2 * int(torch.tensor(shape).prod()))
    block = torch.randn(shape).to(torch.bfloat16)
    held = [random.getrandbits(64) for _ in range(held_blocks)]
    assert tier.put_blocks(held, [block] * held_blocks)

    def median_ms(read, make_hashes) -> float:
        samples = []
        for _ in range(prompts):
            hashes = make_hashes()
            start = time.perf_counter()
            read(hashes)
            samples.append(time.perf_counter() - start)
        return 1e3 * statistics.median(samples)

    def fresh() -> list[int]:
        return [random.getrandbits(64) for _ in range(prompt_blocks)]

    def read_held(hashes: list[int]) -> None:
        assert len(tier.get_prefix(hashes)) == held_blocks

    out = {"prompt_blocks": prompt_blocks, "held_blocks": held_blocks,
           "miss_ms": median_ms(tier.get_prefix, fresh),
           "round_trip_ms": median_ms(lambda _: pool.client.get(pool.ns + "p:absent"), lambda: None),
           "held_ms": median_ms(read_held, lambda: held + fresh()[held_blocks:]),
           "held_alone_ms": median_ms(tier.get_blocks, lambda: held)}
    out["miss_vs_round_trip"] = out["miss_ms"] / out["round_trip_ms"]
    out["held_vs_held_alone"] = out["held_ms"] / out["held_alone_ms"]
    pool.client.flushdb()
    pool.close()
    return out


def filesystem_of(path: Path) -> str:
    """The type of the file system ``path`` is on (from /proc/mounts)."""
    mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    inside = [(len(m), t) for m, t in mounts if path.resolve().is_relative_to(m)]
    return max(inside)[1] if inside else "?"


def drop_from_page_cache(paths: list[Path]) -> None:
    """Make the next reads of ``paths`` come from the disk: write back, then drop their cached pages."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rate_MB_s(nbytes: int, run, prepare=None, repeat: int = 3) -> float:
    """Median MB/s of ``run`` over ``repeat`` runs; ``prepare`` runs untimed before each."""
    rates = []
    for _ in range(repeat):
        if prepare is not None:
            prepare()
        start = time.perf_counter()
        run()
        rates.append(nbytes / 1e6 / (time.perf_counter() - start))
    return statistics.median(rates)


def bench_disk(root: Path, shape: tuple[int, ...], total_bytes: int, run_blocks: int) -> dict:
    """The disk tier's put (queue, encode, write, ``sync``) and prefix-run get (read, check, tensor) against
    plain writes and reads of the same encoded bytes: per-block files, and one sequential file."""
    block = torch.randn(shape).to(torch.bfloat16)
    hashes = [random.getrandbits(64) for _ in range(max(run_blocks, total_bytes // (2 * block.numel())))]
    encoded = [encode_block("bench", h, block) for h in hashes]
    nbytes = sum(map(len, encoded))
    raw_paths = [root / "raw" / f"{i:06d}.kv" for i in range(len(hashes))]
    raw_paths[0].parent.mkdir(parents=True)
    sequential = root / "sequential.bin"
    buffer = bytearray(8 << 20)

    def raw_write() -> None:
        for p, data in zip(raw_paths, encoded, strict=True):
            with open(p, "wb") as f:
                f.write(data)
        os.sync()

    def raw_read() -> None:
        for p in raw_paths:
            with open(p, "rb", buffering=0) as f:
                f.readall()

    def sequential_write() -> None:
        with open(sequential, "wb") as f:
            for data in encoded:
                f.write(data)
        os.sync()

    def sequential_read() -> None:
        with open(sequential, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass

    tier = DiskTier(root / "tier", "bench", 2 * nbytes, max_pending_bytes=2 * nbytes)
    runs = [hashes[i:i + run_blocks] for i in range(0, len(hashes), run_blocks)]

    def tier_write() -> None:
        for run in runs:
            tier.put_blocks(run, [block] * len(run))
        tier.flush()
        os.sync()

    def tier_read() -> None:
        for run in runs:
            assert len(tier.get_prefix(run)) == len(run)

    sides = {"raw_files": (raw_write, raw_read, raw_paths),
             "sequential_file": (sequential_write, sequential_read, [sequential]),
             "tier": (tier_write, tier_read, [tier.path_of(h) for h in hashes])}
    out: dict = {"fs": filesystem_of(root), "block_bytes": len(encoded[0]), "blocks": len(hashes),
                 "run_blocks": run_blocks, "write_MB_s": {}, "read_cold_MB_s": {}, "read_warm_MB_s": {},
                 # the check every tier read makes, on one core: the ceiling of a page-cache read
                 "crc32c_one_core_MB_s": rate_MB_s(nbytes, lambda: [checksum(data) for data in encoded])}
    try:
        for name, (write, read, paths) in sides.items():
            out["write_MB_s"][name] = rate_MB_s(nbytes, write, repeat=1)
            out["read_cold_MB_s"][name] = rate_MB_s(nbytes, read, lambda p=paths: drop_from_page_cache(p))
            out["read_warm_MB_s"][name] = rate_MB_s(nbytes, read, read)  # the untimed read makes them cached
        assert tier.dropped == 0 and tier.nbytes == nbytes
    finally:
        tier.close()
        shutil.rmtree(root)
    for kind in ("read_cold", "read_warm"):
        r = out[f"{kind}_MB_s"]
        out[f"{kind}_tier_vs_raw_files"] = r["tier"] / r["raw_files"]
        out[f"{kind}_tier_vs_sequential_file"] = r["tier"] / r["sequential_file"]
    return out


def bench_mirror(url: str, workers: int, blocks: int, lookups: int) -> dict[str, float]:
    """Chains of 100 blocks: each fully on one worker, a random prefix of it on up to two others; the
    first 8 blocks of chain 0 (a shared system prompt) on every worker."""
    pool = KVPool(url, "bench-mirror", 16, ttl_s=3600)
    rng = random.Random(1)
    names = [f"worker-{i:04d}" for i in range(workers)]
    chains = [[rng.getrandbits(64) for _ in range(100)] for _ in range(blocks // 100)]
    holdings: list[dict[int, int]] = [{} for _ in names]
    for i, c in enumerate(chains):
        holdings[i % workers].update(dict.fromkeys(c, 1))
        for w in rng.sample(range(workers), rng.randrange(3)):
            holdings[w].update(dict.fromkeys(c[:rng.randrange(1, 100)], 1))
    for h in holdings:
        h.update(dict.fromkeys(chains[0][:8], 1))
    start = time.perf_counter()
    pipe = pool.client.pipeline(transaction=False)
    for w in names:
        pipe.zadd(pool.ns + "hb", {w: int(time.time() * 1000)})  # heartbeats, without 1,000 round trips
    pipe.execute()
    for w, h in zip(names, holdings, strict=True):
        assert pool.replace_holdings(w, h)
    load_s = time.perf_counter() - start
    del holdings

    mirror = PoolMirror(url, "bench-mirror", 16, ttl_s=3600)
    start = time.perf_counter()
    mirror.poll()
    rebuild_s = time.perf_counter() - start
    indexed = mirror.indexed_blocks
    assert len(mirror.longest_prefix(chains[0])) == workers and len(mirror.workers()) == workers
    chain_lookups = timed_lookups(mirror.longest_prefix, [rng.choice(chains) for _ in range(lookups)])
    # the shared prefix: every worker matches 8 blocks, then one holder goes on
    hot = timed_lookups(mirror.longest_prefix, [chains[0]] * max(100, lookups // 10))
    mirror.stop()
    pool.client.flushdb()
    pool.close()
    return {"workers": workers, "indexed_blocks": indexed, "redis_load_s": load_s, "rebuild_s": rebuild_s,
            "lookups": lookups, **chain_lookups, "hot_prefix": hot}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="small sizes (100 workers, 100k blocks)")
    ap.add_argument("--block-shape", default="32,2,16,8,128", help="layers,2,block_size,kv_heads,head_dim (bf16)")
    ap.add_argument("--payload-mib", type=int, default=256)
    ap.add_argument("--disk-dir", type=Path, help="where the disk tier writes (default: a temporary dir)")
    ap.add_argument("--disk-run-blocks", type=int, default=16, help="blocks per prefix run the tier reads")
    args = ap.parse_args()
    if shutil.which("redis-benchmark") is None:
        sys.exit("redis-benchmark not found (apt-get install redis-tools)")
    shape = tuple(int(x) for x in args.block_shape.split(","))
    block_bytes = 2 * int(torch.tensor(shape).prod())
    lookups = 2000 if args.quick else 20000
    results: dict = {"quick": args.quick, "block_shape": list(shape), "cpus": os.cpu_count(),
                     "loadavg_before": os.getloadavg()}
    with LocalRedis() as server:
        results["redis_benchmark_small"] = redis_benchmark(server.port, 16, 20000)
        results["redis_benchmark_block"] = redis_benchmark(server.port, block_bytes,
                                                           max(50, (args.payload_mib << 20) // block_bytes))
        server_client = KVPool(server.url, "x", 1).client
        server_client.flushdb()
        results["pool_longest_prefix_100_blocks"] = bench_lookup(server.url, lookups // 4)
        results["payload"] = bench_payload(server.url, shape, args.payload_mib << 20, batch=8)
        results["prefix_read"] = bench_prefix_read(server.url, shape, 128, 16, 20 if args.quick else 100)
        disk_root = Path(tempfile.mkdtemp(prefix="tidepool-disk-bench-", dir=args.disk_dir))
        results["disk"] = bench_disk(disk_root, shape, args.payload_mib << 20, args.disk_run_blocks)
        for kind in ("read_cold", "read_warm"):  # the fetch order: disk before Redis when it reads faster
            results["disk"][f"{kind}_tier_vs_redis_get"] = (results["disk"][f"{kind}_MB_s"]["tier"]
                                                            / results["payload"]["get_MB_s"])
        workers, blocks = (100, 100_000) if args.quick else (1000, 1_000_000)
        results["mirror"] = bench_mirror(server.url, workers, blocks, lookups)
        server_client.close()
    results["loadavg_after"] = os.getloadavg()
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
