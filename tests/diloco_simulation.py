"""DiLoCo's workers simulated in one process: the plain loop a DiLoCo run across processes must reproduce.

M workers, each an island of S ranks, train copies of one model: every inner step each rank of an island takes the
gradient of its own rows of the global batch, the island averages them (as DDP does), and the worker's own
``torch.optim.AdamW`` steps its copy. At the inner steps where a fragment is due (fragment k at the steps t with
(t - k H // P) % H == 0), the pseudo-gradients outer - inner of the fragment's tensors are averaged over the workers in
a fixed order, the Nesterov step moves the outer weights (b <- mu b + p, outer <- outer - outer_lr (p + mu b)), and
every worker's inner weights are reset to them. With an overlap of tau > 0 inner steps (Streaming DiLoCo), the
average of the pseudo-gradients taken at step t is applied after step t + tau (before the fragments due then take
theirs), and each worker's inner weights, which moved on meanwhile, become alpha inner + (1 - alpha) outer. Written
from the papers' algorithms (DiLoCo, Streaming DiLoCo), with nothing of hf_gpa; the split into fragments is written
out for the MLP (``FRAGMENTS``) rather than computed. The outer step is an object (`NesterovStep` by default;
``gpa_diloco_simulation.PrimalAveragingStep`` for GPA across workers): the point the pseudo-gradients are taken from,
and the step that gives the point the workers restart from. ``synchronize=True`` ends the run as the Trainer does:
after the last step the syncs in flight are applied and every fragment with steps since its last outer step takes
one with them.

The model and the global batches are those of ``distributed_workers``; rank r of W owns rows
[r G / W, (r + 1) G / W) of each global batch of G rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from distributed_workers import GLOBAL_BATCH, build_mlp, global_batch, mse

ADAMW_KW: dict[str, Any] = dict(lr=0.05, betas=(0.9, 0.99), weight_decay=0.1)
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
#: The fragment of each tensor of ``build_mlp`` (weights and biases of 6x15, 15x9, 9x1 layers: 90, 15, 135, 9, 9, 1
#: elements) for P = 1, 2, 3: P contiguous runs of about equal size, a tensor in the run where its middle lies.
FRAGMENTS = {1: [0, 0, 0, 0, 0, 0], 2: [0, 0, 1, 1, 1, 1], 3: [0, 1, 1, 2, 2, 2]}


def rank_rows(step: int, rank: int, world_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows of the global batch of ``step`` (0-based), with ``world_size`` ranks in all."""
    inputs, targets = global_batch(step, dtype)
    rows = GLOBAL_BATCH // world_size
    own = slice(rank * rows, (rank + 1) * rows)
    return inputs[own], targets[own]


@dataclass
class Snapshot:
    """After one inner step (and the outer step it ends, if any): each worker's inner weights, the outer weights and
    the outer momentum (lists in the model's parameter order)."""

    #: The outer tensors a worker's record holds after every step, under these names too.
    outer_keys: ClassVar[tuple[str, ...]] = ("outer", "momentum")

    inner: list[list[torch.Tensor]]
    outer: list[torch.Tensor]
    momentum: list[torch.Tensor]
    #: The pseudo-gradients of each worker averaged by this step's outer step (None where no tensor was due).
    pseudo_gradients: list[list[torch.Tensor | None]] | None = None
    #: Each worker's error-feedback residuals after the step (zero in float32).
    residuals: list[list[torch.Tensor]] | None = None
    #: Each worker's residuals of the second quantization (more than 2 workers, compressed; zero otherwise).
    server_residuals: list[list[torch.Tensor]] | None = None


#: The elements of one int8 quantization block of a compressed outer all-reduce.
INT8_BLOCK = 256


def compressed(values: torch.Tensor, outer_dtype: str) -> torch.Tensor:
    """What a worker's flat ``values`` become once sent in ``outer_dtype`` and received: rounded to bf16, or per
    block of 256 elements scaled by max |block| / 127, rounded to integers in [-127, 127] and scaled back."""
    if outer_dtype == "float32":
        return values
    if outer_dtype == "bfloat16":
        return values.to(torch.bfloat16).to(values.dtype)
    out = torch.zeros_like(values)
    for start in range(0, values.numel(), INT8_BLOCK):
        block = values[start : start + INT8_BLOCK]
        scale = block.abs().max() / 127
        if scale > 0:
            out[start : start + INT8_BLOCK] = torch.round(block / scale).clamp(-127, 127) * scale
    return out


def chunk_bounds(numel: int, num_workers: int, outer_dtype: str) -> list[tuple[int, int]]:
    """[start, stop) of each worker's share of a flat vector of ``numel`` elements reduced by more than 2 workers:
    numel / M elements each, rounded up (int8: to whole blocks of 256, so that no block is split), the last shares
    shorter or empty."""
    unit = INT8_BLOCK if outer_dtype == "int8" else 1
    units = (numel + unit - 1) // unit
    size = (units + num_workers - 1) // num_workers * unit
    return [(min(w * size, numel), min((w + 1) * size, numel)) for w in range(num_workers)]


class NesterovStep:
    """DiLoCo's outer step: b <- mu b + p, outer <- outer - outer_lr (p + mu b); the workers restart from outer."""

    def __init__(self, initial: list[torch.Tensor], outer_lr: float = OUTER_LR, momentum: float = OUTER_MOMENTUM):
        self.outer = [p.clone() for p in initial]
        self.momentum = [torch.zeros_like(p) for p in initial]
        self.outer_lr, self.mu = outer_lr, momentum

    def reference(self, i: int) -> torch.Tensor:
        return self.outer[i]

    def update(self, i: int, p: torch.Tensor) -> torch.Tensor:
        self.momentum[i].mul_(self.mu).add_(p)
        self.outer[i].sub_(p.add(self.momentum[i], alpha=self.mu), alpha=self.outer_lr)
        return self.outer[i]

    def state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the evaluation weights, the second outer tensor): the outer weights and momentum."""
        return self.outer, self.momentum


def simulate(
    num_workers: int,
    island_size: int,
    inner_steps: int,
    num_fragments: int,
    steps: int,
    dtype: torch.dtype = torch.float32,
    outer_dtype: str = "float32",
    overlap_steps: int = 0,
    overlap_alpha: float = 0.0,
    outer_step: Callable[[list[torch.Tensor]], Any] | None = None,
    synchronize: bool = False,
) -> list[Snapshot]:
    """The plain loop of M = ``num_workers`` workers of ``island_size`` ranks each: a snapshot after every step.

    ``outer_dtype`` bfloat16 or int8: each worker adds its residual to its pseudo-gradients, sends the due tensors
    (one flat vector in the model's order) `compressed`, keeps what compression lost as its residual, and the
    average is taken of what was received (``Snapshot.residuals``: each worker's residuals after the step). With more
    than 2 workers that average is sent again: worker w adds its server residual to its share of the average
    (`chunk_bounds`), sends that compressed (int8: its blocks counted from the share's start), keeps what this second
    compression lost as its server residual, and everyone takes what was sent (``Snapshot.server_residuals``).
    ``overlap_steps`` tau > 0: the average of the pseudo-gradients taken at step t moves the outer weights after step
    t + tau, and the inner weights are mixed with the new restart point by ``overlap_alpha`` (0: replaced).
    ``outer_step``: the outer step's class, built on the initial weights (default `NesterovStep`). ``synchronize``:
    the last snapshot is taken after the end-of-training sync (the syncs in flight applied, then every fragment with
    steps since its last outer step synchronised)."""
    world_size = num_workers * island_size
    models = [build_mlp(dtype) for _ in range(num_workers)]  # seeded: the same initial weights
    inner_optimizers = [torch.optim.AdamW(model.parameters(), **ADAMW_KW) for model in models]
    weights = [list(model.parameters()) for model in models]
    step = (outer_step or NesterovStep)([p.detach() for p in weights[0]])
    sync = _Sync(num_workers, outer_dtype, [p.detach() for p in weights[0]], step)
    history = []
    pending: list[tuple[int, dict[int, torch.Tensor]]] = []  # (the step after which it applies, {tensor: average})

    def outer_update(averages: dict[int, torch.Tensor]) -> None:
        for i, p in averages.items():
            restart = step.update(i, p)
            for w in weights:
                if overlap_alpha == 0.0:
                    w[i].copy_(restart)
                else:
                    w[i].mul_(overlap_alpha).add_(restart, alpha=1.0 - overlap_alpha)

    for t in range(1, steps + 1):
        for worker, (model, optimizer) in enumerate(zip(models, inner_optimizers)):
            grads = []
            for rank in range(worker * island_size, (worker + 1) * island_size):
                model.zero_grad()
                mse(model, *rank_rows(t - 1, rank, world_size, dtype)).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for i, p in enumerate(model.parameters()):
                island = [g[i] for g in grads]
                p.grad = island[0] if island_size == 1 else sum(island[1:], island[0]) / island_size
            optimizer.step()
        with torch.no_grad():
            while pending and pending[0][0] == t:
                outer_update(pending.pop(0)[1])
            due_now = [
                i
                for i, fragment in enumerate(FRAGMENTS[num_fragments])
                if (t - fragment * inner_steps // num_fragments) % inner_steps == 0
            ]
            averages, averaged = sync.exchange(due_now, weights)
            if overlap_steps == 0:
                outer_update(averages)
            elif averages:
                pending.append((t + overlap_steps, averages))
            if synchronize and t == steps:
                while pending:
                    outer_update(pending.pop(0)[1])
                offsets = [fragment * inner_steps // num_fragments for fragment in FRAGMENTS[num_fragments]]
                since = [t if t < offset else (t - offset) % inner_steps for offset in offsets]
                outer_update(sync.exchange([i for i, n in enumerate(since) if n > 0], weights)[0])
        history.append(sync.snapshot(weights, averaged if due_now else None))
    return history


class _Sync:
    """The workers' exchange of the pseudo-gradients of the due tensors, plain or compressed (see `simulate`)."""

    def __init__(self, num_workers: int, outer_dtype: str, initial: list[torch.Tensor], step: Any) -> None:
        self.num_workers, self.outer_dtype, self.step = num_workers, outer_dtype, step
        self.residuals = [[torch.zeros_like(p) for p in initial] for _ in range(num_workers)]
        self.servers = [[torch.zeros_like(p) for p in initial] for _ in range(num_workers)]
        self.shapes = [p.shape for p in initial]

    def exchange(
        self, due_now: list[int], weights: list[list[torch.Tensor]]
    ) -> tuple[dict[int, torch.Tensor], list[list[torch.Tensor | None]]]:
        """({tensor: the average every worker receives}, each worker's pseudo-gradients as it sent them)."""
        num_workers, outer_dtype = self.num_workers, self.outer_dtype
        averaged: list[list[torch.Tensor | None]] = [[None] * len(self.shapes) for _ in range(num_workers)]
        if not due_now:
            return {}, averaged
        numels = [self.shapes[i].numel() for i in due_now]
        received = []
        for worker, w in enumerate(weights):
            pseudo = [self.step.reference(i) - w[i] for i in due_now]
            if outer_dtype != "float32":
                pseudo = [q + self.residuals[worker][i] for q, i in zip(pseudo, due_now)]
            sent = compressed(torch.cat([q.reshape(-1) for q in pseudo]), outer_dtype)
            received.append(sent)
            for i, q, got in zip(due_now, pseudo, sent.split(numels)):
                averaged[worker][i] = q
                if outer_dtype != "float32":
                    self.residuals[worker][i] = q - got.view(q.shape)
        p = received[0]
        for q in received[1:]:
            p = p + q  # the fixed order: worker 0, 1, 2, ...
        p = p / num_workers
        if outer_dtype != "float32" and num_workers > 2:
            again = torch.empty_like(p)
            for w, (start, stop) in enumerate(chunk_bounds(p.numel(), num_workers, outer_dtype)):
                kept = torch.cat([self.servers[w][i].reshape(-1) for i in due_now])
                share = p[start:stop] + kept[start:stop]
                again[start:stop] = compressed(share, outer_dtype)
                kept[start:stop] = share - again[start:stop]
                for i, e in zip(due_now, kept.split(numels)):
                    self.servers[w][i] = e.view(self.shapes[i]).clone()
            p = again
        return {i: average.view(self.shapes[i]) for i, average in zip(due_now, p.split(numels))}, averaged

    def snapshot(self, weights: list[list[torch.Tensor]], averaged: list | None) -> Snapshot:
        first, second = self.step.state()
        return Snapshot(
            inner=[[p.detach().clone() for p in w] for w in weights],
            outer=[p.clone() for p in first],
            momentum=[b.clone() for b in second],
            pseudo_gradients=averaged,
            residuals=[[e.clone() for e in r] for r in self.residuals],
            server_residuals=[[e.clone() for e in r] for r in self.servers],
        )


def assert_matches(
    history: list[dict[str, list[torch.Tensor]]], expected: list[Any], worker: int, **tol: float
) -> None:
    """One rank's record after every step against the simulation's `Snapshot` (this module's or GPA's): its
    worker's inner weights and the outer tensors (``outer_keys``: the outer weights and momentum, or x and z),
    bitwise or within ``tol``."""
    assert len(history) == len(expected)
    for step, (held, snapshot) in enumerate(zip(history, expected), start=1):
        wanted = [("inner", snapshot.inner[worker]), *((key, getattr(snapshot, key)) for key in snapshot.outer_keys)]
        for key, want in wanted:
            for i, (a, b) in enumerate(zip(held[key], want)):
                if tol:
                    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"step {step}, {key}[{i}]: {m}")  # noqa: B023
                else:
                    assert torch.equal(a, b), f"step {step}, {key}[{i}]: max |diff| {(a - b).abs().max().item():.3g}"


def assert_same_outer_everywhere(
    histories: list[list[dict[str, list[torch.Tensor]]]], keys: tuple[str, ...] = Snapshot.outer_keys
) -> None:
    """Every rank's record holds bitwise the same outer tensors (``keys``, a `Snapshot`'s ``outer_keys``) as rank
    0's after every step."""
    for step, held in enumerate(zip(*histories), start=1):
        for rank, other in enumerate(held[1:], start=1):
            for key in keys:
                assert all(torch.equal(a, b) for a, b in zip(held[0][key], other[key])), (step, rank, key)
