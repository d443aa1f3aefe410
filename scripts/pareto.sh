#!/usr/bin/env bash
# The Pareto table of docs/QUALITY.md (issue 27): quality against FLOPs per (request, ad) pair
# for the two-tower, the moe at E = 1, 2, 4 and 8, the moe with G = 0, the dense interaction
# model and the ranking model, each over SEEDS training seeds (default 3), on MovieLens-100K and
# the demo marketplace (DATASETS, default "ml100k demo"); VARIANTS names the rows to train (default
# all). Trainings run JOBS at a time (default 2), each on one thread under nice; a finished
# training (its .done file) is kept, so a stopped run goes on where it stopped. Then one
# `m31 eval` per dataset over every finished training: the table, the paired moe comparisons, a
# JSON and the plot (docs/img/pareto-<dataset>.png).
#   scripts/pareto.sh [OUT] [MOVIELENS_DIR]      (hours on 2 cores)
set -euo pipefail
OUT=${1:-runs/pareto}
ML=${2:-../shared/data/movielens-100k}
M31=${M31:-.venv/bin/m31}
SEEDS=${SEEDS:-3}
JOBS=${JOBS:-2}
DATASETS=${DATASETS:-ml100k demo}
mkdir -p "$OUT/logs" docs/img

for data in $DATASETS; do
  case $data in
    ml100k) [ -d "$OUT/ml100k" ] || "$M31" data movielens --path "$ML" --out "$OUT/ml100k" ;;
    demo) "$M31" world generate --preset demo --seed 0 --out "$OUT/demo" --reuse ;;
    *) echo "unknown dataset $data (ml100k, demo)" >&2; exit 2 ;;
  esac
done

# NAME: the options of `m31 train` that make the variant (the demo preset's otherwise).
declare -A VARIANT=(
  [two-tower]="--model two-tower"
  [moe-e1]="--model moe --experts sequence=1,cohort=0,semantic=0,coengagement=0"
  [moe-e2]="--model moe --experts sequence=1,cohort=1,semantic=0,coengagement=0"
  [moe-e4]="--model moe --experts sequence=1,cohort=1,semantic=1,coengagement=1"
  [moe]="--model moe"
  [moe-g0]="--model moe --gate-dim 0"
  [dense]="--model dense"
  [ranking]="--model ranking --epochs 3"
)
ALL=(two-tower moe-e1 moe-e2 moe-e4 moe moe-g0 dense ranking)
read -r -a NAMES <<<"${VARIANTS:-${ALL[*]}}"  # the rows to train, e.g. VARIANTS="moe ranking"
for name in "${NAMES[@]}"; do
  [ -n "${VARIANT[$name]:-}" ] || { echo "unknown variant $name (${!VARIANT[*]})" >&2; exit 2; }
done

jobs_file=$(mktemp "$OUT/jobs.XXXXXX")  # one per run: several runs may share OUT
trap 'rm -f "$jobs_file"' EXIT
for data in $DATASETS; do
  for seed in $(seq 0 $((SEEDS - 1))); do
    for name in "${NAMES[@]}"; do
      ckpt=$OUT/$data/runs/$name-s$seed.pt
      [ -f "$ckpt.done" ] && continue  # written once the training has finished
      mkdir -p "$(dirname "$ckpt")"
      # checked again when the job starts, and claimed (mkdir is atomic): another run on the
      # same OUT may have finished or started it meanwhile. A killed training leaves its
      # .lock folder behind; remove it to train that run again.
      echo "[ -f $ckpt.done ] || ! mkdir $ckpt.lock 2>/dev/null || { $M31 train \
${VARIANT[$name]} --data $OUT/$data --seed $seed --device cpu --out $ckpt \
>$OUT/logs/$data-$name-s$seed.log 2>&1 && touch $ckpt.done; rmdir $ckpt.lock; }" >>"$jobs_file"
    done
  done
done
echo "$(wc -l <"$jobs_file") trainings to run, $JOBS at a time (logs in $OUT/logs)"
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 xargs -P "$JOBS" -I{} -d '\n' bash -c {} \
  <"$jobs_file"

for data in $DATASETS; do
  models=() compare=()  # the finished trainings only: a stopped one leaves its best epoch so far
  for name in "${ALL[@]}"; do
    for done in "$OUT/$data/runs/$name"-s*.pt.done; do
      [ -f "$done" ] && models+=("--model=$name=${done%.done}")
    done
    if [ "$name" != moe ] && [ -f "$OUT/$data/runs/$name-s0.pt.done" ]; then
      compare+=(--compare "moe,$name")
    fi
  done
  # The demo's 50,000 ads cost the pair models (dense, ranking) about a minute per 100 requests;
  # there a few hits at HR@10 in 500 requests are noise, and the world's truth is at hand.
  limit=()
  [ "$data" = demo ] && limit=(--max-users 500 --pareto-metric truth_recall@50)
  "$M31" eval --data "$OUT/$data" "${models[@]}" --baselines recency-knn "${limit[@]}" \
    --ks 10,50 "${compare[@]}" --json "$OUT/$data/pareto.json" \
    --pareto "docs/img/pareto-$data.png" | tee "$OUT/$data/pareto.txt"
done
