"""GPA-AdamW: GPA around AdamW in one fused update, with a for-loop (the ground truth), foreach, CPU-kernel and
Triton paths.

One step with learning rate lr, AdamW direction d and weight decay wd (paper, Algorithm 1):

    z' = (1 - lr wd) z - lr d
    x' = mu_x x + (1 - mu_x) z'
    y' = mu_y x' + (1 - mu_y) z'  =  y + (1 - mu_x) (z - y) + (1 - mu_x mu_y) (z' - z)

The last identity (with x = (y - (1 - mu_y) z) / mu_y) is what lets the optimizer update y without storing x. It is
written as small corrections added to y rather than as mu_x mu_y x + (1 - mu_x mu_y) z': the rounding error is then
that of the corrections, and where x = z a step with lr = 0 leaves y bitwise unchanged.

As in torch's ``adam.py``: the functional `gpa_adamw` takes plain tensor lists (params, grads, z, m, v, step counts,
and the layout's own tensors) and calls `_single_tensor_gpa_adamw` (the for-loop, the ground truth),
`_multi_tensor_gpa_adamw` (foreach) or `_fused_gpa_adamw` (the C++ kernel ``kernels/csrc/gpa_adamw.cpp`` on CPU,
the Triton kernel ``kernels/triton_source.py`` on CUDA), picked by the rule of ``kernels.default_to_fused_or_foreach``;
each takes its bias corrections from `bias_corrections`. What a parameter's state holds, how the paths widen it to
float32 and round it back, and which tensors a kernel takes, is its layout's (``_state_layout``). ``GPAAdamW.step()``
runs each group's cached `_Plan` (the implementation, the buckets and the tensor lists decided once, the step
counters advanced by one op; torch's fused AdamW keeps its host work per step as constant) through the same paths:
``_begin_group_step`` resolves a group's hyper-parameters once (lr, this step's mu_x), ``_step_params`` updates some of
its parameters (a step inside backward calls it one parameter at a time). ``fused=None`` takes the fused kernel of
the device where every tensor has one, and foreach inside it for the tensors a kernel cannot take (memory layouts,
state dtypes, a gradient of another dtype).
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import check_adam, check_averaging, check_implementation, check_mu, check_state_dtype
from ._gpa_switch import GPASwitch, follow_half_cast_, to_eval_, x_mu_y, y_across_cast
from ._state_layout import (
    COMPACT,
    FLOAT32,
    PARAM,
    StateLayout,
    convert_,
    layout_for,
    layout_of,
    refusal,
)
from ._tensors import chunks, is_dtensor, local_tensor, real_view
from ._types import (
    AVERAGING,
    BETAS,
    DEFAULT_AVERAGING,
    DEFAULT_BETAS,
    DEFAULT_EPS,
    DEFAULT_LR,
    DEFAULT_MU_X,
    DEFAULT_MU_Y,
    DEFAULT_STATE_DTYPE,
    DEFAULT_WEIGHT_DECAY,
    EPS,
    FOREACH,
    FUSED,
    LR,
    MAXIMIZE,
    MU_X,
    MU_Y,
    STATE_DTYPE,
    STEP,
    TRAIN_MODE,
    WEIGHT_DECAY,
    WEIGHT_SUM,
    Z,
)
from .averaging import averaging_mu_x
from .kernels import FORCE, default_to_fused_or_foreach, fused_buckets, kernel_for, kernel_module

__all__ = ["AdamWHyper", "GPAAdamW", "bias_corrections", "gpa_adamw"]


@dataclass(frozen=True)
class AdamWHyper:
    """One group's hyper-parameters for one step, resolved once per group and step (``_begin_group_step``)."""

    lr: float | torch.Tensor  # a float, or the group's one-element tensor (read by float(), or by the Triton kernel)
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
    word each (``y_lo``, ``z_lo``; see ``_state_layout``), and m and v in bf16: 8 bytes of state per weight, with the
    accuracy of float32 state (docs/memory.md). ``state_dtype="float32"`` keeps z, m, v and a float32 copy of y
    (``y_fp32``, the parameter holds it rounded), x as exact as float32 allows, 16 bytes per weight; fp16 parameters
    keep this state under either mode. A parameter written by something else is taken: exactly where it no longer
    equals ``y_fp32`` rounded, with y's low word under ``"compact"`` (y then rounds to the written value).
    ``state_dtype="param"`` trades the accuracy for memory: z, m and v in the parameter's dtype and no copy of y, 6
    bytes per bf16 weight (torch's AdamW: 4). A parameter keeps the layout its state was created with; a state loaded
    into parameters of another dtype is converted exactly by ``load_state_dict`` (one whose parameters are cast under
    it, ``model.half()``, at the next step, ``eval()`` or ``train()``), the parameter receiving y in its own dtype, or
    refused with a ``ValueError`` naming both dtypes before anything changes where that is not possible (a float64
    state into narrower parameters). ``optimizer.state.clear()`` (or deleting
    one parameter's state) starts the state afresh at the next step, as in torch.
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
        foreach: use the foreach implementation; ``False`` (with ``fused`` unset) is the for-loop, which runs eagerly
            inside ``torch.compile`` (default: None).
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
        state_dtype: str = DEFAULT_STATE_DTYPE,
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
            STATE_DTYPE: state_dtype,
        }
        # Each group's cached step (`_plan`); before torch's constructor, which adds the groups.
        self._plans: dict[Hashable, _Plan] = {}
        # ids of the groups whose step has begun (`_begin_group_step`) since the last step(): those a backward pass
        # stepped (`in_backward`), whose step the step() after it does not take again.
        self._steps_begun: set[int] = set()
        super().__init__(params, defaults)  # every group, these defaults filled in, passes `_check_group`

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        check_adam(group[BETAS], group[EPS], group[WEIGHT_DECAY])
        check_mu(group[MU_X], group[MU_Y])
        group[AVERAGING] = check_averaging(group[AVERAGING])
        check_implementation(group[FOREACH], group[FUSED])
        check_state_dtype(group[STATE_DTYPE])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._plans = {}  # unpickled, or loaded (torch's load_state_dict ends here): plans of the old state go
        self._steps_begun = set()  # a copy or a loaded state is between two steps

    # ---- the state ----

    def _init_state(self, p: torch.Tensor, state_dtype: str = DEFAULT_STATE_DTYPE) -> dict[str, Any]:
        """``p``'s state, created where it has none: step 0 and the layout `layout_for` gives ``p``'s dtype under
        ``state_dtype`` (z = y, m = v = 0)."""
        state = self.state[p]
        if Z not in state:
            # Created lazily, after any wrapping (FSDP2 replaces parameters by DTensor shards in prepare()).
            state[STEP] = torch.tensor(0.0, dtype=torch.float32)
            state.update(layout_for(p.dtype, state_dtype).create(p))
        return state

    def _create_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p, group[STATE_DTYPE])

    def _fit_states(self, group: dict[str, Any], params: list[torch.Tensor], train_mode: bool) -> None:
        """Convert the states of ``params`` that no longer fit their parameter's dtype (a cast model, a checkpoint
        loaded into parameters of another dtype) exactly (`_state_layout.convert_`), and let a float32 state's
        parameter follow a cast between bf16 and fp16 (`follow_half_cast_`); or refuse, changing nothing."""
        fitting, unfit = [], []
        for p in params:
            state = self.state.get(p)
            if not state or Z not in state:
                continue
            if layout_of(state).fits(p.dtype, state):
                fitting.append(p)
                continue
            reason = refusal(state, p.dtype)
            if reason is not None:
                raise ValueError(f"{self.optimizer_name}: the optimizer state of {self._where(p)} {reason}")
            unfit.append(p)
        mu_y = x_mu_y(group)
        for p in fitting:
            follow_half_cast_(p, self.state[p], mu_y, train_mode=train_mode)
        for p in unfit:
            state = self.state[p]
            switched = not train_mode and mu_y != 1.0  # mu_y = 1: x = y, eval() switched nothing
            wide = layout_of(state).wide_state(state)
            convert_(p, state, y_across_cast(p, state, wide[0], mu_y, train_mode=not switched), wide)
            if switched:
                to_eval_(p, state, mu_y)

    def _where(self, p: torch.Tensor) -> str:
        for g, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return f"param_groups[{g}]['params'][{i}]"
        return "a parameter"

    def _check_loaded(self, param: torch.Tensor, saved: dict[str, Any], where: str) -> None:
        reason = refusal(saved, param.dtype) if Z in saved else None
        if reason is not None:
            raise ValueError(f"{self.optimizer_name}.load_state_dict(): the saved state of {where} {reason}")

    @torch.no_grad()
    def _loaded(self) -> None:
        # A state saved for parameters of another dtype (a bf16 run resumed into an fp16 or fp32 model) becomes theirs
        # now, in the mode it was saved in (`_check_loaded` refused what cannot be converted, before the load).
        for group in self.param_groups:
            self._fit_states(group, group["params"], train_mode=group[TRAIN_MODE])

    def _params_to_eval(self, group: dict[str, Any]) -> None:
        self._fit_states(group, group["params"], train_mode=True)
        super()._params_to_eval(group)

    def _params_to_train(self, group: dict[str, Any]) -> None:
        self._fit_states(group, group["params"], train_mode=False)
        super()._params_to_train(group)

    def _adoptable_keys(self, saved_group: dict[str, Any]) -> set[str] | None:
        # An Adam/AdamW run (without amsgrad) continues as GPA-AdamW: z = y = the current weights, m, v, step kept.
        return None if saved_group.get("amsgrad") else {STEP, "exp_avg", "exp_avg_sq"}

    def _adopts(self) -> str:
        return "Adam/AdamW (per-parameter state ['exp_avg', 'exp_avg_sq', 'step'], no amsgrad)"

    def _reset_state(self) -> None:
        super()._reset_state()
        self._plans.clear()

    # ---- the step ----

    def _plan(self, group: dict[str, Any], params: list[torch.Tensor]) -> _Plan:
        """The cached step of ``params`` (every parameter of ``group`` with a gradient, or one of them, stepped from a
        backward hook), built again, the states created or converted first, where it does not fit this step."""
        key: Hashable = id(group) if len(params) > 1 else (id(group), id(params[0]))
        inputs = (FORCE["backend"], group[FOREACH], group[FUSED])
        plan = self._plans.get(key)
        if plan is not None and plan.fits(self.state, params, inputs):
            return plan
        _check_dense_grads(params)
        self._fit_states(group, params, train_mode=True)
        states = [self._init_state(p, group[STATE_DTYPE]) for p in params]
        # Built rarely, so pruned here: plans of groups or parameters the optimizer no longer has (they would keep
        # them and their state alive).
        groups = {id(g) for g in self.param_groups}
        current = {id(q) for g in self.param_groups for q in g["params"]}
        for k in [k for k, v in self._plans.items() if id(v.group) not in groups or not current.issuperset(v.ids)]:
            del self._plans[k]  # in place: torch.compile before torch 2.13 refuses to rebind an optimizer's attribute
        use_fused, use_foreach = default_to_fused_or_foreach(
            [real_view(local_tensor(p)) for p in params], group[FOREACH], group[FUSED]
        )
        impl = "fused" if use_fused else "foreach" if use_foreach else "forloop"
        layouts = [layout_of(s) for s in states]
        plan = _Plan(
            params,
            [p.grad for p in params],
            layouts,
            [tuple(s[k] for k in layout.keys) for s, layout in zip(states, layouts)],
            [s[STEP] for s in states],
            impl,
            states=states,
            group=group,
            inputs=inputs,
            fused_asked=group[FUSED] is True,
        )
        self._plans[key] = plan
        return plan

    def _begin_group_step(self, group: dict[str, Any]) -> AdamWHyper:
        """What is done once per group and training step, whether or not it has gradients: this step's mu_x
        (advancing Schedule-Free's weight sum, as schedule_free's optimizers do for every group at every step) and the
        resolved hyper-parameters. Recorded until the next `step()` ends, which then does not do it again."""
        self._steps_begun.add(id(group))
        mu_x, group[WEIGHT_SUM] = averaging_mu_x(group[AVERAGING], group[MU_X], group[LR], group[WEIGHT_SUM])
        beta1, beta2 = group[BETAS]
        return AdamWHyper(group[LR], beta1, beta2, group[EPS], group[WEIGHT_DECAY], mu_x, group[MU_Y], group[MAXIMIZE])

    @torch.no_grad()
    def _step_params(self, group: dict[str, Any], params: list[torch.Tensor], hyper: AdamWHyper) -> None:
        """Update exactly ``params`` (some of ``group``'s, each with a gradient), creating missing state and advancing
        their step counts; bitwise what `step` computes for them."""
        plan = self._plan(group, params)
        _run(plan, plan.grads(), hyper)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss at y (optional)."""
        loss = self._closure_loss(closure)
        work = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        work = [(group, params) for group, params in work if params]
        for _, params in work:  # before any work: a step that raises changes nothing
            _check_dense_grads(params)
        plans = [self._plan(group, params) for group, params in work]  # a refused conversion raises here
        # A group whose step a backward pass began since the last step() (`step_in_backward`, the closure's backward
        # included) has had this step; step() takes it for every other group, with gradients or without (a step
        # without gradients still counts in Schedule-Free's weight sum): also for a hooked group none of whose
        # parameters got a gradient, so that no hook ran.
        stepped = set(self._steps_begun)
        try:
            for (group, _), plan in zip(work, plans):
                _run(plan, plan.grads(), self._begin_group_step(group))
            stepped.update(id(group) for group, _ in work)
            for group in self.param_groups:
                if id(group) not in stepped:
                    self._begin_group_step(group)
        finally:
            self._steps_begun.clear()
        return loss


def _check_dense_grads(params: list[torch.Tensor]) -> None:
    if any(p.grad.is_sparse for p in params):
        raise RuntimeError("GPAAdamW does not support sparse gradients")


@dataclass
class _Bucket:
    """Tensors one call updates: ``kind`` is "cpu" or "triton" (a kernel), "foreach" or "forloop"; all of one
    layout; ``idx`` their positions in the plan's parameter list; ``ys`` the parameters (views), ``cols`` their state
    tensors, one list per key of the layout; ``whole``: ``idx`` is every position in order. A kernel bucket also
    holds, resolved once, the kernel entry that takes it (``launch``: the layout's entry of `kernels.kernel_module`)
    and ``cols`` as that entry takes them after y and the gradients (``kernel_cols``, `StateLayout.kernel_lists`),
    so that a step runs no dispatch code."""

    kind: str
    layout: StateLayout
    idx: list[int]
    ys: list[torch.Tensor]
    cols: list[list[torch.Tensor]]
    whole: bool
    launch: Callable[..., None] | None = None
    kernel_cols: list[list[torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if self.kind in ("cpu", "triton"):
            self.launch = getattr(kernel_module(self.kind), self.layout.kernel)
            self.kernel_cols = self.layout.kernel_lists(self.cols)


class _Plan:
    """A step over one list of parameters, decided once: the implementation, the buckets (which kernel call or
    foreach group takes each tensor, per tensor, and their tensor lists; only the gradients are gathered per step) and
    the step counters.

    ``GPAAdamW`` keeps one per group (and one per parameter stepped from a backward hook) and checks at every step,
    without an aten op, that it still fits (`fits`): the same parameters, in the same storage and dtype; the same
    state (the very dicts of ``optimizer.state``, holding the very tensors: a cleared, replaced or loaded state is
    created or read afresh); gradients of the same dtypes and memory layouts; the same implementation switches. A
    plan for a whole group binds the per-parameter ``state["step"]`` (a 0-d float32 CPU tensor, what torch's AdamW
    saves and loads) as views of one tensor of the group's counts: a step advances all of them with one ``add_`` and
    reads them with one ``tolist()``. The state tensors are held as objects, never as addresses: the C++ kernel reads
    each tensor's address when called and the Triton launcher keys its pointer tables by the addresses it reads at
    each launch.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        layouts: list[StateLayout],
        cols: list[tuple[torch.Tensor, ...]],
        steps: list[torch.Tensor],
        impl: str,
        *,
        states: list[dict[str, Any]] | None = None,
        group: dict[str, Any] | None = None,
        inputs: tuple = (),
        fused_asked: bool = False,
    ) -> None:
        self.params, self.layouts, self.cols, self.impl = params, layouts, cols, impl
        self.group, self.inputs, self.ids = group, inputs, [id(p) for p in params]
        # DTensor shards and complex views are taken afresh at each step (to_local() and view_as_real() are views of
        # whatever the parameter holds then); plain tensors are used as they are.
        self.fresh_views = any(is_dtensor(p) or p.is_complex() for p in params)
        ys, colv = self._views()
        gs = self.views_of(grads)
        if impl == "forloop":
            by_layout: dict[StateLayout, list[int]] = defaultdict(list)
            for i, layout in enumerate(layouts):
                by_layout[layout].append(i)
            buckets = [("forloop", layout, idx) for layout, idx in by_layout.items()]
        else:
            calls = [(layout, _kernel_dtypes(layout, y, fused_asked)) for layout, y in zip(layouts, ys)]
            kernel_buckets, foreach_buckets = fused_buckets(
                ys, [(g, *c) for g, c in zip(gs, colv)], calls, use_kernels=impl == "fused"
            )
            buckets = [(key[0], key[1], idx) for key, idx in kernel_buckets.items()]
            buckets += [("foreach", key[0], idx) for key, idx in foreach_buckets.items()]
        everything = list(range(len(params)))
        self.buckets = [
            _Bucket(kind, layout, idx, *_gather(ys, colv, idx, layout), idx == everything)
            for kind, layout, idx in buckets
        ]
        self.steps, self.flat_steps = steps, None
        if states is not None and len(params) > 1:  # a whole group: its counters become views of one tensor
            flat = torch.stack([t.detach().to(device="cpu", dtype=torch.float32).reshape(()) for t in steps])
            for k, state in enumerate(states):
                state[STEP] = flat[k]
            self.steps, self.flat_steps = [state[STEP] for state in states], flat
        self.states = states
        if states is not None:
            keys = [(STEP, *layout.keys) for layout in layouts]
            self._watch = (
                [state for state, ks in zip(states, keys) for _ in ks],
                [key for ks in keys for key in ks],
                [state[key] for state, ks in zip(states, keys) for key in ks],
            )
            self._signature = self._sig(grads)

    def fits(self, state: dict[torch.Tensor, dict[str, Any]], params: list[torch.Tensor], inputs: tuple) -> bool:
        """Whether this step's parameters, state, gradients and switches are what the plan was built on."""
        dicts, keys, tensors = self._watch
        return (
            inputs == self.inputs
            and len(params) == len(self.params)
            and all(map(operator.is_, params, self.params))
            and all(map(operator.is_, map(state.get, params), self.states))
            and all(map(operator.is_, map(dict.get, dicts, keys), tensors))
            and self._sig([p.grad for p in params]) == self._signature
        )

    def _sig(self, grads: list[torch.Tensor]) -> tuple:
        """What the buckets were decided on and may change between steps, no aten op: the parameters' dtypes and
        addresses (new storage, ``p.data = ...``, may have another layout), the gradients' dtypes and strides."""
        gs = self.views_of(grads)
        sig = (*map(_dtype, self.params), *map(_dtype, gs), *map(torch.Tensor.stride, gs))
        if self.fresh_views:  # DTensor shards and complex views: their buckets are decided on the views' layouts
            return sig
        return (*sig, *map(torch.Tensor.data_ptr, self.params))

    def _views(self) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, ...]]]:
        def view(t: torch.Tensor) -> torch.Tensor:
            return real_view(local_tensor(t))

        return [view(p) for p in self.params], [tuple(view(t) for t in c) for c in self.cols]

    def views_of(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients as the update takes them (local shards, real views)."""
        return [real_view(local_tensor(g)) for g in grads] if self.fresh_views else grads

    def grads(self) -> list[torch.Tensor]:
        """This step's gradients of the parameters, in their order, as the update takes them."""
        return self.views_of([p.grad for p in self.params])

    def bucket_tensors(self, bucket: _Bucket) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """y and the state lists of a bucket as this step sees them (fresh views of DTensor shards and complex
        tensors)."""
        if not self.fresh_views:
            return bucket.ys, bucket.cols
        ys, cols = self._views()
        return _gather(ys, cols, bucket.idx, bucket.layout)

    def advance_steps(self) -> tuple[list[float], float | None]:
        """Add one to every counter; return the counts and, where all are equal (nearly always), that count."""
        if self.flat_steps is not None:
            self.flat_steps.add_(1.0)
            counts = self.flat_steps.tolist()
        else:
            torch._foreach_add_(self.steps, 1.0)
            counts = [t.item() for t in self.steps]  # on the CPU: no device synchronization
        uniform = counts[0] if counts and min(counts) == max(counts) else None
        return counts, uniform


def _kernel_dtypes(layout: StateLayout, y: torch.Tensor, fused_asked: bool) -> tuple[torch.dtype, ...] | None:
    """The dtypes a fused kernel takes ``y``'s state in (`StateLayout.kernel_dtypes`), or None (foreach) where the
    kernel would be a Triton kernel that its layout takes only when ``fused=True`` asks for it
    (`StateLayout.triton_by_default`)."""
    if not (fused_asked or layout.triton_by_default) and kernel_for(y) == "triton":
        return None
    return layout.kernel_dtypes(y.dtype)


def _dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype


def _gather(
    ys: list[torch.Tensor], cols: list[tuple[torch.Tensor, ...]], idx: list[int], layout: StateLayout
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The parameters at ``idx`` and their state, one list per key of their layout."""
    return [ys[i] for i in idx], [[cols[i][k] for i in idx] for k in range(len(layout.keys))]


@torch.no_grad()
def gpa_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    zs: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    y_fp32s: list[torch.Tensor | None] | None = None,
    y_los: list[torch.Tensor | None] | None = None,
    z_los: list[torch.Tensor | None] | None = None,
    foreach: bool | None = None,
    fused: bool | None = None,
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mu_x: float,
    mu_y: float,
    maximize: bool = False,
) -> None:
    """Functional API of GPA-AdamW's step (see `GPAAdamW`), in the shape of torch's ``adam(...)``.

    ``params`` hold y and are updated in place with their state: z, m, v and, per parameter, its layout's own
    tensors (``_state_layout``): ``y_los`` and ``z_los`` (the int8 low words of "compact"), or ``y_fp32s`` (y's
    float32 copy of "float32"); a parameter with neither keeps z, m and v in its own dtype. ``state_steps`` are 0-d
    float32 CPU tensors, advanced by one. ``mu_x`` is this step's (`averaging.averaging_mu_x`). The implementation is
    torch's rule (`kernels.default_to_fused_or_foreach`): ``foreach=False`` the for-loop, ``fused=True`` the kernels.
    Runs without autograd, as an optimizer's step does.
    """
    nones = [None] * len(params)
    y_fp32s, y_los, z_los = y_fp32s or nones, y_los or nones, z_los or nones
    if len({len(lst) for lst in (params, grads, zs, exp_avgs, exp_avg_sqs, state_steps, y_fp32s, y_los, z_los)}) != 1:
        raise ValueError("gpa_adamw: every tensor list must have one entry per parameter")
    layouts, cols = [], []
    for z, m, v, y32, y_lo, z_lo in zip(zs, exp_avgs, exp_avg_sqs, y_fp32s, y_los, z_los):
        if y_lo is not None:
            layouts.append(COMPACT)
            cols.append((z, m, v, y_lo, z_lo))
        elif y32 is not None:
            layouts.append(FLOAT32)
            cols.append((z, m, v, y32))
        else:
            layouts.append(PARAM)
            cols.append((z, m, v))
    use_fused, use_foreach = default_to_fused_or_foreach([real_view(local_tensor(p)) for p in params], foreach, fused)
    impl = "fused" if use_fused else "foreach" if use_foreach else "forloop"
    plan = _Plan(params, grads, layouts, cols, list(state_steps), impl, fused_asked=fused is True)
    _run(plan, plan.views_of(grads), AdamWHyper(lr, beta1, beta2, eps, weight_decay, mu_x, mu_y, maximize))


def _run(plan: _Plan, grads: list[torch.Tensor], hyper: AdamWHyper) -> None:
    """The plan's implementation, torch's rule having picked it."""
    func = {
        "fused": _fused_gpa_adamw, "foreach": _multi_tensor_gpa_adamw, "forloop": _single_tensor_gpa_adamw
    }[plan.impl]  # fmt: skip
    func(plan, grads, hyper)


# Under torch.compile the for-loop runs eagerly: dynamo turns the step count it reads per tensor into a symbolic float
# from the second step on, with which inductor (torch 2.13) computes addcdiv_'s value wrongly (a drift of 1e-3 in
# 3 steps); run as it is, the compiled step is the eager one bitwise. The other paths read their counts once.
@torch.compiler.disable(reason="GPAAdamW's for-loop reads each step count on the host; it runs eagerly")
def _single_tensor_gpa_adamw(plan: _Plan, grads: list[torch.Tensor], hyper: AdamWHyper) -> None:
    """The ground truth: one tensor at a time, plain ops, on the layout's working copies (float32 for bf16/fp16
    parameters, rounded back once per step)."""
    for bucket in plan.buckets:
        ys, cols = plan.bucket_tensors(bucket)
        for k, i in enumerate(bucket.idx):
            step_t = plan.steps[i]
            step_t += 1
            step = step_t.item()  # step lives on the CPU: no device sync
            one = [[col[k]] for col in cols]
            wide = bucket.layout.widen([ys[k]], one)
            _single_tensor_update(*(w[0] for w in wide), grads[i], step, hyper)
            bucket.layout.narrow_(wide, [ys[k]], one)


def _single_tensor_update(
    y: torch.Tensor, z: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, step: float, h: AdamWHyper
) -> None:
    """One tensor's update in place, y, z, m, v in one dtype (g in any)."""
    lr = float(h.lr)
    bias_correction1, bias_correction2_sqrt = bias_corrections(h.beta1, h.beta2, step)
    g = g.to(z.dtype)
    if h.maximize:
        g = -g
    m.lerp_(g, 1.0 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
    denom = (v.sqrt() / bias_correction2_sqrt).add_(h.eps)
    delta = torch.mul(z, -lr * h.weight_decay).addcdiv_(m, denom, value=-lr / bias_correction1)  # z' - z
    y.add_(torch.sub(z, y), alpha=1.0 - h.mu_x).add_(delta, alpha=1.0 - h.mu_x * h.mu_y)
    z.add_(delta)


def _multi_tensor_gpa_adamw(plan: _Plan, grads: list[torch.Tensor], hyper: AdamWHyper) -> None:
    """The same update as `_single_tensor_gpa_adamw` with foreach ops, one call per foreach group of the plan."""
    counts, uniform = plan.advance_steps()
    for bucket in plan.buckets:
        _foreach_update(plan, bucket, grads, counts, uniform, hyper)


def _foreach_update(
    plan: _Plan, bucket: _Bucket, grads: list[torch.Tensor], counts: list[float], uniform: float | None, h: AdamWHyper
) -> None:
    """One foreach group (one device and layout, every tensor's dtypes alike) with the step counts advanced."""
    ys, cols = plan.bucket_tensors(bucket)
    gs = grads if bucket.whole else [grads[i] for i in bucket.idx]
    steps = uniform if uniform is not None else [counts[i] for i in bucket.idx]
    layout, lr = bucket.layout, float(h.lr)
    if not layout.widens(ys[0].dtype):
        wide = layout.widen(ys, cols)
        _foreach_math(wide, gs, steps, lr, h)
        layout.narrow_(wide, ys, cols)
        return
    # Computed in float32 and rounded once at the end, a piece at a time, so that the float32 copies are a few MB,
    # not the whole bucket (up to 32 bytes per weight at once).
    for k in range(len(ys)):
        step = steps if uniform is not None else steps[k]
        for _, (y, g, *state) in chunks(ys[k], gs[k], *(col[k] for col in cols)):
            one = [[t] for t in state]
            wide = layout.widen([y], one)
            _foreach_math(wide, [g], step, lr, h)
            layout.narrow_(wide, [y], one)


def _foreach_math(
    wide: tuple[list[torch.Tensor], ...], gs: list[torch.Tensor], steps: float | list[float], lr: float, h: AdamWHyper
) -> None:
    """The update in place over lists y, z, m, v of one device and dtype (gradients of one dtype), with foreach ops."""
    ys, zs, ms, vs = wide
    dtype = zs[0].dtype
    g_acc = gs if gs[0].dtype == dtype else [g.to(dtype) for g in gs]
    if h.maximize:
        g_acc = torch._foreach_neg(g_acc)
    if isinstance(steps, list):
        bcs = [bias_corrections(h.beta1, h.beta2, s) for s in steps]
        step_size: float | list[float] = [-lr / bc1 for bc1, _ in bcs]
        bc2_sqrt: float | list[float] = [bc2 for _, bc2 in bcs]
    else:
        bc1, bc2_sqrt = bias_corrections(h.beta1, h.beta2, steps)
        step_size = -lr / bc1
    torch._foreach_lerp_(ms, g_acc, 1.0 - h.beta1)
    torch._foreach_mul_(vs, h.beta2)
    torch._foreach_addcmul_(vs, g_acc, g_acc, 1.0 - h.beta2)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, h.eps)
    delta = torch._foreach_mul(zs, -lr * h.weight_decay)
    torch._foreach_addcdiv_(delta, ms, denom, step_size)
    torch._foreach_add_(ys, torch._foreach_sub(zs, ys), alpha=1.0 - h.mu_x)
    torch._foreach_add_(ys, delta, alpha=1.0 - h.mu_x * h.mu_y)
    torch._foreach_add_(zs, delta)


def _fused_gpa_adamw(plan: _Plan, grads: list[torch.Tensor], hyper: AdamWHyper) -> None:
    """The fused kernels on every tensor they take (one C++ call per layout, one Triton launch per device, dtype and
    step count), foreach on the rest (memory layouts or dtypes a kernel does not take)."""
    counts, uniform = plan.advance_steps()
    for bucket in plan.buckets:
        if bucket.kind == "foreach":
            _foreach_update(plan, bucket, grads, counts, uniform, hyper)
            continue
        ys, cols = plan.bucket_tensors(bucket)
        gs = grads if bucket.whole else [grads[i] for i in bucket.idx]
        if uniform is not None:
            bc1, bc2_sqrt = bias_corrections(hyper.beta1, hyper.beta2, uniform)
            bc1s, bc2_sqrts = [bc1] * len(ys), [bc2_sqrt] * len(ys)
        else:
            bcs = [bias_corrections(hyper.beta1, hyper.beta2, counts[i]) for i in bucket.idx]
            bc1s, bc2_sqrts = [bc1 for bc1, _ in bcs], [bc2 for _, bc2 in bcs]
        lr = hyper.lr  # a tensor on the tensors' device is read by the Triton kernel itself
        if bucket.kind == "cpu" or not (torch.is_tensor(lr) and lr.device == ys[0].device):
            lr = float(lr)
        kernel_cols = bucket.kernel_cols if cols is bucket.cols else bucket.layout.kernel_lists(cols)
        bucket.launch(
            ys, gs, *kernel_cols, bc1s, bc2_sqrts, lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
            hyper.mu_x, hyper.mu_y, hyper.maximize,
        )  # fmt: skip
