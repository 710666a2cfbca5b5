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
out for the MLP (``FRAGMENTS``) rather than computed.

The model and the global batches are those of ``distributed_workers``; rank r of W owns rows
[r G / W, (r + 1) G / W) of each global batch of G rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
) -> list[Snapshot]:
    """The plain loop of M = ``num_workers`` workers of ``island_size`` ranks each: a snapshot after every step.

    ``outer_dtype`` bfloat16 or int8: each worker adds its residual to its pseudo-gradients, sends the due tensors
    (one flat vector in the model's order) `compressed`, keeps what compression lost as its residual, and the
    average is taken of what was received (``Snapshot.residuals``: each worker's residuals after the step). With more
    than 2 workers that average is sent again: worker w adds its server residual to its share of the average
    (`chunk_bounds`), sends that compressed (int8: its blocks counted from the share's start), keeps what this second
    compression lost as its server residual, and everyone takes what was sent (``Snapshot.server_residuals``).
    ``overlap_steps`` tau > 0: the average of the pseudo-gradients taken at step t moves the outer weights after step
    t + tau, and the inner weights are mixed with the new outer weights by ``overlap_alpha`` (0: replaced)."""
    world_size = num_workers * island_size
    models = [build_mlp(dtype) for _ in range(num_workers)]  # seeded: the same initial weights
    inner_optimizers = [torch.optim.AdamW(model.parameters(), **ADAMW_KW) for model in models]
    weights = [list(model.parameters()) for model in models]
    outer = [p.detach().clone() for p in weights[0]]
    momentum = [torch.zeros_like(p) for p in outer]
    residuals = [[torch.zeros_like(p) for p in outer] for _ in range(num_workers)]
    servers = [[torch.zeros_like(p) for p in outer] for _ in range(num_workers)]
    two_stage = outer_dtype != "float32" and num_workers > 2
    history = []
    pending: list[tuple[int, dict[int, torch.Tensor]]] = []  # (the step after which it applies, {tensor: average})

    def outer_update(averages: dict[int, torch.Tensor]) -> None:
        for i, p in averages.items():
            momentum[i].mul_(OUTER_MOMENTUM).add_(p)
            outer[i].sub_(p.add(momentum[i], alpha=OUTER_MOMENTUM), alpha=OUTER_LR)
            for w in weights:
                if overlap_alpha == 0.0:
                    w[i].copy_(outer[i])
                else:
                    w[i].mul_(overlap_alpha).add_(outer[i], alpha=1.0 - overlap_alpha)

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
        averaged: list[list[torch.Tensor | None]] = [[None] * len(outer) for _ in range(num_workers)]
        due = False
        with torch.no_grad():
            while pending and pending[0][0] == t:
                outer_update(pending.pop(0)[1])
            due_now = [
                i
                for i, fragment in enumerate(FRAGMENTS[num_fragments])
                if (t - fragment * inner_steps // num_fragments) % inner_steps == 0
            ]
            received = [[None] * len(outer) for _ in range(num_workers)]
            for worker, w in enumerate(weights):
                pseudo = [outer[i] - w[i] for i in due_now]
                if outer_dtype != "float32":
                    pseudo = [q + residuals[worker][i] for q, i in zip(pseudo, due_now)]
                if not pseudo:
                    continue
                sent = compressed(torch.cat([q.reshape(-1) for q in pseudo]), outer_dtype)
                for i, q, got in zip(due_now, pseudo, sent.split([q.numel() for q in pseudo])):
                    averaged[worker][i] = q
                    received[worker][i] = got.view(q.shape)
                    if outer_dtype != "float32":
                        residuals[worker][i] = q - received[worker][i]
            averages = {}
            if due_now:
                due = True
                shapes = [outer[i].shape for i in due_now]
                flat = [torch.cat([received[w][i].reshape(-1) for i in due_now]) for w in range(num_workers)]
                p = flat[0]
                for q in flat[1:]:
                    p = p + q  # the fixed order: worker 0, 1, 2, ...
                p = p / num_workers
                if two_stage:
                    again = torch.empty_like(p)
                    for w, (start, stop) in enumerate(chunk_bounds(p.numel(), num_workers, outer_dtype)):
                        kept = torch.cat([servers[w][i].reshape(-1) for i in due_now])
                        share = p[start:stop] + kept[start:stop]
                        again[start:stop] = compressed(share, outer_dtype)
                        kept[start:stop] = share - again[start:stop]
                        for i, e in zip(due_now, kept.split([outer[i].numel() for i in due_now])):
                            servers[w][i] = e.view(outer[i].shape).clone()
                    p = again
                for i, shape, average in zip(due_now, shapes, p.split([outer[i].numel() for i in due_now])):
                    averages[i] = average.view(shape)
            if overlap_steps == 0:
                outer_update(averages)
            elif averages:
                pending.append((t + overlap_steps, averages))
        history.append(
            Snapshot(
                inner=[[p.detach().clone() for p in w] for w in weights],
                outer=[p.clone() for p in outer],
                momentum=[b.clone() for b in momentum],
                pseudo_gradients=averaged if due else None,
                residuals=[[e.clone() for e in r] for r in residuals],
                server_residuals=[[e.clone() for e in r] for r in servers],
            )
        )
    return history
