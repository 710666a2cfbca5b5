"""The hyper-parameters' ranges and their checks: the one place a range is written down.

Every hf_gpa optimizer checks each param group here, the constructor's and those added later alike
(`CheckedGroups`: torch's constructor adds its groups through ``add_param_group``), before any state exists, and
`GPATrainingArguments` calls the same functions with the flag's name (``name="--gpa_mu_x"``). A check raises a
``ValueError`` that names the argument, the value and the allowed range; a value that is not a number (a string,
None, a bool) is rejected the same way rather than failing later with a ``TypeError``. The defaults live in
``_types``. `MuonWithAuxAdam`'s groups are checked here too (``check_muon_group``), and the wrappers check the values
most bases share (``check_common``: torch's AdamW would take ``eps=inf``) before their base's own constructor checks.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from ._types import ADJUST_LR_FNS, AVERAGING_MODES, HALF_STATE_MODES, Averaging


def _number(value: Any, name: str, allowed: str) -> float:
    """``value`` as a float, or a ValueError: bools, strings, None and tensors are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Invalid {name}: {value!r} (must be a number {allowed})")
    return float(value)


def _finite_at_least_zero(value: Any, name: str) -> float:
    number = _number(value, name, ">= 0")
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


def check_weight_decay(weight_decay: Any, name: str = "weight_decay value") -> None:
    _finite_at_least_zero(weight_decay, name)


def check_eps(eps: Any, name: str = "epsilon value") -> None:
    _finite_at_least_zero(eps, name)


def check_betas(betas: Any, name: str = "betas") -> None:
    """A pair (beta1, beta2) of numbers in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid {name}: {betas!r} (must be a pair (beta1, beta2))")
    for index, beta in enumerate(betas):
        value = _number(beta, f"beta parameter at index {index}", "in [0, 1)")
        if not 0.0 <= value < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta!r} (beta{index + 1} must lie in [0, 1))")


def check_adam(betas: Any, eps: Any, weight_decay: Any) -> None:
    """AdamW's betas (a pair in [0, 1)), eps (>= 0) and decoupled weight decay (>= 0), all finite numbers."""
    check_betas(betas)
    check_eps(eps)
    check_weight_decay(weight_decay)


def check_muon_group(group: dict[str, Any]) -> None:
    """A `MuonWithAuxAdam` param group: ``use_muon``, Muon's and AdamW's values, Muon's parameters (matrices)."""
    use_muon = group.get("use_muon")
    if not isinstance(use_muon, bool):
        raise ValueError(
            f"Invalid use_muon: {use_muon!r} (every param group of MuonWithAuxAdam must set use_muon=True (Muon: "
            "hidden 2-D weight matrices) or use_muon=False (AdamW: embeddings, output head, norms, biases); "
            "muon_param_groups(model) builds them)"
        )
    check_lr(group["lr"])
    check_weight_decay(group["weight_decay"])
    momentum = _number(group["momentum"], "momentum", "in [0, 1)")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Invalid momentum: {group['momentum']!r} (must lie in [0, 1))")
    check_flag(group["nesterov"], "nesterov")
    coefficients = group["ns_coefficients"]
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
        raise ValueError(f"Invalid ns_coefficients: {coefficients!r} (must be three finite numbers (a, b, c))")
    for value in coefficients:
        if not math.isfinite(_number(value, "ns_coefficients", "(three finite numbers (a, b, c))")):
            raise ValueError(f"Invalid ns_coefficients: {coefficients!r} (must be three finite numbers (a, b, c))")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 1 <= steps < 100:
        raise ValueError(f"Invalid ns_steps: {steps!r} (must be an integer in [1, 100))")
    ns_eps = _number(group["ns_eps"], "ns_eps", "> 0")
    if not (ns_eps > 0.0 and math.isfinite(ns_eps)):
        raise ValueError(f"Invalid ns_eps: {group['ns_eps']!r} (must be finite and > 0)")
    if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(
            f"Invalid adjust_lr_fn: {group['adjust_lr_fn']!r} (must be one of {', '.join(ADJUST_LR_FNS)}, or None "
            "for torch's default 'original')"
        )
    check_betas(group["betas"])
    check_eps(group["eps"])
    check_flag(group["foreach"], "foreach", optional=True)
    if use_muon:
        for p in group["params"]:
            if p.ndim not in (2, 3):
                raise ValueError(
                    f"Invalid param group: use_muon=True takes only 2-D parameters (hidden weight matrices) and 3-D "
                    f"ones (a stack of matrices, such as MoE experts), got a parameter of shape {tuple(p.shape)}; put "
                    "it in a use_muon=False (AdamW) group"
                )
            if torch.is_complex(p):
                raise ValueError("Invalid param group: use_muon=True takes no complex parameters")


def check_flag(value: Any, name: str, optional: bool = False) -> None:
    """A bool (``maximize``), or a bool or None (``foreach``, ``fused``: None lets the optimizer choose)."""
    if not (isinstance(value, bool) or (optional and value is None)):
        allowed = "True, False or None" if optional else "True or False"
        raise ValueError(f"Invalid {name}: {value!r} (must be {allowed})")


def check_state_dtype(state_dtype: Any, name: str = "state_dtype") -> str:
    if not isinstance(state_dtype, str) or state_dtype not in HALF_STATE_MODES:
        raise ValueError(f"Invalid {name}: {state_dtype!r} (must be one of {', '.join(HALF_STATE_MODES)})")
    return state_dtype


def check_implementation(foreach: Any, fused: Any) -> None:
    check_flag(foreach, "foreach", optional=True)
    check_flag(fused, "fused", optional=True)
    if fused and foreach:
        raise ValueError("Invalid arguments: fused=True and foreach=True cannot both be set")


def defaults_from_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """A constructor's arguments (its ``locals()`` on entry) as torch.optim ``defaults``, in the signature's order: the
    signature is the one list of an optimizer's hyper-parameter names. ``self``, ``params`` and ``__class__`` are left
    out; a list becomes a tuple (``betas=[0.9, 0.99]``), so the defaults compare and pickle like torch's."""
    return {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in arguments.items()
        if name not in ("self", "params", "__class__")
    }


class CheckedGroups(torch.optim.Optimizer):
    """``add_param_group`` runs ``_check_group`` on the group with its defaults filled in; a bad group raises and is
    not added. torch's constructor adds its groups through ``add_param_group``, so the constructor's groups are
    checked by the same code as those added later."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict[str, Any]) -> None:
        """Per-group argument checks; subclasses extend it (and call ``super()._check_group``)."""
        check_common(group)

    def _closure_loss(self, closure: Callable[[], Any] | None) -> Any:
        """What ``step()`` does first, as torch's optimizers: the closure's loss, computed with gradients enabled."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


def check_common(values: dict[str, Any]) -> None:
    """The values most optimizers share, where given: lr, weight_decay, a numeric eps (Adafactor's is a pair),
    AdamW-style betas (a pair), maximize. A base optimizer's own checks come on top (``base_defaults``)."""
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


def base_defaults(base: Any, base_kwargs: dict[str, Any], reserved: tuple[str, ...], owner: str) -> dict[str, Any]:
    """The defaults of a base optimizer class with ``base_kwargs`` applied, checked by the base itself.

    Instantiating the base on a dummy tensor runs its own argument checks now, before any work, and yields its
    hyper-parameter names (lr, betas, ...), which the wrapper then carries in its own param groups. A base whose
    groups must say something (``MuonWithAuxAdam``'s ``use_muon``) names it in its class attribute ``probe_group``.
    """
    if not (isinstance(base, type) and issubclass(base, torch.optim.Optimizer)):
        raise ValueError(f"Invalid base: {base!r} (must be a torch.optim.Optimizer subclass)")
    accepted = constructor_arguments(base)
    unknown = sorted(set(base_kwargs) - accepted) if accepted is not None else []
    if unknown:  # a misspelled keyword: a TypeError, as torch's optimizers and any Python function raise
        raise TypeError(
            f"{owner}.__init__() got an unexpected keyword argument {unknown[0]!r} (neither {owner}'s nor its base "
            f"{base.__name__}'s)"
        )
    check_common(base_kwargs)
    try:
        defaults = dict(base([probe_group(base, torch.zeros(2, 2, requires_grad=True))], **base_kwargs).defaults)
    except (TypeError, IndexError) as err:  # e.g. eps="x", betas=(0.9,): say which arguments, as a ValueError
        raise ValueError(f"Invalid argument for {base.__name__}({', '.join(base_kwargs)}): {err}") from err
    overlap = sorted(set(defaults) & set(reserved))
    if overlap:
        raise ValueError(f"Invalid base: {base.__name__} uses hyper-parameter names reserved by {owner}: {overlap}")
    return defaults


def constructor_arguments(base: type[torch.optim.Optimizer]) -> frozenset[str] | None:
    """The keyword arguments ``base(params, ...)`` takes by name, or None if it takes any (``**kwargs``).

    A base's ``defaults`` may hold keys its constructor does not take (torch's AdamW: ``decoupled_weight_decay``).
    """
    parameters = inspect.signature(base.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.name not in ("self", "params"))


def probe_group(base: Any, tensor: torch.Tensor) -> dict[str, Any]:
    """A param group of ``tensor`` that ``base`` accepts: with the keys of ``base.probe_group``, if it has one."""
    return {"params": [tensor], **getattr(base, "probe_group", {})}
