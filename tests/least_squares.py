"""The noisy least-squares run the precision tests and ``benchmarks/bf16_lowmem_study.py`` share (torch only)."""

from __future__ import annotations

import torch

from hf_gpa.optim import GPAAdamW


def least_squares_problem(seed: int = 0, noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """(a, b, the generator that then draws the batches): 256 x 16 least squares, targets with ``noise`` std."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(256, 16, generator=gen)
    b = a @ torch.randn(16, generator=gen)
    if noise:
        b = b + noise * torch.randn(256, generator=gen)
    return a, b, gen


def least_squares_x(
    dtype: torch.dtype,
    impl: dict,
    mu_y: float = 0.3,
    steps: int = 400,
    optimizer: type = GPAAdamW,
    *,
    lr: float = 0.05,
    mu_x: float = 0.98,
    noise: float = 0.0,
) -> torch.Tensor:
    """x after a cosine-scheduled GPAAdamW (or GPA) run on least squares (seed 0); the loss is computed in float32."""
    a, b, gen = least_squares_problem(0, noise)
    w = torch.nn.Parameter(torch.zeros(16, dtype=dtype))
    opt = optimizer([w], lr=lr, mu_x=mu_x, mu_y=mu_y, **impl)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    for _ in range(steps):
        idx = torch.randint(0, 256, (32,), generator=gen)
        opt.zero_grad()
        ((a[idx] @ w.float() - b[idx]) ** 2).mean().backward()
        opt.step()
        sched.step()
    opt.eval()
    return w.detach().float()
