#!/usr/bin/env bash
# Offline quality and the simulated funnel, as reported in docs/QUALITY.md:
# the demo marketplace and MovieLens-100K, three models each, on this machine's CPU.
#   scripts/quality.sh [OUT] [MOVIELENS_DIR]      (about 45 minutes on 2 cores)
set -euo pipefail
OUT=${1:-runs/quality}
ML=${2:-../shared/data/movielens-100k}
M31=${M31:-.venv/bin/m31}
mkdir -p "$OUT"

"$M31" world generate --preset demo --seed 0 --out "$OUT/demo" --reuse
"$M31" data movielens --path "$ML" --out "$OUT/ml100k" --overwrite

for data in demo ml100k; do
  for model in moe two-tower ranking; do
    epochs=()
    [ "$model" = ranking ] && epochs=(--epochs 3)  # about 4 minutes an epoch on the demo data
    "$M31" train --model "$model" --data "$OUT/$data" --out "$OUT/$data/$model.pt" "${epochs[@]}"
  done
done

models() { for m in moe two-tower ranking; do echo "--model=$m=$OUT/$1/$m.pt"; done; }
# MovieLens: every test user, every item; the demo: the ranking model on 500 sampled requests
# (it scores 50,000 ads per request at about 170x the moe's cost), the others also on all.
"$M31" eval --data "$OUT/ml100k" $(models ml100k) --plot "$OUT/ml100k/recall.png" --json "$OUT/ml100k/metrics.json"
"$M31" eval --data "$OUT/demo" --model="moe=$OUT/demo/moe.pt" --model="two-tower=$OUT/demo/two-tower.pt" \
  --json "$OUT/demo/metrics_all.json"
"$M31" eval --data "$OUT/demo" $(models demo) --max-users 500 --plot "$OUT/demo/recall.png" \
  --json "$OUT/demo/metrics_500.json"
"$M31" simulate --data "$OUT/demo" --retriever="two-tower=$OUT/demo/two-tower.pt" \
  --retriever="moe=$OUT/demo/moe.pt" --ranker "$OUT/demo/ranking.pt" --requests 2000 \
  --json "$OUT/demo/funnel.json"
