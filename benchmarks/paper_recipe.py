"""The paper comparison's recipe: its methods and their ``--optim`` flags, the workload (tiny Llama, corpus, budget),
the plan of runs, and one training run. ``benchmarks.paper_table`` runs it; ``benchmarks.lowbit_quality`` and
``benchmarks.bf16_state`` train on the same workload with other optimizers.

Every method is an ``--optim`` value of the Trainer with the paper's settings (`optimizer_flags`), built through the
one ``--optim`` table (`benchmarks.workloads.optimizer_from_flags`) with one weight decay on every tensor. Every
method of a seed trains on identical batches in identical order, from the same initialisation, with a fixed
validation set evaluated every ``eval_every`` steps.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import report, workloads

logger = logging.getLogger("paper_table")

#: The families, in table order. The Muon ones run ``MuonWithAuxAdam`` on its Trainer groups (Muon, lr adjusted to
#: AdamW's RMS, on the attention and MLP matrices; AdamW on the tied embedding and the norms), one lr and one
#: schedule for both; GPA and DiLoCo wrap it as their base.
METHODS = ("adamw", "sf", "sf_ref", "diloco", "gpa", "muon", "diloco_muon", "gpa_muon")
LABELS = {
    "adamw": "AdamW",
    "sf": "SF-AdamW (hf_gpa)",
    "sf_ref": "SF-AdamW (schedulefree)",
    "diloco": "DiLoCo-AdamW",
    "gpa": "GPA-AdamW",
    "muon": "Muon",
    "diloco_muon": "DiLoCo-Muon",
    "gpa_muon": "GPA-Muon",
}
#: Families with an H (DiLoCo's inner steps, GPA's mu_x = mu_x_from_inner_steps(H)), and GPA's (with a mu_y).
WITH_H = ("diloco", "gpa", "diloco_muon", "gpa_muon")
GPA_FAMILIES = ("gpa", "gpa_muon")
#: The base optimizer's family of each method: the baseline its speedup is also measured against.
BASELINE = {method: "muon" if method.endswith("muon") else "adamw" for method in METHODS}
#: Adam's (beta1, beta2): (0.9, 0.95), from the paper's beta grid (appendix, Table 3) and the recipe of its Llama-8B
#: runs, for every method. The bold Llama-160M choice (0.975, 0.9), tuned at 262K-token batches, fails at our 1K-token
#: batches: in a 500-step pilot AdamW ended at 4.78 with it and at 4.08 with (0.9, 0.95), while Schedule-Free reached
#: 3.81. Schedule-Free-AdamW is run as published (Defazio et al., 2024): no gradient momentum (its beta 0.9 is the
#: y-interpolation, ``SF_MU_Y``); ours is GPAAdamW with beta1 = 0 and ``averaging="schedule_free"``. It differs from
#: ``schedulefree.AdamWScheduleFree(betas=(0.9, beta2))`` only in where weight decay acts: on z, as in the paper's
#: Algorithm 1, where schedulefree evaluates it at y; with --weight-decay 0 the two take the same steps
#: (tests/test_gpa.py). Both get the same linear warm-up, then a constant lr (`schedule_of`): under a decaying lr
#: their averages would also differ (docs/concepts.md).
BETAS = {
    "adamw": (0.9, 0.95),
    "sf": (0.0, 0.95),
    "sf_ref": (0.9, 0.95),
    "diloco": (0.9, 0.95),
    "gpa": (0.9, 0.95),
    # AdamW's betas in the AdamW groups (embedding, norms); Muon's momentum is torch's 0.95.
    "muon": (0.9, 0.95),
    "diloco_muon": (0.9, 0.95),
    "gpa_muon": (0.9, 0.95),
}
#: DiLoCo's outer Nesterov step, the paper's best (Table 3): outer lr 0.75, outer momentum 0.75.
DILOCO_OUTER_LR = 0.75
DILOCO_OUTER_MOMENTUM = 0.75
#: Schedule-Free's interpolation constant (its beta), the usual 0.9, for both implementations.
SF_MU_Y = 0.9
_DILOCO_OUTER = {"diloco_outer_lr": DILOCO_OUTER_LR, "diloco_outer_momentum": DILOCO_OUTER_MOMENTUM}
#: Each method as the Trainer's ``--optim`` flags; the run adds its lr, betas, weight decay, H and mu_y.
OPTIM_FLAGS: dict[str, dict[str, Any]] = {
    "adamw": {"optim": "adamw_torch"},
    "sf": {"optim": "gpa_adamw", "gpa_averaging": "schedule_free", "gpa_mu_y": SF_MU_Y},
    "sf_ref": {"optim": "schedule_free_adamw"},
    "diloco": {"optim": "diloco_adamw", **_DILOCO_OUTER},
    "gpa": {"optim": "gpa_adamw"},
    "muon": {"optim": "muon"},
    "diloco_muon": {"optim": "diloco_muon", **_DILOCO_OUTER},
    "gpa_muon": {"optim": "gpa", "gpa_base_optim": "muon"},
}


@dataclass(frozen=True)
class Workload(workloads.LlamaSpec):
    """The model (a tiny Llama with tied embeddings, no dropout), data and budget shared by every run."""

    #: windows of ``seq_len`` tokens per step, and steps of the full budget
    batch_size: int = 16
    steps: int = 2000
    #: evaluation every ``eval_every`` steps (and at the last), on ``val_windows`` fixed validation windows
    eval_every: int = 100
    val_windows: int = 128
    #: the paper's recipe: linear warmup over this share of the steps, weight decay on every tensor, clipping
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    #: characters of train-split text to tokenize (None: all of it); the quick mode reads a slice.
    max_train_chars: int | None = None
    #: the text: "stdlib", "site-packages" or a directory of .py files, split by file (hf_gpa.data).
    corpus: str = "stdlib"
    #: where the runs train ("cpu" or "cuda": the current CUDA device) and whether under bf16 autocast.
    device: str = "cpu"
    bf16: bool = False


@dataclass(frozen=True)
class Plan:
    """What to run: the lr grids of the sweep, the H and mu_y grids, the seeds of the full budget."""

    lrs: dict[str, tuple[float, ...]] = field(
        default_factory=lambda: {
            "adamw": (5e-3, 1e-2, 2e-2, 4e-2),
            "sf": (1e-2, 2e-2, 4e-2),
            "sf_ref": (1e-2, 2e-2, 4e-2),
            "diloco": (5e-3, 1e-2, 2e-2),
            "gpa": (1e-2, 2e-2, 4e-2),
        }
    )
    inner_steps: tuple[int, ...] = (8, 16, 32, 64)
    mu_ys: tuple[float, ...] = (0.7, 0.8, 0.9)
    #: H at which DiLoCo and GPA are swept (scaled by ``sweep_fraction``), the paper's best H for GPA.
    sweep_inner_steps: int = 32
    sweep_fraction: float = 0.25
    seeds: tuple[int, ...] = (0, 1, 2)
    #: seeds at which every H runs at the full budget; the other seeds run each family's best H only.
    all_h_seeds: tuple[int, ...] = (0,)
    sweep_seed: int = 0


@dataclass(frozen=True)
class RunSpec:
    """One training run; ``key`` names it in the JSON file."""

    method: str
    lr: float
    seed: int
    steps: int
    phase: str
    inner_steps: int | None = None
    mu_y: float | None = None
    #: Adam's (beta1, beta2); None: ``BETAS[method]``.
    betas: tuple[float, float] | None = None
    #: DiLoCo's (outer lr, outer momentum); None: ``DILOCO_OUTER_LR``, ``DILOCO_OUTER_MOMENTUM``.
    outer: tuple[float, float] | None = None

    @property
    def key(self) -> str:
        parts = [self.phase, self.method, f"lr{self.lr:g}", f"s{self.seed}", f"T{self.steps}"]
        if self.inner_steps is not None:
            parts.append(f"H{self.inner_steps}")
        if self.mu_y is not None:
            parts.append(f"muy{self.mu_y:g}")
        if self.betas is not None:
            parts.append(f"b{self.betas[0]:g},{self.betas[1]:g}")
        if self.outer is not None:
            parts.append(f"o{self.outer[0]:g},{self.outer[1]:g}")
        return "/".join(parts)


QUICK_WORKLOAD = Workload(
    hidden_size=16, intermediate_size=32, num_heads=2, seq_len=32, batch_size=4, steps=12, eval_every=4,
    val_windows=4, max_train_chars=100_000,
)  # fmt: skip
QUICK_PLAN = Plan(
    lrs={"adamw": (5e-3, 2e-2), "sf": (2e-2,), "sf_ref": (2e-2,), "diloco": (2e-2,), "gpa": (5e-3, 2e-2),
         "muon": (2e-2,), "diloco_muon": (2e-2,), "gpa_muon": (2e-2,)},
    inner_steps=(4, 8), mu_ys=(0.7, 0.9), sweep_inner_steps=8,
    sweep_fraction=0.5, seeds=(0, 1), all_h_seeds=(0,),
)  # fmt: skip
#: The quality benchmark at GPU scale: the recipe of the earlier H100 runs (8 layers, width 512, 16K tokens a step,
#: 1,500 steps, bf16 autocast, cosine, weight decay 0.1, clipping 1.0) on site-packages' Python sources.
GPU_WORKLOAD = Workload(
    vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1376, seq_len=512,
    batch_size=32, steps=1500, eval_every=100, val_windows=512, corpus="site-packages", device="cuda", bf16=True,
)  # fmt: skip
#: lr grids around those runs (AdamW best at 7.5e-4, GPA at 1.5e-3: about 2x); GPA at H 8 and 32, mu_y 0.7.
GPU_PLAN = Plan(
    lrs={"adamw": (3.75e-4, 7.5e-4, 1.5e-3, 3e-3), "gpa": (7.5e-4, 1.5e-3, 3e-3, 6e-3)},
    inner_steps=(8, 32), mu_ys=(0.7,), sweep_inner_steps=32, sweep_fraction=0.5, seeds=(0, 1, 2), all_h_seeds=(0,),
)  # fmt: skip


def load_token_windows(
    workload: Workload, cache_dir: Path | None = None, held_out: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train windows, validation windows) of the workload's corpus (`benchmarks.workloads.token_windows`);
    ``held_out`` > 0: (train windows, that many held-out windows, none of them a validation window) instead."""
    return workloads.token_windows(
        workload.vocab_size,
        workload.seq_len,
        workload.val_windows,
        workload.corpus,
        workload.max_train_chars,
        cache_dir,
        held_out,
    )


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, non-embedding parameters); tied embeddings are counted once."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    return total, total - embedding


def record_parameters(results: report.ResultsFile, workload: Workload) -> tuple[int, int]:
    """Records the model's parameter counts (`count_parameters`) in ``results`` (``parameters`` and
    ``non_embedding_parameters``), writes it, and returns them."""
    total, non_embedding = count_parameters(workload.build(0))
    results.data.update(parameters=total, non_embedding_parameters=non_embedding)
    results.write()
    return total, non_embedding


def results_file(path: Path, workload: Workload, plan: Any) -> report.ResultsFile:
    """The resumable record of ``workload`` at ``path`` under ``plan`` (a dataclass: `Plan`, or another benchmark's
    plan of the same workload), with where its runs train (`benchmarks.report.environment`: CPU model and instruction
    set, Python, torch, threads, commit); records written before a workload field existed hold its default: CPU, the
    stdlib corpus, tied embeddings."""
    device = "cpu" if workload.device == "cpu" else f"cuda:{torch.cuda.current_device()}"
    environment = report.environment(device, num_threads=1)  # every run trains on one thread
    return report.ResultsFile(path, asdict(workload), asdict(plan), environment, asdict(Workload()))


# ---- optimizers and schedules ----


def lr_factor(step: int, steps: int, warmup_fraction: float, schedule: str) -> float:
    """The paper's recipe: linear warmup over ``warmup_fraction``, then cosine to 0 (or constant for SF)."""
    warmup = max(1, round(warmup_fraction * steps))
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def optimizer_flags(spec: RunSpec, workload: Workload) -> dict[str, Any]:
    """The ``--optim`` flags of ``spec``: its method's, with the run's lr, the paper's betas, the workload's weight
    decay, and the run's H and mu_y where the method has them."""
    beta1, beta2 = tuple(spec.betas) if spec.betas is not None else BETAS[spec.method]
    flags = {**OPTIM_FLAGS[spec.method], "learning_rate": spec.lr, "adam_beta1": beta1, "adam_beta2": beta2}
    flags |= {"adam_epsilon": 1e-8, "weight_decay": workload.weight_decay}
    if spec.method in WITH_H:
        flags["gpa_inner_steps" if spec.method in GPA_FAMILIES else "diloco_inner_steps"] = spec.inner_steps
    if (spec.method in GPA_FAMILIES or spec.method == "sf") and spec.mu_y is not None:
        flags["gpa_mu_y"] = spec.mu_y  # Schedule-Free's beta is its mu_y
    if spec.method in ("diloco", "diloco_muon") and spec.outer is not None:
        flags["diloco_outer_lr"], flags["diloco_outer_momentum"] = spec.outer
    if spec.method == "sf_ref":  # schedulefree warms up by itself, over the same share of the run
        flags["warmup_steps"] = max(1, round(workload.warmup_fraction * spec.steps))
    return flags


def build_optimizer(spec: RunSpec, model: torch.nn.Module, workload: Workload) -> torch.optim.Optimizer:
    """The optimizer of ``spec`` for ``model``: its ``--optim`` flags through the one table, weight decay on every
    tensor."""
    if spec.method == "sf_ref":
        import_schedulefree()
    params = [p for p in model.parameters() if p.requires_grad]
    return workloads.optimizer_from_flags(
        optimizer_flags(spec, workload), params, model, weight_decay=workload.weight_decay
    )


def import_schedulefree() -> Any:
    """The `schedulefree` package (the reference SF-AdamW), or an ImportError that says how to install it."""
    try:
        import schedulefree
    except ImportError as error:
        raise ImportError(
            "benchmarks.paper_table runs the reference Schedule-Free AdamW, which needs schedulefree: "
            'pip install "hf_gpa[bench]"'
        ) from error
    return schedulefree


def schedule_of(method: str) -> str:
    return "constant" if method in ("sf", "sf_ref") else "cosine"


# ---- one run ----


def _autocast(workload: Workload) -> Any:
    """bf16 autocast on the workload's device when it asks for it (the Trainer's --bf16), else nothing."""
    return torch.autocast(workload.device, dtype=torch.bfloat16, enabled=workload.bf16)


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor, batch_size: int, workload: Workload | None = None) -> float:
    """Mean next-token loss over the fixed validation windows (every window has the same number of targets)."""
    workload = workload or Workload()
    was_training = model.training
    model.eval()
    with _autocast(workload):
        losses = [
            model(input_ids=chunk.to(workload.device), labels=chunk.to(workload.device)).loss.item()
            for chunk in val.long().split(batch_size)
        ]
    model.train(was_training)
    return statistics.fmean(losses)


@torch.no_grad()
def evaluate_at_z(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, val: torch.Tensor, workload: Workload
) -> float | None:
    """The loss at z, the unaveraged iterate the optimizer's state holds under ``"z"`` (None if it holds none); y is
    put back."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not all("z" in optimizer.state.get(p, {}) for p in params):
        return None
    y = [p.detach().clone() for p in params]
    try:
        for p in params:
            p.copy_(optimizer.state[p]["z"])
        return evaluate(model, val, workload.batch_size, workload)
    finally:
        for p, saved in zip(params, y):
            p.copy_(saved)


def train(
    workload: Workload,
    data: tuple[torch.Tensor, torch.Tensor],
    seed: int,
    steps: int,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    lr: float | None,
    schedule: str = "cosine",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Train the workload's model from ``seed`` for ``steps`` with the optimizer ``make_optimizer(model)`` builds,
    and return the record: evaluation steps, validation losses, train loss, wall time.

    The lr is ``lr`` times the paper's schedule (`lr_factor`), written into every group before each step (None:
    the optimizer schedules itself, as schedulefree does). ``val`` is the loss of the evaluation weights (x for GPA and
    SF, the outer weights for DiLoCo, the parameters otherwise); ``val_train`` the loss of the training iterate (y for
    GPA and SF, DiLoCo's inner weights) of an optimizer with ``eval()``; at the end also the loss at y and at z.
    """
    train_windows, val = data
    model = workload.build(seed).to(device=workload.device, dtype=dtype)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(model)
    order = workloads.batch_order(train_windows.shape[0], workload.batch_size, steps, seed)
    averaged = hasattr(optimizer, "eval")
    if averaged:
        optimizer.train()  # schedulefree starts in eval mode; ours start in train mode (idempotent)
    record: dict[str, Any] = {"steps": [], "val": [], "val_train": [], "train_loss": []}
    running: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        if lr is not None:
            factor = lr_factor(step, steps, workload.warmup_fraction, schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr * factor
        batch = train_windows[order[step]].long().to(workload.device)
        with _autocast(workload):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, workload.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running.append(loss.item())
        if not math.isfinite(running[-1]):
            record["diverged_at"] = step + 1
            break
        if (step + 1) % workload.eval_every == 0 or step + 1 == steps:
            val_train = evaluate(model, val, workload.batch_size, workload) if averaged else None
            if averaged:
                optimizer.eval()
            val_loss = evaluate(model, val, workload.batch_size, workload)
            if averaged:
                optimizer.train()
            record["steps"].append(step + 1)
            record["val"].append(val_loss)
            record["val_train"].append(val_train)
            record["train_loss"].append(statistics.fmean(running))
            running = []
    record["wall_s"] = time.perf_counter() - start
    record["final_val"] = record["val"][-1] if record["val"] and "diverged_at" not in record else math.inf
    if averaged and "diverged_at" not in record and record["val"]:
        # x, y and z at the end: how far the averaged x lags the iterates once the schedule has decayed
        record["final_val_y"] = record["val_train"][-1]
        record["final_val_z"] = evaluate_at_z(model, optimizer, val, workload)
    record["optimizer"] = optimizer  # for the caller to inspect; not part of the JSON record
    return record


def train_run(spec: RunSpec, workload: Workload, data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """Train one run of the comparison and return its record, with its key, settings and betas."""
    record = train(
        workload,
        data,
        spec.seed,
        spec.steps,
        lambda model: build_optimizer(spec, model, workload),
        # schedulefree warms up internally (and its lr is the peak lr); every other optimizer gets the schedule here
        None if spec.method == "sf_ref" else spec.lr,
        schedule_of(spec.method),
    )
    del record["optimizer"]
    if "diverged_at" in record:
        logger.warning("%s diverged at step %d", spec.key, record["diverged_at"])
    betas = spec.betas if spec.betas is not None else BETAS[spec.method]
    return {"key": spec.key, "spec": asdict(spec), "betas": list(betas), **record}
