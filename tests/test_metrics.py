"""The Prometheus metrics: vLLM's names and meanings, recorded however a request ends, clean for promtool.

The request path runs through the dispatcher with the fake workers of test_dispatcher.py and the
gateway's real `Generation` consumer; the exposition is scraped from the live server
(tests/conftest.py) after requests through the official `openai` client and checked with
`promtool check metrics` (Debian's `prometheus` package; `make setup` installs it). The Grafana
dashboard in deploy/ may only query series the server exposes.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
from live_helpers import greedy_chat, idle, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_dispatcher import PROMPT, FakeWorker, make_dispatcher

from engine.sampling_params import SamplingParams
from router.loads import WorkerLoad
from services.dispatcher import GenerateRequest
from services.gateway.generation import Generation
from services.load_reports import decode_load, load_board_key
from services.messages import Role
from services.metrics import Metrics, token_buckets

pytestmark = pytest.mark.timeout(240)

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana-dashboard.json"
CHAT = [{"role": "user", "content": "Which creatures live in a tide pool?"}]


# ---- the request path, with fake workers -----------------------------------------------------------------

class LateEndWorker(FakeWorker):
    """A decode stream whose end arrives well after its last event, as over Ray: by then the gateway has
    stopped reading, so nothing after the last event ever runs in the dispatcher."""

    async def _tokens(self, index: int, cached: int, first: bool = False):
        async for event in super()._tokens(index, cached, first):
            yield event
        await asyncio.sleep(60)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": metrics.model_name, **labels}) or 0.0


async def serve_one(dispatcher, leave_after: int | None = None) -> Generation:
    """One request as the HTTP gateway runs it; ``leave_after`` deltas, the client goes away."""
    await dispatcher.refresh_loads()
    params = SamplingParams(max_tokens=4, temperature=0.0)
    gen = Generation("r1", dispatcher.generate(GenerateRequest("r1", PROMPT, params)), 1)
    await gen.start()
    seen = 0
    async for _ in gen:
        seen += 1
        if seen == leave_after:
            break
    gen.close()
    await asyncio.sleep(0.05)  # the cancelled dispatcher generator runs its cleanup
    return gen


def test_a_request_is_recorded_even_though_the_consumer_never_reads_the_stream_end():
    dispatcher = make_dispatcher(FakeWorker("p0", Role.PREFILL), LateEndWorker("d0", Role.DECODE))
    gen = asyncio.run(serve_one(dispatcher))
    m = dispatcher.metrics
    tokens = gen.usage.completion_tokens  # the prefill side's first token + 3 decoded
    assert tokens == 4 and gen.finish_reasons == ["length"]
    assert sample(m, "tidepool_request_time_per_output_token_seconds_count") == 1
    assert sample(m, "tidepool_inter_token_latency_seconds_count") == tokens - 1
    assert sample(m, "tidepool_request_success_total", finished_reason="length") == 1
    assert sample(m, "tidepool_request_success_total", finished_reason="abort") == 0
    assert sample(m, "tidepool_generation_tokens_total") == tokens
    assert sample(m, "tidepool_prompt_tokens_total") == gen.usage.prompt_tokens == len(PROMPT)
    for phase in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
        assert sample(m, f"tidepool_{phase}_seconds_count") == 1, phase
    assert sample(m, "tidepool_request_generation_tokens_sum") == tokens
    assert sample(m, "tidepool_router_estimate_relative_error_count", estimate="ttft") == 1
    assert sample(m, "tidepool_kv_transfer_bytes_total", transport="grpc") == 1000  # the fake's PrefillResult


def test_a_client_that_leaves_mid_stream_counts_as_aborted_without_latencies():
    dispatcher = make_dispatcher(FakeWorker("p0", Role.PREFILL), LateEndWorker("d0", Role.DECODE))
    asyncio.run(serve_one(dispatcher, leave_after=2))
    m = dispatcher.metrics
    assert sample(m, "tidepool_request_success_total", finished_reason="abort") == 1
    assert sample(m, "tidepool_request_success_total", finished_reason="length") == 0
    assert sample(m, "tidepool_e2e_request_latency_seconds_count") == 0
    assert sample(m, "tidepool_request_time_per_output_token_seconds_count") == 0
    assert sample(m, "tidepool_time_to_first_token_seconds_count") == 1


def test_worker_reports_become_cluster_gauges_and_counter_increments():
    m = Metrics("tiny", 2048)

    def report(worker: str, role: str, **fields) -> None:
        m.set_worker_load(WorkerLoad(worker, role, total_blocks=100, **fields))

    # First reports: the baseline (start-up profiling), nothing counted yet.
    report("p0", "prefill", free_blocks=100, prefix_cache_queries=50, prefix_cache_hits=16, num_preemptions=1,
           prompt_tokens_computed=34)
    report("d0", "decode", free_blocks=60, num_running=3, num_waiting=2, waiting_leases=2, waiting_lease_blocks=70,
           spec_drafts=5, spec_draft_tokens=20, spec_accepted_tokens=9, spec_accepted_per_position=(5, 3, 1, 0))
    assert sample(m, "tidepool_prefix_cache_queries_total") == 0
    report("d0", "decode", free_blocks=60, num_running=3, num_waiting=2, waiting_leases=2, waiting_lease_blocks=70,
           spec_drafts=8, spec_draft_tokens=32, spec_accepted_tokens=16, spec_accepted_per_position=(8, 5, 2, 1))
    assert [sample(m, f"tidepool_spec_decode_num_{name}_total") for name in ("drafts", "draft_tokens",
                                                                            "accepted_tokens")] == [3, 12, 7]
    assert [sample(m, "tidepool_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(4)] == [3, 2, 1, 1]
    report("p0", "prefill", free_blocks=90, num_running=1, num_waiting=4, prefix_cache_queries=150,
           prefix_cache_hits=96, num_preemptions=3, prompt_tokens_computed=88,
           pool_hit_tokens={"host": 32, "redis": 16})
    assert sample(m, "tidepool_prefix_cache_queries_total") == 100
    assert sample(m, "tidepool_prefix_cache_hits_total") == 80
    assert sample(m, "tidepool_num_preemptions_total") == 2
    assert sample(m, "tidepool_worker_preemptions_total", worker="p0", role="prefill") == 2
    assert sample(m, "tidepool_worker_preemptions_total", worker="d0", role="decode") == 0
    by_source = {s: sample(m, "tidepool_prompt_tokens_by_source_total", source=s)
                 for s in ("local_compute", "local_cache_hit", "pool_host", "pool_redis", "pool_disk")}
    # the engine's hits include the pool's placements: 96 - 48 local now, 16 at the baseline
    assert by_source == {"local_compute": 54, "local_cache_hit": 32, "pool_host": 32, "pool_redis": 16,
                         "pool_disk": 0}
    assert sample(m, "tidepool_num_requests_running") == 4 and sample(m, "tidepool_num_requests_waiting") == 6
    assert sample(m, "tidepool_kv_cache_usage_perc") == pytest.approx(50 / 200)
    # Blocks that waiting leases are owed are not in use yet: the usage stays the engine's.
    assert sample(m, "tidepool_worker_kv_cache_usage_perc", worker="d0", role="decode") == pytest.approx(0.4)
    assert sample(m, "tidepool_worker_waiting_leases", worker="d0", role="decode") == 2
    assert sample(m, "tidepool_worker_decode_time_ratio", worker="d0", role="decode") == 1.0  # none given: as modelled
    m.set_worker_load(WorkerLoad("d0", "decode", free_blocks=60), prefill_ratio=1.5, decode_ratio=2.0)
    assert sample(m, "tidepool_worker_prefill_time_ratio", worker="d0", role="decode") == 1.5
    assert sample(m, "tidepool_worker_decode_time_ratio", worker="d0", role="decode") == 2.0
    # A report with lower counts (never from a live worker) takes nothing back.
    report("p0", "prefill", free_blocks=90, prefix_cache_queries=10)
    assert sample(m, "tidepool_prefix_cache_queries_total") == 100
    m.set_worker_load(WorkerLoad("d0", "decode", alive=False))
    for gone in ("tidepool_worker_kv_blocks_used", "tidepool_worker_preemptions_total"):
        assert m.registry.get_sample_value(gone, {"model_name": "tiny", "worker": "d0", "role": "decode"}) is None
    assert sample(m, "tidepool_num_requests_running") == 0


def test_lora_requests_info_names_the_clusters_running_and_waiting_adapters_in_one_series():
    m = Metrics("tiny", 2048)

    def lora_series() -> list[dict[str, str]]:
        found = [s for f in text_string_to_metric_families(m.render().decode()) for s in f.samples
                 if s.name == "tidepool_lora_requests_info"]
        return [{k: v for k, v in s.labels.items() if k != "model_name"} for s in found]

    m.set_worker_load(WorkerLoad("p0", "prefill", total_blocks=10))
    assert lora_series() == []  # no LoRA slots: not exported, as vLLM without LoRA
    m.set_worker_load(WorkerLoad("p0", "prefill", total_blocks=10, max_loras=2, running_loras=("crab",),
                                 waiting_loras=("kelp",)))
    m.set_worker_load(WorkerLoad("d0", "decode", total_blocks=10, max_loras=2, running_loras=("kelp", "crab")))
    assert lora_series() == [{"max_lora": "2", "running_lora_adapters": "crab,kelp", "waiting_lora_adapters": "kelp"}]
    m.set_worker_load(WorkerLoad("p0", "prefill", total_blocks=10, max_loras=3))
    m.set_worker_load(WorkerLoad("d0", "decode", alive=False))
    # one series, the latest: the label sets of earlier scrapes are gone
    assert lora_series() == [{"max_lora": "3", "running_lora_adapters": "", "waiting_lora_adapters": ""}]


def test_token_histograms_use_vllms_1_2_5_buckets_up_to_the_context_length():
    assert token_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


# ---- the live server -------------------------------------------------------------------------------------

def scrape(server) -> tuple[str, list]:
    text = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    return text, list(text_string_to_metric_families(text))


def total(families: list, name: str, **labels: str) -> float:
    return sum(s.value for f in families for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def exposed_series(families: list) -> set[str]:
    """Every sample name each family can expose, whether or not it has samples yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + s for f in families for s in suffixes.get(f.type, ("",))}


def run_requests(server) -> list[tuple[str, int, int, int]]:
    """(finish reason, prompt, completion, cached tokens) of each request, as the client saw them."""
    c = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0, timeout=120)
    every_token = list(range(server.dispatcher.tokenizer.vocab_size))  # the first token ends the request
    seen = []
    for max_tokens, extra in ((5, {}), (3, {}), (6, {}), (4, {"stop_token_ids": every_token})):
        resp = c.chat.completions.create(model=server.model_id, messages=CHAT, max_tokens=max_tokens,
                                         temperature=0.0, extra_body={"ignore_eos": True, **extra})
        u = resp.usage
        seen.append((resp.choices[0].finish_reason, u.prompt_tokens, u.completion_tokens,
                     u.prompt_tokens_details.cached_tokens))
    stream = c.chat.completions.create(model=server.model_id, messages=CHAT, max_tokens=7, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    reason = next(ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    u = chunks[-1].usage
    seen.append((reason, u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens))
    return seen


@pytest.mark.ray
@pytest.mark.redis
def test_live_metrics_pass_promtool_and_match_what_the_client_saw(live_server):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; `make setup` installs it)")
    assert wait_until(lambda: idle(live_server), 60)
    _, before = scrape(live_server)
    seen = run_requests(live_server)
    prompt, completion, cached = (sum(r[i] for r in seen) for i in (1, 2, 3))
    reasons = [r[0] for r in seen]
    assert reasons.count("stop") == 1 and reasons.count("length") == 4

    def delta(after: list, name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    # The prefix-cache counters come with the workers' next load reports.
    queries = "tidepool_prefix_cache_queries_total"
    assert wait_until(lambda: delta(scrape(live_server)[1], queries) == prompt, 10)
    text, after = scrape(live_server)
    assert delta(after, "tidepool_prompt_tokens_total") == prompt
    assert delta(after, "tidepool_generation_tokens_total") == completion
    assert delta(after, "tidepool_prefix_cache_hits_total") == cached > 0  # the same prompt, five times
    for reason in ("stop", "length"):
        assert delta(after, "tidepool_request_success_total", finished_reason=reason) == reasons.count(reason)
    several = sum(1 for r in seen if r[2] > 1)
    assert delta(after, "tidepool_request_time_per_output_token_seconds_count") == several
    assert delta(after, "tidepool_inter_token_latency_seconds_count") == completion - len(seen)
    assert delta(after, "tidepool_time_to_first_token_seconds_count") == len(seen)
    assert delta(after, "tidepool_router_estimate_relative_error_count", estimate="ttft") == len(seen)
    assert 0.0 <= total(after, "tidepool_kv_cache_usage_perc") <= 1.0
    transports = {s.labels["transport"] for f in after for s in f.samples
                  if s.name.startswith("tidepool_kv_transfer")}
    assert transports == {"grpc"}  # the transport used, never the configured "auto"
    assert delta(after, "tidepool_kv_transfer_seconds_count", transport="grpc") == reasons.count("length")
    assert {s.labels["model_name"] for f in after for s in f.samples} == {live_server.model_id}

    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), \
        check.stdout + check.stderr


@pytest.mark.ray
@pytest.mark.redis
def test_speculative_decoding_counters_follow_the_decode_workers_drafts(live_server):
    """The live server's decode worker drafts (conftest): a long greedy answer that repeats itself shows up
    as drafts, draft tokens and accepted tokens, the accepted ones also counted by draft position."""
    assert wait_until(lambda: idle(live_server), 60)
    _, before = scrape(live_server)
    c = openai.OpenAI(base_url=f"{live_server.http_url}/v1", api_key="none", max_retries=0, timeout=120)
    c.chat.completions.create(model=live_server.model_id, messages=[{"role": "user", "content": "abc " * 20}],
                              max_tokens=64, temperature=0.0, extra_body={"ignore_eos": True})
    names = ("tidepool_spec_decode_num_drafts_total", "tidepool_spec_decode_num_draft_tokens_total",
             "tidepool_spec_decode_num_accepted_tokens_total")

    def deltas() -> list[float]:
        after = scrape(live_server)[1]
        return [total(after, name) - total(before, name) for name in (*names,
                "tidepool_spec_decode_num_accepted_tokens_per_pos_total")]

    assert wait_until(lambda: deltas()[2] > 0, 10)  # the counts come with the worker's next load report
    drafts, draft_tokens, accepted, per_position = deltas()
    assert 0 < drafts <= draft_tokens <= 4 * drafts and accepted <= draft_tokens
    assert per_position == accepted
    after = scrape(live_server)[1]
    assert total(after, "tidepool_spec_decode_num_accepted_tokens_per_pos_total", position="0") >= \
        total(after, "tidepool_spec_decode_num_accepted_tokens_per_pos_total", position="1")


@pytest.mark.ray
@pytest.mark.redis
def test_the_workers_write_their_load_reports_on_the_board_and_the_router_reads_them(live_server):
    """Each worker writes its report on the cluster's load board: after a chat, both workers' reports there
    show the steps they ran, and the router counts the reports it took from the board."""
    import redis

    cluster = live_server.server.cluster
    steps = {worker_id: load.steps for worker_id, load in cluster.dispatcher.loads.items()}
    from_board = total(scrape(live_server)[1], "tidepool_load_reports_total", via="board")
    greedy_chat(live_server, "Which creatures live in a tide pool?", 8)
    with redis.Redis.from_url(cluster.redis_url) as client:
        def both_stepped() -> bool:
            board = client.hgetall(load_board_key(cluster.cluster_id))
            return all(w.encode() in board and decode_load(board[w.encode()]).steps > steps[w] for w in steps)

        assert wait_until(both_stepped, 30)
    assert total(scrape(live_server)[1], "tidepool_load_reports_total", via="board") > from_board
    # what `tidepool status` shows: how old the router's view of each worker is
    rows = httpx.get(f"{live_server.http_url}/v1/cluster/status", timeout=30).json()["workers"]
    assert {row["id"] for row in rows} == steps.keys() and all(row["report_age_s"] >= 0.0 for row in rows)


@pytest.mark.ray
@pytest.mark.redis
def test_scrapes_are_not_api_requests_and_head_answers_with_headers(live_server):
    for _ in range(3):
        assert httpx.get(f"{live_server.http_url}/metrics").status_code == 200
    head = httpx.head(f"{live_server.http_url}/metrics")
    assert head.status_code == 200 and head.headers["content-type"].startswith("text/plain")
    assert head.content == b""
    _, families = scrape(live_server)
    apis = {s.labels["api"] for f in families for s in f.samples if s.name == "tidepool_requests_total"}
    assert "/metrics" not in apis


@pytest.mark.ray
@pytest.mark.redis
def test_dashboard_queries_only_series_the_server_exposes(live_server):
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for row in dashboard["panels"] for p in (row, *row.get("panels", ()))]
    exprs = [t["expr"] for p in panels for t in p.get("targets", ())]
    assert dashboard["title"] and dashboard["schemaVersion"] >= 30 and len(exprs) >= 10
    exposed = exposed_series(scrape(live_server)[1])
    for expr in exprs:
        names = re.findall(r"\btidepool_[a-z0-9_]+", expr)
        assert names, expr
        assert set(names) <= exposed, (expr, set(names) - exposed)
