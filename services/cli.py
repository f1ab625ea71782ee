"""The ``tidepool`` command: one subcommand per task, each defined next to the code it drives."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from engine.capacity import add_kv_calc_parser
from engine.generate import add_generate_parser
from loadtest.cli import add_bench_parser
from router.sim_cli import add_simulate_parser
from services.status import add_status_parser


def _serve(args: argparse.Namespace) -> int:
    from services.cluster import ClusterConfig
    from services.serve import GatewayConfig, Server

    if args.colocated and (args.prefill_set or args.decode_set):
        print("tidepool serve: use either --colocated N or --prefill/--decode, not both", file=sys.stderr)
        return 2
    cluster = ClusterConfig(
        model=args.model, prefill=args.prefill, decode=args.decode, colocated=args.colocated,
        policy=args.policy, kv_transport=args.kv_transport, layerwise=not args.no_layerwise,
        address=args.address, redis_url=args.redis_url, dtype=args.dtype, num_blocks=args.num_blocks,
        threads_per_worker=args.threads_per_worker, enable_prefix_caching=not args.no_prefix_caching,
        pool_max_bytes=args.pool_max_bytes, ttft_slo_s=args.ttft_slo_s, tbt_slo_s=args.tbt_slo_ms / 1000,
    )
    gateway = GatewayConfig(
        host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        api_key=args.api_key or os.environ.get("TIDEPOOL_API_KEY"),
    )

    async def run() -> None:
        server = Server(cluster, gateway)
        await server.start()
        print(server.cluster.describe_placement(), flush=True)
        print(f"tidepool: serving {server.cluster.dispatcher.model_id} on {server.http_url} (OpenAI HTTP) "
              f"and {server.grpc_target} (gRPC); Ctrl-C stops", flush=True)
        await server.serve_until_stopped()
        print("tidepool: stopped", flush=True)

    asyncio.run(run())
    return 0


class _MarkSet(argparse.Action):
    """Store the value and remember the flag was given (to refuse mixing colocated and P/D flags)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_set", True)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the cluster and its HTTP + gRPC gateways")
    p.add_argument("--model", default="tiny", help="'tiny' (built-in) or a local HF checkpoint directory")
    p.add_argument("--prefill", type=int, default=1, action=_MarkSet, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, action=_MarkSet, help="decode workers")
    p.add_argument("--colocated", type=int, default=0, help="serve N colocated workers instead")
    p.add_argument("--policy", default="tidepool",
                   choices=["round_robin", "least_loaded", "cache_aware", "mooncake", "tidepool"])
    p.add_argument("--kv-transport", default="auto", choices=["grpc", "collective", "auto"])
    p.add_argument("--no-layerwise", action="store_true", help="send KV after prefill instead of per layer")
    p.add_argument("--address", default=None, help="join a Ray cluster ('auto') instead of starting one")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of a private redis-server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--api-key", default=None, help="require this bearer key (or set TIDEPOOL_API_KEY)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker (default: by memory)")
    p.add_argument("--threads-per-worker", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--pool-max-bytes", type=int, default=256 << 20, help="cap of the Redis KV payload tier")
    p.add_argument("--ttft-slo-s", type=float, default=30.0)
    p.add_argument("--tbt-slo-ms", type=float, default=1000.0)
    p.set_defaults(func=_serve, prefill_set=False, decode_set=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidepool", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_generate_parser(sub)
    add_kv_calc_parser(sub)
    add_simulate_parser(sub)
    add_bench_parser(sub)
    add_status_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
