"""Pure bf16 training: GPAAdamW's state modes for bf16 parameters (``state_dtype``) against each other.

Why this file exists: ``state_dtype="param"`` (bf16 z, m, v: 6 bytes per weight) and ``"compact"`` (24-bit y and z,
bf16 m and v: 8 bytes) cut GPA-AdamW's state for bf16 parameters from the float32 state's 16 bytes (float32 z, m, v
and y). Their cost is measured here as the final validation loss of the paper bench's tiny Llama (the workload and
training loop of ``benchmarks.paper_recipe`` at a shorter budget), trained in pure bf16, beside the same model in
fp32 and torch's AdamW in pure bf16, over one or more seeds (the seed noise is what a difference is held against).
GPA-AdamW runs at the paper bench's best setting (``benchmarks.lowbit_quality``'s), AdamW at the same lr; both are
their ``--optim`` values built through the one table, GPA-AdamW's state mode set by ``state_dtype``.

    nice -n 10 python -m benchmarks.bf16_state --steps 600
    nice -n 10 python -m benchmarks.bf16_state --steps 600 --seeds 0 1 2 --rows float32 compact
    python -m benchmarks.bf16_state --quick --steps 4 --out OUT   # a smoke run on a tiny Llama
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch

from benchmarks import lowbit_quality as lq
from benchmarks import paper_recipe as pr
from benchmarks import workloads

logger = logging.getLogger("bf16_state")

#: row -> (parameter dtype, method of the paper bench, GPAAdamW's state_dtype or None for the default).
ROWS = {
    "GPA-AdamW, fp32 parameters": (torch.float32, "gpa", None),
    "GPA-AdamW, bf16, state_dtype=float32": (torch.bfloat16, "gpa", "float32"),
    "GPA-AdamW, bf16, state_dtype=param": (torch.bfloat16, "gpa", "param"),
    "GPA-AdamW, bf16, state_dtype=compact (default)": (torch.bfloat16, "gpa", "compact"),
    "AdamW, bf16 (m, v in bf16)": (torch.bfloat16, "adamw", None),
}


def factory(method: str, state_dtype: str | None, workload: pr.Workload):
    """``make_optimizer(model)`` of a row: the method at lowbit_quality's setting (GPA-AdamW: H, lr, mu_y)."""
    spec = pr.RunSpec(
        method, lq.LR, 0, workload.steps, "full", *((lq.INNER_STEPS, lq.MU_Y) if method == "gpa" else ())
    )
    flags = pr.optimizer_flags(spec, workload)
    extra = {} if state_dtype is None else {"state_dtype": state_dtype}
    return lambda model: workloads.optimizer_from_flags(
        flags, list(model.parameters()), weight_decay=workload.weight_decay, **extra
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lowbit"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rows", nargs="+", default=None, help="run only the rows whose names contain one of these")
    parser.add_argument("--quick", action="store_true", help="the paper bench's quick workload (a tiny Llama)")
    args = parser.parse_args(argv)
    rows = {row: v for row, v in ROWS.items() if not args.rows or any(r in row for r in args.rows)}
    if not rows:
        parser.error(f"--rows {args.rows} matches none of: {', '.join(ROWS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    workload = dataclasses.replace(pr.QUICK_WORKLOAD if args.quick else pr.Workload(), steps=args.steps)
    data = pr.load_token_windows(workload)
    results: dict[str, list[float]] = {}
    for seed in args.seeds:  # seed-major: a partial run still compares the rows on the same seeds
        for row, (dtype, method, state_dtype) in rows.items():
            run = lq.train_run(row, seed, workload, data, factory(method, state_dtype, workload), dtype)
            results.setdefault(row, []).append(run["final_val"])
            logger.info("%-44s seed %d final val %.4f (%.0f s)", row, seed, run["final_val"], run["wall_s"])
    seeds = " ".join(map(str, args.seeds))
    lines = [
        f"Pure bf16, the paper bench's Llama, {args.steps} steps, seeds {seeds}, lr {lq.LR}, GPA H = "
        f"{lq.INNER_STEPS}, mu_y {lq.MU_Y}: final validation loss (GPA at x), per seed and mean.",
        "",
        "| run | final val loss per seed | mean |",
        "|---|---|---:|",
        *[
            f"| {row} | {' / '.join(f'{v:.4f}' for v in losses)} | {sum(losses) / len(losses):.4f} |"
            for row, losses in results.items()
        ],
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = (
        "bf16_state"
        if args.rows is None and args.seeds == [0]
        else f"bf16_state_seeds_{'_'.join(map(str, args.seeds))}"
    )
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps({"steps": args.steps, "seeds": args.seeds, **results}))
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
