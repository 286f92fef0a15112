#!/usr/bin/env bash
# The GPU check of issue 27, one script of at most ~5 minutes on one node (tried on CPU: with no
# GPU every step runs its CPU twin, so the script itself is checked where it is written).
#
#   bash benchmarks/gpu_check.sh OUT          # OUT: a folder for the figures (default gpu-check)
#
# 1. the device: torch, CUDA, the GPUs;
# 2. FSDP2 on every GPU of the node (nccl, tests/estimators/fsdp_worlds.py): a BERT and a Llama-GQA
#    with PEFT LoRA, float64 / float32 / bfloat16, sharded values against one unsharded device;
# 3. the benchmark regimes (benchmarks/regimes.py) in float32 and bfloat16: absolute times per
#    ascent step and the peak memory above a plain step (max_memory_allocated);
# 4. the sharded memory benchmark on CPU (gloo) for the figures of docs/cluster.md.
# Tried on this 2-core CPU (2026-12-04): device, fsdp (world 1, 2 on gloo, 25 s) and fsdp_memory
# (18 s) ran; regimes reached its 180 s limit (MiniLM 32 × 64 in float32 and bfloat16 on one CPU
# thread), as expected off a GPU.
# Each step has its own time limit and writes its output to OUT; a failing step does not stop the
# next one. The exit status is the number of failed steps.
set -u
OUT=${1:-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
failed=0
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    if timeout "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"; then
        echo "$name: ok ($((SECONDS - t0)) s)"
    else
        echo "$name: FAILED rc=$? ($((SECONDS - t0)) s); see $OUT/$name.err"
        failed=$((failed + 1))
    fi
}

step device 60 python -c "
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(i, p.name, round(p.total_memory / 2**30, 1), 'GiB')
"
cat "$OUT/device.out"
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    DEVICE=cuda
    N=$(python -c "import torch; print(torch.cuda.device_count())")
    WORLDS=$(python -c "print(','.join(str(w) for w in (1, 2, 4, 8) if w <= $N))")
else
    DEVICE=cpu
    WORLDS=1,2
fi
echo "device $DEVICE, world sizes $WORLDS"

step fsdp 150 python tests/estimators/fsdp_worlds.py "$WORLDS" "$DEVICE"
step regimes 180 python benchmarks/regimes.py --device "$DEVICE" --dtype float32,bfloat16 \
    --configs minilm-32x64 --repeats 2 --steps 1,3 --eps 1e-6 --json "$OUT/regimes.json"
step fsdp_memory 90 python benchmarks/fsdp_memory.py --worlds 1,2 --json "$OUT/fsdp_memory.json"
exit "$failed"
