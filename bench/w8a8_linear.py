"""One decoder layer's linears at a decode batch of 64 rows, the default model's (qkv 576->960,
o 576->576, gate_up 576->3072, down 1536->576) or Llama-3.1-8B's (`--shape llama-8b`): bf16 (oneDNN-packed, AMX-BF16 where present) against
W8A8 int8 (oneDNN's int8 GEMM, AMX-INT8 / VNNI) with the activation side as torch ops (absmax,
divide, round, clamp, casts; the rescale after) and fused (one C++ pass each,
kernels/csrc/cpu_quant.cpp). Single calls timed, interleaved, the fastest of each (the
least disturbed by other jobs on a shared machine); ratios in one run.

    python bench/w8a8_linear.py [--shape smollm2|llama-8b] [--rows 64] [--reps 50]
"""

from __future__ import annotations

import argparse
import time

import torch
from kvserve.engine.layers.quantization import activation as act
from kvserve.engine.layers.quantization.int8_w8a8 import Int8W8A8Linear
from kvserve.engine.layers.quantization.qweight import QuantizedWeight

MODELS = {  # (out, in) per linear, and the layer count
    "smollm2": ({"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576),
                 "down": (576, 1536)}, 30),
    "llama-8b": ({"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                  "down": (4096, 14336)}, 32),
}


def kernels(out: int, inp: int, rows: int):
    g = torch.Generator().manual_seed(out * inp)
    w = torch.randn(out, inp, generator=g)
    scale = w.abs().amax(1, keepdim=True) / 127
    lin = Int8W8A8Linear(QuantizedWeight(torch.round(w / scale).to(torch.int8), scale, None,
                                         inp, 8))
    packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None)
    x = torch.randn(rows, inp, generator=g).bfloat16()

    def bf16():
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def unfused():
        codes, xs = act.torch_int8_per_token(x)
        y = torch.ops.onednn.qlinear_pointwise(codes, 1.0, 0, lin.weight, lin.weight_scale,
                                               lin.weight_zero, None, 1.0, 0, torch.float32,
                                               "none", [None], "")
        return (y * xs).to(x.dtype)

    assert torch.equal(unfused(), lin(x)), "the fused path must give the unfused bits"
    return {"bf16": bf16, "int8 unfused": unfused, "int8 fused": lambda: lin(x)}


def once_us(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--shape", choices=sorted(MODELS), default="smollm2")
    args = ap.parse_args()
    shapes, layers = MODELS[args.shape]
    if not act.fused_rows(torch.zeros(1, 8)):
        print("warning: the C++ ops are not built: 'fused' runs the torch expressions")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rows} rows, "
          f"{args.shape} shapes")
    step: dict[str, float] = {}
    for name, (out, inp) in shapes.items():
        fns = kernels(out, inp, args.rows)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.reps):  # interleaved, so a burst of load hits every kernel
            for k, fn in fns.items():
                fn()
                times[k].append(once_us(fn))
        best = {k: min(v) for k, v in times.items()}
        for k, v in best.items():
            step[k] = step.get(k, 0.0) + v * layers
        print(f"{name:8s} {out}x{inp}: " + ", ".join(
            f"{k} {v:.0f} us ({best['bf16'] / v:.2f}x bf16)" for k, v in best.items()))
        del fns
    print(f"decode step linears (x{layers} layers): " + ", ".join(
        f"{k} {v / 1e3:.1f} ms ({step['bf16'] / v:.2f}x bf16)" for k, v in step.items()))


if __name__ == "__main__":
    main()
