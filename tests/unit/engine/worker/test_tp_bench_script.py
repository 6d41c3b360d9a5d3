"""bench/tensor_parallel_gpu.sh runs once on a lent GPU machine, with no chance to debug it there:
`--smoke` runs its whole code path (random model, N = 1 and 2 ranks, the timers, the table) on the
CPU over gloo."""

from __future__ import annotations

from conftest import bench_smoke_run


def test_tp_gpu_bench_smoke_run_gives_identical_tokens() -> None:
    out = bench_smoke_run("tensor_parallel_gpu.sh", timeout=600)
    rows = [line.split() for line in out.splitlines() if line[:2].strip().isdigit()]
    assert [r[0] for r in rows] == ["1", "2"], out
    assert all(r[-1] == "True" for r in rows), out  # N = 2 gives N = 1's tokens
    assert rows[0][3] == "0.0%" and float(rows[1][3].rstrip("%")) > 0  # collectives timed
    assert "GPU decode step at N=2" in out
