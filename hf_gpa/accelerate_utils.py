"""GPA in a plain accelerate loop (no Trainer): the saving and resuming calls that know about x and y.

`accelerator.save_model(model, ...)` and `accelerator.save_state(...)` write whatever the parameters hold, which
during training is GPA's gradient point y, not the weights to keep, x. These wrappers make the same accelerate calls
with x in the parameters (through `hf_gpa.checkpoint.evaluation_weights`, so y is back bitwise afterwards, also
when the save raises), and `load_state` turns a state saved that way back into y exactly. They work with every
optimizer (for a stock one they are the plain accelerate calls) and with the optimizer as `accelerator.prepare`
returns it.

    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    ...
    save_state(accelerator, optimizer, "ckpt")         # resumable: x in the model files, the state to restore y
    load_state(accelerator, optimizer, "ckpt")         # (after prepare, in a new run) y back bitwise
    save_x_model(accelerator, model, optimizer, "final")  # the weights to keep: x, loadable as usual
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from hf_gpa.checkpoint import evaluation_weights, unwrap_gpa_optimizer

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch import nn

__all__ = ["load_state", "save_state", "save_x_model"]


def save_x_model(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: Any,
    save_directory: str | os.PathLike[str],
    **kwargs: Any,
) -> None:
    """`accelerator.save_model(model, save_directory, **kwargs)` writing GPA's x.

    Call it on every process, as `save_model` itself (it gathers sharded models and writes on the main process).
    """
    with evaluation_weights(optimizer):
        accelerator.save_model(model, save_directory, **kwargs)


def save_state(
    accelerator: Accelerator, optimizer: Any, output_dir: str | os.PathLike[str] | None = None, **kwargs: Any
) -> str:
    """`accelerator.save_state(output_dir, **kwargs)` in GPA's eval mode; returns the folder written.

    As in `GPATrainer` checkpoints, the model files hold x and the optimizer state is the eval-mode state, whose
    integer residual lets `load_state` restore y bitwise. Call it on every process.
    """
    with evaluation_weights(optimizer):
        return accelerator.save_state(None if output_dir is None else os.fspath(output_dir), **kwargs)


def load_state(
    accelerator: Accelerator, optimizer: Any, input_dir: str | os.PathLike[str] | None = None, **kwargs: Any
) -> None:
    """`accelerator.load_state(input_dir, **kwargs)`, then y back in the parameters, bitwise as when it was saved.

    Accepts a state from `save_state` above (x and the eval-mode optimizer state) and one from a plain
    `accelerator.save_state` (y and a train-mode state). Call it after `accelerator.prepare`, on every process.
    """
    inner = unwrap_gpa_optimizer(optimizer)
    if inner is not None and getattr(accelerator, "is_fsdp2", False):
        # FSDP2 loads into a template taken from this optimizer and keeps only the keys it has: give it the
        # eval-mode keys (the residual) that our states carry.
        inner.init_state(eval_mode=True)
    accelerator.load_state(None if input_dir is None else os.fspath(input_dir), **kwargs)
    if inner is not None:
        inner.train()
