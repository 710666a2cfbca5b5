"""What DiLoCo and GPA across workers share: a base optimizer's inner steps, and every H-th step an outer step.

`OuterOptimizer` holds everything but the outer step itself: the base optimizer that takes the inner steps on the
parameters (the inner weights; bf16/fp16 parameters through a float32 copy), the schedule of the outer syncs
(``fragments``), the sync that averages the workers' pseudo-gradients (``sync``), the outer state's creation and its
agreement across processes, the train/eval switch (the parameters hold the inner weights while training and the
evaluation weights in eval mode), casts of the parameters, and the state dict (``checkpoint``). An outer algorithm is
a subclass that gives four things:

* ``_outer_state(p)``: its own state of a parameter before the first outer step (``state["outer"]``, the evaluation
  weights, among it), and ``_outer_keys``, the keys of that state besides ``"outer"``;
* ``_reference(group, p)``: the point the workers' inner steps of the period started from, from which the
  pseudo-gradient ``reference - inner`` is taken;
* ``_outer_update(group, p, pseudo_grad)``: the outer step with the averaged pseudo-gradient, returning the point the
  inner weights restart from;
* ``_default_outer_lr(num_workers, outer_defaults)``: the outer lr an unset ``outer_lr`` takes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._checks import check_inner_steps, check_num_fragments, check_outer_lr
from .._state_layout import HALF_DTYPES, held_through_half, wide_dtype
from .._tensors import authoritative_y, bits_differ, local_tensor, shard_like
from .._types import (
    DEFAULT_NUM_FRAGMENTS,
    INNER_FP32,
    INNER_STEP,
    INNER_STEPS,
    OUTER,
    OUTER_LR,
    SYNCED_AT,
    TRAIN_MODE,
)
from .._wrapper import BaseOptimizerWrapper
from . import checkpoint, rules
from .fragments import FragmentSchedule
from .layout import WorkerLayout, worker_layout
from .sync import Due, OuterSync, OuterTraffic, PendingSync

__all__ = ["OuterOptimizer"]


class OuterOptimizer(BaseOptimizerWrapper):
    """A base optimizer's inner steps and an outer algorithm's outer steps, on one worker or across processes (see
    the module docstring; the algorithms: `DiLoCo`, `GPADiLoCo`, whose docstrings give the arguments)."""

    #: The outer algorithm's per-parameter state besides ``"outer"``, kept in `wide_dtype` (following casts).
    _outer_keys: tuple[str, ...] = ()
    #: What a copy or pickle carries besides torch's defaults, state and param groups.
    _carried = ("layout", "sync", "schedule", "outer_traffic", "_wide_keys")
    #: After a train-mode load across workers, until the next step: (parameter, what the load put there).
    _loaded_inner: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __init__(
        self,
        params: Any,
        base: type[torch.optim.Optimizer],
        inner_steps: int,
        outer_lr: float | None,
        outer_defaults: dict[str, Any],
        *,
        distributed: bool = False,
        process_group: Any = None,
        num_workers: int | None = None,
        num_fragments: int = DEFAULT_NUM_FRAGMENTS,
        outer_dtype: str = "float32",
        overlap_steps: int = 0,
        overlap_alpha: float = 0.0,
        sync: OuterSync | None = None,
        **base_kwargs: Any,
    ) -> None:
        # Every argument is checked before anything is created or communicated: the layout's and the sync's, the
        # algorithm's, the wrapper's and the base's values (super().__init__), P against the tensors; only then are
        # the process groups created and the weights broadcast.
        if sync is None:
            layout = worker_layout(distributed, process_group, num_workers, num_fragments)
            sync = OuterSync(layout, outer_dtype, overlap_steps, overlap_alpha, type(self)._algorithm)
        else:
            given = {
                "distributed": distributed,
                "process_group": process_group,
                "num_workers": num_workers,
                "num_fragments": num_fragments,
                "outer_dtype": outer_dtype,
                "overlap_steps": overlap_steps,
                "overlap_alpha": overlap_alpha,
            }
            rules.check_given_sync(type(sync).__name__, sync.runs(), given, sync.not_yet)
            sync.algorithm = type(self)._algorithm
        self.sync = sync
        self.layout: WorkerLayout = sync.layout
        self.schedule = FragmentSchedule(self.layout.num_fragments)
        self.outer_traffic: OuterTraffic = self.sync.traffic
        self._wide_keys = (OUTER, *self._outer_keys, *self.sync.state_keys)
        if outer_lr is None:
            outer_lr = self._default_outer_lr(self.layout.num_workers, outer_defaults)
        defaults = {INNER_STEPS: inner_steps, OUTER_LR: outer_lr, **outer_defaults, INNER_STEP: 0}
        super().__init__(params, base, base_kwargs, defaults)
        params = [p for group in self.param_groups for p in group["params"]]
        check_num_fragments(num_fragments, num_tensors=len(params))
        rules.check_fragment_sizes(self.sync.outer_dtype, self.schedule.numels(params, local_tensor))
        self.layout = self.sync.layout = self.layout.connect()
        self._agree_on_outer(params)
        self.sync.attach(self)

    #: The outer algorithm's name, as the sync's refusals give it.
    _algorithm = "DiLoCo"

    def _check_own(self, values: dict[str, Any]) -> None:
        check_inner_steps(values[INNER_STEPS])
        check_outer_lr(values[OUTER_LR])
        check_num_fragments(self.layout.num_fragments, inner_steps=values[INNER_STEPS])
        self.sync.check_group(values[INNER_STEPS], values.get("params", ()))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (checked like the constructor's); across processes, its parameters are broadcast from the
        group's first process and get their outer state now, as the constructor's do."""
        super().add_param_group(param_group)
        if self.layout.island_group is not None:  # connected: a group added after the constructor
            self._agree_on_outer(self.param_groups[-1]["params"])

    @torch.no_grad()
    def _agree_on_outer(self, params: list[torch.Tensor] | None = None) -> None:
        """Across processes, every worker starts ``params`` from the first process's weights and every one of them
        that takes a gradient gets its outer state now, so that each outer sync has the same tensors on every
        process. Without ``params``: those that take a gradient and have no outer state (unfrozen after construction,
        or their state cleared on every process), decided from ``requires_grad`` and the state alone, the same on
        every process, never from a gradient that some processes have and others not."""
        if not self.layout.distributed:
            return
        if params is None:
            own = [p for group in self.param_groups for p in group["params"]]
            params = [p for p in own if p.requires_grad and OUTER not in self.state.get(p, ())]
            if not params:
                return
        self.sync.broadcast(params)
        for p in params:
            if p.requires_grad:
                self._init_outer(p)

    def _create_state(self) -> None:
        self._agree_on_outer()  # across processes, the outer weights of init_state() are agreed on too
        super()._create_state()

    def _base_tensor(self, p: torch.Tensor, create: bool = False) -> torch.Tensor | None:
        # The base moves the inner weights, once they have a gradient: the parameters themselves, or for bf16/fp16
        # parameters their float32 copy. ``create`` (an adopted state, whose parameters have no gradient yet;
        # ``init_state``) starts their state now, so the base is built on them and receives the state.
        if create or p.grad is not None:
            self._init_outer(p)
        return _inner(self.state[p], p) if p in self.state else None

    def _init_outer(self, p: torch.Tensor) -> None:
        state = self.state[p]
        if OUTER not in state:
            state.update(self._outer_state(p))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; after every H-th of a fragment, its outer sync and step."""
        loss = self._closure_loss(closure)
        checkpoint.check_inner_kept(self)
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
                        inner = _inner(self.state[p], p)
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
        self.sync.tick()
        self._outer_syncs(self.schedule.due(self.param_groups, self.state), every=False)
        return loss

    def _outer_syncs(self, due: Due, every: bool) -> None:
        """Apply the syncs in flight whose steps are over (``every``: all), then start the outer syncs of the ``due``
        parameters and apply those that are done (blocking: at once)."""
        for pending in self.sync.ready(every):
            self._apply(pending)
        if due:
            references = [self._reference(group, p) for group, p in due]
            inners = [local_tensor(_inner(self.state[p], p)) for _, p in due]
            self.sync.start(due, references, inners, [self.state[p] for _, p in due])
            for pending in self.sync.ready(every):
                self._apply(pending)

    def _apply(self, pending: PendingSync) -> None:
        """The outer step of each parameter of a sync with its averaged pseudo-gradient; its inner weights restart
        from the algorithm's restart point, or, overlapped, are mixed with it (``inner * alpha + restart * (1 -
        alpha)``: alpha = 0 copies it, as the blocking sync does)."""
        alpha = self.sync.overlap_alpha
        for (group, p), pseudo_grad in zip(pending.due, pending.pseudo_grads):
            restart = self._outer_update(group, p, pseudo_grad)
            inner = local_tensor(_inner(self.state[p], p))
            if alpha == 0.0:
                inner.copy_(restart)
            else:
                inner.mul_(alpha).add_(restart, alpha=1.0 - alpha)
            if inner is not local_tensor(p):
                local_tensor(p).copy_(inner)

    @torch.no_grad()
    def synchronize(self) -> None:
        """For the end of training (`GPATrainer` calls it at the last step): every sync in flight applied now, then
        every fragment that took inner steps since its last outer step synchronised and stepped now, with the
        pseudo-gradient of those steps, so that the evaluation weights hold every inner step of every worker (without
        it the steps after the last whole period leave no trace there). Once per step: a second call before the next
        inner step changes nothing (the group's ``synced_at``; before, it took the outer step again). Collective:
        every process calls it. In eval mode it switches to train mode for the updates and back."""
        with _in_train_mode(self):
            self._outer_syncs(self.schedule.due(self.param_groups, self.state, partial=True), every=True)
        for group in self.param_groups:
            group[SYNCED_AT] = group[INNER_STEP]

    @torch.no_grad()
    def apply_syncs_in_flight(self) -> None:
        """Overlap: wait for every sync in flight and apply its outer update now, in the order they were started,
        ahead of its tau steps (`synchronize` does this and more). Collective; in eval mode it switches to train mode
        for the updates and back."""
        with _in_train_mode(self):
            self._outer_syncs([], every=True)

    def outer_bytes_per_period(self) -> int:
        """The bytes this process sends to the other workers over one period of H inner steps (every fragment
        once), as counted in ``outer_traffic`` (0 for a single worker)."""
        params = [p for group in self.param_groups for p in group["params"]]
        return self.sync.bytes_per_period(params, self.schedule.of_each(params))

    # ---- the state dict (``checkpoint``) ----

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict with the layout that saved it and the syncs in flight; across M > 1 workers, this
        worker's own entries nested under ``"worker<w>"`` (``diloco.checkpoint``)."""
        return checkpoint.state_dict_of(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved on this layout (world size, M, P, worker); another layout raises a ``ValueError`` naming
        what differs, before anything changes. Taken in train mode, this worker's inner weights go into the
        parameters."""
        checkpoint.load_state(self, state_dict, super().load_state_dict)

    # ---- parameters cast under it (see ``_wrapper``): the outer state follows in wide_dtype, the float32 inner
    # weights of a bf16/fp16 parameter come or go ----

    def _cast_under(self, p: torch.Tensor, state: dict[str, Any]) -> bool:
        return OUTER in state and (
            state[OUTER].dtype != wide_dtype(p.dtype) or (INNER_FP32 in state) != (p.dtype in HALF_DTYPES)
        )

    def _follow_cast(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        # In train mode the parameter holds the inner weights, in eval mode the evaluation ones (and state["outer"]
        # the inner ones where there is no float32 copy): rounded to bf16 or fp16 where it was one of them.
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
            if key in state and state[key].dtype != wide:
                state[key] = shard_like(local_tensor(state[key]).to(wide), p)

    # Where the outer weights have the parameter's dtype, the switch exchanges the contents of the parameter and of
    # state["outer"], keeping the key names (checkpoint loaders fill only keys their template has): in eval mode
    # state["outer"] then holds the inner weights. bf16/fp16 parameters keep both in float32 (state["outer"],
    # state["inner_fp32"]): the parameter holds one of them rounded.
    def _params_to_eval(self, group: dict[str, Any]) -> None:
        checkpoint.check_inner_kept(self)
        for param, outer, inner in _switched(self.state, group):
            inner.copy_(authoritative_y(param, inner, inner.dtype))  # a parameter written in train mode wins
            param.copy_(outer)

    def _params_to_train(self, group: dict[str, Any]) -> None:
        for param, outer, inner in _switched(self.state, group):
            written = bits_differ(param, outer.to(param.dtype))  # the outer weights written in eval mode win
            if bool(written.any()):
                outer.copy_(torch.where(written, param.to(outer.dtype), outer))
            param.copy_(inner)


@contextlib.contextmanager
def _in_train_mode(optimizer: OuterOptimizer) -> Iterator[None]:
    """Train mode inside the block, the mode it found after it."""
    in_eval = not optimizer.train_mode
    if in_eval:
        optimizer.train()
    yield
    if in_eval:
        optimizer.eval()


def _inner(state: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
    """The tensor holding the inner weights: ``state["inner_fp32"]`` for bf16/fp16 parameters, else ``p``."""
    return state.get(INNER_FP32, p)


def _switched(states: Any, group: dict[str, Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The switch both ways: exchanges parameter and outer weights where they share a dtype, and yields
    (parameter, outer weights, float32 inner weights) of the bf16/fp16 parameters, for the caller to switch."""
    for p in group["params"]:
        state = states.get(p)
        if not state or OUTER not in state:
            continue
        param, outer = local_tensor(p), local_tensor(state[OUTER])
        if INNER_FP32 in state:
            yield param, outer, local_tensor(state[INNER_FP32])
        else:
            tmp = param.clone()  # exchanged exactly, one temporary of one tensor's size
            param.copy_(outer)
            outer.copy_(tmp)
