"""GPA across workers simulated in one process: the plain loop a `GPADiLoCo` run across processes must reproduce.

M workers, each an island of S ranks, train copies of one model from the same initial weights w: x = z = w. Every
inner step each rank of an island takes the gradient of its own rows of the global batch, the island averages them
(as DDP does) and the worker's own ``torch.optim.AdamW`` steps its copy. At the steps where a fragment is due
(fragment k at the steps t with (t - k H // P) % H == 0), for each of its tensors:

    y = mu_y x + (1 - mu_y) z        (the restart point of the period, torch.lerp(z, x, mu_y))
    p = (sum_m (y - w_m)) / M        (in the fixed order m = 0, 1, ...)
    z <- z - outer_lr p,   x <- mu_x x + (1 - mu_x) z,   y <- mu_y x + (1 - mu_y) z,   w_m <- y

Written from the equations of docs/gpa_across_workers.md, nothing of hf_gpa; the loop (the model, batches,
fragments, the AdamW settings, a compressed or overlapped sync) is ``diloco_simulation``'s, with this outer step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import diloco_simulation
import torch

#: The outer hyper-parameters of the tests: mu_x != mu_y, so that the run is not DiLoCo's.
OUTER_LR, MU_X, MU_Y = 1.5, 0.8, 0.6


@dataclass
class Snapshot:
    """After one inner step (and the outer step it ends, if any): each worker's inner weights, x and z."""

    #: The outer tensors a worker's record holds after every step, under these names too.
    outer_keys: ClassVar[tuple[str, ...]] = ("x", "z")

    inner: list[list[torch.Tensor]]
    x: list[torch.Tensor]
    z: list[torch.Tensor]


class PrimalAveragingStep:
    """GPA's outer step: the pseudo-gradients are taken from y = torch.lerp(z, x, mu_y); z <- z - outer_lr p,
    x <- torch.lerp(z, x, mu_x), and the workers restart from the new y."""

    def __init__(self, initial: list[torch.Tensor], outer_lr: float, mu_x: float, mu_y: float) -> None:
        self.x = [p.clone() for p in initial]
        self.z = [p.clone() for p in initial]
        self.outer_lr, self.mu_x, self.mu_y = outer_lr, mu_x, mu_y

    def reference(self, i: int) -> torch.Tensor:
        return torch.lerp(self.z[i], self.x[i], self.mu_y)

    def update(self, i: int, p: torch.Tensor) -> torch.Tensor:
        self.z[i].sub_(p, alpha=self.outer_lr)
        self.x[i] = torch.lerp(self.z[i], self.x[i], self.mu_x)
        return torch.lerp(self.z[i], self.x[i], self.mu_y)

    def state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.x, self.z


def simulate(
    num_workers: int,
    island_size: int,
    inner_steps: int,
    steps: int,
    num_fragments: int = 1,
    outer_lr: float = OUTER_LR,
    mu_x: float = MU_X,
    mu_y: float = MU_Y,
    **sync: Any,
) -> list[Snapshot]:
    """``diloco_simulation.simulate`` with GPA's outer step; ``sync``: its outer_dtype, overlap_steps, overlap_alpha,
    synchronize."""
    history = diloco_simulation.simulate(
        num_workers, island_size, inner_steps, num_fragments, steps,
        outer_step=functools.partial(PrimalAveragingStep, outer_lr=outer_lr, mu_x=mu_x, mu_y=mu_y), **sync,
    )  # fmt: skip
    return [Snapshot(inner=s.inner, x=s.outer, z=s.momentum) for s in history]
