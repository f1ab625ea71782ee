"""The installed distribution: which import names it claims, its dependency ranges, a clean `pip check`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
OURS = {"engine", "kvstore", "router", "services", "loadtest", "tidepool"}

pytestmark = pytest.mark.timeout(300)


def test_the_wheel_claims_no_import_name_of_another_package(tmp_path):
    had_build = (ROOT / "build").exists()
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    finally:
        if not had_build:  # setuptools builds in the tree: leave no build/ behind
            shutil.rmtree(ROOT / "build", ignore_errors=True)
    (wheel,) = tmp_path.glob("tidepool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == OURS  # in particular no top-level `proto`, which is proto-plus's package
    assert "tidepool/v1/serving.proto" in names and "kvstore/lua/lookup.lua" in names


def test_torch_is_a_range_that_admits_other_builds():
    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    (torch,) = [d for d in deps if d.name == "torch"]
    assert torch.specifier.contains("2.11.0") and torch.specifier.contains("2.13.0")
    assert torch.specifier.contains("2.14.1")


def test_proto_plus_still_imports_and_pip_check_is_clean():
    out = subprocess.run([sys.executable, "-c", "import proto; proto.Message; import tidepool.v1.serving_pb2"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
