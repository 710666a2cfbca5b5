"""The hyper-parameters' defaults and ranges, and their checks: the one place either is written down.

Every hf_gpa optimizer checks its arguments here before any state exists, and `GPATrainingArguments` calls the same
functions with the flag's name (``name="--gpa_mu_x"``), so a range or a default exists once. A check raises a
``ValueError`` that names the argument, the value and the allowed range; a value that is not a number (a string, None,
a bool) is rejected the same way rather than failing later with a ``TypeError``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

#: GPA's averaging constant: the paper's mu_x for H = 32 DiLoCo inner steps with outer momentum 0.9 (Section 3.1).
DEFAULT_MU_X = 0.9967
#: GPA's interpolation constant of the gradient point y.
DEFAULT_MU_Y = 0.7
#: How x averages z: an exponential moving average with constant mu_x, or Schedule-Free's lr**2-weighted average.
AVERAGING_MODES = ("gpa", "schedule_free")
DEFAULT_AVERAGING = "gpa"
#: Single-worker DiLoCo: inner steps H, outer (Nesterov) learning rate and momentum (paper, Algorithm 2).
DEFAULT_INNER_STEPS = 32
DEFAULT_OUTER_LR = 0.7
#: DiLoCo's outer momentum, also the mu of the paper's conversion mu_x = mu ** (1 / H) (Table 4).
DEFAULT_OUTER_MOMENTUM = 0.9


def _number(value: Any, name: str, allowed: str) -> float:
    """``value`` as a float, or a ValueError: bools, strings, None and tensors are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Invalid {name}: {value!r} (must be a number {allowed})")
    return float(value)


def check_lr(lr: Any) -> None:
    if torch.is_tensor(lr) and lr.numel() != 1:
        raise ValueError(f"Invalid learning rate: a tensor lr must have one element, got shape {tuple(lr.shape)}")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr} (lr must be >= 0)")


def check_mu_x(mu_x: Any, name: str = "mu_x") -> float:
    """mu_x in [0, 1): 0 gives the base optimizer, 1 would never move x."""
    value = _number(mu_x, name, "in [0, 1)")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"Invalid {name}: {mu_x!r} (must lie in [0, 1))")
    return value


def check_mu_y(mu_y: Any, name: str = "mu_y") -> float:
    """mu_y in (0, 1]: the memory-efficient form recovers x as (y - (1 - mu_y) z) / mu_y."""
    value = _number(mu_y, name, "in (0, 1]")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"Invalid {name}: {mu_y!r} (must lie in (0, 1]; x is recovered by dividing by mu_y)")
    return value


def check_mu(mu_x: Any, mu_y: Any) -> None:
    check_mu_x(mu_x)
    check_mu_y(mu_y)


def check_averaging(averaging: Any, name: str = "averaging") -> str:
    if not isinstance(averaging, str) or averaging not in AVERAGING_MODES:
        raise ValueError(f"Invalid {name}: {averaging!r} (must be one of {', '.join(AVERAGING_MODES)})")
    return averaging


def check_inner_steps(inner_steps: Any, name: str = "inner_steps") -> int:
    """An integer H >= 1 (an integral float such as 32.0, as a JSON file may hold, is taken as that integer)."""
    integral = isinstance(inner_steps, numbers.Integral) or (
        isinstance(inner_steps, float) and inner_steps.is_integer()
    )
    if isinstance(inner_steps, bool) or not integral or inner_steps < 1:
        raise ValueError(f"Invalid {name}: {inner_steps!r} (must be an integer >= 1)")
    return int(inner_steps)


def check_outer_lr(outer_lr: Any, name: str = "outer_lr") -> float:
    value = _number(outer_lr, name, "> 0")
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"Invalid {name}: {outer_lr!r} (must be finite and > 0)")
    return value


def check_outer_momentum(outer_momentum: Any, name: str = "outer_momentum") -> float:
    value = _number(outer_momentum, name, "in [0, 1)")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"Invalid {name}: {outer_momentum!r} (must lie in [0, 1))")
    return value


def check_diloco(inner_steps: Any, outer_lr: Any, outer_momentum: Any) -> None:
    check_inner_steps(inner_steps)
    check_outer_lr(outer_lr)
    check_outer_momentum(outer_momentum)


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
    hyper-parameter names (lr, betas, ...), which the wrapper then carries in its own param groups. A base whose
    groups must say something (``MuonWithAuxAdam``'s ``use_muon``) names it in its class attribute ``probe_group``.
    """
    if not (isinstance(base, type) and issubclass(base, torch.optim.Optimizer)):
        raise ValueError(f"Invalid base: {base!r} (must be a torch.optim.Optimizer subclass)")
    defaults = dict(base([probe_group(base, torch.zeros(2, 2, requires_grad=True))], **base_kwargs).defaults)
    overlap = sorted(set(defaults) & set(reserved))
    if overlap:
        raise ValueError(f"Invalid base: {base.__name__} uses hyper-parameter names reserved by {owner}: {overlap}")
    return defaults


def probe_group(base: Any, tensor: torch.Tensor) -> dict[str, Any]:
    """A param group of ``tensor`` that ``base`` accepts: with the keys of ``base.probe_group``, if it has one."""
    return {"params": [tensor], **getattr(base, "probe_group", {})}
