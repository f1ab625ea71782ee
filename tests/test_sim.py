"""The trace-driven simulator: accounts for every request, is deterministic for a seed, times decode
correctly without per-token events, refuses malformed traces before running, and grows and shrinks the
cluster as the live autoscaler would (the rule both share)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from router.autoscale_rules import AutoscaleConfig, ScaleRule
from router.policies import POLICIES
from router.profile import llama3_70b_a800
from router.sim_cli import add_simulate_parser, simulate, sweep
from router.sim_report import summarize
from router.simulator import SimConfig, Simulation
from router.trace import load_trace

REAL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


def write_trace(path: Path, n: int = 200, gap_ms: int = 150, seed: int = 0) -> Path:
    """Synthetic conversations: each turn extends the previous turn's prefix by a few blocks."""
    import random

    rng = random.Random(seed)
    lines, convs, next_id = [], [], 0
    for i in range(n):
        if not convs or rng.random() < 0.4:
            convs.append([])
        conv = rng.choice(convs)
        for _ in range(rng.randint(2, 12)):
            conv.append(next_id)
            next_id += 1
        ids = list(conv)
        length = len(ids) * 512 - rng.randint(0, 511)
        lines.append(json.dumps({"timestamp": i * gap_ms, "input_length": length,
                                 "output_length": rng.randint(1, 400), "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def trace(tmp_path):
    return load_trace(write_trace(tmp_path / "t.jsonl"))


def small_profile():
    prof = llama3_70b_a800()
    prof.prefill_cache_tokens = 40 * 512  # small caches: LRU eviction happens in a 200-request run
    return prof


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_request_is_served_or_rejected(trace, policy):
    cfg = SimConfig(prefill=3, decode=2, policy=policy, speed=4.0)
    res = simulate(trace, small_profile(), cfg)
    assert res["arrived"] == len(trace)
    assert res["served"] + res["rejected"] == res["arrived"]
    assert sum(res["rejected_by_reason"].values()) == res["rejected"]
    assert 0 <= res["slo_attainment"] <= 1 and 0 <= res["cache_hit_rate"] < 1


@pytest.mark.timeout(120)
def test_a_mixed_fleet_is_served_better_when_the_router_learns_each_workers_speed(trace):
    """Every other prefill worker computes 4x slower than the profile says: the router that prices each
    worker by its measured steps (router/worker_speed.py) keeps the slow ones' queues short, the one
    pricing them all by the shared model piles prompts on them; equal workers' factors stay near 1."""
    mixed = SimConfig(prefill=4, decode=2, policy="tidepool", speed=0.25, prefill_slowdown=(1, 4))
    learned = simulate(trace, small_profile(), mixed)
    blind = simulate(trace, small_profile(), replace(mixed, learn_worker_speeds=False))
    assert blind["policy"] == "tidepool[worker_speeds=off]"
    assert learned["slo_attainment"] > blind["slo_attainment"] + 0.2
    assert learned["ttft_s"]["mean"] < blind["ttft_s"]["mean"] / 2
    sim = Simulation(trace, small_profile(), replace(mixed, prefill_slowdown=()))
    sim.run()
    assert all(0.8 < f < 1.25 for f in sim.conductor.prefill_speeds.to_dict().values())
    # decode workers alike but for their speed: the router measures one three times slower than the other
    sim = Simulation(trace, small_profile(), replace(mixed, prefill_slowdown=(), decode_slowdown=(1, 3)))
    sim.run()
    speeds = sim.conductor.decode_speeds
    assert speeds.factor("d1") / speeds.factor("d0") == pytest.approx(3.0, rel=0.05)


@pytest.mark.timeout(120)
def test_overload_makes_the_early_rejecting_policies_reject(trace):
    res = simulate(trace, small_profile(), SimConfig(prefill=1, decode=1, policy="tidepool", speed=20.0))
    assert res["rejected"] > 0 and res["served"] + res["rejected"] == res["arrived"]


@pytest.mark.timeout(120)
def test_same_seed_same_result_and_the_seed_matters(trace):
    cfg = SimConfig(prefill=3, decode=2, policy="tidepool", speed=4.0, seed=7)
    assert simulate(trace, small_profile(), cfg) == simulate(trace, small_profile(), cfg)
    other = simulate(trace, small_profile(), SimConfig(prefill=3, decode=2, policy="tidepool", speed=4.0, seed=8))
    assert other["ttft_s"] != simulate(trace, small_profile(), cfg)["ttft_s"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("slowdown", [1.0, 2.5])
def test_a_lone_request_decodes_at_the_models_step_times(tmp_path, slowdown):
    """On a decode worker of ``--decode-slowdown`` 2.5, each step takes 2.5 times the profile's."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 4096, "output_length": 21,
                                "hash_ids": list(range(8))}) + "\n")
    prof = llama3_70b_a800()
    sim = Simulation(load_trace(path), prof, SimConfig(prefill=1, decode=1, policy="tidepool", noise=0.0,
                                                       decode_slowdown=(slowdown,)))
    (r,) = sim.run()
    # The first token waits for the prefill and for the part of the layer-wise KV hand-off that does not
    # overlap it: with a link faster than the compute, one layer's share plus the link's latency.
    prefill = prof.prefill.predict(4096, 0)
    layer = 4096 * prof.kv_bytes_per_token / prof.peer_link.bandwidth_Bps / prof.layers
    assert r.ttft == pytest.approx(prefill + prof.peer_link.latency_s + layer)
    # 20 decode steps of a batch of one whose context grows by one token a step, the first starting as the
    # KV lands (with the first token): the slowest 10% of the 20 gaps are the last two steps.
    steps = [prof.decode.predict(1, 4097 + i) * slowdown for i in range(20)]
    assert r.tbt == pytest.approx((steps[-2] + steps[-1]) / 2, rel=1e-9)


@pytest.mark.timeout(60)
def test_batched_decode_slows_every_member(tmp_path):
    path = tmp_path / "two.jsonl"
    rows = [{"timestamp": 0, "input_length": 2048, "output_length": 200, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 0, "input_length": 2048, "output_length": 200, "hash_ids": [5, 6, 7, 8]}]
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    prof = llama3_70b_a800()
    alone = Simulation(load_trace(path, max_requests=1), prof, SimConfig(1, 1, "tidepool", noise=0.0)).run()[0]
    pair = Simulation(load_trace(path), prof, SimConfig(1, 1, "tidepool", noise=0.0)).run()
    assert all(r.tbt > alone.tbt for r in pair)
    assert pair[1].ttft > pair[0].ttft  # one prefill worker: the second waits for the first


@pytest.mark.timeout(120)
def test_sweep_brackets_the_rate_where_90_percent_meet_the_slos(trace):
    res = sweep(trace, small_profile(), SimConfig(prefill=2, decode=2, policy="tidepool"), iterations=3)
    rate = res["max_rate_at_90pct_slo"]
    assert rate is not None and rate > 0
    passing = [r for r in res["runs"] if r["slo_attainment"] >= 0.9]
    failing = [r for r in res["runs"] if r["slo_attainment"] < 0.9]
    assert failing and max(r["request_rate"] for r in passing) == rate
    assert min(r["request_rate"] for r in failing) > rate


def _bad_trace(tmp_path) -> Path:
    """Line 2 is malformed (the reader's own checks: test_trace.py)."""
    good = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]})
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([good, "{not json", good]) + "\n")
    return path


@pytest.mark.timeout(30)
def test_simulate_command_stops_before_running_on_a_bad_trace(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    out = tmp_path / "r.json"
    args = parser.parse_args(["simulate", "--trace", str(_bad_trace(tmp_path)), "--preset", "llama3-70b-a800",
                              "--json", str(out)])
    assert args.func(args) == 2
    captured = capsys.readouterr()
    assert "bad.jsonl:2:" in captured.err and "policy" not in captured.out and not out.exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("option", "named"), [
    (["--prefill", "0"], "prefill must be positive"), (["--decode", "-1"], "decode must be positive"),
    (["--speed", "0"], "speed must be positive"), (["--ttft-slo-s", "0"], "ttft_slo_s must be positive"),
    (["--tbt-slo-ms", "nan"], "tbt_slo_s must be positive"), (["--noise", "-1"], "noise must be at least 0"),
    (["--max-requests", "0"], "max_requests must be at least 1"),
    (["--prefill-slowdown", "1,0"], "--prefill-slowdown factors must be positive"),
    (["--decode-slowdown", "-1"], "--decode-slowdown factors must be positive"),
])
def test_simulate_command_refuses_a_setting_that_describes_no_cluster(tmp_path, capsys, option, named):
    """Each of these ran into a ZeroDivisionError or an empty min(), or simulated a cluster that rejected
    every request; now the command names the setting and runs nothing."""
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--trace", str(write_trace(tmp_path / "t.jsonl", n=8)),
                              "--preset", "llama3-70b-a800", *option])
    assert args.func(args) == 2
    captured = capsys.readouterr()
    assert named in captured.err and "policy" not in captured.out


@pytest.mark.timeout(120)
def test_simulate_command_compares_all_policies_and_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    out = tmp_path / "r.json"
    args = parser.parse_args(["simulate", "--trace", str(write_trace(tmp_path / "t.jsonl", n=80)),
                              "--prefill", "2", "--decode", "2", "--policy", "all", "--preset", "llama3-70b-a800",
                              "--speed", "2", "--tbt-slo-ms", "80", "--json", str(out)])
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data["results"]] == list(POLICIES)
    assert data["config"]["tbt_slo_ms"] == 80 and data["profile"]["name"] == "llama3-70b-a800"
    printed = capsys.readouterr().out
    assert all(name in printed for name in POLICIES)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not REAL_TRACE.exists(), reason="the shared Mooncake trace is not checked out")
def test_a_slice_of_the_conversation_trace_replays():
    reqs = load_trace(REAL_TRACE, max_requests=300)
    res = simulate(reqs, llama3_70b_a800(), SimConfig(prefill=4, decode=4, policy="tidepool"))
    assert res["served"] + res["rejected"] == 300 and not math.isnan(res["ttft_s"]["mean"])
    assert res["cache_hit_rate"] > 0.05  # the trace's requests share prefixes


@pytest.mark.timeout(30)
def test_prefix_index_matches_each_holder_up_to_its_first_missing_block():
    from router.prefix_cache import BlockCache, PrefixIndex

    idx = PrefixIndex()
    idx.add("a", [1, 2, 3, 4])
    idx.add("b", [1, 2])
    idx.add("c", [2, 3])  # no first block: matches nothing
    assert idx.longest_prefix([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert idx.longest_prefix([9, 1]) == {} and idx.longest_prefix([]) == {}
    idx.remove("a", [3])
    assert idx.longest_prefix([1, 2, 3, 4]) == {"a": 2, "b": 2}

    cache = BlockCache("w", capacity_blocks=4, index=idx)
    cache.insert([10, 11, 12])
    cache.insert([20, 21])  # over capacity: the least recently used block goes, children before parents
    assert len(cache) == 4 and idx.longest_prefix([10, 11, 12]) == {"w": 2}
    cache.touch([10, 11])
    cache.insert([30])
    assert idx.longest_prefix([10, 11]) == {"w": 2} and idx.longest_prefix([20, 21]) == {"w": 1}


def _rows(path: Path, rows: list[dict]) -> list:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_trace(path)


@pytest.mark.timeout(60)
def test_requests_sharing_a_prefix_still_being_computed_reuse_it(tmp_path):
    """Three unrelated prompts take three workers; then eight share a fresh 31-block prefix. The first
    computes it on the idle worker; the others queue behind it there or copy it to another worker once it
    is computed (the simulated copy waits for the prefill that produces it)."""
    unrelated = [{"timestamp": 0, "input_length": 32 * 512, "output_length": 5,
                  "hash_ids": list(range(1000 * k, 1000 * k + 32))} for k in range(1, 4)]
    siblings = [{"timestamp": 10 + 10 * i, "input_length": 32 * 512, "output_length": 5,
                 "hash_ids": list(range(31)) + [500 + i]} for i in range(8)]
    trace = _rows(tmp_path / "burst.jsonl", unrelated + siblings)
    runs = {}
    for inflight in (True, False):
        sim = Simulation(trace, llama3_70b_a800(), SimConfig(prefill=4, decode=1, policy="tidepool", noise=0.0,
                                                             policy_options={"inflight": inflight}))
        runs[inflight] = (sim.run(), sim.fetched_tokens)
    reqs, fetched = runs[True]
    first, *rest = reqs[3:]
    assert first.cached == 0 and all(r.cached == 31 * 512 for r in rest)
    assert fetched > 0  # some copied it from the worker that computed it
    assert all(r.first_t > first.first_t for r in rest)  # nobody had the prefix before it was computed
    blind, _ = runs[False]
    assert sum(r.cached for r in blind[3:]) < sum(r.cached for r in rest)
    assert np.mean([r.ttft for r in blind]) > np.mean([r.ttft for r in reqs])


@pytest.mark.timeout(60)
def test_hot_prefix_replication_copies_the_prefix_to_an_idle_worker(tmp_path):
    """A prefix asked for every 40 ms over a slow peer link (copying it takes longer than recomputing):
    once its holder has a queue, the policy copies it to an idle worker, which then holds it."""
    from router.estimator import Link

    trace = _rows(tmp_path / "hot.jsonl", [{"timestamp": 40 * i, "input_length": 32 * 512, "output_length": 5,
                                            "hash_ids": list(range(31)) + [500 + i]} for i in range(150)])
    prof = llama3_70b_a800()
    prof.peer_link = Link(1.5e9, 0.001)
    holders = {}
    for replicate in (False, True):
        sim = Simulation(trace, prof, SimConfig(prefill=4, decode=1, policy="tidepool", noise=0.0,
                                                policy_options={"replicate": replicate}))
        res = summarize(sim.run(), sim.cfg, sim.fetched_tokens, sim.replicated_tokens)
        holders[replicate] = (set(sim.index.longest_prefix(list(range(31)))), res["replicated_token_share"])
    assert holders[False][1] == 0 and holders[True][1] > 0
    assert holders[True][0] > holders[False][0]  # the copy's destination holds the prefix too


# ---- the autoscaler in the simulator (router/sim_autoscaler.py) ----------------------------------------------

def step_trace(path: Path) -> Path:
    """20 s of one request every 2 s, 30 s of one every 100 ms, then 60 s of one every 2 s."""
    times = [*range(0, 20_000, 2000), *range(20_000, 50_000, 100), *range(50_000, 110_000, 2000)]
    lines = [json.dumps({"timestamp": t, "input_length": 3000, "output_length": 200,
                         "hash_ids": list(range(10 * i, 10 * i + 6))}) for i, t in enumerate(times)]
    path.write_text("\n".join(lines) + "\n")
    return path


AUTOSCALE = AutoscaleConfig(bounds={"prefill": (1, 6), "decode": (1, 4)}, window_s=5.0, scale_down_delay_s=10.0)


@pytest.mark.timeout(60)
def test_the_simulated_autoscaler_grows_the_cluster_for_a_burst_and_shrinks_it_after(tmp_path):
    trace = load_trace(step_trace(tmp_path / "step.jsonl"))
    cfg = SimConfig(prefill=1, decode=1, policy="tidepool", autoscale=AUTOSCALE, worker_start_s=5.0)
    res = simulate(trace, llama3_70b_a800(), cfg)
    assert res["served"] + res["rejected"] == len(trace)
    scaled = res["autoscale"]
    assert scaled["added"]["prefill"] > 0 and scaled["drained"]["prefill"] > 0
    assert 1 < scaled["most_workers"]["prefill"] <= 6
    timeline = [(t, n) for t, role, n in scaled["timeline"] if role == "prefill"]
    assert timeline[0] == (0.0, 1) and all(1 <= n <= 6 for _, n in timeline)
    # the first worker added serves worker_start_s after the burst began, at the earliest
    assert timeline[1][0] >= 20.0 + 5.0 and timeline[1][1] == 2
    assert timeline[-1][1] < scaled["most_workers"]["prefill"]  # shrunk again in the quiet tail
    # the same trace on the most workers it used, held the whole run, takes more worker-seconds
    fixed = simulate(trace, llama3_70b_a800(), SimConfig(prefill=scaled["most_workers"]["prefill"],
                                                          decode=scaled["most_workers"]["decode"], policy="tidepool"))
    assert sum(res["worker_seconds"].values()) < sum(fixed["worker_seconds"].values())
    assert simulate(trace, llama3_70b_a800(), cfg) == res  # deterministic


@pytest.mark.timeout(60)
def test_a_cluster_held_at_its_minimum_rejects_what_the_autoscaled_one_serves(tmp_path):
    trace = load_trace(step_trace(tmp_path / "step.jsonl"))
    fixed = simulate(trace, llama3_70b_a800(), SimConfig(prefill=1, decode=1, policy="tidepool"))
    scaled = simulate(trace, llama3_70b_a800(), SimConfig(prefill=1, decode=1, policy="tidepool", autoscale=AUTOSCALE,
                                                          worker_start_s=5.0))
    assert scaled["slo_attainment"] > fixed["slo_attainment"]


def test_the_scale_rule_adds_at_once_and_drains_one_after_the_delay():
    rule = ScaleRule(scale_down_delay_s=10.0)
    assert rule.change("decode", 3, 1, now=0.0) == 2
    assert rule.change("decode", 1, 3, now=1.0) == 0  # the wait starts
    assert rule.change("decode", 1, 3, now=10.0) == 0
    assert rule.change("decode", 1, 3, now=11.0) == -1  # ... and starts again
    assert rule.change("decode", 1, 2, now=12.0) == 0
    assert rule.change("decode", 2, 2, now=15.0) == 0  # wanted again: the wait is over
    assert rule.change("decode", 1, 2, now=21.0) == 0 and rule.change("decode", 1, 2, now=31.0) == -1


@pytest.mark.timeout(60)
def test_simulate_command_autoscales_and_refuses_contradicting_bounds(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    trace = str(step_trace(tmp_path / "step.jsonl"))
    out = tmp_path / "r.json"
    args = parser.parse_args(["simulate", "--trace", trace, "--preset", "llama3-70b-a800", "--prefill", "1",
                              "--decode", "1", "--autoscale-prefill", "1:6", "--autoscale-window-s", "5",
                              "--scale-down-delay-s", "10", "--worker-start-s", "5", "--json", str(out)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "worker-seconds prefill" in printed and "prefill 1..6 workers" in printed
    data = json.loads(out.read_text())
    assert data["config"]["autoscale"] == {"prefill": [1, 6]} and data["results"][0]["autoscale"]["added"]["prefill"]
    for option, named in ((["--autoscale-decode", "3:2"], "give MIN:MAX with 1 <= MIN <= MAX"),
                          (["--autoscale-decode", "2:3"], "--decode 1 is outside --autoscale-decode 2:3"),
                          (["--autoscale-decode", "1:3", "--worker-start-s", "-1"], "--worker-start-s must be at least 0")):
        args = parser.parse_args(["simulate", "--trace", trace, "--preset", "llama3-70b-a800", "--prefill", "1",
                                  "--decode", "1", *option])
        assert args.func(args) == 2
        assert named in capsys.readouterr().err
