"""Single-worker DiLoCo (Step-K Nesterov outer optimizer): the baseline GPA is measured against (paper, Algorithm 2).

The base optimizer takes H inner steps on the parameters (the inner weights); every H-th step the pseudo-gradient
p = outer - inner drives a Nesterov step of the outer weights, and the inner weights are reset to them:

    b <- mu b + p,      outer <- outer - outer_lr (mu b + p),      inner <- outer

This is the Nesterov form of the main text (eq. 10, PyTorch's ``SGD(nesterov=True)`` on the pseudo-gradient), in
which the look-ahead uses the updated buffer; Algorithm 2 in the appendix writes the old buffer in that line, which
we read as a typo since its own momentum update precedes it. The evaluation weights are the outer weights. State
per parameter: the outer weights and the outer momentum buffer (2 copies, float32 for bf16/fp16 parameters, as GPA
keeps z) plus the base's state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._checks import check_diloco
from ._tensors import local_tensor, state_dtype_for
from ._types import (
    DEFAULT_INNER_STEPS,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    INNER,
    INNER_STEP,
    INNER_STEPS,
    OUTER,
    OUTER_LR,
    OUTER_MOMENTUM,
    OUTER_MOMENTUM_BUFFER,
)
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

    ``eval()`` puts the outer weights :math:`\tilde x` into the parameters and ``train()`` restores the inner weights
    bitwise. For fp32/fp64 parameters the two are exchanged (``state["outer"]`` holds the inner weights while in eval
    mode, no extra memory). bf16/fp16 parameters keep the outer weights and the outer momentum in float32 (rounding
    the slow weights to bf16 at every outer step would lose most of their updates); in eval mode the parameters hold
    the outer weights rounded and ``state["inner"]`` the inner weights (2 more bytes per parameter while in eval
    mode; a loader that drops that key restarts the inner weights from the outer ones).

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
        check_diloco(group[INNER_STEPS], group[OUTER_LR], group[OUTER_MOMENTUM])

    def _base_tensor(self, p: torch.Tensor, create: bool = False) -> torch.Tensor | None:
        # The base moves the parameters themselves (the inner weights), once they have a gradient; ``create`` (an
        # adopted AdamW state, whose parameters have no gradient yet) starts their outer state now, so the base is
        # built on them and receives the adopted state.
        if create:
            self._init_outer(p)
        return p if p.grad is not None or p in self.state else None

    def _init_outer(self, p: torch.Tensor) -> None:
        """The outer weights (the current weights) and a zero outer momentum, in the state dtype (float32 for half)."""
        state = self.state[p]
        if OUTER not in state:
            dtype = state_dtype_for(p)
            state[OUTER] = p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format)
            state[OUTER_MOMENTUM_BUFFER] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; every ``inner_steps``-th call also takes the outer Nesterov step."""
        loss = self._closure_loss(closure)
        with self._rollback_on_error():
            self._prepare_base()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._init_outer(p)
            self._base_step()
        for group in self.param_groups:
            group[INNER_STEP] += 1
            if group[INNER_STEP] % group[INNER_STEPS] == 0:
                self._outer_step(group)
        return loss

    def _outer_step(self, group: dict[str, Any]) -> None:
        mu, outer_lr = group[OUTER_MOMENTUM], group[OUTER_LR]
        for p in group["params"]:
            state = self.state.get(p)
            if not state or OUTER not in state:
                continue
            inner, outer, buf = (local_tensor(t) for t in (p, state[OUTER], state[OUTER_MOMENTUM_BUFFER]))
            pseudo_grad = outer - inner  # in the outer weights' dtype (float32 for bf16/fp16 parameters)
            buf.mul_(mu).add_(pseudo_grad)
            outer.sub_(pseudo_grad.add_(buf, alpha=mu), alpha=outer_lr)
            inner.copy_(outer)

    # Where the outer weights have the parameter's dtype, the switch exchanges the contents of the parameter and of
    # state["outer"], keeping the key names (checkpoint loaders fill only keys their template has): in eval mode
    # state["outer"] then holds the inner weights. Wider (float32) outer weights stay where they are; the inner
    # weights wait in state["inner"] (as GPA's residual, a key of eval mode only).
    def _params_to_eval(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            state = self.state.get(p)
            if not state or OUTER not in state:
                continue
            inner, outer = local_tensor(p), local_tensor(state[OUTER])
            if outer.dtype == inner.dtype:
                _swap_(inner, outer)
            else:
                state[INNER] = p.detach().clone(memory_format=torch.preserve_format)
                inner.copy_(outer)

    def _params_to_train(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            state = self.state.get(p)
            if not state or OUTER not in state:
                continue
            inner, outer = local_tensor(p), local_tensor(state[OUTER])
            if outer.dtype == inner.dtype:
                _swap_(inner, outer)
                continue
            written = inner != outer.to(inner.dtype)  # the outer weights were written while in eval mode: they win
            if bool(written.any()):
                outer.copy_(torch.where(written, inner.to(outer.dtype), outer))
            if INNER in state:
                inner.copy_(local_tensor(state.pop(INNER)))
            else:  # a loader dropped the inner weights: they restart from the outer ones, as after an outer step
                inner.copy_(outer)


def _swap_(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two tensors exactly (one temporary of one tensor's size)."""
    tmp = a.clone()
    a.copy_(b)
    b.copy_(tmp)
