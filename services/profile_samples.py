"""What ``GET /v1/cluster/profile`` answers: everything the cluster measured that a cost profile is fitted
from (`router.profile.fit_profile` reads it; ``tidepool profile`` fetches it)."""

from __future__ import annotations

from services.dispatcher import Dispatcher


def profile_samples(dispatcher: Dispatcher) -> dict:
    """The workers' start-up profiles, their measured engine steps and KV transfers (the conductor keeps
    the latest of each), each worker's speed against the shared models, and the sizes a profile needs."""
    workers = list(dispatcher.workers.values())
    return {
        "model": dispatcher.model_id,
        "block_size": dispatcher.block_size,
        "kv_bytes_per_token": dispatcher.conductor.estimator.kv_bytes_per_token,
        "workers": [{"id": w.worker_id, "role": str(w.role), "device": w.info.device,
                     "total_blocks": w.info.total_blocks} for w in workers],
        "startup": {"prefill": [list(s) for w in workers for s in w.info.profile.prefill],
                    "decode": [list(s) for w in workers for s in w.info.profile.decode]},
        **dispatcher.conductor.measurements.to_dict(),
        # each measured worker's step times over the shared models' (router.worker_speed)
        "worker_speeds": {"prefill": dispatcher.conductor.prefill_speeds.to_dict(),
                          "decode": dispatcher.conductor.decode_speeds.to_dict()},
    }
