"""bench/tensor_parallel_gpu.sh runs once on a lent GPU machine, with no chance to debug it there:
`--smoke` runs its whole code path (random model, N = 1 and 2 ranks, the timers, the table) on the
CPU over gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_tp_gpu_bench_smoke_run_gives_identical_tokens() -> None:
    out = subprocess.run(["bash", str(ROOT / "bench" / "tensor_parallel_gpu.sh"), "--smoke"],
                         env={**os.environ, "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line[:2].strip().isdigit()]
    assert [r[0] for r in rows] == ["1", "2"], out.stdout
    assert all(r[-1] == "True" for r in rows), out.stdout  # N = 2 gives N = 1's tokens
    assert rows[0][3] == "0.0%" and float(rows[1][3].rstrip("%")) > 0  # collectives timed
    assert "GPU decode step at N=2" in out.stdout
