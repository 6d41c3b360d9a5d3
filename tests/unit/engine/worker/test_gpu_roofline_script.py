"""bench/gpu_roofline.sh runs once on a lent GPU with no chance to debug it there: `--smoke` runs
its whole code path (model built from the config, eager and graph decode, prefill, the default
shape's runner and engine runs with the profiler's busy share, the HF peer) at tiny shapes on the
CPU, with a plain call standing in for graph replay."""

from __future__ import annotations

import re

from conftest import bench_smoke_run


def test_gpu_roofline_smoke_run() -> None:
    out = bench_smoke_run("gpu_roofline.sh", timeout=600)
    rows = [line for line in out.splitlines() if line.startswith("decode")]
    assert [r.split()[1] for r in rows] == ["eager"] * 2 + ["graphs"] * 2, out
    assert re.search(r"^prefill 16 tokens: .* tok/s", out, re.M), out
    assert len(re.findall(r"^hf generate batch", out, re.M)) == 2, out
    default = [line for line in out.splitlines() if line.startswith("default shape: decode")]
    assert [r.split()[3] for r in default] == ["eager", "graphs"], out
    engine = re.findall(r"^engine default shape, 2 requests [^,]*, (eager|graphs)[^,]*"
                        r"(, async scheduling)?:", out, re.M)
    assert engine == [("eager", ""), ("graphs", ""), ("graphs", ", async scheduling")], out
    assert re.search(r"^engine default shape: async scheduling vs sync .*: [0-9.]+x$", out,
                     re.M), out
    timed_rows = rows + default + [line for line in out.splitlines()
                                   if line.startswith(("prefill", "default shape: prefill",
                                                       "engine default shape,"))]
    assert len(timed_rows) == 4 + 2 + 2 + 3, out
    for row in timed_rows:  # every configuration has its profiler busy share
        assert re.search(r"busy +[0-9.]+%$", row), row
    err = float(re.search(r"graphs vs eager logits, batch 3: max err ([0-9.e+-]+)", out)[1])
    assert err < 1e-4, out
