"""bench/kernels_gpu.sh is run once on a lent GPU, with no chance to debug it there: its whole code
path (shapes, pool shuffle, the Triton kernel against SDPA, the printout) must work before then.
`--smoke` runs it at tiny shapes on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import re

from conftest import bench_smoke_run


def test_gpu_bench_script_smoke_run_matches_sdpa() -> None:
    out = bench_smoke_run("kernels_gpu.sh", timeout=300)
    rows = [line for line in out.splitlines() if line.startswith(("decode", "prefill"))]
    assert {r.split()[0] for r in rows} == {"decode", "prefill"}, out
    errors = [float(m) for m in re.findall(r"max err ([0-9.e+-]+)", out)]
    assert len(errors) == len(rows)
    assert max(errors) < 1e-4, out
