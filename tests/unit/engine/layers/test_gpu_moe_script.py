"""bench/gpu_moe_checks.py is run once on a lent GPU, with no chance to debug it there: its whole
code path (sinks in Triton, FusedMoE on the device, the fused MoE kernel in every weight format
and its timing rows, tiny gpt-oss / Qwen2-MoE against HF, an MoE decode in CUDA graphs) must
work before then. `--smoke` runs it on the CPU with Triton interpreted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_gpu_moe_checks_smoke_run_passes():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_moe_checks.py"), "--smoke"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = [line for line in out.stdout.splitlines() if line.startswith(("OK", "FAIL"))]
    assert len(checks) == 9 and all(c.startswith("OK") for c in checks), out.stdout
    assert "all checks passed" in out.stdout
