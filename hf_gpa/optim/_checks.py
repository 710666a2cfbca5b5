"""Argument checks shared by the optimizers: every hyper-parameter is checked before any state exists."""

from __future__ import annotations

from typing import Any

import torch

AVERAGING_MODES = ("gpa", "schedule_free")


def check_lr(lr: Any) -> None:
    if torch.is_tensor(lr) and lr.numel() != 1:
        raise ValueError(f"Invalid learning rate: a tensor lr must have one element, got shape {tuple(lr.shape)}")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr} (lr must be >= 0)")


def check_mu(mu_x: float, mu_y: float) -> None:
    if not 0.0 <= mu_x < 1.0:
        raise ValueError(f"Invalid mu_x: {mu_x} (mu_x must lie in [0, 1))")
    if not 0.0 < mu_y <= 1.0:
        raise ValueError(f"Invalid mu_y: {mu_y} (mu_y must lie in (0, 1])")


def check_averaging(averaging: str) -> None:
    if averaging not in AVERAGING_MODES:
        raise ValueError(f"Invalid averaging: {averaging!r} (must be one of {', '.join(AVERAGING_MODES)})")


def check_adam(betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas} (must be a pair (beta1, beta2))")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]} (beta1 must lie in [0, 1))")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]} (beta2 must lie in [0, 1))")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps} (eps must be >= 0)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (weight_decay must be >= 0)")


def base_defaults(base: Any, base_kwargs: dict[str, Any], reserved: tuple[str, ...], owner: str) -> dict[str, Any]:
    """The defaults of a base optimizer class with ``base_kwargs`` applied, checked by the base itself.

    Instantiating the base on a dummy tensor runs its own argument checks now, before any work, and yields its
    hyper-parameter names (lr, betas, ...), which the wrapper then carries in its own param groups.
    """
    if not (isinstance(base, type) and issubclass(base, torch.optim.Optimizer)):
        raise ValueError(f"Invalid base: {base!r} (must be a torch.optim.Optimizer subclass)")
    defaults = dict(base([torch.zeros(2, 2, requires_grad=True)], **base_kwargs).defaults)
    overlap = sorted(set(defaults) & set(reserved))
    if overlap:
        raise ValueError(f"Invalid base: {base.__name__} uses hyper-parameter names reserved by {owner}: {overlap}")
    return defaults
