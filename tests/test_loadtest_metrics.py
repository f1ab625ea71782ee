"""Metrics from synthetic streams with known timings equal the hand-computed values (vllm bench serve's
definitions), plus Mooncake TBT, goodput and the report layout."""

from __future__ import annotations

import math

import pytest

from loadtest.clients import RequestRecord
from loadtest.metrics import compute_metrics, mooncake_tbt, parse_goodput, tpot_s
from loadtest.report import format_table, result_dict


def _rec(rid, start, chunks, latency, out, prompt, cached=0, status="ok"):
    return RequestRecord(rid, prompt_tokens=prompt, status=status, start_s=start, chunk_s=chunks,
                         latency_s=latency, output_tokens=out, cached_tokens=cached, end_s=start + latency)


def _records():
    return [
        # ttft .1, gaps .05 .10 .05, E2EL .30, 4 tokens -> TPOT (.30-.10)/3, TBT = slowest 1 of 3 gaps = .10
        _rec("a", 0.0, [0.10, 0.15, 0.25, 0.30], 0.30, 4, 10, cached=4),
        # ttft .2, gap .2, E2EL .45 (usage chunk after the last token), 2 tokens -> TPOT .25, TBT .2
        _rec("b", 0.5, [0.20, 0.40], 0.45, 2, 20),
        # one token: no TPOT sample (0 for goodput), no gap
        _rec("c", 1.2, [0.30], 0.30, 1, 5),
        _rec("d", 0.1, [0.1], 0.2, 0, 50, status="failed"),
        _rec("e", 0.2, [], 0.0, 0, 60, status="rejected"),
    ]


def _p(values, q):
    """Linear-interpolated percentile, by hand."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    return xs[lo] + (pos - lo) * (xs[min(lo + 1, len(xs) - 1)] - xs[lo])


@pytest.mark.timeout(30)
def test_latency_metrics_equal_hand_computed_values():
    m = compute_metrics(_records(), duration_s=2.0, percentiles=[50, 99])
    approx = pytest.approx
    assert (m.sent, m.completed, m.failed, m.rejected) == (5, 3, 1, 1)
    # TTFT over completed requests: .1 .2 .3
    assert m.ttft.mean == approx(200.0)
    assert m.ttft.median == approx(200.0)
    assert m.ttft.std == approx(1000 * math.sqrt((0.1**2 + 0 + 0.1**2) / 3))
    assert m.ttft.percentiles[99] == approx(200 + 0.98 * 100)
    # TPOT only for output > 1: (.30-.10)/3 and (.45-.20)/1
    tpots = [0.2 / 3, 0.25]
    assert m.tpot.mean == approx(1000 * sum(tpots) / 2)
    assert m.tpot.percentiles[99] == approx(1000 * _p(tpots, 99))
    # ITL: every gap of every completed request, pooled
    itls = [0.05, 0.10, 0.05, 0.20]
    assert m.itl.mean == approx(100.0)
    assert m.itl.median == approx(75.0)
    assert m.itl.percentiles[99] == approx(1000 * _p(itls, 99))
    assert m.itl.percentiles[50] == approx(75.0)
    # E2EL: .30 .45 .30
    assert m.e2el.mean == approx(350.0)
    assert m.e2el.median == approx(300.0)
    # Mooncake TBT per request (.10, .20), requests without a gap left out
    assert m.tbt.mean == approx(150.0)


@pytest.mark.timeout(30)
def test_throughput_and_token_counts_use_completed_requests_only():
    m = compute_metrics(_records(), duration_s=2.0)
    assert (m.total_input, m.total_output, m.total_cached) == (35, 7, 4)
    assert m.cache_hit_rate == pytest.approx(4 / 35)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(21.0)
    assert m.request_goodput is None
    # vLLM's one-second buckets: a's 4 chunks and b's 2 fall in second 0; a and b overlap there
    assert m.max_output_tokens_per_s == 6
    assert m.max_concurrent_requests == 2


@pytest.mark.timeout(30)
def test_goodput_counts_requests_meeting_every_slo():
    recs = _records()
    # a: ttft .1 tpot .067 -> good; b: tpot .25 > .1 -> bad; c: ttft .3 > .25 -> bad
    assert compute_metrics(recs, 2.0, goodput={"ttft": 250, "tpot": 100}).request_goodput == pytest.approx(0.5)
    # an SLO equal to the value is met (vLLM: slo >= value); c's TPOT counts as 0
    assert compute_metrics(recs, 2.0, goodput={"ttft": 100}).request_goodput == pytest.approx(0.5)
    assert compute_metrics(recs, 2.0, goodput={"tpot": 100}).request_goodput == pytest.approx(1.0)
    # e2el: .30 .45 .30 ; tbt: .10 .20 0
    assert compute_metrics(recs, 2.0, goodput={"e2el": 400}).request_goodput == pytest.approx(1.0)
    assert compute_metrics(recs, 2.0, goodput={"tbt": 150}).request_goodput == pytest.approx(1.0)


@pytest.mark.timeout(30)
def test_mooncake_tbt_is_mean_of_slowest_tenth_of_gaps():
    assert mooncake_tbt([]) == 0.0
    assert mooncake_tbt([0.3]) == pytest.approx(0.3)
    gaps = [0.01] * 18 + [0.5, 0.7]  # 20 gaps: slowest 2
    assert mooncake_tbt(gaps) == pytest.approx(0.6)
    gaps = [0.01] * 22 + [0.2, 0.4, 0.6]  # 25 gaps: 10% = 2.5, rounded up to 3
    assert mooncake_tbt(gaps) == pytest.approx(0.4)


@pytest.mark.timeout(30)
def test_tpot_uses_reported_output_tokens_not_chunks():
    # 3 chunks carried 9 tokens (server batched them): TPOT divides by 8
    rec = _rec("x", 0.0, [0.1, 0.5, 0.9], 0.9, 9, 4)
    assert tpot_s(rec) == pytest.approx(0.8 / 8)


@pytest.mark.timeout(30)
def test_empty_run_reports_zeros():
    m = compute_metrics([_rec("d", 0.0, [], 0.0, 0, 5, status="failed")], duration_s=1.0)
    assert (m.completed, m.failed) == (0, 1)
    assert m.ttft.mean == 0.0 and m.itl.percentiles[99] == 0.0 and m.max_concurrent_requests == 0


@pytest.mark.timeout(30)
def test_parse_goodput_accepts_vllm_pairs_and_rejects_bad_ones():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000", "tbt:100"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.0, "tbt": 100.0}
    for bad in ("ttft", "itl:5", "ttft:-1", "ttft:abc"):
        with pytest.raises(ValueError):
            parse_goodput([bad])


@pytest.mark.timeout(30)
def test_result_keys_and_table_follow_vllm_layout():
    m = compute_metrics(_records(), 2.0, percentiles=[99], goodput={"ttft": 250})
    result = result_dict(m)
    for key in ("completed", "failed", "rejected", "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
                "mean_tbt_ms", "total_cached_tokens", "max_concurrent_requests"):
        assert key in result
    assert result["p99_itl_ms"] == pytest.approx(m.itl.percentiles[99])
    table = format_table(m, request_rate=4.0, max_concurrency=8)
    lines = table.splitlines()
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert f"{'Successful requests:':<40} {3:<10}" in lines
    assert f"{'Request goodput (req/s):':<40} {1.0:<10.2f}" in lines  # a and b meet ttft:250
    assert "---------------Time to First Token----------------" in lines
    assert f"{'P99 ITL (ms):':<40} {m.itl.percentiles[99]:<10.2f}" in lines
    assert lines[-1] == "=" * 50
