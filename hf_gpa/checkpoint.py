"""Evaluation-weight (x) export that never leaves the training weights changed.

GPA computes gradients at y and evaluates at x; the optimizer holds one of the two in the parameters at a time
(`train()` -> y, `eval()` -> x, the way back to y being bitwise exact). Whatever writes the model -- a checkpoint,
`save_model`, a Hub push, a plain PyTorch loop -- must write x and then leave the parameters holding y exactly as
before, also when the write fails half-way. `evaluation_weights` is that one switch, inside try/finally; the rest
of this file and `GPATrainer` go through it.

The optimizer may be wrapped (accelerate's `AcceleratedOptimizer` keeps the real one in `.optimizer`); the helpers
here unwrap it. For any other optimizer they do nothing, so the same code path serves stock optimizers.

A model with BatchNorm (or other norm layers with running statistics, see `hf_gpa.batchnorm`) carries statistics
estimated at y. Given a few training batches (``bn_batches``), the helpers recompute them at x for the block, and
restore y's statistics exactly on exit (`hf_gpa.batchnorm.NormStatisticsAtX`, the holder `GPATrainer` uses too).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from hf_gpa.batchnorm import DEFAULT_RECALIBRATION_BATCHES, NormStatisticsAtX, check_recalibration_batches
from hf_gpa.optim import TrainEvalOptimizer

__all__ = [
    "SAFE_WEIGHTS_NAME",
    "evaluation_weights",
    "random_state_kept",
    "save_x_weights",
    "unwrap_gpa_optimizer",
    "x_state_dict",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
_MAX_WRAPPER_DEPTH = 8  # accelerate wraps once; DeepSpeed/SMP-style wrappers add a level or two at most


def unwrap_gpa_optimizer(optimizer: Any) -> TrainEvalOptimizer | None:
    """The hf_gpa optimizer inside ``optimizer`` (itself, or behind ``.optimizer`` wrappers), else None."""
    for _ in range(_MAX_WRAPPER_DEPTH):
        if optimizer is None or isinstance(optimizer, TrainEvalOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


@contextlib.contextmanager
def random_state_kept(device: torch.device | str | None = None) -> Iterator[None]:
    """On exit (also by an exception) Python's, NumPy's and torch's global random generators are as on entry.

    Evaluating or saving in the middle of training must not change what training draws next: an evaluation's
    DataLoader takes a number from torch's generator to seed itself, which would shift every later dropout mask and
    shuffle. ``device``: an accelerator whose generator is kept too (the CPU's always is).
    """
    try:
        import numpy as np
    except ImportError:  # NumPy is optional here
        np = None
    device = torch.device(device) if device is not None else torch.device("cpu")
    accelerator = [] if device.type in ("cpu", "meta") else [device]
    python_state = random.getstate()
    numpy_state = np.random.get_state() if np is not None else None
    with torch.random.fork_rng(devices=accelerator, device_type=device.type if accelerator else "cuda"):
        try:
            yield
        finally:
            random.setstate(python_state)
            if np is not None:
                np.random.set_state(numpy_state)


@contextlib.contextmanager
def evaluation_weights(
    optimizer: Any,
    model: nn.Module | None = None,
    *,
    bn_batches: Iterable[Any] | None = None,
    bn_num_batches: int = DEFAULT_RECALIBRATION_BATCHES,
    bn_forward: Callable[[nn.Module, Any], Any] | None = None,
) -> Iterator[bool]:
    """Inside the block the parameters hold x; on exit (also by an exception) the mode found on entry is restored.

    A no-op for optimizers without an x/y split (stock torch ones, None) and when already in eval mode. The block
    receives whether this call switched to x (``with evaluation_weights(opt) as switched:``). With
    ``model`` and ``bn_batches`` (an iterable of training batches: a DataLoader may be passed as it is), the running
    statistics of ``model``'s norm layers are recomputed at x from at most ``bn_num_batches`` of them for the block
    and y's statistics restored exactly on exit; the global random generators are left as they were, so passing the
    training DataLoader does not change training's data order. A batch is forwarded by ``bn_forward(model, batch)``,
    by default ``model(**batch)`` for a mapping, ``model(batch[0])`` for an ``(inputs, targets)`` pair, else
    ``model(batch)`` (`hf_gpa.batchnorm.default_forward`). Under DDP the statistics are those of this process's
    batches: pass every rank the same batches, or use `hf_gpa.batchnorm.recalibrate_norm_statistics` with
    ``all_reduce=True``.
    """
    bn_num_batches = check_recalibration_batches(bn_num_batches, "bn_num_batches")
    if bn_batches is not None and model is None:
        raise ValueError("evaluation_weights: bn_batches needs the model whose statistics to recompute (model=...)")
    inner = unwrap_gpa_optimizer(optimizer)
    if inner is None:
        yield False
        return
    switch = inner.train_mode
    if switch:
        inner.eval()
    statistics = NormStatisticsAtX(model) if model is not None else None
    try:
        if statistics is not None:
            statistics.to_x(bn_batches, bn_num_batches, forward=bn_forward)
        yield switch
    finally:
        if statistics is not None:
            statistics.to_y()
        if switch:
            inner.train()


def x_state_dict(
    model: nn.Module,
    optimizer: Any,
    *,
    bn_batches: Iterable[Any] | None = None,
    bn_num_batches: int = DEFAULT_RECALIBRATION_BATCHES,
    bn_forward: Callable[[nn.Module, Any], Any] | None = None,
) -> dict[str, torch.Tensor]:
    """A detached copy of ``model.state_dict()`` at x; the live parameters are left as they were.

    ``bn_batches=...`` (and ``bn_num_batches``, ``bn_forward``) as in `evaluation_weights`: the copy then holds the
    norm statistics recomputed at x.
    """
    with evaluation_weights(
        optimizer, model, bn_batches=bn_batches, bn_num_batches=bn_num_batches, bn_forward=bn_forward
    ):
        return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def save_x_weights(
    model: nn.Module,
    optimizer: Any,
    output_dir: str | os.PathLike[str],
    *,
    bn_batches: Iterable[Any] | None = None,
    bn_num_batches: int = DEFAULT_RECALIBRATION_BATCHES,
    bn_forward: Callable[[nn.Module, Any], Any] | None = None,
) -> str:
    """Write the x weights of ``model`` to ``output_dir`` and return the weights file's path.

    A `PreTrainedModel` is written with ``save_pretrained`` (config included, loadable with ``from_pretrained``);
    any other module as ``model.safetensors`` via `safetensors.torch.save_model`, which handles tied weights.
    ``bn_batches=...`` (and ``bn_num_batches``, ``bn_forward``) as in `evaluation_weights`: the file then holds the
    norm statistics recomputed at x.
    """
    from safetensors.torch import save_model

    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    with evaluation_weights(
        optimizer, model, bn_batches=bn_batches, bn_num_batches=bn_num_batches, bn_forward=bn_forward
    ):
        if callable(getattr(model, "save_pretrained", None)):
            model.save_pretrained(output_dir)
        else:
            save_model(model, os.path.join(output_dir, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    return os.path.join(output_dir, SAFE_WEIGHTS_NAME)
