"""Errors the serving path raises where the cause is known; only the gateway maps them to statuses.

Those with arguments of their own pickle them (``__reduce__``), as ``engine/errors.py``'s do: one raised in
a worker (a peer copy's dead holder, say) reaches its caller through Ray as itself."""

from __future__ import annotations


class RequestRejected(Exception):
    """The router predicts the SLOs can't be met (or no worker has room): try again later."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return type(self), (self.reason, self.retry_after_s)


class NoWorkersError(Exception):
    """No worker of a needed role is alive."""


class PlacementError(Exception):
    """The workers cannot be placed on this Ray cluster (the message says what is missing)."""


class UnknownAdapterError(LookupError):
    """A LoRA adapter name the cluster does not serve (raised in the gateway's process only)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no LoRA adapter {name!r} is loaded")


class UnknownWorkerError(LookupError):
    """A worker id the cluster does not hold (raised in the gateway's process only)."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"no worker {worker_id!r} in this cluster")


class ScalingConflictError(Exception):
    """Resizing the cluster so would leave it unable to serve, or does not fit how it was started."""


class PromptTooLongError(Exception):
    """The prompt (plus max_tokens) does not fit the model's context or the server's prompt limit."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(f"prompt has {prompt_tokens} tokens; the limit is {limit}")
        self.prompt_tokens = prompt_tokens
        self.limit = limit

    def __reduce__(self):
        return type(self), (self.prompt_tokens, self.limit)


class PrefillTimeoutError(Exception):
    """The prompt was not computed (queued, then run) within its deadline: the prefill workers are behind."""

    def __init__(self, deadline_s: float) -> None:
        super().__init__(f"the prompt was not computed within its deadline of {deadline_s:g}s")
        self.deadline_s = deadline_s

    def __reduce__(self):
        return type(self), (self.deadline_s,)


class ReservationReleased(Exception):
    """A decode reservation was released while it waited for blocks (its request failed or was cancelled)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"the reservation of {request_id!r} was released while it waited for KV blocks")
        self.request_id = request_id

    def __reduce__(self):
        return type(self), (self.request_id,)


class WorkerFailedError(Exception):
    """A worker died or a handoff step failed for this request (the request was not completed)."""


class WorkerLostError(WorkerFailedError):
    """A known worker stopped serving this request; the request may resume on another one."""

    def __init__(self, worker_id: str, message: str) -> None:
        super().__init__(message)
        self.worker_id = worker_id

    def __reduce__(self):
        return type(self), (self.worker_id, str(self))


class WorkerDiedError(WorkerLostError):
    """The worker's process is gone (its actor died); the router may pick another one."""


class WorkerStalledError(WorkerLostError):
    """A worker's stream sent nothing within its deadline: the worker may be hung."""
