"""DiLoCo across the processes of a `GPATrainer` run (``--diloco_distributed``): what the Trainer does differently.

With W processes and M workers, each worker is an island of W / M processes. Three things differ from a DDP run:

* Gradients are averaged inside each island only. The Trainer wraps the model in a DDP over the island's process
  group (`island_ddp`) instead of letting accelerate build one over all W processes: between outer steps no
  gradient, bucket layout or buffer crosses the workers; only the optimizer's outer all-reduce does, once per outer
  step (per fragment).
* Every process holds its worker's inner weights and inner optimizer state, which differ between workers, so every
  process writes its own optimizer state into a checkpoint (`worker_optimizer_file`: ``optimizer_rank{r}.pt``, in
  eval mode: the model file holds the outer weights, the same on every process, written once by the first).
* Nothing else crosses the workers between outer steps: the token count that scales a causal LM's loss is taken
  over the island (`island_token_count`; transformers' ``--average_tokens_across_devices`` all-gathers it over every
  process at every step and is turned off), and the frozen parameters and buffers, which neither DiLoCo nor the
  island's DDP makes equal across the workers, are broadcast from the first process once, before training
  (`broadcast_unstepped`).
* A checkpoint resumes only on the layout that saved it (world size, M, P): `refuse_other_layout` reads it before
  anything is trained or loaded, and a checkpoint of a run across processes is refused to a run that is not one. So
  is a DiLoCo state saved with another H, outer lr or outer momentum than the flags give (`refuse_other_outer`).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers.trainer import OPTIMIZER_NAME

from hf_gpa.optim import DiLoCo, WorkerLayout, saved_diloco_layout
from hf_gpa.optim._diloco_workers import broadcast_
from hf_gpa.optim._types import INNER_STEPS, OUTER_LR, OUTER_MOMENTUM

if TYPE_CHECKING:
    from torch import nn
    from transformers import TrainingArguments

__all__ = [
    "OPTIMIZER_RANK_NAME",
    "broadcast_unstepped",
    "island_ddp",
    "island_token_count",
    "refuse_other_layout",
    "refuse_other_outer",
    "requested_layout",
    "worker_optimizer_file",
]

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


#: The flags that set the hyper-parameters of the outer steps, which a DiLoCo state keeps in its param groups.
_OUTER_FLAGS = {
    INNER_STEPS: "diloco_inner_steps",
    OUTER_LR: "diloco_outer_lr",
    OUTER_MOMENTUM: "diloco_outer_momentum",
}


def refuse_other_outer(checkpoint: str, args: TrainingArguments, rank: int) -> None:
    """Raise a ``ValueError`` naming the flag when the DiLoCo state that process ``rank`` resumes from ``checkpoint``
    (its ``optimizer_rank{r}.pt``, else ``optimizer.pt``) was saved with another ``--diloco_inner_steps``,
    ``--diloco_outer_lr`` or ``--diloco_outer_momentum`` than ``args`` give, before anything is loaded.

    Loading the state would keep the saved values over the flags without a word (torch's ``load_state_dict`` takes a
    group's hyper-parameters from the state), and H was checked against the fragments with the flag's value.
    """
    if not str(getattr(args.optim, "value", args.optim)).startswith("diloco"):
        return
    path = worker_optimizer_file(checkpoint, rank)
    if not os.path.isfile(path):
        path = os.path.join(checkpoint, OPTIMIZER_NAME)
        if not os.path.isfile(path):
            return
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if saved_diloco_layout(state) is None:
        return  # not a DiLoCo state: the optimizer's own load names what it is
    saved = state["param_groups"][0]
    for key, flag in _OUTER_FLAGS.items():
        if key in saved and saved[key] != getattr(args, flag):
            raise ValueError(
                f"resume_from_checkpoint {checkpoint}: its DiLoCo state was saved with --{flag} {saved[key]!r}, "
                f"this run asks for {getattr(args, flag)!r}. A DiLoCo run resumes with the outer steps that saved it "
                f"(H, the outer lr and momentum are in its state): resume with --{flag} {saved[key]!r}, or start a "
                f"new run from the checkpoint's outer weights (--model_name_or_path {checkpoint})"
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


@torch.no_grad()
def broadcast_unstepped(model: nn.Module, optimizer: DiLoCo) -> None:
    """Every process takes the first process's parameters of ``model`` that ``optimizer`` (a DiLoCo across processes)
    does not step (the frozen ones) and its buffers, as DDP does over its own group when it is built.

    DiLoCo broadcasts the parameters it steps, and an island's DDP reaches the island only: without this, a model
    initialised without a common seed would keep each worker's own frozen weights and buffers (rank 0's would be
    saved, and each process would evaluate a model of its own).
    """
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    tensors = [p.detach() for p in model.parameters() if id(p) not in stepped] + list(model.buffers())
    if tensors:
        broadcast_(tensors, optimizer.layout.process_group)


def island_token_count(count: torch.Tensor, layout: WorkerLayout) -> torch.Tensor:
    """The number of tokens a loss is averaged over, taken over the island: ``count`` (this process's) summed over
    the island's processes and divided by their number, since the island's DDP averages the processes' gradients. The
    loss of each island is then its tokens' mean, as a DDP run with ``--average_tokens_across_devices`` gives over all
    processes, and no process waits for another worker."""
    if layout.island_size == 1:
        return count
    import torch.distributed as dist

    count = count.clone()
    dist.all_reduce(count, group=layout.island_group)
    return count / layout.island_size
