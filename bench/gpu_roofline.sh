#!/usr/bin/env bash
# The GPU step against its roofline, one CUDA GPU (H100/H200 class), < 5 minutes, no network.
#
#   bench/gpu_roofline.sh            # Llama-3.1-8B's shape, random bf16 weights built on the device
#   bench/gpu_roofline.sh --smoke    # tiny shapes on the CPU under TRITON_INTERPRET=1: checks the
#                                    # script itself, times nothing meaningful
#
# Measures the device's HBM bandwidth (a device copy) and bf16 GEMM peak (an 8192^3 matmul), then
# kvserve's ModelRunner: decode steps at batch 1, 32 and 256 with 1k context, eager and replayed
# from CUDA graphs, as a fraction of the bandwidth roofline (weights + KV bytes read per step), and
# a 4k-token prefill as a fraction of the GEMM peak; the same on the default model's shape
# (SmolLM2-135M) at batch 64; a whole engine run of 64 requests on the default shape, eager and
# with CUDA graphs. Every configuration prints the profiler's GPU-busy share (kernel time / wall).
# HF transformers' generate on the 8B shape at batch 1 and 32 is the same-run peer. Triton's cache
# goes under $OUT (or a temporary folder).
set -euo pipefail
source "$(dirname "$0")/gpu_prelude.sh" "$@"
export TRITON_CACHE_DIR="${OUT:-$(mktemp -d)}/triton-cache"
exec "$PY" bench/gpu_roofline.py
