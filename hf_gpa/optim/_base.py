"""The base classes of every hf_gpa optimizer: the shared contract, in one place.

* **Checked groups** (`CheckedGroups`, the base of every hf_gpa optimizer). torch's constructor adds its groups
  through ``add_param_group``, so the constructor's groups are checked with the same code as those added later (the
  range checks themselves are ``_checks``'s), and a bad group raises and is not added. `defaults_from_arguments`
  turns a constructor's signature into torch's ``defaults``.
* **Train/eval modes** (`TrainEvalOptimizer`, the base of GPA's and DiLoCo's optimizers). In train mode the
  parameters hold the gradient point (GPA: y; DiLoCo: the inner weights); in eval mode they hold the evaluation
  weights (GPA: x; DiLoCo: the outer weights). The mode is recorded in the param groups and travels with
  ``state_dict()``, and so does the optimizer's name, which ``load_state_dict`` checks. How the weights are switched
  is each family's own (``_gpa_switch`` for GPA, ``diloco`` for DiLoCo).
* **Loading a state dict** (`load_checked`), with one order of checks:

  1. **Kind.** Every hf_gpa optimizer records its name in its param groups (``group["optimizer"]``: "GPAAdamW",
     "GPA(AdamW)", "DiLoCo(MuonWithAuxAdam)"), which travels with ``state_dict()`` through torch.save, accelerate and
     torch.distributed.checkpoint alike. A state of the same name is loaded. A state without a name was saved by an
     optimizer outside the GPA family (torch's AdamW, ``MuonWithAuxAdam``, a torchao AdamW): it is adopted when the
     receiving optimizer continues such a run (GPAAdamW an Adam/AdamW run, a wrapper a run of its base) and every
     saved per-parameter state has the keys that run creates; anything else raises a ``ValueError`` naming both
     optimizers.
  2. **Layout.** The saved param groups must match in number and sizes (and an adopted state's tensors the
     parameters' shapes).
  3. **Dtypes, as the receiving optimizer's modes want them.** Its own state keeps the saved dtypes (torch would cast
     the float32 z of a bf16 parameter to bf16), where the receiving optimizer can use them (``_check_loaded``:
     GPAAdamW refuses here what it cannot convert exactly into the parameters' dtype, and converts the rest once it
     is loaded, ``_loaded``); an adopted state is first created in the receiving optimizer's modes (GPAAdamW's
     ``state_dtype``, a low-bit base's quantized moments), and the saved values are copied into it.

  Nothing changes before all three checks passed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._checks import check_common
from ._types import EVAL_MU_Y, INITIAL_LR, LR, OPTIMIZER, STEP, TRAIN_MODE

__all__ = ["CheckedGroups", "TrainEvalOptimizer", "defaults_from_arguments", "load_checked", "saved_optimizer_name"]


def defaults_from_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """A constructor's arguments (its ``locals()`` on entry) as torch.optim ``defaults``, in the signature's order: the
    signature is the one list of an optimizer's hyper-parameter names. ``self``, ``params`` and ``__class__`` are left
    out; a list becomes a tuple (``betas=[0.9, 0.99]``), so the defaults compare and pickle like torch's."""
    return {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in arguments.items()
        if name not in ("self", "params", "__class__")
    }


class CheckedGroups(torch.optim.Optimizer):
    """``add_param_group`` runs ``_check_group`` on the group with its defaults filled in; a bad group raises and is
    not added. torch's constructor adds its groups through ``add_param_group``, so the constructor's groups are
    checked by the same code as those added later."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict[str, Any]) -> None:
        """Per-group argument checks; subclasses extend it (and call ``super()._check_group``)."""
        check_common(group)

    def _closure_loss(self, closure: Callable[[], Any] | None) -> Any:
        """What ``step()`` does first, as torch's optimizers: the closure's loss, computed with gradients enabled."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


class TrainEvalOptimizer(CheckedGroups):
    """Shared mode handling: ``train()``/``eval()``, the eval-mode guard on ``step()``, checked and dtype-safe loading.

    Subclasses implement ``_params_to_eval(group)`` and ``_params_to_train(group)``. The mode lives in each param
    group (``group[TRAIN_MODE]``) so that it travels with ``state_dict()``, and so does the optimizer's name
    (``group["optimizer"]``), which ``load_state_dict`` checks: a state saved by another optimizer raises a
    ``ValueError`` naming both, unless the subclass continues that run (``_adoptable_keys``; see `load_checked`).
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
        optimizer continues that run (an AdamW run switched to GPA); see the module docstring for the order of the
        checks.
        """
        load_checked(self, state_dict, super().load_state_dict)

    # ---- what `load_checked` asks of a subclass that continues another optimizer's run ----

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


# ---- loading a state dict ----


def saved_optimizer_name(state_dict: dict[str, Any]) -> str | None:
    """The hf_gpa optimizer that saved ``state_dict`` ("GPAAdamW", "GPA(AdamW)", "DiLoCo(AdamW)"), else None."""
    groups = state_dict.get("param_groups") or [{}]
    name = groups[0].get(OPTIMIZER)
    return None if name is None else str(name)


def load_checked(
    optimizer: TrainEvalOptimizer, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None]
) -> None:
    """Check ``state_dict`` against ``optimizer`` (kind, layout), then load it with ``load`` (torch's own loader) and
    restore the saved dtypes, or adopt it in the optimizer's modes."""
    saved = saved_optimizer_name(state_dict)
    if saved is not None and saved != optimizer.optimizer_name:
        raise ValueError(_mismatch(optimizer, f"{saved} (an hf_gpa optimizer of another kind)"))
    if saved is None:
        _check_adoptable(optimizer, state_dict)
    _check_layout(optimizer, state_dict)
    if saved is None:
        _check_shapes(optimizer, state_dict)
        _adopt(optimizer, state_dict)
        return
    saved_states = list(_saved_param_states(optimizer, state_dict))
    for param, saved_state, where in saved_states:
        optimizer._check_loaded(param, saved_state, where)
    load(state_dict)
    for param, saved_state, _ in saved_states:
        _restore_dtypes(optimizer.state[param], saved_state)
    optimizer._loaded()


def _describe(state_dict: dict[str, Any]) -> str:
    keys = sorted({str(k) for s in state_dict.get("state", {}).values() for k in s})
    groups = state_dict.get("param_groups", [])
    who = "MuonWithAuxAdam" if any("use_muon" in g for g in groups) else "an optimizer outside hf_gpa's GPA family"
    return f"{who} with per-parameter state {keys}" if keys else who


def _mismatch(optimizer: TrainEvalOptimizer, saved: str) -> str:
    name = optimizer.optimizer_name
    return (
        f"{name}.load_state_dict(): the state dict was saved by {saved}, not by {name}. Resume with the optimizer "
        "that saved it (the same --optim and base), or start a new run from the checkpoint's weights without its "
        "optimizer state (hf_gpa checkpoints hold x)."
    )


def _check_adoptable(optimizer: TrainEvalOptimizer, state_dict: dict[str, Any]) -> None:
    """Kind of a state without a name: each saved group's per-parameter states have the keys the run it continues
    creates (``optimizer._adoptable_keys(saved_group)``; None: this optimizer continues no such run)."""
    for saved_group in state_dict["param_groups"]:
        keys = optimizer._adoptable_keys(saved_group)
        states = [state_dict["state"].get(i) for i in saved_group["params"]]
        if keys is None or any(set(s) != keys for s in states if s):
            what = optimizer._adopts()
            also = f" {optimizer.optimizer_name} continues only a run of {what}." if what else ""
            raise ValueError(_mismatch(optimizer, _describe(state_dict)) + also)


def _check_layout(optimizer: TrainEvalOptimizer, state_dict: dict[str, Any]) -> None:
    saved = [len(g["params"]) for g in state_dict["param_groups"]]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if saved != mine:
        raise ValueError(
            f"{optimizer.optimizer_name}.load_state_dict(): the state dict has parameter groups of sizes {saved}, "
            f"this optimizer {mine}: it belongs to another model or grouping"
        )


def _check_shapes(optimizer: TrainEvalOptimizer, state_dict: dict[str, Any]) -> None:
    for param, saved, where in _saved_param_states(optimizer, state_dict):
        for key, value in saved.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"{optimizer.optimizer_name}.load_state_dict(): the saved {key} of {where} has shape "
                    f"{tuple(value.shape)}, the parameter {tuple(param.shape)}: the state belongs to another model"
                )


def _saved_param_states(
    optimizer: TrainEvalOptimizer, state_dict: dict[str, Any]
) -> Iterator[tuple[torch.Tensor, dict[str, Any], str]]:
    """(parameter, its saved state, where: "parameter 3 (param_groups[1]['params'][0])") in the order torch's
    ``load_state_dict`` pairs them, skipping empty states."""
    saved_ids = ((index, g, i) for g, group in enumerate(state_dict["param_groups"])
                 for i, index in enumerate(group["params"]))  # fmt: skip
    params = (p for g in optimizer.param_groups for p in g["params"])
    for (index, g, i), param in zip(saved_ids, params):
        saved = state_dict["state"].get(index)
        if saved:
            yield param, saved, f"parameter {index} (param_groups[{g}]['params'][{i}])"


def _restore_dtypes(state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Undo torch's cast of loaded state to the parameter dtype (fp32 z of a bf16 parameter must stay fp32)."""
    for key, value in saved.items():
        if isinstance(value, dict) and isinstance(state.get(key), dict):
            _restore_dtypes(state[key], value)
        elif torch.is_tensor(value) and key != STEP and value.dtype != state[key].dtype:
            state[key] = value.to(device=state[key].device, copy=True)


def _adopt(optimizer: TrainEvalOptimizer, state_dict: dict[str, Any]) -> None:
    """Continue another optimizer's run: the state created as a first step would (in this optimizer's modes), the
    saved values copied into it, then the schedule's position (``lr``, ``initial_lr``) and train mode.

    Every other hyper-parameter stays this optimizer's own; LR schedulers restore their own state separately and
    write ``lr`` only at their next step, so the saved ``lr`` is the one the next step must use.
    """
    saved = list(_saved_param_states(optimizer, state_dict))
    optimizer._reset_state()
    optimizer._create_state()
    for param, saved_state, _ in saved:
        target = optimizer._adopted_state(param)
        for key, value in saved_state.items():
            current = target.get(key)
            if torch.is_tensor(current) and torch.is_tensor(value):
                current.copy_(value)  # into the dtype, device and layout (quantized moments too) this optimizer keeps
            elif torch.is_tensor(current):
                current.fill_(value)
            else:
                target[key] = value.clone() if torch.is_tensor(value) else value
    for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"]):
        for key in (LR, INITIAL_LR):
            if key not in saved_group:
                continue
            if torch.is_tensor(group.get(key)):
                group[key].fill_(saved_group[key])
            else:
                group[key] = saved_group[key]
        group[TRAIN_MODE] = True
        group.pop(EVAL_MU_Y, None)
