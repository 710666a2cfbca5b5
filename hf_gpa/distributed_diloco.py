"""DiLoCo across the processes of a `GPATrainer` run (``--diloco_distributed``, and GPA across them,
``--gpa_distributed``, which is DiLoCo with GPA's outer step): what the Trainer does differently.

With W processes and M workers, each worker is an island of W / M processes. Three things differ from a DDP run:

* Gradients are averaged inside each island only. The Trainer wraps the model in a DDP over the island's process
  group (`island_ddp`) instead of letting accelerate build one over all W processes: between outer steps no
  gradient, bucket layout or buffer crosses the workers; only the optimizer's outer all-reduce does, once per outer
  step (per fragment).
* Under FSDP (``accelerate launch --config_file configs/accelerate_fsdp2.yaml``, ``--diloco_workers M`` with
  1 < M < W), the Trainer shards each island's model over the island's processes instead (`shard_islands`: FSDP2's
  ``fully_shard`` over the "shard" dimension of a (M, W / M) ("worker", "shard") device mesh, one group per decoder
  layer, then the root), before the optimizer is built: each process holds its shard of its worker's inner weights
  and inner optimizer state, the gradients are reduce-scattered inside the island, and DiLoCo all-reduces each shard
  of the pseudo-gradient with the process at the same island position of every other island. Saves gather the full
  model over each island (`full_model_state_dict`), as FSDP2's FULL_STATE_DICT saves do.
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
  is a DiLoCo state saved with another H, outer lr or outer momentum than the flags give, and a GPA state (across
  processes or not) saved with other constants (`refuse_other_outer`).

* The run says what it does: at the start of training one INFO line on the first process (`workers_start_line`: the
  workers, H, the fragments, the outer dtype, the bytes of an outer period against DDP's per step), and at every
  logging step ``outer_steps`` and ``outer_bytes`` (the optimizer's count of what this process sent between workers
  so far) in the Trainer's logs.

`DiLoCoWorkersMixin` is where `GPATrainer` does all of this: the Trainer's hooks that differ across workers (the
model's wrapping, the token count, the optimizer files of a checkpoint, the refusal of another run's checkpoint), each
passing on to the next class unchanged for any other optimizer.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings
from transformers.trainer_utils import get_last_checkpoint

from hf_gpa.checkpoint import unwrap_gpa_optimizer
from hf_gpa.optim import DiLoCo, WorkerLayout, saved_diloco_layout, saved_optimizer_name
from hf_gpa.optim._diloco_workers import ALL_GATHER_WORKERS, broadcast_
from hf_gpa.optim._tensors import is_dtensor, local_tensor
from hf_gpa.optim._types import AVERAGING, INNER_STEPS, MU_X, MU_Y, OUTER_LR, OUTER_MOMENTUM

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import TrainingArguments

__all__ = [
    "OPTIMIZER_RANK_NAME",
    "DiLoCoWorkersMixin",
    "ISLAND_MESH_DIMS",
    "IslandShardedModel",
    "broadcast_unstepped",
    "full_model_state_dict",
    "island_ddp",
    "island_mesh",
    "island_token_count",
    "refuse_other_layout",
    "refuse_other_outer",
    "requested_layout",
    "shard_islands",
    "worker_optimizer_file",
    "workers_in_words",
    "workers_start_line",
]

logger = logging.getLogger(__name__)

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
    if not (getattr(args, "diloco_distributed", False) or getattr(args, "gpa_distributed", False)):
        return None
    workers = args.diloco_workers or world_size
    return WorkerLayout(world_size, workers, args.diloco_fragments, worker=rank // (world_size // workers))


def refuse_other_layout(
    checkpoint: str, layout: WorkerLayout | None, rank: int, *, island_shards: bool = False
) -> None:
    """Raise a ``ValueError`` naming what differs when ``checkpoint`` was saved on another layout than ``layout``
    (that of this run, None when it is not DiLoCo across processes), before anything is loaded; also when its states
    hold FSDP2 shards (each island sharded) and this run does not shard its islands (``island_shards``), or the
    reverse.

    A checkpoint without optimizer state (``--save_only_model``) passes: training then starts from its weights.
    """
    own = worker_optimizer_file(checkpoint, rank)
    saved_by_workers = sorted(glob.glob(worker_optimizer_file(glob.escape(checkpoint), "*")))
    if layout is None:
        if saved_by_workers and not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
            state = torch.load(saved_by_workers[0], map_location="cpu", weights_only=True, mmap=True)
            saved = saved_diloco_layout(state) or {}
            gpa = (saved_optimizer_name(state) or "").startswith("GPADiLoCo")
            what, mode = ("GPA", "--gpa_distributed") if gpa else ("DiLoCo", "--diloco_distributed")
            raise ValueError(
                f"resume_from_checkpoint {checkpoint} holds the optimizer states of a {what} run across processes "
                f"({_describe(saved)}), one file per process; this run is not one. Resume it as it was run "
                f"({mode} true{_flags(saved)} on {saved.get('world_size')!r} processes), or start a "
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
    sharded = _saved_shards(own)
    if sharded != island_shards:
        said = {True: "FSDP2 inside each island (the FSDP config)", False: "whole weights on every process (DDP)"}
        raise ValueError(
            f"resume_from_checkpoint {checkpoint}: its optimizer states were saved with {said[sharded]}, this run "
            f"runs with {said[island_shards]}. A DiLoCo state resumes only on the layout that saved it: launch with "
            f"the {'FSDP2' if sharded else 'DDP'} config (configs/accelerate_{'fsdp2' if sharded else 'ddp'}.yaml), "
            f"or start a new run from its outer weights (--model_name_or_path {checkpoint})"
        )


#: The flags that set the hyper-parameters of the outer steps, which a DiLoCo state keeps in its param groups.
_OUTER_FLAGS = {
    INNER_STEPS: "diloco_inner_steps",
    OUTER_LR: "diloco_outer_lr",
    OUTER_MOMENTUM: "diloco_outer_momentum",
}
#: The same for GPA across the processes (``--gpa_distributed``, a `GPADiLoCo` state).
_GPA_OUTER_FLAGS = {
    INNER_STEPS: "gpa_sync_steps",
    OUTER_LR: "gpa_outer_lr",
    MU_X: "gpa_mu_x",
    MU_Y: "gpa_mu_y",
}
#: And for GPA on its own (``--optim gpa_adamw`` or ``gpa``): its averaging, which a GPA state keeps too.
_GPA_FLAGS = {MU_X: "gpa_mu_x", MU_Y: "gpa_mu_y", AVERAGING: "gpa_averaging"}
#: How a state of each kind records its optimizer (``saved_optimizer_name`` up to the base), and the flags of the
#: run that resumes it.
_ACROSS_WORKERS = {
    "DiLoCo": ("DiLoCo", "--optim diloco_adamw (or diloco_muon)", _OUTER_FLAGS),
    "GPADiLoCo": ("GPA across workers", "--optim gpa_adamw --gpa_distributed true", _GPA_OUTER_FLAGS),
}
_GPA_KINDS = ("GPAAdamW", "GPA")


def _outer_kind(args: TrainingArguments) -> str | None:
    """Which optimizer's constants ``args`` set: ``"DiLoCo"`` (--optim diloco_*), ``"GPADiLoCo"``
    (--gpa_distributed), ``"GPA"`` (--optim gpa_adamw or gpa on its own), or None (another)."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim.startswith("diloco"):
        return "DiLoCo"
    if optim == "gpa_adamw" and getattr(args, "gpa_distributed", False):
        return "GPADiLoCo"
    if optim in ("gpa_adamw", "gpa"):
        return "GPA"
    return None


def refuse_other_outer(checkpoint: str, args: TrainingArguments, rank: int) -> None:
    """Raise a ``ValueError`` naming the flag when the DiLoCo state that process ``rank`` resumes from ``checkpoint``
    (its ``optimizer_rank{r}.pt``, else ``optimizer.pt``) was saved with another ``--diloco_inner_steps``,
    ``--diloco_outer_lr`` or ``--diloco_outer_momentum`` than ``args`` give, before anything is loaded; under
    ``--gpa_distributed`` (a `GPADiLoCo` state), another ``--gpa_sync_steps``, ``--gpa_outer_lr``, ``--gpa_mu_x`` or
    ``--gpa_mu_y``; and a state of the other kind (DiLoCo's resumed with ``--gpa_distributed``, or the reverse).
    With ``--optim gpa_adamw`` or ``gpa`` on its own, a GPA state (``optimizer.pt``) saved with another
    ``--gpa_mu_x``, ``--gpa_mu_y`` or ``--gpa_averaging``.

    Loading the state would keep the saved values over the flags without a word (torch's ``load_state_dict`` takes a
    group's hyper-parameters from the state), and H was checked against the fragments with the flag's value.
    """
    kind = _outer_kind(args)
    if kind is None:
        return
    path = worker_optimizer_file(checkpoint, rank)
    if not os.path.isfile(path):
        path = os.path.join(checkpoint, OPTIMIZER_NAME)
        if not os.path.isfile(path):
            return
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    saved_kind = (saved_optimizer_name(state) or "").split("(")[0]
    if kind == "GPA":
        if saved_kind not in _GPA_KINDS:
            return  # another optimizer's state (or none of hf_gpa's): the optimizer's own load names what it is
        what, flags = "GPA", dict(_GPA_FLAGS)
        if args.gpa_averaging == "schedule_free":
            del flags[MU_X]  # Schedule-Free's average has no mu_x (the state keeps the unused default)
    else:
        if saved_diloco_layout(state) is None:
            return  # not a DiLoCo state: the optimizer's own load names what it is
        saved_kind = saved_kind or "DiLoCo"
        if saved_kind != kind and saved_kind in _ACROSS_WORKERS:
            saved_what, resumed_by, _ = _ACROSS_WORKERS[saved_kind]
            raise ValueError(
                f"resume_from_checkpoint {checkpoint}: its state was saved by {saved_what}, which this run "
                f"({_ACROSS_WORKERS[kind][1]}) cannot resume: resume it with {resumed_by}, or start a new run from "
                f"the checkpoint's evaluation weights (--model_name_or_path {checkpoint})"
            )
        what, _, flags = _ACROSS_WORKERS[kind]
    saved = state["param_groups"][0]
    for key, flag in flags.items():
        if key in saved and saved[key] != getattr(args, flag):
            raise ValueError(
                f"resume_from_checkpoint {checkpoint}: its {what} state was saved with --{flag} {saved[key]!r}, "
                f"this run asks for {getattr(args, flag)!r}. A {what} run resumes with the constants that saved it "
                f"(its state keeps them, and loading it would keep them over the flag): resume with --{flag} "
                f"{saved[key]!r}, or start a new run from the checkpoint's evaluation weights (--model_name_or_path "
                f"{checkpoint})"
            )


def _saved_shards(path: str) -> bool:
    """Whether the optimizer state at ``path`` holds DTensor shards (FSDP2 inside the islands)."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return any(is_dtensor(v) for s in state.get("state", {}).values() for v in s.values() if torch.is_tensor(v))


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


#: The dimensions of the device mesh of FSDP2 inside the islands: the workers (replicas), the processes of one.
ISLAND_MESH_DIMS = ("worker", "shard")


def island_mesh(layout: WorkerLayout, device_type: str) -> DeviceMesh:
    """The (M, W / M) ("worker", "shard") device mesh of ``layout``: row i holds island i's processes in island
    order, so that ``mesh["shard"]`` is this process's island (the mesh DiLoCo takes shards on) and the processes at
    one island position, which hold the same shard, form the outer group. Every process must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.num_workers, layout.island_size), mesh_dim_names=ISLAND_MESH_DIMS)


def shard_islands(
    model: nn.Module, layout: WorkerLayout, device: torch.device, **fully_shard_kwargs: Any
) -> DeviceMesh:
    """Shard ``model`` in place with FSDP2 over this process's island: ``fully_shard`` on each module of the classes
    the model names unsplittable (``_no_split_modules``: a decoder layer, as accelerate's TRANSFORMER_BASED_WRAP),
    then on the root, over ``island_mesh(layout)["shard"]``; returns the mesh. ``fully_shard_kwargs``: FSDP2's other
    arguments (``reshard_after_forward``, ``mp_policy``). Every process must call it, before the optimizer is built.

    Why here and not in accelerate: accelerate (1.10 to 1.15) shards over ``accelerator.torch_device_mesh`` indexed
    by its parallelism config's ``fsdp_dim_names``: all processes, or with ``dp_replicate_size`` > 1 HSDP's 2-D
    ("dp_replicate", "dp_shard_cp") mesh, whose gradients are all-reduced across the replicas at every step, which
    DiLoCo exists to avoid; it has no setting for a sub-mesh without that replication. And on CPU processes it turns
    its FSDP plugin off (MULTI_CPU), so it would shard nothing there."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = island_mesh(layout, device.type)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules())[1:]:
        if type(module).__name__ in blocks and not isinstance(module, FSDPModule):
            fully_shard(module, mesh=mesh["shard"], **fully_shard_kwargs)
    root = {k: v for k, v in fully_shard_kwargs.items() if k != "reshard_after_forward"}  # the root: FSDP2's default
    fully_shard(model, mesh=mesh["shard"], **root)
    return mesh


class IslandShardedModel(nn.Module):
    """The module the Trainer trains when it shards each island itself and accelerate does not run FSDP2 (CPU
    processes): ``module`` (sharded by `shard_islands`) as it is, so that the Trainer leaves it to accelerate for
    mixed precision and compilation only and accelerate builds no DDP over all processes (it refuses DTensor
    parameters there). FSDP2 does the island's gradient reduction."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of ``model`` sharded inside the islands, gathered over each island on CPU, as FSDP2's
    FULL_STATE_DICT saves gather it (torch's ``get_model_state_dict``, which accelerate's ``get_state_dict`` calls):
    every process must call it; the first process of the run gets the tensors, the others an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@torch.no_grad()
def broadcast_unstepped(model: nn.Module, optimizer: DiLoCo) -> None:
    """Every process takes the first process's parameters of ``model`` that ``optimizer`` (a DiLoCo across processes)
    does not step (the frozen ones) and its buffers, as DDP does over its own group when it is built.

    DiLoCo broadcasts the parameters it steps, and an island's DDP reaches the island only: without this, a model
    initialised without a common seed would keep each worker's own frozen weights and buffers (rank 0's would be
    saved, and each process would evaluate a model of its own).
    """
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    unstepped = [p.detach() for p in model.parameters() if id(p) not in stepped]
    tensors = [t for t in [*unstepped, *model.buffers()] if not is_dtensor(t)]
    if tensors:
        broadcast_(tensors, optimizer.layout.process_group)
    # FSDP2 inside the islands: a frozen parameter's shard from the process at this island position of the first
    # island, which holds the same shard, as DiLoCo takes the shards it steps.
    shards = [local_tensor(t) for t in unstepped if is_dtensor(t)]
    if shards and optimizer.layout.outer_group is not None:
        broadcast_(shards, optimizer.layout.outer_group)


def workers_in_words(num_workers: int, island_size: int) -> str:
    """ "4 workers of 2 processes", "2 workers of 1 process"."""
    workers = f"{num_workers} worker{'s' if num_workers != 1 else ''}"
    return f"{workers} of {island_size} process{'es' if island_size != 1 else ''}"


def workers_start_line(optimizer: DiLoCo) -> str:
    """The line a run of DiLoCo across processes logs at its start: the workers (and FSDP2 inside the islands), H,
    the fragments, the outer dtype and the overlap, and the bytes each process sends to the other workers over one
    outer period (H inner steps: every fragment once; `DiLoCo.outer_bytes_per_period`, what ``outer_bytes`` will
    count) against what it would send per step under DDP over all W processes: a ring all-reduce of every trainable
    parameter's gradient in its dtype, 2 (W - 1) / W of their bytes."""
    layout = optimizer.layout
    steps = optimizer.param_groups[0][INNER_STEPS]
    fragments = layout.num_fragments
    period = optimizer.outer_bytes_per_period()
    grads = sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    ddp = 2 * (layout.world_size - 1) * grads // layout.world_size
    dtype = layout.outer_dtype
    if dtype == "float32":
        collective = "all-reduce"
    elif layout.num_workers <= ALL_GATHER_WORKERS:
        collective = f"all-gather of the {dtype} payloads"
    else:
        collective = f"all-to-all and all-gather of {dtype} chunks"
    per = "one" if fragments == 1 else f"{fragments} (one per fragment, about 1/{fragments} of the model each)"
    overlap = "no overlap (each outer sync blocks the step that takes it)"
    if optimizer.overlap_steps:
        overlap = (
            f"overlap {optimizer.overlap_steps} inner steps (each fragment's all-reduce runs in the background, its "
            f"outer update applied {optimizer.overlap_steps} steps later, mixing alpha {optimizer.overlap_alpha})"
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sharded = ", each island's model sharded by FSDP2 over its processes" if any(map(is_dtensor, params)) else ""
    return (
        f"hf_gpa: DiLoCo across workers: {workers_in_words(layout.num_workers, layout.island_size)} "
        f"({layout.world_size} processes{sharded}), H = {steps}, "
        f"{fragments} fragment{'s' if fragments != 1 else ''}, outer dtype {layout.outer_dtype}, {overlap}. "
        f"Every {steps} inner steps each process sends {period:,} bytes between workers ({per} {collective} of "
        "the pseudo-gradient), "
        f"against {ddp:,} bytes per step under DDP ({ddp * steps:,} per {steps} steps): {period / (ddp * steps):.3g} "
        "of DDP's. The logs carry outer_steps and outer_bytes (this process's, so far)."
    )


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


class DiLoCoWorkersMixin:
    """The `Trainer` hooks that differ under DiLoCo across processes (``--diloco_distributed``), for a trainer class
    to compose (`GPATrainer` does): a DDP over the worker's island (`_wrap_model`), or under FSDP the model sharded
    over the island (`create_optimizer`, `_wrap_model`, `save_model`, `create_accelerator_and_postprocess`), the
    token count taken over the island (`_get_num_items_in_batch`), the start line (`create_optimizer`) and the outer
    traffic in the logs (`log`), one optimizer state file per process in a checkpoint
    (`_save_optimizer_and_scheduler`, `_load_optimizer_and_scheduler`), and `refuse_other_checkpoint` before
    training. Every hook takes ``*args, **kwargs`` and passes them on to the next class in the MRO unchanged, which
    it leaves alone for any other optimizer."""

    def _workers_layout(self) -> WorkerLayout | None:
        """The layout of the DiLoCo across processes that this trainer steps; None for any other optimizer."""
        inner = unwrap_gpa_optimizer(self.optimizer)
        layout = inner.layout if isinstance(inner, DiLoCo) else None
        return layout if layout is not None and layout.distributed else None

    #: The ("worker", "shard") mesh each island's model is sharded on (FSDP2 inside the islands), else None.
    _island_mesh: DeviceMesh | None = None

    def create_accelerator_and_postprocess(self, *args: Any, **kwargs: Any) -> Any:
        """The next class's; with FSDP2 inside the islands (`GPATrainingArguments.diloco_island_shards`) the Trainer's
        own FSDP paths are turned off (``is_fsdp_enabled``): this trainer shards the model (`shard_islands`), loads a
        checkpoint's full weights before sharding, and saves the full model (`save_model`) itself."""
        result = super().create_accelerator_and_postprocess(*args, **kwargs)
        if getattr(self.args, "diloco_island_shards", False):
            self.is_fsdp_enabled = False
        return result

    def _shard_islands(self) -> None:
        """FSDP2 inside the islands: shard the model over this process's island (`shard_islands`) once, before the
        optimizer is built on its DTensor parameters; accelerate's FSDP2 settings (reshard after forward, mixed
        precision) where its plugin is on."""
        if not getattr(self.args, "diloco_island_shards", False) or self._island_mesh is not None:
            return
        layout = requested_layout(self.args, self.args.world_size, self.args.process_index)
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        kwargs: dict[str, Any] = {}
        if plugin is not None:
            kwargs["reshard_after_forward"] = plugin.reshard_after_forward
            if plugin.mixed_precision_policy is not None:
                kwargs["mp_policy"] = plugin.mixed_precision_policy
        self._island_mesh = shard_islands(self.model, layout, self.args.device, **kwargs)

    def save_model(self, *args: Any, **kwargs: Any) -> None:
        """The next class's; with FSDP2 inside the islands, every process gathers the full model over its island
        (`full_model_state_dict`: the call accelerate makes for FSDP2's FULL_STATE_DICT) and the first writes it."""
        if self._island_mesh is None:
            super().save_model(*args, **kwargs)
            return
        output_dir = kwargs.get("output_dir", args[0] if args else None) or self.args.output_dir
        internal = kwargs.get("_internal_call", args[1] if len(args) > 1 else False)
        state_dict = full_model_state_dict(self.model)
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not internal:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def refuse_other_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Given `train`'s arguments: refuse the checkpoint it would resume when it was saved on another layout of
        DiLoCo (or GPA) across processes, or holds a DiLoCo or GPA state saved with other constants (H, the outer
        step's, mu_x, mu_y), before anything is loaded (`refuse_other_layout`, `refuse_other_outer`)."""
        checkpoint = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if checkpoint is True and os.path.isdir(self.args.output_dir):
            checkpoint = get_last_checkpoint(self.args.output_dir)  # None: the next class says there is none
        if not isinstance(checkpoint, (str, os.PathLike)):
            return
        rank = self.args.process_index
        layout = self._workers_layout() or requested_layout(self.args, self.args.world_size, rank)
        refuse_other_layout(
            os.fspath(checkpoint), layout, rank, island_shards=getattr(self.args, "diloco_island_shards", False)
        )
        refuse_other_outer(os.fspath(checkpoint), self.args, rank)

    def _wrap_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        """The next class's `_wrap_model`; for training under DiLoCo across processes, a DDP over the processes of
        this worker's island only (`island_ddp`).

        The Trainer then leaves the model to accelerate for mixed precision and compilation only (as for any model
        wrapped here), so accelerate builds no DDP over all processes, which would average every gradient across the
        workers at every step. The ``--ddp_*`` flags apply to the island's DDP as they would to accelerate's."""
        wrapped = super()._wrap_model(model, *args, **kwargs)
        training = kwargs.get("training", args[0] if args else True)
        layout = self._workers_layout()
        already_wrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False) is not model
        if isinstance(model, IslandShardedModel):
            return model
        if not training or layout is None or wrapped is not model or already_wrapped:
            return wrapped
        # Frozen parameters and buffers the same on every process (the island's DDP makes them so in the island only),
        # before any process's inner weights are loaded by a resume.
        broadcast_unstepped(model, unwrap_gpa_optimizer(self.optimizer))
        if self._island_mesh is not None:
            if getattr(self.accelerator, "is_fsdp2", False):
                # accelerate's FSDP2 (on accelerators) takes the model with its optimizer and leaves a model that
                # is already an FSDPModule as it is (manual wrapping): the Trainer's accelerator.prepare does that.
                return model
            prepared = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
            return IslandShardedModel(prepared)
        prepared = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        handler = self.accelerator.ddp_handler
        ddp = island_ddp(prepared, layout, self.args.device, **(handler.to_kwargs() if handler is not None else {}))
        if handler is not None:
            handler.register_comm_hook(ddp)  # accelerate's own hook (gradient compression), where it sets one
        return ddp

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        """The next class's; under DiLoCo across processes, the first process logs `workers_start_line`. With FSDP2
        inside the islands the model is sharded first (`_shard_islands`)."""
        if self.optimizer is None:
            self._shard_islands()
        optimizer = super().create_optimizer(*args, **kwargs)
        if self._workers_layout() is not None and self.args.process_index == 0:
            logger.info(workers_start_line(unwrap_gpa_optimizer(self.optimizer)))
        return optimizer

    def apply_outer_syncs_in_flight(self) -> None:
        """At the end of training (`GPATrainer`'s ``on_train_end``, before the model is put at the outer weights):
        the overlapped outer syncs still in flight (``--diloco_overlap_steps``) are applied, so that the weights
        evaluated, saved and pushed after training hold every pseudo-gradient the workers sent. A checkpoint saved
        during training keeps them in flight, so its resume applies them at their own step, bitwise."""
        optimizer = unwrap_gpa_optimizer(getattr(self, "optimizer", None))
        if isinstance(optimizer, DiLoCo):
            optimizer.apply_syncs_in_flight()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The next class's; under DiLoCo across processes, the logs of a training step (those with its ``loss``)
        also carry ``outer_steps`` and ``outer_bytes``, the optimizer's `OuterTraffic` so far."""
        if self._workers_layout() is not None and "loss" in logs:
            traffic = unwrap_gpa_optimizer(self.optimizer).outer_traffic
            logs = {**logs, "outer_steps": traffic.outer_steps, "outer_bytes": traffic.outer_bytes}
        super().log(logs, *args, **kwargs)

    def _get_num_items_in_batch(self, *args: Any, **kwargs: Any) -> torch.Tensor | int | None:
        """The next class's count of the tokens a loss is averaged over; under DiLoCo across processes, taken over
        this worker's island (`island_token_count`) instead of over every process (``--average_tokens_across_devices``,
        which GPATrainingArguments turns off there), so that no process waits for another worker between outer
        steps."""
        count = super()._get_num_items_in_batch(*args, **kwargs)
        layout = self._workers_layout()
        if layout is None or not torch.is_tensor(count) or self.args.average_tokens_across_devices:
            return count
        return island_token_count(count, layout)

    def _save_optimizer_and_scheduler(self, output_dir: str, *args: Any, **kwargs: Any) -> None:
        """The next class's; under DiLoCo across processes, every process writes its worker's state (in eval mode:
        its inner weights and inner optimizer state) to a file of its own (`worker_optimizer_file`), and the first
        process the scheduler's. The stock Trainer writes the first process's optimizer state alone, which would lose
        the other workers'."""
        if self._workers_layout() is None:
            super()._save_optimizer_and_scheduler(output_dir, *args, **kwargs)
            return
        os.makedirs(output_dir, exist_ok=True)
        torch.save(self.optimizer.state_dict(), worker_optimizer_file(output_dir, self.args.process_index))
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught_warnings:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught_warnings)
        # Every process's file is on disk before the first process marks the checkpoint complete
        # (trainer_state.json) and may delete older ones.
        self.accelerator.wait_for_everyone()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None, *args: Any, **kwargs: Any) -> None:
        """The next class's; under DiLoCo across processes, this process's own optimizer state and the scheduler, as
        `_save_optimizer_and_scheduler` wrote them (nothing where the checkpoint has no optimizer state for this
        process: ``--save_only_model``)."""
        if self._workers_layout() is None:
            super()._load_optimizer_and_scheduler(checkpoint, *args, **kwargs)
            return
        path = None if checkpoint is None else worker_optimizer_file(checkpoint, self.args.process_index)
        if path is None or not os.path.isfile(path):
            return
        map_location = self.args.device if self.args.device.type != "cpu" else "cpu"
        self.optimizer.load_state_dict(torch.load(path, map_location=map_location, weights_only=True))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            with warnings.catch_warnings(record=True) as caught_warnings:
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            reissue_pt_warnings(caught_warnings)
