"""Optimizer memory of AdamW, GPA-AdamW and GPA around low-bit AdamWs: state bytes, eval mode, step and save peaks.

(Work in progress: the accounting helpers come first; the table follows.)
"""

from __future__ import annotations

from typing import Any

import torch


def tensor_bytes(t: torch.Tensor, seen: set[int] | None = None) -> int:
    """Bytes a tensor holds: its inner tensors' for a wrapper subclass (torchao's 8-bit and 4-bit states report a
    float32 dtype, but hold uint8 codes and per-block scales); each storage counted once in ``seen``."""
    seen = set() if seen is None else seen
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name), seen) for name in names)
    key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
    if key in seen and t.numel():
        return 0
    seen.add(key)
    return t.numel() * t.element_size()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of all tensor state of an optimizer (nested dicts, such as a wrapper's base state, included)."""
    seen: set[int] = set()

    def walk(value: Any) -> int:
        if torch.is_tensor(value):
            return tensor_bytes(value, seen)
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        return 0

    return sum(walk(s) for s in optimizer.state.values())
