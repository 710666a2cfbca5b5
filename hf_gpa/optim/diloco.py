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

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ._checks import check_diloco
from ._residual import bits_differ
from ._tensors import authoritative_y, local_tensor
from ._types import (
    DEFAULT_INNER_STEPS,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    INNER_FP32,
    INNER_STEP,
    INNER_STEPS,
    OUTER,
    OUTER_LR,
    OUTER_MOMENTUM,
    OUTER_MOMENTUM_BUFFER,
    state_dtype_for,
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
    mode, no extra memory). bf16/fp16 parameters keep their state in float32, as GPA does: the outer weights, the outer
    momentum and the inner weights (``state["inner_fp32"]``, which the base steps, its own state then float32 too;
    the parameter holds it rounded and stays authoritative: a parameter written by something else wins). Stepping
    bf16 inner weights would lose the updates smaller than their rounding, and every outer step would take the
    rounding for a move (least squares in bf16, cosine, 600 steps, H = 8: loss 0.177 at the outer weights against
    0.0025 in fp32; with float32 state it is the fp32 run's). In eval mode the parameters hold the outer weights
    rounded; where they were written there, the written value becomes the outer weights.

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
        defaults = dict(inner_steps=inner_steps, outer_lr=outer_lr, outer_momentum=outer_momentum, inner_step=0)
        super().__init__(params, base, base_kwargs, defaults)

    def _check_own(self, values: dict[str, Any]) -> None:
        check_diloco(values[INNER_STEPS], values[OUTER_LR], values[OUTER_MOMENTUM])

    def _base_tensor(self, p: torch.Tensor, create: bool = False) -> torch.Tensor | None:
        # The base moves the inner weights, once they have a gradient: the parameters themselves, or for bf16/fp16
        # parameters their float32 copy (see ``_inner``). ``create`` (an adopted state, whose parameters have no
        # gradient yet; ``init_state``) starts their state now, so the base is built on them and receives the state.
        if create or p.grad is not None:
            self._init_outer(p)
        return self._inner(p) if p in self.state else None

    def _inner(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor holding the inner weights: ``state["inner_fp32"]`` for bf16/fp16 parameters, else ``p``."""
        return self.state[p].get(INNER_FP32, p)

    def _init_outer(self, p: torch.Tensor) -> None:
        """The outer weights (the current weights) and a zero outer momentum in the state dtype (float32 for
        bf16/fp16 parameters, which also get their inner weights in float32)."""
        state = self.state[p]
        if OUTER not in state:
            dtype = state_dtype_for(p)
            state[OUTER] = p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format)
            state[OUTER_MOMENTUM_BUFFER] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            if dtype != p.dtype:
                state[INNER_FP32] = p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; every ``inner_steps``-th call also takes the outer Nesterov step."""
        loss = self._closure_loss(closure)
        copies = []  # (parameter, its float32 inner weights) of bf16/fp16 parameters with a gradient
        try:
            with self._rollback_on_error():
                self._prepare_base()
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        self._init_outer(p)
                        inner = self._inner(p)
                        if inner is not p:
                            # The parameter is authoritative: where something wrote it, the inner weights take it.
                            local = local_tensor(inner)
                            local.copy_(authoritative_y(local_tensor(p), local, local.dtype))
                            inner.grad = p.grad.to(inner.dtype)
                            copies.append((p, inner))
                self._base_step()
        finally:
            for _, inner in copies:
                inner.grad = None
        for p, inner in copies:
            local_tensor(p).copy_(local_tensor(inner))
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
            inner, outer, buf = (local_tensor(t) for t in (self._inner(p), state[OUTER], state[OUTER_MOMENTUM_BUFFER]))
            pseudo_grad = outer - inner  # in the outer weights' dtype (float32 for bf16/fp16 parameters)
            buf.mul_(mu).add_(pseudo_grad)
            outer.sub_(pseudo_grad.add_(buf, alpha=mu), alpha=outer_lr)
            inner.copy_(outer)
            if inner is not local_tensor(p):
                local_tensor(p).copy_(outer)

    # Where the outer weights have the parameter's dtype, the switch exchanges the contents of the parameter and of
    # state["outer"], keeping the key names (checkpoint loaders fill only keys their template has): in eval mode
    # state["outer"] then holds the inner weights. bf16/fp16 parameters keep both in float32 (state["outer"],
    # state["inner_fp32"]): the parameter holds one of them rounded.
    def _params_to_eval(self, group: dict[str, Any]) -> None:
        for param, outer, inner in self._switch_swapping(group):
            inner.copy_(authoritative_y(param, inner, inner.dtype))  # a parameter written in train mode wins
            param.copy_(outer)

    def _params_to_train(self, group: dict[str, Any]) -> None:
        for param, outer, inner in self._switch_swapping(group):
            written = bits_differ(param, outer.to(param.dtype))  # the outer weights written in eval mode win
            if bool(written.any()):
                outer.copy_(torch.where(written, param.to(outer.dtype), outer))
            param.copy_(inner)

    def _switch_swapping(self, group: dict[str, Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The switch both ways: exchanges parameter and outer weights where they share a dtype, and yields
        (parameter, outer weights, float32 inner weights) of the bf16/fp16 parameters, for the caller to switch."""
        for p in group["params"]:
            state = self.state.get(p)
            if not state or OUTER not in state:
                continue
            param, outer = local_tensor(p), local_tensor(state[OUTER])
            if INNER_FP32 in state:
                yield param, outer, local_tensor(state[INNER_FP32])
            else:
                _swap_(param, outer)


def _swap_(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two tensors exactly (one temporary of one tensor's size)."""
    tmp = a.clone()
    a.copy_(b)
    b.copy_(tmp)
