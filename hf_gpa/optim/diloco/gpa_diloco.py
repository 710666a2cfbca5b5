"""GPA across workers: DiLoCo whose outer step is GPA's primal averaging instead of Nesterov (the paper's closing
proposal: the smoothing mu_x decoupled from the communication period H).

Every H inner steps the M workers' pseudo-gradients are averaged by the outer sync (``sync``), as DiLoCo's are, and
the outer state, an iterate z and its average x, takes one GPA step (paper, eq. 7, with SGD of rate outer_lr as the
base):

    p = mean_m (y - inner_m),   z <- z - outer_lr p,   x <- mu_x x + (1 - mu_x) z,   y <- mu_y x + (1 - mu_y) z

and every worker's inner weights restart from the new y. x is the evaluation weights (``eval()``, and the model
saved in eval mode). With mu_x = mu_y = mu and outer_lr = gamma / (1 - mu) this is DiLoCo with outer lr gamma and
Nesterov momentum mu (the primal averaging form of Nesterov, paper section 2): DiLoCo is the diagonal of this
family, so a tuned run is at least as good as a tuned DiLoCo at the same bytes.

Why this design and not local GPA with periodic averaging (each worker running GPA on its own y, z, x, the state
averaged every H steps): that one all-reduces two model-sized tensors per sync (y and z; x follows, being affine in
them), twice DiLoCo's bytes at the same H, and its evaluation weights differ between workers between syncs; this
one sends exactly what DiLoCo sends (one model-sized all-reduce of the pseudo-gradients per outer step, 1/P of it per
fragment when streaming), keeps DiLoCo's memory (x and z where DiLoCo keeps its outer weights and momentum), and its
x is the same bits on every process, as DiLoCo's outer weights are.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._checks import check_mu_x, in_unit_interval
from .._state_layout import gpa_diloco_state
from .._tensors import local_tensor
from .._types import (
    DEFAULT_INNER_STEPS,
    DEFAULT_OUTER_MOMENTUM,
    MU_X,
    MU_Y,
    OUTER,
    OUTER_LR,
    Z,
    default_outer_lr,
)
from .outer import OuterOptimizer

__all__ = [
    "GPADiLoCo",
    "check_outer_mu_y",
    "outer_lr_like_diloco",
    "DEFAULT_GPA_DILOCO_MU",
    "default_gpa_outer_lr",
]

#: The default mu_x = mu_y = 0.9 with `default_gpa_outer_lr` is DiLoCo's defaults (outer lr 0.7 for one worker, 0.6
#: across workers, Nesterov momentum 0.9) in this form: the starting point of a mu_x / mu_y sweep.
DEFAULT_GPA_DILOCO_MU = 0.9


def default_gpa_outer_lr(
    num_workers: int | None, mu_x: float = DEFAULT_GPA_DILOCO_MU, mu_y: float = DEFAULT_GPA_DILOCO_MU
) -> float:
    """The outer lr an unset ``outer_lr`` (and an unset ``--gpa_outer_lr``) takes: the one whose first outer step moves
    y as far as DiLoCo's defaults for ``num_workers`` (outer lr `default_outer_lr`, momentum 0.9) move its outer
    weights, `outer_lr_like_diloco`. At mu_x = mu_y = 0.9: 7.0 for one worker, 6.0 across workers. The one source of
    this figure: the optimizer, the Trainer flag and the docs (checked by tests/test_docs.py) read it here. Rounded to
    12 decimals, so that the defaults are the figures stated (7.0, not 7.000000000000001)."""
    return round(outer_lr_like_diloco(default_outer_lr(num_workers), DEFAULT_OUTER_MOMENTUM, mu_x, mu_y), 12)


def outer_lr_like_diloco(diloco_outer_lr: float, diloco_outer_momentum: float, mu_x: float, mu_y: float) -> float:
    """The outer lr of `GPADiLoCo` at (mu_x, mu_y) whose outer step moves the restart point y as far as DiLoCo's
    (outer lr gamma, momentum mu) first outer step moves its outer weights: y moves by (1 - mu_x mu_y) outer_lr p
    at once, DiLoCo's by gamma (1 + mu) p, so outer_lr = gamma (1 + mu) / (1 - mu_x mu_y). On the diagonal mu_x =
    mu_y = mu this is gamma / (1 - mu), where `GPADiLoCo` is that DiLoCo exactly; off it, a sweep of (mu_x, mu_y) at
    this outer lr changes the smoothing and the restart point, not the size of the first move (a fixed outer lr would
    make mu_x = 0 an outer SGD step of gamma / (1 - mu) times the pseudo-gradient)."""
    return diloco_outer_lr * (1.0 + diloco_outer_momentum) / (1.0 - mu_x * mu_y)


def check_outer_mu_y(mu_y: Any, name: str = "mu_y") -> float:
    """mu_y of the outer step in [0, 1]: x is kept, not recovered from y, so mu_y = 0 (workers restarting from z, x
    an exponential average of the z's) is allowed here, unlike `GPA`'s mu_y."""
    return in_unit_interval(mu_y, name, with_1=True)


class GPADiLoCo(OuterOptimizer):
    r"""GPA across workers: DiLoCo (see `DiLoCo`) whose outer step is GPA's primal averaging.

    .. math::
        \begin{aligned}
            & \text{inner: } w^{(m)} \leftarrow \mathrm{base}(w^{(m)}, \nabla f_m(w^{(m)})), \text{ from }
              w^{(m)} = y \text{ at the start of each period of } H \text{ steps} \\
            & \text{every } H \text{ steps: } p = \tfrac{1}{M} \textstyle\sum_m (y - w^{(m)}), \quad
              z \leftarrow z - \tilde\gamma p, \quad x \leftarrow \mu_x x + (1 - \mu_x) z, \quad
              y \leftarrow \mu_y x + (1 - \mu_y) z, \quad w^{(m)} \leftarrow y
        \end{aligned}

    H is the communication period alone; :math:`\mu_x` smooths the evaluation weights x and :math:`\mu_y` sets how
    much of the newest z the workers start from, independently (DiLoCo's one momentum sets both, see the paper's
    section 3.1). Per outer step (per fragment when streaming) the processes all-reduce the pseudo-gradients once,
    one model-sized buffer in the parameters' state dtype, exactly what `DiLoCo` sends; nothing else crosses
    workers. x and z start at the initial weights (y = x = z then). The averages are taken with ``torch.lerp``
    (z + mu (x - z)), which gives z exactly where x = z.

    Reductions: ``mu_x = mu_y = mu`` and ``outer_lr = gamma / (1 - mu)`` is `DiLoCo` with ``outer_lr = gamma``,
    ``outer_momentum = mu`` (the same iterates in exact arithmetic; in floating point they agree to rounding), for
    any number of workers: one worker is single-worker DiLoCo (paper, Algorithm 2). ``mu_x = 0`` is DiLoCo with
    outer SGD (no momentum) of rate ``outer_lr``. Off that diagonal, `outer_lr_like_diloco` gives the outer lr whose
    first outer step moves y as far as a given DiLoCo's first step moves its outer weights.

    Everything else is DiLoCo's (``outer``): processes, islands (``num_workers``), streaming (``num_fragments``), the
    outer sync (``outer_dtype``, ``overlap_steps``: the same sync object, compressed or overlapped alike), the
    broadcast at construction, ``eval()``/``train()`` (the parameters hold x in eval mode, the same bits on every
    process, and ``train()`` gives the inner weights back bitwise), ``synchronize()``, the layout in the state dict and
    the bitwise resume of every worker, casts. The state per parameter is ``state["outer"]`` (x; in eval mode the
    inner weights, as for DiLoCo) and ``state["z"]``, plus the base's; the param groups hold ``mu_x`` and ``mu_y``.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        base: the inner optimizer class (default: ``torch.optim.AdamW``).
        inner_steps: H, the inner steps between outer steps (default: 32).
        outer_lr: the rate :math:`\tilde\gamma` of z's outer SGD step (default: DiLoCo's default outer lr over
            1 - 0.9: 7.0 for one worker, 6.0 across workers).
        mu_x: the averaging constant of x per outer step, in [0, 1) (default: 0.9).
        mu_y: the interpolation constant of the restart point y, in [0, 1] (default: 0.9).
        **kwargs: ``distributed``, ``process_group``, ``num_workers``, ``num_fragments``, ``outer_dtype``,
            ``overlap_steps``, ``overlap_alpha`` (keyword-only: where it runs and how it syncs, as for `DiLoCo`; an
            overlapped sync mixes the new y into the inner weights that moved on) or a ready-made ``sync`` (torchft's,
            `diloco.torchft_sync.TorchftSync`: x and z heal with the rest), then the base optimizer's own arguments
            (lr, betas, weight_decay, ...).
    """

    _algorithm = "GPADiLoCo"
    _outer_keys = (Z,)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        base: type[torch.optim.Optimizer] = torch.optim.AdamW,
        inner_steps: int = DEFAULT_INNER_STEPS,
        outer_lr: float | None = None,
        mu_x: float = DEFAULT_GPA_DILOCO_MU,
        mu_y: float = DEFAULT_GPA_DILOCO_MU,
        **kwargs: Any,
    ) -> None:
        mus = {MU_X: check_mu_x(mu_x), MU_Y: check_outer_mu_y(mu_y)}  # before the layout, the sync and the base
        super().__init__(params, base, inner_steps, outer_lr, mus, **kwargs)

    def _default_outer_lr(self, num_workers: int, outer_defaults: dict[str, Any]) -> float:
        """`default_gpa_outer_lr` at this optimizer's mu_x and mu_y."""
        return default_gpa_outer_lr(num_workers, outer_defaults[MU_X], outer_defaults[MU_Y])

    def _check_own(self, values: dict[str, Any]) -> None:
        check_mu_x(values[MU_X])
        check_outer_mu_y(values[MU_Y])
        super()._check_own(values)

    def _outer_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """x (``state["outer"]``) and z, both the current weights; no Nesterov buffer."""
        return gpa_diloco_state(p)

    def _reference(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """y = mu_y x + (1 - mu_y) z, the restart point of the period now ending, computed as at its start (the same
        bits: x and z have not changed since)."""
        x, z = local_tensor(self.state[p][OUTER]), local_tensor(self.state[p][Z])
        return torch.lerp(z, x, group[MU_Y])

    def _outer_update(self, group: dict[str, Any], p: torch.Tensor, pseudo_grad: torch.Tensor) -> torch.Tensor:
        """z's SGD step with the averaged pseudo-gradient, x's average of it; the workers restart from the new y."""
        x, z = local_tensor(self.state[p][OUTER]), local_tensor(self.state[p][Z])
        z.sub_(pseudo_grad, alpha=group[OUTER_LR])
        x.copy_(torch.lerp(z, x, group[MU_X]))
        return torch.lerp(z, x, group[MU_Y])
