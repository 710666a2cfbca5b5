#!/usr/bin/env bash
# The runs of runs.jsonl (docs/benchmarks.md, "Why our Schedule-Free ends behind schedulefree's"): final-seed runs of
# the powered setting (benchmarks.powered_table.WORKLOAD) outside its plan, evaluated on its validation windows, one
# JSON line per run, paired by seed with the final runs of the earlier ../results.json (git show
# 285281b:benchmarks/results/powered_table/results.json, which was evaluated on the same windows). Run from the
# repository root; 17 runs, about 7 CPU-minutes on one thread.
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
out=benchmarks/results/powered_table/sf_gap/runs.jsonl
: > "$out"
# method lr beta1 beta2 weight_decay seeds [mu_y]: schedulefree's beta is its beta1, ours takes it as mu_y (beta1 0)
run() {
    nice -n 19 python - "$@" >> "$out" <<'PY'
import dataclasses, json, sys, time
import torch
from benchmarks.paper_recipe import RunSpec, load_token_windows, train_run
from benchmarks.powered_table import WORKLOAD

torch.set_num_threads(1)
method, lr, b1, b2, wd = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
mu_y = float(sys.argv[7]) if len(sys.argv) > 7 else None
workload = dataclasses.replace(WORKLOAD, weight_decay=wd)
data = load_token_windows(workload)
for seed in map(int, sys.argv[6].split(",")):
    spec = RunSpec(method, lr, seed, workload.steps, "final", mu_y=mu_y, betas=(b1, b2))
    start = time.process_time()
    r = train_run(spec, workload, data)
    print(json.dumps({"key": r["key"], "wd": wd, "final_val": r["final_val"], "final_val_y": r.get("final_val_y"),
                      "final_val_z": r.get("final_val_z"), "cpu_s": time.process_time() - start}), flush=True)
PY
}
# schedulefree at its pick, seed 0 again: reproduces ../results.json bitwise
run sf_ref 0.04 0.9 0.92 0.1 0
# ours at schedulefree's pick (lr 0.04, beta 0.9, beta2 0.92), weight decay 0.1, the 10 final seeds
run sf 0.04 0 0.92 0.1 0,1,2,3,4,5,6,7,8,9 0.9
# both at that pick without weight decay, seeds 0-2
run sf 0.04 0 0.92 0.0 0,1,2 0.9
run sf_ref 0.04 0.9 0.92 0.0 0,1,2
