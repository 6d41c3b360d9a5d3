#!/usr/bin/env bash
# KV block transfer between two GPU caches (KVServeConnector, tcp and shm) vs the prefill of the
# same tokens, at Llama-3.1-8B's shape on a lent GPU (bench/pd_gpu.py); `--smoke` runs the same
# code path at a tiny shape on the CPU.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
exec "$PY" bench/pd_gpu.py "$@"
