"""Session-wide fixtures: one private redis-server and one Ray instance shared by every test."""

from __future__ import annotations

import os

import pytest
import torch

from services.local_redis import LocalRedis

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def redis_server():
    """A private redis-server on a free port (``REDIS_URL`` overrides it with an existing server)."""
    if os.environ.get("REDIS_URL"):
        yield None
        return
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


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for the whole test session (``ray.init`` costs about 5 s here)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
