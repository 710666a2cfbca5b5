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

from ._checks import DEFAULT_AVERAGING, DEFAULT_MU_X, DEFAULT_MU_Y, check_adam, check_averaging, check_lr, check_mu
from .averaging import averaging_mu_x

__all__ = ["ReferenceGPA"]


class ReferenceGPA(torch.optim.Optimizer):
    """Algorithm 1 with x, y, z stored explicitly. ``base`` is ``"adamw"`` or ``"sgd"``.

    Complex parameters are treated as their real views (``torch.view_as_real``), as torch's optimizers do.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        base: str = "adamw",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        nesterov: bool = False,
        mu_x: float = DEFAULT_MU_X,
        mu_y: float = DEFAULT_MU_Y,
        averaging: str = DEFAULT_AVERAGING,
    ) -> None:
        if base not in ("adamw", "sgd"):
            raise ValueError(f"Invalid base: {base!r} (must be 'adamw' or 'sgd')")
        check_lr(lr)
        check_adam(betas, eps, weight_decay)
        check_mu(mu_x, mu_y)
        check_averaging(averaging)
        defaults = dict(
            base=base,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            mu_x=mu_x,
            mu_y=mu_y,
            averaging=averaging,
            weight_sum=0.0,
        )
        super().__init__(params, defaults)

    def x(self, p: torch.Tensor) -> torch.Tensor:
        """The evaluation weights x of a parameter (its initial value before the first step)."""
        state = self.state.get(p)
        if not state:
            return p.detach()
        return torch.view_as_complex(state["x"]) if p.is_complex() else state["x"]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(p.grad is not None and p.grad.is_sparse for g in self.param_groups for p in g["params"]):
            raise RuntimeError("ReferenceGPA does not support sparse gradients")
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            mu_x, group["weight_sum"] = averaging_mu_x(group["averaging"], group["mu_x"], lr, group["weight_sum"])
            mu_y = group["mu_y"]
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
