"""What GPA and DiLoCo share as wrappers of a base optimizer (``torch.optim.AdamW``, ``SGD``, ...).

Both keep a base optimizer that moves some tensors (GPA: z; DiLoCo: the parameters) and add their own passes around
its step. Everything about holding that base lives here, once:

* it is built lazily, at the first step (after any FSDP wrapping has replaced the parameters), and its state of each
  tensor is the very dict ``state[p]["base"]`` of this optimizer, so ``state_dict()`` carries it;
* the per-group hyper-parameters (``lr``, ``weight_decay``, the base's own) are forwarded to it before every step,
  so LR schedulers attached to the wrapper drive it; a value the base keeps as a tensor (torchao's low-bit AdamWs
  keep ``lr`` as one, so that a change does not recompile their step) is written into that tensor;
* a base whose groups carry keys of their own (``MuonWithAuxAdam``'s ``use_muon``) names them in ``probe_group``
  and checks a group in its static ``check_group(group)``: the wrapper's groups are checked by it too, up front;
* ``add_param_group``, ``load_state_dict``, ``copy.deepcopy`` and ``pickle`` drop it, and it is rebuilt on the
  current (added, loaded, copied) tensors at the next step, as it is when a parameter gets its first gradient or its
  state was cleared (created afresh then, as torch does); a base that makes its state in its constructor (torch's
  Adagrad) keeps the state this optimizer holds;
* its step runs without torch's step hooks, so global optimizer hooks fire once per wrapper step, around it;
* a step whose base raises leaves the parameters and this optimizer's state as they were (``_rollback_on_error``);
* a state dict saved by the base class itself is adopted: switching a base-optimizer run to the wrapper mid-training
  (the base's state is created as a first step would, in the base's own modes, and the saved values copied into it);
* parameters cast under it (``model.bfloat16()``, ``model.float()``, a state loaded into a model of another dtype)
  get their state converted at the next step, ``eval()`` or ``train()`` (``_fit_casts``): the subclass's own tensors
  (``_follow_cast``), then the base's state of the tensor it moves, widened to that tensor's dtype exactly, and the
  base rebuilt on it; a state that cannot be held exactly (float64 into narrower parameters) is refused with a
  ``ValueError`` naming the parameter and both dtypes, before anything changes.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._base import TrainEvalOptimizer
from ._checks import check_common
from ._state_layout import refusal, wide_dtype
from ._tensors import local_tensor
from ._types import BASE, LR, OPTIMIZER, STEP, TRAIN_MODE

__all__ = ["BaseOptimizerWrapper", "base_defaults", "unhooked_step"]


def unhooked_step(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer.step()`` without torch's global and per-instance step hooks (a wrapper's hooks stand for it)."""
    step = type(optimizer).step
    raw = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if raw is None:
        return optimizer.step()
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        return raw(optimizer)


def base_defaults(base: Any, base_kwargs: dict[str, Any], reserved: tuple[str, ...], owner: str) -> dict[str, Any]:
    """The defaults of a base optimizer class with ``base_kwargs`` applied, checked by the base itself.

    Instantiating the base on a dummy tensor runs its own argument checks now, before any work, and yields its
    hyper-parameter names (lr, betas, ...), which the wrapper then carries in its own param groups. A base whose
    groups must say something (``MuonWithAuxAdam``'s ``use_muon``) names it in its class attribute ``probe_group``.
    """
    if not (isinstance(base, type) and issubclass(base, torch.optim.Optimizer)):
        raise ValueError(f"Invalid base: {base!r} (must be a torch.optim.Optimizer subclass)")
    accepted = constructor_arguments(base)
    unknown = sorted(set(base_kwargs) - accepted) if accepted is not None else []
    if unknown:  # a misspelled keyword: a TypeError, as torch's optimizers and any Python function raise
        raise TypeError(
            f"{owner}.__init__() got an unexpected keyword argument {unknown[0]!r} (neither {owner}'s nor its base "
            f"{base.__name__}'s)"
        )
    check_common(base_kwargs)
    try:
        defaults = dict(base([probe_group(base, torch.zeros(2, 2, requires_grad=True))], **base_kwargs).defaults)
    except (TypeError, IndexError) as err:  # e.g. eps="x", betas=(0.9,): say which arguments, as a ValueError
        raise ValueError(f"Invalid argument for {base.__name__}({', '.join(base_kwargs)}): {err}") from err
    overlap = sorted(set(defaults) & set(reserved))
    if overlap:
        raise ValueError(f"Invalid base: {base.__name__} uses hyper-parameter names reserved by {owner}: {overlap}")
    return defaults


def constructor_arguments(base: type[torch.optim.Optimizer]) -> frozenset[str] | None:
    """The keyword arguments ``base(params, ...)`` takes by name, or None if it takes any (``**kwargs``).

    A base's ``defaults`` may hold keys its constructor does not take (torch's AdamW: ``decoupled_weight_decay``).
    """
    parameters = inspect.signature(base.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.name not in ("self", "params"))


def probe_group(base: Any, tensor: torch.Tensor) -> dict[str, Any]:
    """A param group of ``tensor`` that ``base`` accepts: with the keys of ``base.probe_group``, if it has one."""
    return {"params": [tensor], **getattr(base, "probe_group", {})}


class _Undo:
    """What a step did in place before its base stepped, as actions that undo it if the step raises (newest first)."""

    def __init__(self) -> None:
        self.actions: list[Callable[[], None]] = []

    def on_error(self, action: Callable[[], None]) -> None:
        self.actions.append(action)

    def restore(self) -> None:
        for action in reversed(self.actions):
            action()


def _key_sets(state: dict[str, Any]) -> dict[str, set[str] | None]:
    return {k: set(v) if isinstance(v, dict) else None for k, v in state.items()}


def _drop_new_keys(state: dict[str, Any], old: dict[str, set[str] | None]) -> None:
    for key in list(state):
        if key not in old:
            del state[key]
        elif old[key] is not None and isinstance(state[key], dict):
            for inner in [k for k in state[key] if k not in old[key]]:  # type: ignore[operator]
                del state[key][inner]


def _follows(key: str, value: Any, p: torch.Tensor) -> bool:
    """Whether a tensor of the base's state of ``p`` follows the dtype of the tensor it moves (m and v: floating, of
    ``p``'s shape; not a step count)."""
    if key == STEP or not (torch.is_tensor(value) and value.is_floating_point()):
        return False
    return local_tensor(value).shape == local_tensor(p).shape


def _forward_hypers(base_group: dict[str, Any], hypers: dict[str, Any]) -> None:
    """Write the wrapper's hyper-parameters into the base's group; a tensor the base keeps is filled in place.

    torchao's ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` and ``_AdamW`` turn ``lr`` into a tensor when the group is
    added and refuse a step after it was replaced by a float ("lr was changed to a non-Tensor object").
    """
    for key, value in hypers.items():
        current = base_group.get(key)
        if torch.is_tensor(current) and not torch.is_tensor(value) and current.numel() == 1:
            current.fill_(value)
        else:
            base_group[key] = value


class BaseOptimizerWrapper(TrainEvalOptimizer):
    """A ``TrainEvalOptimizer`` around a base optimizer class (see the module docstring).

    Subclasses give ``_base_tensor(p)`` (the tensor the base moves for parameter ``p``, or None while it needs
    none) and ``_check_own(values)`` (the checks of their own hyper-parameters, run on the constructor's values and
    on every group), and call ``_prepare_base()`` then ``_base_step()`` inside ``step()``.
    """

    def __init__(
        self, params: Any, base: type[torch.optim.Optimizer], base_kwargs: dict[str, Any], defaults: dict[str, Any]
    ) -> None:
        self._check_own(defaults)  # the wrapper's own values first, before the base is even probed
        owner = type(self).__name__
        base_hypers = base_defaults(base, base_kwargs, (*defaults, TRAIN_MODE, OPTIMIZER), owner)
        self.base_class = base
        self._base_keys = tuple(base_hypers)
        self._base: torch.optim.Optimizer | None = None
        self._base_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        super().__init__(params, {**base_hypers, **defaults})

    @property
    def optimizer_name(self) -> str:
        return f"{super().optimizer_name}({self.base_class.__name__})"

    # ---- the base optimizer ----

    def _base_tensor(self, p: torch.Tensor, create: bool = False) -> torch.Tensor | None:
        """The tensor the base moves for ``p`` (None while it needs none; ``create`` forces it into existence)."""
        raise NotImplementedError

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The base optimizer (built on first use on the current tensors; its state is nested in this one's)."""
        if self._base is None:
            groups, pairs = [], []
            for group in self.param_groups:
                tensors = []
                for p in group["params"]:
                    t = self._base_tensor(p)
                    if t is not None:
                        tensors.append(t)
                        pairs.append((p, t))
                groups.append({"params": tensors, **self._base_hypers(group)})
            base = self.base_class(groups)
            self._link_base_state(base, pairs)
            self._base, self._base_pairs = base, pairs
        return self._base

    def _check_own(self, values: dict[str, Any]) -> None:
        """The checks of the wrapper's own hyper-parameters (GPA's mu_x, ...), on the constructor's defaults and on
        every group."""
        raise NotImplementedError

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        self._check_base_group(group)
        self._check_own(group)

    def _check_base_group(self, group: dict[str, Any]) -> None:
        check = getattr(self.base_class, "check_group", None)
        if check is not None:  # the base's own group checks (MuonWithAuxAdam: use_muon, 2-D Muon parameters), now
            check({**self._base_hypers(group), "params": group["params"]})
            return
        # Any other base checks a group's values in its constructor (torch's AdamW: betas, eps, ...): run it on a
        # probe with this group's values, so a bad added group fails here, not at the next step.
        accepted = constructor_arguments(self.base_class)
        hypers = {k: v for k, v in self._base_hypers(group).items() if accepted is None or k in accepted}
        base_defaults(self.base_class, hypers, (), type(self).__name__)

    def _base_hypers(self, group: dict[str, Any]) -> dict[str, Any]:
        return {k: group[k] for k in self._base_keys if k in group}

    def _link_base_state(self, base: torch.optim.Optimizer, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # The base's state of each tensor is the dict state[p]["base"] of this optimizer (one object, saved and
        # loaded with it); it starts empty so that the base initializes it lazily as usual. A base that creates its
        # state in its constructor (torch's Adagrad) has it taken only where this optimizer holds none: a state that
        # was stepped, loaded or copied is the base's state, whatever a rebuilt base made.
        for p, t in pairs:
            own = self.state[p].setdefault(BASE, {})
            if not own and t in base.state:
                own.update(base.state[t])
            base.state[t] = own

    def _base_step(self) -> None:
        """Forward the hyper-parameters, then the base's step, without step hooks (they fire for the wrapper)."""
        base = self.base_optimizer
        for group, base_group in zip(self.param_groups, base.param_groups):
            _forward_hypers(base_group, self._base_hypers(group))
        unhooked_step(base)

    # ---- what drops the base: a new group, a load, a copy ----

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (checked like the constructor's); the base learns it at the next step."""
        super().add_param_group(param_group)
        self._base = None

    def _prepare_base(self) -> torch.optim.Optimizer:
        """The base, rebuilt first if a parameter has its first gradient (it then needs the base's attention) or if
        the state it was built on is no longer this optimizer's (``state.clear()``, ``del state[p]``, a new dict: the
        state is then created afresh, as torch's optimizers do)."""
        self._fit_casts()
        known = {id(p) for p, _ in self._base_pairs}
        if any(p.grad is not None and id(p) not in known for g in self.param_groups for p in g["params"]):
            self._base = None
        elif self._base is not None and any(
            self.state.get(p, {}).get(BASE) is not self._base.state.get(t) for p, t in self._base_pairs
        ):
            self._base = None
        return self.base_optimizer

    # ---- parameters cast under it ----

    #: The subclass's state tensors kept in `wide_dtype` of the parameter's dtype (DiLoCo: outer weights, momentum).
    _wide_keys: tuple[str, ...] = ()

    def _cast_under(self, p: torch.Tensor, state: dict[str, Any]) -> bool:
        """Whether ``p``'s dtype changed under its ``state`` (the state no longer fits it); a dtype check, no pass."""
        raise NotImplementedError

    def _base_dtype(self, p: torch.Tensor, state: dict[str, Any]) -> torch.dtype:
        """The dtype of the tensor the base moves for ``p`` (its state's dtype) once ``p``'s state was converted."""
        return wide_dtype(p.dtype)

    def _follow_cast(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        """Convert the subclass's own tensors of ``p``'s ``state`` (``_cast_under`` said so, nothing refused) to
        ``p``'s dtype, in the group's mode; the base's state is converted after it."""
        raise NotImplementedError

    @torch.no_grad()
    def _fit_casts(self) -> None:
        """Convert the state of every parameter cast under this optimizer, or refuse (a float64 state into narrower
        parameters: a ``ValueError`` naming the parameter and both dtypes) before anything changes."""
        unfit = []
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                state = self.state.get(p)
                if not state or not self._cast_under(p, state):
                    continue
                base = state.get(BASE) or {}
                reason = refusal(state, p.dtype, self._wide_keys) or refusal(
                    base, p.dtype, tuple(k for k, v in base.items() if _follows(k, v, p)), self._base_dtype(p, state)
                )
                if reason is not None:
                    where = f"param_groups[{g}]['params'][{i}]"
                    raise ValueError(f"{self.optimizer_name}: the optimizer state of {where} {reason}")
                unfit.append((group, p, state))
        for group, p, state in unfit:
            self._follow_cast(group, p, state)
            dtype = self._base_dtype(p, state)
            base = state.get(BASE) or {}
            for key, value in list(base.items()):
                if _follows(key, value, p) and value.dtype != dtype:
                    base[key] = value.to(dtype)
        if unfit:
            self._base = None  # rebuilt on the tensors it moves now

    @torch.no_grad()
    def eval(self) -> None:
        self._fit_casts()
        super().eval()

    @torch.no_grad()
    def train(self) -> None:
        self._fit_casts()
        super().train()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this optimizer's state and the base's nested in it; the base is rebuilt on the loaded tensors."""
        super().load_state_dict(state_dict)
        self._base = None

    #: A subclass's attributes that a copy or pickle carries too (torch's ``__setstate__`` sets every entry back).
    _carried: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        # torch keeps only defaults, state and param_groups; the base class travels too, the base object does not
        # (it is rebuilt on the copy's own tensors).
        carried = {name: getattr(self, name) for name in self._carried}
        return {**super().__getstate__(), "base_class": self.base_class, "_base_keys": self._base_keys, **carried}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._base, self._base_pairs = None, []

    # ---- a step that raises ----

    @contextlib.contextmanager
    def _rollback_on_error(self) -> Iterator[_Undo]:
        """Undo this optimizer's own changes if the block raises: state keys created, group values, saved tensors.

        What a step changes in place before its base steps is undone by the action it registers with
        ``undo.on_error(action)``. What the base itself changed before raising is the base's own affair: torch's
        optimizers check their inputs (a sparse gradient into AdamW) before they change anything.
        """
        keys = {p: _key_sets(s) for p, s in self.state.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        undo = _Undo()
        try:
            yield undo
        except BaseException:
            undo.restore()
            for p in list(self.state):
                if p in keys:
                    _drop_new_keys(self.state[p], keys[p])
                else:
                    del self.state[p]
            for group, old in zip(self.param_groups, groups):
                group.update(old)
            self._base = None  # rebuilt on the restored state at the next step
            raise

    # ---- the state before a first step, and switching a run of the base optimizer to this wrapper ----

    def _create_state(self) -> None:
        """This optimizer's tensors (GPA's z, DiLoCo's outer weights) and the base's state, as a first step finds them.

        The base's state is made by torch's own initializer (``torch.distributed.checkpoint``'s
        ``_init_optim_state``: one step with zero gradients and zero lr), run by a separate instance of the base on
        the base's tensors of the parameters that have no state yet, so the parameters, the existing state and the
        group values are left as they are; the step counts it advanced are set back to 0.
        """
        pairs, groups = [], []
        for group in self.param_groups:
            tensors = []
            for p in group["params"]:
                if p.requires_grad and not self.state.get(p, {}).get(BASE):
                    t = self._base_tensor(p, create=True)
                    tensors.append(t)
                    pairs.append((p, t))
            if tensors:
                hypers = self._base_hypers(group)
                groups.append({**hypers, "params": tensors, **({LR: 0.0} if LR in hypers else {})})
        if not pairs:
            return
        grads = [t.grad for _, t in pairs]
        try:
            for _, t in pairs:
                t.grad = torch.zeros_like(t)
            initializer = self.base_class(groups)
            unhooked_step(initializer)
        finally:
            for (_, t), g in zip(pairs, grads):
                t.grad = g
        for p, t in pairs:
            state = initializer.state[t]
            if torch.is_tensor(state.get(STEP)):
                state[STEP].zero_()
            elif STEP in state:
                state[STEP] = 0
            self.state[p][BASE] = state
        self._base = None  # rebuilt on (and linked to) this state at the next step

    def _adoptable_keys(self, saved_group: dict[str, Any]) -> set[str] | None:
        """The per-parameter state keys the base creates for a group like ``saved_group``: from one step on a probe
        tensor, with the saved group's values of the keys the base's groups must carry (``use_muon``)."""
        required = getattr(self.base_class, "probe_group", {})
        if any(key not in saved_group for key in required):
            return None  # not a state of this base (an AdamW state for a MuonWithAuxAdam base)
        probe = torch.zeros(2, 2, requires_grad=True)
        own = {key: saved_group[key] for key in required}
        optimizer = self.base_class([{**self._base_hypers(self.defaults), "params": [probe], **own}])
        probe.grad = torch.ones_like(probe)
        unhooked_step(optimizer)
        return {str(k) for k in optimizer.state[probe]}

    def _adopts(self) -> str:
        return self.base_class.__name__

    def _adopted_state(self, p: torch.Tensor) -> dict[str, Any]:
        return self.state[p][BASE]
