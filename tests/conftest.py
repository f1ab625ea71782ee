"""Session-wide fixtures: one private redis-server and one Ray instance shared by every test."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

# A source checkout run without installing (the bare GPU machine): the generated gRPC modules' package
# `tidepool` lives in proto/.
if importlib.util.find_spec("tidepool") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))

# Under pytest-xdist (`make test`) the workers share the cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

# Triton chooses between compiling and interpreting at its first import in a process, so whichever test
# module imports it first decides for all of them. Without CUDA only the interpreter can run a kernel:
# say so before any module imports triton (the interpreter tests skip otherwise).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


KERNEL_COMPILE_FILE = "tests/test_kernel_compile.py"  # its GPU-target compiles run in the background


def _uses_the_shared_servers(item: pytest.Item) -> bool:
    """Whether the item uses the session's Ray instance or Redis server (by fixture or by marker)."""
    fixtures, markers = set(getattr(item, "fixturenames", ())), {m.name for m in item.iter_markers()}
    return bool(fixtures & {"ray_session", "redis_url"} or markers & {"ray", "redis"})


def _run_order(item: pytest.Item) -> int:
    """The servers' tests first, then the slow ones, test_kernel_compile.py last (its compiles, minutes of
    CPU, get the whole run's idle cores to finish in). Under pytest-xdist each worker takes the next group
    when it runs out, so the long groups start early and the short ones fill the end."""
    if item.nodeid.startswith(KERNEL_COMPILE_FILE):
        return 3
    if _uses_the_shared_servers(item):
        return 0
    return 1 if any(item.iter_markers("slow")) else 2


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist names the groups in the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the run (``_run_order``; stable, so each file keeps its own order). Under pytest-xdist, every test
    of the shared servers is one group that one worker runs (a single Ray instance and Redis server, as in a
    run without workers), and every other file is a group of its own (its module fixtures built once)."""
    items.sort(key=_run_order)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for item in items:
            group = "shared-servers" if _uses_the_shared_servers(item) else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))


def _start_kernel_compiles(run_id: str) -> None:
    from test_kernel_compile import compile_dir, start_compiles  # triton is looked up there, not imported

    start_compiles(compile_dir(run_id))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start those compiles as soon as the tests are known, at the lowest CPU priority (pytest-xdist's
    controller starts them instead of its workers)."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(item.nodeid.startswith(KERNEL_COMPILE_FILE) for item in session.items):
        from test_kernel_compile import this_run_id

        _start_kernel_compiles(this_run_id())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """pytest-xdist's controller: check that the workers' groups took, and start the compiles once, when the
    first worker's collection holds the file.

    --dist loadgroup tells the controller a test's group by appending it to the test's id, which pytest 9.2
    ignores (pytest-dev/pytest-xdist#1386, hence pyproject's pytest < 9.2): the groups would be dropped without
    a word, the shared servers started in every worker."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not any("@" in nodeid for nodeid in ids):
        raise pytest.UsageError(f"pytest-xdist {importlib.metadata.version('pytest-xdist')} cannot group tests "
                                f"under pytest {pytest.__version__} (pytest-dev/pytest-xdist#1386): install "
                                f"the versions pyproject.toml asks for (make setup)")
    if any(nodeid.startswith(KERNEL_COMPILE_FILE) for nodeid in ids):
        _start_kernel_compiles(node.workerinput["testrunuid"])


@pytest.fixture(scope="session")
def redis_server():
    """A private redis-server on a free port (``REDIS_URL`` overrides it with an existing server)."""
    if os.environ.get("REDIS_URL"):
        yield None
        return
    # imported here: redis-py only where Redis is used (not on a bare GPU machine)
    from services.local_redis import LocalRedis

    server = LocalRedis()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return os.environ.get("REDIS_URL") or redis_server.url


@pytest.fixture
def redis_client(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def pool(redis_url, redis_client):
    """A KV pool index on a flushed database (model "tiny", block size 4)."""
    from kvstore.pool import KVPool

    p = KVPool(redis_url, "tiny", 4, ttl_s=30)
    yield p
    p.close()


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for the whole test session (``ray.init`` costs about 5 s here)."""
    import ray

    if not ray.is_initialized():
        # Logical CPUs (a worker asks for one per thread): room for 8 x 8 workers next to the shared servers.
        # "local": not a cluster test_multinode's two nodes (or a `ray start`) recorded as this machine's latest.
        # No runtime env: each worker would start through a setup process (services/placement.py); Ray sets
        # OMP_NUM_THREADS to an actor's num_cpus (1 unless it asks for more).
        ray.init(address="local", num_cpus=24, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, config) of the built-in tiny model (random weights, 8 layers, 4 KV heads of 64 channels),
    written to a fresh cache directory that stays set while the module runs, so ``Engine("tiny")`` finds
    the same files."""
    from engine.loader import load_model, resolve_model_dir

    mp = pytest.MonkeyPatch()
    mp.setenv("TIDEPOOL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield load_model(resolve_model_dir("tiny"), "float32", "cpu")
    mp.undo()


@pytest.fixture(scope="session")
def serving_model_dir(tmp_path_factory):
    """A small Llama checkpoint (random weights, the built-in tiny model's byte-level tokenizer) that the
    service tests serve: the same loading path as a user's checkpoint, a fraction of the compute."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.config import ModelConfig
    from engine.loader import resolve_model_dir

    tiny = resolve_model_dir("tiny")
    tiny_cfg = ModelConfig.from_dir(tiny)
    out = tmp_path_factory.mktemp("serving-model") / "small-llama"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tiny_cfg.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=tiny_cfg.bos_token_id, eos_token_id=tiny_cfg.eos_token_ids,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    return out


_redis_dbs = list(range(1, 16))  # database 0 is the tests' own


def _start_on_free_ports(server_cls, config, make_gateway, tries: int = 3):
    """Start a server on ports found free; another process may take one between the probe and the bind
    (the HTTP gateway then raises an OSError, gRPC a RuntimeError), so a bind failure tries fresh ports."""
    for attempt in range(tries):
        server = server_cls(config, make_gateway())
        try:
            return server.start()
        except (OSError, RuntimeError) as exc:
            server.stop()
            if attempt == tries - 1 or "bind" not in str(exc).lower():
                raise


@pytest.fixture(scope="session")
def start_server(ray_session, redis_url, serving_model_dir):
    """Factory: start a Tidepool server (cluster + gateways on free loopback ports) sharing the session's Ray.

    Each server gets its own Redis database so pools never mix (a stopped server's is flushed and reused:
    Redis has 16); every server started is stopped at the end.
    """
    import redis

    from engine.config import EngineConfig
    from services.config import ClusterConfig, GatewayConfig
    from services.local_redis import free_port
    from services.serve import ThreadedServer

    started: list[ThreadedServer] = []
    databases: dict[ThreadedServer, int] = {}  # the database each running server holds
    base = redis_url.rsplit("/", 1)[0]

    def start(api_key: str | None = None, model_dir=None, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, engine_options: dict | None = None,
              gateway_options: dict | None = None, **cluster_kwargs) -> ThreadedServer:
        """``model_dir``: the checkpoint to serve (default: ``serving_model_dir``); ``engine_options``,
        ``gateway_options``: more `EngineConfig` and `GatewayConfig` fields."""
        for stopped in [s for s in databases if not s.running]:
            free = databases.pop(stopped)
            with redis.Redis.from_url(f"{base}/{free}") as client:
                client.flushdb()
            _redis_dbs.append(free)
        db = _redis_dbs.pop(0)
        cluster_kwargs.setdefault("threads_per_worker", 1)
        engine = EngineConfig(model=str(model_dir or serving_model_dir), num_blocks=512, **(engine_options or {}))
        config = ClusterConfig(engine=engine, redis_url=f"{base}/{db}", **cluster_kwargs)
        try:
            server = _start_on_free_ports(ThreadedServer, config, lambda: GatewayConfig(
                http_port=free_port(), grpc_port=free_port(), api_key=api_key, tool_call_parser=tool_call_parser,
                reasoning_parser=reasoning_parser, **(gateway_options or {})))
        except BaseException:
            _redis_dbs.append(db)
            raise
        started.append(server)
        databases[server] = db
        return server

    yield start
    for server in started:
        server.stop()


TOOL_TEMPLATE = (  # the tiny model's, plus Qwen-style tools, calls and tool answers
    "{{ bos_token }}{% if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|eot|>{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tool_server(start_server):
    """A colocated server rendering chats with a template of its own (--chat-template) that shows tools, calls
    and tool answers, with the hermes tool-call parser and the qwen3 reasoning parser, serving the model as
    "tool-model" and "tools-alias" (--served-model-name) (test_openai_tools.py, test_openai_responses.py,
    test_serving_options.py)."""
    server = start_server(colocated=1, tool_call_parser="hermes", reasoning_parser="qwen3",
                          chat_template=TOOL_TEMPLATE, served_model_names=("tool-model", "tools-alias"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def live_server(start_server):
    """The default server the API tests talk to: one prefill and one decode worker over gRPC transfer, the
    decode worker speculating (n-gram drafts of up to 4 tokens), so every API test also checks that drafts
    change no output."""
    return start_server(prefill=1, decode=1, kv_transport="grpc", engine_options={"num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def secured_server(start_server):
    """An API key, and a browser page's origin allowed to call the HTTP API (CORS)."""
    server = start_server(api_key="test-key", colocated=1,
                          gateway_options={"allowed_origins": ("https://ui.example",)})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def overloaded_server(start_server):
    """A TTFT SLO no request can meet: the router rejects everything early."""
    server = start_server(colocated=1, ttft_slo_s=1e-6)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dead_server(start_server):
    """Every worker killed (and not replaced), and the dispatcher has noticed."""
    import ray
    from live_helpers import wait_until

    server = start_server(colocated=1, replace_workers=False)
    for worker in server.dispatcher.workers.values():
        ray.kill(worker.actor)
    assert wait_until(lambda: server.dispatcher.alive_workers() == 0, 30)
    yield server
    server.stop()
