"""The Mooncake trace reader (router.trace) that the simulator and the load test share: every malformed
line is named with its line number before anything runs; valid rows come back in arrival order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from router.trace import TraceError, TraceRequest, load_trace


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad, message", [
    ('{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]', "not valid JSON"),
    ("{not json", "Expecting"),
    ('{"timestamp": 5, "input_length": 600, "hash_ids": [1, 2]}', "output_length"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1]}', "expected ceil(600/512) = 2"),
    ('{"timestamp": -1, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}', "timestamp"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, "x"]}', "hash_ids"),
    ('[1, 2, 3]', "JSON object"),
])
def test_malformed_trace_line_is_reported_with_its_line_number(tmp_path, bad, message):
    good = json.dumps({"timestamp": 0, "input_length": 512, "output_length": 3, "hash_ids": [1]})
    path = _write(tmp_path / "t.jsonl", [good, "", bad, good])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert info.value.line == 3
    assert str(info.value).startswith(f"{path}:3: ") and message in str(info.value)


@pytest.mark.timeout(30)
def test_every_malformed_line_is_reported_at_once(tmp_path):
    good = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]})
    path = _write(tmp_path / "bad.jsonl", [
        good,
        "{not json",
        json.dumps({"timestamp": 5, "input_length": 600, "hash_ids": [1, 2]}),  # no output_length
        good,
        json.dumps({"timestamp": 9, "input_length": 600, "output_length": 5, "hash_ids": [1]}),  # 1 id, needs 2
        json.dumps({"timestamp": -1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}),
    ])
    with pytest.raises(TraceError) as e:
        load_trace(path)
    msg = str(e.value)
    assert "4 malformed" in msg and e.value.line == 2
    for line, why in [(2, "Expecting"), (3, "output_length"), (5, "expected ceil(600/512) = 2"), (6, "timestamp")]:
        assert f"{path}:{line}: " in msg and why in msg
    assert f"{path}:1:" not in msg and f"{path}:4:" not in msg


@pytest.mark.timeout(30)
def test_rows_come_back_in_arrival_order_and_an_empty_trace_is_refused(tmp_path):
    rows = [{"timestamp": t, "input_length": 512, "output_length": 1, "hash_ids": [i]}
            for i, t in enumerate([2000, 0, 2000, 1000])]
    path = _write(tmp_path / "t.jsonl", [json.dumps(r) for r in rows])
    assert load_trace(path) == [TraceRequest(0.0, 512, 1, (1,)), TraceRequest(1.0, 512, 1, (3,)),
                                TraceRequest(2.0, 512, 1, (0,)), TraceRequest(2.0, 512, 1, (2,))]
    assert [r.hash_ids for r in load_trace(path, max_requests=2)] == [(1,), (3,)]
    with pytest.raises(TraceError, match="no requests"):
        load_trace(_write(tmp_path / "empty.jsonl", [""]))


# ----- benchmarks/make_traces.py: prefill-bound traces from a seed -----
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["docqa", "agent"])
def test_generated_traces_are_valid_deterministic_and_reuse_prefixes(tmp_path, kind):
    from benchmarks.make_traces import generate, main, reuse_share

    rows = generate(kind, seed=3, requests=400)
    assert rows == generate(kind, seed=3, requests=400) and rows != generate(kind, seed=4, requests=400)
    out = tmp_path / "t.jsonl"
    assert main(["--kind", kind, "--seed", "3", "--requests", "400", "--out", str(out)]) == 0
    trace = load_trace(out)  # every row passes the reader's checks
    assert len(trace) == 400 and [r.hash_ids for r in trace] == [tuple(r["hash_ids"]) for r in rows]
    assert np.all(np.diff([r["timestamp"] for r in rows]) >= 0)
    # prefill-bound: long prompts, short answers, most prompt blocks seen before in some prefix
    assert np.mean([r.input_length for r in trace]) > 20 * np.mean([r.output_length for r in trace])
    assert reuse_share(rows) > 0.6


@pytest.mark.timeout(60)
def test_docqa_popularity_is_skewed_and_bursts_bring_fresh_documents():
    from benchmarks.make_traces import KINDS, generate

    rows = generate("docqa", seed=0, requests=3000)
    docs = {}
    for r in rows:
        docs[r["hash_ids"][0]] = docs.get(r["hash_ids"][0], 0) + 1
    counts = sorted(docs.values(), reverse=True)
    assert counts[0] > 10 * np.median(counts)  # a few documents draw most questions (Zipf)
    t = np.array([r["timestamp"] for r in rows]) / 1000
    per_window = np.histogram(t, bins=np.arange(0, t[-1] + 10, 10))[0]
    assert per_window.max() > 2 * per_window.mean()  # bursts
    assert KINDS["docqa"].burst_factor > 1


@pytest.mark.timeout(60)
def test_agent_steps_extend_the_previous_steps_prompt():
    from benchmarks.make_traces import KINDS, generate

    rows = generate("agent", seed=1, requests=500)
    shared = KINDS["agent"].prefix_tokens[3] // 512  # longer than any shared system prompt
    contexts: set[tuple[int, ...]] = set()
    extended = 0
    for r in rows:
        ids = tuple(r["hash_ids"])
        extended += any(ids[:k] in contexts for k in range(shared + 1, len(ids)))
        contexts.add(ids)  # the session's next step starts with this whole prompt
    assert extended > len(rows) / 2  # most steps continue an earlier step of their session
