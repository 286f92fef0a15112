#!/usr/bin/env bash
# The first device call of the session (PREREGISTRATION.md, addendum 1): it brings the high bytes
# of MiniLM-L6 (.gpu-a, kept there for the second call), tries Study 5's GPU script in smoke mode
# (3 smoke models from the high bytes alone, the pilot, geosharp study on CUDA) and runs issue
# 27's GPU check (FSDP2 on the one GPU with nccl, the benchmark regimes in float32 and bfloat16).
#
#   bash results/study5-minilm-finetunes/gpu/check.sh      # on the device; figures into $OUT
# There it runs from .gpu-a/snap (`git archive HEAD`) with SITE=<repo>/.gpu-a/site.
set -u
OUT=${OUT:-/tmp/check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$SECONDS
echo "== study 5 smoke on the GPU"
WORK=/tmp/s5smoke OUT=/tmp/s5smoke/out timeout 80 bash results/study5-minilm-finetunes/gpu/study.sh 75 1 \
    >"$OUT/smoke.log" 2>&1
echo "smoke rc $? after $((SECONDS - T0)) s"
grep -h "measured\|plan:\|device\|cuda\|SMOKE\|Error\|error" /tmp/s5smoke/logs/*.log | cut -c1-240 | head -30
cp /tmp/s5smoke/out/study5.tar.gz "$OUT/smoke.tar.gz" 2>/dev/null
echo "== issue 27 GPU check"
export PYTHONPATH="${SITE:-$PWD/.gpu-a/site}:$PWD/src"
T1=$SECONDS
timeout 45 python3 tests/estimators/fsdp_worlds.py 1 cuda >"$OUT/fsdp.out" 2>"$OUT/fsdp.err"
echo "fsdp world 1 on cuda (nccl): rc $? in $((SECONDS - T1)) s"
tail -15 "$OUT/fsdp.out"; tail -3 "$OUT/fsdp.err"
T1=$SECONDS
timeout 50 python3 benchmarks/regimes.py --device cuda --dtype float32,bfloat16 \
    --configs minilm-32x64 --repeats 2 --steps 1,3 --eps 1e-6 --json "$OUT/regimes.json" \
    >"$OUT/regimes.out" 2>"$OUT/regimes.err"
echo "regimes on cuda: rc $? in $((SECONDS - T1)) s"
tail -25 "$OUT/regimes.out"; tail -3 "$OUT/regimes.err"
echo "total $((SECONDS - T0)) s"
