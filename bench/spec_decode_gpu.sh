#!/usr/bin/env bash
# Speculative decoding at Llama-3.1-8B's shape on a lent GPU (bench/spec_decode_gpu.py);
# `--smoke` runs the same code path at a tiny shape on the CPU.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
exec "$PY" bench/spec_decode_gpu.py "$@"
