"""Which process is which: DiLoCo's workers across processes, their islands and process groups.

W processes (a torch.distributed process group) run M workers (M divides W); each worker is an *island* of
S = W / M processes with contiguous group ranks (worker i: ranks [i S, (i + 1) S); with torchrun's rank order a node's
processes are contiguous, so an island can be a node). Each process belongs to two groups:

* its island (S processes), in which gradients are averaged every step, as DDP does: build DDP with
  ``process_group=layout.island_group``, or register `island_allreduce_hook` on a DDP built over all processes (as
  accelerate builds it); FSDP2 inside the island shards over the island's 1-D mesh (`WorkerLayout.check_island_mesh`);
* its *outer group* (M processes: the one at its own position in every island), in which the pseudo-gradients are
  averaged at each outer step. The processes of an island hold the same inner weights (or shards), so the S outer
  groups add the same M values in the same positions and return the same bits to their members.

A single worker has the layout (1, 1, P, 0) and no process groups.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from typing import Any

import torch

from .._checks import check_num_fragments, check_num_workers
from .._tensors import is_dtensor, local_tensor

__all__ = [
    "WorkerLayout",
    "broadcast_",
    "collective_timeout",
    "flat_buckets",
    "island_allreduce_hook",
    "worker_layout",
]


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
    """Where a DiLoCo optimizer runs: ``world_size`` processes as ``num_workers`` islands, ``num_fragments``
    fragments, this process in island ``worker``; with its process groups once connected (`connect`). ``saved()`` is
    what a state dict records of it (``checkpoint``)."""

    world_size: int = 1
    num_workers: int = 1
    num_fragments: int = 1
    worker: int = 0
    #: The processes of the whole DiLoCo run (None: a single worker, no communication).
    process_group: Any = dataclasses.field(default=None, compare=False, repr=False)
    #: This process's island (all W processes when M = 1); None until connected.
    island_group: Any = dataclasses.field(default=None, compare=False, repr=False)
    #: One process of each island, this one included, for the pseudo-gradient all-reduce (None when M = 1).
    outer_group: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def distributed(self) -> bool:
        return self.process_group is not None

    @property
    def island_size(self) -> int:
        """S = W / M, the processes of one worker."""
        return self.world_size // self.num_workers

    def saved(self) -> dict[str, int]:
        """What every param group of a state dict records of the layout (``"diloco_layout"``): the same on every
        process, so that a checkpoint that keeps one copy of what is equal keeps it right. Which worker saved a state
        is in its per-parameter entries (``checkpoint``)."""
        return {"world_size": self.world_size, "num_workers": self.num_workers, "num_fragments": self.num_fragments}

    def island_ranks(self) -> list[int]:
        """The global ranks of this process's island, in island order (nothing is created or communicated)."""
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(self.process_group)  # global ranks, in group rank order
        size = self.island_size
        return ranks[self.worker * size : (self.worker + 1) * size]

    def check_island_mesh(self, param: torch.Tensor) -> None:
        """Refuse, by name, a DTensor parameter (FSDP2) whose device mesh is not this process's island: 1-D, the
        island's ranks in island order, so that the process at position i of every island holds the same shard and
        the outer group (position i of every island) averages like shards. Nothing is communicated."""
        mesh = param.device_mesh
        island = self.island_ranks()
        ranks = mesh.mesh.flatten().tolist()
        if mesh.ndim == 1 and ranks == island:
            return
        shape = "x".join(str(n) for n in mesh.mesh.shape)
        raise ValueError(
            f"Invalid params: a DTensor parameter (FSDP2) on a {mesh.ndim}-D device mesh of shape {shape} over ranks "
            f"{ranks}, which is not this process's island (worker {self.worker}: ranks {island}; num_workers = "
            f"{self.num_workers} islands of {self.island_size} processes). A DiLoCo across processes needs each "
            "island to shard its own model (the gradients averaged inside it every step, the pseudo-gradients "
            "across islands every H steps): mesh = init_device_mesh(device, (num_workers, world_size // "
            'num_workers), mesh_dim_names=("worker", "shard")); fully_shard(model, mesh=mesh["shard"]) (not a mesh '
            "over all processes, nor HSDP's 2-D mesh, which would all-reduce the gradients across islands every step)"
        )

    def connect(self) -> WorkerLayout:
        """This layout with its island and outer process groups (created by the member processes only)."""
        if not self.distributed or self.island_group is not None:
            return self
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(self.process_group)  # global ranks, in group rank order
        size, me = self.island_size, dist.get_rank(self.process_group)
        island = self.process_group if self.num_workers == 1 else self._subgroup(ranks[me - me % size :][:size])
        if self.num_workers == 1:
            outer = None
        elif size == 1:
            outer = self.process_group
        else:
            outer = self._subgroup(ranks[me % size :: size])
        return dataclasses.replace(self, island_group=island, outer_group=outer)

    def _subgroup(self, ranks: list[int]) -> Any:
        import torch.distributed as dist

        # Only the members create it (use_local_synchronization), with the parent's collective timeout and backend:
        # a process that fails or leaves makes the others fail within the timeout the run was started with.
        return dist.new_group(
            ranks,
            timeout=collective_timeout(self.process_group),
            backend=dist.get_backend(self.process_group),
            use_local_synchronization=True,
        )

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every process's ``tensors`` become the first worker's: whole tensors from the run's first process, DTensor
        shards (FSDP2 inside the islands) from the process at this process's position in the first island, which holds
        the same shard (none to send with one worker). Every process calls it with the same tensors."""
        if not self.distributed:
            return
        broadcast_([t for t in tensors if not is_dtensor(t)], self.process_group)
        if self.outer_group is not None:
            broadcast_([local_tensor(t) for t in tensors if is_dtensor(t)], self.outer_group)

    def __deepcopy__(self, memo: dict[int, Any]) -> WorkerLayout:
        return self  # immutable, and its process groups belong to the run: a copy of the optimizer shares them

    def __getstate__(self) -> dict[str, Any]:
        if self.distributed:
            raise TypeError(
                "A DiLoCo across processes cannot be pickled: its process groups belong to this run. Save "
                "optimizer.state_dict() (and the model) instead"
            )
        return dict(self.__dict__)


def collective_timeout(group: Any) -> datetime.timedelta | None:
    """The collective timeout ``group`` was created with (None where the backend does not say)."""
    for device_type in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(torch.device(device_type)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def worker_layout(distributed: bool, process_group: Any, num_workers: Any, num_fragments: Any) -> WorkerLayout:
    """The layout DiLoCo's arguments ask for, checked (nothing is created or communicated here).

    ``distributed=False`` and no ``process_group``: one worker. ``distributed=True``: the processes of the default
    group, which must be more than one; ``process_group``: that group's processes (a group of one is one worker).
    """
    if not isinstance(distributed, bool):
        raise ValueError(f"Invalid distributed: {distributed!r} (must be True or False)")
    fragments = check_num_fragments(num_fragments)
    if not distributed and process_group is None:
        if num_workers not in (None, 1):
            raise ValueError(
                f"Invalid num_workers: {num_workers!r} (more than one worker needs distributed=True, or a "
                "process_group, under accelerate launch or torchrun)"
            )
        return WorkerLayout(num_fragments=fragments)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "Invalid distributed: True (torch.distributed is not initialised: launch with accelerate launch or "
            "torchrun and build the Accelerator, or call torch.distributed.init_process_group(), before the "
            "optimizer)"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("Invalid process_group: this process is not a member of it")
    if process_group is None and world_size == 1:
        raise ValueError(
            "Invalid distributed: True on a single process (world size 1): there is no other worker to average "
            "with. Launch several processes (accelerate launch --num_processes N, torchrun --nproc_per_node N), or "
            "leave distributed=False for single-worker DiLoCo"
        )
    workers = world_size if num_workers is None else check_num_workers(num_workers, world_size)
    worker = rank // (world_size // workers)
    return WorkerLayout(world_size, workers, fragments, worker, process_group=group)


def broadcast_(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """Every process's ``tensors`` become those of the group's first process (one broadcast per (device, dtype)
    bucket)."""
    import torch.distributed as dist

    for flat, idx, views in flat_buckets(tensors):
        for i, view in zip(idx, views):
            view.copy_(tensors[i])
        dist.broadcast(flat, group_src=0, group=group)
        for i, view in zip(idx, views):
            tensors[i].copy_(view)


def flat_buckets(like: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, list[int], list[torch.Tensor]]]:
    """One flat buffer per (device, dtype) of ``like``, in first-seen order (the same on every process for the same
    model), with the indices it serves and views of it shaped as those tensors: one collective per buffer."""
    indices: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(like):
        indices.setdefault((t.device, t.dtype), []).append(i)
    buckets = []
    for (device, dtype), idx in indices.items():
        flat = torch.empty(sum(like[i].numel() for i in idx), device=device, dtype=dtype)
        views, offset = [], 0
        for i in idx:
            views.append(flat[offset : offset + like[i].numel()].view(like[i].shape))
            offset += like[i].numel()
        buckets.append((flat, idx, views))
    return buckets


def island_allreduce_hook(island_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages each gradient bucket over the processes of one island only.

    For a DDP model built over all processes (as accelerate builds it) under a distributed `DiLoCo`:
    ``ddp_model.register_comm_hook(optimizer.layout.island_group, island_allreduce_hook)`` before the first backward.
    No gradient then crosses islands; an island of one process sends nothing.
    """
    import torch.distributed as dist

    grads = bucket.buffer()
    size = island_group.size()
    if size == 1:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(grads)
        return done
    grads.div_(size)  # before the sum, as DDP does: exact for islands of 2, 4, 8, ... processes
    work = dist.all_reduce(grads, group=island_group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


if torch.distributed.is_available():
    # DDP's register_comm_hook compares a hook's annotations with these classes; this module's are strings.
    island_allreduce_hook.__annotations__.update(
        {"bucket": torch.distributed.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    )
