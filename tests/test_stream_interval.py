"""``--stream-interval N``: a worker sends a stream's tokens N at a time, an answer's first token at once and its
last with whatever is held; the tokens are the same as one at a time."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from live_helpers import colocated_spec, run_keeping_torch_threads
from test_engine_loop import GREEDY, prompt, write_model

from engine.sampling_params import SamplingParams
from services.cli import build_parser
from services.config import configs_from_args
from services.worker import ColocatedWorker

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("stream-interval"))


def test_a_stream_leaves_its_worker_n_tokens_at_a_time_with_the_first_at_once_and_the_same_tokens(
        model_dir, ray_session):
    spec = colocated_spec(model_dir, stream_interval=4)
    params = SamplingParams(max_tokens=10, **GREEDY)

    async def events(worker: ColocatedWorker, request_id: str, output_ids: tuple[int, ...] = ()) -> list:
        return [e async for e in worker.generate(request_id, prompt(12, seed=5), params, output_ids=output_ids)]

    async def main() -> None:
        worker = ColocatedWorker(spec)  # in this process: the actor class without Ray's wrapper
        await worker.start()
        try:
            held = await events(worker, "held")
            assert [len(e.token_ids) for e in held] == [1, 4, 4, 1] and held[-1].finish_reason == "length"
            assert [e.finish_reason for e in held[:-1]] == [None] * 3
            worker.spec = dataclasses.replace(spec, stream_interval=1)
            each = await events(worker, "each")
            assert [len(e.token_ids) for e in each] == [1] * 10
            assert [t for e in held for t in e.token_ids] == [t for e in each for t in e.token_ids]
            assert "".join(e.text for e in held) == "".join(e.text for e in each)
            worker.spec = spec
            resumed = await events(worker, "resumed", output_ids=tuple(each[0].token_ids + each[1].token_ids))
            assert [len(e.token_ids) for e in resumed] == [4, 4]  # its first token is not the answer's first
            assert [t for e in resumed for t in e.token_ids] == [t for e in each[2:] for t in e.token_ids]
        finally:
            worker.loop.stop()

    run_keeping_torch_threads(main)


def test_the_stream_interval_reaches_the_cluster_config_and_zero_is_refused():
    parser = build_parser()
    cluster, _ = configs_from_args(parser.parse_args(["serve", "--stream-interval", "8"]))
    assert cluster.stream_interval == 8
    with pytest.raises(ValueError, match="--stream-interval must be at least 1, got 0"):
        configs_from_args(parser.parse_args(["serve", "--stream-interval", "0"]))
