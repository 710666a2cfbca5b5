"""GPA across workers simulated in one process: the plain loop a `GPADiLoCo` run across processes must reproduce.

M workers, each an island of S ranks, train copies of one model from the same initial weights w: x = z = w. Every
inner step each rank of an island takes the gradient of its own rows of the global batch, the island averages them
(as DDP does) and the worker's own ``torch.optim.AdamW`` steps its copy. At the steps where a fragment is due
(fragment k at the steps t with (t - k H // P) % H == 0), for each of its tensors:

    y = mu_y x + (1 - mu_y) z        (the restart point of the period, torch.lerp(z, x, mu_y))
    p = (sum_m (y - w_m)) / M        (in the fixed order m = 0, 1, ...)
    z <- z - outer_lr p,   x <- mu_x x + (1 - mu_x) z,   y <- mu_y x + (1 - mu_y) z,   w_m <- y

Written from the equations of docs/distributed.md with nothing of hf_gpa; the model, batches, fragments and AdamW
settings are those of ``diloco_simulation``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diloco_simulation import ADAMW_KW, FRAGMENTS, rank_rows
from distributed_workers import build_mlp, mse

#: The outer hyper-parameters of the tests: mu_x != mu_y, so that the run is not DiLoCo's.
OUTER_LR, MU_X, MU_Y = 1.5, 0.8, 0.6


@dataclass
class Snapshot:
    """After one inner step (and the outer step it ends, if any): each worker's inner weights, x and z."""

    inner: list[list[torch.Tensor]]
    x: list[torch.Tensor]
    z: list[torch.Tensor]


def simulate(
    num_workers: int,
    island_size: int,
    inner_steps: int,
    steps: int,
    num_fragments: int = 1,
    outer_lr: float = OUTER_LR,
    mu_x: float = MU_X,
    mu_y: float = MU_Y,
) -> list[Snapshot]:
    world_size = num_workers * island_size
    models = [build_mlp(torch.float32) for _ in range(num_workers)]
    optimizers = [torch.optim.AdamW(model.parameters(), **ADAMW_KW) for model in models]
    weights = [list(model.parameters()) for model in models]
    x = [p.detach().clone() for p in weights[0]]
    z = [p.detach().clone() for p in weights[0]]
    history = []
    for t in range(1, steps + 1):
        for worker, (model, optimizer) in enumerate(zip(models, optimizers)):
            grads = []
            for rank in range(worker * island_size, (worker + 1) * island_size):
                model.zero_grad()
                mse(model, *rank_rows(t - 1, rank, world_size, torch.float32)).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for i, p in enumerate(model.parameters()):
                island = [g[i] for g in grads]
                p.grad = island[0] if island_size == 1 else sum(island[1:], island[0]) / island_size
            optimizer.step()
        with torch.no_grad():
            for i, fragment in enumerate(FRAGMENTS[num_fragments]):
                if (t - fragment * inner_steps // num_fragments) % inner_steps:
                    continue
                y = torch.lerp(z[i], x[i], mu_y)
                p = y - weights[0][i]
                for w in weights[1:]:
                    p = p + (y - w[i])
                p = p / num_workers
                z[i].sub_(p, alpha=outer_lr)
                x[i] = torch.lerp(z[i], x[i], mu_x)
                y = torch.lerp(z[i], x[i], mu_y)
                for w in weights:
                    w[i].copy_(y)
        history.append(
            Snapshot(
                inner=[[p.detach().clone() for p in w] for w in weights],
                x=[t_.clone() for t_ in x],
                z=[t_.clone() for t_ in z],
            )
        )
    return history
