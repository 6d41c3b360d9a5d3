#!/usr/bin/env bash
# Quantised decode linears on one CUDA GPU (H100/H200 class), < 3 minutes, no network.
#
#   bench/gpu_quant.sh           # Llama-3.1-8B's linear shapes, random weights built on the device
#   bench/gpu_quant.sh --smoke   # tiny shapes on the CPU under TRITON_INTERPRET=1: checks the
#                                # script itself, times nothing meaningful
#
# FP8 x FP8 through torch._scaled_mm (SM89+) and W4A16 through the Triton kernel that dequantises
# inside the tile, against bf16 F.linear, at batch 1 and 64: per linear, and summed over a decode
# step's 32 layers. Triton's cache goes under $OUT (or a temporary folder).
set -euo pipefail
source "$(dirname "$0")/gpu_prelude.sh" "$@"
export TRITON_CACHE_DIR="${OUT:-$(mktemp -d)}/triton-cache"
exec "$PY" bench/gpu_quant.py
