#!/usr/bin/env bash
# The Pareto table of docs/QUALITY.md (issue 27): quality against FLOPs per (request, ad) pair
# for the two-tower, the moe at E = 1, 2, 4 and 8, the moe with G = 0, the dense interaction
# model and the ranking model, each over SEEDS training seeds (default 3), on MovieLens-100K, the
# demo marketplace, and the Amazon Beauty and Sports files (DATASETS, default "ml100k demo"; add
# beauty and sports, read from AMAZON, default ../shared/data/amazon-sr); VARIANTS names the rows
# to train (default all). Trainings run JOBS at a time (default 2) on DEVICE (default cpu: one
# thread each, under nice); TRAIN_ARGS is added to every training (e.g. "--epochs 1" for a quick
# look). Each finished training is evaluated once on its dataset's test requests into an
# evaluation record, RECORDS/<dataset>/<row>-s<seed>.npz (default docs/records/pareto: kept in
# the repository, so a row is trained once, whatever machine runs the rest); on the Amazon files
# each retrieval row also under the standard protocol (every test user) into PROTOCOL_RECORDS
# (default docs/records/loo-position). A row with its records is not trained again, and a
# stopped training goes on from its last epoch (`m31 train --resume`). Then one `m31 eval
# --from-record` per dataset over its records: the table, the paired moe comparisons, a JSON and
# the plot (docs/img/pareto-<dataset>.png); on the Amazon files the protocol's table too.
#   scripts/pareto.sh [OUT] [MOVIELENS_DIR]      (hours on 2 cores; Amazon: days)
set -euo pipefail
OUT=${1:-runs/pareto}
ML=${2:-../shared/data/movielens-100k}
M31=${M31:-.venv/bin/m31}
RECORDS=${RECORDS:-docs/records/pareto}
PROTOCOL_RECORDS=${PROTOCOL_RECORDS:-docs/records/loo-position}
SEEDS=${SEEDS:-3}
JOBS=${JOBS:-2}
DATASETS=${DATASETS:-ml100k demo}
AMAZON=${AMAZON:-../shared/data/amazon-sr}
DEVICE=${DEVICE:-cpu}
TRAIN_ARGS=${TRAIN_ARGS:-}
mkdir -p "$OUT/logs" docs/img

for data in $DATASETS; do
  case $data in
    ml100k) [ -d "$OUT/ml100k" ] || "$M31" data movielens --path "$ML" --out "$OUT/ml100k" ;;
    demo) "$M31" world generate --preset demo --seed 0 --out "$OUT/demo" --reuse ;;
    beauty | sports)
      file=$([ "$data" = beauty ] && echo Beauty || echo Sports_and_Outdoors)
      [ -d "$OUT/$data" ] || "$M31" data import --sequences "$AMAZON/$file.txt" \
        --items "$AMAZON/${file}_item2attributes.json" --out "$OUT/$data" ;;
    *) echo "unknown dataset $data (ml100k, demo, beauty, sports)" >&2; exit 2 ;;
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
# On the Amazon files every row is the `sasrec` preset's (the transformer as the sequence
# expert, 50 items; docs/QUALITY.md), its item attributes read, trained until 5 epochs bring no
# validation gain (60 at most: the Beauty two-tower still gained at epoch 34; with a patience of
# 3, validation's epoch-to-epoch noise stopped the Beauty moe at epochs 10 and 12 while the
# two-tower went on rising to epoch 22 and beyond). The retrieval rows choose their epoch under
# the standard protocol (every validation user, NDCG@10); the dense and ranking models on 2,000
# validation users (HR@50): every item for every validation user is 270 million pairs an epoch
# on Beauty, 650 million on Sports, each a pass of their MLP.
declare -A AMAZON_VARIANT=(
  [two-tower]="--model two-tower"
  [moe-e1]="--model moe --experts sequence=1,cohort=0,semantic=0,coengagement=0 --gate-dim 64"
  [moe-e2]="--model moe --experts sequence=1,cohort=1,semantic=0,coengagement=0 --gate-dim 64"
  [moe-e4]="--model moe --experts sequence=1,cohort=1,semantic=1,coengagement=1 --gate-dim 64"
  [moe]="--model moe --experts sequence=3,cohort=1,semantic=2,coengagement=2 --gate-dim 64"
  [moe-g0]="--model moe --experts sequence=3,cohort=1,semantic=2,coengagement=2 --gate-dim 0"
  [dense]="--model dense"
  [ranking]="--model ranking --epochs 3 --max-len 50"
)
ALL=(two-tower moe-e1 moe-e2 moe-e4 moe moe-g0 dense ranking)
read -r -a NAMES <<<"${VARIANTS:-${ALL[*]}}"  # the rows to train, e.g. VARIANTS="moe ranking"
for name in "${NAMES[@]}"; do
  [ -n "${VARIANT[$name]:-}" ] || { echo "unknown variant $name (${!VARIANT[*]})" >&2; exit 2; }
done

# The test requests each dataset's rows are scored on, and the cut-offs recorded. The demo's
# 50,000 ads cost the pair models (dense, ranking) about a minute per 100 requests; there a few
# hits at HR@10 in 500 requests are noise, and the world's truth is at hand. On the Amazon files
# the same holds for the test users: a seeded sample of 2,000 of them (the history excluded, as
# in the protocol).
eval_args() {
  case $1 in
    demo) echo "--max-users 500 --ks 10,50" ;;
    beauty | sports) echo "--max-users 2000 --ks 10,20" ;;
    *) echo "--ks 10,50" ;;
  esac
}

jobs_file=$(mktemp "$OUT/jobs.XXXXXX")  # one per run: several runs may share OUT
trap 'rm -f "$jobs_file"' EXIT
for data in $DATASETS; do  # the baseline beside every row: minutes, before the trainings
  rec=$RECORDS/$data/recency-knn.npz
  [ -f "$rec" ] || "$M31" eval --data "$OUT/$data" --baselines recency-knn $(eval_args "$data") \
    --record "$rec" >/dev/null
  rec=$PROTOCOL_RECORDS/$data/recency-knn.npz
  case $data in beauty | sports) [ -f "$rec" ] || "$M31" eval --data "$OUT/$data" \
    --baselines recency-knn --protocol loo-position --record "$rec" >/dev/null ;; esac
done
for seed in $(seq 0 $((SEEDS - 1))); do  # a stopped run has one seed of every row first
  for data in $DATASETS; do
    for name in "${NAMES[@]}"; do
      ckpt=$OUT/$data/runs/$name-s$seed.pt rec=$RECORDS/$data/$name-s$seed.npz
      opts=${VARIANT[$name]} done="[ -f $rec ]" evals="{ [ -f $rec ] || $M31 eval --data \
$OUT/$data --model=$name=$ckpt $(eval_args "$data") --record $rec; }"
      case $data in
        beauty | sports)
          opts="--preset sasrec --epochs 60 --patience 5 ${AMAZON_VARIANT[$name]}"
          case $name in
            dense | ranking) ;;
            *)  # a retrieval row: its epoch chosen, and it is recorded, under the protocol too
              prec=$PROTOCOL_RECORDS/$data/$name-s$seed.npz
              opts+=" --protocol loo-position" done+=" && [ -f $prec ]"
              evals+=" && { [ -f $prec ] || $M31 eval --data $OUT/$data --model=$name=$ckpt \
--protocol loo-position --record $prec; }" ;;
          esac ;;
      esac
      eval "$done" && continue  # trained and evaluated, on this machine or another
      mkdir -p "$(dirname "$ckpt")" "$RECORDS/$data" "$PROTOCOL_RECORDS/$data"
      # checked again when the job starts, under a lock (flock's: it goes with the process
      # that holds it): another run on the same OUT may have finished or started it meanwhile.
      log=$OUT/logs/$data-$name-s$seed.log
      echo "$done || flock -n $ckpt.lock bash -c '$done || { { [ -f $ckpt.done ] || { $M31 \
train $opts --data $OUT/$data --seed $seed --device $DEVICE --out $ckpt --resume $TRAIN_ARGS \
&& touch $ckpt.done; }; } && $evals; } >>$log 2>&1'" >>"$jobs_file"
    done
  done
done
echo "$(wc -l <"$jobs_file") rows to train or evaluate, $JOBS at a time (logs in $OUT/logs)"
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 xargs -P "$JOBS" -I{} -d '\n' bash -c {} \
  <"$jobs_file"

for data in $DATASETS; do
  compare=() protocol_compare=()  # the moe against the baseline and each other row recorded
  for rec in "${ALL[@]/%/-s0}" recency-knn; do
    name=${rec%-s0}
    if [ "$name" != moe ] && [ -f "$RECORDS/$data/moe-s0.npz" ] && [ -f "$RECORDS/$data/$rec.npz" ]
    then compare+=(--compare "moe,$name"); fi
    if [ "$name" != moe ] && [ -f "$PROTOCOL_RECORDS/$data/moe-s0.npz" ] \
      && [ -f "$PROTOCOL_RECORDS/$data/$rec.npz" ]
    then protocol_compare+=(--compare "moe,$name"); fi
  done
  metric=()
  [ "$data" = demo ] && metric=(--pareto-metric truth_recall@50)
  "$M31" eval --data "$OUT/$data" --from-record "$RECORDS/$data/*.npz" $(eval_args "$data") \
    "${metric[@]}" "${compare[@]}" --json "$OUT/$data/pareto.json" \
    --pareto "docs/img/pareto-$data.png" | tee "$OUT/$data/pareto.txt"
  case $data in beauty | sports)
    "$M31" eval --data "$OUT/$data" --from-record "$PROTOCOL_RECORDS/$data/*.npz" \
      --protocol loo-position "${protocol_compare[@]}" --json "$OUT/$data/protocol.json" \
      | tee "$OUT/$data/protocol.txt" ;;
  esac
done
