"""Load testing: workloads (Mooncake trace, multi-turn chat, random), streaming HTTP/gRPC clients,
``vllm bench serve`` metrics and reports. ``run_benchmark(BenchConfig(...))`` is the entry point."""

from loadtest.runner import BenchConfig, run_benchmark

__all__ = ["BenchConfig", "run_benchmark"]
