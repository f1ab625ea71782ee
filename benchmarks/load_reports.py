"""What keeping the router's view of busy workers fresh costs the gateway: asking every worker for its load
report with a Ray call 20 times a second (``Dispatcher.refresh_loads``, what the dispatcher does without a
load board) against reading the board the workers write their reports on as often (``LoadBoard.read``).

    python benchmarks/load_reports.py --workers 4 --stand-ins 16,64 --json load_reports.json

First N colocated workers (the built-in tiny model by default) each decode long requests back to back, driven
from Ray tasks so that their token streams cost the gateway's process nothing; their reports change as they
step, and each writes them on the board as it does. Then, for the scale this machine can't run workers at,
stand-ins: Ray actors whose "engine" steps every 10 ms, answering the same call and writing the board with the
same writer (every 25 ms then, as a busy worker does), so only the transport is measured.

The ways alternate for ``--rounds``, each with the gateway process idle for as long (Ray's own threads in it
use CPU all the time); the figure is the process's CPU time (every thread) per report received over
``--seconds``, less the idle time's. The load average is recorded: run it on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import secrets
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from benchmarks._report import format_table, load_average  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from router.loads import WorkerLoad  # noqa: E402
from services.config import ClusterConfig  # noqa: E402
from services.dispatcher import _LOAD_REFRESH_S, _LOAD_TIMEOUT_S  # noqa: E402
from services.load_reports import ChangeSignal, LoadBoard, LoadWriter, load_board_key  # noqa: E402
from services.local_redis import LocalRedis  # noqa: E402
from services.messages import Role  # noqa: E402
from services.placement import WorkerLauncher  # noqa: E402
from services.worker_client import WorkerClient  # noqa: E402


@ray.remote(num_cpus=0)
def keep_decoding(actor: ray.actor.ActorHandle, name: str, until: float, max_tokens: int) -> int:
    """Requests on ``actor``, one after another, until the wall clock passes ``until``; how many ran."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    done = 0
    while time.time() < until:
        for ref in actor.generate.remote(f"{name}-{done}", list(range(10, 42)), params):
            ray.get(ref)
        done += 1
    return done


@ray.remote(num_cpus=0)
class ReportStandIn:
    """A worker's load reporting alone: an engine that "steps" every 10 ms (a busy decode batch) and tells the
    writer so, as the engine loop does; its report, asked for or written, shows the latest step."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id, self.numbers, self.steps = worker_id, itertools.count(1), 0
        self.tasks: list[asyncio.Task] = []

    async def load(self) -> WorkerLoad:
        return WorkerLoad(self.worker_id, "decode", report_seq=next(self.numbers), steps=self.steps,
                          num_running=8, free_blocks=400, total_blocks=512,
                          decode_steps=((self.steps, 8, 2048, 0.01),))

    async def write_board(self, redis_url: str, key: str) -> None:
        changed = ChangeSignal(asyncio.get_running_loop())
        self.tasks = [asyncio.create_task(self._step(changed)),
                      asyncio.create_task(LoadWriter(redis_url, key, self.load, changed).run())]

    async def _step(self, changed: ChangeSignal) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.steps += 1
            changed.notify()


async def asked(ask: list[Callable[[], Awaitable[WorkerLoad]]], seconds: float) -> int:
    """Every worker asked every _LOAD_REFRESH_S, as the dispatcher's refresher does: the reports received."""
    received, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        received += len(await asyncio.gather(*(one() for one in ask)))
        await asyncio.sleep(_LOAD_REFRESH_S)
    return received


async def from_board(redis_url: str, key: str, seconds: float) -> int:
    """The board read every _LOAD_REFRESH_S, as the dispatcher's refresher does: the new reports it gave."""
    board = LoadBoard(redis_url, key)
    await board.read()  # what was written before this run
    received, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        received += len(await board.read())
        await asyncio.sleep(_LOAD_REFRESH_S)
    await board.close()
    return received


async def idle(seconds: float) -> int:
    await asyncio.sleep(seconds)
    return 0


def measure(run) -> tuple[int, float]:
    """(reports received, the gateway process's CPU seconds) of one way's run."""
    cpu = time.process_time()
    received = asyncio.run(run)
    return received, time.process_time() - cpu


def compare(ask: list[Callable[[], Awaitable[WorkerLoad]]], redis_url: str, key: str, seconds: float,
            rounds: int) -> dict:
    """Both ways over ``rounds``, each against an idle spell: reports a second, gateway CPU a report and cores."""
    samples: dict[str, list[tuple[int, float]]] = {"asked": [], "board": [], "idle": []}
    for _ in range(rounds):
        samples["asked"].append(measure(asked(ask, seconds)))
        samples["board"].append(measure(from_board(redis_url, key, seconds)))
        samples["idle"].append(measure(idle(seconds)))
    idle_cpu = statistics.median(cpu for _, cpu in samples.pop("idle"))
    ways = {way: {"reports_per_s": statistics.median(n for n, _ in runs) / seconds,
                  "gateway_cpu_ms_per_report": statistics.median(1000 * (cpu - idle_cpu) / n for n, cpu in runs),
                  "gateway_cores": statistics.median(cpu - idle_cpu for _, cpu in runs) / seconds}
            for way, runs in samples.items()}
    return {"workers": len(ask), "idle_gateway_cores": idle_cpu / seconds, **ways,
            "cpu_per_report_ratio": ways["asked"]["gateway_cpu_ms_per_report"]
            / ways["board"]["gateway_cpu_ms_per_report"]}


def print_results(title: str, results: list[dict]) -> None:
    print(title)
    print(format_table(["workers", "way", "reports/s", "gateway CPU ms a report", "gateway cores", "asked/board"],
                       [[r["workers"], way, r[way]["reports_per_s"], r[way]["gateway_cpu_ms_per_report"],
                         r[way]["gateway_cores"], r["cpu_per_report_ratio"] if way == "board" else ""]
                        for r in results for way in ("asked", "board")]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a checkpoint directory or the built-in tiny model")
    parser.add_argument("--workers", type=int, default=4, help="real workers, decoding")
    parser.add_argument("--stand-ins", default="16,64", help="stand-in counts to run, comma-separated ('': none)")
    parser.add_argument("--seconds", type=float, default=5.0, help="each way's measured time per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    stand_in_counts = [int(n) for n in args.stand_ins.split(",") if n]

    ray.init(address="local", num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    redis = LocalRedis()
    cluster_id = secrets.token_hex(4)
    launcher = WorkerLauncher(ClusterConfig(engine=EngineConfig(model=args.model, num_blocks=512),
                                            colocated=args.workers), cluster_id, redis.url, 1, secrets.token_hex(8),
                              may_grow=False)
    try:
        async def launch_all() -> list[WorkerClient]:
            return list(await asyncio.gather(*(launcher.launch(f"w{i}", Role.COLOCATED)
                                               for i in range(args.workers))))

        workers = asyncio.run(launch_all())
        until = time.time() + 3 * args.rounds * (args.seconds + 2) + 10
        drivers = [keep_decoding.remote(w.actor, w.worker_id, until, 1000) for w in workers]
        time.sleep(3)  # every worker decoding
        real = compare([functools.partial(w.load, _LOAD_TIMEOUT_S) for w in workers], redis.url,
                       load_board_key(cluster_id), args.seconds, args.rounds)
        real["requests_decoded"] = sum(ray.get(drivers))
        launcher.kill_all()
        scaled = []
        for count in stand_in_counts:
            key = load_board_key(secrets.token_hex(4))
            stand_ins = [ReportStandIn.remote(f"s{i}") for i in range(count)]
            ray.get([s.write_board.remote(redis.url, key) for s in stand_ins])
            scaled.append(compare([s.load.remote for s in stand_ins], redis.url, key, args.seconds, args.rounds))
            for stand_in in stand_ins:
                ray.kill(stand_in)
    finally:
        launcher.kill_all()
        ray.shutdown()
        redis.stop()

    report = {"model": args.model, "load_average": load_average(), "workers": real, "stand_ins": scaled}
    print(f"load average {report['load_average']}")
    print_results(f"{args.workers} workers decoding ({real['requests_decoded']} requests); the gateway idle used "
                  f"{real['idle_gateway_cores']:.3f} cores (taken off below)", [real])
    if scaled:
        print_results("stand-ins: a step every 10 ms, so each writes on the board every 25 ms", scaled)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
