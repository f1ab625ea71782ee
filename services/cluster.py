"""Start or attach to Ray, own the local Redis, place the workers by resource, and build the dispatcher."""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from dataclasses import dataclass

import ray

from engine.loader import resolve_model_dir
from engine.tokenizer import Tokenizer
from kvstore.events import PoolMirror
from router.conductor import SLO, Conductor
from router.estimator import Estimator
from services.config import ClusterConfig
from services.dispatcher import Dispatcher
from services.local_redis import LocalRedis
from services.messages import Role
from services.metrics import Metrics
from services.worker import ColocatedWorker, DecodeWorker, PrefillWorker, WorkerSpec
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


class Cluster:
    """Everything ``tidepool serve`` starts; ``stop()`` ends exactly what ``start()`` started."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.redis: LocalRedis | None = None
        self.redis_url = config.redis_url
        self.started_ray = False
        self.workers: list[WorkerClient] = []
        self.placements: list[Placement] = []
        self.mirror: PoolMirror | None = None
        self.dispatcher: Dispatcher | None = None
        self.cluster_id = uuid.uuid4().hex[:8]  # actor names stay unique when clusters share one Ray

    # ---- start ----------------------------------------------------------------------------------------------
    def start_infrastructure(self) -> None:
        if self.redis_url is None:
            self.redis = LocalRedis()
            self.redis_url = self.redis.url
        if not ray.is_initialized():
            if self.config.address:
                ray.init(address=self.config.address, log_to_driver=False)
            else:
                ray.init(num_cpus=self.config.ray_num_cpus, include_dashboard=False, log_to_driver=False)
                self.started_ray = True

    def _actor_options(self, role: Role, threads: int) -> tuple[dict, str]:
        resources = ray.cluster_resources()
        options: dict = {"num_cpus": threads}
        device = "cpu"
        if resources.get("GPU", 0) >= 1:
            options["num_gpus"] = 1  # prefill and decode never share a GPU
            device = "cuda"
        if role != Role.COLOCATED and resources.get(role, 0) >= 1:
            options["resources"] = {role: 1}
        return options, device

    def _threads_per_worker(self) -> int:
        if self.config.threads_per_worker:
            return self.config.threads_per_worker
        cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        return max(1, min(os.cpu_count() or 1, cpus) // len(self.config.roles()))

    async def start(self) -> Dispatcher:
        self.start_infrastructure()
        model_dir = resolve_model_dir(self.config.engine.model)
        tokenizer = Tokenizer.from_dir(model_dir)
        threads = self._threads_per_worker()
        counters: dict[Role, int] = {}
        pending = []
        for role in self.config.roles():
            counters[role] = counters.get(role, 0) + 1
            worker_id = f"{role}-{counters[role] - 1}"
            options, device = self._actor_options(role, threads)
            spec = WorkerSpec(
                worker_id=worker_id, role=role, engine=dataclasses.replace(self.config.engine, device=device,
                                                                   enable_block_events=self.redis_url is not None),
                redis_url=self.redis_url,
                num_threads=threads, kv_transport=self.config.kv_transport, layerwise=self.config.layerwise,
                pool_max_bytes=self.config.pool_max_bytes,
            )
            actor_cls = ray.remote(_ACTOR_CLASSES[role])
            env = {"OMP_NUM_THREADS": str(threads), **self.config.extra_env}
            actor = actor_cls.options(
                name=f"tidepool-{self.cluster_id}-{worker_id}", max_concurrency=1000, runtime_env={"env_vars": env},
                **options,
            ).remote(spec)
            pending.append((worker_id, role, actor, options))
        for worker_id, role, actor, options in pending:
            info = await actor.start.remote()
            self.workers.append(WorkerClient(info, actor))
            self.placements.append(Placement(worker_id, role, info.node, info.node_id, info.device, options))
        first = self.workers[0].info
        estimator = Estimator.from_samples(
            prefill_samples=[s for w in self.workers for s in w.info.profile.prefill],
            decode_samples=[s for w in self.workers for s in w.info.profile.decode],
            kv_bytes_per_token=first.kv_bytes_per_token,
        )
        conductor = Conductor(self.config.policy, estimator, SLO(self.config.ttft_slo_s, self.config.tbt_slo_s),
                              block_size=first.block_size)
        self.mirror = PoolMirror(self.redis_url, first.model_id, first.block_size)
        self.mirror.start()
        self.dispatcher = Dispatcher(self.workers, conductor, self.mirror, tokenizer, Metrics(),
                                     self.config.kv_transport, self.redis_url)
        await self.dispatcher.start()
        return self.dispatcher

    def describe_placement(self) -> str:
        rows = [f"  {p.worker_id:<14} node={p.node} ({p.node_id[:12]}) device={p.device:<5} resources={p.resources}"
                for p in self.placements]
        return "\n".join(["workers:", *rows])

    # ---- stop -----------------------------------------------------------------------------------------------
    async def stop(self) -> None:
        if self.dispatcher is not None:
            await self.dispatcher.stop()
        if self.mirror is not None:
            self.mirror.stop()
        for worker in self.workers:
            try:
                ray.kill(worker.actor)
            except Exception:  # already dead: nothing left to free
                log.debug("worker %s already gone", worker.worker_id)
        self.workers.clear()
        if self.started_ray:
            ray.shutdown()
        if self.redis is not None:
            self.redis.stop()
