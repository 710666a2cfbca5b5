"""Evaluation-weight (x) export that never leaves the training weights changed.

GPA computes gradients at y and evaluates at x; the optimizer holds one of the two in the parameters at a time
(`train()` -> y, `eval()` -> x, the way back to y being bitwise exact). Whatever writes the model -- a checkpoint,
`save_model`, a Hub push, a plain PyTorch loop -- must write x and then leave the parameters holding y exactly as
before, also when the write fails half-way. `evaluation_weights` is that one switch, inside try/finally; the rest
of this file and `GPATrainer` go through it.

The optimizer may be wrapped (accelerate's `AcceleratedOptimizer` keeps the real one in `.optimizer`); the helpers
here unwrap it. For any other optimizer they do nothing, so the same code path serves stock optimizers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hf_gpa.optim._modes import PrimalAveragingOptimizer

__all__ = ["SAFE_WEIGHTS_NAME", "evaluation_weights", "save_x_weights", "unwrap_gpa_optimizer", "x_state_dict"]

SAFE_WEIGHTS_NAME = "model.safetensors"
_MAX_WRAPPER_DEPTH = 8  # accelerate wraps once; DeepSpeed/SMP-style wrappers add a level or two at most


def unwrap_gpa_optimizer(optimizer: Any) -> PrimalAveragingOptimizer | None:
    """The hf_gpa optimizer inside ``optimizer`` (itself, or behind ``.optimizer`` wrappers), else None."""
    for _ in range(_MAX_WRAPPER_DEPTH):
        if optimizer is None or isinstance(optimizer, PrimalAveragingOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


@contextlib.contextmanager
def evaluation_weights(optimizer: Any) -> Iterator[None]:
    """Inside the block the parameters hold x; on exit (also by an exception) the mode found on entry is restored.

    A no-op for optimizers without an x/y split (stock torch ones, None) and when already in eval mode.
    """
    inner = unwrap_gpa_optimizer(optimizer)
    if inner is None or not inner.train_mode:
        yield
        return
    inner.eval()
    try:
        yield
    finally:
        inner.train()


def x_state_dict(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """A detached copy of ``model.state_dict()`` at x; the live parameters are left as they were."""
    with evaluation_weights(optimizer):
        return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def save_x_weights(model: nn.Module, optimizer: Any, output_dir: str | os.PathLike[str]) -> str:
    """Write the x weights of ``model`` to ``output_dir`` and return the weights file's path.

    A `PreTrainedModel` is written with ``save_pretrained`` (config included, loadable with ``from_pretrained``);
    any other module as ``model.safetensors`` via `safetensors.torch.save_model`, which handles tied weights.
    """
    from safetensors.torch import save_model

    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    with evaluation_weights(optimizer):
        if callable(getattr(model, "save_pretrained", None)):
            model.save_pretrained(output_dir)
        else:
            save_model(model, os.path.join(output_dir, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    return os.path.join(output_dir, SAFE_WEIGHTS_NAME)
