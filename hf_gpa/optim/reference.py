"""GPA in its explicit three-sequence form, line by line from Algorithm 1 of the paper: the test oracle.

It keeps x, y and z as separate tensors (y in the parameters), computes the base optimizer's direction with its own
explicit formulas (AdamW with decoupled weight decay, or PyTorch-style SGD with momentum/Nesterov and L2 weight
decay on z), and never uses the memory-efficient rewriting, so agreeing with it checks the algebra of the fast paths.
Slow by design; not for training.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import _types
from ._base import CheckedGroups, defaults_from_arguments
from ._checks import check_adam, check_averaging, check_flag, check_mu
from ._types import Averaging

__all__ = ["ReferenceGPA"]


class ReferenceGPA(CheckedGroups):
    """Algorithm 1 with x, y, z stored explicitly. ``base`` is ``"adamw"`` or ``"sgd"``.

    Complex parameters are treated as their real views (``torch.view_as_real``), as torch's optimizers do.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        base: str = "adamw",
        lr: float = _types.DEFAULT_LR,
        betas: tuple[float, float] = _types.DEFAULT_BETAS,
        eps: float = _types.DEFAULT_EPS,
        weight_decay: float = _types.DEFAULT_WEIGHT_DECAY,
        momentum: float = 0.0,
        nesterov: bool = False,
        mu_x: float = _types.DEFAULT_MU_X,
        mu_y: float = _types.DEFAULT_MU_Y,
        averaging: str = _types.DEFAULT_AVERAGING,
    ) -> None:
        defaults = {**defaults_from_arguments(locals()), "weight_sum": 0.0}
        super().__init__(params, defaults)  # every group passes `_check_group`

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if group["base"] not in ("adamw", "sgd"):
            raise ValueError(f"Invalid base: {group['base']!r} (must be 'adamw' or 'sgd')")
        check_adam(group["betas"], group["eps"], group["weight_decay"])
        if isinstance(group["momentum"], bool) or not group["momentum"] >= 0.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']!r} (must be >= 0)")
        check_flag(group["nesterov"], "nesterov")
        check_mu(group["mu_x"], group["mu_y"])
        group["averaging"] = check_averaging(group["averaging"])

    def x(self, p: torch.Tensor) -> torch.Tensor:
        """The evaluation weights x of a parameter (its initial value before the first step)."""
        state = self.state.get(p)
        if not state:
            return p.detach()
        return torch.view_as_complex(state["x"]) if p.is_complex() else state["x"]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._closure_loss(closure)
        if any(p.grad is not None and p.grad.is_sparse for g in self.param_groups for p in g["params"]):
            raise RuntimeError("ReferenceGPA does not support sparse gradients")
        for group in self.param_groups:
            lr, wd, mu_y = float(group["lr"]), group["weight_decay"], group["mu_y"]
            if group["averaging"] == Averaging.GPA:
                mu_x = group["mu_x"]  # Algorithm 1: x^(t+1) = mu_x x^(t) + (1 - mu_x) z^(t+1)
            else:
                # Schedule-Free (paper eq. 5): x^(t+1) is the average of z^(1..t+1) weighted by lr_i^2, that is
                # x^(t+1) = (1 - c_t) x^(t) + c_t z^(t+1), c_t = lr_t^2 / sum_{i<=t} lr_i^2 (no move while 0/0).
                group["weight_sum"] += lr**2
                mu_x = 1.0 - (lr**2 / group["weight_sum"] if group["weight_sum"] > 0 else 0.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["x"] = _real(p.detach()).clone()  # x^(1) = y^(1) = z^(1)
                    state["z"] = _real(p.detach()).clone()
                    state["t"] = 0
                x, z = state["x"], state["z"]
                g = _real(p.grad)  # g^(t) at y^(t), which the parameter holds
                state["t"] += 1
                t = state["t"]
                if group["base"] == "adamw":
                    beta1, beta2 = group["betas"]
                    m = state["m"] = beta1 * state.get("m", torch.zeros_like(g)) + (1 - beta1) * g
                    v = state["v"] = beta2 * state.get("v", torch.zeros_like(g)) + (1 - beta2) * g * g
                    d = -(m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + group["eps"])
                    z_new = (1 - lr * wd) * z + lr * d  # Algorithm 1, line 6 (decoupled decay)
                else:
                    g = g + wd * z  # torch SGD: L2 decay on the iterate it moves, which is z
                    if group["momentum"] != 0:
                        b = g if t == 1 else group["momentum"] * state["b"] + g
                        state["b"] = b
                        g = g + group["momentum"] * b if group["nesterov"] else b
                    z_new = z - lr * g
                x_new = mu_x * x + (1 - mu_x) * z_new  # line 7
                y_new = mu_y * x_new + (1 - mu_y) * z_new  # line 3 of the next iteration
                state["x"], state["z"] = x_new, z_new
                _real(p).copy_(y_new)
        return loss


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t
