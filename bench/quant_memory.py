"""Resident weight memory of the default model as loaded, dense and quantised, in one process:
bf16 dense, online int8 (W8A8), a W4A16 folder and the model's own GGUF (Q4_1, Q8_0 embedding),
counted as bench/throughput.py counts them (parameters and buffers, each storage once, rotary
tables excluded; a oneDNN-packed copy of a tied lm_head counts). Loading only: seconds, no decode.

    python bench/quant_memory.py [--w4a16 FOLDER]   # FOLDER from bench/make_quantized.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from throughput import weight_bytes  # noqa: E402

from kvserve.engine.worker.model_loader import fetch_model, load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--w4a16", type=Path, help="a compressed-tensors W4A16 copy of the model")
    args = ap.parse_args()
    folder = fetch_model()
    runs = [("bf16", folder, None), ("int8 W8A8 (online)", folder, "int8")]
    if args.w4a16:
        runs.append((f"W4A16 ({args.w4a16.name})", args.w4a16, None))
    runs.append(("GGUF Q4_1 (the model's own file)", folder, "gguf"))
    base = None
    print("| weights | resident MiB | vs bf16 |\n| --- | --- | --- |")
    for label, path, quant in runs:
        model, _ = load_model(path, torch.bfloat16, torch.device("cpu"), quantization=quant)
        mib = weight_bytes(model) / 2**20
        base = base or mib
        print(f"| {label} | {mib:.1f} | {mib / base:.2f}x |", flush=True)
        del model


if __name__ == "__main__":
    main()
