"""Reproduce the paper's comparison (Table 1, Figure 1) at small scale: AdamW, DiLoCo, Schedule-Free and GPA.

Why this file exists: the paper's headline is that GPA-AdamW reaches AdamW's final validation loss in fewer steps
(8.71% on Llama-160M) and beats single-worker DiLoCo at every effective number of inner steps H. This script lets
anyone rerun that comparison on a CPU: a tiny Llama (``transformers.LlamaForCausalLM`` from a config) trained on the
embedded Python-stdlib corpus with the locally trained byte-level BPE, every method on identical batches in
identical order, a fixed validation set every ``eval_every`` steps. The recipe (methods, their ``--optim`` flags,
workload, one run) is ``benchmarks.paper_recipe``; the report (tables, plots) ``benchmarks.paper_report``; this
module runs the plan and is the command line.

Pipeline (each stage appends finished runs to one JSON file, so an interrupted run resumes and partial results
survive; tables and plots are regenerated from that JSON alone with ``--report-only``):

1. learning-rate sweep at a short budget (``sweep_fraction`` of the steps, seed 0), one configuration per family;
   DiLoCo's and GPA's H is scaled with the budget so the averaging window keeps its share of the run; GPA also
   sweeps ``mu_y``;
2. the best setting of each family at the full budget, ``seeds`` seeds, for every H.

Outputs: ``table.md`` (final validation loss per method and H, mean ± std, and the speedup over AdamW),
``val_loss.png`` (best run per method) and ``speedup.png`` (speedup per H, like the paper's Figure 1).

At GPU scale (``--gpu-scale``): an 8-layer, 512-wide Llama (29M parameters, vocabulary 8192) on sequences of 512 x
batch 32 (16K tokens a step) for 1,500 steps, bf16 autocast, trained on the Python sources of the machine's
``site-packages`` split by file (``--corpus``: ``stdlib``, ``site-packages`` or any directory of ``.py`` files), an
lr sweep of AdamW and GPA-AdamW around the recipe of the earlier H100 runs, then 3 seeds of each family's best. At
the end of every run of an averaging method the loss is also taken at z and at y, so that x's lag behind them at the
end of a decayed schedule shows. A longer budget runs each best setting with ``--extras-only`` into
``OUT/steps<N>/`` and is reported side by side with the first.

    python -m benchmarks.paper_table --quick                 # the whole pipeline in well under a minute
    nice -n 5 python -m benchmarks.paper_table --out benchmarks/results/paper_table --workers 2
    python -m benchmarks.paper_table --out benchmarks/results/paper_table --report-only
    python -m benchmarks.paper_table --gpu-scale --device cuda --out OUT   # one GPU; docs/gpu.md
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch

from benchmarks.devices import device_arg
from benchmarks.paper_recipe import (
    GPA_FAMILIES,
    GPU_PLAN,
    GPU_WORKLOAD,
    METHODS,
    QUICK_PLAN,
    QUICK_WORKLOAD,
    WITH_H,
    Plan,
    RunSpec,
    Workload,
    import_schedulefree,
    load_token_windows,
    record_parameters,
    results_file,
    train_run,
)
from benchmarks.paper_report import write_report
from benchmarks.report import ResultsFile

logger = logging.getLogger("paper_table")

_WORKER_DATA: dict[Workload, tuple[torch.Tensor, torch.Tensor]] = {}


def _worker_run(spec: RunSpec, workload: Workload) -> dict[str, Any]:
    torch.set_num_threads(1)
    if workload not in _WORKER_DATA:
        _WORKER_DATA[workload] = load_token_windows(workload)
    return train_run(spec, workload, _WORKER_DATA[workload])


# ----------------------------------------------------------------------------------------------------------------
# The plan: sweep, selection, full budget
# ----------------------------------------------------------------------------------------------------------------


def sweep_specs(workload: Workload, plan: Plan) -> list[RunSpec]:
    """The short-budget learning-rate sweep: one configuration per family, H scaled with the budget."""
    steps = max(1, round(plan.sweep_fraction * workload.steps))
    inner = max(1, round(plan.sweep_inner_steps * plan.sweep_fraction))
    specs = []
    for method in METHODS:
        for lr in plan.lrs.get(method, ()):  # the Muon families are tuned at the full budget only (--extra)
            if method in GPA_FAMILIES:
                specs += [RunSpec(method, lr, plan.sweep_seed, steps, "sweep", inner, mu_y) for mu_y in plan.mu_ys]
            elif method in WITH_H:
                specs.append(RunSpec(method, lr, plan.sweep_seed, steps, "sweep", inner))
            else:
                specs.append(RunSpec(method, lr, plan.sweep_seed, steps, "sweep"))
    return specs


def best_settings(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per family, the sweep run with the lowest final validation loss (its spec)."""
    best: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run["spec"]["phase"] != "sweep":
            continue
        method = run["spec"]["method"]
        if method not in best or run["final_val"] < best[method]["final_val"]:
            best[method] = run
    return {method: run["spec"] for method, run in best.items()}


def full_specs(
    workload: Workload, plan: Plan, best: dict[str, dict[str, Any]], runs: Sequence[dict[str, Any]] = ()
) -> list[RunSpec]:
    """The full-budget runs: the best lr (and GPA's best mu_y) of each family.

    Every H runs at the seeds of ``plan.all_h_seeds``; the other seeds run only the H whose final validation loss
    was lowest there (all of them once ``runs`` holds the first stage), so the headline rows have every seed.
    """
    specs = []
    best_h = best_inner_steps(runs, plan)
    for seed in plan.seeds:
        for method in METHODS:
            if method not in best:
                continue
            lr = best[method]["lr"]
            if method in WITH_H:
                mu_y = best[method]["mu_y"]
                if seed in plan.all_h_seeds:
                    hs: Sequence[int] = plan.inner_steps
                elif method in best_h:
                    hs = [best_h[method]]
                else:
                    continue
                specs += [RunSpec(method, lr, seed, workload.steps, "full", h, mu_y) for h in hs]
            else:
                specs.append(RunSpec(method, lr, seed, workload.steps, "full"))
    return specs


def best_inner_steps(runs: Sequence[dict[str, Any]], plan: Plan) -> dict[str, int]:
    """Per family with an H, the H of lowest mean final validation loss over the ``all_h_seeds`` full runs."""
    finals: dict[tuple[str, int], list[float]] = {}
    for run in runs:
        spec = run["spec"]
        if spec["phase"] == "full" and spec["inner_steps"] is not None and spec["seed"] in plan.all_h_seeds:
            finals.setdefault((spec["method"], spec["inner_steps"]), []).append(run["final_val"])
    best: dict[str, int] = {}
    for (method, h), values in sorted(finals.items()):
        if len(values) < len(plan.all_h_seeds):
            continue
        mean = statistics.fmean(values)
        if method not in best or mean < statistics.fmean(finals[(method, best[method])]):
            best[method] = h
    return best


def run_specs(specs: Sequence[RunSpec], workload: Workload, results: ResultsFile, workers: int) -> None:
    """Run the specs not yet in ``results`` (in ``workers`` processes, one thread each), recording each as it ends."""
    todo = [spec for spec in specs if spec.key not in results.done()]
    logger.info("%d runs to do (%d already recorded)", len(todo), len(specs) - len(todo))
    if workers <= 1:
        torch.set_num_threads(1)
        data = load_token_windows(workload)
        for spec in todo:
            _record(results, train_run(spec, workload, data))
        return
    import multiprocessing

    load_token_windows(workload)  # tokenize once here, so the workers only read the cache
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = [pool.submit(_worker_run, spec, workload) for spec in todo]
        for future in as_completed(futures):
            _record(results, future.result())


def _record(results: ResultsFile, run: dict[str, Any]) -> None:
    results.add(run)
    logger.info("%-48s final val %.4f  (%.0f s)", run["key"], run["final_val"], run["wall_s"])


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def parse_extra(text: str, workload: Workload) -> RunSpec:
    """An extra full-budget run from ``"method,lr=0.02,H=8,mu_y=0.7,seed=0"`` (H and mu_y where they apply)."""
    method, *pairs = text.split(",")
    if method not in METHODS:
        raise ValueError(f"Invalid method in --extra {text!r}: expected one of {METHODS}")
    values = dict(pair.split("=", 1) for pair in pairs)
    unknown = set(values) - {"lr", "H", "mu_y", "seed"}
    if unknown or "lr" not in values:
        raise ValueError(f"Invalid --extra {text!r}: needs lr=..., takes H, mu_y, seed")
    return RunSpec(
        method,
        float(values["lr"]),
        int(values.get("seed", 0)),
        workload.steps,
        "extra",
        int(values["H"]) if "H" in values else None,
        float(values["mu_y"]) if "mu_y" in values else None,
    )


def run_pipeline(
    out: Path,
    workload: Workload,
    plan: Plan,
    workers: int = 1,
    extras: Sequence[RunSpec] = (),
    pipeline: bool = True,
    report: bool = True,
) -> str:
    """Sweep, select, run the full budget (then any extra runs), write the report; resumes from the JSON.

    ``pipeline=False`` runs only ``extras`` (a budget whose learning rates are chosen by hand, e.g. around the
    best of a shorter budget); ``report=False`` leaves the report to a later ``--report-only`` (and returns "").
    """
    results = results_file(out / "results.json", workload, plan)
    total, non_embedding = record_parameters(results, workload)
    tokens = workload.steps * workload.batch_size * workload.seq_len
    logger.info("Model: %d parameters (%d non-embedding); %d tokens per full run", total, non_embedding, tokens)
    if not pipeline:
        run_specs(extras, workload, results, workers)
        return write_report(out / "results.json", out) if report else ""
    run_specs(sweep_specs(workload, plan), workload, results, workers)
    best = best_settings(results.runs)
    results.data["selected"] = best
    results.write()
    logger.info("Selected: %s", {m: (s["lr"], s["mu_y"]) for m, s in best.items()})
    first = [spec for spec in full_specs(workload, plan, best) if spec.seed in plan.all_h_seeds]
    run_specs(first, workload, results, workers)
    results.data["selected_inner_steps"] = best_inner_steps(results.runs, plan)
    results.write()
    logger.info("Selected H: %s", results.data["selected_inner_steps"])
    run_specs(full_specs(workload, plan, best, results.runs), workload, results, workers)
    if extras:
        run_specs(extras, workload, results, workers)
    return write_report(out / "results.json", out)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and run the pipeline (or only the report)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/paper_table"))
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps: the whole pipeline in seconds")
    parser.add_argument(
        "--gpu-scale", action="store_true", help="8 layers x 512 on site-packages, 16K tokens/step, bf16 (one GPU)"
    )
    parser.add_argument(
        "--device", type=device_arg, default=None, help="cpu or cuda[:N] (default: cuda with --gpu-scale, else cpu)"
    )
    parser.add_argument("--bf16", action="store_true", default=None, help="bf16 autocast (default with --gpu-scale)")
    parser.add_argument(
        "--corpus", default=None, help="stdlib, site-packages or a directory of .py files (default: the preset's)"
    )
    parser.add_argument("--report-only", action="store_true", help="regenerate table and plots from the JSON")
    parser.add_argument("--workers", type=int, default=1, help="parallel processes, one thread each")
    parser.add_argument("--steps", type=int, default=None, help="override the full budget")
    parser.add_argument(
        "--weight-decay", type=float, default=None, help=f"override the weight decay (default {Workload.weight_decay})"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="override the full-budget seeds")
    parser.add_argument("--inner-steps", type=int, nargs="+", default=None, help="override the H grid")
    parser.add_argument(
        "--all-h-seeds", type=int, nargs="+", default=None, help="seeds that run every H (default: seed 0 only)"
    )
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        help="an extra full-budget run after the pipeline, e.g. gpa,lr=0.02,H=8,mu_y=0.7,seed=0 (repeatable)",
    )
    parser.add_argument(
        "--extras-only", action="store_true", help="skip the sweep-then-select pipeline; run only the --extra runs"
    )
    parser.add_argument("--no-report", action="store_true", help="with --extras-only: record the runs, no report")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.report_only:
        print(write_report(args.out / "results.json", args.out))
        return
    import_schedulefree()  # before any run, not when the pipeline reaches sf_ref
    if args.quick and args.gpu_scale:
        raise SystemExit("--quick and --gpu-scale are two presets: give one")
    workload, plan = (QUICK_WORKLOAD, QUICK_PLAN) if args.quick else (Workload(), Plan())
    if args.gpu_scale:
        workload, plan = GPU_WORKLOAD, GPU_PLAN
    if args.device is not None:
        if args.device != "cpu":
            torch.cuda.set_device(args.device)  # "cuda" in the record is the current device
        workload = dataclasses.replace(workload, device=args.device.split(":")[0])
    if workload.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--gpu-scale trains on CUDA, which this torch does not see; add --device cpu to run it here")
    if workload.device != "cpu" and args.workers != 1:
        raise SystemExit(f"--workers {args.workers}: on CUDA the runs go one after another (--workers 1)")
    if args.bf16:
        workload = dataclasses.replace(workload, bf16=True)
    if args.corpus is not None:
        from hf_gpa.data import corpus_root

        try:
            corpus_root(args.corpus)
        except ValueError as error:
            raise SystemExit(f"--corpus: {error}") from None
        workload = dataclasses.replace(workload, corpus=args.corpus)
    if args.steps is not None:
        if args.steps < 1:
            raise SystemExit(f"--steps must be >= 1, got {args.steps}")
        workload = dataclasses.replace(workload, steps=args.steps)
    if args.weight_decay is not None:
        if not 0.0 <= args.weight_decay < 1.0:
            raise SystemExit(f"--weight-decay must lie in [0, 1), got {args.weight_decay}")
        workload = dataclasses.replace(workload, weight_decay=args.weight_decay)
    if args.seeds is not None:
        plan = dataclasses.replace(plan, seeds=tuple(args.seeds))
    if args.inner_steps is not None:
        plan = dataclasses.replace(plan, inner_steps=tuple(args.inner_steps))
    if args.all_h_seeds is not None:
        plan = dataclasses.replace(plan, all_h_seeds=tuple(args.all_h_seeds))
    extras = [parse_extra(text, workload) for text in args.extra]
    print(
        run_pipeline(
            args.out, workload, plan, args.workers, extras, pipeline=not args.extras_only, report=not args.no_report
        )
    )


if __name__ == "__main__":
    main()
