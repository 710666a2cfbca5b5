"""GPA-AdamW's step plan: which implementation takes each tensor, decided once per parameter set and reused.

torch's fused AdamW keeps its host work per step constant in the number of tensors. So does a step that runs a plan:
built the first time a set of parameters steps and kept until the parameters or the groups change (`GPAAdamW` drops
its plans on ``add_param_group``, ``load_state_dict``, new or reset state; a replaced parameter is another key), it
holds

* the implementation (`kernels.default_to_fused_or_foreach`, torch's rule) and the buckets: which kernel (one C++
  call, one Triton launch per device and dtype) or which foreach group (per device and every tensor's own dtype)
  takes each tensor (`kernels.fused_buckets`), decided per tensor, once;
* the tensor lists of the update (y, z, m, v, y's float32 copy, the low words of y and z under
  ``state_dtype="compact"``) per bucket; only the gradients are gathered per step;
* the step counters. A plan for a whole group binds the per-parameter ``state["step"]`` (a 0-d float32 CPU tensor,
  what torch's AdamW saves and loads) as views of one tensor of the group's counts: a step advances all of them with
  one ``add_`` and reads them with one ``tolist()``. A plan for a subset of a group (one parameter stepped from a
  backward hook) advances the parameter's own counter and binds nothing, so the group's plan stays valid.

The state tensors are held as objects, never as addresses: the C++ kernel reads each tensor's address when called and
the Triton launcher keys its pointer tables by the addresses it reads at each launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ._tensors import is_dtensor, local_tensor, real_view
from ._types import EXP_AVG, EXP_AVG_SQ, STEP, Y_FP32, Y_LO, Z_LO, Z
from .kernels import LOW_WORD, PARAM_DTYPE, STATE_DTYPE, fused_buckets

__all__ = ["AdamWHyper", "Bucket", "StepPlan", "bias_corrections"]


@dataclass(frozen=True)
class AdamWHyper:
    """One group's hyper-parameters for one step, resolved once per group and step (``_begin_group_step``)."""

    lr: float | torch.Tensor  # a 0-d tensor where the group's lr is a tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    mu_x: float  # this step's weight on the old average (`averaging.averaging_mu_x`)
    mu_y: float
    maximize: bool


def bias_corrections(beta1: float, beta2: float, step: float) -> tuple[float, float]:
    """AdamW's bias corrections after ``step`` steps: (1 - beta1^t, sqrt(1 - beta2^t)); every path takes them here."""
    return 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)


@dataclass
class Bucket:
    """Tensors one call updates: ``kind`` is "cpu" or "triton" (a kernel), "foreach" or "forloop"; ``idx`` their
    positions in the plan's parameter list; ``ys`` ... ``y32s`` the update's tensors (``y32s`` None where no tensor
    of the bucket has a float32 copy of y); ``lows`` the low words of y and z (``state_dtype="compact"``), None where
    no tensor of the bucket has them."""

    kind: str
    idx: list[int]
    ys: list[torch.Tensor]
    zs: list[torch.Tensor]
    ms: list[torch.Tensor]
    vs: list[torch.Tensor]
    y32s: list[torch.Tensor] | None
    whole: bool  # idx is every position in order: the step's lists are used as they are
    lows: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None = None


class StepPlan:
    """The plan of one parameter set (see the module docstring).

    ``impl`` is "forloop", "foreach" or "fused"; ``bind_steps`` makes the counters views of one tensor (whole
    groups only).
    """

    def __init__(self, params: list[torch.Tensor], states: list[dict[str, Any]], impl: str, bind_steps: bool) -> None:
        self.params = params
        self.states = states
        self.impl = impl
        # DTensor shards and complex views are taken afresh at each step (to_local() and view_as_real() are views of
        # whatever the parameter holds then); plain tensors are used as they are.
        self.fresh_views = any(is_dtensor(p) or p.is_complex() for p in params)
        ys, zs, ms, vs, y32s = self._tensors()
        y_los, z_los = self._lows()
        grads = self.grads()
        if impl == "forloop":
            groups = {("forloop", None): list(range(len(params)))}
        else:
            kernel_buckets, foreach_buckets = fused_buckets(
                ys,
                [
                    (grads, PARAM_DTYPE),
                    (zs, STATE_DTYPE),
                    (ms, STATE_DTYPE),
                    (vs, STATE_DTYPE),
                    (y32s, STATE_DTYPE),
                    (y_los, LOW_WORD),
                    (z_los, LOW_WORD),
                ],  # fmt: skip
                use_kernels=impl == "fused",
            )
            groups = {(key[0], key): idx for key, idx in kernel_buckets.items()}
            groups |= {("foreach", key): idx for key, idx in foreach_buckets.items()}
        self.buckets: list[Bucket] = []
        for (kind, _), idx in groups.items():
            y_b, z_b, m_b, v_b, y32_b = ([lst[i] for i in idx] for lst in (ys, zs, ms, vs, y32s))
            y32_b = None if all(t is None for t in y32_b) else y32_b
            lows = ([y_los[i] for i in idx], [z_los[i] for i in idx])
            lows = None if all(t is None for t in lows[0]) else lows
            self.buckets.append(Bucket(kind, idx, y_b, z_b, m_b, v_b, y32_b, idx == list(range(len(params))), lows))
        self._signature = self.signature(grads)
        self.flat_steps: torch.Tensor | None = None
        if bind_steps and params:
            steps = [s[STEP] for s in states]
            flat = torch.stack([t.detach().to(device="cpu", dtype=torch.float32).reshape(()) for t in steps])
            for k, s in enumerate(states):
                s[STEP] = flat[k]
            self.flat_steps = flat

    def signature(self, grads: list[torch.Tensor]) -> tuple:
        """What the buckets were decided on and may change between steps: the parameters' addresses (new storage,
        ``p.data = ...``, may have another layout) and the gradients' strides (a gradient assigned in another layout
        than its parameter's cannot take a kernel)."""
        if self.fresh_views:  # DTensor shards and complex views: their buckets are decided on the views' layouts
            return tuple(g.stride() for g in grads)
        return (*(p.data_ptr() for p in self.params), *(g.stride() for g in grads))

    def fits(self, grads: list[torch.Tensor]) -> bool:
        """Whether this step's parameters and gradients are what the plan was built on (else it is rebuilt)."""
        return self.signature(grads) == self._signature

    def valid(self) -> bool:
        """False where something replaced the counters this plan bound (a loader writing ``state["step"]``)."""
        if self.flat_steps is None:
            return True
        first, last = self.states[0][STEP], self.states[-1][STEP]
        return first._base is self.flat_steps and last._base is self.flat_steps

    def _tensors(self) -> tuple[list[torch.Tensor], ...]:
        def view(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else real_view(local_tensor(t))

        return (
            [view(p) for p in self.params],
            *([view(s[key]) for s in self.states] for key in (Z, EXP_AVG, EXP_AVG_SQ)),
            [view(s.get(Y_FP32)) for s in self.states],
        )

    def _lows(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """The low words of y and z (None where a parameter has none): state tensors (local shards of DTensors), held
        as they are, like the rest of the state of plain tensors."""

        def view(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else local_tensor(t)

        return [view(s.get(Y_LO)) for s in self.states], [view(s.get(Z_LO)) for s in self.states]

    def grads(self) -> list[torch.Tensor]:
        """This step's gradients, in the parameters' order."""
        if self.fresh_views:
            return [real_view(local_tensor(p.grad)) for p in self.params]
        return [p.grad for p in self.params]

    def bucket_tensors(self, bucket: Bucket) -> tuple[list[torch.Tensor], ...]:
        """y, z, m, v and y32 of a bucket as this step sees them (fresh views of DTensor shards and complex
        tensors)."""
        if not self.fresh_views:
            return bucket.ys, bucket.zs, bucket.ms, bucket.vs, bucket.y32s
        ys, zs, ms, vs, y32s = (
            [lst[i] for i in bucket.idx] for lst in self._tensors()
        )  # fmt: skip
        return ys, zs, ms, vs, None if bucket.y32s is None else y32s

    def step_tensors(self) -> list[torch.Tensor]:
        """The per-parameter counters (``state["step"]``)."""
        return [s[STEP] for s in self.states]

    def advance_steps(self) -> tuple[list[float], float | None]:
        """Add one to every counter; return the counts and, where all are equal (nearly always), that count."""
        if self.flat_steps is not None:
            self.flat_steps.add_(1.0)
            counts = self.flat_steps.tolist()
        else:
            steps = self.step_tensors()
            torch._foreach_add_(steps, 1.0)
            counts = [t.item() for t in steps]  # on the CPU: no device synchronization
        uniform = counts[0] if counts and min(counts) == max(counts) else None
        return counts, uniform
