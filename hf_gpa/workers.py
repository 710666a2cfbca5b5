"""DiLoCo and GPA across the processes of a `GPATrainer` run (``--diloco_distributed``, ``--gpa_distributed``): the
Trainer side, in one module. The optimizer side is ``hf_gpa.optim.diloco`` (its ``rules`` say which settings combine,
its ``checkpoint`` what a worker's checkpoint holds).

With W processes and M workers, each worker is an island of W / M processes. What the Trainer does differently:

* **The flags** (`check_workers_flags`, called by `GPATrainingArguments`): the sync's flags (``--diloco_workers``,
  ``--diloco_fragments``, ``--diloco_outer_dtype``, ``--diloco_overlap_steps``, ``--diloco_overlap_alpha``) checked by
  the optimizer's own rules with the flags' names, against the launched processes, and what would let the processes
  step apart (FSDP for GPA, DeepSpeed, ``--fp16``) or shard otherwise than one island each refused.
* **The model**: gradients are averaged inside each island only, by a DDP over the island's process group
  (`island_ddp`) instead of accelerate's over all W processes; under the FSDP2 config, each island's model is sharded
  over the island's processes instead (`shard_islands`), from the first process's weights. Frozen parameters and
  buffers are broadcast from the first process once (`broadcast_unstepped`), and the token count that scales a causal
  LM's loss is taken over the island (`island_token_count`).
* **The checkpoints**: every process writes its own optimizer state (``optimizer_rank{r}.pt``), the first the model
  (the outer weights, the same everywhere); a checkpoint saved on another layout, or with other constants of the outer
  step, is refused before anything is loaded (`refuse_other_checkpoint`).
* **The end of training**: at the last step the optimizer synchronises every fragment's steps since its last outer
  step and the syncs in flight (`DiLoCo.synchronize`), before the last evaluation and save, so that the final model
  holds every step, as the stock Trainer's does; a best checkpoint loaded at the end is kept as it was saved.
* **The logs**: one start line (`workers_start_line`) and ``outer_steps``/``outer_bytes`` at every logging step.

`DiLoCoWorkersMixin` is where `GPATrainer` does the model, checkpoint, end and log parts: the Trainer's hooks, each
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
from transformers.utils.generic import strtobool

from hf_gpa.checkpoint import unwrap_gpa_optimizer
from hf_gpa.optim import (
    AVERAGING,
    INNER_STEPS,
    MU_X,
    MU_Y,
    OUTER_LR,
    OUTER_MOMENTUM,
    check_num_fragments,
    check_num_workers,
    is_dtensor,
    saved_optimizer_name,
)
from hf_gpa.optim.diloco import OuterOptimizer, WorkerLayout, broadcast_, checkpoint, compression, rules
from hf_gpa.optim.diloco.checkpoint import worker_optimizer_file

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import TrainingArguments

__all__ = [
    "DiLoCoWorkersMixin",
    "ISLAND_MESH_DIMS",
    "IslandShardedModel",
    "SYNC_FLAGS",
    "broadcast_unstepped",
    "check_workers_flags",
    "flag_names",
    "full_model_state_dict",
    "island_ddp",
    "island_mesh",
    "island_token_count",
    "refuse_other_checkpoint",
    "refuse_other_layout",
    "refuse_other_outer",
    "requested_layout",
    "shard_islands",
    "workers_in_words",
    "workers_start_line",
]

logger = logging.getLogger(__name__)


# ---- the flags: which combine ----

#: The flags of the outer sync (where the workers run and how the pseudo-gradients cross them), read with
#: --diloco_distributed or --gpa_distributed only.
SYNC_FLAGS = (
    "diloco_workers",
    "diloco_fragments",
    "diloco_outer_dtype",
    "diloco_overlap_steps",
    "diloco_overlap_alpha",
)


def flag_names(args: TrainingArguments) -> dict[str, str]:
    """The flags that set each setting of the sync, as ``rules`` names them in its refusals."""
    inner_steps = "--gpa_sync_steps" if getattr(args, "gpa_distributed", False) is True else "--diloco_inner_steps"
    return {
        "outer_dtype": "--diloco_outer_dtype",
        "overlap_steps": "--diloco_overlap_steps",
        "overlap_alpha": "--diloco_overlap_alpha",
        "num_fragments": "--diloco_fragments",
        "num_workers": "--diloco_workers",
        "inner_steps": inner_steps,
    }


def _given(args: TrainingArguments, flags: tuple[str, ...]) -> list[str]:
    """The ``flags`` set away from their defaults, as the user wrote them."""
    fields = args.__dataclass_fields__
    return [f"--{flag} {getattr(args, flag)}" for flag in flags if getattr(args, flag) != fields[flag].default]


def check_workers_flags(args: TrainingArguments) -> None:
    """--diloco_distributed or --gpa_distributed and the sync's flags (`SYNC_FLAGS`), checked against the number of
    processes the launcher started (``WORLD_SIZE``) with the optimizer's own rules, and every setting that would let
    the processes step apart refused, each naming the flag, before any work."""
    if not isinstance(args.diloco_distributed, bool):
        raise ValueError(f"Invalid --diloco_distributed: {args.diloco_distributed!r} (true or false)")
    if not args.gpa_distributed and (given := _given(args, ("gpa_sync_steps", "gpa_outer_lr"))):
        raise ValueError(
            f"{' and '.join(given)} only applies with --gpa_distributed true (GPA across the processes). "
            "Add --gpa_distributed true under accelerate launch or torchrun, or leave them out."
        )
    names = flag_names(args)
    rules.check_outer_dtype(args.diloco_outer_dtype, names=names)
    flag = args.across_workers
    if flag is None:
        if given := _given(args, SYNC_FLAGS):
            raise ValueError(
                f"{' and '.join(given)} only applies with --diloco_distributed true or --gpa_distributed true "
                "(DiLoCo or GPA across the processes); a single worker has no workers to count and no outer "
                "sync to spread, compress or overlap. Add one of them under accelerate launch or torchrun, or "
                "leave them out."
            )
        return
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 2:
        single = "single-worker DiLoCo" if flag == "--diloco_distributed" else "GPA on one process"
        raise ValueError(
            f"{flag} true on a single process (WORLD_SIZE {world_size}): there is no other worker to average with. "
            "Launch several processes (accelerate launch --num_processes N, torchrun --nproc_per_node N), or leave "
            f"{flag} out for {single}."
        )
    if args.diloco_workers is not None:
        args.diloco_workers = check_num_workers(args.diloco_workers, world_size, "--diloco_workers")
    inner_steps = args.gpa_sync_steps if flag == "--gpa_distributed" else args.diloco_inner_steps
    args.diloco_fragments = check_num_fragments(
        args.diloco_fragments, inner_steps=inner_steps, name="--diloco_fragments"
    )
    args.diloco_outer_dtype, args.diloco_overlap_steps, args.diloco_overlap_alpha = rules.check_sync(
        args.diloco_outer_dtype, args.diloco_overlap_steps, args.diloco_overlap_alpha, args.diloco_workers,
        args.diloco_fragments, names,
    )  # fmt: skip
    rules.check_period(args.diloco_overlap_steps, inner_steps, args.diloco_fragments, names)
    _refuse_other_parallelism(args, flag, world_size)


def _refuse_other_parallelism(args: TrainingArguments, flag: str, world_size: int) -> None:
    """FSDP (for an algorithm not verified on shards), DeepSpeed and --fp16 refused with the flag across workers;
    FSDP otherwise checked for one island per shard group (`_island_shard_refusals`)."""
    refusals = []
    algorithm = "GPADiLoCo" if flag == "--gpa_distributed" else "DiLoCo"
    if args._uses_fsdp and algorithm not in rules.SHARDED_ALGORITHMS:
        refusals.append(
            "FSDP: GPA's outer step across workers is not supported on FSDP2's shards yet; use DDP "
            "(configs/accelerate_ddp.yaml), or --optim diloco_adamw --diloco_distributed true, which shards "
            "each island under FSDP2"
        )
    elif args._uses_fsdp:
        rules.check_shards(algorithm, args.diloco_outer_dtype, args.diloco_overlap_steps, flag_names(args))
        if island_refusals := _island_shard_refusals(args, world_size):
            raise ValueError(f"{flag} true under FSDP cannot run with " + "; ".join(island_refusals) + ".")
    if args._deepspeed_route is not None:
        refusals.append("DeepSpeed: it owns the optimizer step; use DDP (configs/accelerate_ddp.yaml)")
    if args.fp16:
        refusals.append(
            "--fp16: its loss scaling skips the steps whose gradients overflow, which differ between workers, "
            "so the workers would reach the outer all-reduce at different steps; use --bf16"
        )
    if refusals:
        raise ValueError(f"{flag} cannot run with " + "; ".join(refusals) + ".")


def _island_shard_refusals(args: TrainingArguments, world_size: int) -> list[str]:
    """FSDP2 shards each island (W / M processes) and nothing else: every setting that would shard otherwise, or that
    the sharded islands do not support, as a sentence naming it."""
    workers = args.diloco_workers or world_size
    island = world_size // workers
    config = args.fsdp_config if isinstance(args.fsdp_config, dict) else {}
    env = os.environ.get
    refusals = []
    version = env("FSDP_VERSION") if strtobool(env("ACCELERATE_USE_FSDP", "false")) else config.get("version", 2)
    if str(version) != "2":
        refusals.append(
            f"FSDP version {version} (fsdp_version in the accelerate config, or fsdp_config's version): only "
            "FSDP2 (fully_shard) shards inside each island; use configs/accelerate_fsdp2.yaml"
        )
    if workers == world_size:
        refusals.append(
            f"--diloco_workers {workers} on {world_size} processes (unset: one worker per process): each island "
            f"is one process, with nothing to shard; give --diloco_workers M with 1 < M < {world_size} dividing it "
            "(islands of W / M processes), or use DDP (configs/accelerate_ddp.yaml)"
        )
    elif workers == 1:
        refusals.append(
            "--diloco_workers 1: one island of every process is FSDP around single-worker DiLoCo; leave "
            "--diloco_distributed out for that, or give --diloco_workers M > 1"
        )
    replicate = int(env("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1"))
    shard = int(env("PARALLELISM_CONFIG_DP_SHARD_SIZE", str(island)))
    options = args.fsdp.split() if isinstance(args.fsdp, str) else args.fsdp if isinstance(args.fsdp, list) else []
    hybrid = any("hybrid" in str(option).lower() for option in options)
    hybrid = hybrid or "HYBRID" in env("FSDP_SHARDING_STRATEGY", "").upper()
    if replicate != 1 or shard not in (1, island) or hybrid:
        refusals.append(
            f"an FSDP shard group that is not one island (parallelism_config dp_replicate_size {replicate}, "
            f"dp_shard_size {shard}{', HYBRID_SHARD' if hybrid else ''}): the workers are the replicas, each "
            f"island of {island} processes (W / M = {world_size} / {workers}) one shard group; leave "
            f"dp_replicate_size 1 and dp_shard_size {island} (or unset) and no hybrid sharding"
        )
    return refusals + _island_shard_options(args, config)


def _island_shard_options(args: TrainingArguments, config: dict[str, Any]) -> list[str]:
    """The FSDP options the islands' sharding does not take (`_island_shard_refusals`' second half)."""
    env = os.environ.get
    refusals = []
    other = [int(env(f"PARALLELISM_CONFIG_{dim}_SIZE", "1")) for dim in ("TP", "CP", "SP")]
    if any(size != 1 for size in other):
        refusals.append("tensor, context or sequence parallelism (parallelism_config tp/cp/sp_size > 1)")
    if strtobool(env("FSDP_OFFLOAD_PARAMS", "false")) or config.get("cpu_offload", False):
        refusals.append("FSDP parameter offload (fsdp_offload_params / fsdp_config cpu_offload); leave it off")
    checkpointing = env("FSDP_ACTIVATION_CHECKPOINTING", str(config.get("activation_checkpointing", False)))
    if strtobool(str(checkpointing)):
        refusals.append(
            "FSDP activation checkpointing (fsdp_activation_checkpointing), which accelerate applies only to a "
            "model it shards itself; leave it off"
        )
    state_dict_type = env("FSDP_STATE_DICT_TYPE", str(config.get("state_dict_type", "FULL_STATE_DICT")))
    if "SHARDED" in state_dict_type.upper():
        refusals.append(
            f"fsdp_state_dict_type {state_dict_type}: the model files hold the full outer weights "
            "(FULL_STATE_DICT), the inner state one optimizer file per process"
        )
    if args.load_best_model_at_end:
        refusals.append(
            "--load_best_model_at_end: loading a checkpoint's full weights into the sharded model is not "
            "supported yet; leave it out (resuming from a checkpoint is)"
        )
    return refusals


def requested_layout(args: TrainingArguments, world_size: int, rank: int) -> WorkerLayout | None:
    """The layout ``args`` ask for on ``world_size`` processes, seen from process ``rank`` (None: not DiLoCo across
    processes). Nothing is created or communicated."""
    if not (getattr(args, "diloco_distributed", False) or getattr(args, "gpa_distributed", False)):
        return None
    workers = args.diloco_workers or world_size
    return WorkerLayout(world_size, workers, args.diloco_fragments, worker=rank // (world_size // workers))


# ---- the checkpoints: another run's refused before anything is loaded ----

#: The flags that set each field of a layout, as the refusals name them.
_LAYOUT_FLAGS = {
    "world_size": "the world size (the number of processes)",
    "num_workers": "--diloco_workers",
    "num_fragments": "--diloco_fragments",
}


def refuse_other_checkpoint(
    checkpoint_dir: str, args: TrainingArguments, rank: int, layout: WorkerLayout | None = None
) -> None:
    """Raise a ``ValueError`` naming what differs when ``checkpoint_dir`` cannot resume this run (``args``, seen from
    process ``rank``; ``layout``: the optimizer's, when it exists), before anything is loaded: saved on another layout
    of DiLoCo or GPA across processes, or by a run that was (not) one (`refuse_other_layout`), or a DiLoCo or GPA
    state saved with other constants of the outer step (`refuse_other_outer`). A checkpoint without optimizer state
    (``--save_only_model``) passes: training then starts from its weights."""
    layout = layout or requested_layout(args, args.world_size, rank)
    shards = getattr(args, "diloco_island_shards", False)
    refuse_other_layout(checkpoint_dir, layout, rank, island_shards=shards)
    refuse_other_outer(checkpoint_dir, args, rank)


def refuse_other_layout(
    checkpoint_dir: str, layout: WorkerLayout | None, rank: int, *, island_shards: bool = False
) -> None:
    """``checkpoint_dir`` saved on another layout than ``layout`` (this run's, None when it is not across processes)
    refused, naming what differs; also when its states hold FSDP2 shards and this run does not shard its islands
    (``island_shards``), or the reverse."""
    own = worker_optimizer_file(checkpoint_dir, rank)
    saved_by_workers = sorted(glob.glob(worker_optimizer_file(glob.escape(checkpoint_dir), "*")))
    single = os.path.isfile(os.path.join(checkpoint_dir, OPTIMIZER_NAME))
    if layout is None:
        if saved_by_workers and not single:
            _refuse_workers_checkpoint(checkpoint_dir, checkpoint.read_saved_state(saved_by_workers[0]))
        return
    if not saved_by_workers:
        if single:
            raise ValueError(
                f"resume_from_checkpoint {checkpoint_dir} holds one optimizer state ({OPTIMIZER_NAME}), written by a "
                "run that was not DiLoCo across processes; this run is one "
                f"({checkpoint.describe_layout(layout.saved())}), which resumes from one state per process "
                f"({checkpoint.OPTIMIZER_RANK_NAME.format(rank='<r>')}). "
                f"Start a new run from its weights (--model_name_or_path {checkpoint_dir})"
            )
        return  # no optimizer state at all: the Trainer resumes from the weights alone, and says so
    found = os.path.isfile(own)
    state = checkpoint.read_saved_state(own if found else saved_by_workers[0])
    saved = checkpoint.saved_layout(state)
    if saved is None:
        raise ValueError(
            f"resume_from_checkpoint {checkpoint_dir}: {os.path.basename(saved_by_workers[0])} is not a DiLoCo state "
            "(it records no worker layout)"
        )
    if not found:  # the world size, M and P are compared on another process's file; the worker cannot be
        layout = dataclasses.replace(layout, worker=saved.get("worker") or 0)
    checkpoint.check_saved(layout, saved, f"resume_from_checkpoint {checkpoint_dir}", names=_LAYOUT_FLAGS)
    if not found:
        raise ValueError(
            f"resume_from_checkpoint {checkpoint_dir} has no {os.path.basename(own)}: the optimizer state of this "
            "process's worker is missing (an incomplete checkpoint); resume from an earlier one"
        )
    sharded = checkpoint.holds_shards(state)
    if sharded != island_shards:
        said = {True: "FSDP2 inside each island (the FSDP config)", False: "whole weights on every process (DDP)"}
        raise ValueError(
            f"resume_from_checkpoint {checkpoint_dir}: its optimizer states were saved with {said[sharded]}, this run "
            f"runs with {said[island_shards]}. A DiLoCo state resumes only on the layout that saved it: launch with "
            f"the {'FSDP2' if sharded else 'DDP'} config (configs/accelerate_{'fsdp2' if sharded else 'ddp'}.yaml), "
            f"or start a new run from its outer weights (--model_name_or_path {checkpoint_dir})"
        )


def _refuse_workers_checkpoint(checkpoint_dir: str, state: dict[str, Any]) -> None:
    """A checkpoint of a run across processes, to a run that is not one."""
    saved = checkpoint.saved_layout(state) or {}
    gpa = (saved_optimizer_name(state) or "").startswith("GPADiLoCo")
    what, mode = ("GPA", "--gpa_distributed") if gpa else ("DiLoCo", "--diloco_distributed")
    flags = f" --diloco_workers {saved.get('num_workers')!r}"
    if saved.get("num_fragments", 1) != 1:
        flags += f" --diloco_fragments {saved['num_fragments']}"
    raise ValueError(
        f"resume_from_checkpoint {checkpoint_dir} holds the optimizer states of a {what} run across processes "
        f"({checkpoint.describe_layout(saved)}), one file per process; this run is not one. Resume it as it was run "
        f"({mode} true{flags} on {saved.get('world_size')!r} processes), or start a new run from its weights "
        f"(--model_name_or_path {checkpoint_dir})"
    )


#: The flags that set the constants of each kind of outer step (or GPA's), which its state keeps in its param groups:
#: (what the messages call it, the --optim that resumes it, the flags).
_OUTER_FLAGS = {
    "DiLoCo": (
        "DiLoCo",
        "--optim diloco_adamw (or diloco_muon)",
        {INNER_STEPS: "diloco_inner_steps", OUTER_LR: "diloco_outer_lr", OUTER_MOMENTUM: "diloco_outer_momentum"},
    ),
    "GPADiLoCo": (
        "GPA across workers",
        "--optim gpa_adamw --gpa_distributed true",
        {INNER_STEPS: "gpa_sync_steps", OUTER_LR: "gpa_outer_lr", MU_X: "gpa_mu_x", MU_Y: "gpa_mu_y"},
    ),
    "GPA": ("GPA", "--optim gpa_adamw (or gpa)", {MU_X: "gpa_mu_x", MU_Y: "gpa_mu_y", AVERAGING: "gpa_averaging"}),
}


def _outer_kind(args: TrainingArguments) -> str | None:
    """Which optimizer's constants ``args`` set: ``"DiLoCo"`` (--optim diloco_*), ``"GPADiLoCo"``
    (--gpa_distributed), ``"GPA"`` (--optim gpa_adamw or gpa on its own), or None (another)."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim.startswith("diloco"):
        return "DiLoCo"
    if optim == "gpa_adamw" and getattr(args, "gpa_distributed", False):
        return "GPADiLoCo"
    return "GPA" if optim in ("gpa_adamw", "gpa") else None


def refuse_other_outer(checkpoint_dir: str, args: TrainingArguments, rank: int) -> None:
    """The state this process resumes (its ``optimizer_rank{r}.pt``, else ``optimizer.pt``) saved with other
    constants than ``args`` give (DiLoCo's H, outer lr, momentum; GPA across workers' H, outer lr, mu_x, mu_y; GPA's
    mu_x, mu_y, averaging), or by the other kind of outer step, refused naming the flag: loading it would keep the
    saved values over the flags without a word (torch's ``load_state_dict`` takes a group's values from the state)."""
    kind = _outer_kind(args)
    path = worker_optimizer_file(checkpoint_dir, rank)
    path = path if os.path.isfile(path) else os.path.join(checkpoint_dir, OPTIMIZER_NAME)
    if kind is None or not os.path.isfile(path):
        return
    state = checkpoint.read_saved_state(path)
    saved_kind = (saved_optimizer_name(state) or "").split("(")[0]
    if kind == "GPA" and saved_kind not in ("GPAAdamW", "GPA"):
        return  # another optimizer's state (or none of hf_gpa's): the optimizer's own load names what it is
    if kind != "GPA" and checkpoint.saved_layout(state) is None:
        return  # not a DiLoCo state: the optimizer's own load names what it is
    saved_kind = saved_kind or "DiLoCo"
    if kind != "GPA" and saved_kind != kind and saved_kind in _OUTER_FLAGS:
        saved_what, resumed_by, _ = _OUTER_FLAGS[saved_kind]
        raise ValueError(
            f"resume_from_checkpoint {checkpoint_dir}: its state was saved by {saved_what}, which this run "
            f"({_OUTER_FLAGS[kind][1]}) cannot resume: resume it with {resumed_by}, or start a new run from the "
            f"checkpoint's evaluation weights (--model_name_or_path {checkpoint_dir})"
        )
    what, _, flags = _OUTER_FLAGS[kind]
    if kind == "GPA" and args.gpa_averaging == "schedule_free":
        flags = {k: v for k, v in flags.items() if k != MU_X}  # Schedule-Free's average has no mu_x
    saved = state["param_groups"][0]
    for key, flag in flags.items():
        if key in saved and saved[key] != getattr(args, flag):
            raise ValueError(
                f"resume_from_checkpoint {checkpoint_dir}: its {what} state was saved with --{flag} {saved[key]!r}, "
                f"this run asks for {getattr(args, flag)!r}. A {what} run resumes with the constants that saved it "
                f"(its state keeps them, and loading it would keep them over the flag): resume with --{flag} "
                f"{saved[key]!r}, or start a new run from the checkpoint's evaluation weights (--model_name_or_path "
                f"{checkpoint_dir})"
            )


# ---- the model: a DDP over the island, or FSDP2 inside it ----


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
    """Shard ``model`` in place with FSDP2 over this process's island, from the first process's weights: its
    parameters and buffers are broadcast from the run's first process (what ``fsdp_sync_module_states`` promises;
    each process would otherwise keep its shard of its own initialisation), then ``fully_shard`` on each module of the
    classes the model names unsplittable (``_no_split_modules``: a decoder layer, as accelerate's
    TRANSFORMER_BASED_WRAP), then on the root, over ``island_mesh(layout)["shard"]``; returns the mesh.
    ``fully_shard_kwargs``: FSDP2's other arguments (``reshard_after_forward``, ``mp_policy``). Every process must call
    it, before the optimizer is built.

    Why here and not in accelerate: accelerate (1.10 to 1.15) shards over ``accelerator.torch_device_mesh`` indexed
    by its parallelism config's ``fsdp_dim_names``: all processes, or with ``dp_replicate_size`` > 1 HSDP's 2-D
    ("dp_replicate", "dp_shard_cp") mesh, whose gradients are all-reduced across the replicas at every step, which
    DiLoCo exists to avoid; it has no setting for a sub-mesh without that replication. And on CPU processes it turns
    its FSDP plugin off (MULTI_CPU), so it would shard nothing there."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = island_mesh(layout, device.type)
    with torch.no_grad():
        broadcast_([*(p.detach() for p in model.parameters()), *model.buffers()], layout.process_group)
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
def broadcast_unstepped(model: nn.Module, optimizer: OuterOptimizer) -> None:
    """Every process takes the first process's parameters of ``model`` that ``optimizer`` (across processes) does not
    step (the frozen ones) and its buffers, as DDP does over its own group when it is built.

    The optimizer broadcasts the parameters it steps, and an island's DDP reaches the island only: without this, a
    model initialised without a common seed would keep each worker's own frozen weights and buffers (rank 0's would be
    saved, and each process would evaluate a model of its own).
    """
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    unstepped = [p.detach() for p in model.parameters() if id(p) not in stepped]
    optimizer.layout.broadcast([*unstepped, *model.buffers()])


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


# ---- the logs ----


def workers_in_words(num_workers: int, island_size: int) -> str:
    """ "4 workers of 2 processes", "2 workers of 1 process"."""
    workers = f"{num_workers} worker{'s' if num_workers != 1 else ''}"
    return f"{workers} of {island_size} process{'es' if island_size != 1 else ''}"


def workers_start_line(optimizer: OuterOptimizer) -> str:
    """The line a run across processes logs at its start: the workers (and FSDP2 inside the islands), H, the
    fragments, the sync (dtype, overlap), and the bytes each process sends to the other workers over one outer period
    (`OuterOptimizer.outer_bytes_per_period`, what ``outer_bytes`` will count) against what it would send per step
    under DDP over all W processes (a ring all-reduce of every trainable parameter's gradient: 2 (W - 1) / W of their
    bytes)."""
    layout, sync = optimizer.layout, optimizer.sync
    steps, fragments = optimizer.param_groups[0][INNER_STEPS], layout.num_fragments
    period = optimizer.outer_bytes_per_period()
    grads = sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    ddp = 2 * (layout.world_size - 1) * grads // layout.world_size
    if sync.outer_dtype == "float32":
        collective = "all-reduce"
    elif layout.num_workers <= compression.ALL_GATHER_WORKERS:
        collective = f"all-gather of the {sync.outer_dtype} payloads"
    else:
        collective = f"all-to-all and all-gather of {sync.outer_dtype} chunks"
    per = "one" if fragments == 1 else f"{fragments} (one per fragment, about 1/{fragments} of the model each)"
    overlap = "no overlap (each outer sync blocks the step that takes it)"
    if sync.overlap_steps:
        overlap = (
            f"overlap {sync.overlap_steps} inner steps (each fragment's all-reduce runs in the background, its "
            f"outer update applied {sync.overlap_steps} steps later, mixing alpha {sync.overlap_alpha})"
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sharded = ", each island's model sharded by FSDP2 over its processes" if any(map(is_dtensor, params)) else ""
    what = "GPA across workers" if type(optimizer)._algorithm == "GPADiLoCo" else "DiLoCo across workers"
    return (
        f"hf_gpa: {what}: {workers_in_words(layout.num_workers, layout.island_size)} ({layout.world_size} processes"
        f"{sharded}), H = {steps}, {fragments} fragment{'s' if fragments != 1 else ''}, outer dtype "
        f"{sync.outer_dtype}, {overlap}. Every {steps} inner steps each process sends {period:,} bytes between "
        f"workers ({per} {collective} of the pseudo-gradient), against {ddp:,} bytes per step under DDP "
        f"({ddp * steps:,} per {steps} steps): {period / (ddp * steps):.3g} of DDP's. The logs carry outer_steps and "
        "outer_bytes (this process's, so far)."
    )


def _short_run_warning(optimizer: OuterOptimizer, max_steps: int) -> str | None:
    """What a run of ``max_steps`` steps shorter than one outer period should be told at its start."""
    period = min(group[INNER_STEPS] for group in optimizer.param_groups)
    if max_steps <= 0 or max_steps >= period:
        return None
    return (
        f"hf_gpa: this run takes {max_steps} steps, fewer than one outer period (H = {period}): no outer step is due "
        "before the end of training, where the steps taken are synchronised once (outer_steps counts it then)"
    )


# ---- the Trainer's hooks ----


class DiLoCoWorkersMixin:
    """The `Trainer` hooks that differ under DiLoCo or GPA across processes, for a trainer class to compose
    (`GPATrainer` does): the model's wrapping (`_wrap_model`; under FSDP, `create_optimizer`, `save_model`,
    `create_accelerator_and_postprocess`), the token count taken over the island (`_get_num_items_in_batch`), the
    start line (`create_optimizer`) and the outer traffic in the logs (`log`), one optimizer state file per process
    in a checkpoint (`_save_optimizer_and_scheduler`, `_load_optimizer_and_scheduler`), the refusal of another run's
    checkpoint (`refuse_other_checkpoint`), and the end of training (`synchronize_outer`, for any DiLoCo or GPA across
    workers, one worker too). Every hook takes ``*args, **kwargs`` and passes them on to the next class in the MRO
    unchanged, which it leaves alone for any other optimizer."""

    def _outer_optimizer(self) -> OuterOptimizer | None:
        """The DiLoCo or GPA-across-workers optimizer this trainer steps (on one worker or many); else None."""
        inner = unwrap_gpa_optimizer(getattr(self, "optimizer", None))
        return inner if isinstance(inner, OuterOptimizer) else None

    def _workers_layout(self) -> WorkerLayout | None:
        """The layout of the optimizer across processes that this trainer steps; None for any other optimizer."""
        outer = self._outer_optimizer()
        return outer.layout if outer is not None and outer.layout.distributed else None

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
        """Given `train`'s arguments: refuse the checkpoint it would resume when it cannot resume this run
        (`refuse_other_checkpoint`), before anything is loaded."""
        checkpoint_dir = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if checkpoint_dir is True and os.path.isdir(self.args.output_dir):
            checkpoint_dir = get_last_checkpoint(self.args.output_dir)  # None: the next class says there is none
        if isinstance(checkpoint_dir, (str, os.PathLike)):
            rank = self.args.process_index
            refuse_other_checkpoint(os.fspath(checkpoint_dir), self.args, rank, self._workers_layout())

    def _wrap_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        """The next class's `_wrap_model`; for training across processes, a DDP over the processes of this worker's
        island only (`island_ddp`), or the island-sharded model as it is.

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
        broadcast_unstepped(model, self._outer_optimizer())
        prepared = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        if self._island_mesh is not None:
            # accelerate's FSDP2 (on accelerators) leaves a model that is already an FSDPModule as it is (manual
            # wrapping); on CPU processes it runs no FSDP, and the Trainer gets the sharded model as it is.
            return model if getattr(self.accelerator, "is_fsdp2", False) else IslandShardedModel(prepared)
        handler = self.accelerator.ddp_handler
        ddp = island_ddp(prepared, layout, self.args.device, **(handler.to_kwargs() if handler is not None else {}))
        if handler is not None:
            handler.register_comm_hook(ddp)  # accelerate's own hook (gradient compression), where it sets one
        return ddp

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        """The next class's; with FSDP2 inside the islands the model is sharded first (`shard_islands`, once, before
        the optimizer is built on its DTensor parameters, with accelerate's FSDP2 settings where its plugin is on);
        across processes the first process logs `workers_start_line`, and a run shorter than one outer period is
        warned of."""
        if self.optimizer is None and getattr(self.args, "diloco_island_shards", False) and self._island_mesh is None:
            plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
            settings: dict[str, Any] = {}
            if plugin is not None:
                settings["reshard_after_forward"] = plugin.reshard_after_forward
                if plugin.mixed_precision_policy is not None:
                    settings["mp_policy"] = plugin.mixed_precision_policy
            layout = requested_layout(self.args, self.args.world_size, self.args.process_index)
            self._island_mesh = shard_islands(self.model, layout, self.args.device, **settings)
        optimizer = super().create_optimizer(*args, **kwargs)
        outer = self._outer_optimizer()
        if outer is not None and self.args.process_index == 0:
            if outer.layout.distributed:
                logger.info(workers_start_line(outer))
            if (warning := _short_run_warning(outer, self.args.max_steps)) is not None:
                logger.warning(warning)
        return optimizer

    # ---- the end of training: every step in the final model ----

    #: Whether this `train()` has synchronised the outer optimizer at its end already.
    _outer_synchronized = False

    def synchronize_outer(self, *, end: bool = False) -> None:
        """Once per `train()`, at its end (`GPATrainer`'s callback calls it after the last step, before its
        evaluation and save, or at ``on_train_end`` for a run stopped early; ``end=False`` resets it at the start):
        the DiLoCo or GPA-across-workers optimizer synchronises every step since the last outer step and the syncs in
        flight (`OuterOptimizer.synchronize`), so that the weights evaluated, saved and pushed after training hold
        every pseudo-gradient of every worker."""
        if not end:
            self._outer_synchronized = False
            return
        outer = self._outer_optimizer()
        if outer is not None and not self._outer_synchronized:
            outer.synchronize()
        self._outer_synchronized = True

    def _load_best_model(self, *args: Any, **kwargs: Any) -> None:
        """The next class's; the run's own end is synchronised first (`synchronize_outer`), so that nothing of it is
        applied later over the best checkpoint's weights, which stay as that checkpoint saved them."""
        self.synchronize_outer(end=True)
        super()._load_best_model(*args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The next class's; across processes the logs of a training step (those with its ``loss``) also carry
        ``outer_steps`` and ``outer_bytes``, the optimizer's `OuterTraffic` so far."""
        if self._workers_layout() is not None and "loss" in logs:
            traffic = self._outer_optimizer().outer_traffic
            logs = {**logs, "outer_steps": traffic.outer_steps, "outer_bytes": traffic.outer_bytes}
        super().log(logs, *args, **kwargs)

    def _get_num_items_in_batch(self, *args: Any, **kwargs: Any) -> torch.Tensor | int | None:
        """The next class's count of the tokens a loss is averaged over; across processes, taken over this worker's
        island (`island_token_count`) instead of over every process (``--average_tokens_across_devices``, which
        GPATrainingArguments turns off there), so that no process waits for another worker between outer steps."""
        count = super()._get_num_items_in_batch(*args, **kwargs)
        layout = self._workers_layout()
        if layout is None or not torch.is_tensor(count) or self.args.average_tokens_across_devices:
            return count
        return island_token_count(count, layout)

    def _save_optimizer_and_scheduler(self, output_dir: str, *args: Any, **kwargs: Any) -> None:
        """The next class's; across processes every process writes its worker's state to a file of its own
        (``optimizer_rank{r}.pt``), and the first process the scheduler's. The stock Trainer writes the first process's
        optimizer state alone, which would lose the other workers'."""
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

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None, *args: Any, **kwargs: Any) -> None:
        """The next class's; across processes this process's own optimizer state and the scheduler, as
        `_save_optimizer_and_scheduler` wrote them (nothing where the checkpoint has no optimizer state for this
        process: ``--save_only_model``)."""
        if self._workers_layout() is None:
            super()._load_optimizer_and_scheduler(checkpoint_dir, *args, **kwargs)
            return
        path = None if checkpoint_dir is None else worker_optimizer_file(checkpoint_dir, self.args.process_index)
        if path is None or not os.path.isfile(path):
            return
        map_location = self.args.device if self.args.device.type != "cpu" else "cpu"
        self.optimizer.load_state_dict(torch.load(path, map_location=map_location, weights_only=True))
        scheduler = os.path.join(checkpoint_dir, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            with warnings.catch_warnings(record=True) as caught_warnings:
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            reissue_pt_warnings(caught_warnings)
