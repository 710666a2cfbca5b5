"""GPA around any ``torch.optim.Optimizer``: the base optimizer moves z with the gradient taken at y.

The parameters hold y and the state holds z (plus the base optimizer's own state of z); x is recovered by ``eval()``
(paper, Algorithm 3). Around the base step GPA adds two passes over the parameters (``_wrapper_passes``):

    y <- mu_x (y - (1 - mu_y) z)      (= mu_x mu_y x)
    z <- base(z, grad f(y))
    y <- y + (1 - mu_x mu_y) z        (= mu_y x' + (1 - mu_y) z')
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._checks import check_averaging, check_mu
from ._gpa_switch import GPASwitch, to_eval_, x_mu_y, y_across_cast
from ._state_layout import HALF_DTYPES, gpa_y_fp32, gpa_z
from ._tensors import local_tensor, real_view, shard_like
from ._types import (
    AVERAGING,
    DEFAULT_AVERAGING,
    DEFAULT_MU_X,
    DEFAULT_MU_Y,
    LR,
    MU_X,
    MU_Y,
    TRAIN_MODE,
    WEIGHT_SUM,
    Y_FP32,
    Z,
)
from ._wrapper import BaseOptimizerWrapper
from ._wrapper_passes import pass_after_base_, pass_before_base_
from .averaging import averaging_mu_x

__all__ = ["GPA"]


class GPA(BaseOptimizerWrapper, GPASwitch):
    r"""GPA around any ``torch.optim.Optimizer``: the base moves z with the gradient taken at y.

    The base optimizer is built lazily (at the first step, after any FSDP wrapping) on the z tensors, which hold the
    parameters' gradients during its step; its own weight decay therefore acts on z, as in Algorithm 1. Around the
    base step GPA adds two passes over the parameters (single-pass C++ loops on CPU, foreach ops elsewhere):

    .. math::
        y \leftarrow \mu_x (y - (1 - \mu_y) z), \qquad z \leftarrow \mathrm{base}(z, \nabla f(y)), \qquad
        y \leftarrow y + (1 - \mu_x \mu_y) z

    The state of each parameter holds ``z`` and, under ``"base"``, the base's own state of z, so ``state_dict()``
    carries both. Per-group hyper-parameters (``lr``, ``weight_decay``, ``mu_x``, ``mu_y`` and the base's own) are
    forwarded to the base before every step, so LR schedulers act on this optimizer as usual. What it shares with
    `DiLoCo` as a wrapper (see ``_wrapper``):

    * ``add_param_group`` works at any time: the base learns the new group at the next step.
    * ``copy.deepcopy`` and ``pickle`` round trips work as for torch's optimizers; the copy's base acts on the copy's
      tensors.
    * Step hooks: torch's global and per-instance hooks fire once per ``GPA.step()``; the base's step runs without
      hooks (hooks registered on ``base_optimizer`` itself do not fire).
    * A step whose base raises (a sparse gradient into AdamW, an out-of-memory error before the base changes its
      state) leaves z, the base's state, bf16/fp16 parameters and the state keys and group values as they were, and
      the next step works. The first pass changes fp32/fp64 y (and y's float32 copy) in place; it is undone by its
      inverse, y / mu_x + (1 - mu_y) z, which gives y back within 4 u (|y| + (1 - mu_y) |z|) (u the unit roundoff
      of y's dtype, 2^-24 for float32; measured at most 3.0 u over mu_x in [1e-4, 0.99999], mu_y in [0.01, 1]),
      not bitwise: in units of y's own last place there is no bound where y is near 0. The pass is a contraction
      that drops y's low bits, so an exact undo needs more than y and z: a copy of y at every step (measured 2.2x
      the wrapper's step on CPU, and one more parameter copy of peak memory). With mu_x = 0 (and Schedule-Free's
      first step) that pass runs after the base's step, so nothing needs undoing.
    * ``load_state_dict`` of a state saved by the base class itself (``GPA(base=torch.optim.AdamW)`` loading a
      ``torch.optim.AdamW`` state) switches that run to GPA: z = y = the current weights, the base's state (m, v,
      step) carried over, ``lr`` and ``initial_lr`` from the saved groups (the schedule's position), every other
      hyper-parameter this optimizer's own. A state of any other optimizer raises a ``ValueError`` naming both.
    * Complex parameters: the passes act on their real views and the base sees complex z (torch's AdamW, SGD, ...
      handle them through ``view_as_real``), so ``mu_x = 0`` equals the base on complex parameters.
    * bf16/fp16 parameters: z is float32 (so is the base's state of z) and y is kept in float32 too
      (``state["y_fp32"]``, 4 more bytes per parameter; the parameter holds it rounded), as in `GPAAdamW`: x is as
      exact as float32 allows instead of accumulating y's roundings.
    * ``lr = 0``: z stays put but y still moves, since x <- mu_x x + (1 - mu_x) z averages towards z; where x = z
      already (before the first step, or mu_y = 1 with x = z), y stays put within rounding.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        base: the base optimizer class, e.g. ``torch.optim.SGD``, ``torch.optim.AdamW``, ``torch.optim.Adafactor``,
            ``torch.optim.Muon`` (2-D parameters) (default: ``torch.optim.AdamW``).
        mu_x: averaging constant of x in [0, 1) (default: ``mu_x_from_inner_steps(32)`` = 0.996713).
        mu_y: interpolation constant of the gradient point y in (0, 1] (default: 0.7).
        averaging: ``"gpa"`` or ``"schedule_free"`` (Schedule-Free's lr^2-weighted uniform average) (default: "gpa").
        **base_kwargs: the base optimizer's own arguments (lr, momentum, betas, weight_decay, ...).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        base: type[torch.optim.Optimizer] = torch.optim.AdamW,
        mu_x: float = DEFAULT_MU_X,
        mu_y: float = DEFAULT_MU_Y,
        averaging: str = DEFAULT_AVERAGING,
        **base_kwargs: Any,
    ) -> None:
        defaults = dict(mu_x=mu_x, mu_y=mu_y, averaging=averaging, weight_sum=0.0)
        super().__init__(params, base, base_kwargs, defaults)

    def _check_own(self, values: dict[str, Any]) -> None:
        check_mu(values[MU_X], values[MU_Y])
        check_averaging(values[AVERAGING])

    def _base_tensor(self, p: torch.Tensor, create: bool = False) -> torch.Tensor | None:
        # z is created for a parameter once it has a gradient (a parameter that never has one gets no state).
        state = self.state.get(p)
        if state and Z in state:
            return state[Z]
        if p.grad is None and not create:
            return None
        z = self.state[p][Z] = gpa_z(p)
        return z

    # ---- parameters cast under it (see ``_wrapper``): y's float32 copy comes or goes, z and the base stay ----

    def _cast_under(self, p: torch.Tensor, state: dict[str, Any]) -> bool:
        return Z in state and (Y_FP32 in state) != (p.dtype in HALF_DTYPES)

    def _base_dtype(self, p: torch.Tensor, state: dict[str, Any]) -> torch.dtype:
        return state[Z].dtype

    def _follow_cast(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        # y exactly, as GPAAdamW converts it (`y_across_cast`): from a bf16/fp16 parameter the fp32/fp64 one receives
        # y's float32 copy (where the cast left it, else the written value wins); to one, the copy is made from y.
        mu_y = x_mu_y(group)
        switched = not group[TRAIN_MODE] and mu_y != 1.0  # mu_y = 1: x = y, eval() switched nothing
        y = y_across_cast(p, state, local_tensor(state[Z]), mu_y, train_mode=not switched)
        if Y_FP32 in state:
            del state[Y_FP32]
        else:
            state[Y_FP32] = shard_like(y.to(torch.float32), p)
        local_tensor(p).copy_(y)
        if switched:
            to_eval_(p, state, mu_y)

    def _init_y_fp32(self, p: torch.Tensor) -> None:
        """y in float32 beside a bf16/fp16 parameter that holds it rounded, as in GPAAdamW: x stays as exact as z."""
        state = self.state[p]
        if Y_FP32 not in state:
            y32 = gpa_y_fp32(p)
            if y32 is not None:
                state[Y_FP32] = y32

    def _create_state(self) -> None:
        super()._create_state()
        for p in list(self.state):
            self._init_y_fp32(p)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss at y (optional)."""
        loss = self._closure_loss(closure)
        stepped, with_grad = [], []
        try:
            with self._rollback_on_error() as undo:
                self._prepare_base()  # z created (for a first gradient) before the passes read it
                for group in self.param_groups:
                    ys, zs, y32s = [], [], []
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        state = self.state[p]
                        z = state[Z]
                        z.grad = p.grad if p.grad.dtype == z.dtype else p.grad.to(z.dtype)
                        with_grad.append(z)
                        self._init_y_fp32(p)
                        ys.append(real_view(local_tensor(p)))
                        zs.append(real_view(local_tensor(z)))
                        y32s.append(real_view(local_tensor(state[Y_FP32])) if Y_FP32 in state else None)
                    lr = float(group.get(LR, 0.0))
                    # Every group's step counts in Schedule-Free's weight sum, with gradients or not.
                    mu_x, group[WEIGHT_SUM] = averaging_mu_x(group[AVERAGING], group[MU_X], lr, group[WEIGHT_SUM])
                    if not ys:
                        continue
                    mu_y = group[MU_Y]
                    if mu_x != 0.0:
                        # y <- mu_x (y - (1 - mu_y) z) = mu_x mu_y x, in place (its float32 copy alone, where there is
                        # one): needs z from before the base step. Undone by its inverse if the base raises.
                        pass_before_base_(ys, zs, 1.0 - mu_y, mu_x, y32s)
                        undo.on_error(functools.partial(_unscale_, ys, zs, y32s, 1.0 - mu_y, mu_x))
                    stepped.append((ys, zs, mu_x, mu_y, y32s))
                self._base_step()
        finally:
            for z in with_grad:
                z.grad = None
        for ys, zs, mu_x, mu_y, y32s in stepped:
            if mu_x == 0.0:  # the first pass gives 0 whatever z was: taken after the base step, nothing to undo
                pass_before_base_(ys, zs, 1.0 - mu_y, mu_x, y32s)
            pass_after_base_(ys, zs, 1.0 - mu_x * mu_y, y32s)  # y <- mu_x mu_y x + (1 - mu_x mu_y) z'
        return loss


def _unscale_(
    ys: list[torch.Tensor], zs: list[torch.Tensor], y32s: list[torch.Tensor | None], alpha: float, scale: float
) -> None:
    """Inverse of the first pass with z untouched, y <- y / scale + alpha z: y back within 4 u (|y| + alpha |z|).

    A bf16/fp16 parameter was not written by the first pass (only its float32 copy, which this restores), so it is
    back exactly, and z and the base's state are exact too.
    """
    for y, z, y32 in zip(ys, zs, y32s):
        target = y if y32 is None else y32
        target.div_(scale).add_(z, alpha=alpha)
