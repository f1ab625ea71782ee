"""``--stream-interval N``: a worker sends a stream's tokens N at a time, an answer's first token at once and its
last with whatever is held; the tokens are the same as one at a time. On a colocated worker in the test's
process, and through a disaggregated server as a client streams a chat."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
from live_helpers import (
    colocated_spec,
    greedy,
    openai_client,
    request_events,
    run_keeping_torch_threads,
    user_message,
)
from test_engine_loop import GREEDY, prompt, write_model

from engine.sampling_params import SamplingParams
from services.cli import build_parser
from services.config import configs_from_args
from services.messages import TokenEvent
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
        return [e async for e in request_events(worker, request_id, prompt(12, seed=5), params, 0, None, output_ids)]

    async def main() -> None:
        worker = ColocatedWorker(spec)  # in this process: the actor class without Ray's wrapper
        await worker.start()
        first_seen, step, steps = threading.Event(), worker.engine.step, []

        def second_step_waits(*args, **kwargs):  # until the test has the first event: nothing else piles up
            steps.append(None)
            if len(steps) == 2:
                first_seen.wait(10)
            return step(*args, **kwargs)

        try:
            worker.engine.step = second_step_waits
            stream = request_events(worker, "held", prompt(12, seed=5), params)
            first = await anext(stream)
            first_seen.set()
            held = [first] + [e async for e in stream]
            worker.engine.step = step
            assert len(first.token_ids) == 1  # left alone, at once
            assert all(n % 4 == 0 for n in sizes(held[1:-1])) and held[-1].finish_reason == "length"
            worker.spec = dataclasses.replace(spec, stream_interval=1)
            each = await events(worker, "each")
            assert tokens(held) == tokens(each) and len(tokens(each)) == 10 and len(held) < len(tokens(each))
            assert "".join(e.text for e in held) == "".join(e.text for e in each)
            worker.spec = spec
            resumed = await events(worker, "resumed", output_ids=tuple(tokens(each)[:2]))
            assert sizes(resumed) in ([4, 4], [8])  # its first token is not the answer's first: held too
            assert tokens(resumed) == tokens(each)[2:]
        finally:
            worker.loop.stop()

    run_keeping_torch_threads(main)


def sizes(events: list[TokenEvent]) -> list[int]:
    return [len(e.token_ids) for e in events]


def tokens(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_the_stream_interval_reaches_the_cluster_config_and_zero_is_refused():
    parser = build_parser()
    cluster, _ = configs_from_args(parser.parse_args(["serve", "--stream-interval", "8"]))
    assert cluster.stream_interval == 8
    with pytest.raises(ValueError, match="--stream-interval must be at least 1, got 0"):
        configs_from_args(parser.parse_args(["serve", "--stream-interval", "0"]))


@pytest.fixture(scope="module")
def interval_server(start_server):
    """One prefill and one decode worker sending tokens 4 at a time."""
    server = start_server(prefill=1, decode=1, stream_interval=4)
    yield server
    server.stop()


def test_a_disaggregated_chat_streams_the_prefill_token_at_once_then_the_decode_tokens_4_at_a_time(interval_server):
    client = openai_client(interval_server)
    kwargs = dict(model=interval_server.model_id, messages=user_message("Tell me about tides."), logprobs=True,
                  **greedy(10))
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices and c.choices[0].logprobs]
    sizes = [len(c.choices[0].logprobs.content) for c in chunks]
    # The first token is the prefill worker's; the decode worker's leave 4 at a time, its last with what is held
    # (a chunk with more in it: a slow reader's joined, still whole fours but for the last).
    assert sizes[0] == 1 and sum(sizes) == 10 and all(n % 4 == 0 for n in sizes[1:-1]) and len(sizes) < 10
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert [t.token for c in chunks for t in c.choices[0].logprobs.content] == [t.token for t in whole.logprobs.content]
