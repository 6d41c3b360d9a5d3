"""bench/gpu_roofline.sh runs once on a lent GPU with no chance to debug it there: `--smoke` runs
its whole code path (model built from the config, eager and graph decode, prefill, the HF peer)
at tiny shapes on the CPU, with a plain call standing in for graph replay."""

from __future__ import annotations

import re

from conftest import bench_smoke_run


def test_gpu_roofline_smoke_run() -> None:
    out = bench_smoke_run("gpu_roofline.sh", timeout=600)
    rows = [line for line in out.splitlines() if line.startswith("decode")]
    assert [r.split()[1] for r in rows] == ["eager"] * 2 + ["graphs"] * 2, out
    assert re.search(r"^prefill 16 tokens: .* tok/s", out, re.M), out
    assert len(re.findall(r"^hf generate batch", out, re.M)) == 2, out
    err = float(re.search(r"graphs vs eager logits, batch 3: max err ([0-9.e+-]+)", out)[1])
    assert err < 1e-4, out
