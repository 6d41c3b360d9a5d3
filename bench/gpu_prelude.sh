# Sourced by the bench/*_gpu.sh / gpu_roofline.sh scripts: run from the repository root, pick the
# Python ($PYTHON, else .venv's, else python3) as $PY, make the repository importable as package
# `kvserve` without an editable install (a symlink in a temporary folder), and with `--smoke` as
# the first argument run under the Triton interpreter at tiny shapes (KV_BENCH_SMOKE=1).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [[ "${1:-}" == "--smoke" ]]; then export TRITON_INTERPRET=1 KV_BENCH_SMOKE=1; fi
if ! "$PY" -c "import kvserve.engine, kvserve.kernels" 2>/dev/null; then
  LINKS="$(mktemp -d)"; ln -s "$(pwd)" "$LINKS/kvserve"
  export PYTHONPATH="$LINKS${PYTHONPATH:+:}${PYTHONPATH:-}"
fi
