"""bench/pd_gpu.sh runs on a lent GPU with no chance to debug it there: `--smoke` runs its whole
code path (the random-weight prefill timed per N, producer and consumer KVServeConnectors on two
caches of the device, pulls over tcp and shm alternating per round, each round's destination
blocks compared byte for byte with the source, the transfer / prefill ratios) at a tiny shape on
the CPU."""

from __future__ import annotations

import re

from conftest import bench_smoke_run

NUM = r"([0-9.]+)"
SPREAD = rf"{NUM} \({NUM}-{NUM}\)"


def test_pd_gpu_smoke_run() -> None:
    out = bench_smoke_run("pd_gpu.sh", timeout=600)
    assert re.search(r"^device cpu \(smoke\); KV layout tiny: 4 layers, 2 KV heads x 16, block "
                     r"16 \(8 KiB a block in bf16, half in fp8\); 2 rounds", out, re.M), out
    assert re.search(r"^prefill model: 4 of 4 layers, random weights", out, re.M), out
    prefill = {int(n): float(m) for n, _, m, _, _ in re.findall(
        rf"^prefill (\d+) blocks \((\d+) tokens\): {SPREAD} ms/block$", out, re.M)}
    assert sorted(prefill) == [1, 3], out
    assert all(f"prefill {n} blocks ({16 * n} tokens)" in out for n in prefill), out
    rows = re.findall(rf"^transfer (bf16|fp8) (\d+) blocks (tcp|shm): {SPREAD} ms/block, "
                      rf"([0-9.e+-]+) GB/s; wire {SPREAD} ms/block(?:; shm/tcp {SPREAD})?; "
                      rf"exact (\d+)/3 rounds; transfer/prefill {NUM}$", out, re.M)
    assert [(d, n, t) for d, n, t, *_ in rows] == [
        (d, n, t) for d in ("bf16", "fp8") for n in ("1", "3") for t in ("tcp", "shm")], out
    block_bytes = {"bf16": 8 * 1024, "fp8": 4 * 1024}
    for d, n, t, med, lo, hi, gbs, w_med, w_lo, w_hi, *vs, exact, ratio in rows:
        n = int(n)
        assert float(lo) <= float(med) <= float(hi) and float(w_lo) <= float(w_med) <= \
            float(w_hi), out
        assert float(w_med) <= float(hi), out  # the wire part is inside the whole pull
        # GB/s is the block bytes over the median pull; ms/block is the median pull over n
        assert abs(float(gbs) - block_bytes[d] / (float(med) * 1e-3) / 1e9) <= \
            0.02 * float(gbs), (d, n, t, out)
        assert abs(float(ratio) - float(med) / prefill[n]) <= 0.01 * float(ratio) + 1e-3, out
        assert bool(vs[0]) == (t == "shm"), out
        assert exact == "3", out  # every round's pulled blocks equal the source bit for bit
    assert out.rstrip().splitlines()[-1].startswith(
        "every pulled block equals its source bit for bit"), out
