"""DiLoCo (Step-K Nesterov outer optimizer): single-worker, the baseline GPA is measured against (paper, Algorithm 2),
and across processes (Douillard et al. 2023), in islands, streaming (Douillard et al. 2025).

The base optimizer takes H inner steps on the parameters (the inner weights); every H-th step the pseudo-gradient
p = outer - inner drives a Nesterov step of the outer weights, and the inner weights are reset to them:

    b <- mu b + p,      outer <- outer - outer_lr (mu b + p),      inner <- outer

This is the Nesterov form of the main text (eq. 10, PyTorch's ``SGD(nesterov=True)`` on the pseudo-gradient), in
which the look-ahead uses the updated buffer; Algorithm 2 in the appendix writes the old buffer in that line, which
we read as a typo since its own momentum update precedes it. The evaluation weights are the outer weights. State
per parameter: the outer weights and the outer momentum buffer (2 copies, float32 for bf16/fp16 parameters, as GPA
keeps z) plus the base's state.

Across processes, each of M workers takes its inner steps on its own data and p is the average of the M workers'
pseudo-gradients, so that the outer weights stay the same bits on every process; the processes, islands, collectives
and fragments are ``_diloco_workers``' affair.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ._base import saved_optimizer_name
from ._checks import check_diloco, check_num_fragments, check_overlap
from ._diloco_workers import (
    ALL_GATHER_WORKERS,
    OuterTraffic,
    WorkerLayout,
    averaged_pseudo_gradients,
    broadcast_,
    check_outer_dtype,
    fragment_due,
    fragment_of_each,
    outer_sent_bytes,
    saved_diloco_layout,
    start_averaged_pseudo_gradients,
    worker_layout,
)
from ._state_layout import HALF_DTYPES, diloco_residual, diloco_state, held_through_half, wide_dtype
from ._tensors import authoritative_y, bits_differ, is_dtensor, local_tensor, shard_like
from ._types import (
    DEFAULT_INNER_STEPS,
    DEFAULT_NUM_FRAGMENTS,
    DEFAULT_OUTER_MOMENTUM,
    DILOCO_LAYOUT,
    INNER,
    INNER_FP32,
    INNER_STEP,
    INNER_STEPS,
    OUTER,
    OUTER_LR,
    OUTER_MOMENTUM,
    OUTER_MOMENTUM_BUFFER,
    OUTER_RESIDUAL,
    OUTER_SERVER_RESIDUAL,
    TRAIN_MODE,
    default_outer_lr,
)
from ._wrapper import BaseOptimizerWrapper

__all__ = ["DiLoCo"]

#: The state dict's entry for `OuterTraffic` (outer steps taken, bytes sent between workers).
OUTER_TRAFFIC = "diloco_outer_traffic"
#: The state dict's entry for the overlapped outer syncs not applied yet (``overlap_steps`` > 0).
PENDING_SYNCS = "diloco_pending_syncs"


@dataclasses.dataclass
class _PendingSync:
    """An overlapped outer sync: the due (group, parameter) pairs, the tensors that hold (or will hold, once
    ``finish`` ran) their averaged pseudo-gradients, and the inner steps left before its outer update."""

    due: list[tuple[dict[str, Any], torch.Tensor]]
    pseudo_grads: list[torch.Tensor]
    remaining: int
    finish: Callable[[], None] | None

    def settle(self) -> None:
        """Wait for the all-reduces (once)."""
        if self.finish is not None:
            self.finish()
            self.finish = None


class DiLoCo(BaseOptimizerWrapper):
    r"""DiLoCo / Step-K Nesterov around a base optimizer: single-worker (paper, Algorithm 2) or across processes.

    .. math::
        \begin{aligned}
            & x_{t+1} = \mathrm{base}(x_t, \nabla f(x_t)) \quad \text{(inner step, with the base's weight decay)} \\
            & \text{if } t \bmod H = 0: \quad p = \tfrac{1}{M} \textstyle\sum_{m=1}^{M} (\tilde x - x^{(m)}_{t+1}),
              \quad b \leftarrow \mu b + p, \quad
              \tilde x \leftarrow \tilde x - \tilde\gamma (\mu b + p), \quad x_{t+1} \leftarrow \tilde x
        \end{aligned}

    with one worker (M = 1) by default. ``eval()`` puts the outer weights :math:`\tilde x` into the parameters and
    ``train()`` restores the inner weights bitwise. For fp32/fp64 parameters the two are exchanged (``state["outer"]``
    holds the inner weights while in eval mode, no extra memory). bf16/fp16 parameters keep their state in float32, as
    GPA does: the outer weights, the outer momentum and the inner weights (``state["inner_fp32"]``, which the base
    steps, its own state then float32 too; the parameter holds it rounded and stays authoritative: a parameter
    written by something else wins). Stepping bf16 inner weights would lose the updates smaller than their rounding,
    and every outer step would take the rounding for a move (least squares in bf16, cosine, 600 steps, H = 8: loss
    0.177 at the outer weights against 0.0025 in fp32; with float32 state it is the fp32 run's). In eval mode the
    parameters hold the outer weights rounded; where they were written there, the written value becomes the outer
    weights.

    **Across processes** (``distributed=True``, or a ``process_group``): the W processes run M workers, each an
    island of W / M processes with contiguous ranks (``layout``). A worker's inner weights and inner optimizer state
    stay on its processes; the processes of an island average their gradients every step (DDP with
    ``process_group=optimizer.layout.island_group``, or `island_allreduce_hook` on a DDP over all processes; with
    M = W no DDP is needed); at each outer step the pseudo-gradients are averaged over the M workers by one all-reduce
    and every process takes the same Nesterov step, so the outer weights are the same bits everywhere. At
    construction the parameters are broadcast from the group's first process (every worker starts from the same
    outer weights) and the outer state is created for every parameter that requires a gradient, so that every
    process takes part in every outer all-reduce; a parameter that requires a gradient and has none (unfrozen later,
    or after ``state.clear()``, done alike on every process) gets it at the next step the same way, on every process.
    Every process must call ``step()`` equally often. FSDP2 inside each island: DTensor parameters sharded over the
    island's processes only (``fully_shard(model, mesh=mesh["shard"])`` of a ("worker", "shard") mesh of shape
    (M, W / M)), whose reduce-scatter averages the island's gradients; each process keeps the outer weights and
    momentum of its own shards, which its outer group (the same shard in every island) averages, and the shards are
    broadcast from the first island at construction. A DTensor on any other mesh (all processes, HSDP's 2-D mesh,
    other ranks) is refused by name before anything is communicated, as are a compressed ``outer_dtype`` and an
    overlap with them (not supported on shards yet).

    **Streaming** (``num_fragments`` = P > 1, Douillard et al. 2025): the parameters (in the order of the groups) are
    split into P contiguous fragments of about equal size, and fragment k takes its outer step at the inner steps t
    with (t - k H // P) % H == 0, so one outer all-reduce carries about 1/P of the model. The outer weights that
    ``eval()`` shows are then each fragment's as of its last outer step (fragments up to H - 1 steps apart).

    **Overlap** (``overlap_steps`` = tau > 0, Douillard et al. 2025): when fragment k is due at inner step t, its
    pseudo-gradient outer - inner is taken and its all-reduce started in the background (``async_op=True``), and
    ``step()`` returns; after inner step t + tau, ``step()`` waits for it, takes the Nesterov step of the fragment's
    outer weights with the averaged pseudo-gradient, and mixes the new outer weights into the fragment's inner
    weights, which moved on for tau steps meanwhile:

        inner <- alpha inner + (1 - alpha) outer      (alpha = ``overlap_alpha``; alpha = 0: inner <- outer)

    (computed as ``inner * alpha + outer * (1 - alpha)``; alpha = 0 copies the outer weights, as at tau = 0). The
    updates due after the same inner step are applied before the syncs due then are started. tau = 0 is the blocking
    sync, bitwise. ``state_dict()`` waits for the syncs in flight and saves their averaged pseudo-gradients and the
    inner steps left before their updates (``"diloco_pending_syncs"``), which its load restores: a resume is bitwise.

    A state dict records the layout (world size, M, P, and this process's worker) in its param groups; loading it on
    another layout raises a ``ValueError`` naming what differs, before anything changes. Each process saves and loads
    its own state: in eval mode the parameters hold the outer weights (the same on every process: save the model
    once) and ``state["outer"]`` this worker's inner weights, beside the outer momentum and the base's state. Taken in
    train mode with M > 1, it holds this worker's inner weights (``state["inner"]``), which its load puts into the
    parameters.

    As a wrapper of its base it behaves like `GPA` (see ``_wrapper``): ``add_param_group`` at any time,
    ``copy.deepcopy``/``pickle`` round trips (a copy across processes shares the process groups; pickling one
    raises), step hooks that fire once per ``DiLoCo.step()``, a step whose base raises before changing its state
    leaves parameters and state as they were (no copy needed: DiLoCo changes nothing before its base steps), and a
    state dict saved by the base class itself is adopted (the run continues as DiLoCo's inner optimizer, with the
    current weights as the first outer weights). Complex parameters follow the base.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        base: the inner optimizer class (default: ``torch.optim.AdamW``).
        inner_steps: H, the number of inner steps between outer steps (default: 32).
        outer_lr: the outer learning rate :math:`\tilde\gamma` (default: 0.7 for one worker, 0.6 across workers, as
            measured in DiLoCo's regime: docs/distributed.md).
        outer_momentum: the outer Nesterov momentum :math:`\mu` in [0, 1) (default: 0.9).
        distributed: run across the processes of torch.distributed's default group, which must be more than one
            (default: False, a single worker that communicates nothing).
        process_group: run across the processes of this group instead (implies ``distributed``; a group of one
            process is a single worker) (default: None).
        num_workers: M, which divides the world size W; each worker is an island of W / M processes (default: None,
            every process a worker; 1: plain data parallelism around single-worker DiLoCo).
        num_fragments: P, the fragments of streaming DiLoCo, at most the number of parameter tensors and at most H
            (default: 1, plain DiLoCo).
        outer_dtype: the dtype the pseudo-gradients cross the workers in: "float32" (default: as they are),
            "bfloat16" or "int8" (a float32 scale per block of 256 elements), both with error feedback (the residual
            of the compression, ``state["outer_residual"]``, is added to the next pseudo-gradient); with more than 2
            workers, reduced chunk by chunk and the averages compressed again, with error feedback too
            (``state["outer_server_residual"]``); compressed ones need more than one worker, and int8 fragments of at
            least 256 elements. See ``_diloco_workers``.
        overlap_steps: tau, streaming DiLoCo's overlap (default: 0, none): a fragment's all-reduce is started in the
            background when it is due and its outer update applied tau inner steps later. Needs more than one worker,
            P > 1 fragments, tau < H // P and the float32 ``outer_dtype``. See **Overlap** above.
        overlap_alpha: alpha in [0, 1], the weight of the inner weights that moved on during an overlapped sync in
            the mixing (default: 0, they are replaced by the new outer weights); only with ``overlap_steps`` > 0.
        **base_kwargs: the base optimizer's own arguments (lr, betas, weight_decay, ...).

    Papers: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023);
    Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch" (2025).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        base: type[torch.optim.Optimizer] = torch.optim.AdamW,
        inner_steps: int = DEFAULT_INNER_STEPS,
        outer_lr: float | None = None,
        outer_momentum: float = DEFAULT_OUTER_MOMENTUM,
        *,
        distributed: bool = False,
        process_group: Any = None,
        num_workers: int | None = None,
        num_fragments: int = DEFAULT_NUM_FRAGMENTS,
        outer_dtype: str = "float32",
        overlap_steps: int = 0,
        overlap_alpha: float = 0.0,
        **base_kwargs: Any,
    ) -> None:
        # Every argument is checked before anything is created or communicated: the layout's, the wrapper's and the
        # base's values (super().__init__), P against the tensors; only then are the process groups created and the
        # weights broadcast.
        self.layout: WorkerLayout = worker_layout(distributed, process_group, num_workers, num_fragments, outer_dtype)
        self.overlap_steps, self.overlap_alpha = check_overlap(
            overlap_steps, overlap_alpha, self.layout.num_fragments, outer_dtype=outer_dtype
        )
        if self.overlap_steps and self.layout.num_workers == 1:
            raise ValueError(
                f"Invalid overlap_steps: {overlap_steps!r} with a single worker, which sends no pseudo-gradient to "
                "overlap (more than one worker: DiLoCo across processes with num_workers > 1); leave it 0"
            )
        if outer_lr is None:
            outer_lr = self._default_outer_lr(self.layout.num_workers)
        self._pending: list[_PendingSync] = []
        self._fragments: list[int] = []
        self.outer_traffic = OuterTraffic()
        defaults = dict(inner_steps=inner_steps, outer_lr=outer_lr, outer_momentum=outer_momentum, inner_step=0)
        super().__init__(params, base, base_kwargs, defaults)
        check_num_fragments(num_fragments, num_tensors=len(self._all_params()))
        check_outer_dtype(outer_dtype, self.layout.num_workers, self._fragment_numels())
        self.layout = self.layout.connect()
        self._distribute(self._all_params())

    def _default_outer_lr(self, num_workers: int) -> float:
        """The outer lr an unset ``outer_lr`` takes (`_types.default_outer_lr`)."""
        return default_outer_lr(num_workers)

    def _check_own(self, values: dict[str, Any]) -> None:
        check_diloco(values[INNER_STEPS], values[OUTER_LR], values[OUTER_MOMENTUM])
        check_num_fragments(self.layout.num_fragments, inner_steps=values[INNER_STEPS])
        check_overlap(self.overlap_steps, self.overlap_alpha, self.layout.num_fragments, values[INNER_STEPS])
        dtensors = [p for p in values.get("params", ()) if is_dtensor(p)]
        if self.layout.distributed and dtensors:
            self._check_island_shards(dtensors)

    #: Whether DTensor parameters sharded inside each island (FSDP2 over the island's processes) are taken across
    #: processes; a subclass whose outer step is not verified on shards refuses them.
    _island_shards = True

    def _check_island_shards(self, dtensors: list[torch.Tensor]) -> None:
        """Across processes: DTensor parameters (FSDP2) only on this process's island mesh (`WorkerLayout`'s
        ``check_island_mesh``), with the float32 blocking outer sync; refused by name, before any communication."""
        name = type(self).__name__
        if not self._island_shards:
            raise ValueError(
                f"Invalid params: DTensor parameters (FSDP2, tensor parallelism) with a {name} across processes "
                "(not supported yet); use distributed=False under FSDP2, or DDP"
            )
        if self.layout.outer_dtype != "float32":
            raise ValueError(
                f"Invalid outer_dtype: {self.layout.outer_dtype!r} with DTensor parameters (FSDP2 inside the "
                "islands): the compressed outer sync is not supported on shards yet; leave it float32"
            )
        if self.overlap_steps:
            raise ValueError(
                f"Invalid overlap_steps: {self.overlap_steps!r} with DTensor parameters (FSDP2 inside the islands): "
                "the overlapped outer sync is not supported on shards yet; leave it 0"
            )
        for p in dtensors:
            self.layout.check_island_mesh(p)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (checked like the constructor's); across processes, its parameters are broadcast from the
        group's first process and get their outer state now, as the constructor's do."""
        super().add_param_group(param_group)
        if self.layout.island_group is not None:  # connected: a group added after the constructor
            self._distribute(self.param_groups[-1]["params"])

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def _distribute(self, params: list[torch.Tensor]) -> None:
        """Across processes: every worker starts from the first process's weights, and every parameter that takes a
        gradient has its outer state now, so that each outer all-reduce has the same tensors on every process."""
        if not self.layout.distributed:
            return
        # Whole tensors from the group's first process; DTensor shards (FSDP2 inside the island) from the process at
        # this process's position in the first island, which holds the same shard (none to send with one worker).
        broadcast_([p for p in params if not is_dtensor(p)], self.layout.process_group)
        if self.layout.outer_group is not None:
            broadcast_([local_tensor(p) for p in params if is_dtensor(p)], self.layout.outer_group)
        for p in params:
            if p.requires_grad:
                self._init_outer(p)

    def _agree_on_outer(self) -> None:
        """Across processes: the parameters that take a gradient and have no outer state (unfrozen after construction,
        or their state cleared: ``state.clear()`` on every process) get it on every process at once, from the first
        process's weights, as the constructor's do. Which ones is decided from ``requires_grad`` and the state alone,
        the same on every process, never from a gradient that some processes have and others not; each worker's own
        weights would make outer weights that differ between processes."""
        if self.layout.distributed:
            missing = [p for p in self._all_params() if p.requires_grad and OUTER not in self.state.get(p, ())]
            if missing:
                self._distribute(missing)

    def _create_state(self) -> None:
        self._agree_on_outer()  # across processes, the outer weights of init_state() are agreed on too
        super()._create_state()

    def _fragment_of_each(self) -> list[int]:
        """The fragment of each parameter, in the order of the groups (computed again once a group was added)."""
        if len(self._fragments) != len(self._all_params()):
            numels = [p.numel() for p in self._all_params()]
            self._fragments = fragment_of_each(numels, self.layout.num_fragments)
        return self._fragments

    def _fragment_numels(self) -> list[int]:
        """The elements of each fragment."""
        numels = [0] * self.layout.num_fragments
        for p, fragment in zip(self._all_params(), self._fragment_of_each()):
            numels[fragment] += local_tensor(p).numel()
        return numels

    def outer_bytes_per_period(self) -> int:
        """The bytes this process sends to the other workers over one period of H inner steps (every fragment
        once), as counted in ``outer_traffic``: one bucket per fragment and dtype of the outer weights (0 for a
        single worker)."""
        if self.layout.outer_group is None:
            return 0
        buckets: dict[tuple[int, torch.dtype], list[int]] = {}
        for p, fragment in zip(self._all_params(), self._fragment_of_each()):
            if p.requires_grad:
                buckets.setdefault((fragment, wide_dtype(p.dtype)), []).append(local_tensor(p).numel())
        return sum(
            outer_sent_bytes(sum(numels), dtype.itemsize, self.layout.outer_dtype, self.layout.num_workers)
            for (_, dtype), numels in buckets.items()
        )

    def _base_tensor(self, p: torch.Tensor, create: bool = False) -> torch.Tensor | None:
        # The base moves the inner weights, once they have a gradient: the parameters themselves, or for bf16/fp16
        # parameters their float32 copy (see ``_inner``). ``create`` (an adopted state, whose parameters have no
        # gradient yet; ``init_state``) starts their state now, so the base is built on them and receives the state.
        if create or p.grad is not None:
            self._init_outer(p)
        return self._inner(p) if p in self.state else None

    def _inner(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor holding the inner weights: ``state["inner_fp32"]`` for bf16/fp16 parameters, else ``p``."""
        return self.state[p].get(INNER_FP32, p)

    def _init_outer(self, p: torch.Tensor) -> None:
        """The outer weights (the current weights) and a zero outer momentum in the state dtype (float32 for
        bf16/fp16 parameters, which also get their inner weights in float32)."""
        state = self.state[p]
        if OUTER not in state:
            state.update(diloco_state(p))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; every ``inner_steps``-th call also takes the outer Nesterov step."""
        loss = self._closure_loss(closure)
        self._agree_on_outer()
        copies = []  # (parameter, its float32 inner weights) of bf16/fp16 parameters with a gradient
        try:
            with self._rollback_on_error():
                self._prepare_base()
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        self._init_outer(p)
                        inner = self._inner(p)
                        if inner is not p:
                            # The parameter is authoritative: where something wrote it, the inner weights take it.
                            local = local_tensor(inner)
                            local.copy_(authoritative_y(local_tensor(p), local, local.dtype))
                            inner.grad = p.grad.to(inner.dtype)
                            copies.append((p, inner))
                self._base_step()
        finally:
            for _, inner in copies:
                inner.grad = None
        for p, inner in copies:
            local_tensor(p).copy_(local_tensor(inner))
        for group in self.param_groups:
            group[INNER_STEP] += 1
        self._apply_pending()
        self._outer_step(self._due())
        return loss

    def _apply_pending(self) -> None:
        """Overlap: one inner step less for every sync in flight; the outer updates of those whose tau steps are
        over are applied now, in the order they were started."""
        for pending in self._pending:
            pending.remaining -= 1
        self._apply_oldest_syncs(every=False)

    def _apply_oldest_syncs(self, every: bool) -> None:
        """Wait for and apply, in the order they were started, the syncs in flight whose tau steps are over (or
        ``every`` one of them)."""
        while self._pending and (every or self._pending[0].remaining <= 0):
            pending = self._pending.pop(0)
            pending.settle()
            self._outer_update(pending.due, pending.pseudo_grads)

    @torch.no_grad()
    def apply_syncs_in_flight(self) -> None:
        """Overlap: wait for every sync in flight and apply its outer update now, in the order they were started,
        ahead of its tau steps: for the end of training, where no later step would apply it (`GPATrainer` calls it
        then). The outer weights then hold every pseudo-gradient the workers sent. Collective (every process calls
        it); in eval mode it switches to train mode for the updates and back."""
        if not self._pending:
            return
        in_eval = not all(group[TRAIN_MODE] for group in self.param_groups)
        if in_eval:
            self.train()
        self._apply_oldest_syncs(every=True)
        if in_eval:
            self.eval()

    def _settle_pending(self) -> None:
        """Wait for every sync in flight (their updates stay pending)."""
        for pending in self._pending:
            pending.settle()

    def _due(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """(group, parameter) of the parameters with outer weights whose fragment takes its outer step now (P = 1:
        all of them every H-th step), in the order of the groups: the same list on every process."""
        fragments, due, position = self._fragment_of_each(), [], 0
        num_fragments = self.layout.num_fragments
        for group in self.param_groups:
            step, period = group[INNER_STEP], group[INNER_STEPS]
            for p in group["params"]:
                if fragment_due(fragments[position], step, period, num_fragments) and OUTER in self.state.get(p, ()):
                    due.append((group, p))
                position += 1
        return due

    def _outer_step(self, due: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        if not due:
            return
        inners = [local_tensor(self._inner(p)) for _, p in due]
        outers = [local_tensor(self.state[p][OUTER]) for _, p in due]
        if self.overlap_steps:
            self.outer_traffic.outer_steps += 1
            averaged, finish = start_averaged_pseudo_gradients(outers, inners, self.layout, self.outer_traffic)
            self._pending.append(_PendingSync(due, averaged, self.overlap_steps, finish))
            return
        self._outer_update(due, self._pseudo_gradients(outers, inners, [p for _, p in due]))

    def _outer_update(
        self, due: list[tuple[dict[str, Any], torch.Tensor]], pseudo_grads: Iterable[torch.Tensor]
    ) -> None:
        """The Nesterov step of the due parameters' outer weights with their averaged pseudo-gradients, and the inner
        weights reset to the new outer weights (alpha = 0) or mixed with them."""
        alpha = self.overlap_alpha
        inners = [local_tensor(self._inner(p)) for _, p in due]
        outers = [local_tensor(self.state[p][OUTER]) for _, p in due]
        for (group, p), inner, outer, pseudo_grad in zip(due, inners, outers, pseudo_grads):
            # pseudo_grad: in the outer weights' dtype (float32 for bf16/fp16 parameters)
            mu, outer_lr, buf = (
                group[OUTER_MOMENTUM],
                group[OUTER_LR],
                local_tensor(self.state[p][OUTER_MOMENTUM_BUFFER]),
            )
            buf.mul_(mu).add_(pseudo_grad)
            outer.sub_(pseudo_grad.add_(buf, alpha=mu), alpha=outer_lr)
            if alpha == 0.0:
                inner.copy_(outer)
            else:
                inner.mul_(alpha).add_(outer, alpha=1.0 - alpha)
            if inner is not local_tensor(p):
                local_tensor(p).copy_(inner)

    def _pseudo_gradients(
        self, outers: list[torch.Tensor], inners: list[torch.Tensor], params: list[torch.Tensor] | None = None
    ) -> Iterable[torch.Tensor]:
        """outer - inner of each tensor, averaged over the workers: one at a time for a single worker (nothing to
        communicate), else all at once in the flat buffers of the collectives (with the error-feedback residuals of
        a compressed outer dtype, created at zero, for which the ``params`` are needed). One outer step counted."""
        self.outer_traffic.outer_steps += 1
        if self.layout.outer_group is None:
            return (outer - inner for outer, inner in zip(outers, inners))
        residuals = servers = None
        if self.layout.outer_dtype != "float32":
            assert params is not None, "a compressed outer all-reduce keeps a residual per parameter"
            two_stage = self.layout.num_workers > ALL_GATHER_WORKERS
            for p, outer in zip(params, outers):
                for key in (OUTER_RESIDUAL, OUTER_SERVER_RESIDUAL) if two_stage else (OUTER_RESIDUAL,):
                    if key not in self.state[p]:  # also a state saved without a server residual: zero
                        self.state[p][key] = diloco_residual(outer, p)
            residuals = [local_tensor(self.state[p][OUTER_RESIDUAL]) for p in params]
            if two_stage:
                servers = [local_tensor(self.state[p][OUTER_SERVER_RESIDUAL]) for p in params]
        return averaged_pseudo_gradients(outers, inners, self.layout, residuals, self.outer_traffic, servers)

    # ---- the layout in the state dict ----

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with the worker layout recorded in each param group (``"diloco_layout"``) and, across
        processes, ``outer_traffic`` (``"diloco_outer_traffic"``: a resume counts on).

        Taken in train mode across M > 1 workers, it also holds this worker's inner weights (``"inner"``: the
        parameters, which differ between workers; bf16/fp16 parameters have them in ``"inner_fp32"``), which its load
        puts back into the parameters: the model saved by one process and every process's state resume every worker,
        as under DDP."""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            group[DILOCO_LAYOUT] = self.layout.saved()
        if self._pending:  # overlapped syncs in flight: waited for, saved with the steps left before their updates
            self._settle_pending()
            index = {id(p): i for i, p in enumerate(self._all_params())}
            state_dict[PENDING_SYNCS] = [
                {
                    "remaining": pending.remaining,
                    "params": [index[id(p)] for _, p in pending.due],
                    "pseudo_gradients": [g.clone() for g in pending.pseudo_grads],
                }
                for pending in self._pending
            ]
        if self.layout.distributed:  # what crossed the workers so far (a single worker sends nothing)
            state_dict[OUTER_TRAFFIC] = dataclasses.asdict(self.outer_traffic)
        if self._own_inner_weights():
            for index, p in enumerate(self._all_params()):
                state = self.state.get(p)
                if state and OUTER in state and INNER_FP32 not in state:
                    state_dict["state"][index] = {**state_dict["state"][index], INNER: p.detach()}
        return state_dict

    def _own_inner_weights(self) -> bool:
        """Whether the parameters hold inner weights of this worker's own (train mode, M > 1 workers)."""
        return self.layout.num_workers > 1 and self.train_mode

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved on this layout (world size, M, P, worker); another layout raises a ``ValueError`` naming
        what differs, before anything changes. A DiLoCo state that records no layout is a single worker's, P = 1."""
        saved = saved_diloco_layout(state_dict)
        if saved is None and saved_optimizer_name(state_dict) == self.optimizer_name:
            saved = WorkerLayout().saved()
        if saved is not None:
            self.layout.check_saved(saved, f"{self.optimizer_name}.load_state_dict()")
        groups = [{k: v for k, v in group.items() if k != DILOCO_LAYOUT} for group in state_dict["param_groups"]]
        traffic, pending = state_dict.get(OUTER_TRAFFIC), state_dict.get(PENDING_SYNCS, [])
        state_dict = {k: v for k, v in state_dict.items() if k not in (OUTER_TRAFFIC, PENDING_SYNCS)}
        super().load_state_dict({**state_dict, "param_groups": groups})
        self.outer_traffic = OuterTraffic(**traffic) if traffic is not None else OuterTraffic()
        params, group_of = self._all_params(), {id(p): g for g in self.param_groups for p in g["params"]}
        self._pending = []
        for saved_sync in pending:
            due = [(group_of[id(params[i])], params[i]) for i in saved_sync["params"]]
            grads = [
                g.to(device=local_tensor(self.state[p][OUTER]).device, copy=True)
                for (_, p), g in zip(due, saved_sync["pseudo_gradients"])
            ]
            self._pending.append(_PendingSync(due, grads, int(saved_sync["remaining"]), None))
        if self._own_inner_weights():  # a state taken in train mode: the parameters take this worker's inner weights
            with torch.no_grad():
                for p in self._all_params():
                    state = self.state.get(p, {})
                    inner = state.pop(INNER, state.get(INNER_FP32))
                    if inner is not None:
                        local_tensor(p).copy_(local_tensor(inner))

    def __getstate__(self) -> dict[str, Any]:
        self._settle_pending()  # a copy gets the averaged pseudo-gradients, not the collectives in flight
        return {
            **super().__getstate__(),
            "layout": self.layout,
            "outer_traffic": self.outer_traffic,
            "overlap_steps": self.overlap_steps,
            "overlap_alpha": self.overlap_alpha,
            "_pending": self._pending,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._fragments = []
        self.outer_traffic = state.get("outer_traffic", OuterTraffic())
        # torch's load_state_dict calls this with the state and groups only: the overlap stays the constructor's
        self.overlap_steps = state.get("overlap_steps", getattr(self, "overlap_steps", 0))
        self.overlap_alpha = state.get("overlap_alpha", getattr(self, "overlap_alpha", 0.0))
        self._pending = state.get("_pending", getattr(self, "_pending", []))

    # ---- parameters cast under it (see ``_wrapper``): the outer weights and momentum follow in wide_dtype, the
    # float32 inner weights of a bf16/fp16 parameter come or go ----

    _wide_keys = (OUTER, OUTER_MOMENTUM_BUFFER)

    def _cast_under(self, p: torch.Tensor, state: dict[str, Any]) -> bool:
        return OUTER in state and (
            state[OUTER].dtype != wide_dtype(p.dtype) or (INNER_FP32 in state) != (p.dtype in HALF_DTYPES)
        )

    def _follow_cast(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        # In train mode the parameter holds the inner weights, in eval mode the outer ones (and state["outer"] the
        # inner ones where there is no float32 copy): rounded to bf16 or fp16 where it was one of them.
        param, wide, train_mode = local_tensor(p), wide_dtype(p.dtype), group[TRAIN_MODE]
        if INNER_FP32 in state and p.dtype not in HALF_DTYPES:  # from bf16/fp16: the parameter takes the float32 value
            inner = local_tensor(state.pop(INNER_FP32))
            held = inner if train_mode else local_tensor(state[OUTER])
            param.copy_(torch.where(held_through_half(param, held), held.to(param.dtype), param))  # written ones win
            if not train_mode:
                state[OUTER] = shard_like(inner.to(wide), p)
        elif INNER_FP32 not in state and p.dtype in HALF_DTYPES:  # to bf16/fp16: the float32 copy is made
            if train_mode:
                state[INNER_FP32] = shard_like(param.to(wide), p)
            else:
                state[INNER_FP32] = shard_like(local_tensor(state[OUTER]).to(wide, copy=True), p)
                state[OUTER] = shard_like(param.to(wide), p)
        for key in self._wide_keys:
            if state[key].dtype != wide:
                state[key] = shard_like(local_tensor(state[key]).to(wide), p)

    # Where the outer weights have the parameter's dtype, the switch exchanges the contents of the parameter and of
    # state["outer"], keeping the key names (checkpoint loaders fill only keys their template has): in eval mode
    # state["outer"] then holds the inner weights. bf16/fp16 parameters keep both in float32 (state["outer"],
    # state["inner_fp32"]): the parameter holds one of them rounded.
    def _params_to_eval(self, group: dict[str, Any]) -> None:
        for param, outer, inner in self._switch_swapping(group):
            inner.copy_(authoritative_y(param, inner, inner.dtype))  # a parameter written in train mode wins
            param.copy_(outer)

    def _params_to_train(self, group: dict[str, Any]) -> None:
        for param, outer, inner in self._switch_swapping(group):
            written = bits_differ(param, outer.to(param.dtype))  # the outer weights written in eval mode win
            if bool(written.any()):
                outer.copy_(torch.where(written, param.to(outer.dtype), outer))
            param.copy_(inner)

    def _switch_swapping(self, group: dict[str, Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The switch both ways: exchanges parameter and outer weights where they share a dtype, and yields
        (parameter, outer weights, float32 inner weights) of the bf16/fp16 parameters, for the caller to switch."""
        for p in group["params"]:
            state = self.state.get(p)
            if not state or OUTER not in state:
                continue
            param, outer = local_tensor(p), local_tensor(state[OUTER])
            if INNER_FP32 in state:
                yield param, outer, local_tensor(state[INNER_FP32])
            else:
                _swap_(param, outer)


def _swap_(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two tensors exactly (one temporary of one tensor's size)."""
    tmp = a.clone()
    a.copy_(b)
    b.copy_(tmp)
