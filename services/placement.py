"""Placing worker actors on the Ray cluster: what each asks for, where it landed, and failing fast.

``WorkerLauncher`` starts one worker actor from the cluster's settings (at start, and again for a dead
worker's replacement). A worker asks for ``num_gpus`` (on GPUs) or CPU threads, plus the role's custom
resource when the cluster has one. Before anything is started, ``shortfall`` compares what all workers
ask for with what the cluster has, so an impossible request fails at once with what is missing; on a
cluster that may grow (``--address``) the launcher waits up to the placement timeout instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass

import ray

from engine.config import EngineConfig
from services.config import ClusterConfig
from services.decode_worker import DecodeWorker
from services.errors import PlacementError
from services.load_reports import load_board_key
from services.messages import Role
from services.prefill_worker import PrefillWorker
from services.worker import ColocatedWorker, WorkerSpec
from services.worker_client import WorkerClient

log = logging.getLogger(__name__)

_ACTOR_CLASSES = {Role.PREFILL: PrefillWorker, Role.DECODE: DecodeWorker, Role.COLOCATED: ColocatedWorker}


@dataclass
class Placement:
    worker_id: str
    role: Role
    node: str
    node_id: str
    device: str
    resources: dict


def worker_options(role: Role, threads: int, gpus_per_worker: float | None, resources: dict) -> tuple[dict, str]:
    """(Ray actor options, device) of a worker on a cluster with these total ``resources``."""
    gpus = (1.0 if resources.get("GPU", 0) >= 1 else 0.0) if gpus_per_worker is None else gpus_per_worker
    options: dict = {"num_cpus": threads}
    if gpus:
        options["num_gpus"] = gpus  # one each by default: prefill and decode never share a GPU
    if role != Role.COLOCATED and resources.get(role, 0) >= 1:
        options["resources"] = {role: 1}
    return options, "cuda" if gpus else "cpu"


def worker_engine(engine: EngineConfig, role: Role, device: str, block_events: bool) -> EngineConfig:
    """The engine settings of a worker of ``role`` on ``device``. A prefill worker never decodes: it neither
    speculates nor loads a draft model."""
    speculation = dict(num_speculative_tokens=0, speculative_model=None) if role == Role.PREFILL else {}
    return dataclasses.replace(engine, device=device, enable_block_events=block_events, **speculation)


def demand(options: list[dict]) -> Counter:
    """The resources these actor options ask for, summed."""
    total: Counter = Counter()
    for o in options:
        total["CPU"] += o.get("num_cpus", 0)
        total["GPU"] += o.get("num_gpus", 0)
        total.update(o.get("resources", {}))
    return +total  # drop zeros


def shortfall(options: list[dict], resources: dict) -> str | None:
    """What the workers ask for beyond ``resources``, in words ("3 workers need 3 CPUs; this Ray cluster
    has 2"); None when it fits."""
    workers = f"{len(options)} worker{'s need' if len(options) > 1 else ' needs'}"
    missing = [f"{workers} {_amount(name, need)}; this Ray cluster has {_amount(name, resources.get(name, 0))}"
               for name, need in demand(options).items() if need > resources.get(name, 0)]
    return "; ".join(missing) or None


def _amount(name: str, x: float) -> str:
    if name in ("CPU", "GPU"):
        return f"{x:g} {name}{'' if x == 1 else 's'}"
    return f"{x:g} of the custom resource {name!r}"


class WorkerLauncher:
    """Starts worker actors with the cluster's one spec and resource rules; remembers every actor it
    started, so ``kill_all`` ends replacements as well as the first workers."""

    def __init__(self, config: ClusterConfig, cluster_id: str, redis_url: str | None, threads: int,
                 transfer_secret: str, may_grow: bool) -> None:
        self.config, self.cluster_id, self.redis_url, self.threads = config, cluster_id, redis_url, threads
        self.transfer_secret, self.may_grow = transfer_secret, may_grow
        self.actors: list = []
        self.placements: dict[str, Placement | None] = {}  # in launch order; None until the worker serves

    def options(self, role: Role) -> tuple[dict, str]:
        return worker_options(role, self.threads, self.config.gpus_per_worker, ray.cluster_resources())

    def check_fits(self, roles: list[Role]) -> None:
        """Fail at once when the workers can never fit (a cluster that may grow gets the timeout instead)."""
        missing = shortfall([self.options(r)[0] for r in roles], ray.cluster_resources())
        if missing and not self.may_grow:
            raise PlacementError(f"cannot place the workers: {missing}")

    async def launch(self, worker_id: str, role: Role) -> WorkerClient:
        """Start one worker and wait until it serves; PlacementError if Ray can't place it in time."""
        options, device = self.options(role)
        self.placements[worker_id] = None
        spec = WorkerSpec(
            worker_id=worker_id, role=role,
            engine=worker_engine(self.config.engine, role, device, self.redis_url is not None),
            redis_url=self.redis_url, num_threads=self.threads, kv_transport=self.config.kv_transport,
            layerwise=self.config.layerwise, max_kv_channels=self.config.max_kv_channels,
            stream_interval=self.config.stream_interval,
            pool_max_bytes=self.config.pool_max_bytes,
            kv_disk_dir=self.config.kv_disk_dir, kv_disk_bytes=self.config.kv_disk_bytes,
            transfer_secret=self.transfer_secret, load_board=load_board_key(self.cluster_id),
        )
        # No runtime env unless asked for: Ray starts a worker that has one through a setup process of its own,
        # 0.6 s of CPU and of start time more per worker (benchmarks/worker_start.py). OMP_NUM_THREADS needs
        # none: Ray sets it to the actor's num_cpus (the worker's threads) when the node's environment leaves
        # it unset, and the worker sets torch's threads itself.
        runtime_env = {"runtime_env": {"env_vars": self.config.extra_env}} if self.config.extra_env else {}
        actor = ray.remote(_ACTOR_CLASSES[role]).options(
            name=f"tidepool-{self.cluster_id}-{worker_id}", max_concurrency=1000, **runtime_env, **options,
        ).remote(spec)
        self.actors.append(actor)  # killed by kill_all, whatever happens next
        try:
            try:
                async with asyncio.timeout(self.config.placement_timeout_s):
                    await actor.__ray_ready__.remote()
            except TimeoutError:
                missing = shortfall([options], ray.available_resources()) or "nothing it asks for is missing now"
                raise PlacementError(f"worker {worker_id} ({options}) was not placed within "
                                     f"{self.config.placement_timeout_s:g} s: {missing}") from None
            info = await actor.start.remote()
        except BaseException:
            if ray.is_initialized():
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)  # a half-started worker holds resources
            raise
        self.placements[worker_id] = Placement(worker_id, role, info.node, info.node_id, info.device, options)
        return WorkerClient(info, actor)

    def stop(self, worker: WorkerClient) -> None:
        """Kill one worker's actor (a drained worker: its resources go back to Ray) and forget it."""
        with contextlib.suppress(Exception):  # dead already: nothing left to free
            ray.kill(worker.actor, no_restart=True)
        self.actors = [a for a in self.actors if a is not worker.actor]
        self.placements.pop(worker.worker_id, None)

    def kill_all(self) -> None:
        if not ray.is_initialized():
            return  # nothing is left to kill, and a Ray call now would start a new local Ray
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead: nothing left to free
                log.debug("actor already gone")
        self.actors.clear()

    def describe(self) -> str:
        rows = [f"  {p.worker_id:<14} node={p.node} ({p.node_id[:12]}) device={p.device:<5} resources={p.resources}"
                for p in self.placements.values() if p is not None]
        return "\n".join(["workers:", *rows])
