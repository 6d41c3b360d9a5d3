#!/usr/bin/env bash
# The server against the offline engine on one CUDA GPU, the engine core in a thread of the
# server (as before issue 31) and in its own process (the default), same run, < 6 minutes.
#
#   bench/gpu_serve.sh            # the default model's shape, random bf16 weights (no network)
#   bench/gpu_serve.sh --smoke    # two tiny layers on the CPU: checks the script, times nothing
#
# bench/serve.py's chat workload: 256 conversations, 16 / 64 / 256 streaming clients, greedy,
# ignore_eos; prints tok/s vs offline, TTFT and ITL p50/p99 per mode. The JSON goes under $OUT.
set -euo pipefail
source "$(dirname "$0")/gpu_prelude.sh" "$@"
DIR="${OUT:-$(mktemp -d)}"
MODEL="$(mktemp -d)/serve-model"
"$PY" bench/serve_model.py "$MODEL" >/dev/null
if [[ "${KV_BENCH_SMOKE:-}" == "1" ]]; then
  ARGS=(--concurrency 2 4 --num-requests 4 --max-tokens 4 --dtype float32
        --kv-cache-memory 8MiB)
else
  ARGS=(--concurrency 16 64 256 --num-requests 256 --max-tokens 64 --dtype bfloat16)
fi
"$PY" bench/serve.py --model "$MODEL" --engine-core thread process "${ARGS[@]}" \
  --json-out "$DIR/serve.json"
