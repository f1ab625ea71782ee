"""`tidepool serve --address` on a two-node Ray cluster (one machine): workers placed by custom resource."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from ray.cluster_utils import Cluster

from services.local_redis import free_port

pytestmark = pytest.mark.ray


def two_node_cluster() -> tuple[Cluster, str]:
    """(a cluster, its decode node's id): a head node with the prefill resource and a second node with the
    decode resource. Ray gives a raylet a fixed 30 s to register, which a 2-core machine busy with the rest
    of the suite can miss: one more try then, from a clean start."""
    try:
        return _start_two_nodes()
    except Exception as exc:
        if "timed out during startup" not in str(exc):
            raise
        return _start_two_nodes()


def _start_two_nodes() -> tuple[Cluster, str]:
    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=2, resources={"prefill": 1})
        return cluster, cluster.add_node(num_cpus=2, resources={"decode": 1}).node_id
    except Exception:
        cluster.shutdown()
        raise


@pytest.mark.timeout(300)
def test_serve_address_places_decode_on_the_decode_node_and_serves_a_chat(serving_model_dir):
    cluster, decode_node_id = two_node_cluster()
    http_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--address", cluster.address, "--model",
         str(serving_model_dir), "--prefill", "1", "--decode", "1", "--http-port", str(http_port),
         "--grpc-port", str(free_port()), "--threads-per-worker", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[1],
        start_new_session=True,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "tidepool: serving" in line:
                break
        output = "".join(lines)
        assert proc.poll() is None, output
        placement = dict(re.findall(r"^\s+(\S+-\d+)\s+node=\S+ \((\w+)\)", output, re.M))
        assert placement["decode-0"] == decode_node_id[:12], output
        assert placement["prefill-0"] != decode_node_id[:12], output
        reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", timeout=120, json={
            "model": serving_model_dir.name, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5, "temperature": 0,
        })
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        cluster.shutdown()
