#!/usr/bin/env bash
# A local kvserve cluster: redis-server, REPLICAS `kvserve serve` replicas publishing to it, and the
# prefix-aware router on :PORT. Clients talk to http://localhost:PORT/v1 as to one server.
# Ctrl-C stops everything. Knobs (env): MODEL REPLICAS PORT REDIS_PORT SERVICE VENV ROUTER_POLICY,
# and REDIS_URL to use an existing Redis instead of starting one (any --redis-url, e.g.
# redis+sentinel://127.0.0.1:26379/mymaster or redis+cluster://127.0.0.1:7000,127.0.0.1:7001).
set -euo pipefail

MODEL=${MODEL:-smollm2-135m-instruct}
REPLICAS=${REPLICAS:-2}
PORT=${PORT:-8000}
REDIS_PORT=${REDIS_PORT:-6379}
SERVICE=${SERVICE:-demo}
VENV=${VENV:-.venv}
ROUTER_POLICY=${ROUTER_POLICY:-prefix}
KVSERVE=${KVSERVE:-$VENV/bin/kvserve}
REDIS_URL=${REDIS_URL:-}

pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

if [ -n "$REDIS_URL" ]; then
  echo "using REDIS_URL (the replicas and the router check it at startup)"
elif command -v redis-cli >/dev/null && redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; then
  echo "using the Redis already on :$REDIS_PORT"
  REDIS_URL="redis://127.0.0.1:${REDIS_PORT}"
else
  REDIS_URL="redis://127.0.0.1:${REDIS_PORT}"
  command -v redis-server >/dev/null || { echo "redis-server not found (apt install redis-server)"; exit 1; }
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
  pids+=($!)
fi

# Fetch once up front so the replicas do not all download the model at the same time.
"$KVSERVE" fetch-model "$MODEL" >/dev/null 2>&1 || true

for i in $(seq 1 "$REPLICAS"); do
  rport=$((PORT + i))
  "$KVSERVE" serve "$MODEL" --host 127.0.0.1 --port "$rport" --redis-url "$REDIS_URL" \
    --service-name "$SERVICE" --replica-id "replica-$i" --advertise-url "http://127.0.0.1:$rport" &
  pids+=($!)
done

"$KVSERVE" router --port "$PORT" --redis-url "$REDIS_URL" --service-name "$SERVICE" \
  --policy "$ROUTER_POLICY" &
pids+=($!)

echo "router: http://localhost:$PORT/v1 (health /health, metrics /metrics), $REPLICAS replicas on :$((PORT + 1))..:$((PORT + REPLICAS))"
# Stop the whole set as soon as any part exits.
wait -n
