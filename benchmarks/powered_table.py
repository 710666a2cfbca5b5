"""The paper's single-worker comparison with enough seeds to decide it: AdamW, GPA-AdamW, single-worker DiLoCo-AdamW,
``schedulefree.AdamWScheduleFree`` and hf_gpa's Schedule-Free, each tuned with the same number of configurations on
two seeds, then run on at least 10 other seeds, reported as paired differences with 95% intervals.

Why this file exists: the 3-seed table of ``benchmarks.paper_table`` cannot tell its differences from seed noise
(about one seed's standard deviation), gave GPA more configurations than the others, and averaged steps saved over
the seeds that reached the target only. This pipeline fixes the protocol:

1. **Equal tuning, in fact.** Every method has a starting grid of axes (lr for all; GPA's mu_y and H; DiLoCo's H,
   outer lr and outer momentum; Schedule-Free's beta; Adam's betas) whose one-axis-at-a-time pass is the same size
   (``1 + sum(len(axis) - 1)`` = 11), and every method's search evaluates the same number of distinct configurations,
   ``--budget`` (default 40), whatever its landscape (`tune_budget`): passes from the best so far that slide an axis
   whose best is on a movable edge past it, then, once every best is inside, refine each axis at half the spacing,
   until the budget is spent. The pick is the lowest score among all configurations evaluated. A configuration's
   score is its mean final loss on the validation windows over the two tuning seeds, which the final runs never use.
   (The earlier rule, equal grid sizes with slides on top, evaluated 20 to 45 configurations per method.)
2. **Bracketing.** A pick on the lowest or highest value its search tried of an axis that could move (only a budget
   spent while sliding leaves one) is reported, and the final runs wait for a larger ``--budget`` unless
   ``--allow-edges``.
3. **Powered final runs on held-out windows.** Every method at its pick on ``--seeds`` (>= 10): each seed gives every
   method the same initial weights and the same batches in the same order, and the runs are evaluated on
   ``held_out_windows`` windows of the validation split that the tuning never saw (`PoweredWorkload`). DiLoCo is
   evaluated at outer-step boundaries only (its H divides the evaluation interval and the steps, else the plan is
   refused).
4. **Report** (``benchmarks.powered_report``): where the runs were made (CPU, the instruction set torch used, Python,
   torch, threads, commit: a run repeats bitwise only where all agree); final loss of GPA minus each other method,
   paired per seed, with its 95% Student-t interval; the share of the steps each method's seed-mean curve saves to
   reach AdamW's seed-mean final loss, and AdamW's to reach the method's, with a bootstrap interval over the seeds
   that counts the resamples that never reach it (`benchmarks.paired_stats.steps_saved_bootstrap`); which
   differences the data decides.

Every run is appended to one JSON file as it ends; a rerun skips the finished ones, so the pipeline can be stopped
(kill it) and resumed at any time, one process per ``--out``.

    python -m benchmarks.powered_table --quick --out /tmp/powered          # the whole pipeline in seconds
    OMP_NUM_THREADS=1 nice -n 19 python -m benchmarks.powered_table --out benchmarks/results/powered_table --budget 40
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
    import_schedulefree,
    load_token_windows,
    record_parameters,
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


@dataclass(frozen=True)
class PoweredWorkload(Workload):
    """paper_recipe's workload, with the windows the final runs are evaluated on: ``held_out_windows`` windows of the
    validation split midway between the ``val_windows`` validation windows (`benchmarks.workloads.held_out_picks`),
    so that the windows that chose each method's setting do not also report its final loss."""

    held_out_windows: int = 127


#: 1,024 steps of paper_recipe's tiny Llama (1.05M tokens), evaluated every 32 steps (a multiple of every DiLoCo H);
#: tuning runs on the 128 validation windows, final runs on the 127 held-out ones.
WORKLOAD = PoweredWorkload(steps=1024, eval_every=32)
QUICK_GRID: Grid = {
    "gpa": {"lr": (0.005, 0.01, 0.02), "H": (1, 2, 4)},
    "adamw": {"lr": (0.0025, 0.005, 0.01), "beta2": (0.9, 0.95, 0.99)},
    "diloco": {"lr": (0.005, 0.01, 0.02), "H": (1, 2, 4)},
    "sf_ref": {"lr": (0.005, 0.01, 0.02), "beta1": (0.8, 0.9, 0.95)},
    "sf": {"lr": (0.005, 0.01, 0.02), "mu_y": (0.8, 0.9, 0.95)},
}
QUICK = PoweredWorkload(**{**dataclasses.asdict(QUICK_WORKLOAD), "steps": 8, "eval_every": 4, "held_out_windows": 3})
#: Configurations every method's search evaluates, slides and refinements included: a little under 4 passes of the
#: 11-configuration grids (the earlier search, which slid without a budget, evaluated 20 to 45 per method).
DEFAULT_BUDGET = 40
QUICK_BUDGET = 7


@dataclass(frozen=True)
class PoweredPlan:
    """What to run: each method's starting grid (ordered axes), the configurations every method's search evaluates
    (`tune_budget`), the tuning seeds and the final seeds."""

    grid: Grid = field(default_factory=lambda: {m: dict(axes) for m, axes in DEFAULT_GRID.items()})
    budget: int = DEFAULT_BUDGET
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
            f"--grid: unequal first passes {sizes} (configurations = 1 + sum of (axis size - 1)); give every method "
            "the same number"
        )
    if plan.budget < max(sizes.values()):
        raise ValueError(
            f"--budget: {plan.budget} configurations do not finish one pass of the grids ({max(sizes.values())}); "
            "give at least that many"
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


# ---- tuning: one axis at a time, a fixed number of configurations ----


def _config_key(config: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted(config.items()))


def _values_text(values: Sequence[float]) -> str:
    return ",".join(f"{v:g}" for v in values)


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
    if axis not in _GEOMETRIC:
        nxt = round(nxt, 6)  # 0.7, not 0.8 - 0.1 = 0.7000000000000001: one value, one run key
    return (*values[1:], nxt) if side == "high" else (nxt, *values[:-1])


def midpoint(low: float, high: float, axis: str) -> float:
    """The point halfway between two values of ``axis``: geometric for lr (3 significant digits) and H (a whole
    number), arithmetic for the others (6 decimals), so that the same two points always give the same value."""
    if axis == "lr":
        return float(f"{math.sqrt(low * high):.3g}")
    if axis == "H":
        return int(round(math.sqrt(low * high)))
    return round((low + high) / 2.0, 6)


def refine(explored: Sequence[float], best: float, axis: str) -> tuple[float, ...]:
    """The axis around ``best`` at half the spacing: the midpoints between ``best`` and its nearest ``explored`` values
    on each side (one side at a bound), ``best`` in the middle, duplicates dropped."""
    below = [v for v in explored if v < best]
    above = [v for v in explored if v > best]
    points = {best}
    if below:
        points.add(midpoint(max(below), best, axis))
    if above:
        points.add(midpoint(best, min(above), axis))
    return tuple(sorted(points))


def tune(
    method: str,
    axes: Mapping[str, Sequence[float]],
    score: Callable[[dict[str, float]], float],
    start: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """One pass of the one-axis-at-a-time search of ``method`` on ``axes``: from ``start`` (default: every axis's
    middle point), for each axis in order try all its values with the other axes at their best so far and keep the
    best (lowest score; a tie keeps the earlier value).

    Returns the stages (axis, values, scores, best), the selected configuration and the edges: each axis whose best
    is its first or last point, with the ``--grid`` value that slides the axis past it.
    """
    current = dict(start) if start is not None else {axis: values[len(values) // 2] for axis, values in axes.items()}
    stages, edges = [], []
    for axis, values in axes.items():
        scores = [score({**current, axis: value}) for value in values]
        best = min(range(len(values)), key=lambda i: (scores[i], i))
        current[axis] = values[best]
        stages.append({"axis": axis, "values": list(values), "scores": scores, "best": values[best]})
        if len(values) > 1 and best in (0, len(values) - 1):
            side = "low" if best == 0 else "high"
            slid = slide(values, axis, side)
            extend = (
                f"--grid {method}.{axis}=" + _values_text(slid)
                if len(set(slid)) == len(slid)
                else f"none: {values[best]:g} is the bound of {axis}"
            )
            edges.append({"axis": axis, "value": values[best], "side": side, "extend": extend})
    return {"stages": stages, "selected": current, "edges": edges, "configurations": grid_size(axes)}


class _BudgetSpent(Exception):
    """The search has evaluated its budget of configurations."""


def tune_budget(
    method: str,
    grid: dict[str, dict[str, Sequence[float]]],
    score: Callable[[dict[str, float]], float],
    budget: int,
) -> dict[str, Any]:
    """The search of ``method`` that evaluates exactly ``budget`` distinct configurations (fewer only where no new one
    is left to try), whatever its landscape, so that every method of the comparison is tuned with as many.

    Passes of `tune`, each from the best configuration so far (the first from the middle of ``grid[method]``):

    1. **slide**: while the pass's best lies on an edge of an axis that can move (not a bound such as mu_y's 0), that
       axis slides one point past it (`slide`, same size; ``grid`` is updated in place) and a pass runs again;
    2. **refine**: once every best is inside, each axis is replaced by its best and the midpoints to its nearest
       values tried so far (`refine`), and a pass runs again, until the budget is spent.

    The selection is the configuration of lowest score among all those evaluated (a tie: the first evaluated). Its
    edges are the axes on which it holds the lowest or highest value tried and could move: only a budget spent while
    sliding leaves one. The result lists the passes (``moves``) and every configuration with its score.
    """
    scores: dict[tuple[tuple[str, float], ...], float] = {}
    evaluated: list[dict[str, float]] = []

    def counted(config: dict[str, float]) -> float:
        key = _config_key(config)
        if key not in scores:
            if len(scores) >= budget:
                raise _BudgetSpent
            scores[key] = score(config)
            evaluated.append(dict(config))
        return scores[key]

    axes = grid[method]
    explored = {axis: set(values) for axis, values in axes.items()}
    moves: list[str] = []
    start: dict[str, float] | None = None
    refining = False
    first: dict[str, Any] | None = None
    try:
        for _ in range(4 * budget):  # a pass that adds nothing ends the search; this only bounds a bug
            before, previous = len(scores), dict(axes)
            result = tune(method, axes, counted, start)
            first = first or result
            start = result["selected"]
            stalled = len(scores) == before and len(moves) > 0  # a slid pass that tried nothing new: refine instead
            movable = [] if refining or stalled else [e for e in result["edges"] if e["extend"].startswith("--grid")]
            for edge in movable:
                axes[edge["axis"]] = slide(axes[edge["axis"]], edge["axis"], edge["side"])
                moves.append("slide " + edge["extend"].removeprefix("--grid "))
            if not movable:
                refining = True
                for axis in axes:
                    axes[axis] = refine(sorted(explored[axis]), start[axis], axis)
                if axes == previous and len(scores) == before:
                    break
                if axes != previous:
                    moves.append("refine " + "; ".join(f"{a}={_values_text(vs)}" for a, vs in axes.items()))
            for axis, values in axes.items():
                explored[axis].update(values)
    except _BudgetSpent:
        pass
    if not evaluated:
        raise ValueError(f"{method}: a budget of {budget} configurations evaluates none")
    selected = min(evaluated, key=lambda c: scores[_config_key(c)])
    tried = {axis: sorted({c[axis] for c in evaluated}) for axis in selected}
    edges = []
    for axis, value in selected.items():
        values = tried[axis]
        if len(values) > 1 and value in (values[0], values[-1]):
            side = "low" if value == values[0] else "high"
            slid = slide(values[:2] if side == "low" else values[-2:], axis, side)
            if len(set(slid)) == len(slid):
                said = f"{axis} {value:g} is the {'lowest' if side == 'low' else 'highest'} value tried"
                edges.append({"axis": axis, "value": value, "side": side, "extend": f"a larger --budget: {said}"})
    return {
        "first_pass": first["stages"] if first else [],
        "selected": selected,
        "score": scores[_config_key(selected)],
        "edges": edges,
        "configurations": budget,
        "evaluated": len(evaluated),
        "moves": moves,
        "scores": [{**c, "score": scores[_config_key(c)]} for c in evaluated],
    }


# ---- the pipeline ----


class Runner:
    """Runs the specs not yet in the record (one thread, one after another), each recorded as it ends: a tuning run
    evaluated on the validation windows, a final run on the held-out ones (``run["eval_windows"]`` says which)."""

    def __init__(self, results: ResultsFile, workload: PoweredWorkload, max_runs: int | None = None) -> None:
        self.results, self.workload, self.max_runs, self.ran = results, workload, max_runs, 0
        self._data: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._by_key = {run["key"]: run for run in results.runs}

    def windows(self, phase: str) -> str:
        """Which windows a run of ``phase`` is evaluated on: "held_out" for the final runs, else "validation"."""
        return "held_out" if phase == "final" else "validation"

    def data(self, windows: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(train windows, the evaluation windows named ``windows``), loaded once."""
        if windows not in self._data:
            held_out = self.workload.held_out_windows if windows == "held_out" else 0
            self._data[windows] = load_token_windows(self.workload, held_out=held_out)
        return self._data[windows]

    def run(self, spec: RunSpec) -> dict[str, Any]:
        if spec.key in self._by_key:
            return self._by_key[spec.key]
        if self.max_runs is not None and self.ran >= self.max_runs:
            raise _Stop
        windows = self.windows(spec.phase)
        data = self.data(windows)
        cpu = time.process_time()
        run = train_run(spec, self.workload, data)
        run["cpu_s"] = time.process_time() - cpu  # the core time, which a shared machine's wall time overstates
        run["eval_windows"] = windows
        self.results.add(run)
        self._by_key[run["key"]] = run
        self.ran += 1
        logger.info(
            "%-60s final %s %.4f (%.0f s, %.0f s CPU)",
            run["key"], windows, run["final_val"], run["wall_s"], run["cpu_s"],
        )  # fmt: skip
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
    workload: PoweredWorkload,
    plan: PoweredPlan,
    stage: str = "all",
    allow_edges: bool = False,
    max_runs: int | None = None,
) -> str:
    """Tune every method with ``plan.budget`` configurations (`tune_budget`), then (every pick inside what its search
    tried, or ``allow_edges``) run the final seeds; write the report.

    ``stage``: "tune" stops after tuning, "all" goes on to the final runs; both resume from the JSON (a recorded run
    is never rerun; the searches are replayed from it instantly). Returns the report's text.
    """
    from benchmarks.powered_report import write_report

    check_plan(plan, workload)
    results = results_file(out / "results.json", workload, plan)
    record_parameters(results, workload)
    runner = Runner(results, workload, max_runs)
    tuning: dict[str, Any] = {}
    results.data["tuning"] = tuning  # rebuilt from the recorded runs (instantly) for this call's plan
    grid = {method: dict(axes) for method, axes in plan.grid.items()}
    try:
        for method in METHODS:
            tuning[method] = tune_budget(method, grid, tuning_score(runner, method, plan), plan.budget)
            tuning[method]["grid"] = {axis: list(values) for axis, values in grid[method].items()}  # as searched last
            results.write()  # a method's search is in the record as soon as it ends
        edges = {m: t["edges"] for m, t in tuning.items() if t["edges"]}
        if edges:
            logger.warning(
                "Picks on the edge of what was tried: %s", {m: [e["axis"] for e in t] for m, t in edges.items()}
            )
        if stage != "tune" and (allow_edges or not edges):
            for seed in plan.seeds:  # seed-major: a stopped run leaves whole seeds, ready to pair
                for method in METHODS:
                    runner.run(run_spec(method, tuning[method]["selected"], seed, workload.steps, "final"))
        elif stage != "tune":
            logger.warning("Final runs wait for picks inside what was tried (a larger --budget, or --allow-edges)")
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
    parser.add_argument("--steps", type=int, default=None, help=f"training steps a run (default {WORKLOAD.steps})")
    parser.add_argument(
        "--eval-every", type=int, default=None, help=f"evaluation interval (default {WORKLOAD.eval_every})"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="final seeds (>= 10; default 0-9)")
    parser.add_argument("--tuning-seeds", type=int, nargs="+", default=None, help="default 1000 1001")
    parser.add_argument(
        "--grid", action="append", default=[], help="replace or add an axis: METHOD.AXIS=v1,v2,... (repeatable)"
    )
    parser.add_argument(
        "--allow-edges", action="store_true", help="run the final seeds even if a pick is on an edge of what was tried"
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help=f"configurations every method's search evaluates, slides included (default {DEFAULT_BUDGET}; "
        f"--quick: {QUICK_BUDGET})",
    )
    parser.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs (resume later)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.stage == "report":
        from benchmarks.powered_report import write_report

        print(write_report(args.out / "results.json", args.out))
        return
    workload, plan = (WORKLOAD, PoweredPlan())
    if args.quick:
        workload, plan = QUICK, PoweredPlan(grid=QUICK_GRID, budget=QUICK_BUDGET)
    try:
        if args.steps is not None:
            if args.steps < 1:
                raise ValueError(f"--steps must be >= 1, got {args.steps}")
            workload = dataclasses.replace(workload, steps=args.steps)
        if args.eval_every is not None:
            if not 1 <= args.eval_every <= workload.steps:
                raise ValueError(f"--eval-every must lie in [1, --steps], got {args.eval_every}")
            workload = dataclasses.replace(workload, eval_every=args.eval_every)
        if args.max_runs is not None and args.max_runs < 1:
            raise ValueError(f"--max-runs must be >= 1, got {args.max_runs}")
        plan = dataclasses.replace(
            plan,
            grid=parse_grid(args.grid, plan.grid),
            seeds=tuple(args.seeds) if args.seeds is not None else plan.seeds,
            tuning_seeds=tuple(args.tuning_seeds) if args.tuning_seeds is not None else plan.tuning_seeds,
            budget=args.budget if args.budget is not None else plan.budget,
        )
        check_plan(plan, workload)
    except ValueError as error:
        raise SystemExit(f"powered_table: {error}") from None
    import_schedulefree()  # before any run, not when the pipeline reaches sf_ref
    torch.set_num_threads(1)
    print(run_pipeline(args.out, workload, plan, args.stage, args.allow_edges, args.max_runs))


if __name__ == "__main__":
    main()
