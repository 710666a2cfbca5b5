"""What a worker's checkpoint holds: DiLoCo's state dict, the file of each process, and the refusals between layouts.

**The state dict** of `DiLoCo` and `GPADiLoCo` is torch's, with:

* in every param group, the layout that saved it (``"diloco_layout"``: world size, M, P; `WorkerLayout.saved`) and,
  across processes, what this process sent so far (``"diloco_outer_traffic"``), the same on every process;
* per parameter, its state (``"outer"``, the algorithm's own tensors such as the outer momentum or GPA's z, the base
  optimizer's state under ``"base"``) and, with an overlapped sync in flight, its averaged pseudo-gradient
  (``"pending_pseudo_gradient"``) and the inner steps left before its outer update (``"pending_steps"``): a resume
  applies it at its own step, bitwise;
* across M > 1 workers, the entries that are this worker's own nested under ``"worker<w>"``: its inner weights
  (``"inner"``, the parameter in train mode; in eval mode ``"outer"``, which then holds them, or ``"inner_fp32"`` for
  bf16/fp16 parameters), its inner optimizer state (``"base"``) and a compressed sync's residuals. What is the same on
  every process (the outer weights and momentum, GPA's z, the layout) stays outside, so a checkpoint that keeps one
  copy of what is equal on every process (torch.distributed.checkpoint, DCP) keeps every worker's own entries apart
  and loads each process its own worker's; its loader fills only the keys of its template, so the template comes from
  the optimizer that loads (``optimizer.init_state()`` first, as for every hf_gpa optimizer).

Loading a state saved on another layout (world size, M, P) or by another worker raises a ``ValueError`` naming what
differs, before anything changes (`check_saved`); a DiLoCo state that records no layout is a single worker's, P = 1.

**The files** (`GPATrainer`): across processes every process writes its own state to ``optimizer_rank{r}.pt``
(`worker_optimizer_file`) beside the model (the outer weights, the same on every process, written once); a single
worker's state is the stock ``optimizer.pt``. A state holds DTensor shards exactly when its islands were sharded by
FSDP2 (`holds_shards`), and resumes only so.

**What a live worker serves** to one that (re)joins and heals from it (torchft's replica groups, ``torchft_sync``) is
not a file but `served_state`: the parameters (the inner weights), every parameter's state, the param groups' values
and the traffic, copied to the CPU; `heal_from_` copies them into the joining worker's optimizer in place.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._tensors import INT_VIEW, is_dtensor, local_tensor
from .._types import (
    BASE,
    DILOCO_LAYOUT,
    INNER,
    INNER_FP32,
    OUTER,
    OUTER_RESIDUAL,
    OUTER_SERVER_RESIDUAL,
    OUTER_TRAFFIC,
    PENDING_PSEUDO_GRADIENT,
    PENDING_STEPS,
    TRAIN_MODE,
    WORKER_PREFIX,
)
from .layout import WorkerLayout
from .sync import OuterTraffic, PendingSync

__all__ = [
    "OPTIMIZER_RANK_NAME",
    "check_inner_kept",
    "check_saved",
    "cpu_copy",
    "describe_layout",
    "heal_from_",
    "holds_shards",
    "load_state",
    "read_saved_state",
    "saved_layout",
    "served_state",
    "state_dict_of",
    "worker_optimizer_file",
]

#: Each process's optimizer state in a checkpoint of a run across processes (``rank``: its global rank).
OPTIMIZER_RANK_NAME = "optimizer_rank{rank}.pt"
_WORKER_KEY = re.compile(rf"{WORKER_PREFIX}(\d+)")
#: The entries of a parameter's state that belong to one worker (besides its inner weights, see `_own_entries`).
_OWN_KEYS = (BASE, INNER_FP32, OUTER_RESIDUAL, OUTER_SERVER_RESIDUAL)


def worker_optimizer_file(checkpoint: str, rank: int | str) -> str:
    """The optimizer state file that process ``rank`` writes into (and resumes from) ``checkpoint``."""
    return os.path.join(checkpoint, OPTIMIZER_RANK_NAME.format(rank=rank))


def _own_entries(state: dict[str, Any], p: torch.Tensor, train_mode: bool) -> dict[str, Any]:
    """The entries of ``p``'s ``state`` that are this worker's own, with its inner weights as a state dict holds them:
    ``"inner"`` (a copy of the parameter: a loader that fills the model and the optimizer state in place must not
    fill one storage twice) in train mode, ``"outer"`` in eval mode (which then holds them), ``"inner_fp32"`` for
    bf16/fp16 parameters in both modes."""
    own = {key: state[key] for key in _OWN_KEYS if key in state}
    if OUTER in state and INNER_FP32 not in state:
        if train_mode:
            own[INNER] = p.detach().clone()
        else:
            own[OUTER] = state[OUTER]
    return own


def state_dict_of(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (torch's, of ``optimizer``, a ``diloco.outer.OuterOptimizer``: its ``layout``, ``sync``, groups
    and state are read) in the form described in the module docstring. The syncs in flight
    are waited for first; the optimizer's own state is not changed (torch's packed entries are its dicts: copied)."""
    layout, sync = optimizer.layout, optimizer.sync
    for group in state_dict["param_groups"]:
        group[DILOCO_LAYOUT] = layout.saved()
        if layout.distributed:
            group[OUTER_TRAFFIC] = dataclasses.asdict(sync.traffic)
    pairs = [(group, p) for group in optimizer.param_groups for p in group["params"]]
    states = state_dict["state"] = {index: dict(entry) for index, entry in state_dict["state"].items()}
    sync.settle()
    index = {id(p): i for i, (_, p) in enumerate(pairs)}
    for pending in sync.pending:
        for (_, p), pseudo_grad in zip(pending.due, pending.pseudo_grads):
            entry = states.setdefault(index[id(p)], {})
            entry[PENDING_PSEUDO_GRADIENT], entry[PENDING_STEPS] = pseudo_grad.clone(), pending.remaining
    if layout.num_workers > 1:
        for i, (group, p) in enumerate(pairs):
            if i in states and p in optimizer.state:
                own = _own_entries(optimizer.state[p], p, group[TRAIN_MODE])
                states[i] = {k: v for k, v in states[i].items() if k not in own}
                states[i][f"{WORKER_PREFIX}{layout.worker}"] = own
    return state_dict


def saved_layout(state_dict: Mapping[str, Any]) -> dict[str, int | None] | None:
    """The worker layout a DiLoCo state dict was saved on ({"world_size", "num_workers", "num_fragments",
    "worker"}; worker None where no parameter has state yet), or None for a state saved by anything else."""
    groups = state_dict.get("param_groups") or [{}]
    layout = groups[0].get(DILOCO_LAYOUT)
    if layout is None:
        return None
    saved: dict[str, Any] = dict(layout)
    if "worker" not in saved:
        tags = (_WORKER_KEY.fullmatch(str(key)) for entry in state_dict.get("state", {}).values() for key in entry)
        workers = {int(tag.group(1)) for tag in tags if tag}
        saved["worker"] = min(workers) if workers else (0 if saved.get("num_workers") == 1 else None)
    return saved


def describe_layout(saved: Mapping[str, Any]) -> str:
    return (
        f"{saved.get('num_workers')!r} workers over {saved.get('world_size')!r} processes, "
        f"{saved.get('num_fragments')!r} fragments"
    )


#: How `check_saved` names the layout's fields unless told otherwise (the optimizers' arguments).
LAYOUT_NAMES = {
    "world_size": "the world size (processes)",
    "num_workers": "num_workers (M)",
    "num_fragments": "num_fragments (P)",
}


def check_saved(
    layout: WorkerLayout, saved: Mapping[str, Any], owner: str, names: Mapping[str, str] | None = None
) -> None:
    """Refuse, by name, a state saved on another layout (another world size, M, P, or another worker's state).

    ``owner`` begins the message (``"DiLoCo.load_state_dict()"``); ``names`` gives world_size, num_workers or
    num_fragments the names the user knows them by (the flags that set them)."""
    mine = {**layout.saved(), "worker": layout.worker}
    for key, name in {**LAYOUT_NAMES, **(names or {})}.items():
        if saved.get(key) != mine[key]:
            raise ValueError(
                f"{owner}: the state dict was saved with {name} = {saved.get(key)!r}, this optimizer runs with "
                f"{mine[key]} ({describe_layout(saved)} against {describe_layout(mine)}). A DiLoCo state resumes only "
                "on the layout that saved it; start a new run from the checkpoint's outer weights (the model weights "
                "saved in eval mode) to change it"
            )
    if saved.get("worker") is not None and saved["worker"] != mine["worker"]:
        raise ValueError(
            f"{owner}: the state dict holds worker {saved['worker']!r}'s inner weights and inner optimizer state, "
            f"this process is in worker {mine['worker']}: each process loads the state that a process of its own "
            "worker (island) saved"
        )


def load_state(optimizer: Any, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> None:
    """Load ``state_dict`` (the form of `state_dict_of`) into ``optimizer`` with ``load`` (its base class's loader),
    after `check_saved`; the syncs in flight, the traffic and this worker's inner weights come back with it."""
    saved = saved_layout(state_dict)
    if saved is None and (state_dict.get("param_groups") or [{}])[0].get("optimizer") == optimizer.optimizer_name:
        saved = {**WorkerLayout().saved(), "worker": 0}  # a DiLoCo state that records no layout: a single worker's
    if saved is not None:
        check_saved(optimizer.layout, saved, f"{optimizer.optimizer_name}.load_state_dict()")
    extras = (DILOCO_LAYOUT, OUTER_TRAFFIC)
    groups = [{k: v for k, v in g.items() if k not in extras} for g in state_dict["param_groups"]]
    traffic = (state_dict["param_groups"] or [{}])[0].get(OUTER_TRAFFIC)
    states = {}
    for index, entry in state_dict["state"].items():
        flat = {k: v for k, v in entry.items() if not _WORKER_KEY.fullmatch(str(k))}
        for key, own in entry.items():
            if _WORKER_KEY.fullmatch(str(key)):
                flat.update(own)
        states[index] = flat
    load({**state_dict, "state": states, "param_groups": groups})
    saved_traffic = OuterTraffic(**traffic) if traffic is not None else OuterTraffic()
    for field in dataclasses.fields(OuterTraffic):  # in place: the optimizer's ``outer_traffic`` is this object
        setattr(optimizer.sync.traffic, field.name, getattr(saved_traffic, field.name))
    _restore_pending_and_inner(optimizer)


def _restore_pending_and_inner(optimizer: Any) -> None:
    """After a load: the syncs in flight rebuilt from their parameters' entries (oldest, fewest steps left, first),
    and a train-mode state's inner weights put into the parameters (``"inner"``; ``"inner_fp32"`` rounded), kept
    until the next step for `check_inner_kept`."""
    syncs: dict[int, PendingSync] = {}
    optimizer._loaded_inner = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            if PENDING_PSEUDO_GRADIENT in state:
                steps = int(state.pop(PENDING_STEPS))
                pseudo_grad = state.pop(PENDING_PSEUDO_GRADIENT)
                grads = syncs.setdefault(steps, PendingSync([], [], steps))
                grads.due.append((group, p))
                grads.pseudo_grads.append(pseudo_grad.to(local_tensor(state[OUTER]).device))  # type: ignore[union-attr]
            inner = state.pop(INNER, None)
            if group[TRAIN_MODE] and optimizer.layout.num_workers > 1:
                inner = inner if inner is not None else state.get(INNER_FP32)
                if inner is not None:
                    with torch.no_grad():
                        local_tensor(p).copy_(local_tensor(inner))
                    optimizer._loaded_inner.append((p, _fingerprint(local_tensor(p))))
    optimizer.sync.pending = [syncs[steps] for steps in sorted(syncs)]


def _fingerprint(t: torch.Tensor) -> torch.Tensor | None:
    """The sum of ``t``'s bit patterns (as integers): what a write of other values changes."""
    int_dtype = INT_VIEW.get(t.dtype)
    return None if int_dtype is None else torch.sum(t.view(int_dtype), dtype=torch.int64)


def check_inner_kept(optimizer: Any) -> None:
    """At the first step (or switch to eval mode) after a train-mode load across M > 1 workers: refuse, before
    anything changes, parameters that no longer hold the inner weights the load put there (their bit patterns' sums
    differ). A model state loaded after the optimizer's overwrote them: a checkpoint that keeps one copy of what has
    one name on every process holds one worker's parameters for all, in train mode, where each worker's differ. No
    collective: a process whose parameters were written refuses, the others fail at the next outer sync within the
    collective timeout, as when a worker dies."""
    loaded, optimizer._loaded_inner = getattr(optimizer, "_loaded_inner", []), []
    written = sum(held is not None and not torch.equal(_fingerprint(local_tensor(p)), held) for p, held in loaded)
    if written:
        raise ValueError(
            f"{optimizer.optimizer_name}: {written} parameter(s) no longer hold the inner weights that "
            "load_state_dict() put there (a state taken in train mode across workers): a model state was loaded "
            "after the optimizer state, and in train mode each worker's parameters differ, which a checkpoint that "
            "keeps one copy per name (torch.distributed.checkpoint) cannot hold. Save in eval mode "
            "(optimizer.eval() before get_state_dict, init_state(eval_mode=True) before loading, optimizer.train() "
            "after), or load the model first and the optimizer state last (set_model_state_dict, then "
            "set_optimizer_state_dict)"
        )


def read_saved_state(path: str) -> dict[str, Any]:
    """A saved optimizer state, read without loading its tensors' data (mmap): for its layout and kind."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def holds_shards(state_dict: Mapping[str, Any]) -> bool:
    """Whether a saved optimizer state holds DTensor shards (FSDP2 inside the islands)."""

    def shards(value: Any) -> bool:
        if isinstance(value, Mapping):
            return any(shards(v) for v in value.values())
        return torch.is_tensor(value) and is_dtensor(value)

    return any(shards(entry) for entry in state_dict.get("state", {}).values())


# ---- what a live worker serves to one that heals from it ----


def cpu_copy(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU (its local shard), dicts, lists and tuples rebuilt."""
    if torch.is_tensor(value):
        return local_tensor(value).detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: cpu_copy(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(v) for v in value)
    return value


def served_state(optimizer: Any) -> dict[str, Any]:
    """What a live worker serves to a worker that (re)joins and heals from it: every parameter (its inner weights),
    every parameter's state (the outer weights and the algorithm's own tensors, DiLoCo's momentum or GPA's z, the
    base optimizer's state), every param group's values but its parameters (``lr``, ``inner_step``: the step count
    and the data position, ...) and the traffic (``outer_traffic``), in the order of the param groups. Everything is
    a copy on the CPU, so that the worker may go on while it is read (torchft's HTTP transport serves CPU tensors by
    reference)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "params": [cpu_copy(p) for p in params],
        "state": [cpu_copy(dict(optimizer.state.get(p, {}))) for p in params],
        "param_groups": [cpu_copy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups],
        "traffic": dataclasses.asdict(optimizer.sync.traffic),
    }


def _copy_into_(held: dict[str, Any], served: Mapping[str, Any], device: torch.device) -> None:
    """``held`` made equal to ``served`` in place: a tensor of the same shape and dtype is copied into, a dict filled
    recursively (the same objects stay: the base optimizer's state is linked to its dict), anything else replaced (a
    new tensor goes to ``device``, a 0-d one, such as a step count, stays on the CPU), a key ``served`` lacks
    dropped."""
    for key in [key for key in held if key not in served and key != "params"]:
        del held[key]
    for key, value in served.items():
        mine = held.get(key)
        if torch.is_tensor(value) and torch.is_tensor(mine) and (mine.shape, mine.dtype) == (value.shape, value.dtype):
            local_tensor(mine).copy_(value)
        elif isinstance(value, Mapping) and isinstance(mine, dict):
            _copy_into_(mine, value, device)
        elif torch.is_tensor(value):
            held[key] = value.to(device) if value.dim() else value.clone()
        else:
            held[key] = cpu_copy(value)


@torch.no_grad()
def heal_from_(optimizer: Any, served: Mapping[str, Any]) -> None:
    """Make ``optimizer`` the live worker whose `served_state` ``served`` is, in place: the parameters, the state of
    each parameter, the param groups' values and the traffic are copied into the tensors and dicts it holds, so that
    every reference to them (the base optimizer's, an outer step under way, the caller's) stays valid. The served
    state must come from the same model and param groups (refused by name otherwise, before anything changes)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    mine = [tuple(p.shape) for p in params]
    theirs = [tuple(t.shape) for t in served["params"]]
    if mine != theirs or len(served["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"{optimizer.optimizer_name}: the state served to heal from holds {len(theirs)} parameters in "
            f"{len(served['param_groups'])} groups, this optimizer {len(mine)} in {len(optimizer.param_groups)}"
            f"{'' if len(mine) != len(theirs) else ' of other shapes'}: every worker must build the same model and "
            "param groups"
        )
    for p, value, state in zip(params, served["params"], served["state"]):
        local_tensor(p).copy_(value)
        if state or p in optimizer.state:
            _copy_into_(optimizer.state[p], state, local_tensor(p).device)
    for group, values in zip(optimizer.param_groups, served["param_groups"]):
        _copy_into_(group, values, torch.device("cpu"))
    for field in dataclasses.fields(OuterTraffic):
        setattr(optimizer.sync.traffic, field.name, served["traffic"][field.name])
