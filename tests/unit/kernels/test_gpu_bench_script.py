"""bench/kernels_gpu.sh is run once on a lent GPU, with no chance to debug it there: its whole code
path (shapes, pool shuffle, the Triton kernel against SDPA, the printout) must work before then.
`--smoke` runs it at tiny shapes on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_gpu_bench_script_smoke_run_matches_sdpa() -> None:
    out = subprocess.run(["bash", str(ROOT / "bench" / "kernels_gpu.sh"), "--smoke"],
                         env={**os.environ, "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("decode", "prefill"))]
    assert {r.split()[0] for r in rows} == {"decode", "prefill"}, out.stdout
    errors = [float(m) for m in re.findall(r"max err ([0-9.e+-]+)", out.stdout)]
    assert len(errors) == len(rows)
    assert max(errors) < 1e-4, out.stdout
