"""The two elementwise passes the GPA wrapper adds around its base optimizer's step.

    before the base step:  y <- mu_x (y - (1 - mu_y) z)     (= mu_x mu_y x)
    after it:              y <- y + (1 - mu_x mu_y) z'

Each is one pass over memory: the fused CPU kernel on contiguous CPU tensors, foreach ops elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch

from ._kernels import load_cpu_kernel

__all__ = ["foreach_axpby_", "foreach_add_scaled_"]


def _cpu_pass_kernel(ys: list[torch.Tensor], zs: list[torch.Tensor]) -> Any:
    """The fused CPU kernel module when every tensor is a contiguous CPU tensor and it can be had, else None."""
    if all(t.device.type == "cpu" and t.is_contiguous() for t in (*ys, *zs)):
        return load_cpu_kernel()
    return None


def foreach_axpby_(ys: list[torch.Tensor], zs: list[torch.Tensor], alpha: float, scale: float) -> None:
    """y <- scale * (y - alpha * z), with z possibly of a wider dtype than y."""
    kernel = _cpu_pass_kernel(ys, zs)
    if kernel is not None:
        kernel.gpa_wrapper_pass(ys, zs, alpha, scale, True)
    elif all(y.dtype == z.dtype for y, z in zip(ys, zs)):
        torch._foreach_sub_(ys, zs, alpha=alpha)
        torch._foreach_mul_(ys, scale)
    else:
        for y, z in zip(ys, zs):
            y.copy_(torch.sub(y.to(z.dtype), z, alpha=alpha).mul_(scale))


def foreach_add_scaled_(ys: list[torch.Tensor], zs: list[torch.Tensor], c: float) -> None:
    """y <- y + c * z, with z possibly of a wider dtype than y."""
    kernel = _cpu_pass_kernel(ys, zs)
    if kernel is not None:
        kernel.gpa_wrapper_pass(ys, zs, c, 1.0, False)
    elif all(y.dtype == z.dtype for y, z in zip(ys, zs)):
        torch._foreach_add_(ys, zs, alpha=c)
    else:
        for y, z in zip(ys, zs):
            y.copy_(torch.add(y.to(z.dtype), z, alpha=c))
