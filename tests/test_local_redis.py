"""The private redis-server: a password the URL carries, a watcher that restarts a dead server on the same
port with the same password (clients reconnect on their own), ``rediss://`` URLs, and, on a live server
that owns its Redis, /health degraded while Redis does not answer and sessions back after a restart."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from live_helpers import wait_until
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.hashing import block_hashes, salt_for
from kvstore.pool import KVPool, connect
from services.local_redis import LocalRedis, RedisServerError, RedisTLS, free_port
from services.sessions import SessionStore

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

PASSWORD = "local-redis-test-password"
NO_RETRY = Retry(NoBackoff(), 0)  # a refused client fails at once (redis-py retries with backoff by default)


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


async def _session_turn(url: str, session_id: str, reply: str) -> list[dict]:
    store = SessionStore(url)
    try:
        turn = await store.begin_turn(session_id, [{"role": "user", "content": "hi"}])
        await turn.finish(reply)
        return await store.history(session_id)
    finally:
        await store.close()


# ---- the password --------------------------------------------------------------------------------------------
def test_the_password_is_required_carried_by_the_url_and_kept_off_the_command_line():
    with LocalRedis(password=PASSWORD) as server:
        assert server.url == f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port, retry=NO_RETRY).get("k")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port, password="wrong", retry=NO_RETRY).ping()
        assert PASSWORD not in _cmdline(server.process.pid)  # `ps` shows no one the password


# ---- the watcher ---------------------------------------------------------------------------------------------
def test_a_killed_server_is_restarted_on_its_port_with_its_password_and_clients_reconnect():
    with LocalRedis(password=PASSWORD, restart_on_exit=True) as server:
        url, port = server.url, server.port
        sync_client = connect(url)  # the pool's client: publisher, payload tier, mirror
        pool = KVPool(url, "tiny", 4)
        hashes = block_hashes(list(range(16)), 4, salt_for("tiny"))
        assert sync_client.set("before", "1") and pool.publish_stored("w1", hashes)
        old = server.process

        os.kill(old.pid, signal.SIGKILL)  # a crash, not a stop

        assert wait_until(lambda: server.restarts == 1, 30)
        assert old.returncode == -signal.SIGKILL  # reaped by the watcher: no zombie left behind
        assert server.process.pid != old.pid and server.port == port and server.url == url
        # The same client objects work again without being rebuilt (the data is gone: nothing persists).
        assert sync_client.get("before") is None and sync_client.set("after", "1")
        assert wait_until(lambda: pool.heartbeat("w1") and pool.publish_stored("w1", hashes), 10)
        assert pool.longest_prefix(hashes) == {"w1": 4}
        assert asyncio.run(_session_turn(url, "s", "back")) == [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "back"}]
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, retry=NO_RETRY).get("k")  # still password-protected
        sync_client.close()
        pool.close()


def test_a_session_store_reconnects_after_a_restart_without_being_rebuilt():
    async def body(server: LocalRedis) -> list[dict]:
        store = SessionStore(server.url)
        try:
            await (await store.begin_turn("s", [{"role": "user", "content": "one"}])).finish("1")
            server.kill()
            assert await asyncio.to_thread(wait_until, lambda: server.restarts == 1, 30)
            await (await store.begin_turn("s", [{"role": "user", "content": "two"}])).finish("2")
            return await store.history("s")
        finally:
            await store.close()

    with LocalRedis(password=PASSWORD, restart_on_exit=True) as server:
        history = asyncio.run(body(server))
    assert [m["content"] for m in history] == ["two", "2"]  # the restart lost turn one; turn two works


def test_stop_ends_the_server_and_its_watcher_for_good():
    server = LocalRedis(password=PASSWORD, restart_on_exit=True)
    process, port = server.process, server.port
    server.stop()
    assert process.poll() is not None and not server._watcher.is_alive()
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis(port=port, password=PASSWORD, socket_connect_timeout=1, retry=NO_RETRY).ping()
    assert server.restarts == 0


LAUNCHER = """
import signal, sys, time
from services.local_redis import LocalRedis
server = LocalRedis()
def on_ctrl_c(*_):
    time.sleep(1.0)  # long enough for a redis-server that got the same SIGINT to have exited
    print(server.process.poll(), flush=True)
    server.stop()
    sys.exit(0)
signal.signal(signal.SIGINT, on_ctrl_c)
print(server.process.pid, flush=True)
time.sleep(60)
"""


def test_a_terminal_ctrl_c_reaches_the_launcher_and_not_its_redis_server():
    # the launcher in a process group of its own, as a shell runs a foreground job; Ctrl-C signals the group
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        redis_pid = int(launcher.stdout.readline())
        os.killpg(launcher.pid, signal.SIGINT)
        assert launcher.stdout.readline().strip() == "None"  # still serving while the launcher shuts down
        assert launcher.wait(timeout=30) == 0
        with pytest.raises(ProcessLookupError):  # and stopped by it
            os.kill(redis_pid, 0)
    finally:
        launcher.kill()


# ---- rediss:// -------------------------------------------------------------------------------------------------
def test_rediss_urls_reach_redis_py_as_tls_connections_with_their_ssl_options(tmp_path):
    ca = str(tmp_path / "ca.pem")
    url = f"rediss://:{PASSWORD}@127.0.0.1:{free_port()}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"
    sync_pool = connect(url).connection_pool
    async_pool = SessionStore(url)._redis.connection_pool
    assert sync_pool.connection_class is redis.SSLConnection
    assert async_pool.connection_class is aioredis.SSLConnection
    for kwargs in (sync_pool.connection_kwargs, async_pool.connection_kwargs):
        assert kwargs["ssl_ca_certs"] == ca and kwargs["ssl_cert_reqs"] == "required"
        assert kwargs["password"] == PASSWORD


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> RedisTLS:
    """A self-signed certificate for 127.0.0.1 (its own CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return RedisTLS(cert_file=cert, key_file=key, ca_file=cert)


@pytest.fixture(scope="module")
def tls_redis(tls_files):
    try:
        server = LocalRedis(password=PASSWORD, tls=tls_files)
    except RedisServerError as exc:
        pytest.skip(f"this redis-server serves no TLS: {exc}")
    yield server
    server.stop()


def test_the_pool_and_sessions_work_over_tls(tls_redis):
    assert tls_redis.url.startswith("rediss://")
    pool = KVPool(tls_redis.url, "tiny", 4)
    hashes = block_hashes(list(range(8)), 4, salt_for("tiny"))
    try:
        assert pool.heartbeat("w1") and pool.publish_stored("w1", hashes)
        assert pool.longest_prefix(hashes) == {"w1": 2}
    finally:
        pool.close()
    assert asyncio.run(_session_turn(tls_redis.url, "tls", "secure"))[-1]["content"] == "secure"


def test_plain_tcp_gets_nothing_from_the_tls_port(tls_redis):
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis(port=tls_redis.port, password=PASSWORD, socket_timeout=2, socket_connect_timeout=2,
                    retry=NO_RETRY).ping()


# ---- a live server that owns its Redis -----------------------------------------------------------------------
API_KEY = "own-redis-api-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def own_redis_server(ray_session, serving_model_dir):
    """``tidepool serve`` without --redis-url: it starts its private, password-protected, watched Redis.
    Its API key guards /metrics and the docs too (``--metrics-require-key``)."""
    from engine.config import EngineConfig
    from services.config import ClusterConfig, GatewayConfig
    from services.serve import ThreadedServer

    config = ClusterConfig(engine=EngineConfig(model=str(serving_model_dir), num_blocks=256), colocated=1,
                           threads_per_worker=1)
    gateway = GatewayConfig(http_port=free_port(), grpc_port=free_port(), api_key=API_KEY, metrics_require_key=True)
    server = ThreadedServer(config, gateway).start()
    yield server
    server.stop()


def _chat(server, session_id: str) -> httpx.Response:
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
            "temperature": 0.0, "session_id": session_id}
    return httpx.post(f"{server.http_url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_private_redis_is_hidden_watched_and_reported_by_health(own_redis_server):
    server, cluster = own_redis_server, own_redis_server.server.cluster
    local = cluster.redis
    assert local is not None and local.password and local.password in cluster.redis_url
    status = httpx.get(f"{server.http_url}/v1/cluster/status", headers=AUTH, timeout=30).json()
    assert local.password not in str(status) and "***@" in status["redis"]["url"]
    assert _chat(server, "live-1").status_code == 200
    assert httpx.get(f"{server.http_url}/health").status_code == 200

    os.kill(local.process.pid, signal.SIGSTOP)  # Redis stops answering (but has not exited)
    try:
        assert wait_until(lambda: httpx.get(f"{server.http_url}/health").status_code == 503, 60)
        degraded = httpx.get(f"{server.http_url}/health")
        assert degraded.json()["error"]["code"] == "redis_unavailable" and int(degraded.headers["Retry-After"]) >= 1
    finally:
        os.kill(local.process.pid, signal.SIGCONT)
    assert wait_until(lambda: httpx.get(f"{server.http_url}/health").status_code == 200, 60)

    os.kill(local.process.pid, signal.SIGKILL)  # Redis dies: the watcher brings it back, serve goes on
    assert wait_until(lambda: local.restarts == 1, 30)
    assert wait_until(lambda: _chat(server, "live-2").status_code == 200, 60)
    assert wait_until(lambda: httpx.get(f"{server.http_url}/health").status_code == 200, 60)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_metrics_and_docs_need_the_key_when_asked_and_health_never_does(own_redis_server):
    url = own_redis_server.http_url
    for path in ("/metrics", "/docs", "/openapi.json"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 401, path
        assert httpx.get(f"{url}{path}", headers=AUTH, timeout=30).status_code == 200, path
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
