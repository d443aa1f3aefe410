#!/usr/bin/env bash
# Fuzzes `m31 serve` from its own OpenAPI schema with schemathesis, every check on: a tiny world
# (the one the serving tests build), served with an admin and a read token, EXAMPLES generated
# cases per operation and phase, sent with the admin token (which also reads). docs/SERVING.md
# ("Fuzzing") quotes the command and the last run's counts.
#   scripts/fuzz_serve.sh [EXAMPLES]       (default 300; about 2 minutes)
set -euo pipefail
EXAMPLES=${1:-300}
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8732}
OUT=${OUT:-runs/fuzz}
mkdir -p "$OUT"
world=$(mktemp -d)
trap 'kill "$server" 2>/dev/null || true; rm -rf "$world"' EXIT

PYTHONPATH=tests "$PY" -c 'import sys, pathlib, serve_helpers as h; h.build_world(pathlib.Path(sys.argv[1]))' "$world"
export M31_ADMIN_TOKEN=fuzz-admin M31_READ_TOKEN=fuzz-read
"$PY" -m m31.cli serve --index "$world/index" --model "$world/runs/moe.pt" \
  --port "$PORT" >"$OUT/server.log" 2>&1 &
server=$!
until curl -sf "http://127.0.0.1:$PORT/health/ready" >/dev/null; do
  kill -0 "$server" || { cat "$OUT/server.log"; exit 1; }
  sleep 0.5
done

"$(dirname "$PY")/schemathesis" --config-file scripts/schemathesis.toml run \
  "http://127.0.0.1:$PORT/openapi.json" --checks all --max-examples "$EXAMPLES" --seed 31 \
  --header "Authorization: Bearer $M31_ADMIN_TOKEN" --workers 1 \
  --report junit,vcr --report-dir "$OUT" | tee "$OUT/schemathesis.txt"
"$PY" scripts/fuzz_counts.py "$(ls -t "$OUT"/vcr-*.yaml | head -1)"
