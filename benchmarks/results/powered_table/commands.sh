#!/usr/bin/env bash
# The exact sequence that produces benchmarks/results/powered_table/results.json (run from the repository root).
# One process per --out, one thread, niced; every run is appended as it ends, so any step can be killed and rerun
# (recorded runs are skipped). Started in the background with:
#   setsid nohup bash benchmarks/results/powered_table/commands.sh >> benchmarks/results/powered_table/run.log 2>&1 &
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
out=benchmarks/results/powered_table
# 1. tuning (5 methods x 11 configurations x tuning seeds 1000, 1001); an axis whose best is on an edge of its grid
#    is slid one point past it (same size) and the search run again, up to 5 times per method (--slide 5; the
#    report lists each slide and the configurations evaluated); then, if every best is inside its grid, the final
#    runs (seeds 0-9, every method at its selected setting) and the report. Finished runs are reused.
nice -n 19 python -m benchmarks.powered_table --out "$out" --slide 5
# 2. the report alone, from the JSON
python -m benchmarks.powered_table --out "$out" --stage report
