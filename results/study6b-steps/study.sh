#!/usr/bin/env bash
# Study 6b (PREREGISTRATION.md): Study 6's sgd-wd0 models at the middle and largest rho with 80
# Auto-PGD steps, as two shards side by side, merged, then analysed. Resumable: a shard's
# finished rows are in its study.sqlite, so rerunning this goes on where it stopped.
#
#   [LEVEL=adamw] bash results/study6b-steps/study.sh [OUT]     (default OUT: runs/study6b)
#
# LEVEL: Study 6's level measured again (default sgd-wd0; adamw: Amendment 1).
set -euo pipefail
OUT=${1:-runs/study6b}
HERE=results/study6b-steps
PY=${PY:-.venv/bin/python}
GS=${GS:-.venv/bin/geosharp}
LEVEL=${LEVEL:-sgd-wd0}
L=$OUT/$LEVEL
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
mkdir -p "$L"
cp -n "results/study6-orbit-dose/run/$LEVEL/manifest.csv" "$L/manifest.csv"
# the models, rebuilt and checked bit for bit against their manifest rows
pids=()
for k in 1 2; do
    "$PY" results/study6-orbit-dose/train.py --recipe "$LEVEL" --models 64 --out "$L" \
        --shard "$k/2" --threads 1 --restore &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done  # a restore that fails stops the script here
pids=()
for k in 1 2; do
    "$GS" study "$L/manifest.csv" --data "$L/sharpness.npz" --gap error \
        --measures adaptive-l2 geodesic-inv-o2 --rho adaptive=0.316,1 geodesic=0.1,0.316 \
        --batch-size 128 --samples 512 --steps 80 --expect negative \
        --threads 1 --no-progress --shard "$k/2" --out "$L/shard-$k" > "$L/shard-$k.log" 2>&1 &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
"$GS" merge "$L/measure" "$L/shard-1" "$L/shard-2"
"$PY" "$HERE/analysis.py" "$L/measure" --level "$LEVEL"
