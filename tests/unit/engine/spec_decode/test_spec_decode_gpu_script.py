"""bench/spec_decode_gpu.sh runs on a lent GPU with no chance to debug it there: `--smoke` runs
its whole code path (random target built on the device, the EAGLE-3 head written in the
published layout and loaded by Eagle3Proposer, decode / verification / drafting timed, the
projections printed, the verification replayed from a graph of k + 1 tokens per sequence
against the eager one) at a tiny shape on the CPU."""

from __future__ import annotations

import re

from conftest import bench_smoke_run


def test_spec_decode_gpu_smoke_run() -> None:
    out = bench_smoke_run("spec_decode_gpu.sh", timeout=600)
    assert "acceptance cannot be measured on random weights" in out, out
    assert re.findall(r"^decode batch (\d+), context 24: [0-9.]+ ms/step", out, re.M) == \
        ["1", "3"], out
    verify = re.findall(r"^verify batch (\d+) k=2: [0-9.]+ ms \([0-9.]+x decode\); eagle3 "
                        r"draft k=2: [0-9.]+ ms$", out, re.M)
    assert verify == ["1", "3"], out
    projected = re.findall(r"^projected speed-up batch \d+ k=2 at acceptance 0.6: [0-9.]+x, "
                           r"0.7: [0-9.]+x, 0.8: [0-9.]+x \(assumed rates\)$", out, re.M)
    assert len(projected) == 2, out
    # the verification step replayed from a graph of k + 1 tokens per sequence, same logits
    graphs = re.findall(r"^verify graph batch (\d+) k=2: [0-9.]+ ms replayed \(size \1 x 3 "
                        r"tokens\) vs [0-9.]+ ms eager \([0-9.]+x\); max logit difference "
                        r"([0-9.e+-]+)$", out, re.M)
    assert [b for b, _ in graphs] == ["1", "3"], out
    assert all(float(d) < 1e-4 for _, d in graphs), out
