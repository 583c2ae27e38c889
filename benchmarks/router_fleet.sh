#!/usr/bin/env bash
# Router policies side by side: 3 tiny-model replicas, the same closed-loop agentic workload
# through `tokenmill route` once per policy (random, session_hash, agentic).
# Reports per policy: cache hit rate, p50/p99 TTFT (from `tokenmill bench`) and the per-replica
# load dispersion (variance / mean of in-flight requests, sampled by the router every 50 ms).
#
# Usage: benchmarks/router_fleet.sh [OUT_DIR]    (env: PY, POLICIES, CONCURRENCY, SESSIONS, TURNS,
#        FIRST, NEW, OUTPUT, THICK, REPLICAS, KV_TOKENS)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-/tmp/tokenmill-router-fleet}
POLICIES=${POLICIES:-"random session_hash agentic"}
REPLICAS=${REPLICAS:-3}
CONCURRENCY=${CONCURRENCY:-12}
SESSIONS=${SESSIONS:-24}
TURNS=${TURNS:-6}
FIRST=${FIRST:-384}
NEW=${NEW:-64}
OUTPUT=${OUTPUT:-16}
THICK=${THICK:-0.15}
KV_TOKENS=${KV_TOKENS:-32768}
mkdir -p "$OUT"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

port() { "$PY" -c 'from tokenmill.utils.proc import free_port; print(free_port())'; }
wait_up() {
  for _ in $(seq 1 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 0.5
  done
  echo "not healthy: $1" >&2; return 1
}

MODEL_DIR="$OUT/tiny-model"
[ -f "$MODEL_DIR/config.json" ] || "$PY" -c "from tokenmill.loader.tiny import build_tiny_checkpoint as b; b('$MODEL_DIR')" >/dev/null 2>&1
URLS=()
for i in $(seq 1 "$REPLICAS"); do
  P=$(port)
  "$PY" -m tokenmill.cli serve --model "$MODEL_DIR" --served-model-name tiny --port "$P" \
      --kv-cache-tokens "$KV_TOKENS" --log-level warning >"$OUT/replica-$i.log" 2>&1 &
  PIDS+=($!)
  URLS+=("http://127.0.0.1:$P")
done
for u in "${URLS[@]}"; do wait_up "$u"; done
echo "replicas: ${URLS[*]}"

for POLICY in $POLICIES; do
  RP=$(port)
  ARGS=()
  for u in "${URLS[@]}"; do ARGS+=(--replica "$u"); done
  "$PY" -m tokenmill.cli route "${ARGS[@]}" --policy "$POLICY" --port "$RP" --log-level warning \
      >"$OUT/router-$POLICY.log" 2>&1 &
  RPID=$!
  wait_up "http://127.0.0.1:$RP"
  "$PY" -m tokenmill.cli bench --base-url "http://127.0.0.1:$RP" --model tiny --seed 1 \
      --concurrency "$CONCURRENCY" --sessions "$SESSIONS" --turns "$TURNS" --first-turn-tokens "$FIRST" \
      --new-tokens "$NEW" --output-tokens "$OUTPUT" --thick-fraction "$THICK" --thick-parallel 4 \
      --flush-cache --no-progress --label "$POLICY" --out "$OUT/$POLICY" >"$OUT/bench-$POLICY.log" 2>&1
  curl -sf "http://127.0.0.1:$RP/v1/loads" >"$OUT/$POLICY/loads.json"
  kill "$RPID"; wait "$RPID" 2>/dev/null || true
done

"$PY" - "$OUT" $POLICIES <<'PYEOF'
import json, sys
out, policies = sys.argv[1], sys.argv[2:]
print(f"{'policy':<14}{'CHR':>8}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'dispersion':>12}{'requests':>10}  decisions")
for p in policies:
    run = json.load(open(f"{out}/{p}/results.json"))["runs"][0]
    loads = json.load(open(f"{out}/{p}/loads.json"))["router"]
    d = loads["load_dispersion"]
    print(f"{p:<14}{run['cache_hit_rate']:>8.3f}{run['ttft_p50_s']*1e3:>13.1f}{run['ttft_p99_s']*1e3:>13.1f}"
          f"{d['index']:>12.3f}{run['num_ok']:>10}  {loads['decisions']}")
PYEOF
