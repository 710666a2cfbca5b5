"""DiLoCo (Step-K Nesterov outer optimizer): single-worker, the baseline GPA is measured against (paper, Algorithm 2),
and across processes (Douillard et al. 2023), in islands, streaming and overlapped (Douillard et al. 2025).

The base optimizer takes H inner steps on the parameters (the inner weights); every H-th step the pseudo-gradient
p = outer - inner drives a Nesterov step of the outer weights, and the inner weights are reset to them:

    b <- mu b + p,      outer <- outer - outer_lr (mu b + p),      inner <- outer

This is the Nesterov form of the main text (eq. 10, PyTorch's ``SGD(nesterov=True)`` on the pseudo-gradient), in
which the look-ahead uses the updated buffer; Algorithm 2 in the appendix writes the old buffer in that line, which
we read as a typo since its own momentum update precedes it. The evaluation weights are the outer weights. State
per parameter: the outer weights and the outer momentum buffer (2 copies, float32 for bf16/fp16 parameters, as GPA
keeps z) plus the base's state.

This file holds the Nesterov step alone; the inner steps, the schedule, the state dict and the switch are
``outer``'s, what crosses the workers ``sync``'s, the processes ``layout``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._checks import check_outer_momentum
from .._state_layout import diloco_state
from .._tensors import local_tensor
from .._types import (
    DEFAULT_INNER_STEPS,
    DEFAULT_OUTER_MOMENTUM,
    OUTER,
    OUTER_LR,
    OUTER_MOMENTUM,
    OUTER_MOMENTUM_BUFFER,
    default_outer_lr,
)
from .outer import OuterOptimizer

__all__ = ["DiLoCo"]


class DiLoCo(OuterOptimizer):
    r"""DiLoCo / Step-K Nesterov around a base optimizer: single-worker (paper, Algorithm 2) or across processes.

    .. math::
        \begin{aligned}
            & x_{t+1} = \mathrm{base}(x_t, \nabla f(x_t)) \quad \text{(inner step, with the base's weight decay)} \\
            & \text{if } t \bmod H = 0: \quad p = \tfrac{1}{M} \textstyle\sum_{m=1}^{M} (\tilde x - x^{(m)}_{t+1}),
              \quad b \leftarrow \mu b + p, \quad
              \tilde x \leftarrow \tilde x - \tilde\gamma (\mu b + p), \quad x_{t+1} \leftarrow \tilde x
        \end{aligned}

    with one worker (M = 1) by default. ``eval()`` puts the outer weights :math:`\tilde x` into the parameters and
    ``train()`` restores the inner weights bitwise (for fp32/fp64 parameters the two are exchanged with
    ``state["outer"]``, no extra memory). bf16/fp16 parameters keep their state in float32, as GPA does: the outer
    weights, the outer momentum and the inner weights (``state["inner_fp32"]``, which the base steps; the parameter
    holds it rounded and stays authoritative: a parameter written by something else wins). Stepping bf16 inner
    weights would lose the updates smaller than their rounding, and every outer step would take the rounding for a
    move (least squares in bf16, cosine, 600 steps, H = 8: loss 0.177 at the outer weights against 0.0025 in fp32;
    with float32 state it is the fp32 run's).

    **Across processes** (``distributed=True``, or a ``process_group``): the W processes run M workers, each an
    island of W / M processes with contiguous ranks (``layout``: DDP over ``optimizer.layout.island_group``, or
    `island_allreduce_hook`; FSDP2 over the island's mesh). At construction the parameters are broadcast from the
    first process and the outer state is created for every parameter that requires a gradient; every process must
    call ``step()`` equally often. At each outer step the pseudo-gradients are averaged over the M workers
    (``optimizer.sync``: one all-reduce, or compressed with ``outer_dtype``, or overlapped with ``overlap_steps``) and
    every process takes the same Nesterov step, so the outer weights are the same bits everywhere. **Streaming**
    (``num_fragments`` = P > 1): fragment k of the parameters takes its outer step at the inner steps t with
    (t - k H // P) % H == 0 (``fragments``). ``synchronize()`` ends a run: every fragment's steps since its last
    outer step are synchronised (`GPATrainer` calls it at the last step). The state dict records the layout and
    resumes only on it (``checkpoint``).

    As a wrapper of its base it behaves like `GPA` (see ``_wrapper``): ``add_param_group`` at any time,
    ``copy.deepcopy``/``pickle`` round trips (a copy across processes shares the process groups; pickling one
    raises), step hooks that fire once per ``DiLoCo.step()``, a step whose base raises leaves parameters and state as
    they were, a state dict saved by the base class itself is adopted, casts of the parameters are followed.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        base: the inner optimizer class (default: ``torch.optim.AdamW``).
        inner_steps: H, the number of inner steps between outer steps (default: 32).
        outer_lr: the outer learning rate :math:`\tilde\gamma` (default: 0.7 for one worker, 0.6 across workers:
            ``_types.default_outer_lr``).
        outer_momentum: the outer Nesterov momentum :math:`\mu` in [0, 1) (default: 0.9).
        distributed: run across the processes of torch.distributed's default group, which must be more than one
            (default: False, a single worker that communicates nothing).
        process_group: run across the processes of this group instead (implies ``distributed``; a group of one
            process is a single worker) (default: None).
        num_workers: M, which divides the world size W; each worker is an island of W / M processes (default: None,
            every process a worker; 1: plain data parallelism around single-worker DiLoCo).
        num_fragments: P, the fragments of streaming DiLoCo, at most the number of parameter tensors and at most H
            (default: 1, plain DiLoCo).
        outer_dtype: the dtype the pseudo-gradients cross the workers in: "float32" (default), "bfloat16" or "int8"
            (a float32 scale per block of 256 elements), both with error feedback (``compression``); compressed ones
            need more than one worker, and int8 fragments of at least 256 elements.
        overlap_steps: tau, streaming DiLoCo's overlap (default: 0, none): a fragment's all-reduce is started in the
            background when it is due and its outer update applied tau inner steps later, mixed into the inner
            weights that moved on as ``inner * alpha + outer * (1 - alpha)``. Needs more than one worker, P > 1
            fragments, tau < H // P and the float32 ``outer_dtype`` (``rules``).
        overlap_alpha: alpha in [0, 1] (default: 0, the inner weights are replaced); only with ``overlap_steps`` > 0.
        sync: a ready-made outer sync instead of the one the arguments above describe (default: None), such as
            `diloco.torchft_sync.TorchftSync`, replica groups on torchft that go on when one is lost and heal one
            that (re)joins; an argument above that contradicts it is refused by name (``rules.check_given_sync``).
        **kwargs: the keyword-only arguments above (where it runs and how it syncs), then the base optimizer's own
            arguments (lr, betas, weight_decay, ...).

    Papers: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023);
    Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch" (2025).
    """

    _outer_keys = (OUTER_MOMENTUM_BUFFER,)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        base: type[torch.optim.Optimizer] = torch.optim.AdamW,
        inner_steps: int = DEFAULT_INNER_STEPS,
        outer_lr: float | None = None,
        outer_momentum: float = DEFAULT_OUTER_MOMENTUM,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, base, inner_steps, outer_lr, {OUTER_MOMENTUM: outer_momentum}, **kwargs)

    def _default_outer_lr(self, num_workers: int, outer_defaults: dict[str, Any]) -> float:
        """The outer lr an unset ``outer_lr`` takes (`_types.default_outer_lr`)."""
        return default_outer_lr(num_workers)

    def _check_own(self, values: dict[str, Any]) -> None:
        super()._check_own(values)
        check_outer_momentum(values[OUTER_MOMENTUM])

    def _outer_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The outer weights (the current weights) and a zero outer momentum in the state dtype (float32 for
        bf16/fp16 parameters, which also get their inner weights in float32)."""
        return diloco_state(p)

    def _reference(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """The outer weights, from which every inner period starts."""
        return local_tensor(self.state[p][OUTER])

    def _outer_update(self, group: dict[str, Any], p: torch.Tensor, pseudo_grad: torch.Tensor) -> torch.Tensor:
        """The Nesterov step of the outer weights with the averaged pseudo-gradient (in the outer weights' dtype;
        used as scratch); the inner weights restart from the new outer weights."""
        mu, outer_lr = group[OUTER_MOMENTUM], group[OUTER_LR]
        buf, outer = local_tensor(self.state[p][OUTER_MOMENTUM_BUFFER]), local_tensor(self.state[p][OUTER])
        buf.mul_(mu).add_(pseudo_grad)
        outer.sub_(pseudo_grad.add_(buf, alpha=mu), alpha=outer_lr)
        return outer
