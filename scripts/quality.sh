#!/usr/bin/env bash
# Offline quality and the simulated funnel, as reported in docs/QUALITY.md: the demo marketplace
# and MovieLens-100K. Retrieval models are trained over SEEDS training seeds (default 5) and
# reported as mean ± std with a paired moe vs two-tower comparison (m31.eval.stats); the classic
# baselines are scored through the same evaluation on the same requests.
#   scripts/quality.sh [OUT] [MOVIELENS_DIR]      (hours on 2 cores; SEEDS=1 for a quick pass)
set -euo pipefail
OUT=${1:-runs/quality}
ML=${2:-../shared/data/movielens-100k}
M31=${M31:-.venv/bin/m31}
SEEDS=${SEEDS:-5}
BASELINES=popularity,recent-popularity,item-knn,recency-knn,als
mkdir -p "$OUT"

"$M31" world generate --preset demo --seed 0 --out "$OUT/demo" --reuse
"$M31" data movielens --path "$ML" --out "$OUT/ml100k" --overwrite

train() {  # DATA SPLIT MODEL SEED [ARGS...]
  local data=$1 split=$2 model=$3 seed=$4
  shift 4
  local ckpt="$OUT/$data/$split/$model-s$seed.pt"
  mkdir -p "$(dirname "$ckpt")"
  [ -f "$ckpt" ] || "$M31" train --model "$model" --data "$OUT/$data" --split "$split" \
    --seed "$seed" --out "$ckpt" "$@"
}

for data in ml100k demo; do
  splits=(leave-last-out)
  [ "$data" = ml100k ] && splits+=(time)
  for split in "${splits[@]}"; do
    for seed in $(seq 0 $((SEEDS - 1))); do
      for model in moe two-tower; do train "$data" "$split" "$model" "$seed"; done
    done
    # One ranking model: about 4 minutes an epoch on the demo data.
    train "$data" "$split" ranking 0 --epochs 3
  done
done

seeds() { echo "--model=$1=$OUT/$2/$3/$1-s*.pt"; }
# MovieLens: every test user, every item, both splits; the ranking model over the moe's top 500;
# what the moe rests on (its gate and expert families removed at inference).
for split in leave-last-out time; do
  d="$OUT/ml100k/$split"
  "$M31" eval --data "$OUT/ml100k" --split "$split" --baselines "$BASELINES" \
    "$(seeds moe ml100k "$split")" "$(seeds two-tower ml100k "$split")" \
    --model="ranking=$d/ranking-s0.pt" --rerank moe,ranking,500 \
    --plot "$d/recall.png" --json "$d/metrics.json"
  "$M31" ablate --data "$OUT/ml100k" --split "$split" --model "$d/moe-s*.pt" \
    --reference "two-tower=$d/two-tower-s*.pt" --plot "$d/ablation.png" --json "$d/ablation.json"
done
# The demo: all test requests without the ranking model, then 500 sampled requests with it (it
# scores 50,000 ads per request at about 170x the moe's cost).
d="$OUT/demo/leave-last-out"
"$M31" eval --data "$OUT/demo" --baselines popularity,recent-popularity,item-knn,recency-knn \
  "$(seeds moe demo leave-last-out)" "$(seeds two-tower demo leave-last-out)" \
  --json "$d/metrics_all.json"
"$M31" eval --data "$OUT/demo" --model="moe=$d/moe-s0.pt" --model="two-tower=$d/two-tower-s0.pt" \
  --model="ranking=$d/ranking-s0.pt" --rerank moe,ranking,500 --max-users 500 \
  --plot "$d/recall.png" --json "$d/metrics_500.json"
"$M31" simulate --data "$OUT/demo" --retriever="two-tower=$d/two-tower-s0.pt" \
  --retriever="moe=$d/moe-s0.pt" --ranker "$d/ranking-s0.pt" --requests 2000 \
  --json "$d/funnel.json"
