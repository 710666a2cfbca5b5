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

from ._checks import DEFAULT_INNER_STEPS, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, check_diloco
from ._tensors import local_tensor
from ._wrapper import BaseOptimizerWrapper

__all__ = ["DiLoCo"]


class DiLoCo(BaseOptimizerWrapper):
    r"""Single-worker DiLoCo / Step-K Nesterov around a base optimizer (paper, Algorithm 2).

    .. math::
        \begin{aligned}
            & x_{t+1} = \mathrm{base}(x_t, \nabla f(x_t)) \quad \text{(inner step, with the base's weight decay)} \\
            & \text{if } t \bmod H = 0: \quad p = \tilde x - x_{t+1}, \quad b \leftarrow \mu b + p, \quad
              \tilde x \leftarrow \tilde x - \tilde\gamma (\mu b + p), \quad x_{t+1} \leftarrow \tilde x
        \end{aligned}

    ``eval()`` puts the outer weights :math:`\tilde x` into the parameters (they are exchanged with the inner
    weights, which ``state["outer"]`` holds while in eval mode, so ``train()`` restores them bitwise).

    As a wrapper of its base it behaves like `GPA` (see ``_wrapper``): ``add_param_group`` at any time,
    ``copy.deepcopy``/``pickle`` round trips, step hooks that fire once per ``DiLoCo.step()``, a step whose base
    raises before changing its state leaves parameters and state as they were (no copy needed: DiLoCo changes nothing
    before its base steps), and a state dict saved by the base class itself is adopted (the run continues as DiLoCo's
    inner optimizer, with the current weights as the first outer weights). Complex parameters follow the base.

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
        defaults = dict(inner_steps=inner_steps, outer_lr=outer_lr, outer_momentum=outer_momentum, inner_step=0)
        super().__init__(params, base, base_kwargs, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        check_diloco(group["inner_steps"], group["outer_lr"], group["outer_momentum"])

    def _base_tensor(self, p: torch.Tensor, create: bool = False) -> torch.Tensor | None:
        # The base moves the parameters themselves (the inner weights), once they have a gradient.
        return p if create or p.grad is not None or p in self.state else None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; every ``inner_steps``-th call also takes the outer Nesterov step."""
        loss = self._closure_loss(closure)
        with self._rollback_on_error():
            self._prepare_base()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and "outer" not in self.state[p]:
                        state = self.state[p]
                        state["outer"] = p.detach().clone(memory_format=torch.preserve_format)
                        state["outer_momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self._base_step()
        for group in self.param_groups:
            group["inner_step"] += 1
            if group["inner_step"] % group["inner_steps"] == 0:
                self._outer_step(group)
        return loss

    def _outer_step(self, group: dict[str, Any]) -> None:
        mu, outer_lr = group["outer_momentum"], group["outer_lr"]
        for p in group["params"]:
            state = self.state.get(p)
            if not state or "outer" not in state:
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


def _swap_(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two tensors exactly (one temporary of one tensor's size)."""
    tmp = a.clone()
    a.copy_(b)
    b.copy_(tmp)
