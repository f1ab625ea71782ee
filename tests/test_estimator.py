"""The router's cost models: least-squares fits recover known coefficients, online refits converge."""

from __future__ import annotations

import numpy as np
import pytest

from router.estimator import DecodeModel, Estimator, Link, PrefillModel, TransferModel
from router.profile import PRESETS, Profile, llama3_70b_a800, resolve_profile

TRUE_PREFILL = PrefillModel(per_pair_s=2.3e-9, per_token_s=1.3e-4, fixed_s=0.02)
TRUE_DECODE = DecodeModel(fixed_s=0.02, per_seq_s=6e-5, per_context_token_s=2.9e-8)


def _prefill_samples(rng, n=200, noise=0.02):
    new = rng.integers(16, 30_000, n)
    cached = np.where(rng.random(n) < 0.5, 0, rng.integers(0, 60_000, n))
    t = TRUE_PREFILL.predict(new, cached) * rng.lognormal(0, noise, n)
    return list(zip(new.tolist(), cached.tolist(), t.tolist(), strict=True))


def _decode_samples(rng, n=200, noise=0.02):
    batch = rng.integers(1, 256, n)
    ctx = batch * rng.integers(500, 20_000, n)
    t = TRUE_DECODE.predict(batch, ctx) * rng.lognormal(0, noise, n)
    return list(zip(batch.tolist(), ctx.tolist(), t.tolist(), strict=True))


@pytest.mark.timeout(60)
def test_prefill_fit_recovers_known_coefficients():
    fit = PrefillModel.fit(_prefill_samples(np.random.default_rng(0)))
    np.testing.assert_allclose(fit.coef, TRUE_PREFILL.coef, rtol=0.1)


@pytest.mark.timeout(60)
def test_decode_fit_recovers_known_coefficients():
    fit = DecodeModel.fit(_decode_samples(np.random.default_rng(1)))
    np.testing.assert_allclose(fit.coef, TRUE_DECODE.coef, rtol=0.1)


@pytest.mark.timeout(60)
def test_online_refit_moves_a_wrong_prior_to_the_measured_truth():
    wrong_prefill = PrefillModel(TRUE_PREFILL.per_pair_s * 3, TRUE_PREFILL.per_token_s * 0.5, 0.1)
    wrong_decode = DecodeModel(0.05, 1e-4, 1e-8)
    est = Estimator(wrong_prefill, wrong_decode, TransferModel(Link(1e9, 0), Link(1e9, 0)), 1,
                    refit_every=32, prior_weight=4.0)
    rng = np.random.default_rng(2)
    for new, cached, t in _prefill_samples(rng, 512):
        est.observe_prefill(new, cached, t)
    for batch, ctx, t in _decode_samples(rng, 512):
        est.observe_decode_step(batch, ctx, t)
    np.testing.assert_allclose(est.prefill.coef, TRUE_PREFILL.coef, rtol=0.15)
    np.testing.assert_allclose(est.decode.coef, TRUE_DECODE.coef, rtol=0.15)


@pytest.mark.timeout(30)
def test_queue_time_is_the_sum_of_predicted_prefills():
    est = llama3_70b_a800().estimator()
    queued = [(8000, 0), (2000, 6000), (500, 30_000)]
    sums = PrefillModel.features([q[0] for q in queued], [q[1] for q in queued]).sum(axis=0)
    expected = sum(est.prefill.predict(n, c) for n, c in queued)
    assert est.queue_time(sums) == pytest.approx(expected)


@pytest.mark.timeout(30)
def test_decode_run_time_is_the_sum_of_growing_steps_and_inverts():
    batch, ctx = 7, 40_000
    steps = [TRUE_DECODE.predict(batch, ctx + i * batch) for i in range(50)]
    assert TRUE_DECODE.run_time(batch, ctx, 50) == pytest.approx(sum(steps))
    for k in (1, 2, 17, 50):
        t = TRUE_DECODE.run_time(batch, ctx, k)
        assert TRUE_DECODE.steps_to_reach(batch, ctx, t) == k
        assert TRUE_DECODE.steps_to_reach(batch, ctx, t + 1e-9) == k + 1
    assert TRUE_DECODE.steps_to_reach(batch, ctx, 0.0) == 0


@pytest.mark.timeout(30)
def test_transfer_time_is_bytes_over_bandwidth_plus_latency_and_learns_pairs():
    tm = TransferModel(peer=Link(10e9, 0.001), pool=Link(1e9, 0.002))
    est = Estimator(TRUE_PREFILL, TRUE_DECODE, tm, kv_bytes_per_token=1000)
    assert est.transfer_time(1_000_000, "a", "b") == pytest.approx(0.001 + 1e9 / 10e9)
    assert est.transfer_time(1_000_000, "pool", "b", "pool") == pytest.approx(0.002 + 1.0)
    for _ in range(40):  # the a->b pair really runs at 2 GB/s
        tm.observe("a", "b", 2_000_000_000, 0.001 + 1.0)
    assert tm.link("a", "b").bandwidth_Bps == pytest.approx(2e9, rel=0.01)
    assert tm.link("a", "c").bandwidth_Bps == 10e9


@pytest.mark.timeout(30)
def test_profile_roundtrips_through_json_and_preset_matches_the_paper(tmp_path):
    prof = llama3_70b_a800()
    assert prof.kv_bytes_per_token == 327_680  # Llama-3-70B, fp16: the paper's "320 KB per token"
    # about 7-9k tokens/s of prefill without cache on 8 x A800, and a decode step of tens of ms
    assert 6000 < 8000 / prof.prefill.predict(8000, 0) < 9000
    assert 0.02 < prof.decode.predict(64, 64 * 12_000) < 0.1
    path = tmp_path / "p.json"
    prof.save(path)
    assert Profile.load(path) == prof
    assert resolve_profile(None, str(path)) == prof
    assert resolve_profile("llama3-70b-a800", None) == PRESETS["llama3-70b-a800"]()
    path.write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="bad profile"):
        Profile.load(path)
    with pytest.raises(ValueError, match="exactly one"):
        resolve_profile("llama3-70b-a800", str(path))


@pytest.mark.timeout(30)
def test_estimator_from_profiling_samples_predicts_what_was_measured():
    rng = np.random.default_rng(3)
    est = Estimator.from_samples(_prefill_samples(rng, noise=0.0), _decode_samples(rng, noise=0.0), 4096)
    assert est.prefill.predict(5000, 1000) == pytest.approx(TRUE_PREFILL.predict(5000, 1000), rel=1e-6)
    assert est.decode.predict(32, 200_000) == pytest.approx(TRUE_DECODE.predict(32, 200_000), rel=1e-6)
    assert est.kv_bytes_per_token == 4096
    with pytest.raises(ValueError, match="no prefill"):
        Estimator.from_samples([], _decode_samples(rng), 4096)
