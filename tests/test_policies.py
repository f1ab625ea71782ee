"""Hand-built routing decisions for every policy: a long prefix on a busy worker against an idle worker,
a remote fetch worth it against not, a full decode side, and overload rejected with a retry-after."""

from __future__ import annotations

import pytest

from kvstore.names import POOL_HOLDER
from router.conductor import SLO, Conductor, Decision, Reject, RouteRequest, WorkerLoad
from router.estimator import Link, prefill_features
from router.policies import POLICIES
from router.prefix_cache import PrefixIndex
from router.profile import llama3_70b_a800

NOW = 1000.0
BS = 512  # tokens per index block (the Mooncake trace's block)
HASHES = list(range(1, 33))  # a 32-block prompt: 16,384 tokens, about 2.7 s of prefill without cache
REQ = RouteRequest("r1", prompt_len=32 * BS, block_hashes=HASHES, max_tokens=256)
JOB = (32 * BS, 0)  # one queued uncached prompt of the same size


def prefill(wid: str, queued: int = 0, role: str = "prefill", free: int = 1000) -> WorkerLoad:
    return WorkerLoad(wid, role, True, [JOB] * queued, 0, 0, free, 1000, BS, NOW)


def decode(wid: str, running: int = 4, ctx: int = 40_000, free: int = 80_000) -> WorkerLoad:
    return WorkerLoad(wid, "decode", True, [], running, ctx, free, 83_000, 16, NOW)


def conductor(policy: str, pool_link: Link | None = None, peer_link: Link | None = None, **options) -> Conductor:
    prof = llama3_70b_a800()
    if pool_link is not None:
        prof.pool_link = pool_link
    if peer_link is not None:
        prof.peer_link = peer_link
    return Conductor(policy, prof.estimator(), SLO(30.0, 0.1), block_size=BS, **options)


def index(**holders: int) -> PrefixIndex:
    idx = PrefixIndex()
    for holder, n in holders.items():
        idx.add(holder, HASHES[:n])
    return idx


def route(policy: str, loads, idx, **kw) -> Decision | Reject:
    return conductor(policy, **kw).route(REQ, loads, idx, now=NOW)


# ----- a long prefix on a busy worker against an idle worker -----
BUSY_HOLDER = [prefill("p0", queued=3), prefill("p1"), decode("d0")]  # p0: 31/32 blocks, ~8 s of queue


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["mooncake", "tidepool"])
def test_estimating_policies_fetch_the_prefix_to_the_idle_worker(policy):
    dec = route(policy, BUSY_HOLDER, index(p0=31))
    assert isinstance(dec, Decision)
    assert (dec.prefill, dec.fetch_from, dec.fetch_blocks, dec.cached_blocks) == ("p1", "p0", 31, 31)
    assert dec.est_ttft_s < 1.0  # RDMA copy of 31 blocks + 512 new tokens, instead of ~8 s of queue


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["mooncake", "tidepool"])
def test_estimating_policies_use_the_local_prefix_when_its_holder_is_idle(policy):
    dec = route(policy, [prefill("p0"), prefill("p1"), decode("d0")], index(p0=31))
    assert (dec.prefill, dec.fetch_from, dec.cached_blocks) == ("p0", None, 31)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["mooncake", "tidepool"])
def test_a_wholly_cached_prompt_is_estimated_to_compute_its_last_block(policy):
    # The engine takes at most the blocks before the one holding the last token from the cache (that one is
    # computed for its logits): all 32 blocks cached cost what 31 do, not one token's prefill.
    loads = [prefill("p0"), prefill("p1"), decode("d0")]
    whole, all_but_last = route(policy, loads, index(p0=32)), route(policy, loads, index(p0=31))
    assert (whole.prefill, whole.cached_blocks) == ("p0", 32)
    assert whole.est_ttft_s == pytest.approx(all_but_last.est_ttft_s)


@pytest.mark.timeout(30)
def test_cache_aware_follows_the_prefix_until_the_imbalance_passes_both_thresholds():
    dec = route("cache_aware", BUSY_HOLDER, index(p0=31))
    assert (dec.prefill, dec.fetch_from, dec.cached_blocks) == ("p0", None, 31)
    overloaded = [prefill("p0", queued=40), prefill("p1"), decode("d0")]  # 40 - 0 > 32 and 40 > 0 x 1.0001
    assert route("cache_aware", overloaded, index(p0=31)).prefill == "p1"
    # a short match (< 50% of the prompt) goes to the worker with the most free cache instead
    low_match = [prefill("p0", free=10), prefill("p1", free=900), decode("d0")]
    assert route("cache_aware", low_match, index(p0=10)).prefill == "p1"


@pytest.mark.timeout(30)
def test_least_loaded_ignores_the_cache_and_round_robin_cycles():
    dec = route("least_loaded", BUSY_HOLDER, index(p0=31))
    assert (dec.prefill, dec.fetch_from, dec.cached_blocks) == ("p1", None, 0)
    rr = conductor("round_robin")
    loads = [prefill("p0"), prefill("p1"), prefill("p2"), decode("d0"), decode("d1")]
    picks = [rr.route(REQ, loads, index(), now=NOW) for _ in range(4)]
    assert [d.prefill for d in picks] == ["p0", "p1", "p2", "p0"]
    assert [d.decode for d in picks] == ["d0", "d1", "d0", "d1"]


@pytest.mark.timeout(30)
def test_random_is_reproducible_for_a_seed():
    loads = [prefill(f"p{i}") for i in range(8)] + [decode("d0")]
    a, b = conductor("random", seed=3), conductor("random", seed=3)
    assert [a.route(REQ, loads, index(), now=NOW).prefill for _ in range(10)] == \
           [b.route(REQ, loads, index(), now=NOW).prefill for _ in range(10)]


# ----- a remote fetch worth it against not -----
@pytest.mark.timeout(30)
def test_tidepool_fetches_from_the_pool_only_when_it_beats_recomputing():
    loads = [prefill("p0"), prefill("p1"), decode("d0")]
    fast = route("tidepool", loads, index(**{POOL_HOLDER: 31}))
    assert (fast.fetch_from, fast.cached_blocks) == ("pool", 31)
    assert route("tidepool", loads, index(redis=31)).fetch_from == "pool"  # a plain "redis" key too
    slow_pool = Link(bandwidth_Bps=100e6, latency_s=0.002)  # 5 GB at 100 MB/s: ~50 s, recompute ~2.7 s
    slow = route("tidepool", loads, index(redis=31), pool_link=slow_pool)
    assert (slow.fetch_from, slow.cached_blocks) == (None, 0)
    assert slow.est_ttft_s < 5
    # Mooncake's rule fetches whenever best_len > threshold x local_len, so it waits on the slow copy
    # and (TTFT ~ 50 s > 30 s) turns the request away.
    assert isinstance(route("mooncake", loads, index(redis=31), pool_link=slow_pool), Reject)


@pytest.mark.timeout(30)
def test_tidepool_prefers_a_shorter_peer_prefix_over_a_slow_longer_pool_one():
    loads = [prefill("p0", queued=3), prefill("p1"), decode("d0")]
    slow_pool = Link(bandwidth_Bps=1e9, latency_s=0.002)  # 31 blocks: ~5.2 s; 28 from the peer: ~47 ms
    dec = route("tidepool", loads, index(p0=28, redis=31), pool_link=slow_pool)
    assert (dec.prefill, dec.fetch_from, dec.cached_blocks) == ("p1", "p0", 28)


# ----- the decode side full -----
@pytest.mark.timeout(30)
def test_tidepool_skips_a_decode_worker_without_room_for_the_kv():
    # d0 looks idle but its KV memory is reserved; d1 is busier but has room.
    loads = [prefill("p0"), decode("d0", running=1, ctx=2000, free=100), decode("d1", running=60, ctx=700_000)]
    assert route("tidepool", loads, index()).decode == "d1"
    assert route("mooncake", loads, index()).decode == "d0"  # Alg. 1 picks by TBT, blind to memory
    assert route("mooncake", loads, index(), decode_by="free_blocks").decode == "d1"  # the ablation
    assert route("least_loaded", loads, index()).decode == "d0"
    with pytest.raises(ValueError, match="decode_by"):
        conductor("mooncake", decode_by="memory")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["tidepool", "mooncake", "least_loaded", "cache_aware"])
def test_a_decode_worker_whose_adapter_slots_are_all_busy_is_passed_over(policy):
    """One adapter slot a worker: d0 (idle, so every policy's pick) runs kelp's requests, d1 nothing. A crab
    request goes to d1, which can give crab its slot; a kelp request may join d0; with every worker blocked
    the choice is the usual one (the request waits wherever it goes)."""
    def lora_decode(wid: str, running: int, ctx: int, free: int, adapters: tuple[str, ...]) -> WorkerLoad:
        load = decode(wid, running=running, ctx=ctx, free=free)
        load.max_loras, load.running_loras = 1, adapters
        return load

    loads = [prefill("p0"), lora_decode("d0", 1, 2000, 80_000, ("kelp",)), lora_decode("d1", 40, 400_000, 20_000, ())]
    crab = RouteRequest("r-crab", 32 * BS, HASHES, 256, lora="crab")
    assert conductor(policy).route(crab, loads, index(), now=NOW).decode == "d1"
    kelp = RouteRequest("r-kelp", 32 * BS, HASHES, 256, lora="kelp")
    assert conductor(policy).route(kelp, loads, index(), now=NOW).decode == "d0"
    loads[2].running_loras = ("clam",)
    assert conductor(policy).route(crab, loads, index(), now=NOW).decode == "d0"
    # two requests of two adapters before the next reports: the second sees the first's adapter on d0
    loads = [prefill("p0"), lora_decode("d0", 1, 2000, 80_000, ()), lora_decode("d1", 40, 400_000, 20_000, ())]
    burst = conductor(policy)
    assert [burst.route(r, loads, index(), now=NOW + i).decode for i, r in enumerate((crab, kelp))] == ["d0", "d1"]


@pytest.mark.timeout(30)
def test_blocks_decode_reservations_wait_for_count_as_used():
    # d0 reports plenty of free blocks, but reservations waiting there will take nearly all of them.
    waited = WorkerLoad("d0", "decode", True, [], 1, 2000, 80_000, 83_000, 16, NOW, waiting_leases=40,
                        waiting_lease_blocks=79_990)
    loads = [prefill("p0"), waited, decode("d1", running=60, ctx=700_000)]
    assert route("tidepool", loads, index()).decode == "d1"
    assert route("mooncake", loads, index(), decode_by="free_blocks").decode == "d1"


@pytest.mark.timeout(30)
def test_tidepool_rejects_when_no_decode_worker_will_have_room_with_a_retry_after():
    loads = [prefill("p0"), decode("d0", running=2, ctx=2000, free=100), decode("d1", running=2, ctx=2000, free=50)]
    out = route("tidepool", loads, index())
    assert isinstance(out, Reject) and out.reason == "decode"
    assert out.retry_after_s > 0
    # what frees up before this prefill ends counts: a worker whose long-running batch is about to
    # release most of its blocks is accepted even though it is full right now
    ending = decode("d2", running=100, ctx=1_200_000, free=100)
    assert route("tidepool", [*loads, ending], index()).decode == "d2"


# ----- overload rejected with a retry-after -----
OVERLOADED = [prefill("p0", queued=12), prefill("p1", queued=12), decode("d0")]  # ~33 s of queue each


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["mooncake", "tidepool"])
def test_overload_is_rejected_early_with_the_time_until_the_slo_fits(policy):
    out = route(policy, OVERLOADED, index())
    assert isinstance(out, Reject) and out.reason == "ttft"
    c = conductor(policy)
    queue = c.estimator.prefill.predict(*JOB) * 12
    prefill = c.estimator.prefill.predict(REQ.prompt_len, 0)
    # tidepool's TTFT also counts the part of the KV hand-off the first token waits for; Algorithm 1's does not
    handoff = c.estimator.handoff_s(REQ.prompt_len, prefill, "p0", "d0")[1] if policy == "tidepool" else 0.0
    assert out.retry_after_s == pytest.approx(queue + prefill + handoff - 30.0, rel=1e-6)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["round_robin", "random", "least_loaded", "cache_aware"])
def test_baselines_never_reject(policy):
    out = route(policy, OVERLOADED, index())
    assert isinstance(out, Decision) and out.est_ttft_s > 30


# ----- cluster shapes and bookkeeping -----
@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_colocated_workers_decode_what_they_prefill(policy):
    loads = [WorkerLoad(f"w{i}", "colocated", True, [], 2, 20_000, 50_000, 83_000, 16, NOW) for i in range(3)]
    dec = route(policy, loads, index(w2=31))
    assert isinstance(dec, Decision) and dec.prefill == dec.decode


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["tidepool", "mooncake", "least_loaded"])
def test_a_colocated_worker_whose_adapter_slot_is_busy_is_passed_over(policy):
    """Colocated workers decode what they prefill: w0 (idle) runs kelp in its one slot, w1 (queued) nothing;
    a crab request goes to w1."""
    loads = [WorkerLoad("w0", "colocated", True, [], 1, 2000, 50_000, 83_000, 16, NOW, max_loras=1,
                        running_loras=("kelp",)),
             WorkerLoad("w1", "colocated", True, [JOB], 1, 2000, 50_000, 83_000, 16, NOW, max_loras=1)]
    crab = RouteRequest("r-crab", 32 * BS, HASHES, 256, lora="crab")
    dec = conductor(policy).route(crab, loads, index(), now=NOW)
    assert (dec.prefill, dec.decode) == ("w1", "w1")
    kelp = RouteRequest("r-kelp", 32 * BS, HASHES, 256, lora="kelp")
    assert conductor(policy).route(kelp, loads, index(), now=NOW).prefill == "w0"


@pytest.mark.timeout(30)
def test_dead_workers_and_unknown_holders_are_ignored():
    loads = [WorkerLoad("p0", "prefill", False, [], 0, 0, 1000, 1000, BS, NOW), prefill("p1"), decode("d0")]
    for policy in POLICIES:
        dec = route(policy, loads, index(p0=31, ghost=31))
        assert dec.prefill == "p1" and dec.fetch_from is None
    assert isinstance(route("tidepool", [prefill("p0"), WorkerLoad("d0", "decode", alive=False)], index()), Reject)


@pytest.mark.timeout(30)
def test_requests_routed_since_the_last_report_count_as_load():
    c = conductor("least_loaded")
    loads = [prefill("p0"), prefill("p1"), decode("d0")]  # reports from NOW, routing a little later
    first, second = (c.route(REQ, loads, index(), now=NOW + 0.001) for _ in range(2))
    assert (first.prefill, second.prefill) == ("p0", "p1")
    fresh = [prefill("p0"), prefill("p1"), decode("d0")]  # new reports (at NOW) already include them
    fresh[0].updated_at = fresh[1].updated_at = NOW + 0.002
    assert c.route(REQ, fresh, index(), now=NOW + 0.002).prefill == "p0"


@pytest.mark.timeout(30)
def test_routed_work_is_forgotten_after_the_ttl_even_without_reports():
    c = conductor("least_loaded", pending_ttl_s=5.0)
    loads = [prefill("p0"), prefill("p1"), decode("d0")]
    assert c.route(REQ, loads, index(), now=NOW + 1).prefill == "p0"
    assert c.route(REQ, loads, index(), now=NOW + 2).prefill == "p1"  # p0 still counts the first one
    # no report for 10 s: both routed prefills expire, and the (stale, drained) reports say idle again
    assert c.route(REQ, loads, index(), now=NOW + 12).prefill == "p0"


@pytest.mark.timeout(30)
def test_a_reported_queue_drains_with_time_since_the_report():
    c = conductor("least_loaded")
    # p0 reported ~8 s of prefills 30 s ago, done by now; p1 reported one just now
    stale = WorkerLoad("p0", "prefill", True, [JOB] * 3, 1, 0, 1000, 1000, BS, NOW - 30)
    assert c.route(REQ, [stale, prefill("p1", queued=1), decode("d0")], index(), now=NOW).prefill == "p0"


# ----- cache hits the queues will create, hot-prefix replication -----
SIBLING = RouteRequest("r2", prompt_len=32 * BS, block_hashes=HASHES[:31] + [99], max_tokens=256)


@pytest.mark.timeout(30)
def test_tidepool_queues_a_request_behind_the_prefill_computing_its_prefix():
    c = conductor("tidepool")
    loads = [prefill("p0"), prefill("p1", queued=2), decode("d0")]
    first = c.route(REQ, loads, index(), now=NOW)
    second = c.route(SIBLING, loads, index(), now=NOW + 0.01)  # the index does not show the prefix yet
    # behind the first on its worker, the 31 shared blocks are computed by the time the second runs
    assert (second.prefill, second.fetch_from, second.cached_blocks) == (first.prefill, None, 31)
    assert second.est_ttft_s < first.est_ttft_s + 1.0  # its own prefill is one block
    blind = conductor("tidepool", inflight=False)
    blind.route(REQ, loads, index(), now=NOW)
    assert blind.route(SIBLING, loads, index(), now=NOW + 0.01).cached_blocks == 0
    moon = conductor("mooncake")
    moon.route(REQ, loads, index(), now=NOW)
    assert moon.route(SIBLING, loads, index(), now=NOW + 0.01).cached_blocks == 0  # Algorithm 1 recomputes


@pytest.mark.timeout(30)
def test_tidepool_copies_a_prefix_in_flight_once_computed_when_its_worker_has_a_queue():
    c = conductor("tidepool")
    # p0 computes the prefix first; then p0 takes 3 more uncached prompts before our sibling arrives
    first = c.route(REQ, [prefill("p0"), prefill("p1", queued=3), decode("d0")], index(), now=NOW)
    assert first.prefill == "p0"
    loads = [prefill("p0", queued=4), prefill("p1", queued=1), decode("d0")]
    loads[0].updated_at = loads[1].updated_at = NOW + 0.01  # the reports include the first request
    second = c.route(SIBLING, loads, index(), now=NOW + 0.01)
    # p1's queue (~2.7 s) outlasts p0's prefill of the prefix: copy it from p0 once computed, not queue behind 4
    assert (second.prefill, second.fetch_from, second.cached_blocks) == ("p1", "p0", 31)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "mooncake"])
def test_live_conductor_has_any_policy_copy_a_prefix_another_worker_is_computing(policy):
    """The live cluster's conductor (copy_inflight): a policy that would compute a prefix again copies it
    from the worker computing it, when waiting for that prefill and copying gives the earlier first token."""
    c = conductor(policy, copy_inflight=True)
    first = c.route(REQ, [prefill("p0"), prefill("p1", queued=1), decode("d0")], index(), now=NOW)
    assert first.prefill == "p0"
    loads = [prefill("p0", queued=1), prefill("p1"), decode("d0")]
    for load in loads:
        load.updated_at = NOW + 2.0  # the reports include the first request
    # 2 s into p0's ~2.7 s prefill of the prefix: waiting for it beats computing it again on p1
    late = c.route(SIBLING, loads, index(), now=NOW + 2.0)
    assert (late.prefill, late.fetch_from, late.cached_blocks) == ("p1", "p0", 31)
    assert c.copy_wait_s(late) > 0
    plain = conductor(policy)  # the simulator's: the policy as published
    plain.route(REQ, [prefill("p0"), prefill("p1", queued=1), decode("d0")], index(), now=NOW)
    assert plain.route(SIBLING, loads, index(), now=NOW + 2.0).fetch_from is None


@pytest.mark.timeout(30)
def test_a_prefix_just_started_elsewhere_is_computed_again_when_that_is_as_fast():
    c = conductor("round_robin", copy_inflight=True)
    c.route(REQ, [prefill("p0"), prefill("p1"), decode("d0")], index(), now=NOW)
    second = c.route(SIBLING, [prefill("p0"), prefill("p1"), decode("d0")], index(), now=NOW)
    assert (second.prefill, second.fetch_from) == ("p1", None)  # waiting for p0 would take as long


@pytest.mark.timeout(30)
def test_decision_carries_the_kv_handoff_it_added_to_the_ttft():
    dec = route("tidepool", [prefill("p0"), decode("d0")], index())
    est = conductor("tidepool").estimator
    prefill_s = est.prefill.predict(REQ.prompt_len, 0)
    transfer, exposed = est.handoff_s(REQ.prompt_len, prefill_s, "p0", "d0")
    assert (dec.est_transfer_s, dec.est_handoff_s) == pytest.approx((transfer, exposed))
    assert dec.est_ttft_s == pytest.approx(prefill_s + exposed) and 0 < exposed < transfer
    colocated = route("tidepool", [WorkerLoad("w0", "colocated", True, [], 0, 0, 50_000, 83_000, 16, NOW)], index())
    assert (colocated.est_transfer_s, colocated.est_handoff_s) == (0.0, 0.0)


def _replication_case(**options) -> Decision:
    """A prefix made hot by three requests; a minute later its holder p0 has a queue, p1 a longer one,
    p2 and p3 are idle, and the peer link is slow: copying the prefix (5.2 GB at 1.5 GB/s) takes longer
    than recomputing it (2.7 s)."""
    c = conductor("tidepool", peer_link=Link(1.5e9, 0.001), replicate=True, hot_rps=0.01, **options)
    hot = index(p0=31)

    def loads(t: float) -> list[WorkerLoad]:  # fresh reports: they include everything routed before t
        out = [prefill("p0", queued=1), prefill("p1", queued=3), prefill("p2"), prefill("p3"), decode("d0")]
        for w in out:
            w.updated_at = t
        return out

    for k in range(3):
        c.route(RouteRequest(f"h{k}", 32 * BS, HASHES[:31] + [200 + k], 256), loads(NOW + k), hot, now=NOW + k)
    return c.route(SIBLING, loads(NOW + 60), hot, now=NOW + 60)


@pytest.mark.timeout(30)
def test_replication_copies_a_hot_prefix_to_an_idle_worker_within_its_budget():
    dec = _replication_case()
    # the request recomputes on an idle worker (faster than the copy or p0's queue); p0 and p2 are busy
    # with the prefix now, so the other idle worker gets a copy of it from p0, off any request's path
    assert (dec.prefill, dec.fetch_from, dec.cached_blocks) == ("p2", None, 0)
    assert [(r.src, r.dst, r.blocks) for r in dec.replicate] == [("p0", "p3", 31)]
    # a byte budget too small for one copy (150 kB/s against the 5 GB prefix) makes none
    assert _replication_case(budget_share=1e-4).replicate == ()
    # a prefix nobody asked for before is not hot
    cold = conductor("tidepool", peer_link=Link(1.5e9, 0.001), replicate=True)
    busy = [prefill("p0", queued=1), prefill("p1", queued=3), prefill("p2"), prefill("p3"), decode("d0")]
    assert cold.route(SIBLING, busy, index(p0=31), now=NOW).replicate == ()


@pytest.mark.timeout(30)
def test_inflight_prefixes_match_by_stride_and_expire_after_their_grace():
    from router.heat import PrefixHeat
    from router.inflight import InflightPrefixes

    inflight = InflightPrefixes(stride=4, grace_s=5.0)
    inflight.add("p0", list(range(1, 11)), ready_at=10.0)  # keys at blocks 4 and 8
    inflight.add("p1", list(range(1, 5)), ready_at=3.0)
    assert inflight.longest_prefix(list(range(1, 11))) == {"p0": (8, 10.0), "p1": (4, 3.0)}
    assert inflight.longest_prefix([1, 2, 3]) == {}  # shorter than a stride
    inflight.expire(9.0)  # p1's entry ended at 3 + 5
    assert inflight.longest_prefix(list(range(1, 11))) == {"p0": (8, 10.0)}
    inflight.expire(15.0)
    assert len(inflight) == 0

    heat = PrefixHeat(stride=2, window_s=10.0)
    for t in range(5):
        heat.add([1, 2, 3, 4], now=float(t))
    heat.add([1, 2, 7, 8], now=5.0)
    profile = heat.profile([1, 2, 3, 4, 5, 6], now=5.0)
    assert profile[0] > profile[1] > 0 and profile[2] == 0  # deeper strides are never hotter


@pytest.mark.timeout(30)
def test_an_attention_window_bounds_the_kv_a_request_needs_on_the_decode_side_and_moves_in_its_handoff():
    # A long session: prompt + max output far beyond the decode worker's KV memory (1,000 blocks of 16).
    loads = [prefill("p0"), WorkerLoad("d0", "decode", True, [], 0, 0, 1000, 1000, 16, NOW)]
    long_session = RouteRequest("r-long", 16_000, HASHES[:31], max_tokens=100_000)
    plain = conductor("tidepool").route(long_session, loads, index(), now=NOW)
    assert isinstance(plain, Reject) and "KV memory" in plain.reason
    windowed = RouteRequest("r-long", 16_000, HASHES[:31], max_tokens=100_000, max_kv_tokens=8_256)
    decision = conductor("tidepool").route(windowed, loads, index(), now=NOW)
    assert isinstance(decision, Decision)
    # ... and the hand-off moves only that window's worth of the prompt's KV
    c = conductor("tidepool")
    link = c.estimator.transfer.link("p0", "d0")
    window_s = link.latency_s + 8_256 * c.estimator.kv_bytes_per_token / link.bandwidth_Bps
    assert decision.est_transfer_s == pytest.approx(window_s)


@pytest.mark.timeout(30)
def test_a_conductor_asked_to_records_the_prompt_work_it_routes_and_the_sides_it_rejects_for():
    from router.planner import Demand

    c = conductor("tidepool", demand=Demand(window_s=60.0))
    dec = c.route(REQ, [prefill("p0"), prefill("p1"), decode("d0")], index(p0=31), now=NOW)
    other = RouteRequest("r2", REQ.prompt_len, [h + 100 for h in HASHES], REQ.max_tokens)  # no prefix in flight
    assert isinstance(c.route(other, OVERLOADED, index(), now=NOW + 1), Reject)
    window = c.demand.window(NOW + 2)
    cached = dec.cached_blocks * BS
    new = REQ.prompt_len - cached
    routed = (new * cached + new * (new + 1) / 2, new, 1.0)
    rejected = prefill_features(other.prompt_len, 0)  # offered load too (nothing of it cached)
    assert window.prompt_features == pytest.approx(tuple(a + b for a, b in zip(routed, rejected, strict=True)))
    assert window.rejected == {"prefill"}  # the TTFT rejection: more prefill workers would have taken it
    assert conductor("tidepool").demand is None  # recorded only for an autoscaler


def test_a_rejection_no_number_of_workers_avoids_asks_the_autoscaler_for_none():
    """A prompt whose compute alone, on an idle worker with every cached block, outlasts the TTFT SLO is
    rejected on an idle cluster too: it is no sign of too few prefill workers (a planner reading it as one
    grew a simulated cluster to its maximum on the Mooncake trace's longest prompts). One rejected for its
    queue is, and its prompt counts as load."""
    from router.planner import Demand

    c = conductor("tidepool", demand=Demand(window_s=60.0))
    huge = RouteRequest("huge", 64 * 32 * BS, list(range(500, 500 + 64 * 32)), 256)  # ~2 M tokens
    assert c.route(huge, [prefill("p0"), prefill("p1"), decode("d0", free=10**9)], index(), now=NOW).reason == "ttft"
    assert c.demand.window(NOW + 1).rejected == frozenset()
    other = RouteRequest("r2", REQ.prompt_len, [h + 100 for h in HASHES], REQ.max_tokens)
    assert c.route(other, OVERLOADED, index(), now=NOW).reason == "ttft"  # queued too long: more would help
    window = c.demand.window(NOW + 1)
    assert window.rejected == {"prefill"}
    # ... and its prompt is load the cluster should have carried
    assert window.prompt_features == pytest.approx(prefill_features(REQ.prompt_len, 0))
