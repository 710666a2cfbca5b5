#!/usr/bin/env bash
# The exact sequence that produces benchmarks/results/powered_table/isa_drift/ (run from the repository root): the
# final runs of GPA-AdamW and AdamW on seeds 0-2 of the earlier powered-table record (commit 285281b, made on a CPU
# it did not record), re-run here under torch's default instruction set and under ATEN_CPU_CAPABILITY=avx2, each in
# a process of its own, one thread, and GPA's seed 0 once more under the default to show that it repeats bitwise.
# 6 x 2 + 1 = 13 runs of about 20 s of CPU.
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python=${PYTHON:-python}
record=$(mktemp --suffix=.json)
git show 285281b:benchmarks/results/powered_table/results.json > "$record"
nice -n 10 "$python" -m benchmarks.isa_drift --record "$record" --method gpa adamw --seeds 0 1 2 \
    --isa default avx2 --repeat --out benchmarks/results/powered_table/isa_drift
