#!/usr/bin/env bash
# The GPU checks in one go, on one GPU: the GPU tests (pytest -m gpu), the optimizer step-time
# benchmark on Llama-1B shapes in fp32 and bf16 and on 219 tiny tensors (host work), the end-to-end throughput
# benchmark (110M Llama, bf16 autocast) and the optimizer memory table with CUDA peak memory (benchmarks.memory_table).
#
# It fills the table "What is not yet measured on a GPU" in docs/gpu.md: each row there names the step below that
# measures it; put the figures of OUT_DIR/summary.md into the pages the rows link to and drop those rows.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR [STEP ...]
#
# With STEP names (environment, step_time_fp32, step_time_bf16, step_time_host_bound, throughput, memory_table,
# training_step, gpu_tests) only those steps run. The whole suite took about 14 minutes on an H200 (2026-11-28), more
# than one 10-minute device call: run it as two calls, for example the step_time and throughput steps, then
# memory_table, training_step and gpu_tests.
#
# OUT_DIR receives one log per step (<step>.log), the tests' junit XML, the benchmarks' tables (.md), raw numbers
# (.json) and plots, and summary.md (every step's status and every table). A failing or hanging step (each has a
# time limit) is recorded and the suite goes on; the exit status is non-zero if any step failed.
#
# Environment: PYTHON (default python3) must have torch with CUDA, triton, transformers, accelerate, tokenizers,
# safetensors and scikit-learn. run_clm_gpa.py (the accelerate-launch tests) also imports `datasets` and `evaluate`;
# where they are missing, put their wheels in a folder and name it in HF_GPA_WHEELS (default: .whl in the repository
# root): they are installed into a scratch folder on PYTHONPATH, nothing else changes. The wheels to carry, fetched
# on a machine with pip access (Python 3.12 shown; add --platform tags for compiled wheels such as pyarrow):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19
# (datasets also needs pyarrow>=24 and huggingface_hub>=1.31; carry those too where the machine's are older.)
# bitsandbytes, for the GPU tests of GPA around its 8-bit AdamWs (skipped where it does not import), goes the same
# way: add `bitsandbytes` to the pip download line (a manylinux wheel with its CUDA kernels).
set -euo pipefail

OUT=${1:?usage: bash benchmarks/gpu_suite.sh OUT_DIR [STEP ...]}
shift
ONLY=" $* "
STEPS=" environment step_time_fp32 step_time_bf16 step_time_host_bound throughput memory_table training_step gpu_tests "
for name in "$@"; do
    [[ "$STEPS" == *" $name "* ]] || { echo "gpu_suite.sh: unknown STEP '$name'; the steps are:$STEPS" >&2; exit 2; }
done
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

WHEELS=${HF_GPA_WHEELS:-.whl}
# The scratch folder comes after the machine's own site-packages on the path: a package the machine has wins.
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl
    export PYTHONPATH="$PYTHONPATH:$site"
fi

failed=()
# step NAME SECONDS COMMAND...: run with a time limit, output in OUT/NAME.log; a failure is recorded, not fatal.
step() {
    local name=$1 limit=$2 rc=0
    shift 2
    if [ "$ONLY" != "  " ] && [[ "$ONLY" != *" $name "* ]]; then
        return 0
    fi
    echo "== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    if [ "$rc" -eq 0 ]; then
        echo "   ok in $((SECONDS - t0)) s"
    else
        echo "   FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', time limit'), $((SECONDS - t0)) s); end of $name.log:"
        tail -n 15 "$OUT/$name.log" | sed 's/^/   | /'
        failed+=("$name (exit $rc)")
    fi
}

step environment 30 bash -c "set -e; nvidia-smi || true; \"$PY\" -c 'import sys, torch, transformers, accelerate; \
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name()); \
print(\"transformers\", transformers.__version__, \"accelerate\", accelerate.__version__)'; \
\"$PY\" -c 'import triton; print(\"triton\", triton.__version__)'; \
\"$PY\" -c 'import datasets, evaluate; print(\"datasets\", datasets.__version__, \"evaluate\", evaluate.__version__)' \
    || echo 'datasets/evaluate missing: the accelerate-launch tests will skip (see HF_GPA_WHEELS above)'; \
\"$PY\" -c 'import bitsandbytes; print(\"bitsandbytes\", bitsandbytes.__version__)' 2>/dev/null \
    || echo 'bitsandbytes missing: its 8-bit AdamW tests will skip (see HF_GPA_WHEELS above)'"

step step_time_fp32 80 "$PY" -m benchmarks.step_time --device cuda --dtype float32 --rounds 20 --out-dir "$OUT"
step step_time_bf16 150 "$PY" -m benchmarks.step_time --device cuda --dtype bfloat16 --rounds 20 --out-dir "$OUT"
# Host time and aten ops of a step over 219 tiny tensors (the Triton path's host work).
step step_time_host_bound 60 "$PY" -m benchmarks.step_time --device cuda --size host_bound --rounds 30 \
    --out-dir "$OUT"
step throughput 150 "$PY" -m benchmarks.throughput --device cuda --out-dir "$OUT"
# Optimizer state and CUDA peak memory (torch.cuda.max_memory_allocated) of a step and of a save, Llama-1B shapes;
# the torchao rows need torchao (hf_gpa[lowbit]) and are left out where it does not import.
step memory_table 300 "$PY" -m benchmarks.memory_table --device cuda --size llama1b --no-meta --timeout 60 \
    --out "$OUT/memory_cuda"
# The peak of a whole training step of the 58M Llama with GPA-AdamW's step inside backward, and its step time against
# the ordinary GPA-AdamW step.
step training_step 180 "$PY" -m benchmarks.memory_table --training-step --device cuda --timeout 60 \
    --out "$OUT/memory_cuda"

# The tests come last: a suite cut off at the lease's time limit still brings back every figure above.
# Every test file that carries the gpu marker (not the whole suite: other files may need packages this machine lacks).
mapfile -t gpu_tests < <(grep -l "pytest.mark.gpu" tests/test_*.py)
step gpu_tests 240 "$PY" -m pytest -m gpu -p no:cacheprovider -q -ra --junitxml "$OUT/gpu_tests.xml" \
    "${gpu_tests[@]}"

{
    echo "# hf_gpa GPU suite, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    grep -h -E "^(NVIDIA|torch|triton|transformers|datasets|bitsandbytes)" "$OUT/environment.log" 2>/dev/null || true
    echo
    echo "Failed steps: ${failed[*]:-none}"
    tail -n 3 "$OUT/gpu_tests.log" 2>/dev/null | sed 's/^/    /' || true
    echo
    echo "These figures fill docs/gpu.md's table \"What is not yet measured on a GPU\" (its rows name the steps)."
    for table in "$OUT"/step_time_*.md "$OUT"/throughput_cuda.md "$OUT"/memory_cuda/table.md \
        "$OUT"/memory_cuda/training_step.md; do
        [ -f "$table" ] || continue
        echo
        echo "## $(basename "$table" .md)"
        echo
        cat "$table"
    done
} >"$OUT/summary.md"
cat "$OUT/summary.md"
[ ${#failed[@]} -eq 0 ]
