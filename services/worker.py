"""Ray actors wrapping ``engine.Engine``: the base every worker shares and the colocated worker (the prefill
and decode workers are ``services/prefill_worker.py`` and ``services/decode_worker.py``).

Each worker owns one engine, driven on its own thread by ``EngineLoop``; actor methods are async, so a worker
serves many requests at once. A request runs in a task of its own (``generate``), and its tokens go back to its
gateway on that gateway's token feed (``services/token_feed.py``: one Ray stream per gateway carrying a step's
events of all its requests together), handed there as the engine delivers them (``OutputStream``). A request's
blocks are owned by exactly one side at a time: the prefill worker until its KV is acknowledged by the decode
worker, the decode worker's lease from ``reserve`` until the request joins its batch (or the lease expires);
every exit path frees them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
import torch

from engine.config import EngineConfig
from engine.engine import Engine, EngineStats
from engine.sampling_params import Priority, SamplingParams
from router.estimator import PrefillModel
from router.loads import WorkerLoad, step_samples
from services.background import BackgroundTasks
from services.engine_loop import EngineLoop
from services.engine_profile import prefill_batch_tokens, profile_engine
from services.errors import PrefillTimeoutError, WorkerFailedError
from services.load_reports import ChangeSignal, LoadWriter
from services.messages import EmbeddingResult, EngineStepError, PrefixFetch, Role, WorkerInfo
from services.output_stream import OutputStream
from services.peer_copy import PrefixCopier
from services.pool_link import FetchedBlocks, PoolLink
from services.token_feed import Emit, FeedServer, TokenFeeds

_UNLOAD_POLL_S = 0.05  # how often an adapter being unloaded is checked for requests still running with it
_COLOCATED_COPY_TIMEOUT_S = 30.0  # a colocated request's prefix copy from a peer (prefills have a deadline)


@dataclass
class WorkerSpec:
    """Everything a worker needs to start; built by ``Cluster`` from its one ``ClusterConfig``."""

    worker_id: str
    role: Role
    engine: EngineConfig
    redis_url: str | None
    num_threads: int
    kv_transport: str  # grpc | collective | ipc | auto
    layerwise: bool
    max_kv_channels: int  # collective channels (and their transfer threads) kept open, LRU-evicted
    pool_max_bytes: int
    kv_disk_dir: str | None  # the worker's disk tier lives under kv_disk_dir/worker_id; None: none
    kv_disk_bytes: int
    transfer_secret: str  # the cluster's: KV transfer servers refuse pushes without it
    load_board: str  # the Redis hash it writes its load reports in (services/load_reports.py)
    stream_interval: int = 1  # tokens a stream's events hold before they are sent (ClusterConfig's)


class Worker(FeedServer):
    def __init__(self, spec: WorkerSpec) -> None:
        torch.set_num_threads(spec.num_threads)
        self.spec = spec
        self.pool: PoolLink | None = None
        self.engine = Engine(spec.engine)
        self.loop: EngineLoop | None = None
        self.copier: PrefixCopier | None = None
        self.background = BackgroundTasks("work after a request (pool write, release)")
        self.reporting = BackgroundTasks("writing load reports")  # for the worker's life
        # Prompt tokens placed from each pool tier and from peers ("host", "redis", "peer", ...); counted on
        # the engine thread, copied whole (atomically under the GIL) by load reports.
        self.hit_tokens: dict[str, int] = {}
        self._reports = itertools.count(1)  # numbers the load reports in the order they are taken
        self.report_changed: ChangeSignal | None = None  # wakes the load writer (set up in start)
        self.feeds = TokenFeeds()  # the gateways' token feeds (the colocated and decode workers' streams)

    # ---- lifecycle and reports -------------------------------------------------------------------------------
    async def start(self) -> WorkerInfo:
        """Start the engine thread, profile the engine for the router, and say where this worker runs."""
        self.loop = EngineLoop(self.engine, asyncio.get_running_loop())
        profile = await self.loop.acall(profile_engine, self.engine)
        await self.loop.acall(setattr, self.engine.scheduler, "prefill_batch_tokens", prefill_batch_tokens(profile))
        node = ray.util.get_node_ip_address()
        # Prefill and colocated workers take prefix copies from peers (decode workers only give them):
        # their transfer server binds the node's address, as the decode worker's does.
        self.copier = PrefixCopier(self.engine, self.loop, self.spec.transfer_secret,
                                   host=None if self.spec.role == Role.DECODE else node)
        if self.spec.redis_url:
            # Connected after profiling, so the throwaway profile prompts are never published.
            self.pool = PoolLink(self.spec.redis_url, self.spec.worker_id, self.engine,
                                 self.spec.pool_max_bytes, disk_dir=self.spec.kv_disk_dir,
                                 disk_max_bytes=self.spec.kv_disk_bytes,
                                 prefill_model=PrefillModel.fit(profile.prefill))
            self.loop.set_block_event_sink(self.pool.publish)
            self.report_changed = ChangeSignal(asyncio.get_running_loop())
            self.loop.on_stats = self.report_changed.notify
            self.reporting.spawn(LoadWriter(self.spec.redis_url, self.spec.load_board, self.load,
                                            self.report_changed).run())
        return WorkerInfo(
            worker_id=self.spec.worker_id, role=self.spec.role, node=node,
            node_id=ray.get_runtime_context().get_node_id(), device=str(self.engine.device),
            model_id=self.engine.model_id, block_size=self.engine.block_size,
            max_model_len=self.engine.max_model_len,
            kv_bytes_per_token=self.engine.model_config.kv_bytes_per_token(self.spec.engine.dtype),
            total_blocks=self.engine.stats().total_blocks, profile=profile,
            max_kv_tokens=None if self.engine.window is None else self.engine.window.max_blocks * self.engine.block_size,
            long_rope_from=self.engine.model_config.long_rope_from, quantized_at_load=self.engine.quantized_at_load,
            num_layers=self.engine.model_config.num_layers, prefix_address=self.copier.address,
            loras={name: adapter.adapter_id for name, adapter in self.engine.loras.items()},
            num_speculative_tokens=0 if self.engine.proposer is None else self.engine.proposer.config.num_speculative_tokens,
            hidden_size=self.engine.model_config.hidden_size, pooling=self.engine.pooling,
            generates=self.engine.model_config.generates,
        )

    def notify_report_changed(self) -> None:
        """Something the load report shows changed outside the engine's stats (a reservation's line)."""
        if self.report_changed is not None:
            self.report_changed.notify()

    async def load(self) -> WorkerLoad:
        stats = self.loop.stats
        prefill_steps, decode_steps, drafted_steps = step_samples(tuple(self.loop.step_log))
        return WorkerLoad(
            worker_id=self.spec.worker_id, role=self.spec.role, alive=self.loop.failure is None,
            report_seq=next(self._reports), queued_prefills=list(stats.waiting_prefills), num_running=stats.num_running,
            running_context_tokens=stats.running_context_tokens, free_blocks=stats.free_blocks,
            total_blocks=stats.total_blocks, block_size=self.engine.block_size, updated_at=self.loop.stats_at,
            steps=self.loop.steps, last_step_s=self.loop.step_times_s[-1] if self.loop.step_times_s else 0.0,
            prefill_steps=prefill_steps, decode_steps=decode_steps, drafted_steps=drafted_steps,
            num_waiting=stats.num_waiting, prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prompt_tokens_cached, prompt_tokens_computed=stats.prompt_tokens_computed,
            pool_hit_tokens=dict(self.hit_tokens),
            num_preemptions=stats.num_preemptions, spec_drafts=stats.speculation.drafts,
            spec_draft_tokens=stats.speculation.draft_tokens, spec_accepted_tokens=stats.speculation.accepted_tokens,
            spec_accepted_per_position=tuple(stats.speculation.accepted_per_position),
            max_loras=0 if self.engine.lora_slots is None else self.engine.lora_slots.max_loras,
            running_loras=stats.running_loras, waiting_loras=stats.waiting_loras,
        )

    async def stats(self) -> EngineStats:
        return self.loop.stats

    async def abort(self, request_id: str) -> None:
        await self.loop.acall(self.engine.abort, request_id)

    # ---- LoRA adapters loaded and unloaded while serving (services/lora_updates.py) -------------------------
    async def load_lora(self, name: str, path: str) -> str:
        """Load a LoRA adapter between two engine steps; returns its adapter id (its blocks' salt)."""
        adapter = await self.loop.acall(self.engine.load_adapter, name, path)
        return adapter.adapter_id

    async def unload_lora(self, name: str, wait_s: float) -> int:
        """Unload a LoRA adapter (none loaded under ``name``: nothing to do) once its requests have finished,
        waiting up to ``wait_s``; those still running then are aborted. Returns how many were."""
        deadline = time.monotonic() + wait_s
        while await self.loop.acall(self.engine.adapter_requests, name) and time.monotonic() < deadline:
            await asyncio.sleep(_UNLOAD_POLL_S)
        if name not in self.engine.loras:
            return 0
        return len(await self.loop.acall(self.engine.unload_adapter, name))

    # ---- the KV pool and peer copies ------------------------------------------------------------------------
    async def _fetch_prefix(self, token_ids: list[int], scored: bool, fetch: PrefixFetch | None,
                            timeout_s: float, salt: bytes) -> list[FetchedBlocks]:
        """The prefix blocks this engine lacks, hashed under ``salt`` (the request's adapter's,
        ``Engine.prefix_salt``): first from the peer the router chose (``fetch``), then from the pool's tiers,
        whatever the policy (the worker weighs a Redis read against recomputing). They are placed by ``_place``
        on the engine thread, in the call that admits the request. ``scored``: the prompt is computed whole for
        its prompt logprobs."""
        if not self.engine.block_manager.enable_prefix_caching or scored:
            return []  # nothing fetched could be placed, or used (a prompt scored whole)
        have = self.engine.cached_prefix_len(token_ids, salt) // self.engine.block_size  # a lock-free hint
        fetched = []
        if fetch is not None:
            fetched.append(await self.copier.take(token_ids, fetch, have, timeout_s, salt))
            have += fetched[-1].blocks
        if self.pool is not None:
            fetched.append(await self.pool.read_prefix(token_ids, have, salt))
        return fetched

    async def embed(self, request_id: str, prompt_ids: list[int], dimensions: int | None, deadline_s: float,
                    priority: Priority | None = None) -> EmbeddingResult:
        """The prompt's embedding (``Engine.add_embedding_request``: ``dimensions`` values, None: all), computed
        after the prefix this worker holds or reads from the pool; the prompt's new blocks then go to the pool, as
        a prefill's do. PrefillTimeoutError past ``deadline_s``; a
        cancelled caller aborts it."""
        salt = self.engine.prefix_salt(None, len(prompt_ids))
        queue = self.loop.open_queue(request_id)
        done = False
        try:
            async with asyncio.timeout(deadline_s) as deadline:  # (the fetch too: a read that never ends ends it)
                fetched = await self._fetch_prefix(prompt_ids, False, None, deadline_s, salt)

                def admit() -> None:
                    self._place(prompt_ids, fetched, salt)
                    self.engine.add_embedding_request(request_id, prompt_ids, dimensions, priority)

                await self.loop.acall(admit)
                output = await queue.get()
            if isinstance(output, EngineStepError):
                raise output
            done = output.embedding is not None
            if not done:  # an abort reached the engine first
                raise WorkerFailedError(f"embedding request {request_id} was aborted on {self.spec.worker_id}")
        except TimeoutError as exc:
            if not deadline.expired():
                raise  # (not this deadline's)
            raise PrefillTimeoutError(deadline_s) from exc
        finally:
            self.loop.close_stream(request_id)
            if not done:
                await self.loop.acall(self.engine.abort, request_id)
        if self.pool is not None:  # its blocks are free now, and cached: the pool copies those it lacks
            self.background.spawn(self.pool.store_prefix(self.loop, prompt_ids,
                                                         output.num_cached_tokens // self.engine.block_size, salt))
        return EmbeddingResult(output.embedding, output.num_prompt_tokens, output.num_cached_tokens)

    def _place(self, token_ids: list[int], fetched: list[FetchedBlocks], salt: bytes) -> None:
        """Engine thread: put fetched blocks (hashed under ``salt``) in the prefix cache, in order (each
        continues the one before)."""
        for blocks in fetched:
            if blocks.tensor is None:
                continue
            placed = self.engine.insert_cached_blocks(token_ids, blocks.tensor, blocks.first_block, salt)
            for tier, n in blocks.counts:  # the placed blocks, credited to the tiers in reading order
                n = min(n, placed)
                self.hit_tokens[tier] = self.hit_tokens.get(tier, 0) + n * self.engine.block_size
                placed -= n

    async def push_prefix(self, copy_id: str, token_ids: list[int], skip_blocks: int, wait_blocks: int,
                          address: str, wait_s: float, timeout_s: float, salt: bytes) -> tuple[int, float]:
        """Push cached blocks of ``token_ids`` (hashed under ``salt``) to a peer's prefix copy
        (``services/peer_copy.py``)."""
        return await self.copier.push(copy_id, token_ids, skip_blocks, wait_blocks, address, wait_s, timeout_s, salt)

    async def copy_prefix(self, token_ids: list[int], fetch: PrefixFetch, timeout_s: float) -> int:
        """Replication: copy a hot prefix from ``fetch.source`` ahead of the requests that will want it;
        returns the blocks copied."""
        have = self.engine.cached_prefix_len(token_ids, fetch.salt) // self.engine.block_size  # a lock-free hint
        copied = await self.copier.take(token_ids, fetch, have, timeout_s, fetch.salt)
        await self.loop.acall(self._place, token_ids, [copied], fetch.salt)
        return copied.blocks

    def _share_finished(self, token_ids: list[int], skip_blocks: int, lora: str | None, cache_salt: str | None
                        ) -> None:
        """After a sequence of adapter ``lora`` (and request ``cache_salt``) finished: its answer's blocks to the
        pool, in the background, so the next chat turn (whose prompt carries this one and its answer) finds all
        of it. Its last token's K/V was never computed: the others' say which salt its blocks are under. (An
        adapter unloaded meanwhile, its sequences aborted: its blocks are no later request's.)"""
        if self.pool is not None and (lora is None or lora in self.engine.loras):
            salt = self.engine.prefix_salt(lora, len(token_ids) - 1, cache_salt)
            self.background.spawn(self.pool.store_prefix(self.loop, token_ids, skip_blocks, salt))

    # ---- streaming a request's tokens (start_stream, stop_stream, feed: FeedServer's) --------------------------
    async def _stream(
        self, emit: Emit, request_id: str, index: int, start: Callable[[], None], sequence: list[int],
        shared_blocks: int, lora: str | None, cache_salt: str | None, first_at_once: bool,
    ) -> None:
        """Run ``start`` on the engine thread, then hand the request's events to ``emit`` as the engine delivers
        them (``OutputStream``: held until they make ``--stream-interval`` tokens or finish it), until it finishes.

        ``sequence``: the tokens before the ones this stream emits, of which the first ``shared_blocks``
        blocks are in the pool already (as are those the engine found cached): once finished, the rest of
        the sequence's blocks are shared (under the salt of its adapter ``lora`` and ``cache_salt``). ``first_at_once``: the stream's first output
        is the answer's first token (its TTFT), which leaves at once whatever the interval.
        If the task is cancelled first (the gateway stops the stream, or its feed ends), the request is aborted.
        """
        stream = OutputStream(index, self.spec.stream_interval, first_at_once, emit)
        self.loop.open_stream(request_id, stream.push)
        try:
            await self.loop.acall(start)
            generated, cached_tokens = await stream.done
            # The blocks the engine found cached were shared when they were computed.
            self._share_finished([*sequence, *generated], max(shared_blocks, cached_tokens // self.engine.block_size),
                                 lora, cache_salt)
        finally:
            self.loop.close_stream(request_id)
            if not stream.ended:  # (a failed step aborted its requests already)
                await self.loop.acall(self.engine.abort, request_id)


class ColocatedWorker(Worker):
    """Prefill and decode in one engine: the comparison baseline, and the single-worker deployment."""

    async def generate(
        self, emit: Emit, request_id: str, prompt_ids: list[int], params: SamplingParams, index: int = 0,
        fetch: PrefixFetch | None = None, output_ids: tuple[int, ...] = (), priority: Priority | None = None,
        lora: str | None = None,
    ) -> None:
        """Compute the prompt and decode it, handing its token events to ``emit``; returns once it finished.
        ``output_ids``: the tokens a failed attempt already streamed; the stream continues after them.
        ``priority``: the request's place among waiting prompts (its own priority, then the router's order).
        ``lora``: the LoRA adapter it runs with (None: the base model)."""
        tokens = [*prompt_ids, *output_ids]
        # (InvalidRequestError for an adapter this engine lacks)
        salt = self.engine.prefix_salt(lora, len(tokens), params.cache_salt)
        fetched = await self._fetch_prefix(tokens, params.prompt_logprobs is not None, fetch,
                                           _COLOCATED_COPY_TIMEOUT_S, salt)

        def admit() -> None:
            self._place(tokens, fetched, salt)
            self.engine.add_request(request_id, prompt_ids, params, False, output_ids, priority, lora)

        # The prompt's new blocks are this worker's to share, with the answer's.
        await self._stream(emit, request_id, index, admit, tokens, 0, lora, params.cache_salt,
                           first_at_once=not output_ids)
