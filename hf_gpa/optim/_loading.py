"""Which optimizer saved a state dict, and the dtype-safe restore of loaded state (shared by every optimizer)."""

from __future__ import annotations

from typing import Any

import torch

from ._types import BASE, EXP_AVG, INNER_STEPS, OPTIMIZER, STEP, TRAIN_MODE

__all__ = [
    "OPTIMIZER_KEY",
    "saved_optimizer_name",
    "describe_stock",
    "same_optimizer",
    "restore_dtypes",
    "tensor_steps",
]


# The param-group key naming the optimizer that wrote a state dict ("GPAAdamW", "GPA(AdamW)", "DiLoCo(SGD)"): it
# travels with ``state_dict()`` through torch.save, accelerate and torch.distributed.checkpoint alike.
OPTIMIZER_KEY = OPTIMIZER

# Names for state dicts saved before the name was recorded: the family, read from the per-parameter state's keys.
_SOME_GPA = "GPA"  # no per-parameter state yet: GPAAdamW or a GPA wrapper, nothing to tell them apart
_GPA_WRAPPER = "GPA(base unknown)"  # z with a nested base state: a GPA wrapper of an unknown base
_DILOCO = "DiLoCo(base unknown)"  # a DiLoCo wrapper of an unknown base


def saved_optimizer_name(state_dict: dict[str, Any]) -> str | None:
    """The hf_gpa optimizer that saved ``state_dict`` ("GPAAdamW", "GPA(AdamW)", "DiLoCo(AdamW)"), else None.

    State dicts written before the name was recorded are recognized by their keys: the groups' ``train_mode`` makes
    them hf_gpa's, ``inner_steps`` DiLoCo's; the per-parameter state tells GPAAdamW (z, exp_avg, ...) from a GPA
    wrapper (z and the base's state under "base"); the wrappers' base stays unknown.
    """
    groups = state_dict.get("param_groups") or [{}]
    group = groups[0]
    if OPTIMIZER_KEY in group and TRAIN_MODE in group:
        return str(group[OPTIMIZER_KEY])
    if TRAIN_MODE not in group:
        return None
    if INNER_STEPS in group:
        return _DILOCO
    states = [s for s in state_dict.get("state", {}).values() if s]
    if any(EXP_AVG in s for s in states):
        return "GPAAdamW"
    if any(BASE in s for s in states):
        return _GPA_WRAPPER
    return _SOME_GPA


def describe_stock(state_dict: dict[str, Any]) -> str:
    keys = sorted({str(k) for s in state_dict.get("state", {}).values() for k in s})
    return f"a torch.optim optimizer with per-parameter state {keys}" if keys else "a torch.optim optimizer"


def same_optimizer(saved: str, mine: str) -> bool:
    """Same name, or a state dict from before names were recorded whose keys belong to this optimizer's family."""
    if saved == _SOME_GPA:
        return mine == "GPAAdamW" or mine.startswith("GPA(")
    if saved == _GPA_WRAPPER:
        return mine.startswith("GPA(")
    if saved == _DILOCO:
        return mine.startswith("DiLoCo(")
    return saved == mine


def restore_dtypes(state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Undo torch's cast of loaded state to the parameter dtype (fp32 z of a bf16 parameter must stay fp32)."""
    for key, value in saved.items():
        if isinstance(value, dict) and isinstance(state.get(key), dict):
            restore_dtypes(state[key], value)
        elif torch.is_tensor(value) and key != STEP and value.dtype != state[key].dtype:
            state[key] = value.to(device=state[key].device, copy=True)


def tensor_steps(state: dict[str, Any], base_device: torch.device | None = None) -> None:
    """A ``step`` saved as a Python number (torch < 1.12) as the float32 tensor torch keeps now, as torch's
    ``Adam.__setstate__`` converts it on load: GPAAdamW's on the CPU, the one in a wrapper's base state
    (``state["base"]``) on ``base_device`` (the parameter's device for fused/capturable bases, else the CPU)."""
    for target, device in ((state, None), (state.get(BASE), base_device)):
        if isinstance(target, dict) and STEP in target and not torch.is_tensor(target[STEP]):
            target[STEP] = torch.tensor(float(target[STEP]), dtype=torch.float32, device=device)
