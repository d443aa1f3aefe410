#!/usr/bin/env bash
# The whole GPU check of the score·filter·top-K pass, on the GPU image as it is (PyTorch, Triton,
# numpy, typer, pyarrow, matplotlib; nothing is installed): every kernel against the reference on
# fresh random data (stops here on a mismatch), then the timings at DESIGN §6's canonical shapes
# with every baseline, then the engine end to end at N = 10 M over a bf16 and an int8 index,
# plain, capped and ranked by value.
# Under 5 minutes on one H200.
#
#   bash bench/gpu.sh                  # results in bench/out
#   OUT=/tmp/m31-bench bash bench/gpu.sh
#
# Writes check.{csv,md}, bench.{csv,md,png} and engine.{csv,md}; each step prints its tables and
# appends its figures to bench/results.csv, a row each (RESULTS=PATH: another table; on a machine
# that holds a copy of the checkout, bring that table back with the outputs).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out}"
results="${RESULTS:-bench/results.csv}"
python="${PYTHON:-python3}"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"

"$python" -m m31.bench kernels --device cuda --check --out "$out" --results "$results"

# After one warm-up call, at most 5 timed calls and 1.5 s of them per measurement: the slow
# baselines (the reference at B = 512 or N = 100 M) stop after one, which keeps the run short.
"$python" -m m31.bench kernels --device cuda --canonical --repeat 5 --budget 1.5 --out "$out" \
    --results "$results"

# Each request also with a cap per advertiser and ranked by value (the value column), beside
# the plain pass in the same run.
"$python" -m m31.bench engine --device cuda --n 10M --dtype bfloat16,int8 \
    --max-per 0,2 --rank relevance,value --repeat 5 --budget 1.5 --out "$out" --results "$results"
