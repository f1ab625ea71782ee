"""Start or attach to Ray, own the local Redis, place the workers by resource, and build the dispatcher.

A local Ray gets enough logical CPUs for the workers it starts (threads per worker are set separately,
so logical CPUs and physical cores differ); workers that can't be placed fail the start with what is
missing (``services/placement.py``). The supervisor replaces workers that die (``services/supervisor.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import uuid

import ray

from engine.config import ModelConfig
from engine.draft_model import check_draft_model
from engine.generation_defaults import GenerationDefaults
from engine.loader import model_id_for, resolve_model_dir
from engine.lora import check_adapters
from engine.tokenizer import load_tokenizer
from kvstore.events import PoolMirror
from router.conductor import SLO, Conductor
from router.estimator import Estimator
from router.planner import Demand
from services.attempt import Deadlines
from services.autoscaler import Autoscaler
from services.config import ClusterConfig
from services.dispatcher import Dispatcher
from services.load_reports import LoadBoard, load_board_key
from services.local_redis import LocalRedis
from services.lora_updates import LoRAUpdates
from services.metrics import Metrics
from services.placement import WorkerLauncher
from services.scaling import Scaler
from services.supervisor import Supervisor
from services.worker_client import WorkerClient

log = logging.getLogger(__name__)


class Cluster:
    """Everything ``tidepool serve`` starts; ``stop()`` ends exactly what ``start()`` started."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.redis: LocalRedis | None = None
        self.redis_url = config.redis_url
        self.started_ray = False
        self.workers: list[WorkerClient] = []  # the first workers (the dispatcher's set follows replacements)
        self.launcher: WorkerLauncher | None = None
        self.supervisor: Supervisor | None = None
        self.scaler: Scaler | None = None
        self.autoscaler: Autoscaler | None = None
        self.lora_updates: LoRAUpdates | None = None
        self.mirror: PoolMirror | None = None
        self.dispatcher: Dispatcher | None = None
        self.cluster_id = uuid.uuid4().hex[:8]  # actor names stay unique when clusters share one Ray
        # Every worker's KV transfer server refuses pushes without it; it reaches them in their WorkerSpec.
        self.transfer_secret = secrets.token_hex(32)

    # ---- start ----------------------------------------------------------------------------------------------
    def start_infrastructure(self) -> None:
        if self.redis_url is None:
            # A password, so other users of the machine can't read or write the pool and the sessions; the
            # watcher restarts a redis-server that dies, on the same port with the same password.
            self.redis = LocalRedis(password=secrets.token_hex(24), restart_on_exit=True)
            self.redis_url = self.redis.url
        if not ray.is_initialized():
            if self.config.address or os.environ.get("RAY_ADDRESS"):  # (Ray reads the variable itself)
                ray.init(address=self.config.address, log_to_driver=False)
            else:
                # Each worker asks Ray for its threads as CPUs: give Ray at least that many logical CPUs.
                cores = os.cpu_count() or 1
                workers = len(self.config.roles())
                threads = self.config.threads_per_worker or max(1, cores // workers)
                # "local": an instance of our own. Without it Ray joins the cluster a `ray start` on this
                # machine last recorded, which refuses a CPU count (or is gone, and the start fails); that one
                # is joined with --address auto.
                ray.init(address="local", num_cpus=self.config.ray_num_cpus or max(cores, workers * threads),
                         include_dashboard=False, log_to_driver=False)
                self.started_ray = True

    def _threads_per_worker(self) -> int:
        if self.config.threads_per_worker:
            return self.config.threads_per_worker
        cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        return max(1, min(os.cpu_count() or 1, cpus) // len(self.config.roles()))

    async def start(self) -> Dispatcher:
        # A --model that can't be served fails here, before Ray and Redis start, with the file it is about
        # (CheckpointError, UnsupportedModelError), not later inside a worker; so do a --tokenizer and a
        # --speculative-model that are not the model's.
        model_dir = resolve_model_dir(self.config.engine.model)
        model_config = ModelConfig.from_dir(model_dir)
        self.config.engine.max_model_len_for(model_config)
        if self.config.engine.speculative_model is not None:
            check_draft_model(self.config.engine.speculative_model, model_config)
        check_adapters(self.config.engine.lora_modules, model_id_for(self.config.engine.model))
        tokenizer = load_tokenizer(self.config.engine, model_dir, model_config.vocab_size, required=True)
        if self.config.chat_template is not None:
            tokenizer = tokenizer.with_chat_template(self.config.chat_template)
        generation_defaults = GenerationDefaults.load(self.config.generation_config, model_dir,
                                                      self.config.override_generation_config)
        log.info("default sampling parameters (--generation-config %s): %s", self.config.generation_config,
                 generation_defaults.describe())
        self.start_infrastructure()
        roles = self.config.roles()
        # A cluster we joined may grow (autoscaler): it gets the placement timeout, not the fast failure.
        self.launcher = WorkerLauncher(self.config, self.cluster_id, self.redis_url, self._threads_per_worker(),
                                       self.transfer_secret, may_grow=not self.started_ray)
        self.launcher.check_fits(roles)
        counters: dict[str, int] = {}
        ids = []
        for role in roles:
            counters[role] = counters.get(role, 0) + 1
            ids.append(f"{role}-{counters[role] - 1}")
        launches = [asyncio.create_task(self.launcher.launch(i, r)) for i, r in zip(ids, roles, strict=True)]
        try:
            self.workers = list(await asyncio.gather(*launches))
        except BaseException:  # the first failure (e.g. PlacementError) ends the others
            for task in launches:
                task.cancel()
            await asyncio.gather(*launches, return_exceptions=True)
            raise
        first = self.workers[0].info
        estimator = Estimator.from_samples(
            prefill_samples=[s for w in self.workers for s in w.info.profile.prefill],
            decode_samples=[s for w in self.workers for s in w.info.profile.decode],
            kv_bytes_per_token=first.kv_bytes_per_token,
            layers=first.num_layers if self.config.layerwise else 1,  # layer-wise KV leaves as layers finish
        )
        autoscale = self.config.autoscale
        conductor = Conductor(self.config.policy, estimator, SLO(self.config.ttft_slo_s, self.config.tbt_slo_s),
                              block_size=first.block_size, copy_inflight=True,
                              demand=Demand(autoscale.window_s) if autoscale.bounds else None,
                              **self.config.policy_options())
        self.mirror = PoolMirror(self.redis_url, first.model_id, first.block_size)
        self.mirror.start()
        # Without replacements, a request whose workers died has nothing to wait for.
        deadlines = Deadlines() if self.config.replace_workers else Deadlines(resume_s=0.0)
        served = self.config.served_model_names or (first.model_id,)
        self.dispatcher = Dispatcher(self.workers, conductor, self.mirror, tokenizer,
                                     Metrics(served[0], first.max_model_len),
                                     self.config.kv_transport, self.redis_url, deadlines, generation_defaults,
                                     served_model_names=served,
                                     load_board=LoadBoard(self.redis_url, load_board_key(self.cluster_id)))
        await self.dispatcher.start()
        if self.config.replace_workers:
            self.supervisor = Supervisor(self.dispatcher, self.launcher.launch)
            self.supervisor.start()
        self.scaler = Scaler(self.dispatcher, self.launcher, colocated=bool(self.config.colocated))
        self.lora_updates = LoRAUpdates(self.dispatcher, self.config.engine)
        if autoscale.bounds:
            self.autoscaler = Autoscaler(self.dispatcher, self.scaler, autoscale, self.config.engine.max_num_seqs,
                                         replacing=self.config.replace_workers)
            self.autoscaler.start()
        return self.dispatcher

    def describe_placement(self) -> str:
        return self.launcher.describe() if self.launcher else "workers: none"

    # ---- stop -----------------------------------------------------------------------------------------------
    async def stop(self) -> None:
        # Everything that calls workers stops before the workers, and they before Ray: a Ray call after
        # ray.shutdown() would start a new local Ray.
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.dispatcher is not None:
            await self.dispatcher.stop()
        if self.mirror is not None:
            self.mirror.stop()
        if self.launcher is not None:
            self.launcher.kill_all()
        self.workers.clear()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        if self.redis is not None:
            self.redis.stop()
