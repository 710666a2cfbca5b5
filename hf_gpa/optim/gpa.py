"""GPA around any ``torch.optim.Optimizer``: the base optimizer moves z with the gradient taken at y.

The parameters hold y and the state holds z (plus the base optimizer's own state of z); x is recovered by ``eval()``
(paper, Algorithm 3). Around the base step GPA adds two passes over the parameters (``_passes``):

    y <- mu_x (y - (1 - mu_y) z)      (= mu_x mu_y x)
    z <- base(z, grad f(y))
    y <- y + (1 - mu_x mu_y) z        (= mu_y x' + (1 - mu_y) z')
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._checks import DEFAULT_AVERAGING, DEFAULT_MU_X, DEFAULT_MU_Y, base_defaults, check_averaging, check_lr, check_mu
from ._gpa_modes import GPAModes
from ._modes import local_tensor, state_dtype_for
from ._passes import foreach_add_scaled_, foreach_axpby_
from .schedules import averaging_mu_x

__all__ = ["GPA"]

_GPA_KEYS = ("mu_x", "mu_y", "averaging", "weight_sum", "train_mode")


class GPA(GPAModes):
    r"""GPA around any ``torch.optim.Optimizer``: the base moves z with the gradient taken at y.

    The base optimizer is built lazily (at the first step, after any FSDP wrapping) on the z tensors, which hold the
    parameters' gradients during its step; its own weight decay therefore acts on z, as in Algorithm 1. Around the
    base step GPA adds two passes over the parameters (single-pass C++ loops on CPU, foreach ops elsewhere):

    .. math::
        y \leftarrow \mu_x (y - (1 - \mu_y) z), \qquad z \leftarrow \mathrm{base}(z, \nabla f(y)), \qquad
        y \leftarrow y + (1 - \mu_x \mu_y) z

    The state of each parameter holds ``z`` and, under ``"base"``, the base's own state of z, so ``state_dict()``
    carries both. Per-group hyper-parameters (``lr``, ``weight_decay``, ``mu_x``, ``mu_y`` and the base's own) are
    forwarded to the base before every step, so LR schedulers act on this optimizer as usual.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        base: the base optimizer class, e.g. ``torch.optim.SGD``, ``torch.optim.AdamW``, ``torch.optim.Adafactor``,
            ``torch.optim.Muon`` (2-D parameters) (default: ``torch.optim.AdamW``).
        mu_x: averaging constant of x in [0, 1) (default: 0.9967).
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
        check_mu(mu_x, mu_y)
        check_averaging(averaging)
        base_hypers = base_defaults(base, base_kwargs, _GPA_KEYS, "GPA")
        defaults = dict(base_hypers, mu_x=mu_x, mu_y=mu_y, averaging=averaging, weight_sum=0.0)
        super().__init__(params, defaults)
        for group in self.param_groups:
            check_mu(group["mu_x"], group["mu_y"])
            check_averaging(group["averaging"])
            if "lr" in group:
                check_lr(group["lr"])
        self.base_class = base
        self._base_keys = tuple(base_hypers)
        self._base: torch.optim.Optimizer | None = None

    def _build_base(self) -> torch.optim.Optimizer:
        base_groups = []
        for group in self.param_groups:
            zs = []
            for p in group["params"]:
                state = self.state[p]
                if "z" not in state:
                    dtype = state_dtype_for(p)
                    state["z"] = p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format)
                zs.append(state["z"])
            base_groups.append({"params": zs, **{k: group[k] for k in self._base_keys if k in group}})
        base = self.base_class(base_groups)
        # The base's state of z lives inside this optimizer's state of p (one dict object), so it is saved and
        # loaded with it; it starts empty so that the base initializes it lazily as usual.
        for group in self.param_groups:
            for p in group["params"]:
                base.state[self.state[p]["z"]] = self.state[p].setdefault("base", {})
        return base

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The base optimizer acting on z (built on first use)."""
        if self._base is None:
            self._base = self._build_base()
        return self._base

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss at y (optional)."""
        loss = self._closure_loss(closure)
        base = self.base_optimizer
        stepped = []
        for group, base_group in zip(self.param_groups, base.param_groups):
            for key in self._base_keys:
                if key in group:
                    base_group[key] = group[key]
            ys, zs = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                z = self.state[p]["z"]
                z.grad = p.grad if p.grad.dtype == z.dtype else p.grad.to(z.dtype)
                ys.append(local_tensor(p))
                zs.append(local_tensor(z))
            if not ys:
                continue
            lr = float(group.get("lr", 0.0))
            mu_x, group["weight_sum"] = averaging_mu_x(group["averaging"], group["mu_x"], lr, group["weight_sum"])
            mu_y = group["mu_y"]
            foreach_axpby_(ys, zs, 1.0 - mu_y, mu_x)  # y <- mu_x (y - (1 - mu_y) z) = mu_x mu_y x
            stepped.append((ys, zs, 1.0 - mu_x * mu_y))
        base.step()
        for ys, zs, c in stepped:
            foreach_add_scaled_(ys, zs, c)  # y <- mu_x mu_y x + (1 - mu_x mu_y) z'
            for z in zs:
                z.grad = None
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load z and the base's state; the base is rebuilt on the loaded z tensors."""
        super().load_state_dict(state_dict)
        self._base = None
