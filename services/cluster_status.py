"""What ``GET /v1/cluster/status`` answers (and ``tidepool status`` shows): each worker's row, the pool's
Redis and the router, read from the dispatcher's latest load reports."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from router.loads import LoRAUsage
from services.dispatcher import Dispatcher

if TYPE_CHECKING:  # the autoscaler's module imports the workers' actor classes, and with them torch
    from services.autoscaler import Autoscaler


def worker_rows(dispatcher: Dispatcher) -> list[dict]:
    """One JSON row per worker. ``waiting`` counts what waits for the worker: prefills queued on it, and
    decode reservations waiting for free blocks (also apart, as ``waiting_leases``); the time ratios are its
    measured steps over what the router's shared models predict (``router.worker_speed``); ``report_age_s`` how
    old the router's view of it is (seconds since its latest load report was taken; None: none yet)."""
    out = []
    for worker in dispatcher.workers.values():
        load = dispatcher.loads.get(worker.worker_id)
        out.append({
            "id": worker.worker_id, "role": str(worker.role), "alive": bool(load and load.alive),
            "node": worker.info.node, "device": worker.info.device,
            "free_blocks": load.free_blocks if load else 0, "total_blocks": load.total_blocks if load else 0,
            "waiting": len(load.queued_prefills) + load.waiting_leases if load else 0,
            "waiting_leases": load.waiting_leases if load else 0, "running": load.num_running if load else 0,
            "draining": worker.worker_id in dispatcher.draining,
            # its measured steps over the router's shared models (router.worker_speed): 1 as modelled
            "prefill_time_ratio": dispatcher.conductor.prefill_speeds.factor(worker.worker_id),
            "decode_time_ratio": dispatcher.conductor.decode_speeds.factor(worker.worker_id),
            "report_age_s": dispatcher.report_age_s(worker.worker_id),
        })
    return out


def lora_summary(dispatcher: Dispatcher) -> dict | None:
    """The LoRA adapters loaded on every worker, the adapter slots a worker has (``--max-loras``) and the
    adapters of the requests running now; None when no worker has slots."""
    usage = LoRAUsage.of(dispatcher.loads.values())
    if not usage.slots and not dispatcher.loras:
        return None
    return {"adapters": sorted(dispatcher.loras), "slots": usage.slots, "running": list(usage.running)}


def drain_order(row: dict) -> tuple:
    """Sort key of the rows a drain takes first: the dead, then the least busy, then the newest (``decode-3``
    before ``decode-1``, a replacement ``decode-1.2`` before ``decode-1``)."""
    slot, _, incarnation = row["id"].rpartition("-")[2].partition(".")
    age = (-int(slot) if slot.isdigit() else 0), -int(incarnation or 0)
    return row["alive"], row["running"] + row["waiting"], age


def cluster_status(dispatcher: Dispatcher, autoscaler: Autoscaler | None = None) -> dict:
    """The workers, the pool's Redis (its password masked), the router and the autoscaler's plan, if one
    runs."""
    url = urlsplit(dispatcher.redis_url)
    shown = url._replace(netloc=f"***@{url.hostname}:{url.port}") if url.password else url
    index = dispatcher.index
    return {
        "model": dispatcher.served_model_names[0], "policy": dispatcher.conductor.policy_name,
        "kv_transport": dispatcher.kv_transport,
        "redis": {"url": urlunsplit(shown), "up": bool(index.pool.up), "indexed_blocks": index.indexed_blocks},
        "router": {"policy": dispatcher.conductor.policy_name, "rejections": dispatcher.rejections,
                   "resumed": dispatcher.resumed},
        "workers": worker_rows(dispatcher),
        **({"lora": lora} if (lora := lora_summary(dispatcher)) else {}),
        **({"autoscaler": autoscaler.status()} if autoscaler is not None else {}),
    }
