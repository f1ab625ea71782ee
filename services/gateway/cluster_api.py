"""The cluster's own HTTP routes (behind the API key): its status and measured profile, and resizing it while
it serves (``services/scaling.py``): ``POST /v1/cluster/workers`` adds a worker of a role,
``DELETE /v1/cluster/workers/{id}`` drains one and stops it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from services.cluster_status import cluster_status, worker_rows
from services.dispatcher import Dispatcher
from services.errors import ScalingConflictError
from services.gateway.json_body import StrictJSONRoute
from services.gateway.request_body import Body
from services.messages import Role
from services.profile_samples import profile_samples

if TYPE_CHECKING:  # the scaler's module imports the workers' actor classes, and with them torch
    from services.autoscaler import Autoscaler
    from services.scaling import Scaler

DRAIN_TIMEOUT_S = 60.0


class AddWorkerRequest(Body):
    role: Literal["prefill", "decode", "colocated"]


def cluster_routes(dispatcher: Dispatcher, scaler: Scaler | None,
                   autoscaler: Autoscaler | None = None) -> APIRouter:
    """``scaler``: None for a cluster that cannot be resized here (its workers were not started by it);
    ``autoscaler``: the one resizing it, if any (its plan is part of the status)."""
    router = APIRouter(route_class=StrictJSONRoute)  # NaN, Infinity and lone surrogates refused, as elsewhere

    @router.get("/v1/cluster/status")
    async def get_cluster_status() -> dict:
        return cluster_status(dispatcher, autoscaler)

    @router.get("/v1/cluster/profile")
    async def cluster_profile() -> dict:
        return profile_samples(dispatcher)

    @router.post("/v1/cluster/workers", status_code=201)
    async def add_worker(body: AddWorkerRequest) -> JSONResponse:
        """Start a worker of ``role``; answers once it serves, with its status row."""
        body.check_extra("")
        worker = await _scaler().add(Role(body.role))
        (row,) = [r for r in worker_rows(dispatcher) if r["id"] == worker.worker_id]
        return JSONResponse(row, status_code=201)

    @router.delete("/v1/cluster/workers/{worker_id}")
    async def drain_worker(worker_id: str, timeout_s: float = Query(DRAIN_TIMEOUT_S, ge=0, le=3600)) -> dict:
        """Route nothing more to the worker, give what runs on it ``timeout_s`` to finish (the rest resumes
        elsewhere), then stop it."""
        drained = await _scaler().drain(worker_id, timeout_s)
        return {"id": drained.worker_id, "object": "cluster.worker", "role": drained.role, "drained": True,
                "waited_s": round(drained.waited_s, 3), "resumed": drained.resumed}

    def _scaler() -> Scaler:
        if scaler is None:
            raise ScalingConflictError("this gateway cannot resize its cluster")
        return scaler

    return router
