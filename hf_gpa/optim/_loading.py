"""Which optimizer saved a state dict, and the dtype-safe restore of loaded state (shared by every optimizer)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OPTIMIZER_KEY", "saved_optimizer_name", "describe_stock", "same_optimizer", "restore_dtypes"]


# The param-group key naming the optimizer that wrote a state dict ("GPAAdamW", "GPA(AdamW)", "DiLoCo(SGD)"): it
# travels with ``state_dict()`` through torch.save, accelerate and torch.distributed.checkpoint alike.
OPTIMIZER_KEY = "optimizer"


def saved_optimizer_name(state_dict: dict[str, Any]) -> str | None:
    """The hf_gpa optimizer that saved ``state_dict`` ("GPAAdamW", "GPA(AdamW)", "DiLoCo(AdamW)"), else None.

    State dicts written before the name was recorded are recognized by their keys ("GPA" or "DiLoCo", base unknown).
    """
    groups = state_dict.get("param_groups") or [{}]
    group = groups[0]
    if OPTIMIZER_KEY in group and "train_mode" in group:
        return str(group[OPTIMIZER_KEY])
    if "train_mode" not in group:
        return None
    return "DiLoCo" if "inner_steps" in group else "GPA"


def describe_stock(state_dict: dict[str, Any]) -> str:
    keys = sorted({str(k) for s in state_dict.get("state", {}).values() for k in s})
    return f"a torch.optim optimizer with per-parameter state {keys}" if keys else "a torch.optim optimizer"


def same_optimizer(saved: str, mine: str) -> bool:
    """Same name, or a state dict from before names were recorded ("GPA" / "DiLoCo") of the same family."""
    if saved in ("GPA", "DiLoCo"):
        family = "DiLoCo" if mine.startswith("DiLoCo") else "GPA"
        return saved == family
    return saved == mine


def restore_dtypes(state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Undo torch's cast of loaded state to the parameter dtype (fp32 z of a bf16 parameter must stay fp32)."""
    for key, value in saved.items():
        if isinstance(value, dict) and isinstance(state.get(key), dict):
            restore_dtypes(state[key], value)
        elif torch.is_tensor(value) and key != "step" and value.dtype != state[key].dtype:
            state[key] = value.to(device=state[key].device, copy=True)
