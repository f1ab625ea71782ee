"""The `ray up` configs in deploy/ pass Ray's own cluster-config checks offline, and say what Tidepool needs.

`ray up` (ray.autoscaler._private.commands.create_or_update_cluster) runs `_bootstrap_config`: prepare_config
(merge the provider's defaults.yaml, setup commands, per-type min/max workers), validate_config (the JSON
schema in ray-schema.json plus cross-field checks), then the provider's bootstrap_config. For the local
provider that last step is offline, so the whole `_bootstrap_config` runs here; for AWS it talks to EC2/IAM,
so the AWS file gets every step before it.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from packaging.requirements import Requirement
from ray.autoscaler._private.commands import _bootstrap_config
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent
AWS = ROOT / "deploy" / "cluster.yaml"
LOCAL = ROOT / "deploy" / "cluster.local.yaml"


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _ray_up_checks_before_aws(config: dict) -> dict:
    """What `ray up` runs on an AWS config before its first EC2 call."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _pinned_torch() -> str:
    """The exact torch the Makefile installs; it must satisfy the package's own range."""
    pin = re.search(r"pip install -q (torch==[\w.+]+)", (ROOT / "Makefile").read_text()).group(1)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    assert torch.specifier.contains(pin.removeprefix("torch=="))
    return pin


@pytest.mark.timeout(60)
def test_aws_config_passes_ray_up_validation():
    prepared = _ray_up_checks_before_aws(_load(AWS))
    assert prepared["provider"]["type"] == "aws"
    assert set(prepared["available_node_types"]) == {"head", "prefill", "decode"}


@pytest.mark.timeout(60)
def test_ray_validation_rejects_a_misspelled_field():
    config = _load(AWS)
    config["available_node_types"]["prefill"]["min_worker"] = 1  # typo of min_workers
    with pytest.raises(jsonschema.ValidationError):
        _ray_up_checks_before_aws(config)


@pytest.mark.timeout(60)
def test_local_config_passes_ray_up_bootstrap():
    resolved = _bootstrap_config(_load(LOCAL), no_config_cache=True)
    assert resolved["provider"]["type"] == "local"
    node_type = resolved["available_node_types"][resolved["head_node_type"]]
    assert node_type["min_workers"] == node_type["max_workers"] == len(resolved["provider"]["worker_ips"])


@pytest.mark.timeout(60)
def test_aws_node_types_carry_role_resources_and_pool_limits():
    prepared = _ray_up_checks_before_aws(_load(AWS))
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert head["resources"].get("CPU") == 0  # no worker lands on the head
    assert not {"prefill", "decode", "GPU"} & {k for k, v in head["resources"].items() if v}
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        res = types[role]["resources"]
        assert res[role] >= 1 and res["GPU"] >= 1 and other not in res
        assert res[role] <= res["GPU"]  # one Tidepool worker per GPU
        assert 1 <= types[role]["min_workers"] <= types[role]["max_workers"]
    assert prepared["max_workers"] >= types["prefill"]["max_workers"] + types["decode"]["max_workers"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", [AWS, LOCAL], ids=["aws", "local"])
def test_setup_installs_tidepool_with_the_pinned_torch_and_matching_ray(path):
    prepared = prepare_config(_load(path))
    for key in ("head_setup_commands", "worker_setup_commands"):  # setup_commands merged into both
        commands = " ; ".join(prepared[key])
        assert f"pip install {_pinned_torch()}" in commands
        assert f'"ray[default]=={ray.__version__}"' in commands  # `ray up` needs the same Ray on the nodes
        assert "git clone" in commands and "pip install -e ~/tidepool" in commands
    head_setup = " ; ".join(prepared["head_setup_commands"])
    assert "apt-get install -y redis-server" in head_setup
    assert "redis-server" not in " ; ".join(prepared["worker_setup_commands"])
    head_start = " ; ".join(prepared["head_start_ray_commands"])
    assert "ray start --head --port=6379" in head_start and "redis-server --port 6380" in head_start
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in prepared["worker_start_ray_commands"])


@pytest.mark.timeout(60)
def test_local_workers_start_with_their_role_resource():
    prepared = prepare_config(_load(LOCAL))
    assert any('--resources="$(cat ~/.tidepool/ray_resources.json)"' in c
               for c in prepared["worker_start_ray_commands"])
    assert "--num-cpus=0" in " ; ".join(prepared["head_start_ray_commands"])


def _role_step() -> str:
    return next(c for c in _load(LOCAL)["worker_setup_commands"] if "ray_resources.json" in c)


def _run_role_step(tmp_path: Path, host_ips: str) -> subprocess.CompletedProcess:
    # `hostname -I` answers as the given host would; the step itself runs unchanged.
    script = f"hostname() {{ echo '{host_ips}'; }}\n{_role_step()}"
    return subprocess.run(["bash", "-c", script], env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30)


@pytest.mark.timeout(60)
def test_local_role_table_gives_every_worker_host_a_role(tmp_path):
    roles = {}
    for ip in _load(LOCAL)["provider"]["worker_ips"]:
        home = tmp_path / ip
        result = _run_role_step(home, f"{ip} 172.17.0.1")
        assert result.returncode == 0, result.stderr
        resources = json.loads((home / ".tidepool" / "ray_resources.json").read_text())
        assert len(resources) == 1 and next(iter(resources.values())) >= 1
        roles[ip] = next(iter(resources))
    assert set(roles.values()) == {"prefill", "decode"}, roles


@pytest.mark.timeout(60)
def test_local_role_table_refuses_an_unlisted_host(tmp_path):
    result = _run_role_step(tmp_path, "10.9.9.9")
    assert result.returncode != 0
    assert "no role for host" in result.stderr
    assert not (tmp_path / ".tidepool" / "ray_resources.json").exists()
