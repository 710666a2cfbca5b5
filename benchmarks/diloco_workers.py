"""DiLoCo across workers against DDP, measured on CPU processes over gloo: the bytes each process sends per training
step, the steps per second over a simulated slow link, and the loss at the same token budget, each method's settings
picked on seeds and windows that never report it.

Why this file exists: DiLoCo's reason to exist is communication. M workers each take H inner steps on their own
data and then average their pseudo-gradients in one all-reduce, where DDP all-reduces every gradient at every step;
so DiLoCo should send about 1/H of DDP's bytes, streaming DiLoCo (P fragments) should cut the peak of one
synchronisation by P, and over a slow link DiLoCo should take more steps per second. This benchmark measures the
three claims and what the saving costs in loss, on the tiny Llama and corpus of ``benchmarks.paper_recipe``:

* **bytes**: every collective of every process is counted by the metered gloo backend of ``benchmarks.ranks`` (the
  payload each process hands to each collective: DDP's gradient buckets, DiLoCo's outer all-reduce, anything else),
  over whole outer periods after two warm-up steps, for DDP-AdamW, GPA-AdamW under DDP, DiLoCo and GPA across
  workers (``GPADiLoCo``) at each H (every process a worker), DiLoCo at each H with its outer all-reduce compressed
  (``Plan.outer_dtypes``: bfloat16, int8 with error feedback; beside the metered count, the optimizer's own count of
  what it sent to the other workers), streaming DiLoCo (P fragments) and DiLoCo in islands (M workers of W / M
  processes, DDP inside each island: only the outer all-reduce crosses workers);
* **speed**: steps per second of DDP-AdamW and DiLoCo at each H with every collective delayed by a `ranks.Link`
  (latency plus bytes over bandwidth), in interleaved rounds (ABBA), medians and the ratio to DDP of the same link.
  The ranks share the machine's cores, so the model is tiny and the step's compute small beside the link;
* **quality**: DDP-AdamW, DiLoCo at each H (M = W workers), GPA across workers at each H and, for reference, GPA-AdamW
  under DDP, trained on the same batches (each step's global batch split over the processes, the same tokens for
  every method) from the same initialisation with the recipe of ``benchmarks.paper_recipe`` (its betas, weight decay,
  clipping, warmup and cosine). Picking and reporting are kept apart:

  - every tuned method evaluates the same number of configurations (``Plan.tune_budget``), by one rule
    (`next_point`): it starts at a point of its lattice (``Plan.lattices``, a ladder of values on each axis:
    DDP-AdamW's lr; DiLoCo's lr, outer lr and outer momentum; GPA across workers' (mu_x, mu_y) at its DiLoCo's pick's
    lr, its outer lr matched to that pick's outer pair by `hf_gpa.optim.outer_lr_like_diloco`) and then evaluates,
    one at a time, the untried point nearest the best so far: past an edge while the best lies on it, around the
    best once it does not. The report says on every axis whether the pick is bracketed;
  - a configuration's score is its final loss on the fixed validation windows (``Workload.val_windows``), averaged
    over the tuning seeds (``--tune-seeds``); every run also evaluates ``Plan.held_out_windows`` other windows of the
    validation split (`workloads.held_out_windows`), and the final runs, at the final seeds (``--final-seeds``: at
    least 5, none a tuning seed), report those: each pick; at one H the untuned variants of its DiLoCo pick (outer
    all-reduce in bfloat16 and int8, streaming DiLoCo blocking and overlapped); DiLoCo's pick at the outer lrs of
    ``Plan.outer_lr_checks``. Every run records its phase ("tune" or "final") and where it ran
    (`report.environment`);
  - the end of training is the Trainer's: ``synchronize()`` (``GPATrainer`` calls it at the last step) applies an
    overlapped outer sync still in flight and synchronises the fragments of a streaming run that took inner steps
    since their last outer step, before the final evaluation (the evaluation before it is kept under
    ``before_syncs_applied``, for a streaming or overlapped run); the evaluations during training are of what a user
    sees at that step, the syncs in flight not applied.

  The loss is that of the evaluation weights (DiLoCo's outer weights, GPA's x).

Each part runs in one launch of W spawned processes with a timeout; results are written as they come (a resumable
``diloco_workers.json``, ``diloco_workers.md`` and ``diloco_workers.png`` under ``--out``):

    python -m benchmarks.diloco_workers --parts bytes speed        # 4 processes, about 7 minutes
    nohup python -m benchmarks.diloco_workers --parts quality > quality.log 2>&1 &
    python -m benchmarks.diloco_workers --tiny --out outputs/dl    # 2 processes, 1 minute: the whole pipeline
    python -m benchmarks.diloco_workers --report-only --regime --out benchmarks/results/diloco_regime  # the report

The quality tables and the "loss against bytes" panel give each final row's held-out loss (mean over the final seeds)
beside the bytes between workers per step that the bytes part counted for it, and every comparison as paired
differences over the final seeds with 95% intervals.

The default quality setting (4 windows per worker a step, 1,024 steps) is outside DiLoCo's regime: with so small a
per-worker batch the workers end about where one of them would alone on its quarter of the data. ``--regime`` runs
the quality part where DiLoCo is meant to run (`REGIME_PLAN`: 16 windows per worker, 4,096 steps), into its own
``--out``; ``benchmarks/results/diloco_regime/commands.sh`` holds the command that made its record.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import paper_recipe as pr
from benchmarks import report, workloads
from benchmarks.paired_stats import Interval, decided_together, mean_interval, paired_differences, t_quantile
from benchmarks.ranks import LOOPBACK, Link, Meter, run_ranks
from hf_gpa.optim import GPADiLoCo, outer_lr_like_diloco

logger = logging.getLogger("diloco_workers")

PARTS = ("bytes", "speed", "quality")
#: The collective timeout of every process group: a process left alone in a collective (another one failed) fails
#: after this; process 0 evaluates while the others wait in their next collective.
COLLECTIVE_TIMEOUT_S = 120.0
STEM = "diloco_workers"
#: A quality run's phase: "tune" (a configuration of a tuned method at a tuning seed, scored on the validation
#: windows) or "final" (a pick or a variant at a final seed, reported on the held-out windows).
TUNE, FINAL = "tune", "final"
#: The fewest final seeds a plan may have: the paired intervals over the final seeds are the report's figures.
MIN_FINAL_SEEDS = 5


@dataclass(frozen=True)
class Method:
    """One way to train across the processes: ``family`` is the paper recipe's method ("adamw" and "gpa" under
    DDP over all processes, "diloco" across workers), ``inner_steps`` H, ``num_workers`` M (None: every process a
    worker), ``num_fragments`` P."""

    family: str
    inner_steps: int | None = None
    num_workers: int | None = None
    num_fragments: int = 1
    #: GPA across workers ("gpa_diloco", `hf_gpa.optim.GPADiLoCo`): the outer step's mu_x and mu_y
    mu_x: float | None = None
    mu_y: float | None = None
    #: DiLoCo's (outer lr, outer momentum); None: the paper recipe's (`paper_recipe.DILOCO_OUTER_LR`, `_MOMENTUM`);
    #: For GPA across workers: the DiLoCo pair its outer lr is matched to (`hf_gpa.optim.outer_lr_like_diloco`)
    outer: tuple[float, float] | None = None
    #: the dtype DiLoCo's pseudo-gradients cross the workers in (`hf_gpa.optim.DiLoCo`'s ``outer_dtype``)
    outer_dtype: str = "float32"
    #: streaming DiLoCo's overlap (`hf_gpa.optim.DiLoCo`'s ``overlap_steps`` tau and ``overlap_alpha``)
    overlap_steps: int = 0
    overlap_alpha: float = 0.0

    @property
    def outer_pair(self) -> tuple[float, float]:
        """``outer``, or the paper recipe's pair where it is None."""
        return self.outer or RECIPE_OUTER

    @property
    def name(self) -> str:
        if self.family == "adamw":
            return "DDP-AdamW"
        if self.family == "gpa":
            return f"GPA-AdamW (DDP, H={self.inner_steps})"
        name = f"DiLoCo H={self.inner_steps}"
        if self.family == "gpa_diloco":
            name = f"GPA-DiLoCo H={self.inner_steps} mu_x={self.mu_x:g} mu_y={self.mu_y:g}"
        if self.num_fragments > 1:
            name = f"streaming {name} P={self.num_fragments}"
        if self.outer is not None:
            name = f"{name}, outer {self.outer[0]:g}/{self.outer[1]:g}"
        if self.outer_dtype != "float32":
            name = f"{name}, outer {self.outer_dtype}"
        if self.overlap_steps:
            name = f"{name}, overlap tau={self.overlap_steps} alpha={self.overlap_alpha:g}"
        return name if self.num_workers is None else f"{name}, M={self.num_workers} islands"


#: DiLoCo's (outer lr, outer momentum) where a method names none: the paper recipe's
RECIPE_OUTER = (pr.DILOCO_OUTER_LR, pr.DILOCO_OUTER_MOMENTUM)
DDP_ADAMW = Method("adamw")
ACROSS_WORKERS = ("diloco", "gpa_diloco")  # the families whose optimizer runs across the processes itself


#: What a lattice may tune: the lr, DiLoCo's outer pair, GPA across workers' (mu_x, mu_y).
AXES = ("lr", "outer_lr", "outer_momentum", "mu_x", "mu_y")


@dataclass(frozen=True)
class Lattice:
    """What a tuned method searches: on each of its ``axes`` (of `AXES`) a ladder of values (ascending), and the
    point its search starts from (one value of each ladder). A point is a tuple of ladder indices."""

    axes: tuple[str, ...]
    ladders: tuple[tuple[float, ...], ...]
    start: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.axes or not len(self.axes) == len(self.ladders) == len(self.start):
            raise ValueError(f"Invalid lattice: axes {self.axes}, {len(self.ladders)} ladders, start {self.start}")
        for axis, ladder, value in zip(self.axes, self.ladders, self.start):
            if axis not in AXES:
                raise ValueError(f"Invalid lattice axis: {axis!r} (one of {AXES})")
            if list(ladder) != sorted(set(ladder)):
                raise ValueError(f"Invalid {axis} ladder: {ladder} (ascending, no value twice)")
            if value not in ladder:
                raise ValueError(f"Invalid {axis} start: {value} (not on its ladder {ladder})")

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Lattice:
        """The lattice of a plan written to JSON (lists where the dataclass holds tuples)."""
        return cls(tuple(record["axes"]), tuple(map(tuple, record["ladders"])), tuple(record["start"]))

    @property
    def start_point(self) -> tuple[int, ...]:
        return self.point(dict(zip(self.axes, self.start)))

    def values(self, point: tuple[int, ...]) -> dict[str, float]:
        """The value on each axis at ``point``."""
        return {axis: ladder[i] for axis, ladder, i in zip(self.axes, self.ladders, point)}

    def point(self, values: Mapping[str, float]) -> tuple[int, ...]:
        """The point whose values are ``values`` (one of each axis)."""
        return tuple(ladder.index(values[axis]) for axis, ladder in zip(self.axes, self.ladders))

    def points(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(len(ladder)) for ladder in self.ladders)))


def best_point(scores: Mapping[tuple[int, ...], float]) -> tuple[int, ...]:
    """The point of the lowest score (of equal ones, the first evaluated)."""
    return min(scores, key=lambda point: scores[point])


def next_point(lattice: Lattice, scores: Mapping[tuple[int, ...], float]) -> tuple[int, ...] | None:
    """The configuration a tuned method evaluates next, given the ``scores`` of those it evaluated: the start, then
    the untried point nearest the best so far (in ladder steps, summed over the axes), so that the search steps past
    an edge while the best lies on it and closes in around the best once it does not; of equally near points, the one
    that moves along more axes (a diagonal step before two steps along one axis), then along the first axis,
    downwards first. None: every point was tried."""
    if not scores:
        return lattice.start_point
    best = best_point(scores)

    def order(point: tuple[int, ...]) -> tuple[int, int, list[tuple[bool, bool]]]:
        offsets = [p - b for p, b in zip(point, best)]
        return sum(map(abs, offsets)), -sum(o != 0 for o in offsets), [(o == 0, o > 0) for o in offsets]

    return min((point for point in lattice.points() if point not in scores), key=order, default=None)


def bracketing(lattice: Lattice, scores: Mapping[tuple[int, ...], float], point: tuple[int, ...]) -> dict[str, str]:
    """On each axis, whether ``point`` (the best of ``scores``) is bracketed there: "yes" where both its neighbours
    on that axis were evaluated (and, ``point`` being the best, are no lower), else what is missing."""
    verdicts = {}
    for i, (axis, ladder) in enumerate(zip(lattice.axes, lattice.ladders)):
        missing = []
        for step in (-1, 1):
            j = point[i] + step
            if not 0 <= j < len(ladder):
                missing.append(f"{'lowest' if step < 0 else 'highest'} value of its ladder")
            elif point[:i] + (j,) + point[i + 1 :] not in scores:
                missing.append(f"{ladder[j]:g} not evaluated")
        verdicts[axis] = "yes" if not missing else "no: " + ", ".join(missing)
    return verdicts


def configured(base: Method, lr: float | None, values: Mapping[str, float]) -> tuple[Method, float]:
    """``base`` at ``lr`` with the lattice ``values`` of a point set on it (`AXES`)."""
    changes: dict[str, Any] = {axis: values[axis] for axis in ("mu_x", "mu_y") if axis in values}
    if "outer_lr" in values or "outer_momentum" in values:
        outer_lr, momentum = base.outer_pair
        changes["outer"] = (values.get("outer_lr", outer_lr), values.get("outer_momentum", momentum))
    lr = values.get("lr", lr)
    if lr is None:
        raise ValueError(f"{base.name}: no lr (its lattice has no lr axis and none was given)")
    return dataclasses.replace(base, **changes), lr


def lattice_key(family: str, inner_steps: int | None = None) -> str:
    """The key of a tuned method's lattice in ``Plan.lattices``: the family, with its H across workers."""
    return f"{family} H={inner_steps}" if family in ACROSS_WORKERS else family


#: The ladders of the lattices: DDP-AdamW's lr in steps of sqrt(2) (one axis: its 7 configurations close in on the
#: pick), DiLoCo's lr in steps of 2, its outer lr in steps of 0.15 (0.6, the default across workers, and the recipe's
#: 0.75 on it), its outer momentum and GPA across workers' mu_x and mu_y denser towards 1.
ADAMW_LRS = (0.005, 0.007071, 0.01, 0.01414, 0.02, 0.02828, 0.04, 0.05657, 0.08, 0.1131, 0.16, 0.2263, 0.32, 0.4525)
DILOCO_LRS = (0.000625, 0.00125, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08)
OUTER_LRS = (0.15, 0.3, 0.45, 0.6, 0.75, 0.9, 1.05, 1.2, 1.35)
OUTER_MOMENTA = (0.3, 0.5, 0.6, 0.75, 0.9, 0.95, 0.98)
MU_XS = (0.5, 0.75, 0.9, 0.95, 0.97, 0.985, 0.995)
MU_YS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.98)
DILOCO_AXES = ("lr", "outer_lr", "outer_momentum")


def diloco_lattice(lr: float, outer_lr: float, outer_momentum: float) -> Lattice:
    return Lattice(DILOCO_AXES, (DILOCO_LRS, OUTER_LRS, OUTER_MOMENTA), (lr, outer_lr, outer_momentum))


def gpa_diloco_lattice(mu_x: float, mu_y: float) -> Lattice:
    return Lattice(("mu_x", "mu_y"), (MU_XS, MU_YS), (mu_x, mu_y))


def default_lattices() -> dict[str, Lattice]:
    """The default plan's (4 windows per worker a step, 1,024 steps): around the paper bench's best lrs (AdamW and GPA
    0.02, single-worker DiLoCo 0.01 at 2,000 steps of the same global batch) and the recipe's outer pair."""
    lattices = {"adamw": Lattice(("lr",), (ADAMW_LRS,), (0.02,)), "gpa": Lattice(("lr",), (ADAMW_LRS,), (0.02,))}
    for h in (8, 32):
        lattices[lattice_key("diloco", h)] = diloco_lattice(0.01, *RECIPE_OUTER)
        lattices[lattice_key("gpa_diloco", h)] = gpa_diloco_lattice(0.9, 0.5)
    return lattices


def check_seeds(tune_seeds: Sequence[int], final_seeds: Sequence[int]) -> None:
    """Refuse seeds that would let a pick report itself or too few seeds to report: the tuning seeds and the final
    seeds (the command line's ``--tune-seeds`` and ``--final-seeds``) share none, the final seeds are at least
    `MIN_FINAL_SEEDS`, and no seed is given twice."""
    if not tune_seeds:
        raise ValueError("Invalid --tune-seeds: none (at least one seed to pick the settings on)")
    for flag, seeds in (("--tune-seeds", tune_seeds), ("--final-seeds", final_seeds)):
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"Invalid {flag}: {' '.join(map(str, seeds))} (a seed given twice)")
    shared = sorted(set(tune_seeds) & set(final_seeds))
    if shared:
        raise ValueError(
            f"Invalid --tune-seeds / --final-seeds: both hold {', '.join(map(str, shared))} (a seed that picks a "
            "setting must never report it)"
        )
    if len(final_seeds) < MIN_FINAL_SEEDS:
        raise ValueError(
            f"Invalid --final-seeds: {' '.join(map(str, final_seeds))} ({len(final_seeds)} seeds; at least "
            f"{MIN_FINAL_SEEDS}, so that the paired intervals over them say something)"
        )


@dataclass(frozen=True)
class Plan:
    """What to run: the processes, the methods of each part, the links, the seeds, the lattices each tuned method
    searches and how many configurations each evaluates."""

    world_size: int = 4
    #: DiLoCo's H (every part); streaming DiLoCo's H and P (bytes, speed), the H of the quality part's untuned
    #: variants (compressed outer all-reduce, streaming blocking and overlapped)
    inner_steps: tuple[int, ...] = (8, 32)
    streaming_inner_steps: int = 32
    fragments: tuple[int, ...] = (2, 4)
    #: M of the islands row of the bytes table (None: no such row), at the largest H
    islands: int | None = 2
    #: the compressed outer dtypes of the bytes table's DiLoCo rows (at every H, beside float32's)
    outer_dtypes: tuple[str, ...] = ("bfloat16", "int8")
    #: GPA-AdamW's H (its mu_x) and mu_y: the paper bench's best full-budget setting (as benchmarks.lowbit_quality)
    gpa_inner_steps: int = 8
    gpa_mu_y: float = 0.5
    #: the (mu_x, mu_y) of GPA across workers' bytes rows (any pair sends the same bytes)
    gpa_diloco_bytes_mus: tuple[float, float] = (0.9, 0.5)

    #: steps counted per method (a multiple of every H and of every H / P), after `WARMUP_STEPS`
    bytes_steps: int = 64
    #: steps per timed round (a multiple of every H), rounds kept (after one warm-up round), links: short rounds,
    #: many of them, so that the load of a shared machine hits every method alike
    speed_steps: int = 32
    speed_rounds: int = 11
    links: tuple[Link, ...] = (
        LOOPBACK,
        Link("WAN", latency_s=0.05, bandwidth=100e6),
        Link("thin", latency_s=0.005, bandwidth=2e6),
        Link("cross-region", latency_s=0.2, bandwidth=10e6),
    )
    #: the (constant) lr of the bytes and speed runs, which measure communication, not loss
    comm_lr: float = 1e-3
    #: the seeds the settings are picked on, and the seeds the picks are reported on (`check_seeds`)
    tune_seeds: tuple[int, ...] = (0,)
    final_seeds: tuple[int, ...] = (1, 2, 3, 4, 5)
    #: the windows of the validation split, none of the workload's ``val_windows``, that the final runs report
    held_out_windows: int = 256
    #: the configurations every tuned method evaluates (each at every tuning seed): equal for all of them
    tune_budget: int = 7
    #: each tuned method's lattice, by `lattice_key`: "adamw" and DiLoCo's at each H must be there (with an lr axis);
    #: GPA across workers at an H (mu_x, mu_y only: its lr and outer pair are its DiLoCo's pick's) and GPA-AdamW under
    #: DDP ("gpa", an lr axis) run where theirs is
    lattices: dict[str, Lattice] = field(default_factory=default_lattices)
    #: the quality part's untuned variants at ``streaming_inner_steps``, at that H's DiLoCo pick, every final seed:
    #: its outer all-reduce compressed to each of these dtypes, and streaming DiLoCo with the most ``fragments``
    #: blocking and overlapped by (tau, alpha) = ``overlap`` (also the speed part's overlapped row; None: neither)
    quality_outer_dtypes: tuple[str, ...] = ()
    overlap: tuple[int, float] | None = (4, 0.5)
    #: DiLoCo's pick at each H run again at each of these outer lrs (its lr and outer momentum kept), every final seed,
    #: and paired with the pick: whether the outer lr picked is better than these, on seeds that did not pick it
    outer_lr_checks: tuple[float, ...] = ()
    timeout_s: float = 7200.0

    def __post_init__(self) -> None:
        check_seeds(self.tune_seeds, self.final_seeds)
        if self.tune_budget < 1 or self.held_out_windows < 1:
            raise ValueError(f"Invalid tune_budget / held_out_windows: {self.tune_budget} / {self.held_out_windows}")
        for key in ["adamw", *(lattice_key("diloco", h) for h in self.inner_steps)]:
            if key not in self.lattices:
                raise ValueError(f"Invalid lattices: none for {key!r} (keys {sorted(self.lattices)})")
        for key, lattice in self.lattices.items():
            tunes_lr = "lr" in lattice.axes
            if tunes_lr == key.startswith("gpa_diloco") or (
                key.startswith("gpa_diloco") and "outer_lr" in lattice.axes
            ):
                raise ValueError(f"Invalid {key} lattice axes: {lattice.axes}")
            if math.prod(len(ladder) for ladder in lattice.ladders) < self.tune_budget:
                raise ValueError(f"Invalid {key} lattice: fewer points than the tune_budget {self.tune_budget}")

    def bytes_methods(self) -> list[Method]:
        methods = [DDP_ADAMW, Method("gpa", self.gpa_inner_steps)]
        methods += [Method("diloco", h) for h in self.inner_steps]
        methods += [Method("diloco", h, outer_dtype=dtype) for h in self.inner_steps for dtype in self.outer_dtypes]
        mu_x, mu_y = self.gpa_diloco_bytes_mus
        methods += [Method("gpa_diloco", h, mu_x=mu_x, mu_y=mu_y) for h in self.inner_steps]
        methods += [Method("diloco", self.streaming_inner_steps, num_fragments=p) for p in self.fragments]
        if self.islands is not None:
            methods.append(Method("diloco", max(self.inner_steps), num_workers=self.islands))
        return methods

    def speed_methods(self) -> list[Method]:
        return [DDP_ADAMW, *(Method("diloco", h) for h in self.inner_steps), *self.overlap_pair(Method("diloco"))]

    def overlap_pair(self, diloco: Method) -> list[Method]:
        """Streaming ``diloco`` at ``streaming_inner_steps`` and the most fragments, blocking and overlapped."""
        if self.overlap is None:
            return []
        tau, alpha = self.overlap
        streaming = dataclasses.replace(
            diloco, inner_steps=self.streaming_inner_steps, num_fragments=max(self.fragments)
        )
        return [streaming, dataclasses.replace(streaming, overlap_steps=tau, overlap_alpha=alpha)]

    def quality_families(self) -> list[Method]:
        """The families and H the quality part runs (`measure_quality` sets their lr, outer pair, (mu_x, mu_y) and
        variants)."""
        methods = [DDP_ADAMW, *(Method(family, h) for h in self.inner_steps for family in ACROSS_WORKERS)]
        return methods + ([Method("gpa", self.gpa_inner_steps)] if "gpa" in self.lattices else [])


#: The quality budget: the paper bench's tiny Llama, 16 windows of 64 tokens a step (4 per process on 4 processes),
#: 1,024 steps (1.05M tokens, a multiple of every H), evaluated every 128 steps on 128 fixed validation windows.
WORKLOAD = pr.Workload(batch_size=16, steps=1024, eval_every=128, val_windows=128)
TINY_WORKLOAD = dataclasses.replace(pr.QUICK_WORKLOAD, steps=8, eval_every=4)
TINY_PLAN = Plan(
    world_size=2, inner_steps=(2, 4), streaming_inner_steps=4, fragments=(2,), islands=None, gpa_inner_steps=2,
    bytes_steps=4, speed_steps=4, speed_rounds=1, links=(LOOPBACK, Link("WAN", latency_s=0.001, bandwidth=100e6)),
    held_out_windows=4, tune_budget=2, timeout_s=300.0, quality_outer_dtypes=("int8",), overlap=(1, 0.5),
    outer_lr_checks=(0.6,),
    lattices={
        "adamw": Lattice(("lr",), ((1e-2, 2e-2, 4e-2),), (2e-2,)),
        **{lattice_key("diloco", h): Lattice(DILOCO_AXES, ((1e-2, 2e-2), (0.6, 0.75), (0.75, 0.9)), (1e-2, 0.75, 0.75))
           for h in (2, 4)},
        lattice_key("gpa_diloco", 2): gpa_diloco_lattice(0.9, 0.5),
    },
)  # fmt: skip
#: DiLoCo in the regime it is built for: 4 workers with 16 windows (1,024 tokens) each a step, 4,096 steps (16.8M
#: tokens, 512 outer steps at H = 8), evaluated every 256 steps (a multiple of every H: at outer-step boundaries) on
#: the 128 validation windows and 256 held-out ones. Tuned at seed 0, reported at seeds 1-5: 7 configurations for
#: each of DDP-AdamW, DiLoCo and GPA across workers at H = 8 and 32 (35 runs), each lattice starting at the pick of
#: the earlier seed-0 record (DDP lr 0.08; DiLoCo lr 0.01 with outer (0.75, 0.75) at H = 8, (0.6, 0.9) at H = 32;
#: GPA across workers (0.97, 0.9) at H = 8, on the corner of its earlier grid, (0.9, 0.75) at H = 32); then 5 final
#: seeds of each pick, of the untuned variants at H = 32 (outer bfloat16, int8, streaming P = 4 blocking and
#: overlapped: tau 4, alpha 0.5) and of DiLoCo's pick at the outer lrs 0.6 and 0.75 where it picked another (about
#: 55 runs): about 90 runs of 3.5 (idle machine) to 9 minutes each, in this order (what answers most first).
REGIME_WORKLOAD = pr.Workload(batch_size=64, steps=4096, eval_every=256, val_windows=128)
REGIME_PLAN = Plan(
    world_size=4, inner_steps=(8, 32), tune_seeds=(0,), final_seeds=(1, 2, 3, 4, 5), held_out_windows=256,
    tune_budget=7,
    lattices={
        "adamw": Lattice(("lr",), (ADAMW_LRS,), (0.08,)),
        lattice_key("diloco", 8): diloco_lattice(0.01, 0.75, 0.75),
        lattice_key("gpa_diloco", 8): gpa_diloco_lattice(0.97, 0.9),
        lattice_key("diloco", 32): diloco_lattice(0.01, 0.6, 0.9),
        lattice_key("gpa_diloco", 32): gpa_diloco_lattice(0.9, 0.75),
    },
    quality_outer_dtypes=("bfloat16", "int8"), outer_lr_checks=(0.6, 0.75), timeout_s=172800.0,
)  # fmt: skip


# ---- one trainee: a model, what its forward runs through, its optimizer ----


@dataclass
class Trainee:
    method: Method
    model: torch.nn.Module
    forward: torch.nn.Module  # the model, or its DDP
    optimizer: torch.optim.Optimizer
    grad_clip: float

    def step(self, batch: torch.Tensor) -> float:
        loss = self.forward(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def evaluation_losses(self, windows: Mapping[str, torch.Tensor], workload: pr.Workload) -> dict[str, float]:
        """The loss of the evaluation weights (DiLoCo's outer weights, GPA's x, else the parameters) on each set of
        ``windows``."""
        averaged = hasattr(self.optimizer, "eval")
        if averaged:
            self.optimizer.eval()
        try:
            return {name: pr.evaluate(self.model, val, workload.batch_size, workload) for name, val in windows.items()}
        finally:
            if averaged:
                self.optimizer.train()

    def end_training(self) -> None:
        """What the Trainer does when training ends, before it evaluates: the outer optimizer's ``synchronize()``
        (the syncs in flight applied, every fragment's partial period synchronised; nothing for DDP-AdamW or a run
        that ends on a whole period). A collective: every process calls it."""
        synchronize = getattr(self.optimizer, "synchronize", None)
        if synchronize is not None:
            synchronize()


def entry_key(method: Method) -> Method:
    """The method whose ``--optim`` entry ``method`` is built from: its family and H (`build` sets the rest)."""
    return Method(method.family, method.inner_steps)


def optimizer_entries(plan: Plan, workload: pr.Workload) -> dict[Method, tuple[type, dict[str, Any]]]:
    """The ``--optim`` table's entry (class, keyword arguments) of every family and H the plan may run: the paper
    recipe's flags (`paper_recipe.optimizer_flags`) read by the one table, once, in the launching process; each run
    sets its lr, outer pair, (mu_x, mu_y) and outer dtype."""
    methods = {*plan.bytes_methods(), *plan.speed_methods(), *plan.quality_families()}
    methods |= {Method("gpa_diloco", h) for h in plan.inner_steps}
    entries = {}
    for method in sorted({entry_key(m) for m in methods}, key=lambda m: (m.family, m.inner_steps or 0)):
        mu_y = plan.gpa_mu_y if method.family == "gpa" else None
        family = "diloco" if method.family == "gpa_diloco" else method.family
        spec = pr.RunSpec(family, plan.comm_lr, 0, workload.steps, STEM, method.inner_steps, mu_y)
        cls, kwargs = workloads.optimizer_cls_and_kwargs(pr.optimizer_flags(spec, workload))
        if method.family == "gpa_diloco":  # the recipe DiLoCo's base, H and inner AdamW; the outer step GPA's
            cls, kwargs = GPADiLoCo, {k: v for k, v in kwargs.items() if k != "outer_momentum"}
        entries[method] = cls, kwargs
    return entries


def method_overrides(method: Method) -> dict[str, Any]:
    """What ``method`` sets over its family's entry: the outer pair, GPA across workers' (mu_x, mu_y) and the outer
    lr matched to its DiLoCo pair, the outer dtype."""
    overrides: dict[str, Any] = {}
    if method.family == "diloco" and method.outer is not None:
        overrides["outer_lr"], overrides["outer_momentum"] = method.outer
    if method.family == "gpa_diloco":
        outer_lr = outer_lr_like_diloco(*method.outer_pair, method.mu_x, method.mu_y)
        overrides |= {"outer_lr": outer_lr, "mu_x": method.mu_x, "mu_y": method.mu_y}
    if method.outer_dtype != "float32":
        overrides["outer_dtype"] = method.outer_dtype
    if method.overlap_steps:
        overrides |= {"overlap_steps": method.overlap_steps, "overlap_alpha": method.overlap_alpha}
    return overrides


def build(method: Method, context: Context, seed: int, lr: float) -> Trainee:
    """The trainee of ``method`` on every process (a collective: every process calls it with the same arguments):
    the workload's Llama from ``seed``, the method's optimizer at ``lr`` with weight decay on every tensor, DDP over
    all processes for AdamW and GPA, over the island for DiLoCo in islands, none for DiLoCo with every process a
    worker. DDP does not broadcast buffers before each forward: the Llama's only buffers are constant."""
    from torch.nn.parallel import DistributedDataParallel

    workload = context.workload
    model = workload.build(seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    cls, kwargs = context.entries[entry_key(method)]
    overrides: dict[str, Any] = {"lr": lr, **method_overrides(method)}
    if method.family in ACROSS_WORKERS:
        overrides |= {"distributed": True, "num_workers": method.num_workers, "num_fragments": method.num_fragments}
    optimizer = workloads.optimizer_from_entry(cls, kwargs, params, weight_decay=workload.weight_decay, **overrides)
    group = dist.group.WORLD
    if method.family in ACROSS_WORKERS:
        group = optimizer.layout.island_group if optimizer.layout.island_size > 1 else None
    forward = model if group is None else DistributedDataParallel(model, process_group=group, **_NO_BUFFER_SYNC)
    return Trainee(method, model, forward, optimizer, workload.grad_clip)


#: DDP's switch for the per-forward buffer broadcast (renamed in torch 2.13; the old name warns there).
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


# ---- the three parts, run on every process ----


@dataclass
class Context:
    """What every part of one process works with."""

    rank: int
    meter: Meter
    plan: Plan
    workload: pr.Workload
    entries: dict[Method, tuple[type, dict[str, Any]]]
    #: (train windows, {"val": the validation windows, "held_out": the held-out windows}) of the corpus
    data: tuple[torch.Tensor, dict[str, torch.Tensor]]
    #: the runs recorded before (a resumed record), by key
    recorded: dict[str, dict[str, Any]]
    #: records a finished run (process 0 writes it, with where it ran; the others do nothing)
    record: Callable[[dict[str, Any]], None]

    def from_rank0(self, value: Any) -> Any:
        """``value`` of process 0, on every process (a collective, neither counted nor delayed)."""
        return from_rank0(value, self.meter)

    def evaluate(self, trainee: Trainee) -> dict[str, float]:
        """The trainee's loss on the validation and the held-out windows: process 0's (nan on the others)."""
        if self.rank != 0:
            return {name: math.nan for name in self.data[1]}
        return trainee.evaluation_losses(self.data[1], self.workload)

    def batch(self, order: torch.Tensor, step: int) -> torch.Tensor:
        """This process's share of the step's global batch (row ``step`` of a `workloads.batch_order`)."""
        per = order.shape[1] // self.plan.world_size
        return self.data[0][order[step, self.rank * per : (self.rank + 1) * per]].long()


def from_rank0(value: Any, meter: Meter) -> Any:
    box = [value]
    with meter.paused():
        dist.broadcast_object_list(box, src=0)
    return box[0]


#: Steps before the bytes are counted: DDP rebuilds its buckets at the start of its second step (a broadcast).
WARMUP_STEPS = 2


def measure_bytes(context: Context) -> None:
    """Each method's collectives over ``plan.bytes_steps`` steps after `WARMUP_STEPS` steps, per step. A window of
    N consecutive steps, N a multiple of H, holds N / H outer steps of every fragment."""
    plan, meter, world, steps = context.plan, context.meter, context.plan.world_size, context.plan.bytes_steps
    order = workloads.batch_order(context.data[0].shape[0], context.workload.batch_size, WARMUP_STEPS + steps, 0)
    for method in plan.bytes_methods():
        key = f"bytes/{method.name}"
        if key in context.recorded:
            continue
        trainee = build(method, context, 0, plan.comm_lr)
        model_bytes = sum(p.numel() * p.element_size() for p in trainee.model.parameters() if p.requires_grad)
        for step in range(WARMUP_STEPS):
            trainee.step(context.batch(order, step))
        counted_before = _outer_bytes(trainee.optimizer)
        meter.clear()
        for step in range(steps):
            meter.step = step
            trainee.step(context.batch(order, WARMUP_STEPS + step))
        collectives, meter.collectives = meter.collectives, []
        counted = _outer_bytes(trainee.optimizer) - counted_before
        with meter.paused():
            payloads: list[Any] = [None] * world
            dist.all_gather_object(payloads, sum(c.payload for c in collectives))
        island = world // (method.num_workers or world)
        between = [c for c in collectives if len({r // island for r in c.ranks}) > 1]
        context.record({
            "key": key, "part": "bytes", "method": method.name, **dataclasses.asdict(method),
            "world_size": world, "island_size": island, "steps": steps, "model_bytes": model_bytes,
            "collectives_per_step": len(collectives) / steps,
            "ops": {op: sum(c.op == op for c in collectives) for op in sorted({c.op for c in collectives})},
            "payload_per_step": sum(c.payload for c in collectives) / steps,
            "sent_per_step": sum(c.wire_bytes for c in collectives) / steps,
            "between_workers_per_step": sum(c.payload for c in between) / steps,
            "between_workers_sent_per_step": sum(c.wire_bytes for c in between) / steps,
            "peak_step_payload": max(sum(c.payload for c in collectives if c.step == s) for s in range(steps)),
            "peak_between_workers_step_payload": max(
                sum(c.payload for c in between if c.step == s) for s in range(steps)
            ),
            "payload_of_each_rank": payloads,
            "optimizer_outer_bytes_per_step": counted / steps,
        })  # fmt: skip


def _outer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes DiLoCo's optimizer says it sent to the other workers so far (0 for DDP's)."""
    traffic = getattr(optimizer, "outer_traffic", None)
    return 0 if traffic is None else traffic.outer_bytes


def measure_speed(context: Context) -> None:
    """Steps per second of each speed method over each link, in interleaved rounds (process 0's clock, between two
    uncounted barriers), and the link time the model charged per step."""
    plan, meter, world, steps = context.plan, context.meter, context.plan.world_size, context.plan.speed_steps
    trainees = {m.name: build(m, context, 0, plan.comm_lr) for m in plan.speed_methods()}
    generator = torch.Generator().manual_seed(1000 + context.rank)
    train = context.data[0]

    def timed(trainee: Trainee) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:
            shape = (steps, context.workload.batch_size // world)
            picks = torch.randint(0, train.shape[0], shape, generator=generator)
            meter.clear()
            with meter.paused():
                dist.barrier()
            start = time.perf_counter()
            for step in range(steps):
                meter.step = step
                trainee.step(train[picks[step]].long())
            with meter.paused():
                dist.barrier()
            elapsed = time.perf_counter() - start
            link_s = sum(meter.link.delay_s(c.wire_bytes) for c in meter.collectives if len(c.ranks) > 1)
            return steps / elapsed, (link_s / steps if meter.link != LOOPBACK else 0.0)

        return run

    for link in plan.links:
        key = f"speed/{link.name}"
        if key in context.recorded:
            continue
        meter.link = link
        rounds = report.interleaved_rounds({n: timed(t) for n, t in trainees.items()}, plan.speed_rounds, warmup=1)
        meter.link, meter.collectives = LOOPBACK, []
        medians, rates = rounds.medians(0), {n: [s[0] for s in samples] for n, samples in rounds.samples.items()}
        ddp = rates[DDP_ADAMW.name]
        round_ratios = {n: statistics.median(a / b for a, b in zip(r, ddp)) for n, r in rates.items()}
        context.record({
            "key": key, "part": "speed", "link": dataclasses.asdict(link), "link_text": link.describe(),
            "world_size": world, "steps_per_round": steps, "rounds": plan.speed_rounds,
            "steps_per_s": rates, "median_steps_per_s": medians,
            "ratio_to_ddp": {n: medians[n] / medians[DDP_ADAMW.name] for n in medians},
            "median_round_ratio_to_ddp": round_ratios,
            "modelled_link_s_per_step": rounds.medians(1),
        })  # fmt: skip


def measure_quality(context: Context) -> None:
    """Every tuned method's search at the tuning seeds (`tuned`), then its pick at the final seeds, in the order that
    answers the most first: DDP-AdamW; at each H, DiLoCo, then GPA across workers at DiLoCo's pick; at
    ``streaming_inner_steps``, the untuned variants of DiLoCo's pick there (compressed outer all-reduce, streaming
    blocking and overlapped); GPA-AdamW under DDP; last, DiLoCo's picks at the ``outer_lr_checks``."""
    plan = context.plan
    finals(context, *tuned(context, DDP_ADAMW, None))
    picks = {}
    for h in plan.inner_steps:
        picks[h] = finals(context, *tuned(context, Method("diloco", h), None))
        if lattice_key("gpa_diloco", h) in plan.lattices:
            diloco, lr = picks[h]
            finals(context, *tuned(context, Method("gpa_diloco", h, outer=diloco.outer_pair), lr))
    if plan.streaming_inner_steps in picks:
        diloco, lr = picks[plan.streaming_inner_steps]
        variants = [dataclasses.replace(diloco, outer_dtype=dtype) for dtype in plan.quality_outer_dtypes]
        for method in variants + plan.overlap_pair(diloco):
            finals(context, method, lr, role="variant")
    if "gpa" in plan.lattices:
        finals(context, *tuned(context, Method("gpa", plan.gpa_inner_steps), None))
    for diloco, lr in picks.values():
        outer_lr, momentum = diloco.outer_pair
        for check in plan.outer_lr_checks:
            if check != outer_lr:
                finals(context, dataclasses.replace(diloco, outer=(check, momentum)), lr, role="check")


def finals(context: Context, method: Method, lr: float, role: str = "pick") -> tuple[Method, float]:
    """``method`` at ``lr`` at every final seed; ``role``: "pick" (a tuned method's pick), "variant" (an untuned
    variant of a pick) or "check" (a pick at another outer lr)."""
    for seed in context.plan.final_seeds:
        quality_run(context, method, lr, seed, FINAL, role=role)
    return method, lr


def tuned(context: Context, base: Method, lr: float | None) -> tuple[Method, float]:
    """The pick of ``base``'s lattice (`lattice_key`; at ``lr`` where the lattice has no lr axis): ``tune_budget``
    configurations in `next_point`'s order, each scored by its final validation loss averaged over the tuning seeds,
    the lowest picked. Every process returns the same pick (the scores are process 0's)."""
    plan = context.plan
    key = lattice_key(base.family, base.inner_steps)
    lattice = plan.lattices[key]
    scores: dict[tuple[int, ...], float] = {}
    while len(scores) < plan.tune_budget and (point := next_point(lattice, scores)) is not None:
        values = lattice.values(point)
        method, point_lr = configured(base, lr, values)
        losses = [quality_run(context, method, point_lr, seed, TUNE, lattice=key, point=values)
                  for seed in plan.tune_seeds]  # fmt: skip
        scores[point] = statistics.fmean(losses)
    return configured(base, lr, lattice.values(best_point(scores)))


def quality_key(method: Method, lr: float, seed: int, phase: str) -> str:
    return f"quality/{phase}/{method.name}/lr{lr:g}/s{seed}"


def quality_run(context: Context, method: Method, lr: float, seed: int, phase: str, **notes: Any) -> float:
    """One training run on every process (or its record, if there is one); its final loss on the validation
    windows (process 0's evaluation, on every process; inf if it diverged). The record holds the curves on the
    validation and the held-out windows, evaluated every ``eval_every`` steps (of the weights a user would evaluate
    then: overlapped syncs in flight not applied) and at the last step after `Trainee.end_training` (the Trainer's
    end of training: syncs in flight applied; for an overlapped run the evaluation before it too), the phase,
    ``notes`` and where it ran."""
    key = quality_key(method, lr, seed, phase)
    if key in context.recorded:
        return _finite(context.recorded[key]["final_val"])
    workload, steps = context.workload, context.workload.steps
    trainee = build(method, context, seed, lr)
    order = workloads.batch_order(context.data[0].shape[0], workload.batch_size, steps, seed)
    run: dict[str, Any] = {"steps": [], "val": [], "held_out": [], "train_loss": []}
    running: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        trainee.set_lr(lr * pr.lr_factor(step, steps, workload.warmup_fraction, "cosine"))
        running.append(trainee.step(context.batch(order, step)))
        if not math.isfinite(running[-1]):
            run["diverged_at"] = step + 1
            break
        if step + 1 == steps:
            if method.overlap_steps or method.num_fragments > 1:
                run["before_syncs_applied"] = context.evaluate(trainee)
            trainee.end_training()
        if (step + 1) % workload.eval_every == 0 or step + 1 == steps:
            losses = context.evaluate(trainee)
            run["steps"].append(step + 1)
            run["val"].append(losses["val"])
            run["held_out"].append(losses["held_out"])
            run["train_loss"].append(statistics.fmean(running))  # process 0's share of the batches
            running = []
    # A loss that is not finite on one process stops that one only; the others fail in their next collective.
    run["wall_s"] = time.perf_counter() - start
    ended = bool(run["val"]) and "diverged_at" not in run
    final = {name: run[name][-1] if ended else math.inf for name in ("val", "held_out")}
    context.record({
        "key": key, "part": "quality", "phase": phase, "method": method.name, **dataclasses.asdict(method), "lr": lr,
        "seed": seed, **notes, "world_size": context.plan.world_size, "final_val": final["val"],
        "final_held_out": final["held_out"], **run,
    })  # fmt: skip
    return _finite(context.from_rank0(final["val"]))


def _finite(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else math.inf


MEASURES = {"bytes": measure_bytes, "speed": measure_speed, "quality": measure_quality}


def load_windows(workload: pr.Workload, plan: Plan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(train windows, {"val": the validation windows, "held_out": the plan's held-out windows}) of the corpus."""
    train, val = pr.load_token_windows(workload)
    held_out = workloads.held_out_windows(
        workload.vocab_size, workload.seq_len, workload.val_windows, plan.held_out_windows, workload.corpus,
        workload.max_train_chars,
    )  # fmt: skip
    return train, {"val": val, "held_out": held_out}


def rank_main(
    rank: int, meter: Meter, parts: Sequence[str], plan: Plan, workload: pr.Workload, entries: dict, out: Path
) -> None:
    """One process of the launch: the requested parts in order; process 0 records every result as it comes, each
    with where it ran (`report.environment`: a record resumed on another machine keeps each run's own)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(message)s")
    results = results_file(out, plan, workload) if rank == 0 else None
    environment = report.environment() if rank == 0 else None

    def record(run: dict[str, Any]) -> None:
        if results is not None:
            results.add({**run, "environment": environment})
            write_report(results.data, out)
            logger.info("%s done", run["key"])

    recorded = {run["key"]: run for run in from_rank0(results.runs if results is not None else None, meter)}
    context = Context(rank, meter, plan, workload, entries, load_windows(workload, plan), recorded, record)
    for part in parts:
        MEASURES[part](context)


# ---- the record and the report ----


def results_file(out: Path, plan: Plan, workload: pr.Workload) -> report.ResultsFile:
    """The record under ``out``: its workload (with the processes and the held-out windows, so that a record of
    another split is refused) and plan, the environment of this launch (each run holds its own)."""
    workload_fields = {**dataclasses.asdict(workload), "world_size": plan.world_size,
                       "held_out_windows": plan.held_out_windows}  # fmt: skip
    return report.ResultsFile(
        out / f"{STEM}.json", workload_fields, dataclasses.asdict(plan), report.environment(num_threads=1)
    )


def check_record(runs: list[dict[str, Any]], plan: Plan) -> None:
    """Refuse to resume a record whose quality runs would change phase under ``plan``: a run recorded at a tuning
    seed that is now a final seed, or the reverse (or one recorded with no phase)."""
    roles = {TUNE: set(plan.tune_seeds), FINAL: set(plan.final_seeds)}
    for run in runs:
        if run["part"] == "quality" and run.get("seed") not in roles.get(run.get("phase"), ()):
            raise ValueError(
                f"Invalid --tune-seeds / --final-seeds for this record: its run {run['key']} is a "
                f"{run.get('phase')} run at seed {run.get('seed')}, which is not among this plan's {run.get('phase')} "
                "seeds (pass the seeds it was made with, or another --out)"
            )


def _kb(value: float) -> str:
    return f"{value / 1e3:,.1f}"


def bytes_table(runs: list[dict[str, Any]]) -> str:
    rows = [run for run in runs if run["part"] == "bytes"]
    ddp = next((run for run in rows if run["method"] == DDP_ADAMW.name), None)
    header = ["method", "processes per worker", "collectives / step", "payload / step (KB)", "sent / step (KB)",
              "between workers / step: payload (KB)", "between workers / step: sent (KB)", "sent vs DDP",
              "sent vs float32 outer", "optimizer's count / step (KB)", "peak of one step between workers (KB)",
              "peak / model"]  # fmt: skip
    table = []
    sent = "between_workers_sent_per_step"
    for run in rows:
        ratio = run[sent] / ddp[sent] if ddp else math.nan
        float32 = next((r for r in rows if _same_but_float32(r, run)), None)
        vs_float32 = f"{run[sent] / float32[sent]:.4f}" if float32 else ""
        counted = run.get("optimizer_outer_bytes_per_step")
        table.append([
            run["method"], run["island_size"], f"{run['collectives_per_step']:.3f}", _kb(run["payload_per_step"]),
            _kb(run["sent_per_step"]), _kb(run["between_workers_per_step"]), _kb(run[sent]),
            f"{ratio:.4f} (1/{1 / ratio:.1f})", vs_float32, _kb(counted) if counted else "",
            _kb(run["peak_between_workers_step_payload"]),
            f"{run['peak_between_workers_step_payload'] / run['model_bytes']:.3f}",
        ])  # fmt: skip
    return report.markdown_table(header, table, right=range(1, len(header)))


def _same_but_float32(candidate: dict[str, Any], run: dict[str, Any]) -> bool:
    """Whether ``candidate`` is the float32-outer row of ``run``'s compressed DiLoCo (never where ``run`` is one)."""
    if run.get("outer_dtype", "float32") == "float32" or candidate.get("outer_dtype", "float32") != "float32":
        return False
    same = ("family", "inner_steps", "num_workers", "num_fragments", "outer")
    return all(candidate.get(key) == run.get(key) for key in same)


def speed_table(runs: list[dict[str, Any]]) -> str:
    rows = [run for run in runs if run["part"] == "speed"]
    if not rows:
        return ""
    header = ["link", "method", "steps/s, median (range)", "vs DDP: ratio of medians", "median of round ratios",
              "link time / step (ms, model)"]  # fmt: skip
    table = []
    for run in rows:
        for name, rates in run["steps_per_s"].items():
            table.append([
                run["link_text"], name, f"{run['median_steps_per_s'][name]:.2f} ({min(rates):.1f}-{max(rates):.1f})",
                f"{run['ratio_to_ddp'][name]:.2f}x", f"{run['median_round_ratio_to_ddp'][name]:.2f}x",
                f"{run['modelled_link_s_per_step'][name] * 1e3:.1f}",
            ])  # fmt: skip
    return report.markdown_table(header, table, right=range(2, len(header)))


#: A quality run's configuration: its `Method` fields and its lr (`_config`).
METHOD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Method)}


def _config(run: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded quality run's configuration: its `Method` fields (the outer pair a tuple) and its lr."""
    config = {name: run.get(name, default) for name, default in METHOD_DEFAULTS.items()}
    config["outer"] = tuple(config["outer"]) if config["outer"] else None
    return {**config, "lr": run["lr"]}


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values and all(map(math.isfinite, values)) else math.inf


def final_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The final runs, one row per configuration in the order they ran: its runs by seed, their final held-out losses
    (what the report reports; inf where a run diverged), the mean of those, its role (pick, variant, check)."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for run in runs:
        if run["part"] == "quality" and run.get("phase") == FINAL:
            groups.setdefault((run["method"], run["lr"]), []).append(run)
    rows = []
    for mine in groups.values():
        mine = sorted(mine, key=lambda run: run["seed"])
        finals = [_finite(run["final_held_out"]) for run in mine]
        rows.append({
            "method": mine[0]["method"], "lr": mine[0]["lr"], "role": mine[0].get("role", "pick"),
            "config": _config(mine[0]), "runs": mine, "seeds": [run["seed"] for run in mine], "finals": finals,
            "mean": _mean(finals),
        })  # fmt: skip
    return rows


def tuning_summary(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per tuned lattice, in the order it was searched: every configuration evaluated (its values, its score: the
    mean final validation loss over the tuning seeds that ran it, the held-out loss beside), the pick among those
    every tuning seed ran, whether it is bracketed on each axis (`bracketing`), how many configurations there are."""
    tune_seeds = sorted(data["plan"]["tune_seeds"])
    groups: dict[str, dict[tuple[float, ...], list[dict[str, Any]]]] = {}
    for run in data["runs"]:
        if run["part"] == "quality" and run.get("phase") == TUNE:
            groups.setdefault(run["lattice"], {}).setdefault(tuple(run["point"].values()), []).append(run)
    summary = []
    for key, configs in groups.items():
        lattice = Lattice.from_record(data["plan"]["lattices"][key])
        entries, scores = [], {}
        for mine in configs.values():
            point = lattice.point(mine[0]["point"])
            complete = sorted(run["seed"] for run in mine) == tune_seeds
            score = _mean([_finite(run["final_val"]) for run in mine])
            entries.append({
                "point": point, "values": mine[0]["point"], "method": mine[0]["method"], "lr": mine[0]["lr"],
                "config": _config(mine[0]), "runs": mine, "complete": complete, "score": score,
                "held_out": _mean([_finite(run["final_held_out"]) for run in mine]),
            })  # fmt: skip
            if complete:
                scores[point] = score
        pick = best_point(scores) if scores else None
        summary.append({
            "key": key, "lattice": lattice, "configs": entries, "scores": scores, "pick": pick, "count": len(scores),
            "bracketing": bracketing(lattice, scores, pick) if pick is not None else {},
        })  # fmt: skip
    return summary


def between_workers_per_step(runs: list[dict[str, Any]], quality_run: dict[str, Any]) -> float:
    """The bytes each process sent between workers per step that the bytes part counted for the method of
    ``quality_run``: the bytes run of the same family, H, M, P and outer dtype (mu_x, mu_y and the outer pair change
    no byte); nan where none was counted."""
    same = ("family", "inner_steps", "num_workers", "num_fragments", "outer_dtype")
    for run in runs:
        if run["part"] == "bytes" and all(run.get(key, "float32") == quality_run.get(key, "float32") for key in same):
            return run["between_workers_sent_per_step"]
    return math.nan


def references(row: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The final rows ``row`` is compared with, seed by seed: DDP-AdamW; GPA across workers: the DiLoCo pick it is
    matched to (its H, lr and outer pair); a compressed outer all-reduce: the same at float32; an overlapped sync: the
    same blocking; blocking streaming DiLoCo: the same DiLoCo with one fragment; a check of another outer lr: the pick
    at its own."""
    mine = row["config"]

    def like(**changes: Any) -> list[dict[str, Any]]:
        wanted = {**mine, **changes}
        return [other for other in rows if other is not row and other["config"] == wanted]

    found = [other for other in rows if other["method"] == DDP_ADAMW.name and other is not row]
    if mine["family"] == "gpa_diloco":
        found += like(family="diloco", mu_x=None, mu_y=None)
    if mine["outer_dtype"] != "float32":
        found += like(outer_dtype="float32")
    if mine["overlap_steps"]:
        found += like(overlap_steps=0, overlap_alpha=0.0)
    elif mine["num_fragments"] > 1:
        found += like(num_fragments=1)
    if row["role"] == "check":
        found += [
            other for other in rows if other["role"] == "pick" and other["config"]["outer"] is not None
            and other["config"] == {**mine, "outer": (other["config"]["outer"][0], mine["outer"][1])}
        ]  # fmt: skip
    return found


def comparisons(runs: list[dict[str, Any]], final_seeds: Sequence[int]) -> list[dict[str, Any]]:
    """Every final row that ran every final seed against each of its `references` that did: the per-seed
    differences of final held-out loss and their mean's 95% Student-t interval (None where a run diverged)."""
    rows = [row for row in final_rows(runs) if row["seeds"] == sorted(final_seeds)]
    found = []
    for row in rows:
        for ref in references(row, rows):
            mine = {run["seed"]: _finite(run["final_held_out"]) for run in row["runs"]}
            theirs = {run["seed"]: _finite(run["final_held_out"]) for run in ref["runs"]}
            diffs = list(paired_differences(mine, theirs).values())
            interval = mean_interval(diffs) if all(map(math.isfinite, diffs)) else None
            found.append({"row": row, "ref": ref, "diffs": diffs, "interval": interval})
    return found


def _verdict(interval: Interval | None) -> str:
    if interval is None:
        return "a run diverged"
    return ("yes: lower" if interval.high < 0 else "yes: higher") if interval.decided else "no"


def paired_table(runs: list[dict[str, Any]], final_seeds: Sequence[int]) -> str:
    """`comparisons` as a table: the mean of the per-seed differences with its 95% interval, the relative gap,
    whether the interval decides the sign, and whether it stays decided over all the comparisons together."""
    found = comparisons(runs, final_seeds)
    header = ["method", "against", "seeds", "final held-out loss difference, mean [95% CI]", "relative", "decided",
              f"decided over all {len(found)} (Holm)"]  # fmt: skip
    table = []
    for f, together in zip(found, decided_together([f["interval"] for f in found])):
        interval, ref = f["interval"], f["ref"]
        table.append([
            f["row"]["method"], ref["method"], len(f["diffs"]), interval.text() if interval else "",
            f"{interval.mean / ref['mean']:+.2%}" if interval else "", _verdict(interval),
            "yes" if together else "no",
        ])  # fmt: skip
    return report.markdown_table(header, table, right=(2, 3, 4)) if table else ""


def _tuning_scores(summary: list[dict[str, Any]]) -> dict[str, float]:
    """The tuning score of every configuration evaluated, by `_config` (as JSON)."""
    return {json.dumps(entry["config"]): entry["score"] for lattice in summary for entry in lattice["configs"]}


def quality_table(data: Mapping[str, Any]) -> str:
    """Every final row: its bytes between workers, its lr, the final seeds it ran, their held-out losses (mean,
    spread, each), against DDP-AdamW, its loss on the validation windows (the windows of the tuning) at the same
    seeds, its own tuning score (at the tuning seeds; picks only) and its wall time."""
    runs = data["runs"]
    rows = final_rows(runs)
    if not rows:
        return ""
    ddp = next((row for row in rows if row["method"] == DDP_ADAMW.name), None)
    scores = _tuning_scores(tuning_summary(data))
    header = ["method", "role", "sent between workers / step (KB)", "lr", "seeds", "held-out final loss, mean",
              "spread (max - min)", "each seed", "vs DDP-AdamW", "validation windows, mean", "tuning score",
              "wall s / run"]  # fmt: skip
    table = []
    for row in rows:
        score = scores.get(json.dumps(row["config"]))
        table.append([
            row["method"], row["role"], _kb(between_workers_per_step(runs, row["runs"][0])), f"{row['lr']:g}",
            " ".join(map(str, row["seeds"])), f"{row['mean']:.4f}", f"{max(row['finals']) - min(row['finals']):.4f}",
            " / ".join(f"{v:.4f}" for v in row["finals"]), f"{row['mean'] - ddp['mean']:+.4f}" if ddp else "",
            f"{_mean([_finite(run['final_val']) for run in row['runs']]):.4f}",
            f"{score:.4f}" if score is not None else "",
            f"{statistics.fmean(run['wall_s'] for run in row['runs']):.0f}",
        ])  # fmt: skip
    return report.markdown_table(header, table, right=(2, 3, 5, 6, 8, 9, 10, 11))


def _values_text(values: Mapping[str, float]) -> str:
    return ", ".join(f"{axis} {value:g}" for axis, value in values.items())


def counts_table(summary: list[dict[str, Any]], budget: int) -> str:
    """Per tuned method: its axes, the configurations it evaluated (every tuning seed), its pick and whether that is
    bracketed on each axis."""
    header = ["tuned method (lattice)", "axes", "configurations evaluated", "of budget", "pick (tuning score)",
              "bracketed"]  # fmt: skip
    table = []
    for lattice in summary:
        pick = lattice["pick"]
        picked = f"{_values_text(lattice['lattice'].values(pick))} ({lattice['scores'][pick]:.4f})" if pick else ""
        brackets = "; ".join(f"{axis}: {verdict}" for axis, verdict in lattice["bracketing"].items())
        table.append([lattice["key"], ", ".join(lattice["lattice"].axes), lattice["count"], budget, picked, brackets])
    return report.markdown_table(header, table, right=(2, 3))


def grid_table(lattice: dict[str, Any]) -> str:
    """One lattice's configurations in the order evaluated: values, score, held-out loss (same runs), against the
    pick; the pick marked."""
    header = ["#", "configuration", "method", "lr", "tuning seeds", "score (validation windows)",
              "held-out (same runs)", "minus the pick's score"]  # fmt: skip
    pick = lattice["pick"]
    best = lattice["scores"].get(pick, math.nan) if pick is not None else math.nan
    table = []
    for i, entry in enumerate(lattice["configs"], 1):
        mark = " **(pick)**" if entry["point"] == pick else ""
        seeds = " ".join(str(run["seed"]) for run in entry["runs"]) + ("" if entry["complete"] else " (partial)")
        table.append([
            i, _values_text(entry["values"]) + mark, entry["method"], f"{entry['lr']:g}", seeds,
            f"{entry['score']:.4f}", f"{entry['held_out']:.4f}", f"{entry['score'] - best:+.4f}",
        ])  # fmt: skip
    return report.markdown_table(header, table, right=(0, 3, 5, 6, 7))


def outer_lr_table(summary: list[dict[str, Any]]) -> str:
    """At each H, DiLoCo's pick against the configurations that differ from it in the outer lr only: the difference
    of final validation loss at each tuning seed, with its 95% interval where there are two seeds or more."""
    header = ["lattice", "pick's outer lr", "against outer lr", "tuning seeds", "difference (validation windows)",
              "decided"]  # fmt: skip
    table = []
    for lattice in summary:
        pick = lattice["pick"]
        if pick is None or "outer_lr" not in lattice["lattice"].axes:
            continue
        axis = lattice["lattice"].axes.index("outer_lr")
        mine = next(entry for entry in lattice["configs"] if entry["point"] == pick)
        for entry in lattice["configs"]:
            point = entry["point"]
            if (
                not entry["complete"]
                or point == pick
                or point[:axis] + point[axis + 1 :] != pick[:axis] + pick[axis + 1 :]
            ):
                continue
            theirs = {run["seed"]: _finite(run["final_val"]) for run in entry["runs"]}
            ours = {run["seed"]: _finite(run["final_val"]) for run in mine["runs"]}
            diffs = list(paired_differences(theirs, ours).values())
            if len(diffs) >= 2 and all(map(math.isfinite, diffs)):
                interval = mean_interval(diffs)
                text, verdict = interval.text(), _verdict(interval)
            else:
                text, verdict = " / ".join(f"{d:+.4f}" for d in diffs), "no: one tuning seed, no interval"
            table.append([lattice["key"], f"{mine['values']['outer_lr']:g}", f"{entry['values']['outer_lr']:g}",
                          len(diffs), text, verdict])  # fmt: skip
    return report.markdown_table(header, table, right=(1, 2, 3, 4)) if table else ""


def environment_table(data: dict[str, Any]) -> str:
    """Each machine and software the runs were made on (`report.environment`), with how many runs of each part."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in data["runs"]:
        groups.setdefault(json.dumps(report.environment_of(data, run), sort_keys=True), []).append(run)
    header = ["CPU", "torch's CPU kernels", "Python", "torch", "threads / process", "commit", "runs"]
    table = []
    for key, mine in groups.items():
        env = json.loads(key) or {}
        parts = ", ".join(f"{part} {sum(run['part'] == part for run in mine)}" for part in PARTS
                          if any(run["part"] == part for run in mine))  # fmt: skip
        table.append([env.get("cpu", "not recorded"), env.get("cpu_capability", ""), env.get("python", ""),
                      env.get("torch", ""), env.get("num_threads", ""), env.get("commit", ""), parts])  # fmt: skip
    return report.markdown_table(header, table)


def decisions_text(data: Mapping[str, Any], summary: list[dict[str, Any]]) -> str:
    """What the record decides and what it does not, in sentences: each paired comparison over the final seeds
    whose interval excludes zero, each one whose does not, the picks that are not bracketed."""
    found = comparisons(data["runs"], data["plan"]["final_seeds"])
    lines = []
    for decided in (True, False):
        chosen = [f for f in found if f["interval"] is not None and f["interval"].decided == decided]
        if chosen:
            lines.append("Decided (the 95% interval excludes zero):" if decided else
                         "Not decided (the interval holds zero: no difference of that size is shown, none is ruled "
                         "out):")  # fmt: skip
            lines += [f"- {f['row']['method']} minus {f['ref']['method']}: {f['interval'].text()}" for f in chosen]
            lines.append("")
    diverged = [f for f in found if f["interval"] is None]
    lines += [f"- {f['row']['method']} against {f['ref']['method']}: a run diverged" for f in diverged]
    together = [f for f, verdict in zip(found, decided_together([f["interval"] for f in found])) if verdict]
    if any(f["interval"] is not None and f["interval"].decided for f in found):
        lines.append(
            f"Each interval above is at 95% on its own. Read together, with a 5% chance of any false decision among "
            f"all {len(found)} comparisons (Holm's step-down), "
            + ("these stay decided:" if together else "none stays decided.")
        )
        lines += [f"- {f['row']['method']} minus {f['ref']['method']}: {f['interval'].text()}" for f in together]
        lines.append("")
    loose = [lattice for lattice in summary if any(v != "yes" for v in lattice["bracketing"].values())]
    if loose:
        lines.append("Picks not bracketed on every axis (a better setting may lie past them):")
        lines += [f"- {lattice['key']}: " + "; ".join(f"{axis}: {verdict}" for axis, verdict in
                  lattice["bracketing"].items() if verdict != "yes") for lattice in loose]  # fmt: skip
        lines.append("")
    if len(data["plan"]["tune_seeds"]) < 2:
        lines.append(
            "With one tuning seed, the differences between the configurations of a grid (the outer lr's "
            "included) have no interval: the tuning picks, it does not decide. What the picks give is "
            "decided only by the final seeds above (`check` rows: DiLoCo's pick at another outer lr)."
        )
    return "\n".join(lines)


def report_text(data: dict[str, Any]) -> str:
    workload, runs, plan = data["workload"], data["runs"], data["plan"]
    world = workload["world_size"]
    spec = pr.Workload(**{k: v for k, v in workload.items() if k in {f.name for f in dataclasses.fields(pr.Workload)}})
    model = next((run["model_bytes"] for run in runs if run["part"] == "bytes"), None)
    parts = [
        f"# DiLoCo across workers against DDP: {world} CPU processes over gloo\n",
        f"Model: the paper bench's Llama (d={spec.hidden_size}, {spec.num_layers} layers, vocabulary "
        f"{spec.vocab_size}, seq {spec.seq_len})"
        + (f", {model:,} bytes of fp32 parameters" if model else "")
        + f"; global batch {spec.batch_size} windows ({spec.batch_size // world} per process); one thread per "
        "process, the processes sharing the machine's cores. Every collective of every process is counted by the "
        "metered gloo backend (`benchmarks/ranks.py`): the payload is the bytes of the tensors a process hands to a "
        "collective, `sent` what it sends to the others in a ring (2 (n - 1) / n of an all-reduce's payload over n "
        "processes, n - 1 times an all-gather's, an all-to-all's less its own part), `between workers` the "
        "collectives whose group spans more than one worker (island); the ratios compare what was sent.\n",
        "## Where it ran\n",
        "Each run records the machine and the software it ran on (`benchmarks.report.environment`): another CPU "
        "(another instruction set for torch's kernels) gives other bits.\n",
        environment_table(data) + "\n",
    ]
    if [run for run in runs if run["part"] == "bytes"]:
        steps = next(run["steps"] for run in runs if run["part"] == "bytes")
        parts += [
            f"## Bytes per training step (process 0, {steps} steps after {WARMUP_STEPS} warm-up steps)\n",
            bytes_table(runs) + "\n",
        ]
    text = speed_table(runs)
    if text:
        run = next(run for run in runs if run["part"] == "speed")
        parts += [
            f"## Steps per second over a simulated link ({run['steps_per_round']} steps a round, median of "
            f"{run['rounds']} interleaved rounds)\n",
            "No collective of more than one process completes sooner than latency + sent bytes / bandwidth after "
            "it was issued (`benchmarks.ranks.Link`): a blocking one pays all of it, streaming DiLoCo's overlapped "
            "sync only what its tau inner steps meanwhile did not cover. The last column is the time the link model "
            "charged per step, overlapped or not (the rest of a step is compute and gloo on loopback, which the "
            "processes' sharing of the cores makes noisy: the range is over the rounds).\n",
            text + "\n",
        ]
    summary = tuning_summary(data)
    text = quality_table(data)
    if text or summary:
        tune_seeds, final_seeds = plan["tune_seeds"], plan["final_seeds"]
        parts += [
            f"## Loss at the same token budget ({spec.steps} steps, {spec.steps * spec.batch_size * spec.seq_len:,} "
            "tokens)\n",
            f"The paper bench's recipe (betas {pr.BETAS['adamw']}, weight decay {spec.weight_decay} on every tensor, "
            f"clipping {spec.grad_clip}, {spec.warmup_fraction:.0%} warmup then cosine; GPA-AdamW's mu_y "
            f"{plan['gpa_mu_y']}). Settings are picked at the tuning seed(s) {', '.join(map(str, tune_seeds))} on the "
            f"{spec.val_windows} validation windows; every figure below comes from the final seeds "
            f"{', '.join(map(str, final_seeds))} on {workload['held_out_windows']} held-out windows of the validation "
            "split, none of those (`benchmarks.workloads.held_out_windows`). Every tuned method evaluated the same "
            f"number of configurations ({plan['tune_budget']}, each at every tuning seed; table below): DDP-AdamW "
            "its lr; DiLoCo its lr, outer lr and outer momentum; GPA across workers (`hf_gpa.optim.GPADiLoCo`: "
            "DiLoCo's inner AdamW, H and lr, the outer step GPA's primal averaging) its (mu_x, mu_y) at its "
            "DiLoCo's pick's lr, with the outer lr gamma (1 + mu) / (1 - mu_x mu_y) of that pick's outer pair "
            "(gamma, mu) (its first move of the restart point that DiLoCo's): it reuses DiLoCo's tuning of those. "
            "Roles: `pick` a tuned method's pick; `variant` an untuned variant of a DiLoCo pick (outer all-reduce "
            "compressed, streaming blocking or overlapped); `check` a DiLoCo pick at another outer lr. DiLoCo: every "
            "process a worker, each with its share of the global batch. The loss is that of the evaluation weights "
            "(DiLoCo's outer weights, GPA's x), at the last step after the Trainer's end of training "
            "(`synchronize()`: an overlapped sync still in flight applied, a streaming run's partial fragment "
            "periods synchronised); the curves before the last step show the weights as a user sees them then. "
            "`validation windows` is the same final runs on the tuning's windows; `tuning "
            "score` the pick's own at the tuning seeds: their gap is what the picking flattered it by.\n",
            text + "\n",
        ]
        text = paired_table(runs, final_seeds)
        if text:
            parts += [
                f"### Paired differences over the final seeds {', '.join(map(str, final_seeds))}\n",
                "Each final row that ran every final seed, seed by seed against DDP-AdamW and against what it "
                "varies (GPA across workers against the DiLoCo pick it is matched to, a compressed outer all-reduce "
                "against float32, an overlapped sync against the blocking one, blocking streaming against one "
                "fragment, a check against the pick): every seed gives the methods the same initial weights and "
                f"batches. A negative difference is a lower loss. With {len(final_seeds)} seeds t = "
                f"{t_quantile(0.975, len(final_seeds) - 1):.2f}.\n",
                text + "\n",
                "### What the data decides, and what it does not\n",
                decisions_text(data, summary) + "\n",
            ]
        if summary:
            parts += [
                "### Tuning: the configurations each method evaluated\n",
                f"Each tuned method evaluates {plan['tune_budget']} configurations (`benchmarks.diloco_workers."
                "next_point`): the start of its lattice, then one at a time the untried point nearest the best so "
                "far (past an edge while the best lies on it, around it after). Bracketed: both neighbours of the "
                "pick on that axis evaluated (and no lower).\n",
                counts_table(summary, plan["tune_budget"]) + "\n",
            ]
            text = outer_lr_table(summary)
            if text:
                parts += [
                    "### DiLoCo's outer lr at the tuning seeds\n",
                    "DiLoCo's pick against the configurations that differ from it in the outer lr only (a positive "
                    "difference: that outer lr is worse). These are the tuning's own runs: the `check` rows above "
                    "answer on the final seeds.\n",
                    text + "\n",
                ]
            for lattice in summary:
                parts += [f"#### {lattice['key']}\n", grid_table(lattice) + "\n"]
    return "\n".join(parts)


def write_report(data: dict[str, Any], out: Path) -> None:
    (out / f"{STEM}.md").write_text(report_text(data))
    plot(data, out / f"{STEM}.png")


def plot(data: dict[str, Any], path: Path) -> None:
    """Bytes between workers per step (log scale), steps/s against DDP per link, the mean held-out curve of each
    final row, its final held-out loss against its bytes, and the paired differences with their intervals: one panel
    per part that has results, legends below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = data["runs"]
    rows = final_rows(runs)
    found = comparisons(runs, data["plan"]["final_seeds"])
    panels = [part for part in ("bytes", "speed") if any(run["part"] == part for run in runs)]
    panels += ["quality"] if rows else []
    panels += ["loss against bytes"] if rows and "bytes" in panels else []
    panels += ["paired differences"] if any(f["interval"] for f in found) else []
    if not panels:
        return
    widths = [2.0 if part == "paired differences" else 1.0 for part in panels]  # room for its long labels
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6 * sum(widths), 7.5), squeeze=False, gridspec_kw={"width_ratios": widths}
    )
    for ax, part in zip(axes[0], panels):
        if part == "bytes":
            chosen = [run for run in runs if run["part"] == "bytes"]
            ax.barh(
                [r["method"] for r in chosen][::-1], [r["between_workers_sent_per_step"] / 1e3 for r in chosen][::-1]
            )
            ax.set_xscale("log")
            ax.set_xlabel("sent between workers per step (KB, log)")
        elif part == "speed":
            chosen = [run for run in runs if run["part"] == "speed"]
            names = list(chosen[0]["ratio_to_ddp"])
            width = 0.8 / len(names)
            for i, name in enumerate(names):
                ax.bar([j + i * width for j in range(len(chosen))], [r["ratio_to_ddp"][name] for r in chosen], width,
                       label=name)  # fmt: skip
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(chosen))], [r["link_text"] for r in chosen],
                          fontsize=8)  # fmt: skip
            ax.set_ylabel("steps/s relative to DDP-AdamW")
            ax.legend(fontsize=8)
        elif part == "loss against bytes":
            for row in rows:
                sent = between_workers_per_step(runs, row["runs"][0]) / 1e3
                if math.isfinite(row["mean"]) and math.isfinite(sent):
                    low, high = min(row["finals"]), max(row["finals"])
                    ax.errorbar([sent], [row["mean"]], yerr=[[row["mean"] - low], [high - row["mean"]]], fmt="o",
                                capsize=3, label=row["method"])  # fmt: skip
            ax.set_xscale("log")
            ax.set_xlabel("sent between workers per step (KB, log)")
            ax.set_ylabel("final held-out loss (mean, seed range)")
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
        elif part == "paired differences":
            shown = [f for f in found if f["interval"]]
            for i, f in enumerate(shown):
                interval = f["interval"]
                xerr = [[interval.mean - interval.low], [interval.high - interval.mean]]
                color = "tab:red" if interval.decided else "tab:gray"
                ax.errorbar([interval.mean], [i], xerr=xerr, fmt="o", capsize=3, color=color)
            ax.set_yticks(range(len(shown)), [f"{f['row']['method']}\n  - {f['ref']['method']}" for f in shown],
                          fontsize=6)  # fmt: skip
            ax.invert_yaxis()
            ax.axvline(0.0, color="black", lw=0.8)
            ax.set_xlabel("final held-out loss difference, mean and 95% CI (red: decided)")
        else:
            tails = []
            for row in rows:
                curves = [run["held_out"] for run in row["runs"] if "diverged_at" not in run]
                if curves and all(len(c) == len(curves[0]) for c in curves):
                    mean = [statistics.fmean(values) for values in zip(*curves)]
                    ax.plot(row["runs"][0]["steps"], mean, label=f"{row['method']} (lr {row['lr']:g})")
                    tails += [v for v in mean[len(mean) // 2 :] if math.isfinite(v)]
            if tails:  # the second half of the run, where the methods part
                pad = 0.1 * (max(tails) - min(tails)) or 0.05
                ax.set_ylim(min(tails) - pad, max(tails) + pad)
            ax.set_xlabel("step")
            ax.set_ylabel("held-out loss (mean over the final seeds)")
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
        ax.set_title(part)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the command line ----


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", type=Path, default=Path(f"benchmarks/results/{STEM}"))
    parser.add_argument("--tiny", action="store_true", help="2 processes, a tiny Llama, a few steps: seconds")
    parser.add_argument(
        "--regime",
        action="store_true",
        help="DiLoCo's regime: 4 workers x 16 windows a step, 4,096 steps, every tuned method's lattice around the "
        "earlier seed-0 picks (many core-hours)",
    )
    parser.add_argument("--tune-seeds", type=int, nargs="+", help="the seeds settings are picked on (default: plan's)")
    parser.add_argument(
        "--final-seeds",
        type=int,
        nargs="+",
        help=f"the seeds the picks are reported on: at least {MIN_FINAL_SEEDS}, none a tuning seed (default: plan's)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds for the whole launch (default: plan's)")
    parser.add_argument("--again", action="store_true", help="measure --parts again, replacing their recorded runs")
    parser.add_argument("--report-only", action="store_true", help="rewrite the table and the plot from the JSON")
    args = parser.parse_args(argv)
    if args.tiny and args.regime:
        parser.error("--tiny and --regime are two presets: give one")
    plan, workload = (TINY_PLAN, TINY_WORKLOAD) if args.tiny else (Plan(), WORKLOAD)
    if args.regime:
        plan, workload = REGIME_PLAN, REGIME_WORKLOAD
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout: {args.timeout} (must be > 0 seconds)")
    changes = {"timeout_s": args.timeout, "tune_seeds": args.tune_seeds, "final_seeds": args.final_seeds}
    try:  # the seeds checked (`check_seeds`) before anything runs or is written
        plan = dataclasses.replace(plan, **{k: tuple(v) if isinstance(v, list) else v
                                            for k, v in changes.items() if v is not None})  # fmt: skip
    except ValueError as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    results = results_file(args.out, plan, workload)  # refuses a record of another workload before anything starts
    parts = [part for part in PARTS if part in args.parts]
    if args.report_only:
        write_report(results.data, args.out)
        logger.info("\n%s", report_text(results.data))
        return
    try:
        check_record(results.runs, plan)
    except ValueError as error:
        parser.error(str(error))
    if args.again:
        results.data["runs"] = [run for run in results.runs if run["part"] not in parts]
        results.write()
    load_windows(workload, plan)  # tokenized and cached once, here, rather than by every process
    start = time.perf_counter()
    entries = optimizer_entries(plan, workload)
    run_ranks(rank_main, plan.world_size, (parts, plan, workload, entries, args.out.resolve()),
              timeout_s=plan.timeout_s, collective_timeout_s=COLLECTIVE_TIMEOUT_S)  # fmt: skip
    data = results_file(args.out, plan, workload).data
    write_report(data, args.out)
    logger.info("%s in %.0f s\n%s", " ".join(parts), time.perf_counter() - start, report_text(data))


if __name__ == "__main__":
    main()
