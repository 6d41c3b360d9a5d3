"""FP8 (torch._scaled_mm) and W4A16 (Triton, dequantised in the tile) against bf16 on one GPU:
the decoder linears of Llama-3.1-8B's shape (qkv, o, gate_up, down; random weights built on the
device), timed as one decode step's worth (x 32 layers) at batch 1 and 64, each kernel's output
checked against its own dequantised weight. KV_BENCH_SMOKE=1: tiny shapes on the CPU under
TRITON_INTERPRET=1 (checks the script; times nothing meaningful). Run through bench/gpu_quant.sh."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from gpu_roofline import timed  # bench/ is sys.path[0]

from kvserve.engine.layers.quantization.activation import ActivationScheme
from kvserve.engine.layers.quantization.gpu_linear import ScaledMMFp8Linear, TritonW4A16Linear, \
    gpu_kernel_choice
from kvserve.engine.layers.quantization.qweight import QuantizedWeight

SMOKE = os.environ.get("KV_BENCH_SMOKE") == "1"
HIDDEN, INTER, LAYERS = (64, 128, 2) if SMOKE else (4096, 14336, 32)
Q, KV = (64, 32) if SMOKE else (4096, 1024)
SHAPES = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # (out, in)
BATCHES = (1, 4) if SMOKE else (1, 64)
GROUP = 32 if SMOKE else 128


def weights(out: int, inp: int, device: torch.device) -> dict[str, QuantizedWeight]:
    g = torch.Generator(device=device).manual_seed(out + inp)
    codes = torch.randint(-8, 8, (out, inp), generator=g, device=device, dtype=torch.int8)
    scale = torch.rand(out, inp // GROUP, generator=g, device=device) * 0.01 + 1e-3
    fp8 = (torch.randn(out, inp, generator=g, device=device) * 100).clamp(-448, 448)
    return {"w4a16": QuantizedWeight(codes, scale, None, GROUP, 4),
            "fp8": QuantizedWeight(fp8.to(torch.float8_e4m3fn),
                                   torch.rand(out, 1, generator=g, device=device) * 1e-4, None,
                                   inp, 8)}


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cap = torch.cuda.get_device_capability() if device.type == "cuda" else None
    name = torch.cuda.get_device_name() if cap else "cpu (smoke)"
    print(f"device {name}, capability {cap}, torch {torch.__version__}, linears {SHAPES} "
          f"x {LAYERS} layers")
    reps = 2 if SMOKE else 50
    totals: dict[tuple[str, int], float] = {}
    for out, inp in SHAPES:
        ws = weights(out, inp, device)
        dense = {k: w.dequantize(torch.bfloat16) for k, w in ws.items()}
        fp8_ok = gpu_kernel_choice(ws["fp8"], ActivationScheme("fp8"), cap) == "scaled_mm_fp8"
        kernels = {"bf16": lambda x, d=dense["w4a16"]: F.linear(x, d),
                   "w4a16": TritonW4A16Linear(ws["w4a16"], torch.bfloat16)}
        if fp8_ok:
            kernels["fp8"] = ScaledMMFp8Linear(ws["fp8"], torch.bfloat16)
        for m in BATCHES:
            x = torch.randn(m, inp, device=device, dtype=torch.bfloat16)
            for label, fn in kernels.items():
                ref = dense["fp8" if label == "fp8" else "w4a16"]
                y = fn(x).float()
                want = F.linear(x.float(), ref.float())
                err = float((y - want).abs().max() / want.abs().max().clamp_min(1e-6))
                dt = timed(lambda fn=fn, x=x: fn(x), reps)
                totals[(label, m)] = totals.get((label, m), 0.0) + dt * LAYERS
                print(f"linear {out}x{inp} batch {m:3d} {label:6s} {dt * 1e6:9.1f} us  "
                      f"rel err {err:.1e}")
    if "fp8" not in {k for k, _ in totals}:
        print("fp8: _scaled_mm needs SM89+ (row-wise scales SM90+); not timed on this device")
    for m in BATCHES:
        base = totals[("bf16", m)]
        row = ", ".join(f"{k} {t * 1e3:.2f} ms ({base / t:.2f}x bf16)"
                        for (k, mm), t in totals.items() if mm == m)
        print(f"decode step linears, batch {m}: {row}")


if __name__ == "__main__":
    main()
