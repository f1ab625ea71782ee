"""The whole system as users drive it: load tests against a live server, `tidepool status`, shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest
import ray
from live_helpers import wait_until

from loadtest.runner import BenchConfig, run_benchmark
from services.local_redis import free_port
from services.status import fetch_status, render_status

pytestmark = [pytest.mark.ray, pytest.mark.redis]

TRACE_ROWS = [  # Mooncake format: one hash id per 512-token block; ids 1-2 are a shared prefix
    {"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
    {"timestamp": 100, "input_length": 1300, "output_length": 6, "hash_ids": [1, 2, 3]},
    {"timestamp": 200, "input_length": 700, "output_length": 5, "hash_ids": [4, 5]},
    {"timestamp": 300, "input_length": 1536, "output_length": 7, "hash_ids": [1, 2, 6]},
]


@pytest.mark.timeout(180)
def test_mooncake_replay_against_the_live_server_accounts_for_every_request(live_server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in TRACE_ROWS))
    result = run_benchmark(BenchConfig(
        model=live_server.model_id, base_url=live_server.http_url, workload="mooncake", trace=str(trace),
        length_scale=0.125, time_scale=0.5, result_json=str(tmp_path / "result.json"),
        plot_dir=str(tmp_path / "plots"), progress=False, print_table=False,
    ))
    assert result["completed"] + result["failed"] + result["rejected"] == result["sent"] == len(TRACE_ROWS)
    assert result["completed"] == len(TRACE_ROWS)
    assert result["total_cached_tokens"] > 0  # rows 2 and 4 reuse row 1's blocks
    assert json.loads((tmp_path / "result.json").read_text())["completed"] == len(TRACE_ROWS)
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {"ttft_cdf.png", "tpot_cdf.png"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["openai", "grpc"])
def test_chat_sessions_against_the_live_server(live_server, tmp_path, backend):
    result = run_benchmark(BenchConfig(
        model=live_server.model_id, backend=backend, base_url=live_server.http_url,
        target=live_server.grpc_target, workload="chat", num_users=2, turns=3, think_time_s=0.0,
        input_len=40, output_len=6, prefix_len=64, result_json=str(tmp_path / "chat.json"),
        progress=False, print_table=False,
    ))
    assert result["completed"] + result["failed"] + result["rejected"] == result["sent"] == 6
    assert result["completed"] == 6
    assert result["total_cached_tokens"] > 0  # later turns reuse the history's KV


@pytest.mark.timeout(180)
def test_status_marks_a_killed_worker_dead(start_server):
    server = start_server(prefill=1, decode=2, kv_transport="grpc", replace_workers=False)
    try:
        victim = server.dispatcher.workers["decode-1"]
        ray.kill(victim.actor)
        assert wait_until(lambda: server.dispatcher.alive_workers() == 2, 30)
        status = fetch_status(server.http_url)
        by_id = {w["id"]: w for w in status["workers"]}
        assert by_id["decode-1"]["alive"] is False
        assert by_id["decode-0"]["alive"] and by_id["prefill-0"]["alive"]
        assert status["redis"]["up"] is True
        table = render_status(status)
        assert "DEAD" in next(line for line in table.splitlines() if "decode-1" in line)
    finally:
        server.stop()


def _descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _stream_until_cut(url: str, model: str, got_text: threading.Event, events: list[str]) -> None:
    """A chat far longer than the test waits for: streamed until the server ends it."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me everything about tides."}],
            "stream": True, "max_tokens": 1500, "temperature": 0.0, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                events.append(line)
                if '"content"' in line:
                    got_text.set()
    except httpx.HTTPError as exc:  # the server may cut the connection rather than end the stream
        events.append(repr(exc))


@pytest.mark.timeout(240)
def test_serve_with_more_workers_than_cores_serves_and_stops_everything_on_sigterm_mid_stream(
        tmp_path, serving_model_dir):
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    # Three workers of one thread each on this machine's cores: the local Ray gets a logical CPU for each.
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--model", str(serving_model_dir), "--prefill", "2",
         "--decode", "1", "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--shutdown-timeout", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=Path(__file__).parents[1],
        start_new_session=True,
    )
    try:
        lines = []
        for line in proc.stdout:  # the launcher prints where it listens once it is ready
            lines.append(line)
            if "tidepool: serving" in line:
                break
        assert proc.poll() is None, "".join(lines)
        url = f"http://127.0.0.1:{http_port}"
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["workers"] == 3
        started = _descendants(proc.pid)
        names = {psutil.Process(p).name() for p in started if psutil.pid_exists(p)}
        assert any("redis-server" in n for n in names) and any("raylet" in n or "gcs" in n for n in names)
        got_text, events = threading.Event(), []
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        client = threading.Thread(target=_stream_until_cut, args=(url, model, got_text, events), daemon=True)
        client.start()
        assert got_text.wait(60), events
        proc.send_signal(signal.SIGTERM)  # while the long request streams
        rest, _ = proc.communicate(timeout=120)
        client.join(60)
        assert not client.is_alive()  # its stream ended with the server
        assert proc.returncode == 0 and "tidepool: stopped" in rest, rest
        output = "".join(lines) + rest
        # nothing after the teardown started a Ray of its own (a Ray call after ray.shutdown() would)
        assert output.count("Started a local Ray instance") == 1 and "Traceback" not in output, output
        assert wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                          for p in started), 60), \
            [psutil.Process(p).cmdline() for p in started if psutil.pid_exists(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
