"""The hyper-parameters' ranges and their checks: the one place a range is written down.

Every hf_gpa optimizer checks each param group with these, the constructor's and those added later alike
(``_base.CheckedGroups``: torch's constructor adds its groups through ``add_param_group``), before any
state exists, and `GPATrainingArguments` calls the same functions with the flag's name (``name="--gpa_mu_x"``). A
check raises a ``ValueError`` that names the argument, the value and the allowed range; a value that is not a number
(a string, None, a bool) is rejected the same way rather than failing later with a ``TypeError``. The defaults live
in ``_types``. The wrappers check the values most bases share (``check_common``: torch's AdamW would take
``eps=inf``) before their base's own constructor checks.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ._types import AVERAGING_MODES, STATE_DTYPES, Averaging


def as_number(value: Any, name: str, allowed: str) -> float:
    """``value`` as a float, or a ValueError: bools, strings, None and tensors are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Invalid {name}: {value!r} (must be a number {allowed})")
    return float(value)


def _finite_at_least_zero(value: Any, name: str) -> float:
    number = as_number(value, name, ">= 0")
    if not (number >= 0.0 and math.isfinite(number)):
        raise ValueError(f"Invalid {name}: {value!r} (must be finite and >= 0)")
    return number


def check_lr(lr: Any, name: str = "lr") -> None:
    """A finite lr >= 0: a number, or a one-element tensor as in torch's optimizers."""
    if torch.is_tensor(lr):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element (invalid learning rate {name}: shape {tuple(lr.shape)})")
        if lr.is_complex() or lr.dtype == torch.bool:
            raise ValueError(f"Invalid learning rate {name}: a tensor of dtype {lr.dtype} (must be real)")
        value: Any = lr.item()
    else:
        value = lr
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Invalid learning rate {name}: {lr!r} (must be a number >= 0)")
    if not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"Invalid learning rate {name}: {lr!r} (must be finite and >= 0)")


def in_unit_interval(value: Any, name: str, *, with_0: bool = True, with_1: bool = False, why: str = "") -> float:
    """``value`` as a float in the unit interval, with or without each end (``with_0``, ``with_1``), or a ValueError
    naming the interval (and ``why``, after a semicolon)."""
    allowed = f"{'[' if with_0 else '('}0, 1{']' if with_1 else ')'}"
    number = as_number(value, name, f"in {allowed}")
    if not ((number >= 0.0 if with_0 else number > 0.0) and (number <= 1.0 if with_1 else number < 1.0)):
        raise ValueError(f"Invalid {name}: {value!r} (must lie in {allowed}{'; ' + why if why else ''})")
    return number


def check_mu_x(mu_x: Any, name: str = "mu_x") -> float:
    """mu_x in [0, 1): 0 gives the base optimizer, 1 would never move x."""
    return in_unit_interval(mu_x, name)


def check_mu_y(mu_y: Any, name: str = "mu_y") -> float:
    """mu_y in (0, 1]: the memory-efficient form recovers x as (y - (1 - mu_y) z) / mu_y."""
    return in_unit_interval(mu_y, name, with_0=False, with_1=True, why="x is recovered by dividing by mu_y")


def check_mu(mu_x: Any, mu_y: Any) -> None:
    check_mu_x(mu_x)
    check_mu_y(mu_y)


def check_averaging(averaging: Any, name: str = "averaging") -> str:
    """One of the `Averaging` modes, returned as its plain string (what a param group and a state dict hold)."""
    if not isinstance(averaging, str) or averaging not in AVERAGING_MODES:
        raise ValueError(f"Invalid {name}: {averaging!r} (must be one of {', '.join(AVERAGING_MODES)})")
    return Averaging(averaging).value


def _positive_integer(value: Any, name: str, allowed: str = "") -> int:
    """An integer >= 1 (an integral float such as 32.0, as a JSON file may hold, is taken as that integer)."""
    integral = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value < 1:
        raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= 1{allowed})")
    return int(value)


def check_inner_steps(inner_steps: Any, name: str = "inner_steps") -> int:
    """An integer H >= 1."""
    return _positive_integer(inner_steps, name)


def check_num_workers(num_workers: Any, world_size: int, name: str = "num_workers") -> int:
    """M >= 1 dividing the world size W: each of the M workers is an island of W / M processes."""
    allowed = f" that divides the world size {world_size}: one of {_divisors(world_size)}"
    value = _positive_integer(num_workers, name, allowed)
    if world_size % value:
        raise ValueError(
            f"Invalid {name}: {num_workers!r} (must divide the world size {world_size}, each worker being an island "
            f"of world_size / {name} processes: one of {_divisors(world_size)})"
        )
    return value


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_num_fragments(
    num_fragments: Any, num_tensors: int | None = None, inner_steps: int | None = None, name: str = "num_fragments"
) -> int:
    """P >= 1 fragments, at most one per parameter tensor (``num_tensors``) and one per inner step of the period
    (``inner_steps``), so that each fragment holds a tensor and synchronises at a step of its own."""
    value = _positive_integer(num_fragments, name)
    if num_tensors is not None and value > num_tensors:
        raise ValueError(
            f"Invalid {name}: {num_fragments!r} (must lie in [1, {num_tensors}]: the parameters are {num_tensors} "
            "tensors, and each fragment holds at least one)"
        )
    if inner_steps is not None and value > inner_steps:
        raise ValueError(
            f"Invalid {name}: {num_fragments!r} (must lie in [1, inner_steps = {inner_steps}]: each fragment "
            "synchronises at its own inner step of the period)"
        )
    return value


def check_outer_lr(outer_lr: Any, name: str = "outer_lr") -> float:
    value = as_number(outer_lr, name, "> 0")
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"Invalid {name}: {outer_lr!r} (must be finite and > 0)")
    return value


def check_outer_momentum(outer_momentum: Any, name: str = "outer_momentum") -> float:
    return in_unit_interval(outer_momentum, name)


def check_weight_decay(weight_decay: Any, name: str = "weight_decay value") -> None:
    _finite_at_least_zero(weight_decay, name)


def check_eps(eps: Any, name: str = "epsilon value") -> None:
    _finite_at_least_zero(eps, name)


def check_betas(betas: Any, name: str = "betas") -> None:
    """A pair (beta1, beta2) of numbers in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid {name}: {betas!r} (must be a pair (beta1, beta2))")
    for index, beta in enumerate(betas):
        value = as_number(beta, f"beta parameter at index {index}", "in [0, 1)")
        if not 0.0 <= value < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta!r} (beta{index + 1} must lie in [0, 1))")


def check_adam(betas: Any, eps: Any, weight_decay: Any) -> None:
    """AdamW's betas (a pair in [0, 1)), eps (>= 0) and decoupled weight decay (>= 0), all finite numbers."""
    check_betas(betas)
    check_eps(eps)
    check_weight_decay(weight_decay)


def check_flag(value: Any, name: str, optional: bool = False) -> None:
    """A bool (``maximize``), or a bool or None (``foreach``, ``fused``: None lets the optimizer choose)."""
    if not (isinstance(value, bool) or (optional and value is None)):
        allowed = "True, False or None" if optional else "True or False"
        raise ValueError(f"Invalid {name}: {value!r} (must be {allowed})")


def check_state_dtype(state_dtype: Any, name: str = "state_dtype") -> str:
    if not isinstance(state_dtype, str) or state_dtype not in STATE_DTYPES:
        raise ValueError(f"Invalid {name}: {state_dtype!r} (must be one of {', '.join(STATE_DTYPES)})")
    return state_dtype


def check_implementation(foreach: Any, fused: Any) -> None:
    check_flag(foreach, "foreach", optional=True)
    check_flag(fused, "fused", optional=True)
    if fused and foreach:
        raise ValueError("Invalid arguments: fused=True and foreach=True cannot both be set")


def check_common(values: dict[str, Any]) -> None:
    """The values most optimizers share, where given: lr, weight_decay, a numeric eps (Adafactor's is a pair),
    AdamW-style betas (a pair), maximize. A base optimizer's own checks come on top (``_wrapper.base_defaults``)."""
    if "lr" in values:
        check_lr(values["lr"])
    if "weight_decay" in values:
        check_weight_decay(values["weight_decay"])
    if isinstance(values.get("eps"), numbers.Real):
        check_eps(values["eps"])
    if isinstance(values.get("betas"), (tuple, list)) and len(values["betas"]) <= 2:
        check_betas(values["betas"])
    if "maximize" in values:
        check_flag(values["maximize"], "maximize")
