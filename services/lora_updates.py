"""LoRA adapters loaded into and unloaded from a serving cluster (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, behind ``tidepool serve --allow-runtime-lora-updating``).

A load goes into the cluster's engine config first, so a worker started meanwhile (a replacement, or one
added by the autoscaler) loads the adapter as it starts, then into every running worker (a worker that has it
already answers at once); only when all have it do requests naming it get routed. A worker that cannot load
it fails the whole load: the others unload it again, and the client is told why. An unload stops routing the
name first, then lets each worker finish the adapter's requests (up to a wait) before taking it off the
layers; requests still running then are aborted. Updates run one at a time.
"""

from __future__ import annotations

import asyncio
import logging

from engine.config import EngineConfig
from engine.errors import LoRAAdapterError
from engine.lora import check_adapters
from services.dispatcher import Dispatcher
from services.errors import UnknownAdapterError

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0  # one worker's load of an adapter (read from its disk, copied to its device)
UNLOAD_WAIT_S = 30.0  # how long an unloaded adapter's running requests get to finish


class LoRAUpdates:
    def __init__(self, dispatcher: Dispatcher, engine: EngineConfig) -> None:
        """``engine``: the config every worker starts from (``lora_modules`` is kept current here)."""
        self.dispatcher, self.engine = dispatcher, engine
        self._lock = asyncio.Lock()

    async def load(self, name: str, path: str) -> str:
        """Load the adapter at ``path`` (a directory every worker's node has) as ``name`` on every worker; its
        adapter id. LoRAAdapterError when the name is taken or a worker cannot load it."""
        async with self._lock:
            if name in self.dispatcher.loras:
                raise LoRAAdapterError(f"LoRA adapter {name!r} is already loaded: unload it first")
            if name in self.dispatcher.served_model_names:
                raise LoRAAdapterError(f"{name!r} is the base model's name: give the adapter another")
            check_adapters({name: path}, self.dispatcher.model_id)  # a bad directory fails here, before any worker
            self.engine.lora_modules[name] = path
            workers = list(self.dispatcher.workers.values())
            results = await asyncio.gather(*(w.load_lora(name, path, LOAD_TIMEOUT_S) for w in workers),
                                           return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed or len(set(results)) > 1:
                del self.engine.lora_modules[name]
                await asyncio.gather(*(w.unload_lora(name, 0.0) for w in workers), return_exceptions=True)
                if failed:
                    raise failed[0]
                raise LoRAAdapterError(f"LoRA adapter {name!r}: the workers read different files at {path}")
            self.dispatcher.loras[name] = results[0]
            log.warning("LoRA adapter %s loaded from %s", name, path)
            return self.dispatcher.loras[name]

    async def unload(self, name: str, wait_s: float = UNLOAD_WAIT_S) -> int:
        """Stop routing requests to adapter ``name``, let its running ones finish (up to ``wait_s``), then unload
        it from every worker; returns the requests aborted at the end of the wait."""
        async with self._lock:
            if name not in self.dispatcher.loras:
                raise UnknownAdapterError(name)
            del self.dispatcher.loras[name]
            self.engine.lora_modules.pop(name, None)
            workers = list(self.dispatcher.workers.values())
            aborted = await asyncio.gather(*(w.unload_lora(name, wait_s) for w in workers))
            log.warning("LoRA adapter %s unloaded (%d requests aborted)", name, sum(aborted))
            return sum(aborted)
