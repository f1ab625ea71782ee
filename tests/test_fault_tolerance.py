"""Fault tolerance: dead workers are replaced, requests survive their workers, abandoned work stops, and
workers that can't be placed fail the start with what is missing.

Live servers come from ``start_server`` (tests/conftest.py): ``ft_server`` (one prefill, one decode,
replacements on) serves the kill and disconnect tests; ``fixed_server`` has replacements off, for the
degraded answers. Workers are killed with SIGKILL on their process (what ``kill -9`` does), frozen with
SIGSTOP. The engine's resume, the engine loop's step failure and the dispatcher's resume are unit-tested
on real engines (a runner subclass stands in for a kernel that raises) and the dispatcher's fake workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import ray
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from live_helpers import (
    Streams,
    colocated_spec,
    greedy_chat,
    idle,
    request_events,
    run_keeping_torch_threads,
    user_message,
    wait_until,
)
from test_dispatcher import PROMPT, FakeWorker, make_dispatcher
from test_engine_loop import GREEDY, make_engine, prompt, run_outputs, write_model

from engine.config import EngineConfig
from engine.output import FinishReason
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from services.config import ClusterConfig
from services.dispatcher import GenerateRequest
from services.errors import WorkerDiedError, WorkerStalledError
from services.gateway import errors
from services.gateway.chat_prompt import encode_chat
from services.gateway.token_texts import TokenTexts
from services.local_redis import free_port
from services.messages import EngineStepError, Role, TokenEvent
from services.placement import WorkerLauncher
from services.worker import ColocatedWorker

pytestmark = pytest.mark.timeout(240)


# ---- the engine: a request resumed after tokens it produced elsewhere ---------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("fault-tolerance"))


SEEDED = dict(temperature=0.9, top_k=50, seed=11, ignore_eos=True)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_exactly_as_the_undisturbed_one(model_dir, sampling):
    ids, params, k = prompt(29, seed=21), SamplingParams(max_tokens=24, stop=["zz"], **sampling), 9
    whole = make_engine(model_dir)
    whole.add_request("r", ids, params)
    expected = run_outputs(whole)
    tokens = [o.new_token_ids[0] for o in expected]
    streamed = tokens[:k]

    # colocated: one engine recomputes prompt + streamed tokens and goes on
    again = make_engine(model_dir)
    again.add_request("r", ids, params, output_ids=streamed)
    rest = run_outputs(again)
    assert [o.new_token_ids[0] for o in rest] == tokens[k:]
    assert "".join(o.text for o in expected[:k]) + "".join(o.text for o in rest) == \
        "".join(o.text for o in expected)
    assert rest[0].num_prompt_tokens == len(ids)

    # disaggregated: a prefill engine computes them, a decode engine imports the KV and goes on
    prefill, decode = make_engine(model_dir), make_engine(model_dir)
    prefill.add_request("r", ids, params, prefill_only=True, output_ids=streamed)
    (first,) = prefill.step()
    assert first.finish_reason is FinishReason.PREFILLED and first.new_token_ids == [tokens[k]]
    tensor = prefill.kv_cache.export_blocks(prefill.request_block_ids("r"))
    prefill.release("r")
    reserved = decode.reserve_blocks("r", len(ids) + k)
    decode.kv_cache.import_blocks(reserved, tensor)
    decode.add_imported_request("r", ids, tokens[k], params, reserved, output_ids=streamed)
    rest = [first, *run_outputs(decode)]
    assert [o.new_token_ids[0] for o in rest] == tokens[k:]
    assert "".join(o.text for o in rest) == "".join(o.text for o in expected[k:])
    assert decode.stats().free_blocks == decode.stats().total_blocks


# ---- the engine loop: a step that raises -------------------------------------------------------------------

POISON = [7, 7, 7, 7, 7, 7]


class PoisonedRunner(ModelRunner):
    """The engine's own runner, except that a batch holding a prompt that starts with POISON raises, as a
    kernel that fails on some input would."""

    def run(self, chunks, on_layer_done=None):
        if any(c.start_pos == 0 and c.token_ids[:len(POISON)] == POISON for c in chunks):
            raise RuntimeError("paged attention kernel failed: illegal memory access at 0xdeadbeef")
        return super().run(chunks, on_layer_done)


@pytest.mark.timeout(120)
def test_a_failing_step_fails_its_requests_frees_their_blocks_and_the_worker_reports_unhealthy(
        model_dir, ray_session):
    spec = colocated_spec(model_dir)

    async def main() -> None:
        worker = ColocatedWorker(spec)  # in this process: the actor class without Ray's wrapper
        await worker.start()
        engine = worker.engine
        try:
            assert (await worker.load()).alive
            engine.runner = PoisonedRunner(engine.model, engine.model_config, engine.kv_cache, engine.window)
            running = request_events(worker, "running", prompt(20, seed=1), SamplingParams(max_tokens=300, **GREEDY))
            assert (await anext(running)).token_ids  # decoding when the poisoned prompt joins its batch
            bad, later = worker.loop.open_queue("bad"), worker.loop.open_queue("later")
            params = SamplingParams(max_tokens=4, **GREEDY)

            def add_both() -> None:  # in one command: "later" waits (two sequences at most) while the step fails
                engine.add_request("bad", POISON + prompt(10, seed=2), params)
                engine.add_request("later", prompt(12, seed=3), params)

            await worker.loop.acall(add_both)
            assert isinstance(await bad.get(), EngineStepError)
            with pytest.raises(EngineStepError, match="running"):
                async for _ in running:
                    pass
            outputs = [await later.get()]  # not in the failed step: it runs to its end
            while not outputs[-1].finished:
                outputs.append(await later.get())
            assert outputs[-1].finish_reason is FinishReason.LENGTH
            stats = await worker.loop.acall(engine.stats)
            assert stats.free_blocks == stats.total_blocks and not engine.requests
            load = await worker.load()
            assert not load.alive  # the router stops routing to it; the supervisor replaces it
            assert "illegal memory access" in worker.loop.failure
        finally:
            worker.loop.stop()

    run_keeping_torch_threads(main)
    api = errors.classify(EngineStepError("the engine step running r failed: RuntimeError: at 0xdeadbeef"))
    assert (api.http_status, api.code) == (500, "engine_step_failed") and "0xdeadbeef" not in api.message


# ---- the dispatcher: resuming with fake workers ------------------------------------------------------------

class FailingDecode(FakeWorker):
    """A decode worker whose stream fails after two tokens: its process dies, or it stalls."""

    def __init__(self, *args, dies: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dies = dies

    async def _tokens(self, index, cached, first=False):
        for i in range(2):
            await asyncio.sleep(0)
            yield TokenEvent(index, [100 + i], None, len(PROMPT), cached, "x")
        if self.dies:
            self.alive = False
            raise WorkerDiedError(self.worker_id, f"worker {self.worker_id} died mid-stream")
        raise WorkerStalledError(self.worker_id, f"worker {self.worker_id} sent nothing for 60s")


class RecordingPrefill(FakeWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.resumed_after: list[tuple] = []

    async def prefill(self, request_id, prompt_ids, params, kv_target, fetch, deadline_s, output_ids=(),
                      priority=None, lease_pending=False, lora=None):
        self.resumed_after.append((request_id, kv_target.worker_id, tuple(output_ids)))
        return await super().prefill(request_id, prompt_ids, params, kv_target, fetch, deadline_s)


@pytest.mark.parametrize("dies", [True, False], ids=["dies", "stalls"])
def test_a_stream_whose_decode_worker_fails_resumes_on_another_after_its_streamed_tokens(dies):
    p, failing, spare = RecordingPrefill("p0", Role.PREFILL), FailingDecode("d0", Role.DECODE, dies=dies), \
        FakeWorker("d1", Role.DECODE)
    dispatcher = make_dispatcher(p, failing, spare)  # round robin: d0 first

    async def run() -> list[TokenEvent]:
        await dispatcher.refresh_loads()
        params = SamplingParams(max_tokens=6, temperature=0.0)
        return [e async for e in dispatcher.generate(GenerateRequest("r1", PROMPT, params))]

    events = asyncio.run(run())
    # first token 7 and two decode tokens from d0; then the resumed prefill's 7 and d1's three tokens
    assert [t for e in events for t in e.token_ids] == [7, 100, 101, 7, 100, 101, 102]
    assert p.resumed_after == [("r1", "d0", ()), ("r1/1", "d1", (7, 100, 101))]
    assert events[-1].finish_reason == FinishReason.LENGTH
    assert {e.num_cached_tokens for e in events} == {16}
    assert dispatcher.resumed == 1 and dispatcher.missing_roles() == []
    assert [w.worker_id for w in dispatcher.dead_workers()] == (["d0"] if dies else [])


def test_an_engine_step_error_is_not_retried_elsewhere():
    p = FakeWorker("p0", Role.PREFILL, fail_on_prefill=EngineStepError("step failed"))
    spare, d = FakeWorker("p1", Role.PREFILL), FakeWorker("d0", Role.DECODE)
    dispatcher = make_dispatcher(p, spare, d)

    async def run() -> None:
        await dispatcher.refresh_loads()
        params = SamplingParams(max_tokens=4, temperature=0.0)
        async for _ in dispatcher.generate(GenerateRequest("r1", PROMPT, params)):
            pass

    with pytest.raises(EngineStepError):
        asyncio.run(run())
    assert not any(call == "prefill" for call, _ in spare.calls) and not d.leases


# ---- live: kill -9, replacement, degraded health -------------------------------------------------------------

@pytest.fixture(scope="module")
def ft_server(start_server):
    server = start_server(prefill=1, decode=1, kv_transport="grpc")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fixed_server(start_server):
    server = start_server(prefill=1, decode=1, kv_transport="grpc", replace_workers=False)
    yield server
    server.stop()


class _HealthWatch:
    """Polls /health from a thread; keeps every 503 answer's body and Retry-After."""

    def __init__(self, server) -> None:
        self.url, self.degraded = f"{server.http_url}/health", []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            with httpx.Client(timeout=10) as http:
                resp = http.get(self.url)
            if resp.status_code == 503:
                self.degraded.append((resp.json()["error"]["message"], resp.headers.get("retry-after")))
            self._stop.wait(0.05)

    def __enter__(self) -> _HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15)


def _worker(server, role: str):
    (worker,) = [w for w in server.dispatcher.workers.values() if w.role == role]
    return worker


def _pid(worker) -> int:
    return ray.get(worker.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def _used_blocks(worker) -> int:
    """Blocks in use on the worker now (asked directly: the dispatcher's report may lag)."""
    load = ray.get(worker.actor.load.remote(), timeout=30)
    return load.total_blocks - load.free_blocks


def _replaced(server, dead) -> bool:
    ids = {s["id"]: s["alive"] for s in server.worker_stats()}
    return dead.worker_id not in ids and any(alive and i.startswith(f"{dead.worker_id.split('.')[0]}.")
                                             for i, alive in ids.items())


@pytest.mark.timeout(300)
def test_killed_decode_worker_is_replaced_and_its_streams_end_as_undisturbed_ones(ft_server):
    texts = [f"Stream {i}: how do the tides reach the pools at the edge of the shore?" for i in range(4)]
    expected = [greedy_chat(ft_server, t, 300) for t in texts]
    decode = _worker(ft_server, "decode")
    pid, resumed = _pid(decode), ft_server.dispatcher.resumed
    with _HealthWatch(ft_server) as health:
        streams = Streams(ft_server, texts, 300)
        assert streams.wait_started()
        os.kill(pid, signal.SIGKILL)  # mid-stream: every stream has text, none can have 300 tokens yet
        assert streams.join() == expected  # no token missing, none repeated, none different
        assert wait_until(lambda: _replaced(ft_server, decode), 60)
    assert ft_server.dispatcher.resumed > resumed
    # no decode worker between the death and the replacement: degraded, with when to retry
    assert any("no live decode worker" in message and retry for message, retry in health.degraded)
    assert greedy_chat(ft_server, texts[0], 300) == expected[0]  # the replacement serves
    assert httpx.get(f"{ft_server.http_url}/health").status_code == 200
    assert wait_until(lambda: idle(ft_server), 30)


@pytest.mark.timeout(300)
def test_killed_prefill_worker_is_replaced_and_requests_it_held_finish(ft_server):
    texts = [f"Prefill {i}: what lives in a tide pool?" for i in range(3)]
    expected = [greedy_chat(ft_server, t, 24) for t in texts]
    prefill, decode = _worker(ft_server, "prefill"), _worker(ft_server, "decode")
    token_texts = TokenTexts(ft_server.dispatcher.tokenizer)
    leases = sum(-(-len(encode_chat(token_texts, user_message(t))) // ft_server.dispatcher.block_size) for t in texts)
    assert wait_until(lambda: _used_blocks(decode) == 0, 30)
    pid = _pid(prefill)
    os.kill(pid, signal.SIGSTOP)  # requests reach it and wait there
    try:
        with _HealthWatch(ft_server) as health:
            streams = Streams(ft_server, texts, 24)
            # every request is routed and holds its decode lease: its prompt is in the frozen worker's hands
            assert wait_until(lambda: _used_blocks(decode) == leases, 60)
            os.kill(pid, signal.SIGKILL)
            assert streams.join() == expected
            assert wait_until(lambda: _replaced(ft_server, prefill), 60)
    finally:
        if _alive_pid(pid):  # the kill did not happen
            os.kill(pid, signal.SIGCONT)
    assert any("no live prefill worker" in message and retry for message, retry in health.degraded)
    assert wait_until(lambda: idle(ft_server), 30)


@pytest.mark.timeout(180)
def test_a_stream_whose_worker_stops_answering_is_resumed_after_its_token_deadline(ft_server):
    text = "Stall: where do hermit crabs find their shells?"
    expected = greedy_chat(ft_server, text, 300)
    decode, dispatcher = _worker(ft_server, "decode"), ft_server.dispatcher
    pid, resumed, saved = _pid(decode), dispatcher.resumed, dispatcher.deadlines
    dispatcher.deadlines = dataclasses.replace(saved, token_s=3.0)
    try:
        streams = Streams(ft_server, [text], 300)
        assert streams.wait_started()
        os.kill(pid, signal.SIGSTOP)  # alive, but silent: only the token deadline notices
        try:
            assert wait_until(lambda: dispatcher.resumed > resumed, 60)
        finally:
            os.kill(pid, signal.SIGCONT)  # it wakes up in time to take the resumed attempt
        assert streams.join() == [expected]
    finally:
        dispatcher.deadlines = saved
    assert wait_until(lambda: idle(ft_server), 30)


def _alive_pid(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _generated_tokens(server) -> float:
    metrics = server.dispatcher.metrics
    return metrics.registry.get_sample_value("tidepool_generation_tokens_total", {"model_name": metrics.model_name})


@pytest.mark.timeout(180)
def test_a_client_that_leaves_before_its_first_token_cancels_the_request(ft_server):
    prefill, decode = _worker(ft_server, "prefill"), _worker(ft_server, "decode")
    assert wait_until(lambda: idle(ft_server), 30)
    tokens_before = _generated_tokens(ft_server)
    pid = _pid(prefill)
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hello there"}], "stream": true, ' \
           b'"max_tokens": 64}' % ft_server.model_id.encode()
    host, port = ft_server.http_url.removeprefix("http://").split(":")
    os.kill(pid, signal.SIGSTOP)  # the prompt can't get past prefill
    try:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert wait_until(lambda: _used_blocks(decode) > 0, 60)  # routed: its lease is reserved
        # the client is gone; only a cancelled request frees its lease while its prefill is still frozen
        assert wait_until(lambda: _used_blocks(decode) == 0, 60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: idle(ft_server), 60)
    assert _generated_tokens(ft_server) == tokens_before  # not a token was produced for it


@pytest.mark.timeout(120)
def test_without_replacements_a_role_with_no_live_worker_is_503_with_retry_after_and_not_serving(fixed_server):
    ray.kill(_worker(fixed_server, "decode").actor)
    assert wait_until(lambda: httpx.get(f"{fixed_server.http_url}/health").status_code == 503, 30)
    health = httpx.get(f"{fixed_server.http_url}/health")
    assert health.headers["retry-after"] and "no live decode worker" in health.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError) as info:  # 503, not 429: nothing to wait for in a queue
        greedy_chat(fixed_server, "hello", 4)
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"]
    assert info.value.body["code"] == "no_workers" and "decode" in info.value.body["message"]
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(fixed_server.grpc_target))
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
        health_pb2.HealthCheckResponse.NOT_SERVING
    assert [s["id"] for s in fixed_server.worker_stats() if s["alive"]] == ["prefill-0"]  # nothing replaced


# ---- placement ------------------------------------------------------------------------------------------------

def test_workers_start_without_a_runtime_env_unless_extra_env_asks_for_one(ft_server, serving_model_dir):
    """A runtime env makes Ray start each worker through a setup process of its own (0.6 s of CPU more at
    every start, benchmarks/worker_start.py): a plain worker has none and still runs one OpenMP thread per CPU
    it asked for; ClusterConfig.extra_env reaches the worker's environment, while torch keeps the worker's
    own thread count."""
    def environment(actor) -> tuple:  # run in the worker's process: defined here, it is pickled by value
        return (dict(ray.get_runtime_context().runtime_env), os.environ.get("OMP_NUM_THREADS"),
                torch.get_num_threads(), os.environ.get("TIDEPOOL_TEST_MARK"))

    plain = next(iter(ft_server.dispatcher.workers.values()))
    assert ray.get(plain.actor.__ray_call__.remote(environment), timeout=30) == ({}, "1", 1, None)

    config = ClusterConfig(engine=EngineConfig(model=str(serving_model_dir), num_blocks=64), colocated=1,
                           extra_env={"OMP_NUM_THREADS": "3", "TIDEPOOL_TEST_MARK": "kelp"})
    launcher = WorkerLauncher(config, "env-test", None, 1, "secret", may_grow=False)
    try:
        worker = asyncio.run(launcher.launch("colocated-env", Role.COLOCATED))
        runtime_env, omp, threads, mark = ray.get(worker.actor.__ray_call__.remote(environment), timeout=30)
        assert runtime_env["env_vars"] == config.extra_env and (omp, threads, mark) == ("3", 1, "kelp")
    finally:
        launcher.kill_all()


@pytest.mark.timeout(180)
def test_workers_that_cannot_be_placed_fail_serve_at_once_naming_what_is_missing(serving_model_dir):
    """Also: serve without --address starts a Ray instance of its own, whatever cluster a `ray start` (or
    test_multinode's cluster, beside this test) last recorded as this machine's; here a dead one."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths live under it
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "services.cli", "serve", "--model", str(serving_model_dir), "--colocated", "2",
             "--gpus-per-worker", "1", "--http-port", str(free_port()), "--grpc-port", str(free_port())],
            capture_output=True, text=True, timeout=150, cwd=Path(__file__).parents[1],
            env={**os.environ, "RAY_TMPDIR": str(ray_tmp)},
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode != 0
    assert "tidepool serve: cannot place the workers: 2 workers need 2 GPUs; this Ray cluster has 0 GPUs" \
        in proc.stderr, proc.stderr[-2000:]
