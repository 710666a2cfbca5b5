"""Single-worker DiLoCo (Step-K Nesterov outer optimizer): the baseline GPA is measured against (paper, Algorithm 2).

The base optimizer takes H inner steps on the parameters (the inner weights); every H-th step the pseudo-gradient
p = outer - inner drives a Nesterov step of the outer weights, and the inner weights are reset to them:

    b <- mu b + p,      outer <- outer - outer_lr (mu b + p),      inner <- outer

This is the Nesterov form of the main text (eq. 10, PyTorch's ``SGD(nesterov=True)`` on the pseudo-gradient), in
which the look-ahead uses the updated buffer; Algorithm 2 in the appendix writes the old buffer in that line, which
we read as a typo since its own momentum update precedes it. The evaluation weights are the outer weights. State
per parameter: the outer weights and the outer momentum buffer (2 copies) plus the base's state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._checks import (
    DEFAULT_INNER_STEPS,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    base_defaults,
    check_diloco,
    check_lr,
)
from ._modes import PrimalAveragingOptimizer, local_tensor

__all__ = ["DiLoCo"]

_DILOCO_KEYS = ("inner_steps", "outer_lr", "outer_momentum", "inner_step", "train_mode")


class DiLoCo(PrimalAveragingOptimizer):
    r"""Single-worker DiLoCo / Step-K Nesterov around a base optimizer (paper, Algorithm 2).

    .. math::
        \begin{aligned}
            & x_{t+1} = \mathrm{base}(x_t, \nabla f(x_t)) \quad \text{(inner step, with the base's weight decay)} \\
            & \text{if } t \bmod H = 0: \quad p = \tilde x - x_{t+1}, \quad b \leftarrow \mu b + p, \quad
              \tilde x \leftarrow \tilde x - \tilde\gamma (\mu b + p), \quad x_{t+1} \leftarrow \tilde x
        \end{aligned}

    ``eval()`` puts the outer weights :math:`\tilde x` into the parameters (they are exchanged with the inner
    weights, which ``state["outer"]`` holds while in eval mode, so ``train()`` restores them bitwise).

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        base: the inner optimizer class (default: ``torch.optim.AdamW``).
        inner_steps: H, the number of inner steps between outer steps (default: 32).
        outer_lr: the outer learning rate :math:`\tilde\gamma` (default: 0.7).
        outer_momentum: the outer Nesterov momentum :math:`\mu` in [0, 1) (default: 0.9).
        **base_kwargs: the base optimizer's own arguments (lr, betas, weight_decay, ...).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        base: type[torch.optim.Optimizer] = torch.optim.AdamW,
        inner_steps: int = DEFAULT_INNER_STEPS,
        outer_lr: float = DEFAULT_OUTER_LR,
        outer_momentum: float = DEFAULT_OUTER_MOMENTUM,
        **base_kwargs: Any,
    ) -> None:
        check_diloco(inner_steps, outer_lr, outer_momentum)
        base_hypers = base_defaults(base, base_kwargs, _DILOCO_KEYS, "DiLoCo")
        defaults = dict(
            base_hypers, inner_steps=inner_steps, outer_lr=outer_lr, outer_momentum=outer_momentum, inner_step=0
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            check_diloco(group["inner_steps"], group["outer_lr"], group["outer_momentum"])
            if "lr" in group:
                check_lr(group["lr"])
        self.base_class = base
        self._base_keys = tuple(base_hypers)
        self._base: torch.optim.Optimizer | None = None

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer, acting on the parameters (built on first use, after any wrapping)."""
        if self._base is None:
            groups = [
                {"params": list(g["params"]), **{k: g[k] for k in self._base_keys if k in g}}
                for g in self.param_groups
            ]
            self._base = self.base_class(groups)
            for group in self.param_groups:
                for p in group["params"]:
                    # The base's state lives inside this optimizer's state (saved with it), empty until its first step.
                    self._base.state[p] = self.state[p].setdefault("base", {})
        return self._base

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; every ``inner_steps``-th call also takes the outer Nesterov step."""
        self._check_train_mode()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        base = self.base_optimizer
        for group, base_group in zip(self.param_groups, base.param_groups):
            for key in self._base_keys:
                if key in group:
                    base_group[key] = group[key]
            for p in group["params"]:
                state = self.state[p]
                if p.grad is not None and "outer" not in state:
                    state["outer"] = p.detach().clone(memory_format=torch.preserve_format)
                    state["outer_momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        base.step()
        for group in self.param_groups:
            group["inner_step"] += 1
            if group["inner_step"] % group["inner_steps"] == 0:
                self._outer_step(group)
        return loss

    def _outer_step(self, group: dict[str, Any]) -> None:
        mu, outer_lr = group["outer_momentum"], group["outer_lr"]
        for p in group["params"]:
            state = self.state[p]
            if "outer" not in state:
                continue
            inner, outer, buf = (local_tensor(t) for t in (p, state["outer"], state["outer_momentum_buffer"]))
            pseudo_grad = outer - inner
            buf.mul_(mu).add_(pseudo_grad)
            outer.sub_(pseudo_grad.add_(buf, alpha=mu), alpha=outer_lr)
            inner.copy_(outer)

    # The switch exchanges the contents of the parameter and of state["outer"], keeping the key names (checkpoint
    # loaders fill only keys their template has): in eval mode state["outer"] holds the inner weights.
    def _params_to_eval(self, group: dict[str, Any]) -> None:
        self._exchange(group)

    def _params_to_train(self, group: dict[str, Any]) -> None:
        self._exchange(group)

    def _exchange(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            state = self.state.get(p)
            if state and "outer" in state:
                _swap_(local_tensor(p), local_tensor(state["outer"]))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the outer weights, momentum and the base's state; the base is rebuilt around them."""
        super().load_state_dict(state_dict)
        self._base = None


def _swap_(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two tensors exactly (one temporary of one tensor's size)."""
    tmp = a.clone()
    a.copy_(b)
    b.copy_(tmp)
