"""The committed generated proto modules are what `make proto` produces from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = Path("proto/tidepool/v1")
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


@pytest.mark.timeout(120)
def test_generated_proto_modules_match_make_proto(tmp_path):
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / PROTO_DIR).glob("*.proto"))
    assert protos, "no .proto files found"
    # The same invocation as `make proto`, written to a scratch directory.
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos], cwd=ROOT, check=True)
    stale = []
    for proto in protos:
        stem = Path(proto).stem
        for suffix in SUFFIXES:
            rel = PROTO_DIR / f"{stem}{suffix}"
            committed = ROOT / rel
            if not committed.exists() or committed.read_bytes() != (tmp_path / rel).read_bytes():
                stale.append(str(rel))
    assert not stale, f"stale generated modules (run `make proto`): {stale}"
