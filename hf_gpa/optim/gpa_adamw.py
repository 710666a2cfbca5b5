"""GPA-AdamW: GPA around AdamW in one fused update, with a for-loop (the ground truth), foreach, CPU-kernel and
Triton paths.

One step with learning rate lr, AdamW direction d and weight decay wd (paper, Algorithm 1):

    z' = (1 - lr wd) z - lr d
    x' = mu_x x + (1 - mu_x) z'
    y' = mu_y x' + (1 - mu_y) z'  =  y + (1 - mu_x) (z - y) + (1 - mu_x mu_y) (z' - z)

The last identity (with x = (y - (1 - mu_y) z) / mu_y) is what lets the optimizer update y without storing x. It is
written as small corrections added to y rather than as mu_x mu_y x + (1 - mu_x mu_y) z': the rounding error is then
that of the corrections, and where x = z a step with lr = 0 leaves y bitwise unchanged.

As in torch's ``adam.py``: ``GPAAdamW.step()`` is ``_init_group`` plus one call of the functional `gpa_adamw`, which
picks `_single_tensor_gpa_adamw` (the for-loop, the ground truth), `_multi_tensor_gpa_adamw` (foreach) or
`_fused_gpa_adamw` (the C++ kernel ``kernels/csrc/gpa_adamw.cpp`` on CPU, the Triton kernel
``kernels/triton_source.py`` on CUDA) by the rule of ``kernels.default_to_fused_or_foreach``; each does its own bias
correction. ``fused=None`` takes the fused kernel of the device where every tensor has one, and foreach inside it
for the tensors whose layouts a kernel cannot take.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._checks import check_adam, check_averaging, check_implementation, check_mu, check_state_dtype
from ._gpa_switch import GPASwitch
from ._tensors import authoritative_y, chunks, local_tensor, real_view
from ._types import (
    AVERAGING,
    BETAS,
    DEFAULT_AVERAGING,
    DEFAULT_BETAS,
    DEFAULT_EPS,
    DEFAULT_HALF_STATE,
    DEFAULT_LR,
    DEFAULT_MU_X,
    DEFAULT_MU_Y,
    DEFAULT_WEIGHT_DECAY,
    EPS,
    EXP_AVG,
    EXP_AVG_SQ,
    FOREACH,
    FUSED,
    HALF_DTYPES,
    HALF_STATE,
    LR,
    MAXIMIZE,
    MU_X,
    MU_Y,
    STEP,
    WEIGHT_DECAY,
    WEIGHT_SUM,
    Y_FP32,
    Z,
    state_dtype_for,
)
from .averaging import averaging_mu_x
from .kernels import PARAM_DTYPE, STATE_DTYPE, default_to_fused_or_foreach, fused_buckets
from .kernels.cpu import load_cpu_kernel

__all__ = ["GPAAdamW", "gpa_adamw"]


class GPAAdamW(GPASwitch):
    r"""GPA around AdamW, with fused single-pass kernels (C++ on CPU, Triton on CUDA).

    .. math::
        \begin{aligned}
            & m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \quad v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2,
              \quad g_t = \nabla f(y_t) \\
            & z_{t+1} = (1 - \gamma_t \lambda) z_t - \gamma_t \frac{m_t / (1 - \beta_1^t)}
              {\sqrt{v_t / (1 - \beta_2^t)} + \epsilon} \\
            & x_{t+1} = \mu_x x_t + (1 - \mu_x) z_{t+1}, \qquad y_{t+1} = \mu_y x_{t+1} + (1 - \mu_y) z_{t+1}
        \end{aligned}

    The parameters hold y; the state holds ``z``, ``exp_avg`` (m) and ``exp_avg_sq`` (v): 3.0x the parameter
    bytes for fp32 parameters. For bf16/fp16 parameters z, m and v are kept in float32 (z is the unrounded copy of
    the weights), and so is y: the state also holds ``y_fp32`` and the parameter holds it rounded, so x is as exact
    as float32 allows (rounding y to bf16 at every step would accumulate in x, amplified by 1 / mu_y). That is 16
    bytes of state per parameter, 8.0x the bytes of a bf16 parameter (4 bytes, a third, more than without the copy).
    The parameter stays authoritative: where it no longer equals ``y_fp32`` rounded (something else wrote it), the
    step starts from the parameter. ``state_dtype="param"`` trades that accuracy for memory: z, m and v in the
    parameter's dtype and no copy of y, 6 bytes per bf16 weight (torch's AdamW: 4).
    Weight decay is decoupled and acts on z, as in Algorithm 1 of the paper.
    ``mu_x = 0`` is AdamW; ``mu_y = 1`` is stochastic primal averaging. Call ``eval()`` before evaluating or saving
    (the parameters then hold x) and ``train()`` before the next step (y comes back bitwise).

    y is updated as y + (1 - mu_x) (z - y) + (1 - mu_x mu_y) (z' - z), so a step with lr = 0 from x = z (e.g. the
    first step) leaves y, z and x bitwise unchanged; with x != z, x still moves towards z, as the average should.
    Complex parameters are optimized as pairs of reals (``torch.view_as_real``), as torch's AdamW does.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate, a float or a one-element tensor (as in torch's AdamW; a 0-d CUDA tensor is read by the
            Triton kernel on the device), driven by the usual LR schedulers (default: 1e-3).
        betas: AdamW's coefficients for the running averages of the gradient and its square (default: (0.9, 0.999)).
        eps: term added to the denominator (default: 1e-8).
        weight_decay: decoupled weight decay on z (default: 0).
        mu_x: averaging constant of x in [0, 1); ``mu_x_from_inner_steps(H)`` maps DiLoCo's H (default:
            ``mu_x_from_inner_steps(32)`` = 0.996713).
        mu_y: interpolation constant of the gradient point y in (0, 1] (default: 0.7).
        averaging: ``"gpa"`` (exponential average with ``mu_x``) or ``"schedule_free"`` (Schedule-Free's average
            weighted by lr_t^2, paper eq. 5; ``mu_x`` is then unused; it reads lr on the host) (default: "gpa").
        foreach: use the foreach implementation; ``False`` (with ``fused`` unset) is the for-loop (default: None).
        fused: use the fused kernel of the device: the single-pass C++ kernel on CPU (built once per environment),
            the multi-tensor Triton kernel on CUDA (fp32/bf16/fp16 parameters; needs ``triton``). As in torch:
            ``True`` raises a ``RuntimeError`` where no kernel takes a parameter's device and dtype, ``False`` never
            fuses, ``None`` fuses where every parameter has a kernel and ``foreach`` is unset; a parameter whose
            tensors differ in layout takes foreach within the fused path (default: None).
        maximize: maximize the objective instead of minimizing it (default: False).
        state_dtype: the state of bf16/fp16 parameters: ``"float32"`` (z, m, v and y's float32 copy) or ``"param"``
            (z, m, v in the parameter's dtype, no copy of y; computed in float32 and rounded once per step). The
            fused kernels take float32 state only: such parameters take the foreach path inside the fused one.
            fp32/fp64 parameters are not affected (default: "float32").

    Paper: Defazio, Mishchenko, Raman, Shi, Xiao, "Smoothing DiLoCo with Primal Averaging for Faster Training of
    LLMs" (Generalized Primal Averaging).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = DEFAULT_LR,
        betas: tuple[float, float] = DEFAULT_BETAS,
        eps: float = DEFAULT_EPS,
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
        mu_x: float = DEFAULT_MU_X,
        mu_y: float = DEFAULT_MU_Y,
        *,
        averaging: str = DEFAULT_AVERAGING,
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
        state_dtype: str = DEFAULT_HALF_STATE,
    ) -> None:
        defaults = {
            LR: lr,
            BETAS: tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            EPS: eps,
            WEIGHT_DECAY: weight_decay,
            MU_X: mu_x,
            MU_Y: mu_y,
            AVERAGING: averaging,
            WEIGHT_SUM: 0.0,
            FOREACH: foreach,
            FUSED: fused,
            MAXIMIZE: maximize,
            HALF_STATE: state_dtype,
        }
        super().__init__(params, defaults)  # every group, these defaults filled in, passes `_check_group`

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        check_adam(group[BETAS], group[EPS], group[WEIGHT_DECAY])
        check_mu(group[MU_X], group[MU_Y])
        group[AVERAGING] = check_averaging(group[AVERAGING])
        check_implementation(group[FOREACH], group[FUSED])
        check_state_dtype(group[HALF_STATE])

    def _init_state(self, p: torch.Tensor, half_state: str = DEFAULT_HALF_STATE) -> dict[str, Any]:
        """Create what is missing of ``p``'s state (z = y, m = v = 0, step 0; y's float32 copy for bf16/fp16
        parameters whose state is float32, ``half_state`` deciding that for new state)."""
        state = self.state[p]
        if Z not in state:
            # Created lazily, after any wrapping (FSDP2 replaces parameters by DTensor shards in prepare()).
            dtype = p.dtype if half_state == "param" else state_dtype_for(p)
            z = p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format)
            state[STEP] = torch.tensor(0.0, dtype=torch.float32)
            state[Z] = z
            state[EXP_AVG] = torch.zeros_like(z, memory_format=torch.preserve_format)
            state[EXP_AVG_SQ] = torch.zeros_like(z, memory_format=torch.preserve_format)
        if p.dtype in HALF_DTYPES and Y_FP32 not in state and state[Z].dtype == torch.float32:
            # Also for state saved before this copy existed: the parameter holds y rounded, a fine start.
            state[Y_FP32] = p.detach().to(dtype=torch.float32, copy=True, memory_format=torch.preserve_format)
        return state

    def _create_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p, group[HALF_STATE])

    def _init_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        zs: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        y32s: list[torch.Tensor | None],
        state_steps: list[torch.Tensor],
    ) -> bool:
        """Fill the lists with the local tensors of every parameter with a gradient (state created on first use), as
        torch's ``Adam._init_group`` does; return whether any is complex."""
        has_complex = False
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("GPAAdamW does not support sparse gradients")
            state = self.state[p]
            if Y_FP32 not in state and (Z not in state or p.dtype in HALF_DTYPES):
                self._init_state(p, group[HALF_STATE])
            has_complex |= torch.is_complex(p)
            params.append(local_tensor(p))
            grads.append(local_tensor(p.grad))
            zs.append(local_tensor(state[Z]))
            exp_avgs.append(local_tensor(state[EXP_AVG]))
            exp_avg_sqs.append(local_tensor(state[EXP_AVG_SQ]))
            y32 = state.get(Y_FP32)
            y32s.append(None if y32 is None else local_tensor(y32))
            state_steps.append(state[STEP])
        return has_complex

    def _adoptable_keys(self, saved_group: dict[str, Any]) -> set[str] | None:
        # An Adam/AdamW run (without amsgrad) continues as GPA-AdamW: z = y = the current weights, m, v, step kept.
        return None if saved_group.get("amsgrad") else {STEP, EXP_AVG, EXP_AVG_SQ}

    def _adopts(self) -> str:
        return "Adam/AdamW (per-parameter state ['exp_avg', 'exp_avg_sq', 'step'], no amsgrad)"

    def _implementation(self, group: dict[str, Any], params: list[torch.Tensor]) -> str:
        """The group's path: "forloop", "foreach" or "fused" (`kernels.default_to_fused_or_foreach`)."""
        use_fused, use_foreach = default_to_fused_or_foreach(params, group[FOREACH], group[FUSED])
        return "fused" if use_fused else "foreach" if use_foreach else "forloop"

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss at y (optional)."""
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            hyper = self._begin_group_step(group)
            self._step_params(group, params, hyper)
        return loss

    def _begin_group_step(self, group: dict[str, Any]) -> dict[str, Any]:
        """What runs once per group and training step, however its parameters are stepped: this step's mu_x (the
        Schedule-Free weight sum advanced); returns the keyword arguments of `gpa_adamw` for the step."""
        mu_x, group[WEIGHT_SUM] = averaging_mu_x(group[AVERAGING], group[MU_X], group[LR], group[WEIGHT_SUM])
        beta1, beta2 = group[BETAS]
        return dict(
            foreach=group[FOREACH], fused=group[FUSED], lr=group[LR], beta1=beta1, beta2=beta2, eps=group[EPS],
            weight_decay=group[WEIGHT_DECAY], mu_x=mu_x, mu_y=group[MU_Y], maximize=group[MAXIMIZE],
        )  # fmt: skip

    @torch.no_grad()
    def _step_params(self, group: dict[str, Any], params: list[torch.Tensor], hyper: dict[str, Any]) -> None:
        """Update exactly ``params`` (each with a gradient) of ``group`` with this step's ``hyper``
        (`_begin_group_step`), creating missing state and advancing their step counts."""
        grads: list[torch.Tensor] = []
        zs: list[torch.Tensor] = []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        y32s: list[torch.Tensor | None] = []
        state_steps: list[torch.Tensor] = []
        local_params: list[torch.Tensor] = []
        # _init_group reads the group's parameters and state dtype: handed the group with only these parameters.
        has_complex = self._init_group(
            {**group, "params": params}, local_params, grads, zs, exp_avgs, exp_avg_sqs, y32s, state_steps
        )
        gpa_adamw(local_params, grads, zs, exp_avgs, exp_avg_sqs, y32s, state_steps, has_complex=has_complex, **hyper)


def gpa_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    zs: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    y32s: list[torch.Tensor | None],
    state_steps: list[torch.Tensor],
    *,
    foreach: bool | None = None,
    fused: bool | None = None,
    has_complex: bool = False,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mu_x: float,
    mu_y: float,
    maximize: bool,
) -> None:
    """Functional API of GPA-AdamW's step (see `GPAAdamW`): the parameters hold y, updated in place with z, m, v,
    y's float32 copies (None for fp32/fp64 parameters) and the step counts; ``mu_x`` is this step's weight on the
    old average (``averaging.averaging_mu_x``)."""
    if has_complex:  # complex tensors as pairs of reals, as torch's AdamW does
        params, grads, zs, exp_avgs, exp_avg_sqs = (
            [real_view(t) for t in lst] for lst in (params, grads, zs, exp_avgs, exp_avg_sqs)
        )
    use_fused, use_foreach = default_to_fused_or_foreach(params, foreach, fused)
    if torch.is_tensor(lr):
        lr = lr.squeeze()  # a one-element lr of any shape is its 0-d value (torch's AdamW does the same)
    if use_fused:
        func = _fused_gpa_adamw
    elif use_foreach:
        func = _multi_tensor_gpa_adamw
    else:
        func = _single_tensor_gpa_adamw
    func(
        params, grads, zs, exp_avgs, exp_avg_sqs, y32s, state_steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, mu_x=mu_x, mu_y=mu_y, maximize=maximize,
    )  # fmt: skip


def _single_tensor_gpa_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    zs: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    y32s: list[torch.Tensor | None],
    state_steps: list[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mu_x: float,
    mu_y: float,
    maximize: bool,
) -> None:
    """The ground truth: one tensor at a time, plain ops, in the state dtype (``y32``: y's float32 copy, or None).

    State kept in a half-precision dtype (``state_dtype="param"``) is computed in float32 and rounded once at the end.
    """
    lr = float(lr)
    for y, g, z, m, v, y32, step_t in zip(params, grads, zs, exp_avgs, exp_avg_sqs, y32s, state_steps):
        if z.dtype in HALF_DTYPES:
            wide = [t.float() for t in (z, m, v)]
            _single_tensor_gpa_adamw(
                [y], [g], *([t] for t in wide), [y32], [step_t], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, mu_x=mu_x, mu_y=mu_y, maximize=maximize,
            )  # fmt: skip
            torch._foreach_copy_([z, m, v], wide)
            continue
        step_t += 1
        step = step_t.item()  # step lives on the CPU: no device synchronization
        bias_correction1 = 1.0 - beta1**step
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
        g = g.to(z.dtype)
        if maximize:
            g = -g
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        delta = torch.mul(z, -lr * weight_decay).addcdiv_(m, denom, value=-lr / bias_correction1)  # z' - z
        y_acc = authoritative_y(y, y32, z.dtype)
        y_acc.add_(torch.sub(z, y_acc), alpha=1.0 - mu_x).add_(delta, alpha=1.0 - mu_x * mu_y)
        z.add_(delta)
        if y32 is not None:
            y32.copy_(y_acc)
        y.copy_(y_acc)




def _multi_tensor_gpa_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    zs: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    y32s: list[torch.Tensor | None],
    state_steps: list[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mu_x: float,
    mu_y: float,
    maximize: bool,
) -> None:
    """The same update as `_single_tensor_gpa_adamw` with foreach ops, one call per (device, dtype) bucket."""
    torch._foreach_add_(state_steps, 1.0)
    _foreach_update(
        params, grads, zs, exp_avgs, exp_avg_sqs, y32s, [step.item() for step in state_steps], lr=float(lr),
        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, mu_x=mu_x, mu_y=mu_y, maximize=maximize,
    )  # fmt: skip


def _foreach_update(
    ys: list[torch.Tensor],
    gs: list[torch.Tensor],
    zs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    y32s: list[torch.Tensor | None],
    step_counts: list[float],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mu_x: float,
    mu_y: float,
    maximize: bool,
) -> None:
    """`_multi_tensor_gpa_adamw` with the step counts already advanced (also the fused path's fallback)."""
    grouped = torch.optim.Optimizer._group_tensors_by_device_and_dtype([ys, gs, zs, ms, vs], with_indices=True)
    for (y_b, g_b, z_b, m_b, v_b), indices in grouped.values():
        if z_b[0].dtype in HALF_DTYPES:
            # state_dtype="param": computed in float32 and rounded once at the end, a piece at a time, so that the
            # float32 copies of z, m and v are a few MB, not the whole bucket (32 bytes per weight at once).
            for k, i in enumerate(indices):
                for _, (y, g, z, m, v) in chunks(y_b[k], g_b[k], z_b[k], m_b[k], v_b[k]):
                    z32, m32, v32 = z.float(), m.float(), v.float()
                    _foreach_update(
                        [y], [g], [z32], [m32], [v32], [None], [step_counts[i]], lr=lr, beta1=beta1, beta2=beta2,
                        eps=eps, weight_decay=weight_decay, mu_x=mu_x, mu_y=mu_y, maximize=maximize,
                    )  # fmt: skip
                    torch._foreach_copy_([z, m, v], [z32, m32, v32])
            continue
        state_dtype = z_b[0].dtype
        g_acc = [g.to(state_dtype) for g in g_b]
        if maximize:
            g_acc = torch._foreach_neg(g_acc)
        torch._foreach_lerp_(m_b, g_acc, 1.0 - beta1)
        torch._foreach_mul_(v_b, beta2)
        torch._foreach_addcmul_(v_b, g_acc, g_acc, 1.0 - beta2)
        denom = torch._foreach_sqrt(v_b)
        torch._foreach_div_(denom, [math.sqrt(1.0 - beta2 ** step_counts[i]) for i in indices])
        torch._foreach_add_(denom, eps)
        delta = torch._foreach_mul(z_b, -lr * weight_decay)
        torch._foreach_addcdiv_(delta, m_b, denom, [-lr / (1.0 - beta1 ** step_counts[i]) for i in indices])
        # fp32/fp64 parameters accumulate in place; bf16/fp16 ones in float32 (their float32 copy of y).
        in_place = [y.dtype == state_dtype and y32s[i] is None for y, i in zip(y_b, indices)]
        y_acc = [y if ip else authoritative_y(y, y32s[i], state_dtype) for y, i, ip in zip(y_b, indices, in_place)]
        torch._foreach_add_(y_acc, torch._foreach_sub(z_b, y_acc), alpha=1.0 - mu_x)
        torch._foreach_add_(y_acc, delta, alpha=1.0 - mu_x * mu_y)
        torch._foreach_add_(z_b, delta)
        y32_b = [y32s[i] for i in indices if y32s[i] is not None]
        if y32_b:
            torch._foreach_copy_(y32_b, [a for a, i in zip(y_acc, indices) if y32s[i] is not None])
        copied = [k for k, ip in enumerate(in_place) if not ip]
        if copied:
            torch._foreach_copy_([y_b[k] for k in copied], [y_acc[k] for k in copied])


def _fused_gpa_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    zs: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    y32s: list[torch.Tensor | None],
    state_steps: list[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mu_x: float,
    mu_y: float,
    maximize: bool,
) -> None:
    """The fused kernels on every tensor they take (one C++ call, or one Triton launch per device, dtype and step
    count), foreach on the rest (tensors of one parameter that differ in layout)."""
    torch._foreach_add_(state_steps, 1.0)
    step_counts = [step.item() for step in state_steps]
    buckets, rest = fused_buckets(
        params,
        [(grads, PARAM_DTYPE), (zs, STATE_DTYPE), (exp_avgs, STATE_DTYPE), (exp_avg_sqs, STATE_DTYPE),
         (y32s, STATE_DTYPE)],
        triton_key=step_counts.__getitem__,
    )  # fmt: skip
    hyper = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, mu_x=mu_x, mu_y=mu_y, maximize=maximize)
    for (kernel, device, _, step, absent), idx in buckets.items():
        y_b, g_b, z_b, m_b, v_b = ([lst[i] for i in idx] for lst in (params, grads, zs, exp_avgs, exp_avg_sqs))
        y32_b = None if absent[-1] else [y32s[i] for i in idx]
        if kernel == "cpu":  # the C++ kernel takes a step size and a bias correction per tensor
            lr_f = float(lr)
            step_sizes = [lr_f / (1.0 - beta1 ** step_counts[i]) for i in idx]
            bias_corrections2_sqrt = [math.sqrt(1.0 - beta2 ** step_counts[i]) for i in idx]
            load_cpu_kernel().gpa_adamw_step(
                y_b, g_b, z_b, m_b, v_b, y32_b or [], step_sizes, bias_corrections2_sqrt, lr_f, beta1, beta2, eps,
                weight_decay, mu_x, mu_y, maximize,
            )  # fmt: skip
        else:
            from .kernels import triton_launch

            lr_arg = lr if torch.is_tensor(lr) and lr.device == device else float(lr)
            triton_launch.gpa_adamw_step(
                y_b, g_b, z_b, m_b, v_b, y32_b, lr=lr_arg, bc1=1.0 - beta1**step,
                bc2_sqrt=math.sqrt(1.0 - beta2**step), **hyper,
            )  # fmt: skip
    if rest:
        picked = [[lst[i] for i in rest] for lst in (params, grads, zs, exp_avgs, exp_avg_sqs, y32s, step_counts)]
        _foreach_update(*picked, lr=float(lr), **hyper)
