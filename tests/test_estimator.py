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
def test_online_refit_starts_with_the_first_measured_steps_not_after_a_full_batch():
    """The start-up profile is taken on an idle machine: a serving machine twice as slow shows in the
    model after its first steps, long before ``refit_every`` of them."""
    slow = PrefillModel(*(2 * TRUE_PREFILL.coef))
    est = Estimator(TRUE_PREFILL, TRUE_DECODE, TransferModel(Link(1e9, 0), Link(1e9, 0)), 1, refit_every=32,
                    prior_weight=4.0)
    rng = np.random.default_rng(3)
    before = est.prefill.predict(4000, 0)
    refits = []
    for i, (new, cached, _) in enumerate(_prefill_samples(rng, 16), 1):
        model = est.prefill
        est.observe_prefill(new, cached, slow.predict(new, cached))
        if est.prefill is not model:
            refits.append(i)
    assert refits == [1, 3, 7, 15]  # after 1, 2, 4, 8 more samples (then 16, then every 32)
    assert est.prefill.predict(4000, 0) > 1.5 * before


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


@pytest.mark.timeout(60)
def test_online_refit_forgets_old_samples_and_relearns_a_machine_that_changed_speed():
    est = Estimator(TRUE_PREFILL, TRUE_DECODE, TransferModel(Link(1e9, 0), Link(1e9, 0)), 1,
                    refit_every=16, prior_weight=4.0, decay=0.98)
    rng = np.random.default_rng(4)
    for new, cached, t in _prefill_samples(rng, 400, noise=0.0):
        est.observe_prefill(new, cached, t)
    np.testing.assert_allclose(est.prefill.coef, TRUE_PREFILL.coef, rtol=0.05)
    for new, cached, t in _prefill_samples(rng, 400, noise=0.0):  # the machine got twice as slow
        est.observe_prefill(new, cached, 2 * t)
    # a window of 512 equal-weight samples would still hold the 400 fast ones and land near 1.5x
    assert est.prefill.predict(8000, 4000) == pytest.approx(2 * TRUE_PREFILL.predict(8000, 4000), rel=0.1)


@pytest.mark.timeout(60)
def test_engine_steps_of_several_chunks_fit_as_one_row_each():
    """A step's time is the sum of its chunks' costs: summed features make one least-squares row."""
    rng = np.random.default_rng(5)
    rows, seconds = [], []
    for _ in range(300):
        chunks = [(int(rng.integers(16, 4000)), int(rng.integers(0, 20_000))) for _ in range(rng.integers(1, 5))]
        feats = PrefillModel.features([n for n, _ in chunks], [c for _, c in chunks]).sum(axis=0)
        rows.append(feats)
        seconds.append(sum(TRUE_PREFILL.predict(n, c) for n, c in chunks) * rng.lognormal(0, 0.01))
    fit = PrefillModel.fit_rows(np.array(rows), np.array(seconds))
    np.testing.assert_allclose(fit.coef, TRUE_PREFILL.coef, rtol=0.1)


@pytest.mark.timeout(30)
def test_step_samples_split_prefill_steps_from_decode_steps_and_drafted_steps():
    from engine.engine_stats import StepComposition
    from router.loads import step_samples

    prefill, decode, drafted = step_samples([
        (7, StepComposition([("a", 100, 0), ("b", 50, 200)], 0, 0), 0.5),
        (8, StepComposition([("c", 10, 0)], decode_seqs=2, decode_context_tokens=300), 0.2),
        (9, StepComposition([], decode_seqs=3, decode_context_tokens=900, decoded_tokens=3), 0.05),
        # two sequences verify drafts of 3 beside one decode row: 7 tokens come out of the step
        (10, StepComposition([("d", 4, 99), ("e", 4, 199)], decode_seqs=1, decode_context_tokens=50,
                             drafted_seqs=2, drafted_context_tokens=300, decoded_tokens=7), 0.08),
        # a draft verified beside a prompt chunk: prompt work in it, so no per-token decode sample
        (11, StepComposition([("f", 4, 99), ("g", 64, 0)], 0, 0, drafted_seqs=1, drafted_context_tokens=100,
                             decoded_tokens=2), 0.3),
    ])
    a, b, c = PrefillModel.features([100, 50, 10], [0, 200, 0])
    assert prefill[0] == pytest.approx((7, *(a + b), 0.5))
    # decode rows in a mixed step count as one-token chunks on their context: (context, 1, 1) each
    assert prefill[1] == pytest.approx((8, c[0] + 300, c[1] + 2, c[2] + 2, 0.2))
    assert decode == ((9, 3, 900, 0.05),)
    # a drafted step is priced as chunks (the prefill model) and counted per token (the decode speed)
    assert [row[0] for row in prefill] == [7, 8, 10, 11]
    assert drafted == ((10, 3, 350, 0.08, 7),)


@pytest.mark.timeout(30)
def test_handoff_wait_is_what_layer_wise_streaming_leaves_exposed():
    from router.estimator import exposed_handoff_s

    assert exposed_handoff_s(2.0, 5.0, layers=1) == pytest.approx(2.0)  # sent after the prefill: all of it
    assert exposed_handoff_s(2.0, 5.0, layers=80) == pytest.approx(2.0 / 80)  # link faster: the last layer
    assert exposed_handoff_s(5.0, 2.0, layers=80, latency_s=0.01) == pytest.approx(0.01 + 3.0 + 2.0 / 80)
    tm = TransferModel(peer=Link(10e9, 0.001), pool=Link(1e9, 0.002))
    est = Estimator(TRUE_PREFILL, TRUE_DECODE, tm, kv_bytes_per_token=1000, layers=10)
    total, exposed = est.handoff_s(1_000_000, 0.01, "p0", "d0")  # 1 GB: 0.1 s over 10 GB/s, 0.01 s compute
    assert total == pytest.approx(0.101) and exposed == pytest.approx(0.001 + 0.09 + 0.001)
    for _ in range(60):  # the measured p0 -> d0 link is slower
        tm.observe("p0", "d0", 1_000_000_000, 0.001 + 1.0)
    assert est.handoff_s(1_000_000, 0.01, "p0", "d0")[0] == pytest.approx(1.001, rel=0.02)
    assert est.handoff_s(1_000_000, 0.01, "p1", "d0")[0] == pytest.approx(0.101)


@pytest.mark.timeout(30)
def test_link_fit_separates_latency_from_bandwidth():
    default = Link(1e9, 0.005)
    sizes = [1e6, 1e7, 1e8, 3e8]
    fit = Link.fit([(b, 0.002 + b / 4e9) for b in sizes], default)
    assert fit.bandwidth_Bps == pytest.approx(4e9, rel=1e-3) and fit.latency_s == pytest.approx(0.002, rel=1e-2)
    one = Link.fit([(1e8, 0.005 + 1e8 / 2e9)] * 3, default)  # one size: the default latency, measured bandwidth
    assert one.latency_s == 0.005 and one.bandwidth_Bps == pytest.approx(2e9)
    assert Link.fit([], default) == default


@pytest.mark.timeout(30)
def test_profile_fitted_from_cluster_samples_predicts_them():
    from router.profile import fit_profile

    rng = np.random.default_rng(6)
    steps = [[*PrefillModel.features(n, c), t] for n, c, t in _prefill_samples(rng, 100, noise=0.0)]
    samples = {
        "kv_bytes_per_token": 4096, "block_size": 16,
        "workers": [{"role": "prefill", "total_blocks": 1000}, {"role": "decode", "total_blocks": 500}],
        "startup": {"prefill": _prefill_samples(rng, 10, noise=0.0), "decode": _decode_samples(rng, 50, noise=0.0)},
        "prefill_steps": steps, "decode_steps": [], "transfers": [["p", "d", b, 0.001 + b / 3e9] for b in (1e6, 1e8)],
    }
    prof = fit_profile(samples, "m", max_batch=32)
    np.testing.assert_allclose(prof.prefill.coef, TRUE_PREFILL.coef, rtol=1e-3)
    np.testing.assert_allclose(prof.decode.coef, TRUE_DECODE.coef, rtol=1e-3)
    assert prof.peer_link.bandwidth_Bps == pytest.approx(3e9, rel=1e-3)
    assert (prof.prefill_cache_tokens, prof.decode_kv_tokens, prof.max_batch) == (16_000, 8000, 32)
    with pytest.raises(ValueError, match="no prefill"):
        fit_profile({**samples, "startup": {"prefill": [], "decode": []}, "prefill_steps": []}, "m", 32)
    with pytest.raises(ValueError, match="not a cluster profile"):
        fit_profile({"workers": []}, "m", 32)


def test_estimator_from_profiling_knows_how_many_pieces_the_handoff_streams_in():
    from router.estimator import Estimator

    samples = dict(prefill_samples=[(16, 0, 0.01), (64, 0, 0.02), (256, 0, 0.08)],
                   decode_samples=[(1, 32, 0.01), (4, 128, 0.012), (8, 512, 0.02)], kv_bytes_per_token=1 << 20)
    whole, streamed = Estimator.from_samples(**samples), Estimator.from_samples(**samples, layers=32)
    _, exposed_whole = whole.handoff_s(256, 0.08, "p0", "d0")
    transfer, exposed_streamed = streamed.handoff_s(256, 0.08, "p0", "d0")
    assert exposed_whole == pytest.approx(transfer)  # sent after the prefill: the request waits for all of it
    assert exposed_streamed < exposed_whole


@pytest.mark.timeout(30)
def test_measured_ttfts_teach_the_per_request_overhead_which_outliers_barely_move():
    est = Estimator(TRUE_PREFILL, TRUE_DECODE, TransferModel(Link(1e9, 0), Link(1e9, 0)), 1)
    assert est.request_overhead_s == 0.0
    for _ in range(200):  # every first token comes 0.4 s after the model's 1 s
        est.observe_ttft(measured_s=1.4, modelled_s=1.0)
    assert est.request_overhead_s == pytest.approx(0.4, abs=0.02)
    est.observe_ttft(measured_s=30.0, modelled_s=1.0)  # one request behind a burst the reports missed
    assert est.request_overhead_s < 0.6
    for _ in range(200):
        est.observe_ttft(measured_s=0.9, modelled_s=1.0)  # faster than the model: no overhead at all
    assert est.request_overhead_s == 0.0


@pytest.mark.timeout(30)
def test_prefill_batch_tokens_is_where_a_steps_fixed_cost_stops_mattering():
    from services.engine_profile import prefill_batch_tokens
    from services.messages import WorkerProfile

    def profile(per_token_s: float, step_s: float) -> WorkerProfile:
        prefill = [(n, 0, step_s + per_token_s * n) for n in (16, 64, 128, 256, 512)]
        decode = [(b, c, step_s + 1e-4 * b + 1e-8 * c) for b, c in ((1, 32), (4, 32), (8, 32), (1, 512), (2, 512))]
        return WorkerProfile(prefill, decode)

    # A CPU: 3 ms a token against an 18 ms step: batching stops paying after a few dozen tokens.
    cpu = prefill_batch_tokens(profile(3e-3, 0.018))
    assert 32 <= cpu <= 128
    # A GPU: 3 us a token against a 13 ms step: past any step's budget.
    assert prefill_batch_tokens(profile(3e-6, 0.013)) >= 32768
