#!/usr/bin/env bash
# The exact command that produces benchmarks/results/diloco_regime/diloco_workers.{json,md,png}, run from the
# repository root of a detached checkout of the commit that runs it, so that nothing edited later changes the running
# code (every run records that commit, its CPU, torch's instruction set, Python, torch and threads):
#   git worktree add --detach ../bench-regime <commit>
#   cd ../bench-regime
#   PYTHONPATH=$PWD OMP_NUM_THREADS=1 setsid nohup nice -n 19 python \
#       -m benchmarks.diloco_workers --regime --parts bytes quality --tune-seeds 0 --final-seeds 1 2 3 4 5 \
#       --out benchmarks/results/diloco_regime > regime.log 2>&1 &
# Every run is appended to the JSON as it ends (the .md and .png rewritten from it), so the command can be killed
# and started again: recorded runs are skipped. The same, as a script:
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
out=benchmarks/results/diloco_regime
# 1. the bytes of every method with today's meter (minutes), then the quality part (`REGIME_PLAN`, about 90 runs of
#    4 processes x 4,096 steps, 3.5 to 9 minutes each): tuning at seed 0, 7 configurations for each of DDP-AdamW,
#    DiLoCo H = 8, GPA across workers H = 8 (each pick then at seeds 1-5), then the same at H = 32, then the untuned
#    variants at H = 32 (outer bfloat16, int8, streaming P = 4 blocking and overlapped) and DiLoCo's picks at outer
#    lr 0.6 / 0.75, at seeds 1-5
nice -n 19 python -m benchmarks.diloco_workers --regime --parts bytes quality --tune-seeds 0 --final-seeds 1 2 3 4 5 \
    --out "$out"
# 2. the report alone, from the JSON (any time, also while 1 runs)
python -m benchmarks.diloco_workers --regime --report-only --out "$out"
