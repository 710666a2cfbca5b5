"""GPA-AdamW: GPA around AdamW in one fused update, with a for-loop (the ground truth), foreach, CPU-kernel and
Triton paths.

One step with learning rate lr, AdamW direction d and weight decay wd (paper, Algorithm 1):

    z' = (1 - lr wd) z - lr d
    x' = mu_x x + (1 - mu_x) z'
    y' = mu_y x' + (1 - mu_y) z'  =  y + (1 - mu_x) (z - y) + (1 - mu_x mu_y) (z' - z)

The last identity (with x = (y - (1 - mu_y) z) / mu_y) is what lets the optimizer update y without storing x. It is
written as small corrections added to y rather than as mu_x mu_y x + (1 - mu_x mu_y) z': the rounding error is then
that of the corrections, and where x = z a step with lr = 0 leaves y bitwise unchanged.

As in torch's ``adam.py``, with the per-step host work of torch's fused path: ``GPAAdamW.step()`` takes, for each
group, its parameters with a gradient, resolves the group's hyper-parameters once (``_begin_group_step``: lr, this
step's mu_x) and runs their cached step plan (``_step_params``; ``_step_plan.StepPlan``: the implementation and the
per-tensor buckets decided once, the step counters advanced by one op) through the functional `gpa_adamw`, which
calls `_single_tensor_gpa_adamw` (the for-loop, the ground truth), `_multi_tensor_gpa_adamw` (foreach) or
`_fused_gpa_adamw` (the C++ kernel ``kernels/csrc/gpa_adamw.cpp`` on CPU, the Triton kernel
``kernels/triton_source.py`` on CUDA), picked by the rule of ``kernels.default_to_fused_or_foreach``; each takes its
bias corrections from `_step_plan.bias_corrections`. ``fused=None`` takes the fused kernel of the device where every
tensor has one, and foreach inside it for the tensors a kernel cannot take (layouts, state dtypes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._checks import check_adam, check_averaging, check_implementation, check_mu, check_state_dtype
from ._compact import join24, split24_
from ._gpa_switch import GPASwitch
from ._step_plan import AdamWHyper, Bucket, StepPlan, bias_corrections
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
    Y_LO,
    Z_LO,
    Z,
    state_dtype_for,
)
from .averaging import averaging_mu_x
from .kernels import FORCE, default_to_fused_or_foreach, kernel_module

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
    bytes for fp32 parameters. y and z of bf16/fp16 parameters need more than their 8 (or 11) bits: rounding y to
    bf16 at every step would accumulate in x, amplified by 1 / mu_y. By default (``state_dtype="compact"``) bf16
    parameters keep y and z as 24-bit values, the parameter (y's high word) or z's bf16 high word and an int8 low
    word each (``y_lo``, ``z_lo``; see ``_compact``), and m and v in bf16: 8 bytes of state per weight, with the
    accuracy of float32 state (docs/memory.md). ``state_dtype="float32"`` keeps z, m, v and a float32 copy of y
    (``y_fp32``, the parameter holds it rounded), x as exact as float32 allows, 16 bytes per weight; fp16 parameters
    keep this state under either mode. A parameter written by something else is taken: exactly where it no longer
    equals ``y_fp32`` rounded, with y's low word under ``"compact"`` (y then rounds to the written value).
    ``state_dtype="param"`` trades the accuracy for memory: z, m and v in the parameter's dtype and no copy of y, 6
    bytes per bf16 weight (torch's AdamW: 4).
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
        state_dtype: the state of bf16/fp16 parameters: ``"float32"`` (z, m, v and y's float32 copy, 16 bytes per
            weight), ``"compact"`` (bf16 parameters: 24-bit y and z, m and v in bf16, 8 bytes; fp16 ones keep
            ``"float32"``'s state) or ``"param"`` (z, m, v in the parameter's dtype, no copy of y, 6 bytes); the last
            two are computed in float32 and rounded once per step. The fused kernels take ``"float32"`` and
            ``"compact"``; ``"param"`` state takes the foreach path inside the fused one. fp32/fp64 parameters are not
            affected (default: "compact").

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

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._plans = {}  # unpickled, or loaded (torch's load_state_dict ends here): plans of the old state go

    def _init_state(self, p: torch.Tensor, half_state: str = DEFAULT_HALF_STATE) -> dict[str, Any]:
        """Create what is missing of ``p``'s state (z = y, m = v = 0, step 0; y's float32 copy for bf16/fp16
        parameters whose state is float32, ``half_state`` deciding that for new state; the low words of y and z,
        zero, for bf16 parameters under ``"compact"``)."""
        state = self.state[p]
        if Z not in state:
            # Created lazily, after any wrapping (FSDP2 replaces parameters by DTensor shards in prepare()).
            compact = half_state == "compact" and p.dtype == torch.bfloat16
            dtype = p.dtype if half_state == "param" or compact else state_dtype_for(p)
            z = p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format)
            state[STEP] = torch.tensor(0.0, dtype=torch.float32)
            state[Z] = z
            state[EXP_AVG] = torch.zeros_like(z, memory_format=torch.preserve_format)
            state[EXP_AVG_SQ] = torch.zeros_like(z, memory_format=torch.preserve_format)
            if compact:  # y and z are then exactly the bf16 parameter's value: their low words are zero
                state[Y_LO] = torch.zeros_like(z, dtype=torch.int8, memory_format=torch.preserve_format)
                state[Z_LO] = torch.zeros_like(z, dtype=torch.int8, memory_format=torch.preserve_format)
        if p.dtype in HALF_DTYPES and Y_FP32 not in state and state[Z].dtype == torch.float32:
            # Also for state saved before this copy existed: the parameter holds y rounded, a fine start.
            state[Y_FP32] = p.detach().to(dtype=torch.float32, copy=True, memory_format=torch.preserve_format)
        return state

    def _create_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p, group[HALF_STATE])

    def _adoptable_keys(self, saved_group: dict[str, Any]) -> set[str] | None:
        # An Adam/AdamW run (without amsgrad) continues as GPA-AdamW: z = y = the current weights, m, v, step kept.
        return None if saved_group.get("amsgrad") else {STEP, EXP_AVG, EXP_AVG_SQ}

    def _adopts(self) -> str:
        return "Adam/AdamW (per-parameter state ['exp_avg', 'exp_avg_sq', 'step'], no amsgrad)"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._plans: dict[tuple, StepPlan] = {}  # a new group: every plan is rebuilt (torch's __init__ comes here)

    def _reset_state(self) -> None:
        super()._reset_state()
        self._plans.clear()

    def _implementation(self, group: dict[str, Any], params: list[torch.Tensor]) -> str:
        """The group's path: "forloop", "foreach" or "fused" (`kernels.default_to_fused_or_foreach`)."""
        use_fused, use_foreach = default_to_fused_or_foreach(params, group[FOREACH], group[FUSED])
        return "fused" if use_fused else "foreach" if use_foreach else "forloop"

    def _plan(self, group: dict[str, Any], params: list[torch.Tensor], rebuild: bool = False) -> StepPlan:
        """The cached plan of these parameters (built, their state created, on first use; see `_step_plan`)."""
        key = (FORCE["backend"], group[FOREACH], group[FUSED], *map(id, params))
        plan = self._plans.get(key)
        if plan is not None and plan.valid() and not rebuild:
            return plan
        _check_dense_grads(params)
        for p in params:
            state = self.state[p]
            if Y_FP32 not in state and (Z not in state or p.dtype in HALF_DTYPES):
                self._init_state(p, group[HALF_STATE])
        locals_ = [real_view(local_tensor(p)) for p in params]
        bind_steps = len(params) > 1  # one parameter from a backward hook: its own counter, the group's plan kept
        # Built rarely, so pruned here: plans holding a parameter no group holds any more (they would keep it and its
        # state alive), and, where this plan binds the counters as views of its own tensor, every other binding plan.
        current = {id(q) for g in self.param_groups for q in g["params"]}
        stale = [
            k
            for k, v in self._plans.items()
            if not all(id(q) in current for q in v.params) or (bind_steps and v.flat_steps is not None)
        ]
        for k in stale:  # in place: torch.compile before torch 2.13 refuses to rebind an optimizer's attribute
            del self._plans[k]
        impl = self._implementation(group, locals_)
        plan = StepPlan(list(params), [self.state[p] for p in params], impl, bind_steps)
        self._plans[key] = plan
        return plan

    def _begin_group_step(self, group: dict[str, Any]) -> AdamWHyper:
        """What is done once per group and training step: this step's mu_x (advancing Schedule-Free's weight sum)
        and the resolved hyper-parameters."""
        mu_x, group[WEIGHT_SUM] = averaging_mu_x(group[AVERAGING], group[MU_X], group[LR], group[WEIGHT_SUM])
        lr = group[LR]
        if torch.is_tensor(lr):
            lr = lr.squeeze()  # a one-element lr of any shape is its 0-d value (torch's AdamW does the same)
        beta1, beta2 = group[BETAS]
        return AdamWHyper(lr, beta1, beta2, group[EPS], group[WEIGHT_DECAY], mu_x, group[MU_Y], group[MAXIMIZE])

    @torch.no_grad()
    def _step_params(self, group: dict[str, Any], params: list[torch.Tensor], hyper: AdamWHyper) -> None:
        """Update exactly ``params`` (some of ``group``'s, each with a gradient), creating missing state and advancing
        their step counts; bitwise what `step` computes for them."""
        plan = self._plan(group, params)
        grads = plan.grads()
        if not plan.fits(grads):  # new storage or a gradient of another layout: decided again
            plan = self._plan(group, params, rebuild=True)
            grads = plan.grads()
        gpa_adamw(plan, grads, hyper)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss at y (optional)."""
        loss = self._closure_loss(closure)
        work = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        for _, params in work:  # before any work: a step that raises changes nothing
            _check_dense_grads(params)
        for group, params in work:
            if params:
                self._step_params(group, params, self._begin_group_step(group))
        return loss


def _check_dense_grads(params: list[torch.Tensor]) -> None:
    if any(p.grad.is_sparse for p in params):
        raise RuntimeError("GPAAdamW does not support sparse gradients")


def gpa_adamw(plan: StepPlan, grads: list[torch.Tensor], hyper: AdamWHyper) -> None:
    """Functional API of GPA-AdamW's step (see `GPAAdamW`): the plan's parameters hold y, updated in place with
    their state (z, m, v, y's float32 copy, the step counts); the plan names the implementation, torch's rule."""
    func = {
        "fused": _fused_gpa_adamw, "foreach": _multi_tensor_gpa_adamw, "forloop": _single_tensor_gpa_adamw
    }[plan.impl]  # fmt: skip
    func(plan, grads, hyper)


def _single_tensor_gpa_adamw(plan: StepPlan, grads: list[torch.Tensor], hyper: AdamWHyper) -> None:
    """The ground truth: one tensor at a time, plain ops, in the state dtype.

    State kept in a half-precision dtype (``state_dtype="param"``) is computed in float32 and rounded once at the end;
    so is the 24-bit y and z of ``state_dtype="compact"`` (`_compact`).
    """
    (bucket,) = plan.buckets
    ys, zs, ms, vs, y32s = plan.bucket_tensors(bucket)
    nones = [None] * len(ys)
    y_los, z_los = bucket.lows or (nones, nones)
    tensors = zip(ys, grads, zs, ms, vs, y32s or nones, y_los, z_los, plan.step_tensors())
    for y, g, z, m, v, y32, y_lo, z_lo, step_t in tensors:
        step_t += 1
        step = step_t.item()  # step lives on the CPU: no device sync
        if z.dtype not in HALF_DTYPES:
            _single_tensor_update(y, g, z, m, v, y32, step, hyper)
            continue
        half = (y, z, m, v, y_lo, z_lo)
        wide = _widened(half)
        y_w, z_w, m_w, v_w = wide
        _single_tensor_update(y_w, g, z_w, m_w, v_w, y32, step, hyper)
        _narrow_(wide, half)


#: A tensor's half-precision state as `_widened` and `_narrow_` take it: (y, z, m, v, y_lo, z_lo), the low words of y
#: and z None except with ``state_dtype="compact"``.
HalfState = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _widened(state: HalfState) -> tuple[torch.Tensor, ...]:
    """float32 working copies (y, z, m, v) of half-precision state: y and z joined with their low words
    (``state_dtype="compact"``, `_compact`), or z, m and v widened with y left as it is (``"param"``); `_narrow_`
    rounds them back once."""
    y, z, m, v, y_lo, z_lo = state
    if y_lo is None:
        return y, z.float(), m.float(), v.float()
    return join24(y, y_lo), join24(z, z_lo), m.float(), v.float()


def _narrow_(wide: tuple[torch.Tensor, ...], state: HalfState) -> None:
    """Round `_widened`'s working copies back into the state (and y's low word) once."""
    y_w, z_w, m_w, v_w = wide
    y, z, m, v, y_lo, z_lo = state
    if y_lo is None:
        torch._foreach_copy_([z, m, v], [z_w, m_w, v_w])
        return
    split24_(y_w, y, y_lo)
    split24_(z_w, z, z_lo)
    torch._foreach_copy_([m, v], [m_w, v_w])


def _single_tensor_update(
    y: torch.Tensor,
    g: torch.Tensor,
    z: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    y32: torch.Tensor | None,
    step: float,
    h: AdamWHyper,
) -> None:
    lr = float(h.lr)
    bias_correction1, bias_correction2_sqrt = bias_corrections(h.beta1, h.beta2, step)
    g = g.to(z.dtype)
    if h.maximize:
        g = -g
    m.lerp_(g, 1.0 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
    denom = (v.sqrt() / bias_correction2_sqrt).add_(h.eps)
    delta = torch.mul(z, -lr * h.weight_decay).addcdiv_(m, denom, value=-lr / bias_correction1)  # z' - z
    y_acc = authoritative_y(y, y32, z.dtype)
    y_acc.add_(torch.sub(z, y_acc), alpha=1.0 - h.mu_x).add_(delta, alpha=1.0 - h.mu_x * h.mu_y)
    z.add_(delta)
    if y32 is not None:
        y32.copy_(y_acc)
    y.copy_(y_acc)


def _multi_tensor_gpa_adamw(plan: StepPlan, grads: list[torch.Tensor], hyper: AdamWHyper) -> None:
    """The same update as `_single_tensor_gpa_adamw` with foreach ops, one call per foreach group of the plan."""
    counts, uniform = plan.advance_steps()
    lr = float(hyper.lr)
    for bucket in plan.buckets:
        _foreach_update(plan, bucket, grads, counts, uniform, lr, hyper)


def _bucket_steps(bucket: Bucket, counts: list[float], uniform: float | None) -> float | list[float]:
    """The bucket's step count where all are equal, else one per tensor."""
    return uniform if uniform is not None else [counts[i] for i in bucket.idx]


def _foreach_update(
    plan: StepPlan,
    bucket: Bucket,
    grads: list[torch.Tensor],
    counts: list[float],
    uniform: float | None,
    lr: float,
    h: AdamWHyper,
) -> None:
    """One foreach group (one device, every tensor's dtype alike) with the step counts already advanced."""
    y_b, z_b, m_b, v_b, y32_b = plan.bucket_tensors(bucket)
    g_b = grads if bucket.whole else [grads[i] for i in bucket.idx]
    steps = _bucket_steps(bucket, counts, uniform)
    if z_b[0].dtype in HALF_DTYPES:
        # state_dtype="compact" or "param": computed in float32 (`_widened`) and rounded once at the end, a piece at a
        # time, so that the float32 copies are a few MB, not the whole bucket (up to 32 bytes per weight at once).
        nones = [None] * len(y_b)
        y_los, z_los = bucket.lows or (nones, nones)
        for k in range(len(y_b)):
            step = steps if uniform is not None else steps[k]
            lows = () if y_los[k] is None else (y_los[k], z_los[k])
            for _, (y, g, z, m, v, *lo) in chunks(y_b[k], g_b[k], z_b[k], m_b[k], v_b[k], *lows):
                half = (y, z, m, v, *(lo or (None, None)))
                wide = _widened(half)
                y_w, z_w, m_w, v_w = wide
                _foreach_math(([y_w], [g], [z_w], [m_w], [v_w], None), step, lr, h)
                _narrow_(wide, half)
        return
    _foreach_math((y_b, g_b, z_b, m_b, v_b, y32_b), steps, lr, h)


def _foreach_math(
    tensors: tuple[list[torch.Tensor] | None, ...], steps: float | list[float], lr: float, h: AdamWHyper
) -> None:
    """The update over y, g, z, m, v and y32 (None: absent) lists of one device and dtypes, with foreach ops."""
    y_b, g_b, z_b, m_b, v_b, y32_b = tensors
    state_dtype = z_b[0].dtype
    g_acc = g_b if g_b[0].dtype == state_dtype else [g.to(state_dtype) for g in g_b]
    if h.maximize:
        g_acc = torch._foreach_neg(g_acc)
    if isinstance(steps, list):
        bcs = [bias_corrections(h.beta1, h.beta2, s) for s in steps]
        step_size: float | list[float] = [-lr / bc1 for bc1, _ in bcs]
        bc2_sqrt: float | list[float] = [bc2 for _, bc2 in bcs]
    else:
        bc1, bc2_sqrt = bias_corrections(h.beta1, h.beta2, steps)
        step_size = -lr / bc1
    torch._foreach_lerp_(m_b, g_acc, 1.0 - h.beta1)
    torch._foreach_mul_(v_b, h.beta2)
    torch._foreach_addcmul_(v_b, g_acc, g_acc, 1.0 - h.beta2)
    denom = torch._foreach_sqrt(v_b)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, h.eps)
    delta = torch._foreach_mul(z_b, -lr * h.weight_decay)
    torch._foreach_addcdiv_(delta, m_b, denom, step_size)
    # fp32/fp64 parameters accumulate in place; bf16/fp16 ones in float32 (their float32 copy of y, if any).
    in_place = y_b[0].dtype == state_dtype
    y32_or_none = y32_b or [None] * len(y_b)
    y_acc = y_b if in_place else [authoritative_y(y, y32, state_dtype) for y, y32 in zip(y_b, y32_or_none)]
    torch._foreach_add_(y_acc, torch._foreach_sub(z_b, y_acc), alpha=1.0 - h.mu_x)
    torch._foreach_add_(y_acc, delta, alpha=1.0 - h.mu_x * h.mu_y)
    torch._foreach_add_(z_b, delta)
    if y32_b is not None:
        torch._foreach_copy_(y32_b, y_acc)
    if not in_place:
        torch._foreach_copy_(y_b, y_acc)


def _fused_gpa_adamw(plan: StepPlan, grads: list[torch.Tensor], hyper: AdamWHyper) -> None:
    """The fused kernels on every tensor they take (one C++ call, one Triton launch per device, dtype and step
    count), foreach on the rest (layouts or dtypes a kernel does not take)."""
    counts, uniform = plan.advance_steps()
    for bucket in plan.buckets:
        if bucket.kind == "foreach":
            _foreach_update(plan, bucket, grads, counts, uniform, float(hyper.lr), hyper)
            continue
        y_b, z_b, m_b, v_b, y32_b = plan.bucket_tensors(bucket)
        g_b = grads if bucket.whole else [grads[i] for i in bucket.idx]
        if uniform is not None:
            bc1, bc2_sqrt = bias_corrections(hyper.beta1, hyper.beta2, uniform)
            bc1s, bc2_sqrts = [bc1] * len(y_b), [bc2_sqrt] * len(y_b)
        else:
            bcs = [bias_corrections(hyper.beta1, hyper.beta2, counts[i]) for i in bucket.idx]
            bc1s, bc2_sqrts = [bc1 for bc1, _ in bcs], [bc2 for _, bc2 in bcs]
        lr = hyper.lr  # a tensor on the tensors' device is read by the Triton kernel itself
        if bucket.kind == "cpu" or not (torch.is_tensor(lr) and lr.device == y_b[0].device):
            lr = float(lr)
        kernel = kernel_module(bucket.kind)
        if bucket.lows is not None:  # state_dtype="compact": the kernels' 24-bit update, with the low words
            launch, extra = kernel.gpa_adamw_step_compact, bucket.lows
        else:  # float32 state, with y's float32 copies where there are any
            launch, extra = kernel.gpa_adamw_step, (y32_b or [],)
        launch(
            y_b, g_b, z_b, m_b, v_b, *extra, bc1s, bc2_sqrts, lr, hyper.beta1, hyper.beta2, hyper.eps,
            hyper.weight_decay, hyper.mu_x, hyper.mu_y, hyper.maximize,
        )  # fmt: skip
