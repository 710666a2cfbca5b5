"""Conversions between GPA's averaging constant and DiLoCo's number of inner steps, and the averaging weights.

The paper (Section 3.1, Table 4) matches GPA to single-worker DiLoCo with H inner steps and outer momentum mu by
asking that the weight on an old average after H steps be the same: ``mu_x ** H == mu``, so ``mu_x = mu ** (1/H)``.
"""

from __future__ import annotations

import math

import torch

from ._types import DEFAULT_OUTER_MOMENTUM, Averaging

__all__ = ["mu_x_from_inner_steps", "inner_steps_from_mu_x", "averaging_mu_x"]


def _check_mu(mu: float) -> None:
    if not 0.0 < mu < 1.0:
        raise ValueError(f"Invalid mu: {mu} (DiLoCo's outer momentum must lie in (0, 1))")


def mu_x_from_inner_steps(inner_steps: float, mu: float = DEFAULT_OUTER_MOMENTUM) -> float:
    """GPA's ``mu_x`` that matches DiLoCo with ``inner_steps`` (H) inner steps and outer momentum ``mu``.

    ``mu_x = mu ** (1 / H)`` (paper, Table 4): H=32, mu=0.9 gives 0.99671.
    """
    if isinstance(inner_steps, bool) or not 1 <= inner_steps < math.inf:
        # H = inf would give mu_x = mu ** 0 = 1.0: an x that never moves, which no GPA optimizer accepts.
        raise ValueError(f"Invalid inner_steps: {inner_steps} (must be finite and >= 1)")
    _check_mu(mu)
    return mu ** (1.0 / inner_steps)


def inner_steps_from_mu_x(mu_x: float, mu: float = DEFAULT_OUTER_MOMENTUM) -> float:
    """The effective number of DiLoCo inner steps H of a GPA ``mu_x``: the inverse of `mu_x_from_inner_steps`."""
    if not 0.0 < mu_x < 1.0:
        raise ValueError(f"Invalid mu_x: {mu_x} (must lie in (0, 1) to have an effective number of inner steps)")
    _check_mu(mu)
    return math.log(mu) / math.log(mu_x)


def averaging_mu_x(averaging: str, mu_x: float, lr: float | torch.Tensor, weight_sum: float) -> tuple[float, float]:
    """The weight on the old average x for this step, and the updated sum of averaging weights.

    ``"gpa"``: the constant ``mu_x`` (an exponential moving average of z).
    ``"schedule_free"``: Schedule-Free's weighted uniform average (paper eq. 5) with weights ``lr_t ** 2``:
    ``x_{t+1} = (1 - c) x_t + c z_{t+1}`` with ``c = lr_t**2 / sum_{i<=t} lr_i**2``; while every weight so far is 0
    (an lr warm-up that starts at 0) the average stays where it is. A tensor ``lr`` is read on the host only there.
    """
    if averaging == Averaging.GPA:
        return mu_x, weight_sum
    lr = float(lr)
    weight = lr * lr
    weight_sum = weight_sum + weight
    c = weight / weight_sum if weight_sum > 0.0 else 0.0
    return 1.0 - c, weight_sum
