"""The optimizer step inside the backward pass: each parameter is updated as soon as its gradient is complete.

Why: GPA keeps one more copy of the weights than AdamW (z). In fp32 an ordinary step holds parameters, gradients,
z, m and v at once, 20 bytes per weight against AdamW's 16. Stepping each parameter from its
``register_post_accumulate_grad_hook`` and freeing its gradient right after means no full set of gradients ever
exists: GPA then needs AdamW's memory, with the same numbers (bitwise) as stepping after ``backward()``.

One ``backward()`` is one training step. The first hook of a group in a backward pass runs the group's once-per-step
work (``_begin_group_step``: the learning rate of this step, the Schedule-Free weight sum); every hook then updates its
one parameter (``_step_params``); at the end of the pass the step is closed, the hooked groups that got no gradient in
it running their once-per-step work then (as ``step()`` runs it for a group without gradients). A parameter that gets
no gradient is not stepped, as in ``step()``. ``optimizer.step()`` and ``zero_grad()`` find no gradients left and do
nothing for the hooked groups (their step was the backward pass), so a loop or a Trainer that calls them keeps working,
and the LR scheduler, ``eval()``/``train()``, ``state_dict()`` and resuming are unchanged. A training step in which no
hooked parameter gets a gradient (no backward at all, or one through other parameters only) runs no hook: the
``optimizer.step()`` after it is then the hooked groups' step, as in ``step()`` (it takes the once-per-step work of
every group whose step no backward pass began since the last ``step()``).

What cannot work this way: gradient accumulation (every backward steps), clipping by the global gradient norm (the
norm is known only after the last gradient, when every other parameter has moved), loss scaling that skips steps on
overflow (fp16's GradScaler), and data-parallel wrappers whose hooks fire before the gradients are reduced (DDP,
FSDP), and reentrant activation checkpointing (its nested backward passes would each count as a step). Only
optimizers with a per-parameter step (``GPAAdamW``) can be hooked; ``GPA(base=...)`` runs its base
optimizer's ``step()`` over all tensors at once and is refused.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ._tensors import is_dtensor

__all__ = ["StepInBackward", "step_in_backward"]

#: The optimizer methods a per-parameter step needs (``GPAAdamW``'s).
_PER_PARAMETER_STEP = ("_begin_group_step", "_step_params")


class StepInBackward:
    """The hooks that step ``optimizer``'s parameters inside ``backward()``; ``remove()`` takes them away.

    The parameters of the optimizer's groups when it is called are hooked; a group added later keeps its gradients
    for ``optimizer.step()``. Also a context manager (the hooks are removed on exit). ``grad_norm`` is the global
    norm of the last step's gradients (the norm ``clip_grad_norm_`` reports, not clipped) when ``track_grad_norm``
    is set, else None.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, track_grad_norm: bool = False) -> None:
        missing = [name for name in _PER_PARAMETER_STEP if not callable(getattr(optimizer, name, None))]
        if missing:
            raise TypeError(
                f"{type(optimizer).__name__} cannot step inside backward: it has no per-parameter step "
                f"({', '.join(missing)}). Use hf_gpa.GPAAdamW; GPA(base=...) steps its base optimizer over all "
                "tensors at once."
            )
        self.optimizer = optimizer
        self.track_grad_norm = track_grad_norm
        self.grad_norm: torch.Tensor | None = None
        self._hypers: dict[int, Any] = {}  # group index -> this step's hyper-parameters (_begin_group_step)
        self._sq_norms: list[torch.Tensor] = []
        self._pass: int | None = None  # the autograd graph task of the step in progress, None between steps
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        seen: set[int] = set()
        self._groups: list[int] = []  # indices of the hooked groups
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if not p.requires_grad or id(p) in seen:
                    continue
                if not self._groups or self._groups[-1] != index:
                    self._groups.append(index)
                if is_dtensor(p):
                    self.remove()
                    raise ValueError(
                        "cannot step inside backward with sharded (DTensor) parameters: FSDP reduces the gradients "
                        "after the hooks that would step them have run"
                    )
                seen.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(index)))

    def _hook(self, index: int) -> Any:
        def step_param(p: torch.Tensor) -> None:
            self._step(index, p)

        return step_param

    @torch.no_grad()
    def _step(self, index: int, p: torch.Tensor) -> None:
        optimizer = self.optimizer
        group = optimizer.param_groups[index]
        # The autograd engine runs the hooks of parameters on different GPUs on different threads.
        with self._lock:
            this_pass = torch._C._current_graph_task_id()
            if this_pass != self._pass:
                # The first gradient of this backward pass: a new training step. (A pass that raised half-way never
                # ran its end-of-step callback; its step is over all the same.)
                if not getattr(optimizer, "train_mode", True):
                    raise RuntimeError(
                        f"{type(optimizer).__name__} was asked to step inside backward in eval mode (the parameters "
                        "hold the averaged weights). Call optimizer.train() before training steps."
                    )
                self._hypers.clear()
                self._sq_norms = []
                # Closes the step when this pass ends (the engine runs queued callbacks after the last hook).
                torch.autograd.Variable._execution_engine.queue_callback(self._end_step)
                self._pass = this_pass
            hyper = self._hypers.get(index)
            if hyper is None:
                hyper = self._hypers[index] = optimizer._begin_group_step(group)
            if self.track_grad_norm:
                self._sq_norms.append(torch.linalg.vector_norm(p.grad, dtype=torch.float32).square())
        optimizer._step_params(group, [p], hyper)
        p.grad = None  # the point of it all: the gradient is gone before the next one is computed

    def _end_step(self) -> None:
        for index in self._groups:
            if index not in self._hypers:  # a hooked group without gradients in this pass: its step all the same
                self.optimizer._begin_group_step(self.optimizer.param_groups[index])
        self._hypers.clear()
        self._pass = None
        if self.track_grad_norm:
            norms = [n.to(self._sq_norms[0].device) for n in self._sq_norms]
            self.grad_norm = torch.stack(norms).sum().sqrt() if norms else None
            self._sq_norms = []

    def remove(self) -> None:
        """Remove the hooks: ``backward()`` leaves gradients again and ``optimizer.step()`` steps them. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def active(self) -> bool:
        """Whether the hooks are in place."""
        return bool(self._handles)

    def __enter__(self) -> StepInBackward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def step_in_backward(optimizer: torch.optim.Optimizer, *, track_grad_norm: bool = False) -> StepInBackward:
    """Step ``optimizer``'s parameters inside ``backward()``, each as soon as its gradient is complete, and free the
    gradient; returns the handle whose ``remove()`` ends it. See the module docstring for what it refuses."""
    return StepInBackward(optimizer, track_grad_norm=track_grad_norm)
