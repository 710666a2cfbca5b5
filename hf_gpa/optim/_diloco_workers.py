"""DiLoCo's workers across processes: the layout, its process groups, the outer step's collectives, the fragments.

W processes (a torch.distributed process group) run M workers (M divides W); each worker is an *island* of
S = W / M processes with contiguous group ranks (worker i: ranks [i S, (i + 1) S); with torchrun's rank order a node's
processes are contiguous, so an island can be a node). Each process belongs to two groups:

* its island (S processes), in which gradients are averaged every step, as DDP does: build DDP with
  ``process_group=layout.island_group``, or register `island_allreduce_hook` on a DDP built over all processes (as
  accelerate builds it);
* its *outer group* (M processes: the one at its own position in every island), in which the pseudo-gradients are
  averaged at each outer step. The processes of an island hold the same inner weights, so the S outer groups add the
  same M values in the same positions, each returns the same bits to its members, and no broadcast inside an island
  is needed. An all-reduce over all W processes divided by W would add each island's pseudo-gradient S times in some
  order and round differently from the average of the M workers.

The pseudo-gradients are summed by one all-reduce per (device, dtype) bucket (a flat buffer) and divided by M. Every
process receives the same bits from the collective, so the outer step leaves the same bits everywhere. Against an
average taken in a fixed order: with M = 2 the sum of 2 terms is the same in any order, and halving is exact, so
the average is bitwise the fixed-order one; with M > 2 the backend's order of the M additions may round differently
(the two sums differ by at most 2 (M - 1) u sum_i |p_i| per element, u the unit roundoff of the dtype). An all-gather
and a fixed-order sum would be bitwise for every M, but each process would receive M - 1 fragments instead of the
ring all-reduce's 2 (M - 1) / M: traffic is what DiLoCo exists to save.

The outer dtype (``outer_dtype``): "float32" sends the pseudo-gradient as it is (in the outer weights' dtype: float32
for fp32/bf16/fp16 parameters) in that all-reduce. "bfloat16" and "int8" compress it: each worker adds its residual
``e`` (the part of its earlier pseudo-gradients that compression lost, ``state["outer_residual"]``, float32, zero at
first) to its pseudo-gradient ``p``, sends ``c = C(p + e)`` and keeps ``e <- (p + e) - D(c)`` (error feedback), D the
dequantization. bfloat16: ``c`` is ``p + e`` rounded to bf16 (2 bytes an element). int8: the flat bucket is cut into
blocks of `INT8_BLOCK` = 256 elements (the last one shorter), each sent as int8 ``q = round((p + e) / s)`` with its
float32 scale ``s = max |p + e| / 127`` over the block (1 + 4 / 256 bytes an element): a block of 256 keeps one
outlier from coarsening more than 255 neighbours while its scale costs 1.6 % of the payload, and it does not depend on
the tensors' shapes (a bias, an embedding row, a fragment boundary alike). No int8 or bf16 sum can overflow or round:
the compressed values are dequantized and summed in float32, in the workers' order, which gloo and NCCL do without a
custom reduction, and gives the same bits on every process, equal to a fixed-order simulation, for every M:

* M <= `ALL_GATHER_WORKERS` (2): an *all-gather* of the M payloads, summed locally and divided by M. Each process sends
  its payload once, what a ring all-reduce sends of a float32 bucket at M = 2 (2 (M - 1) / M = 1 times it): b / 4 of
  float32's bytes for b bytes an element;
* M > 2: a *reduce-scatter of compressed chunks, then an all-gather of compressed averages*
  (`_compressed_reduce_scatter_all_gather`): the bucket is cut into M chunks (`chunk_numel`: n / M rounded up, for
  int8 to whole blocks), chunk j of every worker goes to worker j (one all-to-all), which sums the M chunks, divides
  by M, adds its *server residual* (``state["outer_server_residual"]``: error feedback of this second compression,
  kept where the worker's residual is) and compresses the average again; an all-gather hands every process the M
  compressed averages. Each process sends 2 (M - 1) chunks, 2 (M - 1) / M of its compressed bucket: b / 4 of
  float32's ring all-reduce for every M, where an all-gather would send M - 1 payloads (M b / 8 of float32's). At
  M = 2 both send the same bytes; the all-gather then needs one collective and one quantization instead of two.

Every process counts what it sends to the other workers (`OuterTraffic`: the outer steps taken and the bytes, as a ring
sends them: `outer_sent_bytes`; the same on every process), which the Trainer logs.

Streaming (P fragments): the parameters, in the order of the param groups, are split into P contiguous runs of about
equal size (each at least one tensor), and fragment k has its outer step at the inner steps t with
(t - k H // P) % H == 0, so that one outer all-reduce carries about 1/P of the model. P = 1 is plain DiLoCo.

Overlapped (``overlap_steps`` tau > 0, float32 only): `start_averaged_pseudo_gradients` takes the pseudo-gradients and
starts their all-reduces in the background (``async_op=True``); the optimizer calls its ``finish`` (wait, divide by
M) tau inner steps later. The same buckets, collective and division as `averaged_pseudo_gradients`: the same bits.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ._checks import check_num_fragments, check_num_workers
from ._types import DILOCO_LAYOUT

__all__ = [
    "ALL_GATHER_WORKERS",
    "INT8_BLOCK",
    "OUTER_DTYPES",
    "OuterTraffic",
    "WorkerLayout",
    "check_outer_dtype",
    "chunk_numel",
    "outer_payload_bytes",
    "outer_sent_bytes",
    "worker_layout",
    "island_allreduce_hook",
    "saved_diloco_layout",
    "start_averaged_pseudo_gradients",
    "fragment_of_each",
    "fragment_due",
]


#: The dtypes the pseudo-gradient may cross the workers in (``outer_dtype``, ``--diloco_outer_dtype``).
OUTER_DTYPES = ("float32", "bfloat16", "int8")
#: The elements of one int8 quantization block (one float32 scale each) of a flat bucket.
INT8_BLOCK = 256
#: Up to this many workers a compressed outer sync all-gathers the whole payloads (one quantization, one collective);
#: more reduce it chunk by chunk (`chunk_numel`), which sends 2 (M - 1) / M of the payload instead of M - 1 times it.
ALL_GATHER_WORKERS = 2


def check_outer_dtype(
    outer_dtype: Any,
    num_workers: int | None = None,
    fragment_numels: Sequence[int] | None = None,
    name: str = "outer_dtype",
    fragments_name: str = "num_fragments",
) -> str:
    """``outer_dtype`` one of `OUTER_DTYPES`; a compressed one only with more than one worker (``num_workers``, when
    known: a single worker sends nothing) and, for int8, with every fragment (``fragment_numels``, the elements of
    each, when known) at least one quantization block."""
    if outer_dtype not in OUTER_DTYPES:
        raise ValueError(f"Invalid {name}: {outer_dtype!r} (one of {', '.join(OUTER_DTYPES)})")
    if outer_dtype != "float32" and num_workers == 1:
        raise ValueError(
            f"Invalid {name}: {outer_dtype!r} with a single worker, which sends no pseudo-gradient to compress "
            "(more than one worker: DiLoCo across processes with num_workers > 1); leave it float32"
        )
    if outer_dtype == "int8" and fragment_numels and min(fragment_numels) < INT8_BLOCK:
        raise ValueError(
            f"Invalid {name}: 'int8' with {fragments_name} = {len(fragment_numels)}: a fragment holds "
            f"{min(fragment_numels)} elements, fewer than one int8 quantization block ({INT8_BLOCK}), whose float32 "
            f"scale would cost more than the compression saves. Use fewer {fragments_name}, or {name} bfloat16"
        )
    return outer_dtype


@dataclasses.dataclass
class OuterTraffic:
    """What the outer steps of this process sent so far: ``outer_steps`` (one per fragment synchronised; P = 1: one
    per H inner steps) and ``outer_bytes``, the bytes it sent to the other workers, as a ring sends them
    (`outer_sent_bytes`; the same on every process). Saved in the optimizer's state dict."""

    outer_steps: int = 0
    outer_bytes: int = 0


def outer_payload_bytes(numel: int, element_size: int, outer_dtype: str) -> int:
    """The payload of ``numel`` elements of ``element_size`` bytes (the outer weights' dtype) in ``outer_dtype``: the
    bytes of what `compress` makes of them (float32: the values as they are)."""
    if outer_dtype == "float32":
        return numel * element_size
    if outer_dtype == "bfloat16":
        return 2 * numel
    return numel + 4 * -(-numel // INT8_BLOCK)


def chunk_numel(numel: int, outer_dtype: str, num_workers: int) -> int:
    """The elements of each of the M chunks of a flat bucket of ``numel`` elements that more than
    `ALL_GATHER_WORKERS` workers reduce compressed: ``numel`` / M rounded up, for int8 to whole quantization blocks (a
    block never straddles two chunks; the chunks after the end are zeros)."""
    if outer_dtype == "int8":
        blocks = -(-numel // INT8_BLOCK)
        return -(-blocks // num_workers) * INT8_BLOCK
    return -(-numel // num_workers)


def outer_sent_bytes(numel: int, element_size: int, outer_dtype: str, num_workers: int) -> int:
    """The bytes one process sends to the other M - 1 workers to average a flat bucket of ``numel`` elements of
    ``element_size`` bytes in ``outer_dtype``, as a ring sends them: float32's all-reduce 2 (M - 1) / M of the
    bucket's bytes (rounded down); a compressed bucket, for M = 2, its payload once (the all-gather), for M > 2,
    2 (M - 1) chunk payloads (the all-to-all sends M - 1 chunks, the all-gather of the averaged chunks M - 1)."""
    m = num_workers
    if outer_dtype == "float32":
        return 2 * (m - 1) * numel * element_size // m
    if m <= ALL_GATHER_WORKERS:
        return (m - 1) * outer_payload_bytes(numel, element_size, outer_dtype)
    return 2 * (m - 1) * outer_payload_bytes(chunk_numel(numel, outer_dtype, m), element_size, outer_dtype)


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
    """Where a DiLoCo optimizer runs: ``world_size`` processes as ``num_workers`` islands, ``num_fragments``
    fragments, this process in island ``worker``; with its process groups once connected (`connected`).

    A single-worker DiLoCo has the layout (1, 1, P, 0) and no process groups. ``saved()`` is what a state dict
    records; ``check_saved`` refuses a state saved on another layout.
    """

    world_size: int = 1
    num_workers: int = 1
    num_fragments: int = 1
    worker: int = 0
    #: The dtype the pseudo-gradient crosses the workers in (`OUTER_DTYPES`); not part of the saved layout.
    outer_dtype: str = dataclasses.field(default="float32", compare=False)
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
        """What a state dict records of the layout (``state_dict()["param_groups"][i]["diloco_layout"]``)."""
        return {
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "num_fragments": self.num_fragments,
            "worker": self.worker,
        }

    def check_saved(self, saved: dict[str, Any], owner: str, names: Mapping[str, str] | None = None) -> None:
        """Refuse, by name, a state saved on another layout (another world size, M, P, or another worker's state).

        ``owner`` begins the message (``"DiLoCo.load_state_dict()"``); ``names`` gives world_size, num_workers or
        num_fragments the names the user knows them by (the flags that set them).
        """
        mine = self.saved()
        what = {
            "world_size": "the world size (processes)",
            "num_workers": "num_workers (M)",
            "num_fragments": "num_fragments (P)",
            **(names or {}),
        }
        for key, name in what.items():
            if saved.get(key) != mine[key]:
                raise ValueError(
                    f"{owner}: the state dict was saved with {name} = {saved.get(key)!r}, this "
                    f"optimizer runs with {mine[key]} ({_describe(saved)} against {_describe(mine)}). A DiLoCo state "
                    "resumes only on the layout that saved it; start a new run from the checkpoint's outer weights "
                    "(the model weights saved in eval mode) to change it"
                )
        if saved.get("worker") != mine["worker"]:
            raise ValueError(
                f"{owner}: the state dict holds worker {saved.get('worker')!r}'s inner weights and "
                f"inner optimizer state, this process is in worker {mine['worker']}: each process loads the state "
                "that a process of its own worker (island) saved"
            )

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
            timeout=_timeout(self.process_group),
            backend=dist.get_backend(self.process_group),
            use_local_synchronization=True,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> WorkerLayout:
        return self  # immutable, and its process groups belong to the run: a copy of the optimizer shares them

    def __getstate__(self) -> dict[str, Any]:
        if self.distributed:
            raise TypeError(
                "A DiLoCo across processes cannot be pickled: its process groups belong to this run. Save "
                "optimizer.state_dict() (and the model) instead"
            )
        return dict(self.__dict__)


def _describe(layout: dict[str, Any]) -> str:
    return (
        f"{layout.get('num_workers')!r} workers over {layout.get('world_size')!r} processes, "
        f"{layout.get('num_fragments')!r} fragments"
    )


def _timeout(group: Any) -> datetime.timedelta | None:
    """The collective timeout ``group`` was created with (None where the backend does not say)."""
    for device_type in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(torch.device(device_type)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def worker_layout(
    distributed: bool, process_group: Any, num_workers: Any, num_fragments: Any, outer_dtype: Any = "float32"
) -> WorkerLayout:
    """The layout DiLoCo's arguments ask for, checked (nothing is created or communicated here).

    ``distributed=False`` and no ``process_group``: one worker. ``distributed=True``: the processes of the default
    group, which must be more than one; ``process_group``: that group's processes (a group of one is one worker).
    """
    if not isinstance(distributed, bool):
        raise ValueError(f"Invalid distributed: {distributed!r} (must be True or False)")
    fragments = check_num_fragments(num_fragments)
    check_outer_dtype(outer_dtype)
    if not distributed and process_group is None:
        check_outer_dtype(outer_dtype, num_workers=1)
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
    check_outer_dtype(outer_dtype, num_workers=workers)
    worker = rank // (world_size // workers)
    return WorkerLayout(world_size, workers, fragments, worker, outer_dtype=outer_dtype, process_group=group)


def saved_diloco_layout(state_dict: dict[str, Any]) -> dict[str, int] | None:
    """The worker layout a DiLoCo state dict was saved on ({"world_size", "num_workers", "num_fragments",
    "worker"}), or None for a state saved by anything else."""
    groups = state_dict.get("param_groups") or [{}]
    layout = groups[0].get(DILOCO_LAYOUT)
    return None if layout is None else dict(layout)


# ---- the collectives ----


def _flat_buckets(like: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, list[int], list[torch.Tensor]]]:
    """One flat buffer per (device, dtype) of ``like``, in first-seen order (the same on every process for the same
    model), with the indices it serves and views of it shaped as those tensors."""
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


def broadcast_(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """Every process's ``tensors`` become those of the group's first process (one broadcast per bucket)."""
    import torch.distributed as dist

    for flat, idx, views in _flat_buckets(tensors):
        for i, view in zip(idx, views):
            view.copy_(tensors[i])
        dist.broadcast(flat, group_src=0, group=group)
        for i, view in zip(idx, views):
            tensors[i].copy_(view)


def averaged_pseudo_gradients(
    outers: Sequence[torch.Tensor],
    inners: Sequence[torch.Tensor],
    layout: WorkerLayout,
    residuals: Sequence[torch.Tensor] | None = None,
    traffic: OuterTraffic | None = None,
    server_residuals: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """outer - inner of each tensor, averaged over the M workers: one exchange per bucket in the outer group (the same
    bits on every process; see the module docstring for the rounding). In float32, summed by an all-reduce and
    divided by M; compressed (``layout.outer_dtype`` bfloat16 or int8), with each tensor's error-feedback
    ``residuals`` (updated in place) added before compression, then for M = 2 all-gathered and summed locally in the
    workers' order, for M > 2 reduced chunk by chunk (`_compressed_reduce_scatter_all_gather`, with this worker's
    ``server_residuals``, updated in place). The bytes this process sends to the other workers are added to
    ``traffic`` (`outer_sent_bytes`)."""
    import torch.distributed as dist

    averaged: list[torch.Tensor] = [outers[0]] * len(outers)
    for flat, idx, views in _flat_buckets(outers):
        for i, view in zip(idx, views):
            torch.sub(outers[i], inners[i], out=view)
            averaged[i] = view
        if layout.outer_dtype == "float32":
            dist.all_reduce(flat, group=layout.outer_group)
            flat.div_(layout.num_workers)
        else:
            assert residuals is not None, "a compressed outer all-reduce needs the residuals"
            for i, view in zip(idx, views):
                view.add_(residuals[i])  # p + e
            if layout.num_workers <= ALL_GATHER_WORKERS:
                payload, dequantized = compress(flat, layout.outer_dtype)
                gathered = [torch.empty_like(payload) for _ in range(layout.num_workers)]
                dist.all_gather(gathered, payload, group=layout.outer_group)
                total = decompress(gathered[0], flat, layout.outer_dtype)
                for other in gathered[1:]:
                    total.add_(decompress(other, flat, layout.outer_dtype))  # the workers' order, in the outer dtype
                total.div_(layout.num_workers)
            else:
                assert server_residuals is not None, "a compressed reduce-scatter needs the server residuals"
                servers = [server_residuals[i] for i in idx]
                dequantized, total = _compressed_reduce_scatter_all_gather(flat, servers, layout)
            for i, view, kept in zip(idx, views, _split_like(dequantized, views)):
                torch.sub(view, kept, out=residuals[i])  # e <- (p + e) - D(C(p + e))
            flat.copy_(total)
        if traffic is not None:
            traffic.outer_bytes += outer_sent_bytes(
                flat.numel(), flat.element_size(), layout.outer_dtype, layout.num_workers
            )
    return averaged


def _compressed_reduce_scatter_all_gather(
    values: torch.Tensor, servers: Sequence[torch.Tensor], layout: WorkerLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The average over the M > 2 workers of the flat ``values`` (p + e) of each, sent compressed in two stages: each
    worker cuts its ``values`` into M chunks of `chunk_numel` elements (zeros after the end), compresses each and sends
    chunk j to worker j (one all-to-all); worker j sums the M chunks it received, dequantized, in float (the workers'
    order), divides by M, adds its server residual for chunk j (``servers``: one per tensor of the bucket, the shape of
    the tensor, of which this worker uses the elements in its chunk), compresses that again, keeps what the second
    compression lost as its new server residual, and all-gathers the compressed averages, which every process
    dequantizes: the same bits everywhere. Returns (``values`` as this worker sent them, dequantized; the average)."""
    import torch.distributed as dist

    m, n, dtype = layout.num_workers, values.numel(), layout.outer_dtype
    me = dist.get_rank(layout.outer_group)  # the outer group's rank of a process is its worker
    c = chunk_numel(n, dtype, m)
    padded = values.new_zeros(m * c)
    padded[:n] = values
    chunks = padded.view(m, c)
    compressed = [compress(chunk, dtype) for chunk in chunks]
    sent = torch.stack([payload for payload, _ in compressed])
    dequantized = torch.cat([kept for _, kept in compressed])[:n]
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=layout.outer_group)
    mine = chunks[me]
    total = decompress(received[0], mine, dtype)
    for other in received[1:]:
        total.add_(decompress(other, mine, dtype))  # the workers' order, in the outer dtype
    total.div_(m)
    owned = list(_overlaps([s.numel() for s in servers], me * c, min((me + 1) * c, n)))
    for i, start, stop, at in owned:
        total[at : at + stop - start].add_(servers[i].view(-1)[start:stop])  # + the server residual
    payload, kept = compress(total, dtype)
    for i, start, stop, at in owned:
        torch.sub(total[at : at + stop - start], kept[at : at + stop - start], out=servers[i].view(-1)[start:stop])
    gathered = [torch.empty_like(payload) for _ in range(m)]
    dist.all_gather(gathered, payload, group=layout.outer_group)
    average = torch.cat([decompress(other, mine, dtype) for other in gathered])[:n]
    return dequantized, average


def _overlaps(numels: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """The elements [start, stop) of a flat bucket of tensors of ``numels`` elements, tensor by tensor: (the tensor,
    the first and end element within it, the position of the first within [start, stop))."""
    out, offset = [], 0
    for i, numel in enumerate(numels):
        lo, hi = max(start, offset), min(stop, offset + numel)
        if lo < hi:
            out.append((i, lo - offset, hi - offset, lo - start))
        offset += numel
    return out


def start_averaged_pseudo_gradients(
    outers: Sequence[torch.Tensor],
    inners: Sequence[torch.Tensor],
    layout: WorkerLayout,
    traffic: OuterTraffic | None = None,
) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """`averaged_pseudo_gradients` in float32, started in the background (an overlapped outer sync): the
    pseudo-gradients are taken now and their all-reduces started (``async_op=True``, one per bucket, in the same order
    on every process); returns the tensors that will hold the averages and ``finish``, which waits for the
    all-reduces and divides by M. The tensors hold the averages, bitwise those of `averaged_pseudo_gradients`, once
    ``finish()`` returned (call it once)."""
    import torch.distributed as dist

    assert layout.outer_dtype == "float32", "an overlapped outer sync sends float32"
    averaged: list[torch.Tensor] = [outers[0]] * len(outers)
    started = []
    for flat, idx, views in _flat_buckets(outers):
        for i, view in zip(idx, views):
            torch.sub(outers[i], inners[i], out=view)
            averaged[i] = view
        started.append((flat, dist.all_reduce(flat, group=layout.outer_group, async_op=True)))
        if traffic is not None:
            traffic.outer_bytes += outer_sent_bytes(flat.numel(), flat.element_size(), "float32", layout.num_workers)

    def finish() -> None:
        for flat, work in started:
            work.wait()
            flat.div_(layout.num_workers)

    return averaged, finish


def _split_like(flat: torch.Tensor, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for view in views:
        out.append(flat[offset : offset + view.numel()].view(view.shape))
        offset += view.numel()
    return out


def compress(values: torch.Tensor, outer_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, its dequantization) of a flat ``values`` in ``outer_dtype``: bfloat16, the values rounded; int8, a
    uint8 buffer of the int8 values of every block of `INT8_BLOCK` elements followed by their float32 scales (the
    bytes of ``outer_payload_bytes``)."""
    if outer_dtype == "bfloat16":
        payload = values.to(torch.bfloat16)
        return payload, payload.to(values.dtype)
    n = values.numel()
    blocks = _blocks(values)
    scales = blocks.abs().amax(dim=1).to(torch.float32) / 127
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).to(values.dtype)
    quantized = torch.round(blocks / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
    payload = torch.cat([quantized.view(-1)[:n].view(torch.uint8), scales.view(torch.uint8)])
    return payload, _dequantize(quantized, scales, values)


def decompress(payload: torch.Tensor, like: torch.Tensor, outer_dtype: str) -> torch.Tensor:
    """The values of a `compress` payload, in ``like``'s dtype and flat shape."""
    if outer_dtype == "bfloat16":
        return payload.to(like.dtype)
    n = like.numel()
    count = -(-n // INT8_BLOCK)
    quantized = torch.zeros(count * INT8_BLOCK, dtype=torch.int8, device=like.device)
    quantized[:n] = payload[:n].view(torch.int8)
    scales = payload[n:].clone().view(torch.float32)
    return _dequantize(quantized.view(count, INT8_BLOCK), scales, like)


def _blocks(values: torch.Tensor) -> torch.Tensor:
    """``values`` (flat) as rows of `INT8_BLOCK`, the last one padded with zeros."""
    n = values.numel()
    padded = values.new_zeros(-(-n // INT8_BLOCK) * INT8_BLOCK)
    padded[:n] = values
    return padded.view(-1, INT8_BLOCK)


def _dequantize(quantized: torch.Tensor, scales: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return (quantized.to(like.dtype) * scales.to(like.dtype)[:, None]).view(-1)[: like.numel()]


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


# ---- streaming: the fragments and their schedule ----


def fragment_of_each(numels: Sequence[int], num_fragments: int) -> list[int]:
    """The fragment (0 .. P - 1) of each tensor: P contiguous runs in the given order, each at least one tensor, a
    tensor going to the fragment in whose share (k/P to (k+1)/P of the total size) its middle lies."""
    total, n = sum(numels), len(numels)
    fragments, before, previous = [], 0, -1
    for i, size in enumerate(numels):
        # middle of the tensor, in fragments (integers: every process computes the same split)
        share = (2 * before + size) * num_fragments // (2 * total) if total else i * num_fragments // max(n, 1)
        fragment = min(max(share, previous, num_fragments - (n - i)), previous + 1, num_fragments - 1)
        fragments.append(fragment)
        before, previous = before + size, fragment
    return fragments


def fragment_due(fragment: int, inner_step: int, inner_steps: int, num_fragments: int) -> bool:
    """Whether fragment ``fragment`` takes its outer step after inner step ``inner_step`` (1, 2, ...): at the steps t
    with (t - offset) % H == 0, the offsets k H // P spread evenly over the period (fragment 0: t % H == 0)."""
    return (inner_step - fragment * inner_steps // num_fragments) % inner_steps == 0
