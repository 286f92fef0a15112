#!/usr/bin/env bash
# The GPU check of issue 27, one script of at most ~5 minutes on one node (tried on CPU: with no
# GPU every step runs its CPU twin, so the script itself is checked where it is written).
#
#   bash benchmarks/gpu_check.sh OUT          # OUT: a folder for the figures (default gpu-check)
#   GPU_CHECK_WHEELS=0 PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh OUT   # the CPU twin
#
# 0. the packages: a GPU machine has its own torch (a CUDA build); wheels of the lock's other
#    versions, where a folder .whl holds them (transformers, peft, accelerate, huggingface_hub,
#    tokenizers and what they need, downloaded for that machine's Python), go in first, so that
#    the check runs against requirements.lock and not whatever that machine has;
# 1. the device: torch, CUDA, the GPUs;
# 2. the CUDA paths of the suite: tests/test_cuda.py (sharpness, curvature and the CLI on the GPU
#    against the CPU; bfloat16 against float32; a model dispatched over the GPU and the CPU) and
#    tests/estimators/test_device_placement.py;
# 3. FSDP2 on every GPU of the node (nccl, tests/estimators/fsdp_worlds.py): a BERT and a Llama-GQA
#    with PEFT LoRA, float64 / float32 / bfloat16, sharded values against one unsharded device,
#    summed up by benchmarks/gpu_fsdp_summary.py;
# 4. `geosharp measure --fsdp` under torchrun on the GPUs against one process
#    (benchmarks/gpu_cli_check.py);
# 5. the benchmark regimes (benchmarks/regimes.py) in float32 and bfloat16 on a BERT-large shape
#    (335 M) and a TinyLlama shape (Llama-GQA, 1.1 B): absolute times per ascent step and the
#    peak memory above a plain step (max_memory_allocated).
# Each step has its own time limit and writes its output to OUT; a failing step does not stop the
# next one. The exit status is the number of failed steps. GPU_CHECK_ONLY="tests fsdp" runs only
# the steps named (device always runs); REGIMES="--configs ... --dtype ..." replaces the
# regimes step's configurations, dtypes and measures.
set -u
OUT=${1:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}  # PYTHON=.venv/bin/python for the CPU twin (with GPU_CHECK_WHEELS=0)
if [ "${GPU_CHECK_WHEELS:-1}" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
failed=0
ONLY=${GPU_CHECK_ONLY:-device tests fsdp cli regimes}
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    case " device $ONLY " in *" $name "*) ;; *) return 0 ;; esac
    local t0=$SECONDS
    if timeout "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"; then
        echo "$name: ok ($((SECONDS - t0)) s)"
    else
        echo "$name: FAILED rc=$? ($((SECONDS - t0)) s); see $OUT/$name.err"
        failed=$((failed + 1))
    fi
}

step device 60 "$PY" -c "
import torch, transformers, peft, accelerate
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
print('transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(i, p.name, round(p.total_memory / 2**30, 1), 'GiB')
"
cat "$OUT/device.out"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    DEVICE=cuda
    N=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    WORLDS=$("$PY" -c "print(','.join(str(w) for w in (1, 2, 4, 8) if w <= $N))")
    CONFIGS=bert-335m,llama-1b
else  # the CPU twin: gloo, and the small configurations
    export GEOSHARP_TEST_GPU=cpu
    DEVICE=cpu
    N=2
    WORLDS=1,2
    CONFIGS=tiny
fi
echo "device $DEVICE, world sizes $WORLDS"

step tests 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    tests/estimators/test_device_placement.py
[ -f "$OUT/tests.out" ] && tail -n 3 "$OUT/tests.out"
step fsdp 120 "$PY" tests/estimators/fsdp_worlds.py "$WORLDS" "$DEVICE"
if [ -f "$OUT/fsdp.out" ]; then
    "$PY" benchmarks/gpu_fsdp_summary.py "$OUT/fsdp.out" >"$OUT/fsdp_summary.out" 2>&1 ||
        failed=$((failed + 1))
    cat "$OUT/fsdp_summary.out"
fi
step cli 90 "$PY" benchmarks/gpu_cli_check.py /tmp/gpu-cli "$N"
[ -f "$OUT/cli.out" ] && tail -n 7 "$OUT/cli.out"
# shellcheck disable=SC2086  # REGIMES: several arguments
step regimes "${REGIMES_LIMIT:-150}" "$PY" benchmarks/regimes.py --device "$DEVICE" --repeats 2 --steps 2,6 \
    --eps 1e-6 ${REGIMES:---configs $CONFIGS --dtype float32,bfloat16} --json "$OUT/regimes.json"
exit "$failed"
