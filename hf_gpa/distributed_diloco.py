"""DiLoCo across the processes of a `GPATrainer` run (``--diloco_distributed``): what the Trainer does differently.

With W processes and M workers, each worker is an island of W / M processes. Three things differ from a DDP run:

* Gradients are averaged inside each island only. The Trainer wraps the model in a DDP over the island's process
  group (`island_ddp`) instead of letting accelerate build one over all W processes: between outer steps no
  gradient, bucket layout or buffer crosses the workers; only the optimizer's outer all-reduce does, once per outer
  step (per fragment).
* Every process holds its worker's inner weights and inner optimizer state, which differ between workers, so every
  process writes its own optimizer state into a checkpoint (`worker_optimizer_file`: ``optimizer_rank{r}.pt``, in
  eval mode: the model file holds the outer weights, the same on every process, written once by the first).
* A checkpoint resumes only on the layout that saved it (world size, M, P): `refuse_other_layout` reads it before
  anything is trained or loaded, and a checkpoint of a run across processes is refused to a run that is not one.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers.trainer import OPTIMIZER_NAME

from hf_gpa.optim import WorkerLayout, saved_diloco_layout

if TYPE_CHECKING:
    from torch import nn
    from transformers import TrainingArguments

__all__ = ["OPTIMIZER_RANK_NAME", "island_ddp", "refuse_other_layout", "requested_layout", "worker_optimizer_file"]

#: Each process's optimizer state in a checkpoint of a run across processes (``rank``: its global rank).
OPTIMIZER_RANK_NAME = "optimizer_rank{rank}.pt"

#: The flags that set each field of a layout, as the refusals name them.
_FLAGS = {
    "world_size": "the world size (the number of processes)",
    "num_workers": "--diloco_workers",
    "num_fragments": "--diloco_fragments",
}


def worker_optimizer_file(checkpoint: str, rank: int) -> str:
    """The optimizer state file that process ``rank`` writes into (and resumes from) ``checkpoint``."""
    return os.path.join(checkpoint, OPTIMIZER_RANK_NAME.format(rank=rank))


def requested_layout(args: TrainingArguments, world_size: int, rank: int) -> WorkerLayout | None:
    """The layout ``args`` ask for on ``world_size`` processes, seen from process ``rank`` (None: not DiLoCo across
    processes). Nothing is created or communicated."""
    if not getattr(args, "diloco_distributed", False):
        return None
    workers = args.diloco_workers or world_size
    return WorkerLayout(world_size, workers, args.diloco_fragments, worker=rank // (world_size // workers))


def refuse_other_layout(checkpoint: str, layout: WorkerLayout | None, rank: int) -> None:
    """Raise a ``ValueError`` naming what differs when ``checkpoint`` was saved on another layout than ``layout``
    (that of this run, None when it is not DiLoCo across processes), before anything is loaded.

    A checkpoint without optimizer state (``--save_only_model``) passes: training then starts from its weights.
    """
    own = worker_optimizer_file(checkpoint, rank)
    saved_by_workers = sorted(glob.glob(worker_optimizer_file(glob.escape(checkpoint), "*")))
    if layout is None:
        if saved_by_workers and not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
            saved = _saved_layout(saved_by_workers[0]) or {}
            raise ValueError(
                f"resume_from_checkpoint {checkpoint} holds the optimizer states of a DiLoCo run across processes "
                f"({_describe(saved)}), one file per process; this run is not one. Resume it as it was run "
                f"(--diloco_distributed true{_flags(saved)} on {saved.get('world_size')!r} processes), or start a "
                f"new run from its weights (--model_name_or_path {checkpoint})"
            )
        return
    if not saved_by_workers:
        if os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
            raise ValueError(
                f"resume_from_checkpoint {checkpoint} holds one optimizer state ({OPTIMIZER_NAME}), written by a "
                "run that was not DiLoCo across processes; this run is one "
                f"({_describe(layout.saved())}), which resumes from one state per process "
                f"({OPTIMIZER_RANK_NAME.format(rank='<r>')}). Start a new run from its weights "
                f"(--model_name_or_path {checkpoint})"
            )
        return  # no optimizer state at all: the Trainer resumes from the weights alone, and says so
    found = os.path.isfile(own)
    saved = _saved_layout(own if found else saved_by_workers[0])
    if saved is None:
        raise ValueError(
            f"resume_from_checkpoint {checkpoint}: {os.path.basename(saved_by_workers[0])} is not a DiLoCo state "
            "(it records no worker layout)"
        )
    if not found:  # the world size, M and P are compared on another process's file; the worker cannot be
        layout = dataclasses.replace(layout, worker=saved.get("worker"))
    layout.check_saved(saved, f"resume_from_checkpoint {checkpoint}", names=_FLAGS)
    if not found:
        raise ValueError(
            f"resume_from_checkpoint {checkpoint} has no {os.path.basename(own)}: the optimizer state of this "
            "process's worker is missing (an incomplete checkpoint); resume from an earlier one"
        )


def _saved_layout(path: str) -> dict[str, int] | None:
    # mmap: only the param groups are read, not the state tensors.
    return saved_diloco_layout(torch.load(path, map_location="cpu", weights_only=True, mmap=True))


def _describe(saved: dict[str, Any]) -> str:
    return (
        f"{saved.get('num_workers')!r} workers over {saved.get('world_size')!r} processes, "
        f"{saved.get('num_fragments')!r} fragments"
    )


def _flags(saved: dict[str, Any]) -> str:
    flags = f" --diloco_workers {saved.get('num_workers')!r}"
    return flags + (f" --diloco_fragments {saved['num_fragments']}" if saved.get("num_fragments", 1) != 1 else "")


def island_ddp(model: nn.Module, layout: WorkerLayout, device: torch.device, **ddp_kwargs: Any) -> nn.Module:
    """``model`` in a DDP over its island's processes only (an island of one process included: DDP then averages
    nothing), so that no gradient crosses the workers. ``ddp_kwargs``: DDP's other arguments (the ``--ddp_*``
    flags, as accelerate would pass them)."""
    device_ids = None if device.type == "cpu" else [device]
    return DistributedDataParallel(model, process_group=layout.island_group, device_ids=device_ids, **ddp_kwargs)
