"""The generated gRPC modules: what `make proto` produces, importable and working on the oldest grpcio and
protobuf pyproject.toml allows (the pinned generator environment `make setup` builds holds exactly those)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
STUB_DIR = Path("tidepool/v1")
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
LOWEST = ROOT / ".venv-proto" / "bin" / "python"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def lowest_python() -> Path:
    assert LOWEST.exists(), "the pinned generator environment is missing: run `make setup`"
    return LOWEST


def test_generated_proto_modules_match_make_proto(tmp_path, lowest_python):
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / STUB_DIR).glob("*.proto"))
    assert protos, "no .proto files found"
    # The same invocation as `make proto`, written to a scratch directory.
    subprocess.run([str(lowest_python), "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos], cwd=PROTO_ROOT, check=True)
    stale = []
    for proto in protos:
        for suffix in SUFFIXES:
            rel = STUB_DIR / f"{Path(proto).stem}{suffix}"
            committed = PROTO_ROOT / rel
            if not committed.exists() or committed.read_bytes() != (tmp_path / rel).read_bytes():
                stale.append(str(rel))
    assert not stale, f"stale generated modules (run `make proto`): {stale}"


CALL_ON_LOWEST_VERSIONS = """
import sys
from concurrent import futures
import grpc, google.protobuf
from tidepool.v1 import kv_transfer_pb2, serving_pb2, serving_pb2_grpc
assert serving_pb2.DESCRIPTOR.name == "tidepool/v1/serving.proto", serving_pb2.DESCRIPTOR.name

class Echo(serving_pb2_grpc.ServingServicer):
    def Chat(self, request, context):
        yield serving_pb2.GenerateChunk(text=request.messages[0].content, finish_reason="stop")

server = grpc.server(futures.ThreadPoolExecutor(2))
serving_pb2_grpc.add_ServingServicer_to_server(Echo(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
stub = serving_pb2_grpc.ServingStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
request = serving_pb2.ChatRequest(messages=[serving_pb2.ChatMessage(role="user", content="hi")])
(chunk,) = list(stub.Chat(request, timeout=10))
server.stop(0)
print(grpc.__version__, google.protobuf.__version__, chunk.text)
"""


def test_stubs_work_on_the_lowest_declared_grpcio_and_protobuf(lowest_python):
    out = subprocess.run([str(lowest_python), "-c", CALL_ON_LOWEST_VERSIONS], cwd=PROTO_ROOT,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1.66.2", "5.27.2", "hi"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"grpcio>=1.66.2"' in pyproject and '"protobuf>=5.27.2"' in pyproject
