#!/usr/bin/env bash
# Serving figures of docs/SERVING.md: the demo index behind `m31 serve`, with dynamic batching
# (batches of up to 64 requests) and without (batches of 1), loaded by `m31 loadtest` at
# concurrency 1, 8 and 64 on loopback. Needs `make demo` first (data/demo).
#   scripts/serve_load.sh [DEMO_DIR] [SECONDS]     (about 2 minutes with 10 s per level)
set -euo pipefail
DEMO=${1:-data/demo}
SECONDS_PER_LEVEL=${2:-10}
M31=${M31:-.venv/bin/m31}
PORT=${PORT:-8731}
OUT=${OUT:-runs/serve}
mkdir -p "$OUT"
state=$(mktemp -d)
source "$(dirname "$0")/serve_lib.sh"
trap 'stop_server; rm -rf "$state"' EXIT

for batch in 64 1; do
  rm -rf "$state/serving"
  start_server "$OUT/server-batch$batch.log" --index "$DEMO/index" --state "$state/serving" \
    --model "$DEMO/runs/moe.pt" --data "$DEMO/world" --max-batch-size "$batch" \
    --max-queue 4096 --timeout-ms 30000
  echo "## max batch size $batch"
  "$M31" loadtest --url "http://127.0.0.1:$PORT" --data "$DEMO/world" --concurrency 1,8,64 \
    --duration "$SECONDS_PER_LEVEL" --out "$OUT/load-batch$batch.json" \
    --variant "max-batch-size $batch"
  stop_server
done
