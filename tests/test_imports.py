"""Import-layer checks: the gateway and router process never loads torch (DESIGN.md section 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

TORCH_FREE = [
    "services.gateway.http", "services.gateway.grpc", "services.dispatcher", "services.messages",
    "services.config", "router.conductor", "router.simulator",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_without_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {module} imports torch"


def test_the_engine_runs_without_llguidance_and_refuses_structured_outputs():
    """The GPU check's bare CUDA machine has no llguidance: the engine must load and generate there."""
    code = """
import sys
sys.modules["llguidance"] = None  # import llguidance now fails, as where it is not installed
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
engine = Engine(EngineConfig(model="tiny", num_blocks=64))
engine.add_request("free", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
while engine.has_unfinished():
    engine.step()
try:
    engine.add_request("kept", [1, 2, 3], SamplingParams(structured_output=StructuredOutput("regex", "a+")))
except InvalidRequestError as err:
    print(err)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "llguidance package is not installed" in out.stdout
