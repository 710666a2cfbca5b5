"""The train/eval modes shared by every hf_gpa optimizer, and its checked loading of state dicts.

In train mode the parameters hold the gradient point (GPA: y; DiLoCo: the inner weights); in eval mode they hold
the evaluation weights (GPA: x; DiLoCo: the outer weights). The mode is recorded in the param groups and travels
with ``state_dict()``, and so does the optimizer's name, which ``load_state_dict`` checks. How the weights are
switched is each family's own (``_gpa_switch`` for GPA, ``diloco`` for DiLoCo).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ._checks import CheckedGroups
from ._loading import OPTIMIZER_KEY, describe_stock, restore_dtypes, same_optimizer, saved_optimizer_name, tensor_steps
from ._types import FUSED, INITIAL_LR, LR, TRAIN_MODE

__all__ = ["TrainEvalOptimizer"]


class TrainEvalOptimizer(CheckedGroups):
    """Shared mode handling: ``train()``/``eval()``, the eval-mode guard on ``step()``, checked and dtype-safe loading.

    Subclasses implement ``_params_to_eval(group)`` and ``_params_to_train(group)``. The mode lives in each param
    group (``group[TRAIN_MODE]``) so that it travels with ``state_dict()``, and so does the optimizer's name
    (``group["optimizer"]``), which ``load_state_dict`` checks: a state saved by another optimizer raises a
    ``ValueError`` naming both, unless the subclass knows how to adopt it (``_load_stock_state_dict``).
    """

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        defaults = {**defaults, TRAIN_MODE: True, OPTIMIZER_KEY: self.optimizer_name}
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch calls this for pickles and at the end of load_state_dict: older states get today's conventions.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault(TRAIN_MODE, True)
            capturable = group.get(FUSED) or group.get("capturable")
            for p in group["params"]:
                if p in self.state:
                    tensor_steps(self.state[p], p.device if capturable else None)

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
        """Create the state of every parameter that requires a gradient (GPAAdamW creates it directly).

        This default is torch's own initializer (``torch.distributed.checkpoint``'s ``_init_optim_state``): one
        step with zero gradients and zero learning rates, the group values then restored (in train mode); it runs
        only while there is no state at all.
        """
        if self.state:
            return
        grads = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    grads[p] = p.grad
                    p.grad = torch.zeros_like(p)
        saved = [dict(group) for group in self.param_groups]
        for group in self.param_groups:
            if LR in group:
                group[LR] = 0.0
        try:
            self.step()
        finally:
            for group, old in zip(self.param_groups, saved):
                # The step left the optimizer in train mode with y in the parameters; keep that flag.
                group.update({k: v for k, v in old.items() if k not in ("params", TRAIN_MODE)})
            for p, g in grads.items():
                p.grad = g

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
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping the saved dtypes of the state (torch would cast it to the param dtype).

        The parameters must hold what they held when the state was saved: x if it was saved in eval mode. A state
        saved by another optimizer raises a ``ValueError`` before anything changes, except where this optimizer
        can continue that run (``_load_stock_state_dict``: an AdamW run switched to GPA).
        """
        self._check_layout(state_dict)
        saved = saved_optimizer_name(state_dict)
        if saved is None:
            self._load_stock_state_dict(state_dict)
            return
        if not same_optimizer(saved, self.optimizer_name):
            raise ValueError(self._mismatch(f"{saved} (an hf_gpa optimizer of another kind)"))
        super().load_state_dict(state_dict)
        saved_ids: Iterable[int] = (i for g in state_dict["param_groups"] for i in g["params"])
        params = (p for g in self.param_groups for p in g["params"])
        for index, param in zip(saved_ids, params):
            saved = state_dict["state"].get(index)
            if saved:
                restore_dtypes(self.state[param], saved)

    def _load_stock_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A stock torch optimizer's state: refused here; subclasses that can continue such a run adopt it."""
        raise ValueError(self._mismatch(describe_stock(state_dict)))

    def _mismatch(self, saved: str) -> str:
        return (
            f"{self.optimizer_name}.load_state_dict(): the state dict was saved by {saved}, not by "
            f"{self.optimizer_name}. Resume with the optimizer that saved it (the same --optim and base), or start a "
            "new run from the checkpoint's weights without its optimizer state (hf_gpa checkpoints hold x)."
        )

    def _check_layout(self, state_dict: dict[str, Any]) -> None:
        """The saved param groups must match ours in number and sizes (checked before anything is changed)."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                f"{self.optimizer_name}.load_state_dict(): the state dict has parameter groups of sizes "
                f"{[len(g['params']) for g in saved]}, this optimizer "
                f"{[len(g['params']) for g in self.param_groups]}: it belongs to another model or grouping"
            )

    def _saved_param_states(self, state_dict: dict[str, Any]) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """(parameter, its saved state) in the order torch's ``load_state_dict`` pairs them, skipping empty states."""
        saved_ids = (i for g in state_dict["param_groups"] for i in g["params"])
        params = (p for g in self.param_groups for p in g["params"])
        for index, param in zip(saved_ids, params):
            saved = state_dict["state"].get(index)
            if saved:
                yield param, saved

    def _check_stock_state(self, state_dict: dict[str, Any], keys: set[str], what: str) -> None:
        """A stock state can be adopted only when every saved per-parameter state has exactly ``keys``."""
        amsgrad = any(g.get("amsgrad") for g in state_dict["param_groups"])
        if amsgrad or any(set(s) != keys for s in state_dict["state"].values() if s):
            raise ValueError(
                self._mismatch(describe_stock(state_dict) + (" with amsgrad" if amsgrad else ""))
                + f" {self.optimizer_name} continues only a run of {what} (per-parameter state {sorted(keys)})."
            )
        saved_ids = [(g, i, index) for g, group in enumerate(state_dict["param_groups"]) for i, index in
                     enumerate(group["params"])]  # fmt: skip
        params = [p for group in self.param_groups for p in group["params"]]
        for (g, i, index), param in zip(saved_ids, params):
            for key, value in (state_dict["state"].get(index) or {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    raise ValueError(
                        f"{self.optimizer_name}.load_state_dict(): the saved {key} of parameter {index} "
                        f"(param_groups[{g}]['params'][{i}]) has shape {tuple(value.shape)}, the parameter "
                        f"{tuple(param.shape)}: the state belongs to another model"
                    )

    def _adopt_schedule(self, state_dict: dict[str, Any]) -> None:
        """After adopting a stock state: the saved lr schedule position (``lr``, ``initial_lr``), train mode.

        Every other hyper-parameter stays this optimizer's own; LR schedulers restore their own state separately
        and write ``lr`` only at their next step, so the saved ``lr`` is the one the next step must use.
        """
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            for key in (LR, INITIAL_LR):
                if key not in saved:
                    continue
                if torch.is_tensor(group.get(key)):
                    group[key].fill_(saved[key])
                else:
                    group[key] = saved[key]
            group[TRAIN_MODE] = True

    def _reset_state(self) -> None:
        self.state = defaultdict(dict)
