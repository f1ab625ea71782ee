"""Workloads: shared Mooncake hash ids give identical prompt prefixes, reproducibly for a seed; random and
chat workloads and arrival schedules behave as documented (the trace reader itself: test_trace.py)."""

from __future__ import annotations

import json

import pytest

from loadtest.arrivals import synthetic_arrivals, trace_arrivals
from loadtest.workloads import chat_sessions, mooncake_requests, random_requests
from router.trace import TraceRequest, load_trace

SCALE = 16 / 512  # 16-token blocks, Tidepool's KV block size


def _rows():
    return [
        TraceRequest(0.0, 2048, 320, (1, 2, 3, 4)),
        TraceRequest(0.01, 1800, 64, (1, 2, 5, 6)),  # shares blocks 1, 2 with the first row
        TraceRequest(0.02, 1000, 32, (7, 8)),
        TraceRequest(0.03, 1100, 32, (1, 2, 9)),  # 1100 tokens -> last block partial
    ]


@pytest.mark.timeout(30)
def test_shared_hash_ids_give_identical_prompt_prefixes():
    a, b, c, d = mooncake_requests(_rows(), seed=3, length_scale=SCALE)
    assert a.prompt[:32] == b.prompt[:32] == d.prompt[:32]  # blocks 1, 2 = 2 x 16 characters
    assert a.prompt[32:48] != b.prompt[32:48]  # block 3 vs block 5
    assert a.prompt[:16] != c.prompt[:16]
    assert (len(a.prompt), a.prompt_len) == (64, 64)
    # 1800 * SCALE = 56.25 -> 56 tokens: the fourth block is partial and is a prefix of that id's text
    assert len(b.prompt) == 56


@pytest.mark.timeout(30)
def test_partial_last_block_is_a_prefix_of_the_full_block():
    rows = [TraceRequest(0.0, 1024, 1, (1, 2)), TraceRequest(0.001, 1000, 1, (1, 2))]
    full, partial = mooncake_requests(rows, length_scale=SCALE)
    assert len(partial.prompt) == 31 and full.prompt.startswith(partial.prompt)


@pytest.mark.timeout(30)
def test_mooncake_prompts_are_reproducible_for_a_seed():
    first = [s.prompt for s in mooncake_requests(_rows(), seed=3, length_scale=SCALE)]
    again = [s.prompt for s in mooncake_requests(_rows(), seed=3, length_scale=SCALE)]
    other = [s.prompt for s in mooncake_requests(_rows(), seed=4, length_scale=SCALE)]
    assert first == again and first != other


@pytest.mark.timeout(30)
def test_mooncake_scales_lengths_and_characters_per_token():
    specs = mooncake_requests(_rows(), length_scale=SCALE, chars_per_token=4.0)
    assert len(specs[0].prompt) == 64 * 4 and specs[0].prompt_len == 64
    assert specs[0].prompt[:128] == specs[1].prompt[:128]
    assert [s.max_tokens for s in specs] == [10, 2, 1, 1]  # output_length scaled, at least 1
    unscaled = mooncake_requests(_rows()[:1])
    assert len(unscaled[0].prompt) == 2048 and unscaled[0].prompt.isascii()


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(30)
def test_valid_trace_is_read_in_full(tmp_path):
    rows = [{"timestamp": 1000 * i, "input_length": 700, "output_length": 5, "hash_ids": [0, i]} for i in range(3)]
    path = _write(tmp_path / "t.jsonl", [json.dumps(r) for r in rows])
    read = load_trace(path)
    assert [r.hash_ids for r in read] == [(0, 0), (0, 1), (0, 2)]
    assert trace_arrivals(read, time_scale=0.5) == [0.0, 0.5, 1.0]


@pytest.mark.timeout(30)
def test_random_workload_lengths_prefix_and_seed():
    specs = random_requests(50, input_len=100, output_len=20, range_ratio=0.5, prefix_len=30, seed=1)
    prefix = specs[0].prompt[:30]
    assert all(s.prompt.startswith(prefix) for s in specs)
    assert all(80 <= s.prompt_len <= 180 and len(s.prompt) == s.prompt_len for s in specs)
    assert all(10 <= s.max_tokens <= 30 for s in specs)
    assert len({s.prompt_len for s in specs}) > 1
    same = random_requests(50, input_len=100, output_len=20, range_ratio=0.5, prefix_len=30, seed=1)
    assert [s.prompt for s in same] == [s.prompt for s in specs]
    fixed = random_requests(5, input_len=64, output_len=8, seed=1)
    assert {(s.prompt_len, s.max_tokens) for s in fixed} == {(64, 8)}
    with pytest.raises(ValueError):
        random_requests(1, input_len=8, output_len=8, range_ratio=1.0)


@pytest.mark.timeout(30)
def test_chat_session_sends_new_message_and_no_session_sends_history():
    (with_id,) = chat_sessions(1, 3, input_len=20, output_len=5, prefix_len=10, seed=2, id_prefix="r-")
    (full,) = chat_sessions(1, 3, input_len=20, output_len=5, prefix_len=10, seed=2, use_session=False)
    first = with_id.request(0)
    assert first.session_id == "r-u0" and [m["role"] for m in first.messages] == ["system", "user"]
    with_id.add_reply("answer one")
    second = with_id.request(1)
    assert [m["role"] for m in second.messages] == ["user"] and second.request_id == "r-u0-t1"
    assert second.prompt_len == 10 + 20 + len("answer one") + 20

    full.request(0)
    full.add_reply("answer one")
    resent = full.request(1)
    assert resent.session_id is None
    assert [m["role"] for m in resent.messages] == ["system", "user", "assistant", "user"]
    assert resent.messages[2]["content"] == "answer one"
    assert resent.messages[-1]["content"] == second.messages[0]["content"]  # same seed, same words


@pytest.mark.timeout(30)
def test_synthetic_arrivals_follow_rate_and_seed():
    assert synthetic_arrivals(4, float("inf")) == [0.0] * 4
    times = synthetic_arrivals(100, rate=10.0, burstiness=1.0, seed=5)
    assert times == sorted(times) and times[-1] == pytest.approx(10.0)
    assert times == synthetic_arrivals(100, rate=10.0, burstiness=1.0, seed=5)
    assert times != synthetic_arrivals(100, rate=10.0, burstiness=1.0, seed=6)
    even = synthetic_arrivals(4, rate=2.0, burstiness=float("inf"))
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError):
        synthetic_arrivals(3, rate=1.0, burstiness=0)
