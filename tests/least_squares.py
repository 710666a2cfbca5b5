"""The noisy least-squares run the precision tests share: x after a cosine-scheduled GPA run (torch only)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hf_gpa.optim import GPAAdamW

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bf16_lowmem_study import problem  # noqa: E402


def least_squares_problem(noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """A (256 x 16), the targets b (with ``noise`` times Gaussian noise added: the fp32 run's loss is then the noise
    floor) and the generator that draws the minibatches next: benchmarks/bf16_lowmem_study.py's problem, seed 0."""
    return problem(0, noise)


def least_squares_x(
    dtype: torch.dtype,
    impl: dict,
    mu_y: float = 0.3,
    steps: int = 400,
    optimizer: type = GPAAdamW,
    noise: float = 0.0,
) -> torch.Tensor:
    """x after a cosine-scheduled GPAAdamW (or GPA) run on least squares with minibatch noise (and ``noise`` in the
    targets); the loss is computed in float32."""
    a, b, gen = least_squares_problem(noise)
    w = torch.nn.Parameter(torch.zeros(16, dtype=dtype))
    opt = optimizer([w], lr=0.05, mu_x=0.98, mu_y=mu_y, **impl)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    for _ in range(steps):
        idx = torch.randint(0, 256, (32,), generator=gen)
        opt.zero_grad()
        ((a[idx] @ w.float() - b[idx]) ** 2).mean().backward()
        opt.step()
        sched.step()
    opt.eval()
    return w.detach().float()
