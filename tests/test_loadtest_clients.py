"""Clients and runner against real servers on loopback: a small OpenAI-compatible FastAPI app that streams
deterministic chunks with known sleeps, and a gRPC ``Serving`` server. Checks SSE parsing, timing capture,
usage and cached tokens, 429 handling, request accounting, result JSON and plots, and that an interrupted
run still writes what it measured."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loadtest.cli import add_bench_parser
from loadtest.clients import GrpcClient, OpenAIClient, RequestRecord, sse_lines
from loadtest.runner import BenchConfig, run_benchmark
from loadtest.workloads import RequestSpec
from router.trace import TraceError
from tidepool.v1 import serving_pb2, serving_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
CACHED = 7


@dataclass
class ServerState:
    first_delay_s: float = 0.0
    gap_s: float = 0.0
    reject_every: int = 0  # every n-th request (1-based) gets a 429
    fast_requests: int | None = None  # requests after this many hang after their first token
    requests: list[dict] = field(default_factory=list)
    completed: int = 0
    streaming: int = 0
    max_streaming: int = 0


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _sse_raw_text_crlf(obj) -> str:
    """As a server may also send events: UTF-8 text unescaped in the JSON, lines ended by CRLF."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\r\n\r\n"


LINE_BREAKS = "\u2028\x85\u2029"  # line ends to str.splitlines, text to JSON and SSE


def make_app(state: ServerState) -> FastAPI:
    app = FastAPI()

    async def respond(request: Request, chat: bool):
        body = await request.json()
        state.requests.append({"path": request.url.path, "body": body, "headers": dict(request.headers)})
        index = len(state.requests)
        model = body["model"]
        if model == "reject" or (state.reject_every and index % state.reject_every == 0):
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=429, headers={"Retry-After": "3"})
        if model == "broken":
            return JSONResponse({"error": {"message": "internal"}}, status_code=500)
        prompt = "".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        n, hang = body["max_tokens"], state.fast_requests is not None and index > state.fast_requests
        sse = _sse_raw_text_crlf if model == "line-breaks" else _sse

        def chunk(i: int) -> dict:
            finish = "length" if i == n - 1 else None
            piece = f"t{i}{LINE_BREAKS if model == 'line-breaks' else ''} "
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            return {"id": "x", "choices": [{**choice, "finish_reason": finish}]}

        async def stream():
            state.streaming += 1
            state.max_streaming = max(state.max_streaming, state.streaming)
            try:
                async for event in events():
                    yield event
            finally:
                state.streaming -= 1

        async def events():
            yield ": ping\n\n"  # an SSE comment, as servers send for keep-alive
            if chat:  # the role-only chunk servers send before any token exists
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(state.first_delay_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(state.gap_s)
                if model == "midstream-error" and i == 2:
                    yield sse({"error": {"message": "engine died"}})
                    return
                yield sse(chunk(i))
                if hang:
                    await asyncio.sleep(60)
            if model != "no-usage" and body.get("stream_options", {}).get("include_usage"):
                yield sse({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                                     "prompt_tokens_details": {"cached_tokens": CACHED}}})
            yield "data: [DONE]\n\n"
            state.completed += 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, chat=True)

    return app


@pytest.fixture(scope="module")
def http_server():
    state = ServerState()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield state, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def server(http_server):
    state, url = http_server
    state.__init__()  # fresh behaviour and request log per test
    return state, url


def _send(url: str, spec: RequestSpec, model: str = "m") -> RequestRecord:
    async def go():
        client = OpenAIClient(url, model)
        try:
            return await client.send(spec, RequestRecord(spec.request_id, prompt_tokens=spec.prompt_len))
        finally:
            await client.aclose()
    return asyncio.run(go())


@pytest.mark.timeout(60)
def test_completions_stream_is_parsed_with_chunk_times_and_usage(server):
    state, url = server
    state.first_delay_s, state.gap_s = 0.2, 0.05
    rec = _send(url, RequestSpec("r1", prompt_len=5, max_tokens=4, prompt="hello"))
    assert rec.status == "ok" and rec.generated_text == "t0 t1 t2 t3 "
    assert len(rec.chunk_s) == 4 and len(rec.itl_s) == 3
    # Each chunk is timed when it arrives: none before the server sent it (two sent 50 ms apart may still be
    # read together by a busy client, so no single gap is bounded below).
    sent_by = [0.2 + i * 0.05 for i in range(4)]
    assert all(t >= s * 0.8 for t, s in zip(rec.chunk_s, sent_by, strict=True)) and min(rec.itl_s) >= 0
    assert rec.latency_s >= rec.chunk_s[-1]
    assert (rec.output_tokens, rec.prompt_tokens, rec.cached_tokens) == (4, 5, CACHED)
    sent = state.requests[0]
    assert sent["path"] == "/v1/completions" and sent["headers"]["x-request-id"] == "r1"
    assert sent["body"]["stream"] is True and sent["body"]["stream_options"] == {"include_usage": True}
    assert sent["body"]["ignore_eos"] is True and sent["body"]["max_tokens"] == 4


@pytest.mark.timeout(60)
def test_events_split_only_at_cr_and_lf_keep_unicode_line_breaks_in_their_text(server):
    _, url = server
    rec = _send(url, RequestSpec("r1", prompt_len=5, max_tokens=3, prompt="hello"), model="line-breaks")
    assert rec.status == "ok", rec.error
    assert rec.generated_text == "".join(f"t{i}{LINE_BREAKS} " for i in range(3)) and len(rec.chunk_s) == 3
    assert rec.output_tokens == 3


@pytest.mark.timeout(10)
def test_sse_lines_join_a_crlf_cut_between_chunks_and_end_lines_only_at_cr_and_lf():
    chunks = ["data: a\r", "\n\r\ndata: b\u2028c\x85\n", "\ndata: d\rdata: e\r", "\r", "data: f"]

    async def lines() -> list[str]:
        async def text():
            for chunk in chunks:
                yield chunk
        return [line async for line in sse_lines(text())]

    assert asyncio.run(lines()) == ["data: a", "", "data: b\u2028c\x85", "", "data: d", "data: e", "", "data: f"]


@pytest.mark.timeout(60)
def test_chat_ttft_skips_the_role_only_chunk(server):
    state, url = server
    state.first_delay_s = 0.3
    spec = RequestSpec("r2", prompt_len=2, max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                       session_id="s-1")
    rec = _send(url, spec)
    assert rec.status == "ok" and rec.generated_text == "t0 t1 t2 "
    assert rec.ttft_s >= 0.3 * 0.8  # the role chunk arrived at once; the first token only after the delay
    assert len(rec.chunk_s) == 3
    sent = state.requests[0]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["headers"]["x-session-id"] == "s-1" and sent["body"]["session_id"] == "s-1"


@pytest.mark.timeout(60)
def test_output_tokens_fall_back_to_chunks_without_usage(server):
    _, url = server
    rec = _send(url, RequestSpec("r3", prompt_len=9, max_tokens=5, prompt="x"), model="no-usage")
    assert rec.status == "ok" and rec.output_tokens == 5 and rec.prompt_tokens == 9 and rec.cached_tokens == 0


@pytest.mark.timeout(60)
def test_429_is_rejected_with_retry_after_and_errors_are_failures(server):
    _, url = server
    spec = RequestSpec("r4", prompt_len=1, max_tokens=3, prompt="x")
    rejected = _send(url, spec, model="reject")
    assert rejected.status == "rejected" and rejected.retry_after_s == 3.0 and "429" in rejected.error
    broken = _send(url, spec, model="broken")
    assert broken.status == "failed" and "HTTP 500" in broken.error
    midstream = _send(url, RequestSpec("r5", prompt_len=1, max_tokens=5, prompt="x"), model="midstream-error")
    assert midstream.status == "failed" and "engine died" in midstream.error
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    refused = _send(dead, spec)
    assert refused.status == "failed" and "ConnectError" in refused.error


@pytest.mark.timeout(60)
def test_run_accounts_every_request_and_writes_json_and_plots(server, tmp_path):
    state, url = server
    state.reject_every = 3
    result = run_benchmark(BenchConfig(
        model="m", base_url=url + "/v1", workload="random", num_prompts=6, input_len=20, output_len=3,
        max_concurrency=2, request_rate=50.0, goodput={"ttft": 10_000}, result_json=str(tmp_path / "r.json"),
        plot_dir=str(tmp_path / "plots"), progress=False, print_table=False, save_detailed=True))
    assert result["sent"] == 6 == result["completed"] + result["failed"] + result["rejected"]
    assert (result["completed"], result["rejected"], result["failed"]) == (4, 2, 0)
    assert result["total_output_tokens"] == 12 and result["total_cached_tokens"] == 4 * CACHED
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["interrupted"] is False and 1 <= state.max_streaming <= 2  # --max-concurrency 2
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["completed"] == 4 and "p99_itl_ms" in on_disk and len(on_disk["itls"]) == 6
    assert "api_key" not in on_disk["config"]
    for name in ("ttft_cdf.png", "tpot_cdf.png", "throughput.png", "inflight.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_session", [True, False])
def test_chat_workload_sends_sessions_or_full_history(server, use_session):
    state, url = server
    result = run_benchmark(BenchConfig(
        model="m", base_url=url, workload="chat", num_users=2, turns=3, think_time_s=0.0, input_len=12,
        output_len=2, use_session=use_session, progress=False, print_table=False))
    assert result["completed"] == 6
    by_session: dict[str, list[dict]] = {}
    for r in state.requests:
        key = r["headers"].get("x-session-id") or r["body"]["messages"][0]["content"]
        by_session.setdefault(key, []).append(r["body"])
    assert len(by_session) == 2
    for bodies in by_session.values():
        last = bodies[-1]["messages"]
        if use_session:
            assert [len(b["messages"]) for b in bodies] == [1, 1, 1]
            assert bodies[0]["session_id"] == bodies[-1]["session_id"]
        else:
            assert [len(b["messages"]) for b in bodies] == [1, 3, 5]
            assert [m["content"] for m in last if m["role"] == "assistant"] == ["t0 t1 ", "t0 t1 "]
            assert "session_id" not in bodies[-1]


def _trace(path: Path, rows: list[dict], bad_line: str | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    if bad_line is not None:
        lines.insert(2, bad_line)
    path.write_text("\n".join(lines) + "\n")
    return path


ROWS = [
    {"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [11, 12]},
    {"timestamp": 40, "input_length": 1500, "output_length": 64, "hash_ids": [11, 12, 13]},
    {"timestamp": 80, "input_length": 600, "output_length": 64, "hash_ids": [14, 15]},
]


@pytest.mark.timeout(60)
def test_mooncake_replay_sends_shared_prefixes(server, tmp_path):
    state, url = server
    result = run_benchmark(BenchConfig(
        model="m", base_url=url, workload="mooncake", trace=str(_trace(tmp_path / "t.jsonl", ROWS)),
        length_scale=16 / 512, time_scale=0.5, progress=False, print_table=False))
    assert result["completed"] == 3 and result["total_output_tokens"] == 6
    prompts = [r["body"]["prompt"] for r in sorted(state.requests, key=lambda r: r["headers"]["x-request-id"])]
    assert prompts[1].startswith(prompts[0]) and len(prompts[0]) == 32 and len(prompts[1]) == 47
    assert prompts[2][:16] != prompts[0][:16]


@pytest.mark.timeout(60)
def test_malformed_trace_is_reported_before_any_request(server, tmp_path, capsys):
    import argparse

    state, url = server
    path = _trace(tmp_path / "t.jsonl", ROWS, bad_line='{"timestamp": 3, "input_length": "many"}')
    with pytest.raises(TraceError) as info:
        run_benchmark(BenchConfig(model="m", base_url=url, workload="mooncake", trace=str(path), progress=False))
    assert info.value.line == 3
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--base-url", url, "--model", "m", "--workload", "mooncake",
                              "--trace", str(path)])
    assert args.func(args) == 2
    assert f"{path}:3: " in capsys.readouterr().err
    assert state.requests == []


@pytest.mark.timeout(60)
def test_interrupted_run_still_writes_results(server, tmp_path):
    state, url = server
    state.fast_requests = 2  # the first two requests finish; later ones hang after one token
    out = tmp_path / "r.json"
    # The child takes Ctrl-C as a terminal gives it: a suite started in the background (bash without job
    # control) ignores SIGINT, and a child inherits that, so the signal below would do nothing.
    cmd = [sys.executable, "-c",
           "import argparse, signal, sys\n"
           "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
           "from loadtest.cli import add_bench_parser\n"
           "p = argparse.ArgumentParser(); add_bench_parser(p.add_subparsers())\n"
           "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n",
           "bench", "--base-url", url, "--model", "m", "--num-prompts", "5", "--input-len", "8",
           "--output-len", "3", "--max-concurrency", "2", "--result-json", str(out),
           "--plot", str(tmp_path / "plots"), "--disable-tqdm"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # With two slots, the 3rd and 4th requests reach the server only once the client has finished the
        # first two; the 5th waits for a slot that never frees, so it is never sent.
        deadline = time.time() + 40
        while len(state.requests) < 4 and time.time() < deadline:
            time.sleep(0.05)
        assert len(state.requests) == 4
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    result = json.loads(out.read_text())
    assert result["interrupted"] is True and result["planned"] == 5
    assert (result["sent"], result["completed"], result["failed"]) == (4, 2, 2), result["error_samples"]
    assert result["error_samples"] == ["interrupted"]
    assert "Serving Benchmark Result" in stdout
    assert (tmp_path / "plots" / "inflight.png").exists()


class Servicer(serving_pb2_grpc.ServingServicer):
    """Streams three chunks; model "reject" is refused like an overloaded Tidepool gateway."""

    def __init__(self):
        self.requests = []

    def _stream(self, request, context, prompt_len):
        self.requests.append(request)
        if request.model == "reject":
            context.set_trailing_metadata((("retry-after", "2"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no capacity")
        for i in range(3):
            time.sleep(0.02)
            yield serving_pb2.GenerateChunk(text=f"g{i}", token_ids=[i, i])
        yield serving_pb2.GenerateChunk(finish_reason="length", usage=serving_pb2.Usage(
            prompt_tokens=prompt_len, completion_tokens=6, cached_tokens=CACHED))

    def Chat(self, request, context):
        yield from self._stream(request, context, sum(len(m.content) for m in request.messages))

    def Complete(self, request, context):
        yield from self._stream(request, context, len(request.prompt))


@pytest.mark.timeout(60)
def test_grpc_client_streams_chat_and_complete():
    servicer = Servicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    serving_pb2_grpc.add_ServingServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        async def go():
            client = GrpcClient(f"127.0.0.1:{port}", "m")
            ok = RequestRecord("c")
            await client.send(RequestSpec("c", prompt_len=1, max_tokens=6, prompt="abcd"), ok)
            chat = RequestRecord("h")
            await client.send(RequestSpec("h", 1, 6, messages=[{"role": "user", "content": "hey"}],
                                          session_id="s9"), chat)
            await client.aclose()
            refused = GrpcClient(f"127.0.0.1:{port}", "reject")
            no = RequestRecord("n")
            await refused.send(RequestSpec("n", 1, 6, prompt="x"), no)
            await refused.aclose()
            return ok, chat, no
        ok, chat, no = asyncio.run(go())
    finally:
        server.stop(grace=None)
    assert ok.status == "ok" and ok.generated_text == "g0g1g2" and len(ok.chunk_s) == 4  # 3 + the finish
    assert (ok.output_tokens, ok.prompt_tokens, ok.cached_tokens) == (6, 4, CACHED)
    assert chat.status == "ok" and chat.prompt_tokens == 3
    complete, chat_req = servicer.requests[0], servicer.requests[1]
    assert complete.sampling.max_tokens == 6 and complete.sampling.ignore_eos
    assert chat_req.session_id == "s9" and chat_req.messages[0].content == "hey"
    assert no.status == "rejected" and no.retry_after_s == 2.0
