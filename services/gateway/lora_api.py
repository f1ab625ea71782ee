"""vLLM's routes for LoRA adapters loaded and unloaded while serving (``services/lora_updates.py``), served only
with ``tidepool serve --allow-runtime-lora-updating`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), behind the
API key like every route. Their answers are vLLM's plain-text ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from services.gateway.json_body import StrictJSONRoute
from services.gateway.request_body import Body

if TYPE_CHECKING:  # the updates' module imports the engine's LoRA loader, and with it torch
    from services.lora_updates import LoRAUpdates


class LoadLoRAAdapterRequest(Body):
    lora_name: str
    lora_path: str  # a PEFT adapter directory, on every worker's node


class UnloadLoRAAdapterRequest(Body):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's own id of the adapter: names are unique here, so it is not needed


def lora_routes(updates: LoRAUpdates) -> APIRouter:
    router = APIRouter(route_class=StrictJSONRoute)

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        """Load the adapter on every worker; requests may name it once this answers."""
        body.check_extra("")
        await updates.load(body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        """Route nothing more to the adapter, let its running requests finish (up to a wait), then unload it."""
        body.check_extra("")
        await updates.unload(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return router
