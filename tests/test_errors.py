"""Errors that cross a process boundary: a worker raises them and Ray pickles them to the dispatcher, so
each must come back as itself, with its fields, or the gateway cannot map it to its status."""

from __future__ import annotations

import pickle

import grpc
import pytest

from engine.config import UnsupportedModelError
from engine.errors import InvalidRequestError, OutOfBlocksError
from services.errors import (
    PrefillTimeoutError,
    PromptTooLongError,
    RequestRejected,
    WorkerDiedError,
    WorkerLostError,
    WorkerStalledError,
)
from services.gateway.errors import classify

pytestmark = pytest.mark.timeout(30)

RAISED_IN_WORKERS = [
    (InvalidRequestError("max_tokens", "must be a positive integer"), ("field", "message")),
    (OutOfBlocksError(217, 197), ("needed", "free")),
    (OutOfBlocksError(217, 230, 14), ("needed", "free", "kept")),
    (UnsupportedModelError("architectures", "['GPT2LMHeadModel'] is not supported"), ("field", "message")),
    (RequestRejected("ttft", 2.5), ("reason", "retry_after_s")),
    (PromptTooLongError(5000, 4096), ("prompt_tokens", "limit")),
    (PrefillTimeoutError(120.0), ("deadline_s",)),
    (WorkerLostError("decode-1", "worker decode-1 stopped"), ("worker_id",)),
    (WorkerDiedError("prefill-0", "worker prefill-0 died"), ("worker_id",)),
    (WorkerStalledError("decode-0", "worker decode-0 sent nothing for 60s"), ("worker_id",)),
]


@pytest.mark.parametrize(("error", "fields"), RAISED_IN_WORKERS, ids=lambda v: type(v).__name__)
def test_an_error_survives_pickling_with_its_type_message_and_fields(error, fields):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert all(getattr(copy, name) == getattr(error, name) for name in fields)


def test_a_decode_worker_out_of_blocks_is_a_429_with_a_retry_after():
    err = classify(pickle.loads(pickle.dumps(OutOfBlocksError(217, 197))))
    assert (err.http_status, err.grpc_code) == (429, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "need 217 KV blocks, 197 free" in err.message and err.retry_after_header() == "1"


def test_a_prompt_not_computed_in_time_is_a_504_that_says_so():
    err = classify(pickle.loads(pickle.dumps(PrefillTimeoutError(120.0))))
    assert (err.http_status, err.grpc_code) == (504, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert err.message == "the prompt was not computed within its deadline of 120s"
    assert err.retry_after_header() == "1"
