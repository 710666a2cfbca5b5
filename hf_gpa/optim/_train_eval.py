"""The train/eval modes shared by every hf_gpa optimizer, and its checked loading of state dicts.

In train mode the parameters hold the gradient point (GPA: y; DiLoCo: the inner weights); in eval mode they hold
the evaluation weights (GPA: x; DiLoCo: the outer weights). The mode is recorded in the param groups and travels
with ``state_dict()``, and so does the optimizer's name, which ``load_state_dict`` checks. How the weights are
switched is each family's own (``_gpa_switch`` for GPA, ``diloco`` for DiLoCo).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ._checked_groups import CheckedGroups
from ._loading import load_checked
from ._types import OPTIMIZER, TRAIN_MODE

__all__ = ["TrainEvalOptimizer"]


class TrainEvalOptimizer(CheckedGroups):
    """Shared mode handling: ``train()``/``eval()``, the eval-mode guard on ``step()``, checked and dtype-safe loading.

    Subclasses implement ``_params_to_eval(group)`` and ``_params_to_train(group)``. The mode lives in each param
    group (``group[TRAIN_MODE]``) so that it travels with ``state_dict()``, and so does the optimizer's name
    (``group["optimizer"]``), which ``load_state_dict`` checks: a state saved by another optimizer raises a
    ``ValueError`` naming both, unless the subclass continues that run (``_adoptable_keys``; see ``_loading``).
    """

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        defaults = {**defaults, TRAIN_MODE: True, OPTIMIZER: self.optimizer_name}
        super().__init__(params, defaults)

    @property
    def optimizer_name(self) -> str:
        """The name recorded in the state dict: the hf_gpa class (a user's subclass is named by its hf_gpa parent)."""
        return next(c.__name__ for c in type(self).__mro__ if c.__module__.startswith("hf_gpa.optim"))

    @property
    def train_mode(self) -> bool:
        """True while the parameters hold the gradient point (a new optimizer starts in train mode)."""
        return all(group[TRAIN_MODE] for group in self.param_groups)

    @torch.no_grad()
    def eval(self) -> None:
        """Put the evaluation weights into the parameters. Idempotent."""
        for group in self.param_groups:
            if group[TRAIN_MODE]:
                self._params_to_eval(group)
                group[TRAIN_MODE] = False

    @torch.no_grad()
    def train(self) -> None:
        """Put the training iterate back into the parameters, bitwise as it was before ``eval()``. Idempotent."""
        for group in self.param_groups:
            if not group[TRAIN_MODE]:
                self._params_to_train(group)
                group[TRAIN_MODE] = True

    @torch.no_grad()
    def init_state(self, eval_mode: bool = False) -> None:
        """Create every parameter's state now, without a step, then switch to eval mode if asked.

        State is normally created lazily in ``step()``. Checkpoint loaders that fill a template taken from the
        optimizer (``torch.distributed.checkpoint`` under FSDP2) only restore keys the template has; call
        ``init_state(eval_mode=True)`` before taking the template when the checkpoint was saved in eval mode, so the
        residual that restores y exactly is loaded too. Parameters, step counts and group values are left as they
        are (the state is what a first step would find); the load that follows overwrites it.
        """
        self.train()  # the state is created for y (an early eval() of stateless parameters switched nothing)
        self._create_state()
        if eval_mode:
            self.eval()

    def _create_state(self) -> None:
        """Create the state of every parameter that requires a gradient and has none yet, as a first step would find
        it, without changing the parameters, the group values or any existing state."""
        raise NotImplementedError

    def _params_to_eval(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _params_to_train(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _check_train_mode(self) -> None:
        if not self.train_mode:
            raise RuntimeError(
                f"{type(self).__name__}.step() was called in eval mode (the parameters hold the averaged "
                "weights). Call optimizer.train() before training steps, and optimizer.eval() before evaluation."
            )

    def _closure_loss(self, closure: Callable[[], Any] | None) -> Any:
        """The mode guard of every ``step()``, then the closure's loss (computed with gradients enabled)."""
        self._check_train_mode()
        return super()._closure_loss(closure)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping the saved dtypes of the state (torch would cast it to the param dtype).

        The parameters must hold what they held when the state was saved: x if it was saved in eval mode. A state
        saved by another optimizer raises a ``ValueError`` naming both before anything changes, except where this
        optimizer continues that run (an AdamW run switched to GPA); see ``_loading`` for the order of the checks.
        """
        load_checked(self, state_dict, super().load_state_dict)

    # ---- what ``_loading`` asks of a subclass that continues another optimizer's run ----

    def _adoptable_keys(self, saved_group: dict[str, Any]) -> set[str] | None:
        """The per-parameter state keys of a run this optimizer continues, for a param group saved with
        ``saved_group``'s values; None: it continues no run of another optimizer (the default)."""
        return None

    def _adopts(self) -> str:
        """The optimizer whose runs this one continues, as an error message names it ("" for none)."""
        return ""

    def _adopted_state(self, p: torch.Tensor) -> dict[str, Any]:
        """Where the adopted state of ``p`` goes, once ``_create_state`` created it."""
        return self.state[p]

    def _check_loaded(self, param: torch.Tensor, saved: dict[str, Any], where: str) -> None:
        """Raise a ``ValueError``, before anything is loaded, where ``param`` cannot take its ``saved`` state
        (``where`` names the parameter); by default every state is taken."""

    def _loaded(self) -> None:
        """What is done with a state of this optimizer's own kind once loaded (default: nothing)."""

    def _reset_state(self) -> None:
        self.state = defaultdict(dict)
