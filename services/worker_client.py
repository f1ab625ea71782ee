"""Typed calls to one worker actor, so the dispatcher reads without Ray.

``WorkerClient`` wraps a Ray actor handle: each method is one actor call with a deadline, and Ray's
failures become ours: ``WorkerDiedError`` when the actor is gone, ``WorkerFailedError`` when it did not
answer in time, and the worker's own exception (e.g. ``OutOfBlocksError``) when the call raised there.
Streams cancel the actor's generator and abort the request when the consumer stops early. Tests drive
the dispatcher with fakes that have the same methods.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from engine.sampling_params import SamplingParams
from router.loads import WorkerLoad
from services.errors import WorkerDiedError, WorkerFailedError
from services.messages import KVTarget, PrefillResult, Role, TokenEvent, WorkerInfo


class WorkerClient:
    def __init__(self, info: WorkerInfo, actor: ray.actor.ActorHandle) -> None:
        self.info = info
        self.actor = actor

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> Role:
        return self.info.role

    # ---- calls --------------------------------------------------------------------------------------------
    async def load(self, timeout_s: float) -> WorkerLoad:
        return await self._call(self.actor.load.remote(), timeout_s)

    async def reserve(self, request_id: str, num_tokens: int, lease_s: float, timeout_s: float) -> None:
        """Reserve decode-side blocks for ``num_tokens`` of prompt KV, held for ``lease_s``."""
        await self._call(self.actor.reserve.remote(request_id, num_tokens, lease_s), timeout_s)

    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams, kv_target: KVTarget,
                      fetch_from: str | None, deadline_s: float) -> PrefillResult:
        """Compute the prompt, sample its first token and push its KV into ``kv_target``'s lease."""
        ref = self.actor.prefill.remote(request_id, prompt_ids, params, kv_target, fetch_from, deadline_s)
        return await self._call(ref, deadline_s + 5.0)  # the worker enforces the deadline; this is the backstop

    async def release(self, request_id: str) -> None:
        """Free a decode lease that never joined the batch; a dead worker has nothing left to free."""
        with contextlib.suppress(WorkerDiedError, WorkerFailedError):
            await self._call(self.actor.release.remote(request_id), 10.0)

    async def abort(self, request_id: str) -> None:
        with contextlib.suppress(WorkerDiedError, WorkerFailedError):
            await self._call(self.actor.abort.remote(request_id), 10.0)

    # ---- streams ------------------------------------------------------------------------------------------
    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, index: int,
                 fetch_from: str | None) -> AsyncIterator[TokenEvent]:
        """A colocated worker computes the prompt and decodes it."""
        gen = self.actor.generate.remote(request_id, prompt_ids, params, index, fetch_from)
        return self._stream(gen, request_id)

    def decode(self, request_id: str, prompt_ids: list[int], first_token_id: int, params: SamplingParams,
               index: int, num_cached_tokens: int) -> AsyncIterator[TokenEvent]:
        """A decode worker continues from its filled lease and the first token the prefill side sampled."""
        gen = self.actor.generate.remote(request_id, prompt_ids, first_token_id, params, index, num_cached_tokens)
        return self._stream(gen, request_id)

    async def _stream(self, gen: Any, request_id: str) -> AsyncIterator[TokenEvent]:
        finished = False
        try:
            async for ref in gen:
                event: TokenEvent = await ref
                finished = event.finish_reason is not None
                yield event
        except RayActorError as exc:
            raise WorkerDiedError(self.worker_id, f"worker {self.worker_id} died mid-stream") from exc
        except RayTaskError as exc:
            raise exc.as_instanceof_cause() from None
        finally:
            if not finished:
                # The consumer went away (or the stream broke): stop the request and free its blocks.
                ray.cancel(gen)
                await self.abort(request_id)

    async def _call(self, ref: ray.ObjectRef, timeout_s: float) -> Any:
        try:
            return await asyncio.wait_for(ref, timeout=timeout_s)
        except RayActorError as exc:
            raise WorkerDiedError(self.worker_id, f"worker {self.worker_id} died") from exc
        except (TimeoutError, GetTimeoutError) as exc:
            ray.cancel(ref)
            raise WorkerFailedError(
                f"worker {self.worker_id} did not answer within {timeout_s:.0f}s") from exc
        except RayTaskError as exc:
            raise exc.as_instanceof_cause() from None
