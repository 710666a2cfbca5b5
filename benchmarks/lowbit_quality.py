"""GPA around 8-bit and 4-bit AdamW against GPA around fp32 AdamW, on the paper bench's workload.

Why this file exists: ``GPA(base=torchao.optim.AdamW8bit)`` keeps z in float32 and m, v in 8 bits (about 1.5x the
parameter bytes against GPA-AdamW's 3.0x and AdamW's 2.0x). Whether the quantized moments cost validation loss is
measured here on the workload of ``benchmarks.paper_recipe`` (its tiny Llama, data, batches, lr schedule,
evaluation, training loop), at the paper bench's best full-budget GPA setting (``best_configurations``: H = 8, lr
0.02, mu_y 0.5), over three seeds. Each optimizer is ``--optim gpa --gpa_base_optim NAME`` built through the one
``--optim`` table; only the base changes between the rows:

* ``fp32``: ``adamw_torch`` (torch's AdamW), the reference;
* ``8bit`` / ``4bit``: ``adamw_torch_8bit`` / ``adamw_torch_4bit``, torchao's AdamW8bit / AdamW4bit as it ships them.
  torchao quantizes only tensors of at least 4096 elements (as bitsandbytes does), which on this 37K-parameter model
  is the embedding alone (44% of the parameters);
* ``8bit-all`` / ``4bit-all``: the same optimizers with every tensor whose size is a multiple of the block size
  quantized (all matrices; only the norm weights stay float32), the regime of a large model;
* ``torchao-fp32``: torchao's AdamW8bit with no tensor quantized (its step, float32 m and v): a control that
  separates torchao's step from torch's AdamW's and from the quantization.

    nice -n 10 python -m benchmarks.lowbit_quality                        # 15 runs, one process, one thread
    python -m benchmarks.lowbit_quality --report-only
    python -m benchmarks.lowbit_quality --quick                           # a 12-step smoke run

Results (resumable JSON, one record per finished run) and ``table.md`` go to ``benchmarks/results/lowbit/``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks import paper_recipe as pr
from benchmarks import workloads

logger = logging.getLogger("lowbit_quality")

VARIANTS = ("fp32", "8bit", "4bit", "8bit-all", "4bit-all", "torchao-fp32")
#: The base of each variant: its --gpa_base_optim, and how its quantization is changed ("all", "none" or as shipped).
BASES = {
    "fp32": ("adamw_torch", None),
    "8bit": ("adamw_torch_8bit", None),
    "4bit": ("adamw_torch_4bit", None),
    "8bit-all": ("adamw_torch_8bit", "all"),
    "4bit-all": ("adamw_torch_4bit", "all"),
    "torchao-fp32": ("adamw_torch_8bit", "none"),
}
#: The paper bench's best full-budget GPA configuration (benchmarks/results/paper_table/table.md).
INNER_STEPS, LR, MU_Y = 8, 0.02, 0.5
SEEDS = (0, 1, 2)


def _quantize_all(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` quantizing every tensor whose size is a multiple of its block size (torchao's floor is 4096)."""

    class QuantizeAll(cls):  # type: ignore[misc, valid-type]
        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            if p.numel() % self.block_size == 0:
                return self._subclass_zeros(p, signed, self.block_size)
            return torch.zeros_like(p)

    QuantizeAll.__name__ = f"{cls.__name__}All"
    return QuantizeAll


def _quantize_none(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` with float32 m and v for every tensor: its own step without quantization."""

    class QuantizeNone(cls):  # type: ignore[misc, valid-type]
        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            return torch.zeros_like(p)

    QuantizeNone.__name__ = f"{cls.__name__}None"
    return QuantizeNone


def gpa_flags(base: str, workload: pr.Workload) -> dict[str, Any]:
    """The paper bench's GPA-AdamW at its best setting (`paper_recipe.optimizer_flags`), as ``--optim gpa`` around
    ``base``."""
    best_gpa = pr.RunSpec("gpa", LR, 0, workload.steps, "full", INNER_STEPS, MU_Y)
    return {**pr.optimizer_flags(best_gpa, workload), "optim": "gpa", "gpa_base_optim": base}


def build_optimizer(variant: str, model: torch.nn.Module, workload: pr.Workload) -> torch.optim.Optimizer:
    """GPA around the base of ``variant``, built through the ``--optim`` table; the "-all" and control variants
    replace the table's torchao class by one that quantizes every tensor, or none."""
    base, quantize = BASES[variant]
    overrides = {}
    if quantize is not None:
        table_base = workloads.optimizer_cls_and_kwargs(gpa_flags(base, workload))[1]["base"]
        overrides["base"] = (_quantize_all if quantize == "all" else _quantize_none)(table_base)
    params = [p for p in model.parameters() if p.requires_grad]
    return workloads.optimizer_from_flags(
        gpa_flags(base, workload), params, weight_decay=workload.weight_decay, **overrides
    )


def quantized_fraction(optimizer: torch.optim.Optimizer) -> float:
    """The share of parameters whose base state (m) is a quantized tensor subclass."""
    total = quantized = 0
    for p, state in optimizer.state.items():
        total += p.numel()
        m = state.get("base", {}).get("exp_avg")
        if m is not None and type(m) is not torch.Tensor:
            quantized += p.numel()
    return quantized / max(total, 1)


def train_run(
    variant: str,
    seed: int,
    workload: pr.Workload,
    data: tuple[torch.Tensor, torch.Tensor],
    make_optimizer: Any = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """One run of the paper bench's loop (`paper_recipe.train`: same batches, schedule, clipping, evaluation) with
    GPA around the base of ``variant``, or the optimizer ``make_optimizer(model)`` builds; the model in ``dtype``."""
    make = make_optimizer or (lambda model: build_optimizer(variant, model, workload))
    record = pr.train(workload, data, seed, workload.steps, make, LR, "cosine", dtype)
    record["quantized_fraction"] = quantized_fraction(record.pop("optimizer"))
    return {"key": f"{variant}/s{seed}/T{workload.steps}", "variant": variant, "seed": seed, **record}


def markdown_table(data: dict[str, Any]) -> str:
    workload = data["workload"]
    lines = [
        f"Workload: the paper bench's Llama (d={workload['hidden_size']}, L={workload['num_layers']}), "
        f"{workload['steps']} steps; GPA H = {INNER_STEPS} (mu_x from H), lr {LR}, mu_y {MU_Y}, betas "
        f"{pr.BETAS['gpa']}, weight decay {workload['weight_decay']}; final validation loss at x, mean ± std over "
        "seeds; the difference to fp32 is paired by seed (same batches, same initialisation).",
        "",
        "| Base of GPA | seeds | quantized share of parameters | final val loss | minus fp32 (paired) | s/run |",
        "|---|---|---|---|---|---|",
    ]
    by_variant: dict[str, dict[int, dict[str, Any]]] = {}
    for run in data["runs"]:
        by_variant.setdefault(run["variant"], {})[run["seed"]] = run
    reference = by_variant.get("fp32", {})
    for variant in VARIANTS:
        runs = by_variant.get(variant)
        if not runs:
            continue
        finals = [run["final_val"] for run in runs.values()]
        deltas = [run["final_val"] - reference[s]["final_val"] for s, run in runs.items() if s in reference]
        share = statistics.fmean(run["quantized_fraction"] for run in runs.values())
        lines.append(
            f"| {_label(variant)} | {len(finals)} | {share:.0%}"
            f" | {_mean_std(finals)} | {_mean_std(deltas, signed=True) if variant != 'fp32' else '—'}"
            f" | {statistics.median(r['wall_s'] for r in runs.values()):.0f} |"
        )
    return "\n".join(lines) + "\n"


def _label(variant: str) -> str:
    return {
        "fp32": "torch.optim.AdamW (fp32 m, v)",
        "8bit": "torchao AdamW8bit",
        "4bit": "torchao AdamW4bit",
        "8bit-all": "AdamW8bit, every matrix quantized",
        "4bit-all": "AdamW4bit, every matrix quantized",
        "torchao-fp32": "AdamW8bit's step, nothing quantized (control)",
    }[variant]


def _mean_std(values: list[float], signed: bool = False) -> str:
    fmt = "{:+.4f}" if signed else "{:.4f}"
    if len(values) < 2:
        return fmt.format(values[0]) + " (1 seed)" if values else "—"
    return f"{fmt.format(statistics.fmean(values))} ± {statistics.stdev(values):.4f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lowbit"))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--quick", action="store_true", help="the paper bench's quick workload (12 steps)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    workload = pr.QUICK_WORKLOAD if args.quick else pr.Workload()
    results = pr.results_file(args.out / ("quick.json" if args.quick else "results.json"), workload, pr.Plan())
    if not args.report_only:
        torch.set_num_threads(1)
        data = pr.load_token_windows(workload)
        for seed in args.seeds:  # seed-major: a partial record already compares every variant
            for variant in args.variants:
                key = f"{variant}/s{seed}/T{workload.steps}"
                if key in results.done():
                    continue
                run = train_run(variant, seed, workload, data)
                results.add(run)
                logger.info("%-24s final val %.4f  (%.0f s)", key, run["final_val"], run["wall_s"])
    table = markdown_table(results.data)
    (args.out / ("quick.md" if args.quick else "table.md")).write_text(table)
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
