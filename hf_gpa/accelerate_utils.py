"""GPA in a plain accelerate loop (no Trainer): the evaluating, saving and resuming calls that know about x and y.

During training the parameters hold GPA's gradient point y, not the weights to keep, x. A loop written for a stock
optimizer (transformers' ``run_clm_no_trainer.py``, say) evaluates and saves whatever the parameters hold, so it
reports y's loss and ships y. Four names cover every place such a loop reads or writes the weights; each works with
every optimizer (for a stock one it is the plain accelerate call) and with the optimizer as `accelerator.prepare`
returns it:

    from hf_gpa.accelerate_utils import evaluation_weights, load_state, save_state, save_x_model

    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    ...
    with evaluation_weights(optimizer):                # the loop's evaluation (or any write of the model) at x;
        model.eval()                                   # y back bitwise on exit, also on an error
        ...
    save_state(accelerator, optimizer, "ckpt")         # resumable: x in the model files, the state to restore y
    load_state(accelerator, optimizer, "ckpt")         # (after prepare, in a new run) y back bitwise
    save_x_model(accelerator, model, optimizer, "final", tokenizer=tokenizer)  # x, loadable with from_pretrained

`evaluation_weights` is `hf_gpa.checkpoint.evaluation_weights`, the one switch everything here goes through.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from hf_gpa.checkpoint import evaluation_weights, unwrap_gpa_optimizer

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch import nn

__all__ = ["evaluation_weights", "load_state", "save_state", "save_x_model"]


def save_x_model(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: Any,
    save_directory: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    **kwargs: Any,
) -> None:
    """Write GPA's x as the model to keep: the stock loop's final save, at x.

    A model with ``save_pretrained`` once unwrapped (a transformers or PEFT model) is written as transformers'
    no-Trainer examples write it, ``unwrap_model(model).save_pretrained(save_directory, is_main_process=...)``, with
    the state dict of `accelerator.get_state_dict` (gathered where the model is sharded): config and weights, loadable
    with ``from_pretrained``. Any other module is written by `accelerator.save_model` (weights only). ``kwargs`` go
    to that call (``max_shard_size=...``). ``tokenizer``: anything with ``save_pretrained`` (a tokenizer, an image
    processor) that the main process writes beside the weights. Call it on every process, as accelerate's own
    saving; on return the folder is complete.
    """
    save_directory = os.fspath(save_directory)
    unwrapped = accelerator.unwrap_model(model)
    with evaluation_weights(optimizer):
        if callable(getattr(unwrapped, "save_pretrained", None)):
            unwrapped.save_pretrained(
                save_directory,
                is_main_process=accelerator.is_main_process,
                state_dict=accelerator.get_state_dict(model),
                **kwargs,
            )
        else:
            accelerator.save_model(model, save_directory, **kwargs)
    if tokenizer is not None and accelerator.is_main_process:
        tokenizer.save_pretrained(save_directory)
    accelerator.wait_for_everyone()


def save_state(
    accelerator: Accelerator, optimizer: Any, output_dir: str | os.PathLike[str] | None = None, **kwargs: Any
) -> str:
    """`accelerator.save_state(output_dir, **kwargs)` in GPA's eval mode; returns the folder written, as a str.

    As in `GPATrainer` checkpoints, the model files hold x and the optimizer state is the eval-mode state, whose
    integer residual lets `load_state` restore y bitwise. Call it on every process.
    """
    with evaluation_weights(optimizer):
        # accelerate returns the folder as a str or a Path depending on its version and project configuration.
        return os.fspath(accelerator.save_state(None if output_dir is None else os.fspath(output_dir), **kwargs))


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
