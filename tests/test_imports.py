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
