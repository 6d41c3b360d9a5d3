#!/usr/bin/env bash
# Tensor parallelism on a lent multi-GPU machine, < 5 minutes, installs nothing, needs no network.
#
#   bench/tensor_parallel_gpu.sh          # random weights of the default model's shape, bf16,
#                                         # N = 1, 2, 4, 8 up to the GPUs present (NCCL)
#   bench/tensor_parallel_gpu.sh --smoke  # the same code path on the CPU (gloo), tiny model
#
# Prints, per N: throughput, median step, rank 0's share of time in the collectives, bytes per
# token, whether the greedy tokens equal N = 1's; then the arithmetic for when TP pays.
set -euo pipefail
source "$(dirname "$0")/gpu_prelude.sh" "$@"
if [[ "${1:-}" == "--smoke" ]]; then
  exec "$PY" bench/tensor_parallel.py --smoke
fi
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [[ "$GPUS" -lt 1 ]]; then echo "no CUDA GPU visible (use --smoke on a CPU)" >&2; exit 1; fi
TP=(1)
for n in 3 2 4 8; do  # 3: the default model's 9 / 3 heads split three ways too
  if [[ "$n" -le "$GPUS" ]]; then TP+=("$n"); fi
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -8 || true
exec timeout 280 "$PY" bench/tensor_parallel.py --random-weights --device cuda --dtype bfloat16 \
  --tp "${TP[@]}" --prompts 64 --prompt-len 256 --max-tokens 64
