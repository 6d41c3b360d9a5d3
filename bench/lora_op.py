"""The batched LoRA op alone on the CPU, per adapted linear of the default model's shapes.

    python bench/lora_op.py [--dtype float32] [--threads 1] [--rows 16 256]

For each linear (qkv, o, gate_up, down) at T rows, 8 resident adapters of rank 8, every row on
one of them: the base linear (oneDNN-packed) alone, base + the dense torch fallback (x @ A_all^T
masked per row, then a block-diagonal B: three ops), and base + the C++ op
(kernels/csrc/cpu_lora.cpp: one call). Each figure is the 10th percentile of single calls (robust
to other work on a shared machine); the ratio to the base linear is measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.engine.layers.packed_linear import _pack
from kvserve.kernels import cpu_ops

SHAPES = (("qkv", 576, [576, 192, 192]), ("o", 576, [576]), ("gate_up", 576, [1536, 1536]),
          ("down", 1536, [576]))


def timed(f, n: int = 300) -> float:
    for _ in range(10):
        f()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 10] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 256])
    args = ap.parse_args()
    if not cpu_ops.fused_available():
        raise SystemExit("the C++ kernels are unavailable here")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    dt, slots, rank = getattr(torch, args.dtype), 8, 8
    for t in args.rows:
        totals = [0.0, 0.0, 0.0]
        for name, k, widths in SHAPES:
            s, n = len(widths), max(widths)
            base = _pack(torch.nn.Linear(k, sum(widths), bias=False).to(dt))
            x = torch.randn(t, k, dtype=dt)
            a = (torch.randn(s, slots, rank, k) * 0.05).to(dt)
            bt = (torch.randn(s, slots, rank, n) * 0.05).to(dt)
            idx = torch.arange(t) % slots
            onehot = (idx[:, None] == torch.arange(slots)[None]).to(dt)
            mask = onehot[:, None, :, None].expand(t, s, slots, rank).reshape(t, -1)
            offs = [sum(widths[:i]) for i in range(s)]
            bdiag = torch.zeros(s * slots * rank, sum(widths), dtype=dt)
            for i in range(s):
                for j in range(slots):
                    row = (i * slots + j) * rank
                    bdiag[row:row + rank, offs[i]:offs[i] + widths[i]] = bt[i, j, :, :widths[i]]
            a_all = a.view(-1, k)

            def dense():
                y = base(x)
                shrink = x @ a_all.t()
                shrink.mul_(mask)
                return y.addmm_(shrink, bdiag)

            def cpp():
                y = base(x)
                torch.ops.kvserve_ops.lora_add(y, x, a, bt, idx, offs, widths)
                return y

            torch.testing.assert_close(dense().float(), cpp().float(), atol=0.05, rtol=0.02)
            us = [timed(lambda: base(x)), timed(dense), timed(cpp)]
            totals = [a + b for a, b in zip(totals, us)]
            print(f"T={t} {name}: base {us[0]:.0f} us, + dense {us[1]:.0f} us "
                  f"({us[1] / us[0]:.2f}x), + C++ op {us[2]:.0f} us ({us[2] / us[0]:.2f}x)")
        print(f"T={t} all four: base {totals[0]:.0f} us, + dense {totals[1] / totals[0]:.2f}x, "
              f"+ C++ op {totals[2] / totals[0]:.2f}x")


if __name__ == "__main__":
    main()
