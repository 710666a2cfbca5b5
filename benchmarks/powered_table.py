"""The paper's single-worker comparison with enough seeds to decide it: AdamW, GPA-AdamW, single-worker DiLoCo-AdamW,
``schedulefree.AdamWScheduleFree`` and hf_gpa's Schedule-Free, each tuned with the same number of configurations on
two seeds, then run on at least 10 other seeds, reported as paired differences with 95% intervals.

Why this file exists: the 3-seed table of ``benchmarks.paper_table`` cannot tell its differences from seed noise
(about one seed's standard deviation), gave GPA more configurations than the others, and averaged steps saved over
the seeds that reached the target only. This pipeline fixes the protocol:

1. **Equal tuning.** Every method has a grid of axes (lr for all; GPA's mu_y and H; DiLoCo's H, outer lr and outer
   momentum; Schedule-Free's beta; Adam's betas), searched one axis at a time from the middle of the grid (each axis
   in its order, the others at their best so far): ``1 + sum(len(axis) - 1)`` configurations, which the plan makes
   equal across methods. A configuration's score is its mean final validation loss over the two tuning seeds, which
   the final runs never use. A full product of the axes (GPA: 5 x 4 x 4 = 80 configurations, x 2 seeds x 5 methods)
   does not fit a few core-hours at ~1 minute a run; the one-axis-at-a-time search does (11 each), at the cost of not
   seeing interactions beyond one pass.
2. **Bracketing.** A best value on the first or last point of its axis is reported with the ``--grid`` value that
   slides the axis past it (same size, so the budgets stay equal; finished runs are reused); the final runs wait for
   a grid whose every best is inside unless ``--allow-edges``.
3. **Powered final runs.** Every method at its chosen setting on ``--seeds`` (>= 10): each seed gives every method the
   same initial weights and the same batches in the same order. DiLoCo is evaluated at outer-step boundaries only
   (its H divides the evaluation interval and the budget, else the plan is refused).
4. **Report** (``benchmarks.powered_report``): final loss of GPA minus each other method, paired per seed, with its
   95% Student-t interval; steps to reach AdamW's final loss of the same seed, the seeds that never reach it counted
   as censored at the budget; which differences the data decides.

Every run is appended to one JSON file as it ends; a rerun skips the finished ones, so the pipeline can be stopped
(kill it) and resumed at any time, one process per ``--out``.

    python -m benchmarks.powered_table --quick --out /tmp/powered          # the whole pipeline in seconds
    OMP_NUM_THREADS=1 nice -n 19 python -m benchmarks.powered_table --out benchmarks/results/powered_table
    python -m benchmarks.powered_table --out benchmarks/results/powered_table --stage report
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.paper_recipe import (
    BETAS,
    DILOCO_OUTER_LR,
    DILOCO_OUTER_MOMENTUM,
    QUICK_WORKLOAD,
    RunSpec,
    Workload,
    count_parameters,
    import_schedulefree,
    load_token_windows,
    results_file,
    train_run,
)
from benchmarks.report import ResultsFile

logger = logging.getLogger("powered_table")

#: The five methods of the comparison, GPA first (the report takes GPA minus each of the others).
METHODS = ("gpa", "adamw", "diloco", "sf_ref", "sf")
#: The axes each method may be tuned on. beta1 / beta2 are Adam's (schedulefree's beta1 is its interpolation beta);
#: hf_gpa's Schedule-Free has no gradient momentum and takes its beta as mu_y.
AXES = {
    "adamw": ("lr", "beta1", "beta2"),
    "gpa": ("lr", "mu_y", "H", "beta1", "beta2"),
    "diloco": ("lr", "H", "outer_lr", "outer_momentum", "beta1", "beta2"),
    "sf_ref": ("lr", "beta1", "beta2"),
    "sf": ("lr", "mu_y", "beta2"),
}
#: Axes whose points are spaced by a factor (the grid slides by that factor); the others lie in (0, 1) and slide in
#: 1 - value by a factor.
_GEOMETRIC = ("lr", "H")
MIN_FINAL_SEEDS = 10
MIN_TUNING_SEEDS = 2

Grid = dict[str, dict[str, tuple[float, ...]]]


def _lrs(low: float, points: int) -> tuple[float, ...]:
    """``points`` learning rates from ``low`` in steps of sqrt(2) (rounded to 3 significant digits: start every grid
    from a power of 2 times one number, so that the grids share their points)."""
    return tuple(float(f"{low * 2 ** (i / 2):.3g}") for i in range(points))


#: 11 configurations per method (1 + the sum over axes of their size - 1). GPA: the paper's mu_y grid and four H,
#: its lr a factor sqrt 2 above AdamW's middle (the paper bench's GPA preferred about twice AdamW's lr);
#: DiLoCo: the paper's best outer step (0.75 / 0.75) in the middle of outer lr {0.5, 0.75, 1} x momentum
#: {0.5, 0.75, 0.9} (0.9: the scaling-law study's Nesterov momentum); both Schedule-Free: beta {0.8, 0.9, 0.95}.
DEFAULT_GRID: Grid = {
    "gpa": {"lr": _lrs(0.01, 6)[1:], "mu_y": (0.7, 0.8, 0.9, 0.95), "H": (8, 16, 32, 64)},
    "adamw": {"lr": _lrs(0.005, 7), "beta1": (0.8, 0.9, 0.95), "beta2": (0.95, 0.98, 0.99)},
    "diloco": {
        "lr": _lrs(0.005, 5),
        "H": (8, 16, 32),
        "outer_lr": (0.5, 0.75, 1.0),
        "outer_momentum": (0.5, 0.75, 0.9),
    },
    "sf_ref": {"lr": _lrs(0.005, 7), "beta1": (0.8, 0.9, 0.95), "beta2": (0.95, 0.98, 0.99)},
    "sf": {"lr": _lrs(0.005, 7), "mu_y": (0.8, 0.9, 0.95), "beta2": (0.95, 0.98, 0.99)},
}
#: 1,024 steps of paper_recipe's tiny Llama (1.05M tokens), evaluated every 32 steps (a multiple of every DiLoCo H).
WORKLOAD = Workload(steps=1024, eval_every=32)
QUICK_GRID: Grid = {
    "gpa": {"lr": (0.005, 0.01, 0.02), "H": (1, 2, 4)},
    "adamw": {"lr": (0.0025, 0.005, 0.01), "beta2": (0.9, 0.95, 0.99)},
    "diloco": {"lr": (0.005, 0.01, 0.02), "H": (1, 2, 4)},
    "sf_ref": {"lr": (0.005, 0.01, 0.02), "beta1": (0.8, 0.9, 0.95)},
    "sf": {"lr": (0.005, 0.01, 0.02), "mu_y": (0.8, 0.9, 0.95)},
}
QUICK = dataclasses.replace(QUICK_WORKLOAD, steps=8, eval_every=4)


@dataclass(frozen=True)
class PoweredPlan:
    """What to run: each method's grid (ordered axes), the tuning seeds and the final seeds."""

    grid: Grid = field(default_factory=lambda: {m: dict(axes) for m, axes in DEFAULT_GRID.items()})
    tuning_seeds: tuple[int, ...] = (1000, 1001)
    seeds: tuple[int, ...] = tuple(range(10))


def grid_size(axes: Mapping[str, Sequence[float]]) -> int:
    """Configurations the one-axis-at-a-time search runs: the middle point, then each axis's other points."""
    return 1 + sum(len(values) - 1 for values in axes.values())


def check_plan(plan: PoweredPlan, workload: Workload) -> None:
    """Refuse, before any run, a plan that cannot produce the table; the error names the flag."""
    if len(plan.tuning_seeds) < MIN_TUNING_SEEDS or len(set(plan.tuning_seeds)) != len(plan.tuning_seeds):
        raise ValueError(f"--tuning-seeds: give at least {MIN_TUNING_SEEDS} distinct seeds, got {plan.tuning_seeds}")
    if len(plan.seeds) < MIN_FINAL_SEEDS or len(set(plan.seeds)) != len(plan.seeds):
        raise ValueError(f"--seeds: give at least {MIN_FINAL_SEEDS} distinct seeds, got {plan.seeds}")
    if shared := sorted(set(plan.tuning_seeds) & set(plan.seeds)):
        raise ValueError(f"--tuning-seeds and --seeds share {shared}: a seed that chose a setting cannot judge it")
    if missing := [m for m in METHODS if m not in plan.grid]:
        raise ValueError(f"--grid: no grid for {missing}")
    for method, axes in plan.grid.items():
        if method not in METHODS:
            raise ValueError(f"--grid: unknown method {method!r}; expected one of {METHODS}")
        for axis, values in axes.items():
            name = f"--grid {method}.{axis}"
            if axis not in AXES[method]:
                raise ValueError(f"{name}: {method} is tuned on {AXES[method]}, not on {axis!r}")
            if len(values) < 3 or len(set(values)) != len(values):
                raise ValueError(f"{name}: give at least 3 distinct values so the best can be inside, got {values}")
            if list(values) != sorted(values):
                raise ValueError(f"{name}: give the values in increasing order, got {values}")
            if axis == "H" and any(h < 1 or h != int(h) for h in values):
                raise ValueError(f"{name}: H is a whole number of steps >= 1, got {values}")
            if axis in ("lr", "outer_lr") and any(v <= 0 for v in values):
                raise ValueError(f"{name}: values are > 0, got {values}")
            if axis in ("beta1", "beta2", "mu_y", "outer_momentum") and not all(0.0 <= v < 1.0 for v in values):
                raise ValueError(f"{name}: values lie in [0, 1), got {values}")
        if "lr" not in axes:
            raise ValueError(f"--grid {method}.lr: every method's learning rate is tuned; give its grid")
    sizes = {method: grid_size(axes) for method, axes in plan.grid.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(
            f"--grid: unequal tuning budgets {sizes} (configurations = 1 + sum of (axis size - 1)); give every method "
            "the same number"
        )
    for h in plan.grid["diloco"].get("H", ()):
        if workload.eval_every % h or workload.steps % h:
            raise ValueError(
                f"--grid diloco.H={h:g}: DiLoCo is evaluated at outer-step boundaries only, so H must divide "
                f"--eval-every ({workload.eval_every}) and --steps ({workload.steps})"
            )


# ---- one configuration as a run ----


def run_spec(method: str, config: Mapping[str, float], seed: int, steps: int, phase: str) -> RunSpec:
    """The run of ``method`` at ``config`` (axis -> value; an axis not given keeps the recipe's default)."""
    beta1, beta2 = BETAS[method]
    betas = (config.get("beta1", beta1), config.get("beta2", beta2))
    outer = None
    if method == "diloco":
        outer = (config.get("outer_lr", DILOCO_OUTER_LR), config.get("outer_momentum", DILOCO_OUTER_MOMENTUM))
    inner = None
    if method in ("gpa", "diloco"):
        inner = int(config.get("H", 32 if method == "gpa" else 16))
    mu_y = config.get("mu_y", 0.7 if method == "gpa" else 0.9) if method in ("gpa", "sf") else None
    return RunSpec(method, config["lr"], seed, steps, phase, inner, mu_y, betas, outer)


# ---- tuning: one axis at a time ----


def slide(values: Sequence[float], axis: str, side: str) -> tuple[float, ...]:
    """``values`` slid one point past the edge ``side`` ("low" or "high"), the far end dropped (same size)."""
    if axis in _GEOMETRIC:
        ratio = values[-1] / values[-2] if side == "high" else values[0] / values[1]
        nxt = (values[-1] if side == "high" else values[0]) * ratio
        nxt = float(f"{nxt:.3g}") if axis == "lr" else float(max(1, round(nxt)))
    elif side == "high":
        nxt = 1.0 - (1.0 - values[-1]) / 2.0 if values[-1] < 1.0 else values[-1] + (values[-1] - values[-2])
    else:
        nxt = max(0.0, values[0] - (values[1] - values[0]))
    return (*values[1:], nxt) if side == "high" else (nxt, *values[:-1])


def tune(
    method: str,
    axes: Mapping[str, Sequence[float]],
    score: Callable[[dict[str, float]], float],
) -> dict[str, Any]:
    """The one-axis-at-a-time search of ``method`` on ``axes``: start at every axis's middle point, then for each
    axis in order try all its values with the other axes at their best so far and keep the best (lowest score).

    Returns the stages (axis, values, scores, best), the selected configuration and the edges: each axis whose best
    is its first or last point, with the ``--grid`` value that slides the axis past it.
    """
    current = {axis: values[len(values) // 2] for axis, values in axes.items()}
    stages, edges = [], []
    for axis, values in axes.items():
        scores = [score({**current, axis: value}) for value in values]
        best = min(range(len(values)), key=lambda i: (scores[i], i))
        current[axis] = values[best]
        stages.append({"axis": axis, "values": list(values), "scores": scores, "best": values[best]})
        if best in (0, len(values) - 1):
            side = "low" if best == 0 else "high"
            slid = slide(values, axis, side)
            extend = (
                f"--grid {method}.{axis}=" + ",".join(f"{v:g}" for v in slid)
                if len(set(slid)) == len(slid)
                else f"none: {values[best]:g} is the bound of {axis}"
            )
            edges.append({"axis": axis, "value": values[best], "side": side, "extend": extend})
    return {"stages": stages, "selected": current, "edges": edges, "configurations": grid_size(axes)}


def tune_sliding(
    method: str,
    grid: dict[str, dict[str, Sequence[float]]],
    score: Callable[[dict[str, float]], float],
    slides: int,
) -> dict[str, Any]:
    """`tune`, and while a best lies on an edge that can move (not a bound such as mu_y's 0), for at most ``slides``
    rounds: slide every such axis one point past its edge (`slide`: same size, so every method keeps its
    number of configurations) in ``grid`` (updated in place) and search again. The result also lists the slides made
    and counts every configuration evaluated on the way (``evaluated``), the cost the equal grid sizes do not show.
    """
    made: list[str] = []
    seen: set[tuple[tuple[str, float], ...]] = set()

    def counted(config: dict[str, float]) -> float:
        seen.add(tuple(sorted(config.items())))
        return score(config)

    for round_ in range(slides + 1):
        result = tune(method, grid[method], counted)
        movable = [edge for edge in result["edges"] if edge["extend"].startswith("--grid")]
        if not movable or round_ == slides:
            break
        for edge in movable:
            grid[method][edge["axis"]] = slide(grid[method][edge["axis"]], edge["axis"], edge["side"])
            made.append(edge["extend"].removeprefix("--grid "))
    return {**result, "slides": made, "evaluated": len(seen)}


# ---- the pipeline ----


class Runner:
    """Runs the specs not yet in the record (one thread, one after another), each recorded as it ends."""

    def __init__(self, results: ResultsFile, workload: Workload, max_runs: int | None = None) -> None:
        self.results, self.workload, self.max_runs, self.ran = results, workload, max_runs, 0
        self._data: tuple[torch.Tensor, torch.Tensor] | None = None
        self._by_key = {run["key"]: run for run in results.runs}

    def run(self, spec: RunSpec) -> dict[str, Any]:
        if spec.key in self._by_key:
            return self._by_key[spec.key]
        if self.max_runs is not None and self.ran >= self.max_runs:
            raise _Stop
        if self._data is None:
            self._data = load_token_windows(self.workload)
        cpu = time.process_time()
        run = train_run(spec, self.workload, self._data)
        run["cpu_s"] = time.process_time() - cpu  # the core time, which a shared machine's wall time overstates
        self.results.add(run)
        self._by_key[run["key"]] = run
        self.ran += 1
        logger.info(
            "%-60s final val %.4f (%.0f s, %.0f s CPU)", run["key"], run["final_val"], run["wall_s"], run["cpu_s"]
        )
        return run


class _Stop(Exception):
    """``--max-runs`` new runs are done: the pipeline stops here and resumes on the next call."""


def tuning_score(runner: Runner, method: str, plan: PoweredPlan) -> Callable[[dict[str, float]], float]:
    """A configuration's score: its mean final validation loss over the tuning seeds (inf if any diverged)."""

    def score(config: dict[str, float]) -> float:
        finals = [
            runner.run(run_spec(method, config, seed, runner.workload.steps, "tune")).get("final_val", math.inf)
            for seed in plan.tuning_seeds
        ]
        return statistics.fmean(finals) if all(math.isfinite(v) for v in finals) else math.inf

    return score


def run_pipeline(
    out: Path,
    workload: Workload,
    plan: PoweredPlan,
    stage: str = "all",
    allow_edges: bool = False,
    max_runs: int | None = None,
    slides: int = 0,
) -> str:
    """Tune every method, then (every best inside its grid, or ``allow_edges``) run the final seeds; write the report.

    ``stage``: "tune" stops after tuning, "all" goes on to the final runs; both resume from the JSON (a recorded run
    is never rerun). ``slides``: how many times a method's axis whose best is on an edge is slid past it and the
    search run again (`tune_sliding`); the record's plan holds the grids as slid. Returns the report's text.
    """
    from benchmarks.powered_report import write_report

    check_plan(plan, workload)
    results = results_file(out / "results.json", workload, plan)
    total, non_embedding = count_parameters(workload.build(0))
    results.data.update(parameters=total, non_embedding_parameters=non_embedding)
    results.write()
    runner = Runner(results, workload, max_runs)
    tuning: dict[str, Any] = {}
    results.data["tuning"] = tuning  # rebuilt from the recorded runs (instantly) for this call's grid
    grid = {method: dict(axes) for method, axes in plan.grid.items()}
    try:
        for method in METHODS:
            tuning[method] = tune_sliding(method, grid, tuning_score(runner, method, plan), slides)
            results.data["plan"]["grid"] = {m: {a: list(v) for a, v in axes.items()} for m, axes in grid.items()}
            results.write()  # a method's search is in the record as soon as it ends
        edges = {m: t["edges"] for m, t in tuning.items() if t["edges"]}
        if edges:
            logger.warning("Best on a grid edge: %s", {m: [e["extend"] for e in e_] for m, e_ in edges.items()})
        if stage != "tune" and (allow_edges or not edges):
            for seed in plan.seeds:  # seed-major: a stopped run leaves whole seeds, ready to pair
                for method in METHODS:
                    runner.run(run_spec(method, tuning[method]["selected"], seed, workload.steps, "final"))
        elif stage != "tune":
            logger.warning("Final runs wait for a grid that brackets every best (or --allow-edges)")
    except _Stop:
        logger.info("--max-runs %d new runs done; rerun the same command to go on", max_runs)
    return write_report(out / "results.json", out)


# ---- CLI ----


def parse_grid(texts: Sequence[str], grid: Grid) -> Grid:
    """``grid`` with each ``method.axis=v1,v2,...`` of ``texts`` replacing (or adding) that axis."""
    grid = {method: dict(axes) for method, axes in grid.items()}
    for text in texts:
        name, _, values = text.partition("=")
        method, _, axis = name.partition(".")
        if method not in grid or not axis or not values:
            raise ValueError(f"--grid {text!r}: expected METHOD.AXIS=v1,v2,... with METHOD one of {METHODS}")
        try:
            grid[method][axis] = tuple(float(v) for v in values.split(","))
        except ValueError:
            raise ValueError(f"--grid {text!r}: the values must be numbers") from None
        if axis == "H":
            grid[method][axis] = tuple(int(v) if v == int(v) else v for v in grid[method][axis])
    return grid


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, check the plan, run the stage and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/powered_table"))
    parser.add_argument("--quick", action="store_true", help="tiny model and grids: the whole pipeline in seconds")
    parser.add_argument("--stage", choices=("all", "tune", "report"), default="all")
    parser.add_argument("--steps", type=int, default=None, help=f"the budget (default {WORKLOAD.steps})")
    parser.add_argument(
        "--eval-every", type=int, default=None, help=f"evaluation interval (default {WORKLOAD.eval_every})"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="final seeds (>= 10; default 0-9)")
    parser.add_argument("--tuning-seeds", type=int, nargs="+", default=None, help="default 1000 1001")
    parser.add_argument(
        "--grid", action="append", default=[], help="replace or add an axis: METHOD.AXIS=v1,v2,... (repeatable)"
    )
    parser.add_argument("--allow-edges", action="store_true", help="run the final seeds even if a best is on an edge")
    parser.add_argument(
        "--slide",
        type=int,
        default=0,
        help="slide an axis whose best is on an edge past it and search again, up to this many times per method",
    )
    parser.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs (resume later)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.stage == "report":
        from benchmarks.powered_report import write_report

        print(write_report(args.out / "results.json", args.out))
        return
    workload, plan = (QUICK, PoweredPlan(grid=QUICK_GRID)) if args.quick else (WORKLOAD, PoweredPlan())
    try:
        if args.steps is not None:
            if args.steps < 1:
                raise ValueError(f"--steps must be >= 1, got {args.steps}")
            workload = dataclasses.replace(workload, steps=args.steps)
        if args.eval_every is not None:
            if not 1 <= args.eval_every <= workload.steps:
                raise ValueError(f"--eval-every must lie in [1, --steps], got {args.eval_every}")
            workload = dataclasses.replace(workload, eval_every=args.eval_every)
        if args.slide < 0:
            raise ValueError(f"--slide must be >= 0, got {args.slide}")
        if args.max_runs is not None and args.max_runs < 1:
            raise ValueError(f"--max-runs must be >= 1, got {args.max_runs}")
        plan = dataclasses.replace(
            plan,
            grid=parse_grid(args.grid, plan.grid),
            seeds=tuple(args.seeds) if args.seeds is not None else plan.seeds,
            tuning_seeds=tuple(args.tuning_seeds) if args.tuning_seeds is not None else plan.tuning_seeds,
        )
        check_plan(plan, workload)
    except ValueError as error:
        raise SystemExit(f"powered_table: {error}") from None
    import_schedulefree()  # before any run, not when the pipeline reaches sf_ref
    torch.set_num_threads(1)
    print(run_pipeline(args.out, workload, plan, args.stage, args.allow_edges, args.max_runs, args.slide))


if __name__ == "__main__":
    main()
