"""The noisy least-squares run the precision tests share: x after a cosine-scheduled GPA run (torch only)."""

from __future__ import annotations

import torch

from hf_gpa.optim import GPAAdamW


def least_squares_x(
    dtype: torch.dtype, impl: dict, mu_y: float = 0.3, steps: int = 400, optimizer: type = GPAAdamW
) -> torch.Tensor:
    """x after a cosine-scheduled GPAAdamW (or GPA) run on noisy least squares; the loss is computed in float32."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 16, generator=gen)
    b = a @ torch.randn(16, generator=gen)
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
