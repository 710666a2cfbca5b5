"""DiLoCo across workers against DDP, measured on CPU processes over gloo: the bytes each process sends per training
step, the steps per second over a simulated slow link, and the validation loss at the same token budget.

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
* **quality**: DDP-AdamW, DiLoCo at each H (M = W workers), GPA across workers at each H with its (mu_x, mu_y)
  sweep (``Plan.gpa_diloco_mus``) and, for reference, GPA-AdamW under DDP, trained on the
  same batches (each step's global batch split over the processes, the same tokens for every method) from the same
  initialisation with the recipe of ``benchmarks.paper_recipe`` (its betas, weight decay, clipping, warmup and
  cosine, DiLoCo's outer lr and momentum); each method's lr is the best of a small grid at the first seed (one
  value: no sweep), then every seed runs at it. The loss is that of the evaluation weights (DiLoCo's outer weights,
  GPA's x) on the fixed validation windows.

Each part runs in one launch of W spawned processes with a timeout; results are written as they come (a resumable
``diloco_workers.json``, ``diloco_workers.md`` and ``diloco_workers.png`` under ``--out``):

    python -m benchmarks.diloco_workers --parts bytes speed        # 4 processes, about 7 minutes
    nohup python -m benchmarks.diloco_workers --parts quality > quality.log 2>&1 &
    python -m benchmarks.diloco_workers --tiny --out outputs/dl    # 2 processes, 1 minute: the whole pipeline
    nohup python -m benchmarks.diloco_workers --regime --parts bytes quality \
        --out benchmarks/results/diloco_regime > regime.log 2>&1 &   # issue 39's regime: many core-hours

The quality table and the "loss against bytes" panel give each method's final loss (mean and seed range) beside the
bytes between workers per step that the bytes part counted for it.

The default quality setting (4 windows per worker a step, 1,024 steps) is outside DiLoCo's regime: with so small a
per-worker batch the workers end about where one of them would alone on its quarter of the data. ``--regime`` runs
the quality part where DiLoCo is meant to run (`REGIME_PLAN`: 16 windows per worker, 4,096 steps, the outer lr and
momentum swept around the scaling-law study's 0.6 / 0.9 at M = 4), into its own ``--out``:

    nice -n 19 python -m benchmarks.diloco_workers --regime --parts quality --out benchmarks/results/diloco_regime
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import paper_recipe as pr
from benchmarks import report, workloads
from benchmarks.paired_stats import mean_interval, paired_differences, t_quantile
from benchmarks.ranks import LOOPBACK, Link, Meter, run_ranks
from hf_gpa.optim import GPADiLoCo, outer_lr_like_diloco

logger = logging.getLogger("diloco_workers")

PARTS = ("bytes", "speed", "quality")
#: The collective timeout of every process group: a process left alone in a collective (another one failed) fails
#: after this; process 0 evaluates while the others wait in their next collective.
COLLECTIVE_TIMEOUT_S = 120.0
STEM = "diloco_workers"


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


@dataclass(frozen=True)
class Plan:
    """What to run: the processes, the methods of each part, the links, the seeds and the lr grids."""

    world_size: int = 4
    #: DiLoCo's H (every part) and streaming DiLoCo's H and P (bytes)
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
    #: GPA across workers (`hf_gpa.optim.GPADiLoCo`) at each H of ``inner_steps``: the (mu_x, mu_y) of its quality
    #: sweep (the first is the recipe's DiLoCo itself, mu_x = mu_y = its momentum: the control), each at the outer lr
    #: whose first move of the restart point is the recipe DiLoCo's (`hf_gpa.optim.outer_lr_like_diloco`)
    gpa_diloco_mus: tuple[tuple[float, float], ...] = (
        (pr.DILOCO_OUTER_MOMENTUM, pr.DILOCO_OUTER_MOMENTUM),
        (0.9, 0.75),
        (0.9, 0.5),
        (0.97, 0.75),
        (0.97, 0.9),
    )

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
    seeds: tuple[int, ...] = (0, 1, 2)
    #: the lr grid of each quality family, swept at the first seed (one value: no sweep): around the paper bench's
    #: best lrs (AdamW and GPA 0.02, single-worker DiLoCo 0.01 at 2,000 steps of the same global batch); DiLoCo's
    #: widened both ways once its best lrs (H = 8: 0.02, H = 32: 0.005) came out at the edges of 0.005-0.02. GPA
    #: across workers runs at the lr of the DiLoCo it is matched to; a family without a grid here is not run
    lrs: dict[str, tuple[float, ...]] = field(
        default_factory=lambda: {
            "adamw": (1e-2, 2e-2, 4e-2),
            "diloco": (2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2),
            "gpa": (1e-2, 2e-2, 4e-2),
        }
    )
    #: how many times a grid may grow past its edge while its best point lies on that edge (lr: by a factor of 2;
    #: DiLoCo's outer lr: by ``outer_lr_step`` at the best pair's momentum), so that every pick is bracketed
    slide: int = 0
    outer_lr_step: float = 0.2
    #: DiLoCo at the first H, at its chosen lr and outer pair, with its outer all-reduce compressed: every seed
    quality_outer_dtypes: tuple[str, ...] = ()
    #: streaming DiLoCo's overlap (tau, alpha) of the speed part (streaming DiLoCo at ``streaming_inner_steps`` with
    #: the most ``fragments``, against the same without overlap) and of the quality part (the same pair there, at that
    #: H's chosen lr and outer pair, every seed); None: neither
    overlap: tuple[int, float] | None = (4, 0.5)
    timeout_s: float = 7200.0
    #: DiLoCo's (outer lr, outer momentum) pairs tried in the quality part at each H's best lr (first seed), beside
    #: the recipe's; the best of them all runs the other seeds. Empty: the recipe's only.
    outer_grid: tuple[tuple[float, float], ...] = ()
    #: Outer momenta tried last, at the first seed, at each H's picked outer lr (lr and outer lr of the pick): whether
    #: the pick's momentum is bracketed. Reported with the grids; not candidates (the pick and what follows from it
    #: stay). Empty: none.
    momentum_probe: tuple[float, ...] = ()

    def bytes_methods(self) -> list[Method]:
        methods = [DDP_ADAMW, Method("gpa", self.gpa_inner_steps)]
        methods += [Method("diloco", h) for h in self.inner_steps]
        methods += [Method("diloco", h, outer_dtype=dtype) for h in self.inner_steps for dtype in self.outer_dtypes]
        methods += [
            Method("gpa_diloco", h, mu_x=mu_x, mu_y=mu_y)
            for h in self.inner_steps
            for mu_x, mu_y in self.gpa_diloco_mus[:1]
        ]
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
        """The methods the quality part tunes (`measure_quality` runs them, and the variants it chooses from them:
        DiLoCo's outer pair, GPA across workers' (mu_x, mu_y), the compressed and streaming rows)."""
        methods = [DDP_ADAMW, *(Method("diloco", h) for h in self.inner_steps)]
        return methods + ([Method("gpa", self.gpa_inner_steps)] if "gpa" in self.lrs else [])


#: The quality budget: the paper bench's tiny Llama, 16 windows of 64 tokens a step (4 per process on 4 processes),
#: 1,024 steps (1.05M tokens, a multiple of every H), evaluated every 128 steps on 128 fixed validation windows.
WORKLOAD = pr.Workload(batch_size=16, steps=1024, eval_every=128, val_windows=128)
TINY_WORKLOAD = dataclasses.replace(pr.QUICK_WORKLOAD, steps=8, eval_every=4)
TINY_PLAN = Plan(
    world_size=2, inner_steps=(2, 4), streaming_inner_steps=4, fragments=(2,), islands=None, gpa_inner_steps=2,
    bytes_steps=4, speed_steps=4, speed_rounds=1, links=(LOOPBACK, Link("WAN", latency_s=0.001, bandwidth=100e6)),
    gpa_diloco_mus=((0.9, 0.5),), seeds=(0, 1),
    lrs={"adamw": (1e-2, 2e-2), "diloco": (1e-2,), "gpa": (1e-2,)}, timeout_s=300.0,
    outer_grid=((0.6, 0.9),), quality_outer_dtypes=("int8",), overlap=(1, 0.5), momentum_probe=(0.5,),
)  # fmt: skip
#: DiLoCo in the regime it is built for: 4 workers with 16 windows (1,024 tokens) each a step, 4,096 steps (16.8M
#: tokens, 512 outer steps at H = 8), evaluated every 256 steps (a multiple of every H: at outer-step boundaries).
#: Every grid slides until its pick is bracketed. The outer grid holds the DiLoCo scaling-law study's values at M = 4
#: (Charles et al. 2025, Table 4: Nesterov momentum 0.9, outer lr about 0.6) between 0.4 and 0.8, beside the
#: recipe's 0.75 / 0.75 (single worker); GPA across workers sweeps (mu_x, mu_y) off the diagonal (on it, it is the
#: DiLoCo it is matched to); DiLoCo at H = 8 with its outer all-reduce in bfloat16 and in int8 (issue 40's cost in
#: loss). One run takes about 7 CPU-minutes (4 processes x ~24 ms of CPU per 16-window step, 4,096 steps, plus
#: gloo), about 3.5 minutes of wall on 2 cores: the plan ran 61 runs (55, then the momentum probe's 6), in this
#: order (what matters first).
REGIME_WORKLOAD = pr.Workload(batch_size=64, steps=4096, eval_every=256, val_windows=128)
REGIME_PLAN = Plan(
    world_size=4, inner_steps=(8, 32), seeds=(0, 1, 2),
    lrs={"adamw": (1e-2, 2e-2, 4e-2), "diloco": (5e-3, 1e-2, 2e-2)}, slide=2,
    outer_grid=((0.4, 0.9), (0.6, 0.9), (0.8, 0.9)),
    gpa_diloco_mus=((0.9, 0.5), (0.9, 0.75), (0.97, 0.75), (0.97, 0.9)),
    quality_outer_dtypes=("bfloat16", "int8"), timeout_s=86400.0, momentum_probe=(0.6, 0.8, 0.95),
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

    def evaluation_loss(self, val: torch.Tensor, workload: pr.Workload) -> float:
        """The loss of the evaluation weights (DiLoCo's outer weights, GPA's x, else the parameters)."""
        averaged = hasattr(self.optimizer, "eval")
        if averaged:
            self.optimizer.eval()
        try:
            return pr.evaluate(self.model, val, workload.batch_size, workload)
        finally:
            if averaged:
                self.optimizer.train()


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
    #: (train windows, validation windows) of the corpus
    data: tuple[torch.Tensor, torch.Tensor]
    #: the runs recorded before (a resumed record), by key
    recorded: dict[str, dict[str, Any]]
    #: records a finished run (process 0 writes it; the others do nothing)
    record: Callable[[dict[str, Any]], None]

    def from_rank0(self, value: Any) -> Any:
        """``value`` of process 0, on every process (a collective, neither counted nor delayed)."""
        return from_rank0(value, self.meter)

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
    """Every quality method tuned at the first seed (`tuned`), then every other seed at its pick, in the order that
    answers the most first: DDP-AdamW; then at each H, DiLoCo, GPA across workers matched to that DiLoCo, and at the
    first H DiLoCo with its outer all-reduce compressed; streaming DiLoCo blocking and overlapped; GPA-AdamW under
    DDP; last, the momentum probe of each H's DiLoCo pick."""
    plan = context.plan
    every_seed(context, *tuned(context, DDP_ADAMW))
    picks = {}
    for h in plan.inner_steps:
        picks[h] = every_seed(context, *tuned(context, Method("diloco", h)))
        if plan.gpa_diloco_mus:
            every_seed(context, *tuned_gpa_diloco(context, *picks[h]))
        for dtype in plan.quality_outer_dtypes if h == plan.inner_steps[0] else ():
            diloco, lr = picks[h]
            every_seed(context, dataclasses.replace(diloco, outer_dtype=dtype), lr, tuned_here=False)
    if plan.streaming_inner_steps in picks:
        diloco, lr = picks[plan.streaming_inner_steps]
        for method in plan.overlap_pair(diloco):
            every_seed(context, method, lr, tuned_here=False)
    if "gpa" in plan.lrs:
        every_seed(context, *tuned(context, Method("gpa", plan.gpa_inner_steps)))
    for diloco, lr in picks.values():
        outer_lr, picked = diloco.outer_pair
        for momentum in plan.momentum_probe:
            if momentum != picked:
                quality_run(context, dataclasses.replace(diloco, outer=(outer_lr, momentum)), lr, plan.seeds[0])


def every_seed(context: Context, method: Method, lr: float, tuned_here: bool = True) -> tuple[Method, float]:
    """``method`` at ``lr`` on every seed after the first (on every seed where it was not ``tuned_here``)."""
    for seed in context.plan.seeds[1 if tuned_here else 0 :]:
        quality_run(context, method, lr, seed)
    return method, lr


def tuned(context: Context, method: Method) -> tuple[Method, float]:
    """``method``'s lr, the best of its family's grid at the first seed, the grid doubled or halved past an edge
    while the best lies on it (at most ``plan.slide`` times); for DiLoCo then each outer pair of the plan at that lr,
    the best pair's outer lr slid the same way (by ``plan.outer_lr_step``). Every process returns the same pick."""
    plan, first = context.plan, context.plan.seeds[0]
    finals = {lr: quality_run(context, method, lr, first) for lr in plan.lrs[method.family]}
    for _ in range(plan.slide):
        best = min(finals, key=lambda lr: finals[lr])
        if best not in (min(finals), max(finals)) or len(finals) < 2:
            break
        lr = best / 2 if best == min(finals) else best * 2
        finals[lr] = quality_run(context, method, lr, first)
    lr = min(finals, key=lambda lr: finals[lr])
    if method.family != "diloco" or not plan.outer_grid:
        return method, lr
    candidates = {method: finals[lr]}
    for pair in plan.outer_grid:
        variant = dataclasses.replace(method, outer=pair)
        candidates[variant] = quality_run(context, variant, lr, first)
    for _ in range(plan.slide):
        best = min(candidates, key=lambda m: candidates[m])
        if best.outer is None:
            break
        outer_lr, momentum = best.outer
        row = sorted(m.outer[0] for m in candidates if m.outer is not None and m.outer[1] == momentum)
        if len(row) < 2 or row[0] < outer_lr < row[-1]:
            break
        step = plan.outer_lr_step if outer_lr == row[-1] else -plan.outer_lr_step
        if outer_lr + step <= 0:
            break
        variant = dataclasses.replace(method, outer=(round(outer_lr + step, 6), momentum))
        candidates[variant] = quality_run(context, variant, lr, first)
    return min(candidates, key=lambda m: candidates[m]), lr


def tuned_gpa_diloco(context: Context, diloco: Method, lr: float) -> tuple[Method, float]:
    """GPA across workers at ``diloco``'s H and lr, its outer lr matched to ``diloco``'s outer pair: the best (mu_x,
    mu_y) of the plan at the first seed."""
    candidates = {}
    for mu_x, mu_y in context.plan.gpa_diloco_mus:
        method = Method("gpa_diloco", diloco.inner_steps, mu_x=mu_x, mu_y=mu_y, outer=diloco.outer_pair)
        candidates[method] = quality_run(context, method, lr, context.plan.seeds[0])
    return min(candidates, key=lambda m: candidates[m]), lr


def quality_key(method: Method, lr: float, seed: int) -> str:
    return f"quality/{method.name}/lr{lr:g}/s{seed}"


def quality_run(context: Context, method: Method, lr: float, seed: int) -> float:
    """One training run on every process (or its record, if there is one); its final validation loss (process 0's
    evaluation, on every process; inf if it diverged)."""
    key = quality_key(method, lr, seed)
    if key in context.recorded:
        return _finite(context.recorded[key]["final_val"])
    workload, steps = context.workload, context.workload.steps
    trainee = build(method, context, seed, lr)
    order = workloads.batch_order(context.data[0].shape[0], workload.batch_size, steps, seed)
    run: dict[str, Any] = {"steps": [], "val": [], "train_loss": []}
    running: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        trainee.set_lr(lr * pr.lr_factor(step, steps, workload.warmup_fraction, "cosine"))
        running.append(trainee.step(context.batch(order, step)))
        if not math.isfinite(running[-1]):
            run["diverged_at"] = step + 1
            break
        if (step + 1) % workload.eval_every == 0 or step + 1 == steps:
            run["steps"].append(step + 1)
            run["val"].append(trainee.evaluation_loss(context.data[1], workload) if context.rank == 0 else math.nan)
            run["train_loss"].append(statistics.fmean(running))  # process 0's share of the batches
            running = []
    # A loss that is not finite on one process stops that one only; the others fail in their next collective.
    run["wall_s"] = time.perf_counter() - start
    final = run["val"][-1] if run["val"] and "diverged_at" not in run else math.inf
    context.record({"key": key, "part": "quality", "method": method.name, **dataclasses.asdict(method), "lr": lr,
                    "seed": seed, "world_size": context.plan.world_size, "final_val": final, **run})  # fmt: skip
    return _finite(context.from_rank0(final))


def _finite(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else math.inf


MEASURES = {"bytes": measure_bytes, "speed": measure_speed, "quality": measure_quality}


def rank_main(
    rank: int, meter: Meter, parts: Sequence[str], plan: Plan, workload: pr.Workload, entries: dict, out: Path
) -> None:
    """One process of the launch: the requested parts in order; process 0 records every result as it comes."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(message)s")
    results = results_file(out, plan, workload) if rank == 0 else None

    def record(run: dict[str, Any]) -> None:
        if results is not None:
            results.add(run)
            write_report(results.data, out)
            logger.info("%s done", run["key"])

    recorded = {run["key"]: run for run in from_rank0(results.runs if results is not None else None, meter)}
    data = pr.load_token_windows(workload)
    context = Context(rank, meter, plan, workload, entries, data, recorded, record)
    for part in parts:
        MEASURES[part](context)


# ---- the record and the report ----


def results_file(out: Path, plan: Plan, workload: pr.Workload) -> report.ResultsFile:
    environment = {"torch": torch.__version__, "num_threads": 1, "device": report.device_name("cpu")}
    workload_fields = {**dataclasses.asdict(workload), "world_size": plan.world_size}
    return report.ResultsFile(out / f"{STEM}.json", workload_fields, dataclasses.asdict(plan), environment)


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


def quality_summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: the lr chosen at the first seed (the lowest final loss of its grid) and the runs of every seed
    at it, in method order."""
    rows = [run for run in runs if run["part"] == "quality"]
    summary = []
    for name in dict.fromkeys(run["method"] for run in rows):
        mine = [run for run in rows if run["method"] == name]
        first = min(run["seed"] for run in mine)
        sweep = {run["lr"]: run["final_val"] for run in mine if run["seed"] == first}
        best = min(sweep, key=lambda lr: _finite(sweep[lr]))
        chosen = sorted((run for run in mine if run["lr"] == best), key=lambda run: run["seed"])
        finals = [run["final_val"] for run in chosen]
        mean = statistics.fmean(finals) if all(map(math.isfinite, finals)) else math.inf
        summary.append({"method": name, "lr": best, "sweep": sweep, "runs": chosen, "finals": finals, "mean": mean})
    return summary


def between_workers_per_step(runs: list[dict[str, Any]], quality_run: dict[str, Any]) -> float:
    """The bytes each process sent between workers per step that the bytes part counted for the method of
    ``quality_run``: the bytes run of the same family, H, M, P and outer dtype (mu_x and mu_y change no byte); nan
    where none was counted."""
    same = ("family", "inner_steps", "num_workers", "num_fragments", "outer_dtype")
    for run in runs:
        if run["part"] == "bytes" and all(run.get(key, "float32") == quality_run.get(key, "float32") for key in same):
            return run["between_workers_sent_per_step"]
    return math.nan


def quality_table(runs: list[dict[str, Any]]) -> str:
    summary = quality_summary(runs)
    if not summary:
        return ""
    ddp = next((row for row in summary if row["method"] == DDP_ADAMW.name), None)
    header = ["method", "sent between workers / step (KB)", "lr (best of)", "seeds", "final val loss, mean",
              "spread (max - min)", "each seed", "vs DDP-AdamW", "wall s / run"]  # fmt: skip
    table = []
    for row in summary:
        delta = row["mean"] - ddp["mean"] if ddp else math.nan
        grid = ", ".join(f"{lr:g}: {loss:.4f}" for lr, loss in sorted(row["sweep"].items()))
        table.append([
            row["method"], _kb(between_workers_per_step(runs, row["runs"][0])), f"{row['lr']:g} ({grid})",
            len(row["finals"]), f"{row['mean']:.4f}", f"{max(row['finals']) - min(row['finals']):.4f}",
            " / ".join(f"{v:.4f}" for v in row["finals"]), f"{delta:+.4f}",
            f"{statistics.fmean(run['wall_s'] for run in row['runs']):.0f}",
        ])  # fmt: skip
    return report.markdown_table(header, table, right=(1, 3, 4, 5, 7, 8))


def _matched_diloco(candidate: dict[str, Any], gpa_diloco: dict[str, Any]) -> bool:
    """Whether ``candidate`` is the DiLoCo that ``gpa_diloco`` (GPA across workers) is matched to: the same H and
    workers, one fragment, no overlap, the float32 outer sync, the outer pair its outer lr was matched to."""
    same = ("inner_steps", "num_workers", "num_fragments")
    return (
        candidate["family"] == "diloco"
        and all(candidate.get(key) == gpa_diloco.get(key) for key in same)
        and candidate.get("outer_dtype", "float32") == "float32"
        and not candidate.get("overlap_steps", 0)
        and _outer_pair(candidate) == _outer_pair(gpa_diloco)
    )


def _outer_pair(run: dict[str, Any]) -> tuple[float, float]:
    """A recorded run's outer pair (a list in the JSON; None: the recipe's), as `Method.outer_pair`."""
    return tuple(run["outer"]) if run.get("outer") else RECIPE_OUTER


def _complete(row: dict[str, Any], seeds: Sequence[int]) -> bool:
    return [run["seed"] for run in row["runs"]] == list(seeds)


def references(row: dict[str, Any], summary: list[dict[str, Any]], seeds: Sequence[int]) -> list[dict[str, Any]]:
    """What ``row`` is compared with, seed by seed: DDP-AdamW; for GPA across workers the DiLoCo of its H that ran
    every seed with the outer pair it is matched to (its pick; not a streaming or compressed row); for a compressed
    outer all-reduce the float32 DiLoCo it compresses; for an overlapped sync the blocking one."""
    method = row["runs"][0]
    picks = [other for other in summary if other is not row and _complete(other, seeds)]
    found = [other for other in picks if other["method"] == DDP_ADAMW.name]
    if method["family"] == "gpa_diloco":
        found += [other for other in picks if _matched_diloco(other["runs"][0], method)]
    if method.get("outer_dtype", "float32") != "float32":
        found += [other for other in picks if _same_but_float32(other["runs"][0], method)]
    if method.get("overlap_steps", 0):
        same = ("family", "inner_steps", "num_workers", "num_fragments", "outer", "outer_dtype")
        found += [
            other for other in picks if not other["runs"][0].get("overlap_steps", 0)
            and all(other["runs"][0].get(key) == method.get(key) for key in same)
        ]  # fmt: skip
    return found


def paired_table(runs: list[dict[str, Any]], seeds: Sequence[int]) -> str:
    """Each pick that ran every seed against its references (`references`): the mean of the per-seed differences
    of final loss with its 95% Student-t interval, the relative gap, and whether the interval decides the sign."""
    summary = quality_summary(runs)
    header = ["method", "against", "seeds", "final loss difference, mean [95% CI]", "relative", "decided"]
    table = []
    for row in summary:
        if row["method"] == DDP_ADAMW.name or not _complete(row, seeds):
            continue
        for ref in references(row, summary, seeds):
            mine = {run["seed"]: run["final_val"] for run in row["runs"]}
            theirs = {run["seed"]: run["final_val"] for run in ref["runs"]}
            diffs = list(paired_differences(mine, theirs).values())
            if not all(map(math.isfinite, diffs)):
                table.append([row["method"], ref["method"], len(diffs), "a run diverged", "", ""])
                continue
            interval = mean_interval(diffs)
            decided = ("yes: lower" if interval.high < 0 else "yes: higher") if interval.decided else "no"
            table.append([row["method"], ref["method"], len(diffs), interval.text(),
                          f"{interval.mean / ref['mean']:+.2%}", decided])  # fmt: skip
    return report.markdown_table(header, table, right=(2, 3, 4)) if table else ""


def tuning_table(runs: list[dict[str, Any]], seed: int) -> str:
    """Every run of the first seed: the grids each pick was chosen from."""
    rows = [run for run in runs if run["part"] == "quality" and run["seed"] == seed]
    table = [[run["method"], f"{run['lr']:g}", f"{run['final_val']:.4f}"] for run in rows]
    return report.markdown_table(["method (first seed)", "lr", "final val loss"], table, right=(1, 2))


def report_text(data: dict[str, Any]) -> str:
    workload, runs = data["workload"], data["runs"]
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
    ]
    text = bytes_table(runs)
    if [run for run in runs if run["part"] == "bytes"]:
        steps = next(run["steps"] for run in runs if run["part"] == "bytes")
        parts += [
            f"## Bytes per training step (process 0, {steps} steps after {WARMUP_STEPS} warm-up steps)\n",
            text + "\n",
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
    text = quality_table(runs)
    if text:
        parts += [
            f"## Validation loss at the same token budget ({spec.steps} steps, "
            f"{spec.steps * spec.batch_size * spec.seq_len:,} tokens)\n",
            f"The paper bench's recipe (betas {pr.BETAS['adamw']}, weight decay {spec.weight_decay} on every tensor, "
            f"clipping {spec.grad_clip}, {spec.warmup_fraction:.0%} warmup then cosine; DiLoCo's outer lr "
            f"{pr.DILOCO_OUTER_LR} and momentum {pr.DILOCO_OUTER_MOMENTUM} unless its row names another outer pair, "
            f"which was tried at the first seed at that H's best lr; GPA's mu_y {data['plan']['gpa_mu_y']}); "
            "each method's lr the best of its grid at the first seed, the other seeds at it (for DiLoCo at the best "
            "outer pair of its H). DiLoCo: every process a worker, each with its share of the global batch. "
            "GPA-DiLoCo (GPA across workers, `hf_gpa.optim.GPADiLoCo`): DiLoCo's inner AdamW, H and lr, the outer "
            "step GPA's primal averaging with the outer lr gamma (1 + mu) / (1 - mu_x mu_y) of the DiLoCo pair "
            "(gamma, mu) its row names (its first move of the restart point that DiLoCo's; mu_x = mu_y = mu is "
            "that DiLoCo again). The loss is that of the evaluation weights (DiLoCo's outer weights, "
            "GPA's x) on the fixed validation windows; bytes between workers per step as the bytes part counted them "
            "for the same family, H, M, P.\n",
            text + "\n",
        ]
        seeds = data["plan"]["seeds"]
        text = paired_table(runs, seeds)
        if text:
            parts += [
                f"### Paired differences over seeds {', '.join(map(str, seeds))}\n",
                f"Each pick that ran every seed, seed by seed against DDP-AdamW (and GPA across workers against the "
                "DiLoCo of its H, a compressed outer all-reduce against its float32 DiLoCo, an overlapped streaming "
                "sync against the blocking one): every seed gives the "
                "methods the same initial weights and batches. A negative difference is a lower loss; `decided` "
                f"says whether the 95% interval excludes zero. With {len(seeds)} seeds the interval is wide (t = "
                f"{t_quantile(0.975, len(seeds) - 1):.2f}): a difference it does not decide is not shown to be "
                "zero.\n",
                text + "\n",
            ]
        parts += [
            f"### Every run of the first seed (seed {seeds[0]}): the grids\n",
            "Each grid slid past its edge while its best point lay on it (at most "
            f"{data['plan'].get('slide', 0)} times); DiLoCo's outer pairs at its best lr; GPA across workers at its "
            "DiLoCo's lr with its outer lr matched to that DiLoCo's outer pair.\n",
            tuning_table(runs, seeds[0]) + "\n",
        ]
    return "\n".join(parts)


def write_report(data: dict[str, Any], out: Path) -> None:
    (out / f"{STEM}.md").write_text(report_text(data))
    plot(data, out / f"{STEM}.png")


def plot(data: dict[str, Any], path: Path) -> None:
    """Bytes between workers per step (log scale), steps/s against DDP per link, and the mean validation curve of
    each quality method: one panel per part that has results. Where some methods ran every seed, the quality panels
    show those (the picks; the grids' single-seed runs are in the report's tables), legends below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = data["runs"]
    panels = [part for part in PARTS if any(run["part"] == part for run in runs)]
    if {"bytes", "quality"} <= set(panels):
        panels.append("loss against bytes")
    if not panels:
        return
    summary = quality_summary(runs)
    picks = [row for row in summary if len(row["runs"]) > 1] or summary
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 7.5), squeeze=False)
    for ax, part in zip(axes[0], panels):
        if part == "bytes":
            rows = [run for run in runs if run["part"] == "bytes"]
            ax.barh([r["method"] for r in rows][::-1], [r["between_workers_sent_per_step"] / 1e3 for r in rows][::-1])
            ax.set_xscale("log")
            ax.set_xlabel("sent between workers per step (KB, log)")
        elif part == "speed":
            rows = [run for run in runs if run["part"] == "speed"]
            names = list(rows[0]["ratio_to_ddp"])
            width = 0.8 / len(names)
            for i, name in enumerate(names):
                ax.bar([j + i * width for j in range(len(rows))], [r["ratio_to_ddp"][name] for r in rows], width,
                       label=name)  # fmt: skip
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r["link_text"] for r in rows], fontsize=8)
            ax.set_ylabel("steps/s relative to DDP-AdamW")
            ax.legend(fontsize=8)
        elif part == "loss against bytes":
            for row in picks:
                sent = between_workers_per_step(runs, row["runs"][0]) / 1e3
                finals = [v for v in row["finals"] if math.isfinite(v)]
                if finals and math.isfinite(sent):
                    low, high = min(finals), max(finals)
                    ax.errorbar([sent], [row["mean"]], yerr=[[row["mean"] - low], [high - row["mean"]]], fmt="o",
                                capsize=3, label=row["method"])  # fmt: skip
            ax.set_xscale("log")
            ax.set_xlabel("sent between workers per step (KB, log)")
            ax.set_ylabel("final validation loss (mean, seed range)")
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
        else:
            tails = []
            for row in picks:
                curves = [run["val"] for run in row["runs"] if "diverged_at" not in run]
                if curves and all(len(c) == len(curves[0]) for c in curves):
                    mean = [statistics.fmean(values) for values in zip(*curves)]
                    ax.plot(row["runs"][0]["steps"], mean, label=f"{row['method']} (lr {row['lr']:g})")
                    tails += [v for v in mean[len(mean) // 2 :] if math.isfinite(v)]
            if tails:  # the second half of the run, where the methods part
                pad = 0.1 * (max(tails) - min(tails)) or 0.05
                ax.set_ylim(min(tails) - pad, max(tails) + pad)
            ax.set_xlabel("step")
            ax.set_ylabel("validation loss (mean over seeds)")
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
        help="DiLoCo's regime: 4 workers x 16 windows a step, 4,096 steps, DiLoCo's outer lr / momentum and GPA "
        "across workers' mu_x / mu_y swept (many core-hours)",
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
    if args.timeout is not None:
        if args.timeout <= 0:
            parser.error(f"--timeout: {args.timeout} (must be > 0 seconds)")
        plan = dataclasses.replace(plan, timeout_s=args.timeout)
    args.out.mkdir(parents=True, exist_ok=True)
    results = results_file(args.out, plan, workload)  # refuses a record of another workload before anything starts
    parts = [part for part in PARTS if part in args.parts]
    if args.report_only:
        write_report(results.data, args.out)
        logger.info("\n%s", report_text(results.data))
        return
    if args.again:
        results.data["runs"] = [run for run in results.runs if run["part"] not in parts]
        results.write()
    pr.load_token_windows(workload)  # tokenized and cached once, here, rather than by every process
    start = time.perf_counter()
    entries = optimizer_entries(plan, workload)
    run_ranks(rank_main, plan.world_size, (parts, plan, workload, entries, args.out.resolve()),
              timeout_s=plan.timeout_s, collective_timeout_s=COLLECTIVE_TIMEOUT_S)  # fmt: skip
    data = results_file(args.out, plan, workload).data
    write_report(data, args.out)
    logger.info("%s in %.0f s\n%s", " ".join(parts), time.perf_counter() - start, report_text(data))


if __name__ == "__main__":
    main()
