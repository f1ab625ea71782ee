"""The autoscaler (router/planner.py, services/autoscaler.py): worker counts from the measured load, priced by
the conductor's estimator, within the operator's bounds; a live cluster adds a decode worker when its decode
workers hold more sequences than they run at once, drains one once the load has stayed low, and adds none
for a dead worker the supervisor is replacing."""

from __future__ import annotations

import math

import httpx
import pytest
import ray
from live_helpers import Streams, greedy_chat, idle, wait_until
from prometheus_client.parser import text_string_to_metric_families

from router.autoscale_rules import AutoscaleConfig
from router.estimator import (
    DEFAULT_PEER_LINK,
    DEFAULT_POOL_LINK,
    DecodeModel,
    Estimator,
    PrefillModel,
    TransferModel,
)
from router.planner import SHRINK_MARGIN, Demand, LoadWindow, Planner, sequences_per_worker
from router.view import SLO
from services.cli import build_parser
from services.config import configs_from_args
from services.status import render_status

DECODE = DecodeModel(fixed_s=0.01, per_seq_s=0.001, per_context_token_s=1e-6)
PREFILL = PrefillModel(per_pair_s=1e-8, per_token_s=1e-4, fixed_s=0.005)
ESTIMATOR = Estimator(PREFILL, DECODE, TransferModel(DEFAULT_PEER_LINK, DEFAULT_POOL_LINK), kv_bytes_per_token=1024)
SLO_ = SLO(ttft_s=1.0, tbt_s=0.05)


def _window(prompts: tuple[float, float, float] = (0.0, 0.0, 0.0), sequences: float = 0.0, context: float = 0.0,
            rejected: frozenset[str] = frozenset(), seconds: float = 10.0) -> LoadWindow:
    return LoadWindow(seconds, prompts, sequences, context, rejected)


# ---- the planner's arithmetic ------------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_prefill_load_is_the_prompt_work_routed_in_the_window_priced_by_the_estimator_per_second():
    demand = Demand(window_s=10.0)
    prompts = [(2000, 0), (1500, 500), (3000, 1000)] * 20  # (new, cached) tokens
    for i, (new, cached) in enumerate(prompts):
        demand.add_prompt(100.0 + i * 0.1, new, cached)
    window = demand.window(106.0)
    busy_s = sum(PREFILL.predict(new, cached) for new, cached in prompts)
    assert window.prompt_features == pytest.approx((sum(n * c + n * (n + 1) / 2 for n, c in prompts),
                                                    sum(n for n, _ in prompts), len(prompts)))
    planner = Planner({"prefill": (1, 10)}, utilization=0.5, slo=SLO_, max_num_seqs=64)
    (load,) = planner.plan(window, ESTIMATOR, {"prefill": 1}, kv_tokens=10_000).values()
    assert load.load == pytest.approx(busy_s / 10.0)
    assert load.wanted == math.ceil(busy_s / 10.0 / 0.5) and load.wanted > 1


@pytest.mark.timeout(10)
def test_a_decode_worker_holds_what_the_tbt_slo_its_kv_cache_and_max_num_seqs_allow():
    # a step of B sequences of 1,000 tokens: 10 ms + B * (1 + 1) ms; within 50 ms: B = 20
    assert sequences_per_worker(DECODE, 0.05, 1000, max_num_seqs=64, kv_tokens=1_000_000) == 20
    assert sequences_per_worker(DECODE, 0.05, 1000, max_num_seqs=64, kv_tokens=10_000) == 10
    assert sequences_per_worker(DECODE, 0.05, 1000, max_num_seqs=4, kv_tokens=1_000_000) == 4
    assert sequences_per_worker(DECODE, 0.005, 1000, max_num_seqs=64, kv_tokens=1_000_000) == 1  # SLO < fixed
    free_steps = DecodeModel(fixed_s=0.01, per_seq_s=0.0, per_context_token_s=1e-6)  # as a fit may come out
    assert sequences_per_worker(free_steps, 0.05, 0.0, max_num_seqs=64, kv_tokens=1_000) == 64  # nothing held yet


@pytest.mark.timeout(10)
def test_a_mixed_fleet_is_planned_by_each_workers_speed():
    """Prompt work priced by the shared model, carried by workers of factors 1 and 3: each does 1/1 and 1/3 of
    a model-second a second, 2/3 on average, so the load is 1.5x what the model alone says. A decode worker
    twice as slow holds (50 - 20) / 4 = 7 sequences of 1,000 tokens within 50 ms, the fast one 20."""
    planner = Planner({"prefill": (1, 20), "decode": (1, 20)}, utilization=1.0, slo=SLO_, max_num_seqs=64)
    window = _window(prompts=(0.0, 400_000.0, 0.0), sequences=27.0, context=1000.0)  # 4 model-seconds a second
    alike = planner.plan(window, ESTIMATOR, {"prefill": 2, "decode": 2}, kv_tokens=1_000_000)
    mixed = planner.plan(window, ESTIMATOR, {"prefill": 2, "decode": 2}, kv_tokens=1_000_000,
                         prefill_speeds=[1.0, 3.0], decode_speeds=[1.0, 2.0])
    assert alike["prefill"].load == pytest.approx(4.0) and mixed["prefill"].load == pytest.approx(6.0)
    assert sequences_per_worker(DECODE, 0.05, 1000, max_num_seqs=64, kv_tokens=1_000_000, speed=2.0) == 7
    assert alike["decode"].load == pytest.approx(27 / 20) and mixed["decode"].load == pytest.approx(27 / 13.5)
    assert (alike["prefill"].wanted, mixed["prefill"].wanted) == (4, 6)


@pytest.mark.timeout(10)
def test_a_count_grows_with_the_load_shrinks_only_well_below_the_target_and_stays_within_its_bounds():
    planner = Planner({"decode": (1, 4)}, utilization=0.5, slo=SLO_, max_num_seqs=10)  # 10 a worker, 5 at 50 %

    def wanted(sequences: float, current: int) -> int:
        return planner.plan(_window(sequences=sequences, context=100), ESTIMATOR, {"decode": current},
                            kv_tokens=100_000)["decode"].wanted

    assert wanted(12, 1) == 3  # 1.2 workers busy: 3 at 50 %
    assert wanted(9, 3) == 3  # 2 would do at 50 %, but not at 50 % x SHRINK_MARGIN
    assert 7 / 10 / (0.5 * SHRINK_MARGIN) <= 2 and wanted(7, 3) == 2
    assert wanted(0, 3) == 1 and wanted(40, 1) == 4


@pytest.mark.timeout(10)
def test_requests_rejected_for_a_roles_slo_ask_for_one_worker_more_of_that_role():
    demand = Demand(window_s=10.0)
    for reason in ("ttft", "request larger than any decode worker's KV memory"):
        demand.add_rejection(5.0, reason)
    assert demand.window(6.0).rejected == {"prefill"}
    split = Planner({"prefill": (1, 3), "decode": (1, 3)}, utilization=0.7, slo=SLO_, max_num_seqs=8)
    plan = split.plan(demand.window(6.0), ESTIMATOR, {"prefill": 1, "decode": 1}, kv_tokens=10_000)
    assert (plan["prefill"].wanted, plan["decode"].wanted) == (2, 1)
    demand.add_rejection(7.0, "tbt")
    colocated = Planner({"colocated": (1, 3)}, utilization=0.7, slo=SLO_, max_num_seqs=8)
    assert colocated.plan(demand.window(8.0), ESTIMATOR, {"colocated": 2}, kv_tokens=10_000)["colocated"].wanted == 3
    assert demand.window(20.0).rejected == frozenset()  # out of the window


@pytest.mark.timeout(10)
def test_the_window_forgets_what_is_older_and_weighs_the_context_by_the_sequences_holding_it():
    demand = Demand(window_s=10.0)
    demand.add_prompt(0.0, 4000, 0)
    demand.add_prompt(20.0, 100, 0)
    demand.add_decode_sample(5.0, 50, 9999)
    demand.add_decode_sample(21.0, 2, 100)
    demand.add_decode_sample(22.0, 6, 300)
    window = demand.window(25.0)
    assert window.prompt_features == pytest.approx((100 * 101 / 2, 100, 1))
    assert (window.decode_sequences, window.context_tokens) == (4.0, 250.0)  # (2*100 + 6*300) / 8
    assert demand.window(40.0) == LoadWindow(10.0, (0.0, 0.0, 0.0), 0.0, 0.0, frozenset())


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("flags", "message"), [
    (["--autoscale-decode", "3:1"], "give MIN:MAX with 1 <= MIN <= MAX"),
    (["--decode", "3", "--autoscale-decode", "1:2"], "--decode 3 is outside --autoscale-decode 1:2"),
    (["--colocated", "2", "--autoscale-decode", "1:2"], "this cluster serves colocated workers"),
    (["--autoscale-prefill", "1:2", "--autoscale-utilization", "0"], "--autoscale-utilization must be in (0, 1]"),
    (["--autoscale-decode", "1:2", "--autoscale-window-s", "0"], "--autoscale-window-s must be positive"),
])
def test_autoscale_settings_that_contradict_each_other_are_refused_naming_the_flag(flags, message):
    with pytest.raises(ValueError) as raised:
        configs_from_args(build_parser().parse_args(["serve", *flags]))
    assert message in str(raised.value)


@pytest.mark.timeout(10)
def test_autoscale_flags_reach_the_cluster_config_and_a_malformed_range_is_an_argument_error(capsys):
    cluster, _ = configs_from_args(build_parser().parse_args(
        ["serve", "--decode", "2", "--autoscale-decode", "1:4", "--autoscale-prefill", "1:1",
         "--scale-down-delay-s", "30", "--autoscale-window-s", "15"]))
    assert cluster.autoscale == AutoscaleConfig(bounds={"decode": (1, 4), "prefill": (1, 1)}, window_s=15.0,
                                                scale_down_delay_s=30.0)
    assert configs_from_args(build_parser().parse_args(["serve"]))[0].autoscale.bounds == {}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--autoscale-decode", "four"])
    assert "expected MIN:MAX (two whole numbers), got 'four'" in capsys.readouterr().err


# ---- a live cluster ---------------------------------------------------------------------------------------

def _gauge(server, name: str, **labels: str) -> list[float]:
    text = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    return [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()]


def _decode_ids(server, alive: bool = False) -> list[str]:
    """The decode workers listed (``alive``: only those routed to, from their first load report on)."""
    return [w["id"] for w in server.worker_stats() if w["role"] == "decode" and (w["alive"] or not alive)]


@pytest.fixture(scope="module")
def autoscaled(start_server):
    # Two sequences a decode worker: six streams ask for five workers at 70 %, three at most.
    server = start_server(prefill=1, decode=2, kv_transport="grpc", engine_options={"max_num_seqs": 2},
                          autoscale=AutoscaleConfig(bounds={"decode": (2, 3)}, window_s=3.0, scale_down_delay_s=5.0,
                                                    drain_timeout_s=30.0))
    yield server
    server.stop()


def _changes(server, role: str) -> dict[str, float]:
    return {change: sum(_gauge(server, "tidepool_worker_changes_total", role=role, change=change))
            for change in ("added", "drained", "replaced")}


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_a_decode_worker_is_added_while_sequences_wait_for_room_and_drained_once_the_load_has_stayed_low(
        autoscaled):
    server = autoscaled
    text = "Autoscaling: how many pools does the tide fill tonight?"
    expected = greedy_chat(server, text, 300)  # one sequence at a time: no worker more
    assert _decode_ids(server) == ["decode-0", "decode-1"]
    status = httpx.get(f"{server.http_url}/v1/cluster/status", timeout=30).json()
    assert status["autoscaler"]["decode"]["min"] == 2 and status["autoscaler"]["decode"]["max"] == 3
    assert "autoscaler  decode 2..3   load " in render_status(status)  # as `tidepool status` prints it
    first = Streams(server, [text] * 6, 300)
    assert wait_until(lambda: "decode-2" in _decode_ids(server, alive=True), 120)
    second = Streams(server, [text] * 4, 300)  # routed while all three serve: the added worker takes a share
    assert wait_until(lambda: server.dispatcher.in_flight.count("decode-2") > 0, 60)
    assert first.join() == [expected] * 6 and second.join() == [expected] * 4  # served right as the cluster grew
    assert _gauge(server, "tidepool_autoscaler_wanted_workers", role="decode")
    assert wait_until(lambda: len(_decode_ids(server)) == 2, 120)  # the load gone, one worker is drained
    assert greedy_chat(server, text, 300) == expected and wait_until(lambda: idle(server), 30)
    assert _changes(server, "decode") == {"added": 1, "drained": 1, "replaced": 0}


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_a_dead_worker_counts_while_it_is_replaced_so_the_autoscaler_adds_none_in_its_place(autoscaled):
    server = autoscaled
    before = _changes(server, "decode")
    dead, kept = [w.worker_id for w in server.dispatcher.workers.values() if w.role == "decode"]
    ray.kill(server.dispatcher.workers[dead].actor, no_restart=True)  # the other alone is below the minimum
    assert wait_until(lambda: sorted(_decode_ids(server, alive=True)) == sorted([kept, f"{dead}.1"]), 120)
    assert wait_until(lambda: idle(server), 30)
    after = _changes(server, "decode")
    assert {change: after[change] - before[change] for change in after} == {"added": 0, "drained": 0,
                                                                            "replaced": 1}
    assert len(_decode_ids(server)) == 2
