"""Resizing a running cluster (services/scaling.py, `tidepool scale`): a worker added while serving takes
requests, a drained one is routed nothing more, keeps what runs on it until it ends (or its timeout, after
which the request resumes elsewhere without a gap), then is stopped; the last worker of a role is kept."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import ray
from live_helpers import Streams, greedy_chat, idle, wait_until
from prometheus_client.parser import text_string_to_metric_families

from services.cli import main
from services.in_flight import InFlight
from services.scale_cli import plan

# ---- the parts -------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_an_attempt_counts_on_its_workers_while_it_runs_and_on_its_prefill_worker_until_the_handoff():
    in_flight = InFlight()

    async def events():
        yield 1
        use.release("prefill-0")  # the handoff
        yield 2

    async def run() -> list[tuple[int, int]]:
        seen = []
        async for _ in use.during(events()):
            seen.append((in_flight.count("prefill-0"), in_flight.count("decode-0")))
        return seen

    use = in_flight.use("prefill-0", "decode-0")
    assert asyncio.run(run()) == [(1, 1), (0, 1)]
    assert (in_flight.count("prefill-0"), in_flight.count("decode-0")) == (0, 0)
    never_started = in_flight.use("decode-0").during(events())
    asyncio.run(never_started.aclose())
    assert in_flight.count("decode-0") == 0


@pytest.mark.timeout(10)
def test_scale_adds_the_missing_workers_and_drains_the_dead_then_the_least_busy_then_the_newest():
    def row(worker_id: str, alive: bool = True, running: int = 0, draining: bool = False) -> dict:
        return {"id": worker_id, "role": worker_id.split("-")[0], "alive": alive, "running": running,
                "waiting": 0, "draining": draining}

    workers = [row("prefill-0"), row("decode-0", running=3), row("decode-1"), row("decode-2", alive=False),
               row("decode-3"), row("decode-4", draining=True)]
    assert plan(workers, {"prefill": 3, "decode": 4}) == (["prefill", "prefill"], [])
    assert plan(workers, {"decode": 2}) == ([], ["decode-2", "decode-3"])
    assert plan(workers, {"decode": 1, "prefill": 1}) == ([], ["decode-2", "decode-3", "decode-1"])


# ---- a live cluster ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scaled_server(start_server):
    server = start_server(prefill=1, decode=1, kv_transport="grpc")
    yield server
    server.stop()


def _workers(server, role: str) -> list[dict]:
    return [w for w in server.worker_stats() if w["role"] == role]


def _counter(server, name: str, **labels: str) -> float:
    """A counter's value on the server's /metrics (0 before its first increment)."""
    text = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def _scale(server, *flags: str) -> int:
    return main(["scale", "--url", server.http_url, *flags])


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_workers_added_while_serving_take_over_from_a_drained_one_and_scale_drains_the_newest(scaled_server, capsys):
    server = scaled_server
    text = "Scaling: which way does the tide turn?"
    expected = greedy_chat(server, text, 8)
    changes = {change: _counter(server, "tidepool_worker_changes_total", role="decode", change=change)
               for change in ("added", "drained")}
    assert _scale(server, "--decode", "3") == 0
    out = capsys.readouterr().out
    assert "added decode-1 (decode) on " in out and "added decode-2 (decode) on " in out
    original = server.dispatcher.workers["decode-0"]
    assert [w["alive"] for w in _workers(server, "decode")] == [True, True, True]
    drained = httpx.delete(f"{server.http_url}/v1/cluster/workers/decode-0", timeout=120).json()
    assert (drained["id"], drained["role"], drained["resumed"]) == ("decode-0", "decode", 0)
    def stopped() -> bool:  # its resources are Ray's again (ray.kill takes effect a moment after it returns)
        try:
            ray.get(original.actor.load.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return True
        return False
    assert wait_until(stopped, 30)
    assert greedy_chat(server, text, 8) == expected  # served by the added workers
    assert wait_until(lambda: idle(server), 30)  # the reports no longer count the chat as running
    assert _scale(server, "--decode", "1", "--drain-timeout-s", "30") == 0
    assert "drained decode-2 (decode)" in capsys.readouterr().out  # the newest of two idle ones
    assert [w["id"] for w in _workers(server, "decode")] == ["decode-1"]
    assert greedy_chat(server, text, 8) == expected
    assert _scale(server, "--decode", "1") == 0 and "nothing to change" in capsys.readouterr().out
    assert {change: _counter(server, "tidepool_worker_changes_total", role="decode", change=change) - before
            for change, before in changes.items()} == {"added": 2, "drained": 2}


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(300)
@pytest.mark.parametrize("timeout_s", [60.0, 0.0])
def test_a_drain_waits_for_the_stream_on_its_worker_and_past_its_timeout_the_stream_resumes_without_a_gap(
        scaled_server, timeout_s):
    server = scaled_server
    text = f"Drain {timeout_s:g}: how do the tides reach the pools at the edge of the shore?"
    expected = greedy_chat(server, text, 300)
    resumed = _counter(server, "tidepool_requests_resumed_total")
    added = httpx.post(f"{server.http_url}/v1/cluster/workers", json={"role": "decode"}, timeout=300)
    assert added.status_code == 201 and added.json()["alive"], added.text
    streams = Streams(server, [text], 300)
    assert streams.wait_started()
    (busy,) = [w for w in server.dispatcher.workers.values() if w.role == "decode"
               and server.dispatcher.in_flight.count(w.worker_id)]
    drained = httpx.delete(f"{server.http_url}/v1/cluster/workers/{busy.worker_id}",
                           params={"timeout_s": timeout_s}, timeout=120).json()
    assert (drained["id"], drained["drained"], drained["resumed"]) == (busy.worker_id, True, 0 if timeout_s else 1)
    assert streams.join() == [expected]  # no token missing, none repeated, none different
    assert _counter(server, "tidepool_requests_resumed_total") - resumed == (0 if timeout_s else 1)
    assert busy.worker_id not in {w["id"] for w in server.worker_stats()}
    assert len(_workers(server, "decode")) == 1 and wait_until(lambda: idle(server), 30)


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_what_cannot_be_resized_is_refused_naming_why(scaled_server):
    url = f"{scaled_server.http_url}/v1/cluster/workers"
    (decode,) = _workers(scaled_server, "decode")
    last = httpx.delete(f"{url}/{decode['id']}", timeout=30)
    assert last.status_code == 409 and "last live decode worker" in last.json()["error"]["message"]
    assert httpx.delete(f"{url}/decode-9", timeout=30).status_code == 404
    colocated = httpx.post(url, json={"role": "colocated"}, timeout=30)
    assert colocated.status_code == 409 and "not colocated ones" in colocated.json()["error"]["message"]
    assert httpx.post(url, json={"role": "router"}, timeout=30).status_code == 400
    assert httpx.delete(f"{url}/{decode['id']}", params={"timeout_s": -1}, timeout=30).status_code == 400
    assert [w["id"] for w in _workers(scaled_server, "decode")] == [decode["id"]]
