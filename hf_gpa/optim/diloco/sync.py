"""What crosses the wire: the outer sync, the one object that averages the workers' pseudo-gradients.

An outer algorithm (`DiLoCo`'s Nesterov step, `GPADiLoCo`'s primal averaging) hands the sync, for the parameters due,
the point each worker's inner steps started from (its *reference*: DiLoCo's outer weights, GPA's y) and the inner
weights; the sync takes the pseudo-gradients ``reference - inner`` and averages them over the M workers; the algorithm
then takes its outer step with the averages. How they cross is the sync's alone:

* **one worker**: nothing crosses; the pseudo-gradients are taken one at a time as the algorithm consumes them;
* **float32, blocking**: one all-reduce per (device, dtype) bucket (a flat buffer) over the outer group, divided by M.
  Every process receives the same bits, so the outer step leaves the same bits everywhere. With M = 2 the sum of 2
  terms is the same in any order and halving is exact, so the average is bitwise a fixed-order one; with M > 2 the
  backend's order may round differently (by at most 2 (M - 1) u sum_i |p_i| per element);
* **compressed** (``outer_dtype`` bfloat16 or int8): with error feedback, in ``compression``; the residuals are kept in
  the optimizer's per-parameter state (`OuterSync.state_keys`), created at zero at the first compressed sync, so that
  they are saved, loaded and cast with the rest of the state;
* **overlapped** (``overlap_steps`` tau > 0, float32, Douillard et al. 2025): the all-reduces are started in the
  background (``async_op=True``) and the algorithm applies their averages tau inner steps later (`OuterSync.ready`),
  mixing its new restart point into the inner weights that moved on meanwhile with weight ``overlap_alpha``.

Across processes the sync also makes every worker start from the first process's weights (`OuterSync.broadcast`), and
it counts what this process sent to the other workers (`OuterTraffic`, the bytes as a ring sends them), which the
Trainer logs. Which combinations it runs is ``rules``'; it checks them when it is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from .._state_layout import wide_dtype
from .._tensors import is_dtensor, local_tensor, shard_like
from .._types import OUTER_RESIDUAL, OUTER_SERVER_RESIDUAL
from . import rules
from .compression import ALL_GATHER_WORKERS, average_compressed, outer_sent_bytes
from .layout import WorkerLayout, flat_buckets

__all__ = ["OuterSync", "OuterTraffic", "PendingSync"]

#: (group, parameter) pairs whose outer step a sync serves, in the order of the groups.
Due = list[tuple[dict[str, Any], torch.Tensor]]


@dataclasses.dataclass
class OuterTraffic:
    """What the outer syncs of this process sent so far: ``outer_steps`` (one per sync: P = 1, one per H inner steps;
    streaming, one per fragment) and ``outer_bytes``, the bytes it sent to the other workers, as a ring sends them
    (`compression.outer_sent_bytes`; the same on every process)."""

    outer_steps: int = 0
    outer_bytes: int = 0


@dataclasses.dataclass
class PendingSync:
    """A sync started and not applied yet: the due (group, parameter) pairs, the averaged pseudo-gradients (once
    ``settle`` ran), and the inner steps left before the algorithm applies them."""

    due: Due
    pseudo_grads: Iterable[torch.Tensor]
    remaining: int
    finish: Callable[[], None] | None = None

    def settle(self) -> None:
        """Wait for the collectives (once)."""
        if self.finish is not None:
            self.finish()
            self.finish = None


class OuterSync:
    """How the pseudo-gradients of one optimizer cross its workers (see the module docstring).

    Built by the optimizer from its arguments, refused by name where it cannot run them (``rules``): the layout,
    ``outer_dtype``, ``overlap_steps`` (tau) and ``overlap_alpha``, for the outer ``algorithm`` (its class name).
    """

    def __init__(
        self,
        layout: WorkerLayout,
        outer_dtype: str = "float32",
        overlap_steps: int = 0,
        overlap_alpha: float = 0.0,
        algorithm: str = "DiLoCo",
    ) -> None:
        self.outer_dtype, self.overlap_steps, self.overlap_alpha = rules.check_sync(
            outer_dtype, overlap_steps, overlap_alpha, layout.num_workers, layout.num_fragments
        )
        self.layout = layout
        self.algorithm = algorithm
        self.traffic = OuterTraffic()
        self.pending: list[PendingSync] = []

    #: Why this kind of sync refuses a setting it does not run (``rules.check_given_sync``), by argument name.
    not_yet: dict[str, str] = {}

    def runs(self) -> dict[str, Any]:
        """What this sync runs, by the optimizers' argument names (``rules.SYNC_ARGUMENTS``): an optimizer given it
        (``sync=``) refuses an argument that says otherwise."""
        layout = self.layout
        return {
            "distributed": layout.distributed,
            "process_group": layout.process_group,
            "num_workers": layout.num_workers,
            "num_fragments": layout.num_fragments,
            "outer_dtype": self.outer_dtype,
            "overlap_steps": self.overlap_steps,
            "overlap_alpha": self.overlap_alpha,
        }

    def attach(self, optimizer: Any) -> None:
        """Called once by the optimizer this sync serves, at the end of its construction (nothing to do here; a sync
        that serves the optimizer's state to others, as torchft's does, takes it here)."""

    @property
    def num_workers(self) -> int:
        """M, the workers whose pseudo-gradients one sync averages (1: nothing crosses)."""
        return self.layout.num_workers if self.layout.outer_group is not None else 1

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The per-parameter state this sync keeps in the optimizer (in the outer weights' dtype): a compressed sync's
        error-feedback residuals (and, with more than `ALL_GATHER_WORKERS` workers, its server residuals)."""
        if self.outer_dtype == "float32":
            return ()
        if self.layout.num_workers > ALL_GATHER_WORKERS:
            return (OUTER_RESIDUAL, OUTER_SERVER_RESIDUAL)
        return (OUTER_RESIDUAL,)

    def check_group(self, inner_steps: int, params: Sequence[torch.Tensor]) -> None:
        """Refuse, by name, a param group this sync cannot serve: an overlap as long as H // P, DTensor parameters
        (FSDP2) with what the sync does not run on shards, or on another mesh than this process's island."""
        rules.check_period(self.overlap_steps, inner_steps, self.layout.num_fragments)
        shards = [p for p in params if is_dtensor(p)]
        if shards and self.layout.distributed:
            rules.check_shards(self.algorithm, self.outer_dtype, self.overlap_steps)
            for p in shards:
                self.layout.check_island_mesh(p)

    def broadcast(self, params: Sequence[torch.Tensor]) -> None:
        """Across processes, every worker starts from the first worker's weights (`WorkerLayout.broadcast`)."""
        self.layout.broadcast(params)

    def start(
        self, due: Due, references: list[torch.Tensor], inners: list[torch.Tensor], states: list[dict[str, Any]]
    ) -> None:
        """Take the pseudo-gradients ``references - inners`` of the ``due`` parameters (local tensors) now and start
        their average over the workers; the sync is pending until `ready` hands it back (blocking: at once). One
        outer step counted; ``states`` (the parameters' optimizer states) receive a compressed sync's residuals."""
        self.traffic.outer_steps += 1
        if self.layout.outer_group is None:  # one worker: nothing to send, taken as the algorithm consumes them
            grads: Iterable[torch.Tensor] = (ref - inner for ref, inner in zip(references, inners))
            self.pending.append(PendingSync(due, grads, 0))
            return
        averaged: list[torch.Tensor] = list(references)
        finishes = []
        for flat, idx, views in flat_buckets(references):
            for i, view in zip(idx, views):
                torch.sub(references[i], inners[i], out=view)
                averaged[i] = view
            finishes.append(self._average(flat, views, [states[i] for i in idx], [due[i][1] for i in idx]))
            self.traffic.outer_bytes += outer_sent_bytes(
                flat.numel(), flat.element_size(), self.outer_dtype, self.layout.num_workers
            )
        pending = PendingSync(due, averaged, self.overlap_steps, lambda: [finish() for finish in finishes])
        if not self.overlap_steps:
            pending.settle()
        self.pending.append(pending)

    def _average(
        self, flat: torch.Tensor, views: list[torch.Tensor], states: list[dict[str, Any]], params: list[torch.Tensor]
    ) -> Callable[[], None]:
        """Start averaging one bucket of pseudo-gradients over the outer group; returns what waits for it (float32
        overlapped: the all-reduce in the background; otherwise done already) and divides by M."""
        import torch.distributed as dist

        group, workers = self.layout.outer_group, self.layout.num_workers
        if self.outer_dtype == "float32":
            work = dist.all_reduce(flat, group=group, async_op=bool(self.overlap_steps))

            def finish() -> None:
                if work is not None:
                    work.wait()
                flat.div_(workers)

            return finish
        for state, view, p in zip(states, views, params):
            for key in self.state_keys:
                if key not in state:  # also a state saved without a server residual: zero
                    state[key] = shard_like(torch.zeros(view.shape, dtype=view.dtype, device=view.device), p)
        residuals = [local_tensor(state[OUTER_RESIDUAL]) for state in states]
        two_stage = len(self.state_keys) > 1
        servers = [local_tensor(state[OUTER_SERVER_RESIDUAL]) for state in states] if two_stage else None
        average_compressed(flat, residuals, servers, views, self.outer_dtype, group)
        return lambda: None

    def tick(self) -> None:
        """One inner step taken: one step less for every sync in flight."""
        for pending in self.pending:
            pending.remaining -= 1

    def ready(self, every: bool = False) -> Iterator[PendingSync]:
        """The pending syncs whose steps are over (``every``: all of them), oldest first, each waited for and taken
        off the list as it is handed out."""
        while self.pending and (every or self.pending[0].remaining <= 0):
            pending = self.pending.pop(0)
            pending.settle()
            yield pending

    def settle(self) -> None:
        """Wait for every sync in flight (their updates stay pending): before a state dict or a copy is taken."""
        for pending in self.pending:
            pending.settle()

    def bytes_per_period(self, params: Sequence[torch.Tensor], fragments: Sequence[int]) -> int:
        """The bytes this process sends to the other workers over one period of H inner steps (every fragment once),
        as `traffic` counts them: one bucket per fragment and dtype of the outer weights (0 for a single worker)."""
        if self.num_workers == 1:
            return 0
        buckets: dict[tuple[int, torch.dtype], list[int]] = {}
        for p, fragment in zip(params, fragments):
            if p.requires_grad:
                buckets.setdefault((fragment, wide_dtype(p.dtype)), []).append(local_tensor(p).numel())
        return sum(
            outer_sent_bytes(sum(numels), dtype.itemsize, self.outer_dtype, self.num_workers)
            for (_, dtype), numels in buckets.items()
        )

    def __getstate__(self) -> dict[str, Any]:
        self.settle()  # a copy gets the averaged pseudo-gradients, not the collectives in flight
        return dict(self.__dict__)
