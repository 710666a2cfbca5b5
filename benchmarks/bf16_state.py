"""Pure bf16 training: GPAAdamW's default state (float32 z, m, v and y) against ``state_dtype="param"`` (bf16 z, m, v).

Why this file exists: ``state_dtype="param"`` cuts GPA-AdamW's state for bf16 parameters from 16 to 6 bytes per
weight. Its cost is measured here as the final validation loss of the paper bench's tiny Llama (the workload of
``benchmarks/paper_table.py`` at a shorter budget), trained in pure bf16, beside the same model in fp32 and torch's
AdamW in pure bf16. The loop, data and evaluation are ``lowbit_quality.train_run``'s.

    nice -n 10 python benchmarks/bf16_state.py --steps 600
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lowbit_quality as lq  # noqa: E402
import paper_table as pt  # noqa: E402

logger = logging.getLogger("bf16_state")

#: (row, parameter dtype, optimizer factory); GPA at the paper bench's best setting, AdamW at the same lr.
ROWS = {
    "GPA-AdamW, fp32 parameters": (torch.float32, {}),
    "GPA-AdamW, bf16, state float32 (default)": (torch.bfloat16, {}),
    "GPA-AdamW, bf16, state_dtype=param": (torch.bfloat16, {"state_dtype": "param"}),
    "AdamW, bf16 (m, v in bf16)": (torch.bfloat16, None),
}


def factory(extra: dict | None, workload: pt.Workload):
    from hf_gpa import GPAAdamW, mu_x_from_inner_steps

    common = dict(lr=lq.LR, betas=pt.BETAS["gpa"], eps=1e-8, weight_decay=workload.weight_decay)
    if extra is None:
        return lambda params: torch.optim.AdamW(params, **common)
    mu_x = mu_x_from_inner_steps(lq.INNER_STEPS)
    return lambda params: GPAAdamW(params, mu_x=mu_x, mu_y=lq.MU_Y, **common, **extra)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lowbit"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    workload = dataclasses.replace(pt.Workload(), steps=args.steps)
    data = pt.load_token_windows(workload)
    results = {}
    for row, (dtype, extra) in ROWS.items():
        run = lq.train_run(row, args.seed, workload, data, factory(extra, workload), dtype)
        results[row] = run["final_val"]
        logger.info("%-44s final val %.4f (%.0f s)", row, run["final_val"], run["wall_s"])
    lines = [
        f"Pure bf16, the paper bench's Llama, {args.steps} steps, seed {args.seed}, lr {lq.LR}, GPA H = "
        f"{lq.INNER_STEPS}, mu_y {lq.MU_Y}: final validation loss (GPA at x).",
        "",
        "| run | final val loss |",
        "|---|---|",
        *[f"| {row} | {loss:.4f} |" for row, loss in results.items()],
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bf16_state.md").write_text("\n".join(lines) + "\n")
    (args.out / "bf16_state.json").write_text(json.dumps({"steps": args.steps, "seed": args.seed, **results}))
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
