#!/usr/bin/env bash
# The exact sequence that produced results.json (resumable: each call skips the runs already recorded).
set -euo pipefail
out=benchmarks/results/paper_table
run() { nice -n 5 python -m benchmarks.paper_table --out "$out" --workers 3 "$@"; }
# 1. sweep (500 steps, seed 0) -> full budget at every H on seed 0 -> seeds 1, 2 at each family's best H
run
# 2. learning rate re-tuned at the full budget (seed 0), then 3 seeds of each family's best
run --extra gpa,lr=0.02,H=8,mu_y=0.7,seed=0 --extra gpa,lr=0.02,H=32,mu_y=0.7,seed=0 \
    --extra gpa,lr=0.005,H=8,mu_y=0.7,seed=0 --extra gpa,lr=0.01,H=8,mu_y=0.5,seed=0 \
    --extra adamw,lr=0.01,seed=0 --extra diloco,lr=0.02,H=32,seed=0
run --extra gpa,lr=0.02,H=8,mu_y=0.7,seed=1 --extra gpa,lr=0.02,H=8,mu_y=0.7,seed=2 \
    --extra adamw,lr=0.0025,seed=0 --extra diloco,lr=0.005,H=32,seed=0 --extra sf,lr=0.01,seed=0 \
    --extra sf,lr=0.04,seed=0 --extra sf_ref,lr=0.02,seed=0 --extra gpa,lr=0.04,H=8,mu_y=0.7,seed=0 \
    --extra gpa,lr=0.02,H=16,mu_y=0.7,seed=0
run --extra adamw,lr=0.02,seed=0 --extra adamw,lr=0.01,seed=1 --extra adamw,lr=0.01,seed=2 \
    --extra sf,lr=0.04,seed=1 --extra sf,lr=0.04,seed=2 --extra sf,lr=0.08,seed=0
run --extra adamw,lr=0.04,seed=0 --extra sf_ref,lr=0.02,seed=1 --extra sf_ref,lr=0.02,seed=2 \
    --extra gpa,lr=0.02,H=8,mu_y=0.5,seed=0 --extra adamw,lr=0.02,seed=1 --extra adamw,lr=0.02,seed=2
# 3. every H on all three seeds
run --all-h-seeds 0 1 2 --extra gpa,lr=0.02,H=8,mu_y=0.5,seed=1 --extra gpa,lr=0.02,H=8,mu_y=0.5,seed=2
# (AdamW sweep points lr 2.5e-3 and 1.25e-3 at 500 steps were run afterwards with the same code and appended.)
python -m benchmarks.paper_table --out "$out" --report-only

# ---- the Muon families, and every family at 6,000 steps ----
# One worker process, niced, on a 2-core machine shared with five other engineers (load average ~5: a step took
# ~0.12 s instead of ~12 ms, so a 6,000-step run took 10-15 min). TORCH_EXTENSIONS_DIR points at a private build
# folder: the shared one was being rebuilt by the other worktrees (their kernel sources live at other paths).
# Each run is its own call, resumable like the rest (a recorded run is skipped).
export TORCH_EXTENSIONS_DIR=/tmp/muon_ext
one() { nice -n 10 python -m benchmarks.paper_table --workers 1 --extras-only --no-report "$@"; }
# 4. the Muon families at the full budget (2,000 steps), seed 0, at the centre of their lr grid: Muon and GPA-Muon
#    at AdamW's best full-budget lr (0.02; Muon's lr is adjusted to AdamW's RMS), DiLoCo-Muon at DiLoCo-AdamW's
#    (0.01, H = 16); GPA-Muon at GPA-AdamW's best H and mu_y (8, 0.5).
one --out "$out" --extra muon,lr=0.02,seed=0
one --out "$out" --extra gpa_muon,lr=0.02,H=8,mu_y=0.5,seed=0
one --out "$out" --extra diloco_muon,lr=0.01,H=16,seed=0
one --out "$out" --extra muon,lr=0.04,seed=0
one --out "$out" --extra gpa_muon,lr=0.04,H=8,mu_y=0.5,seed=0
# 5. 6,000 steps into steps6000/ (lr grid of 3 centred on each family's 2,000-step best, at its best H and mu_y, seed
#    0; the first nine runs were one call with all fifteen AdamW-family extras, stopped after nine to make room for
#    the Muon rows, with the report written after each run):
one --out "$out/steps6000" --steps 6000 --extra adamw,lr=0.02,seed=0
one --out "$out/steps6000" --steps 6000 --extra sf,lr=0.04,seed=0
one --out "$out/steps6000" --steps 6000 --extra sf_ref,lr=0.02,seed=0
one --out "$out/steps6000" --steps 6000 --extra diloco,lr=0.01,H=16,seed=0
one --out "$out/steps6000" --steps 6000 --extra gpa,lr=0.02,H=8,mu_y=0.5,seed=0
one --out "$out/steps6000" --steps 6000 --extra adamw,lr=0.01,seed=0
one --out "$out/steps6000" --steps 6000 --extra adamw,lr=0.04,seed=0
one --out "$out/steps6000" --steps 6000 --extra gpa,lr=0.01,H=8,mu_y=0.5,seed=0
one --out "$out/steps6000" --steps 6000 --extra gpa,lr=0.04,H=8,mu_y=0.5,seed=0
one --out "$out/steps6000" --steps 6000 --extra muon,lr=0.02,seed=0
one --out "$out/steps6000" --steps 6000 --extra gpa_muon,lr=0.02,H=8,mu_y=0.5,seed=0
one --out "$out/steps6000" --steps 6000 --extra muon,lr=0.02,seed=1
one --out "$out/steps6000" --steps 6000 --extra gpa_muon,lr=0.02,H=8,mu_y=0.5,seed=1
# Queued but not run (out of time): 2000 steps muon lr 0.01, gpa_muon lr 0.01 (and 0.08, since 0.04 is the grid's
# edge), diloco_muon lr 0.005 and 0.02; 6000 steps diloco_muon lr 0.01 H 16; every family's seeds 1-2 at 6000 steps.
# 5b. afterwards, on a quieter machine (one worker, nice 10): seeds 1-2 of Muon and GPA-Muon's 2,000-step best, the
#     DiLoCo-Muon lr grid at 2,000 steps, and at 6,000 steps GPA-Muon and Muon at lr 0.04, DiLoCo-Muon at lr 0.01 and
#     the third seed of the Muon pair at lr 0.02.
one --out "$out" --extra muon,lr=0.02,seed=1 --extra muon,lr=0.02,seed=2 \
    --extra gpa_muon,lr=0.04,H=8,mu_y=0.5,seed=1 --extra gpa_muon,lr=0.04,H=8,mu_y=0.5,seed=2 \
    --extra diloco_muon,lr=0.02,H=16,seed=0 --extra diloco_muon,lr=0.005,H=16,seed=0
one --out "$out/steps6000" --steps 6000 --extra gpa_muon,lr=0.04,H=8,mu_y=0.5,seed=0 --extra muon,lr=0.04,seed=0 \
    --extra diloco_muon,lr=0.01,H=16,seed=0 --extra muon,lr=0.02,seed=2 --extra gpa_muon,lr=0.02,H=8,mu_y=0.5,seed=2
# 6. the report of both budgets (table.md gains "Budgets side by side" once steps6000/results.json exists)
python -m benchmarks.paper_table --out "$out" --report-only
python -m benchmarks.paper_table --out "$out/steps6000" --report-only
# 7. a later session (two workers, nice 10): the Muon families' H grid and seeds at 2,000 steps; at 6,000 steps the lr
#    re-tuned for every family, H at that budget, seeds 1-2 of each family's best; the Schedule-Free weight-decay check.
python -m benchmarks.paper_table --workers 2 --extras-only --no-report --out "$out" \
  --extra muon,lr=0.01,seed=0 \
  --extra gpa_muon,lr=0.08,H=8,mu_y=0.5,seed=0 \
  --extra gpa_muon,lr=0.04,H=16,mu_y=0.5,seed=0 \
  --extra gpa_muon,lr=0.04,H=32,mu_y=0.5,seed=0 \
  --extra gpa_muon,lr=0.04,H=64,mu_y=0.5,seed=0 \
  --extra gpa_muon,lr=0.04,H=8,mu_y=0.7,seed=0 \
  --extra diloco_muon,lr=0.04,H=16,seed=0 \
  --extra diloco_muon,lr=0.02,H=8,seed=0 \
  --extra diloco_muon,lr=0.02,H=32,seed=0 \
  --extra diloco_muon,lr=0.02,H=64,seed=0
python -m benchmarks.paper_table --workers 2 --extras-only --no-report --out "$out"/steps6000 --steps 6000 \
  --extra sf,lr=0.02,seed=0 --extra sf,lr=0.08,seed=0 \
  --extra sf_ref,lr=0.01,seed=0 --extra sf_ref,lr=0.04,seed=0 \
  --extra diloco,lr=0.005,H=16,seed=0 --extra diloco,lr=0.02,H=16,seed=0 \
  --extra diloco_muon,lr=0.005,H=16,seed=0 --extra diloco_muon,lr=0.02,H=16,seed=0 \
  --extra muon,lr=0.01,seed=0 --extra muon,lr=0.08,seed=0 \
  --extra gpa_muon,lr=0.01,H=8,mu_y=0.5,seed=0 --extra gpa,lr=0.08,H=8,mu_y=0.5,seed=0 \
  --extra gpa,lr=0.04,H=16,mu_y=0.5,seed=0 --extra gpa,lr=0.04,H=32,mu_y=0.5,seed=0 \
  --extra gpa_muon,lr=0.02,H=16,mu_y=0.5,seed=0 --extra gpa_muon,lr=0.02,H=32,mu_y=0.5,seed=0 \
  --extra diloco,lr=0.01,H=32,seed=0 --extra diloco_muon,lr=0.01,H=32,seed=0
python -m benchmarks.paper_table --workers 2 --extras-only --no-report --out "$out" \
  --extra gpa_muon,lr=0.04,H=16,mu_y=0.5,seed=1 --extra gpa_muon,lr=0.04,H=16,mu_y=0.5,seed=2 \
  --extra diloco_muon,lr=0.02,H=32,seed=1 --extra diloco_muon,lr=0.02,H=32,seed=2
python -m benchmarks.paper_table --workers 2 --extras-only --no-report --steps 6000 --weight-decay 0 \
  --out benchmarks/results/paper_table/sf_no_decay --extra sf,lr=0.02,seed=0 --extra sf_ref,lr=0.02,seed=0
python -m benchmarks.paper_table --workers 2 --extras-only --no-report --steps 6000 \
  --out benchmarks/results/paper_table/steps6000 \
  --extra muon,lr=0.005,seed=0 --extra gpa_muon,lr=0.005,H=8,mu_y=0.5,seed=0 \
  --extra sf,lr=0.01,seed=0 --extra gpa_muon,lr=0.01,H=16,mu_y=0.5,seed=0
python -m benchmarks.paper_table --workers 2 --extras-only --no-report --out benchmarks/results/paper_table \
  --extra gpa_muon,lr=0.02,H=16,mu_y=0.5,seed=0 --extra gpa_muon,lr=0.08,H=16,mu_y=0.5,seed=0
python -m benchmarks.paper_table --workers 2 --extras-only --no-report --steps 6000 --out benchmarks/results/paper_table/steps6000 \
  --extra gpa_muon,lr=0.01,H=32,mu_y=0.5,seed=0 --extra gpa_muon,lr=0.01,H=64,mu_y=0.5,seed=0 \
  --extra gpa_muon,lr=0.02,H=64,mu_y=0.5,seed=0 --extra diloco_muon,lr=0.01,H=64,seed=0 \
  --extra diloco_muon,lr=0.02,H=32,seed=0 --extra diloco_muon,lr=0.005,H=32,seed=0 \
  --extra gpa,lr=0.04,H=64,mu_y=0.5,seed=0 --extra gpa,lr=0.02,H=32,mu_y=0.5,seed=0 \
  --extra adamw,lr=0.02,seed=1 --extra adamw,lr=0.02,seed=2
python -m benchmarks.paper_table --workers 2 --extras-only --no-report --steps 6000 \
  --out benchmarks/results/paper_table/steps6000 \
  --extra muon,lr=0.01,seed=1 --extra muon,lr=0.01,seed=2 \
  --extra sf,lr=0.02,seed=1 --extra sf,lr=0.02,seed=2 \
  --extra sf_ref,lr=0.02,seed=1 --extra sf_ref,lr=0.02,seed=2 \
  --extra diloco,lr=0.01,H=16,seed=1 --extra diloco,lr=0.01,H=16,seed=2
python -m benchmarks.paper_table --workers 2 --extras-only --no-report --steps 6000 \
  --out benchmarks/results/paper_table/steps6000 \
  --extra diloco_muon,lr=0.01,H=64,seed=1 --extra diloco_muon,lr=0.01,H=64,seed=2 \
  --extra gpa_muon,lr=0.02,H=32,mu_y=0.5,seed=1 --extra gpa_muon,lr=0.02,H=32,mu_y=0.5,seed=2 \
  --extra gpa,lr=0.04,H=32,mu_y=0.5,seed=1 --extra gpa,lr=0.04,H=32,mu_y=0.5,seed=2 \
  --extra diloco_muon,lr=0.01,H=128,seed=0 --extra gpa_muon,lr=0.02,H=128,mu_y=0.5,seed=0 \
  --extra diloco,lr=0.01,H=64,seed=0
python -m benchmarks.paper_table --out "$out/sf_no_decay" --report-only
python -m benchmarks.paper_table --out "$out/steps6000" --report-only
python -m benchmarks.paper_table --out "$out" --report-only
