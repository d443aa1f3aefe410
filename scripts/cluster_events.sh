#!/usr/bin/env bash
# Events on one server and on the cluster, same index, same run (docs/SCALING.md, "Users"):
# events acknowledged per second (batches of 100, SENDERS senders, default 2, no retrieves; more
# senders give the cluster's group commit more calls to share a transaction), then retrieve
# p50/p99 (B = 1, K = 100, one client) alone and beside 2,000 events/s, for `m31 serve` and for
# `m31 serve --ray` over SHARDS shards (a local Ray cluster).
#   .venv/bin/python scripts/serve_limits.py build data/events --ads 50000   # once
#   scripts/cluster_events.sh [WORLD_DIR] [SHARDS] [SECONDS]   (about 4 minutes)
set -euo pipefail
WORLD=${1:-data/events}
SHARDS=${2:-2}
SECONDS_PER_LEVEL=${3:-10}
SENDERS=${SENDERS:-2}
M31=${M31:-.venv/bin/m31}
PORT=${PORT:-8751}
OUT=${OUT:-runs/cluster-events}
export M31_ADMIN_TOKEN=${M31_ADMIN_TOKEN:-events-bench}
mkdir -p "$OUT"
state=$(mktemp -d)
source "$(dirname "$0")/serve_lib.sh"
trap 'stop_server; rm -rf "$state"' EXIT

for kind in single ray; do
  if [ "$kind" = ray ]; then
    extra=(--ray --shards "$SHARDS" --state "$state/cluster")
  else
    extra=(--state "$state/serving")
  fi
  start_server "$OUT/server-$kind.log" --index "$WORLD/index" --model "$WORLD/runs/moe.pt" \
    --timeout-ms 30000 "${extra[@]}"
  echo "## $kind"
  "$M31" loadtest --data "$WORLD/index" --url "http://127.0.0.1:$PORT" --concurrency 0 \
    --duration "$SECONDS_PER_LEVEL" --event-clients "$SENDERS" --event-batch 100 \
    --out "$OUT/events-$kind.json" --variant "$kind"
  "$M31" loadtest --data "$WORLD/index" --url "http://127.0.0.1:$PORT" --concurrency 1 \
    --duration "$((2 * SECONDS_PER_LEVEL))" --event-clients 2 --event-batch 100 \
    --event-rate 2000 --out "$OUT/beside-$kind.json" --variant "$kind"
  stop_server
done
