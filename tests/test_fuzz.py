"""Hostile input (issue 14): hypothesis-generated HTTP bodies and gRPC requests against the live server
(never a 5xx, INTERNAL or UNKNOWN; healthy and every KV block back afterwards), and KV-transfer headers
(only ValueError/TransferError). The strategies live in benchmarks/fuzz_inputs.py, which
``benchmarks/chaos.py --fuzz-http/--fuzz-grpc`` runs at a larger scale."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from live_helpers import idle, wait_until

from benchmarks.fuzz_inputs import fuzz_grpc, fuzz_http
from kvstore.transfer import TransferError
from kvstore.transfer.wire import DTYPES, TransferHeader
from tidepool.v1 import kv_transfer_pb2


def _healthy_and_idle(server) -> None:
    assert httpx.get(server.http_url + "/health", timeout=10).status_code == 200
    assert wait_until(lambda: idle(server), 60), server.worker_stats()


@pytest.mark.timeout(120)
def test_generated_http_bodies_never_get_a_server_error(live_server):
    tally = fuzz_http(live_server.http_url, live_server.dispatcher.model_id, 200)
    assert tally.cases == 200
    assert tally.failed == 0, (tally.answers, tally.failures)
    assert tally.answers[200] > 0 and tally.answers[400] > 0, tally.answers  # both valid and refused ones
    _healthy_and_idle(live_server)


@pytest.mark.timeout(120)
def test_generated_grpc_requests_never_get_internal_or_unknown(live_server):
    tally = fuzz_grpc(live_server.grpc_target, live_server.dispatcher.model_id, 150)
    assert tally.cases == 150
    assert tally.failed == 0, (tally.answers, tally.failures)
    assert tally.answers["OK"] > 0 and tally.answers["INVALID_ARGUMENT"] > 0, tally.answers
    _healthy_and_idle(live_server)


headers = st.builds(
    kv_transfer_pb2.KVHeader, request_id=st.text(max_size=10), model=st.text(max_size=10),
    block_hashes=st.lists(st.integers(0, 2**64 - 1), max_size=4), num_layers=st.integers(0, 2**32 - 1),
    dtype=st.one_of(st.sampled_from(sorted(DTYPES)), st.text(max_size=10)),
    shape=st.lists(st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)), max_size=6),
    checksum=st.integers(0, 2**64 - 1), total_bytes=st.integers(0, 2**64 - 1), layerwise=st.booleans(),
    kv_format=st.text(max_size=8))


@settings(max_examples=500, deadline=None, database=None)
@given(headers)
def test_generated_kv_headers_are_accepted_or_refused_with_a_value_error(msg):
    try:
        header = TransferHeader.from_proto(msg)
    except (ValueError, TransferError):
        return
    # accepted: the fields agree with each other, as validate() promises
    assert header.request_id and header.num_layers == header.shape[0] >= 1
    assert header.total_bytes == header.layer_bytes * header.num_layers


@settings(max_examples=300, deadline=None, database=None)
@given(st.binary(max_size=120))
def test_kv_headers_parsed_from_raw_bytes_are_accepted_or_refused_with_a_value_error(data):
    from google.protobuf.message import DecodeError
    try:
        msg = kv_transfer_pb2.KVHeader.FromString(data)
    except DecodeError:  # not a protobuf message at all: the gRPC layer refuses it before the header code
        return
    with contextlib.suppress(ValueError, TransferError):
        TransferHeader.from_proto(msg)
