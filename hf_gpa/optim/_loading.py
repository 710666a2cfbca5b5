"""Loading a state dict into an hf_gpa optimizer: the one place, with one order of checks.

1. **Kind.** Every hf_gpa optimizer records its name in its param groups (``group["optimizer"]``: "GPAAdamW",
   "GPA(AdamW)", "DiLoCo(MuonWithAuxAdam)"), which travels with ``state_dict()`` through torch.save, accelerate and
   torch.distributed.checkpoint alike. A state of the same name is loaded. A state without a name was saved by an
   optimizer outside the GPA family (torch's AdamW, ``MuonWithAuxAdam``, a torchao AdamW): it is adopted when the
   receiving optimizer continues such a run (GPAAdamW an Adam/AdamW run, a wrapper a run of its base) and every saved
   per-parameter state has the keys that run creates; anything else raises a ``ValueError`` naming both optimizers.
2. **Layout.** The saved param groups must match in number and sizes (and an adopted state's tensors the parameters'
   shapes).
3. **Dtypes, as the receiving optimizer's modes want them.** Its own state keeps the saved dtypes (torch would cast
   the float32 z of a bf16 parameter to bf16), where the receiving optimizer can use them (``_check_loaded``:
   GPAAdamW refuses here what it cannot convert exactly into the parameters' dtype, and converts the rest once it is
   loaded, ``_loaded``); an adopted state is first created in the receiving optimizer's modes (GPAAdamW's
   ``state_dtype``, a low-bit base's quantized moments), and the saved values are copied into it.

Nothing changes before all three checks passed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ._types import EVAL_MU_Y, INITIAL_LR, LR, OPTIMIZER, STEP, TRAIN_MODE

__all__ = ["Loadable", "saved_optimizer_name", "load_checked"]


class Loadable(Protocol):
    """What loading asks of an hf_gpa optimizer (``TrainEvalOptimizer`` provides it)."""

    state: defaultdict[torch.Tensor, dict[str, Any]]
    param_groups: list[dict[str, Any]]

    @property
    def optimizer_name(self) -> str: ...

    def _adoptable_keys(self, saved_group: dict[str, Any]) -> set[str] | None: ...

    def _adopts(self) -> str: ...

    def _adopted_state(self, p: torch.Tensor) -> dict[str, Any]: ...

    def _check_loaded(self, param: torch.Tensor, saved: dict[str, Any], where: str) -> None: ...

    def _loaded(self) -> None: ...

    def _reset_state(self) -> None: ...

    def _create_state(self) -> None: ...


def saved_optimizer_name(state_dict: dict[str, Any]) -> str | None:
    """The hf_gpa optimizer that saved ``state_dict`` ("GPAAdamW", "GPA(AdamW)", "DiLoCo(AdamW)"), else None."""
    groups = state_dict.get("param_groups") or [{}]
    name = groups[0].get(OPTIMIZER)
    return None if name is None else str(name)


def load_checked(optimizer: Loadable, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> None:
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


def _mismatch(optimizer: Loadable, saved: str) -> str:
    name = optimizer.optimizer_name
    return (
        f"{name}.load_state_dict(): the state dict was saved by {saved}, not by {name}. Resume with the optimizer "
        "that saved it (the same --optim and base), or start a new run from the checkpoint's weights without its "
        "optimizer state (hf_gpa checkpoints hold x)."
    )


def _check_adoptable(optimizer: Loadable, state_dict: dict[str, Any]) -> None:
    """Kind of a state without a name: each saved group's per-parameter states have the keys the run it continues
    creates (``optimizer._adoptable_keys(saved_group)``; None: this optimizer continues no such run)."""
    for saved_group in state_dict["param_groups"]:
        keys = optimizer._adoptable_keys(saved_group)
        states = [state_dict["state"].get(i) for i in saved_group["params"]]
        if keys is None or any(set(s) != keys for s in states if s):
            what = optimizer._adopts()
            also = f" {optimizer.optimizer_name} continues only a run of {what}." if what else ""
            raise ValueError(_mismatch(optimizer, _describe(state_dict)) + also)


def _check_layout(optimizer: Loadable, state_dict: dict[str, Any]) -> None:
    saved = [len(g["params"]) for g in state_dict["param_groups"]]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if saved != mine:
        raise ValueError(
            f"{optimizer.optimizer_name}.load_state_dict(): the state dict has parameter groups of sizes {saved}, "
            f"this optimizer {mine}: it belongs to another model or grouping"
        )


def _check_shapes(optimizer: Loadable, state_dict: dict[str, Any]) -> None:
    for param, saved, where in _saved_param_states(optimizer, state_dict):
        for key, value in saved.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"{optimizer.optimizer_name}.load_state_dict(): the saved {key} of {where} has shape "
                    f"{tuple(value.shape)}, the parameter {tuple(param.shape)}: the state belongs to another model"
                )


def _saved_param_states(
    optimizer: Loadable, state_dict: dict[str, Any]
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


def _adopt(optimizer: Loadable, state_dict: dict[str, Any]) -> None:
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
