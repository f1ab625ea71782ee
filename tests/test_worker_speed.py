"""Per-worker speed factors (router/worker_speed.py): each worker's measured steps against the shared cost
models, and how the conductor prices a slower worker's queue, prompts and decode steps by them."""

from __future__ import annotations

import pytest
from test_policies import BS, NOW, REQ, conductor, decode, prefill

from router.conductor import Decision
from router.estimator import prefill_features
from router.prefix_cache import PrefixIndex
from router.worker_speed import FACTOR_BOUNDS, WorkerSpeeds

pytestmark = pytest.mark.timeout(30)


def test_a_factor_is_decayed_measured_over_predicted_once_warmed_up():
    speeds = WorkerSpeeds(decay=0.5, warmup=2)
    speeds.observe("w", predicted_s=1.0, measured_s=3.0)
    assert speeds.factor("w") == 1.0 and speeds.factor("never-seen") == 1.0  # not warmed up, unknown
    speeds.observe("w", predicted_s=1.0, measured_s=1.0)
    assert speeds.factor("w") == pytest.approx((0.5 * 3 + 1) / (0.5 * 1 + 1))  # recent steps weigh more
    speeds.observe("w", predicted_s=0.0, measured_s=5.0)  # the model prices it at nothing: tells nothing
    assert speeds.factor("w") == pytest.approx(2.5 / 1.5)
    for _ in range(40):
        speeds.observe("w", predicted_s=1.0, measured_s=1000.0)
    assert speeds.factor("w") == FACTOR_BOUNDS[1]
    assert list(speeds.factors(["w", "x"])) == [FACTOR_BOUNDS[1], 1.0]
    speeds.forget("w")
    assert speeds.to_dict() == {}


def test_factors_of_the_same_worker_list_follow_every_new_step():
    """The router asks on every decision with the same list object: the answer is kept until a step comes."""
    speeds, workers = WorkerSpeeds(decay=1.0, warmup=1), ["a", "b"]
    assert list(speeds.factors(workers)) == [1.0, 1.0]
    speeds.observe("b", predicted_s=1.0, measured_s=2.0)
    assert list(speeds.factors(workers)) == [1.0, 2.0]
    assert speeds.factors(workers) is speeds.factors(workers)  # nothing new: the same array
    speeds.forget("b")
    assert list(speeds.factors(workers)) == [1.0, 1.0]


def slow_first_prefill_worker(policy: str, learn: bool, slowdown: float = 3.0):
    """A conductor whose workers p0 and p1 each ran 8 prefill steps, p0's taking ``slowdown`` times what
    p1's took for the same work."""
    c = conductor(policy, learn_worker_speeds=learn)
    features = prefill_features(4 * BS, 0)
    base = float(c.estimator.queue_time(features))
    for _ in range(8):
        c.observe_prefill_step("p0", features, base * slowdown)
        c.observe_prefill_step("p1", features, base)
    return c


@pytest.mark.parametrize("policy", ["mooncake", "tidepool", "least_loaded"])
def test_a_slower_prefill_worker_gets_the_prompt_only_when_its_speed_is_learned(policy):
    """Two idle prefill workers, equal but for their measured speed: the first (the pick on a tie) is 3x
    slower. With speeds learned the prompt goes to the faster one, and the estimate is that worker's;
    without, the slow one gets it, estimated as the shared model says."""
    loads = [prefill("p0", queued=1), prefill("p1", queued=1), decode("d0")]
    learned = slow_first_prefill_worker(policy, learn=True)
    dec = learned.route(REQ, loads, PrefixIndex(), now=NOW)
    assert isinstance(dec, Decision) and dec.prefill == "p1"
    speeds = learned.prefill_speeds.to_dict()
    assert speeds["p0"] / speeds["p1"] == pytest.approx(3.0, rel=0.05)  # the shared model sits between
    blind = slow_first_prefill_worker(policy, learn=False)
    assert blind.route(REQ, loads, PrefixIndex(), now=NOW).prefill == "p0"
    assert blind.prefill_speeds.to_dict() == {}


def test_a_slow_workers_queue_and_prompt_are_priced_by_its_speed():
    """Only the slow worker to go to, with a queued prompt: its estimate (queue + prefill, the hand-off
    aside) is its factor times what the shared model alone gives, the queue included."""
    loads = [prefill("p0", queued=1), decode("d0")]
    learned = slow_first_prefill_worker("tidepool", learn=True, slowdown=4.0)
    blind = slow_first_prefill_worker("tidepool", learn=False, slowdown=4.0)
    got, alone = learned.route(REQ, loads, PrefixIndex(), now=NOW), blind.route(REQ, loads, PrefixIndex(), now=NOW)
    assert got.prefill == alone.prefill == "p0"
    factor = learned.prefill_speeds.factor("p0")
    assert factor > 2.0 and learned.prefill_speeds.factor("p1") < 1.0  # both against the refit shared model
    assert got.est_ttft_s - got.est_handoff_s == pytest.approx(factor * (alone.est_ttft_s - alone.est_handoff_s))


@pytest.mark.parametrize("policy", ["mooncake", "tidepool"])
def test_a_slower_decode_worker_is_expected_at_its_own_step_time(policy):
    c = conductor(policy)
    for _ in range(8):
        base = float(c.estimator.decode.predict(8, 40_000))
        c.observe_decode_step("d0", 8, 40_000, base * 2.5)
        c.observe_decode_step("d1", 8, 40_000, base)
    loads = [prefill("p0"), decode("d0"), decode("d1")]
    dec = c.route(REQ, loads, PrefixIndex(), now=NOW)
    assert dec.decode == "d1"  # equal batches and room: the faster worker's steps
    ratio = c.decode_speeds.factor("d0") / c.decode_speeds.factor("d1")
    assert ratio == pytest.approx(2.5, rel=0.05)
    c.forget_worker("d0")
    assert c.decode_speeds.factor("d0") == 1.0


def test_accepted_drafts_price_a_workers_tbt_per_token():
    """Speculative decoding: a step that takes a plain step's time but gives each sequence two tokens halves
    the time per token the router expects on that worker; the shared decode model is not refit on it."""
    c = conductor("tidepool")
    model = c.estimator.decode
    for _ in range(8):
        seconds = float(model.predict(8, 40_000))
        c.observe_decode_step("d0", 8, 40_000, seconds)
        c.observe_drafted_step("d1", 8, 40_000, seconds, tokens=16)
    assert c.decode_speeds.factor("d1") == pytest.approx(0.5 * c.decode_speeds.factor("d0"), rel=0.05)
    assert len(c.measurements.decode_steps) == 8  # only the plain steps
    dec = c.route(REQ, [prefill("p0"), decode("d0"), decode("d1")], PrefixIndex(), now=NOW)
    assert dec.decode == "d1"
    alone = c.route(REQ, [prefill("p0"), decode("d0")], PrefixIndex(), now=NOW + 1)
    assert dec.est_tbt_s == pytest.approx(alone.est_tbt_s / 2, rel=0.1)
