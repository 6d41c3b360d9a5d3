"""bench/gpu_quant.sh runs once on a lent GPU with no chance to debug it there: its code path
(weights built on the device, the Triton W4A16 kernel, the checks and the printout) runs here at
tiny shapes on the CPU under TRITON_INTERPRET=1 (`--smoke`)."""

from __future__ import annotations

import re

from conftest import bench_smoke_run


def test_gpu_quant_script_smoke_run_checks_every_kernel() -> None:
    out = bench_smoke_run("gpu_quant.sh", timeout=300)
    rows = [line for line in out.splitlines() if line.startswith("linear ")]
    assert {r.split()[4] for r in rows} == {"bf16", "w4a16"}, out  # no FP8 tensor cores here
    assert len(rows) == 4 * 2 * 2
    errors = [float(m) for m in re.findall(r"rel err ([0-9.e+-]+)", out)]
    assert len(errors) == len(rows) and max(errors) < 2e-2, out  # bf16 inputs and outputs
    assert re.search(r"decode step linears, batch 4: bf16 .* w4a16 .*x bf16\)", out), out
