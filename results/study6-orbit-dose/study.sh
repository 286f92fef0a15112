#!/usr/bin/env bash
# Study 6, shard K of N, resumable across sessions (PREREGISTRATION.md).
#
#   bash results/study6-orbit-dose/study.sh K N [LIMIT_S]
#
# For every level (its recipe, LEVELS below), trains shard K/N of the level's models with the
# ordinary training script (train.py: each finished model is in OUT/<recipe>/manifest.csv or
# excluded.csv, so a killed run resumes), then measures them as a user would:
# `geosharp study OUT/<recipe>/manifest.csv --data OUT/<recipe>/sharpness.npz ...` into
# OUT/<recipe>/measure, every model trained so far, of any shard (every finished row is in its
# study.sqlite and is reused: rerunning resumes; `geosharp study --shard` would take positions
# of the manifest, which grows as shards finish, so it is not used). Run the shards one after
# another, not at the same time. One thread throughout.
# LIMIT_S: stop training new models after this many seconds (default: no limit); measuring
# always runs to the end of the models trained.
# SMOKE=1: one-epoch models of the pilot stream (3 per level) into /tmp/study6-smoke, to try
# the pipeline; never part of the study.
set -euo pipefail
K=${1:-1}
N=${2:-1}
LIMIT=${3:-inf}
HERE=results/study6-orbit-dose
PY=${PY:-.venv/bin/python}
GS=(${GS:-.venv/bin/geosharp})
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
# The levels and n per level, as PREREGISTRATION.md fixes them (low, middle, high spread).
LEVELS=(${LEVELS:-adamw sgd-wd0 sgd-init})
NPER=${NPER:-64}
OUT=${OUT:-runs/study6}
SMOKE_ARGS=()
if [ "${SMOKE:-0}" = 1 ]; then
    OUT=/tmp/study6-smoke; NPER=3; SMOKE_ARGS=(--smoke)
fi
T0=$SECONDS
say() { echo "[$(date -u +%T) +$((SECONDS - T0)) s] $*"; }
left() { if [ "$LIMIT" = inf ]; then echo inf; else echo $((LIMIT - (SECONDS - T0))); fi; }

for r in "${LEVELS[@]}"; do
    L=$(left)
    if [ "$L" != inf ] && [ "$L" -le 0 ]; then say "time limit: no more training"; break; fi
    say "training $r, shard $K/$N of $NPER models"
    "$PY" "$HERE/train.py" --recipe "$r" --models "$NPER" --out "$OUT/$r" --shard "$K/$N" \
        --threads 1 --limit-s "$L" "${SMOKE_ARGS[@]}"
done
for r in "${LEVELS[@]}"; do
    if [ ! -f "$OUT/$r/manifest.csv" ]; then say "$r: no model trained yet"; continue; fi
    say "measuring $r, shard $K/$N"
    "${GS[@]}" study "$OUT/$r/manifest.csv" --data "$OUT/$r/sharpness.npz" --gap error \
        --measures adaptive-l2 geodesic-inv-o2 \
        --rho adaptive=0.1,0.316,1 geodesic=0.0316,0.1,0.316 \
        --batch-size 128 --samples 512 --steps 20 --expect negative \
        --threads 1 --no-progress --out "$OUT/$r/measure"
done
say "done"
