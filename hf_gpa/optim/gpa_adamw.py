"""GPA-AdamW: GPA around AdamW in one fused update, with a for-loop (the ground truth), foreach, CPU-kernel and
Triton paths.

One step with learning rate lr, AdamW direction d and weight decay wd (paper, Algorithm 1):

    z' = (1 - lr wd) z - lr d
    x' = mu_x x + (1 - mu_x) z'
    y' = mu_y x' + (1 - mu_y) z'  =  y + (1 - mu_x) (z - y) + (1 - mu_x mu_y) (z' - z)

The last identity (with x = (y - (1 - mu_y) z) / mu_y) is what lets the optimizer update y without storing x. It is
written as small corrections added to y rather than as mu_x mu_y x + (1 - mu_x mu_y) z': the rounding error is then
that of the corrections, and where x = z a step with lr = 0 leaves y bitwise unchanged.

Every path computes the same update: `_single_tensor_gpa_adamw` (the ground truth), `_foreach_gpa_adamw`, the C++
kernel (``kernels/csrc/gpa_adamw.cpp``) and the Triton kernel (``kernels/triton_source.py``). ``fused=None``
takes the fused kernel of the device (CPU: C++; CUDA: Triton, when triton imports) and foreach for the tensors it
cannot take.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._checks import DEFAULT_AVERAGING, DEFAULT_MU_X, DEFAULT_MU_Y, check_adam, check_averaging, check_lr, check_mu
from ._gpa_switch import GPASwitch
from ._tensors import local_tensor, state_dtype_for
from .averaging import averaging_mu_x
from .kernels.cpu import load_cpu_kernel

__all__ = ["GPAAdamW"]

_HALF = (torch.bfloat16, torch.float16)
#: ``state_dtype``: what bf16/fp16 parameters keep their state in. "float32": z, m, v and a float32 copy of y (16 bytes
#: per weight, x as exact as float32 allows); "param": z, m and v in the parameter's dtype, no copy of y (6 bytes, as
#: torch's AdamW keeps m and v; the update is computed in float32 and rounded once per step).
STATE_DTYPES = ("float32", "param")


def _check_state_dtype(state_dtype: Any) -> None:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"Invalid state_dtype: {state_dtype!r} (must be one of {', '.join(STATE_DTYPES)})")
_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


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
    parameter's dtype and no copy of y, 6 bytes per bf16 weight (torch's AdamW: 4, GPA-AdamW's default: 16).
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
        mu_x: averaging constant of x in [0, 1); ``mu_x_from_inner_steps(H)`` maps DiLoCo's H (default: 0.9967).
        mu_y: interpolation constant of the gradient point y in (0, 1] (default: 0.7).
        averaging: ``"gpa"`` (exponential average with ``mu_x``) or ``"schedule_free"`` (Schedule-Free's average
            weighted by lr_t^2, paper eq. 5; ``mu_x`` is then unused; it reads lr on the host) (default: "gpa").
        foreach: use the foreach implementation; ``False`` (with ``fused`` unset) is the for-loop (default: None).
        fused: use the fused kernel of the device: the single-pass C++ kernel on CPU (built once per machine), the
            multi-tensor Triton kernel on CUDA (fp32/bf16/fp16 parameters; needs ``triton``). ``None`` picks it
            where it is available; tensors a kernel cannot take (other dtypes or devices, parameters whose
            tensors differ in layout) use foreach (default: None).
        maximize: maximize the objective instead of minimizing it (default: False).
        state_dtype: the state of bf16/fp16 parameters: ``"float32"`` (z, m, v and y's float32 copy) or ``"param"``
            (z, m, v in the parameter's dtype, no copy of y; computed in float32, rounded once per step; the fused
            kernels take float32 state only, so these parameters take the foreach path). fp32/fp64 parameters are
            not affected (default: "float32").

    Paper: Defazio, Mishchenko, Raman, Shi, Xiao, "Smoothing DiLoCo with Primal Averaging for Faster Training of
    LLMs" (Generalized Primal Averaging).
    """

    # Private switch for tests: "triton" sends the fused buckets to the Triton kernel on any device (on CPU tensors
    # it runs through Triton's interpreter). A class attribute, so copies and unpickled optimizers have it too.
    _fused_backend: str | None = None

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        mu_x: float = DEFAULT_MU_X,
        mu_y: float = DEFAULT_MU_Y,
        *,
        averaging: str = DEFAULT_AVERAGING,
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
        state_dtype: str = "float32",
    ) -> None:
        check_lr(lr)
        _check_state_dtype(state_dtype)
        check_adam(betas, eps, weight_decay)
        check_mu(mu_x, mu_y)
        check_averaging(averaging)
        if fused and foreach:
            raise ValueError("Invalid arguments: fused=True and foreach=True cannot both be set")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            mu_x=mu_x,
            mu_y=mu_y,
            averaging=averaging,
            weight_sum=0.0,
            foreach=foreach,
            fused=fused,
            maximize=maximize,
            state_dtype=state_dtype,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            check_lr(group["lr"])
            check_adam(group["betas"], group["eps"], group["weight_decay"])
            check_mu(group["mu_x"], group["mu_y"])
            check_averaging(group["averaging"])
            _check_state_dtype(group["state_dtype"])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("state_dtype", "float32")

    def _init_group(self, group: dict[str, Any]) -> tuple[list[Any], ...]:
        """The local (real-valued) tensors of every parameter with a gradient; state is created on first use."""
        ys, gs, zs, ms, vs, y32s, steps = [], [], [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("GPAAdamW does not support sparse gradients")
            state = self.state[p]
            in_param_dtype = group.get("state_dtype", "float32") == "param"
            if "z" not in state:
                # Created lazily, after any wrapping (FSDP2 replaces parameters by DTensor shards in prepare()).
                dtype = p.dtype if in_param_dtype else state_dtype_for(p)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["z"] = p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format)
                state["exp_avg"] = torch.zeros_like(state["z"], memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(state["z"], memory_format=torch.preserve_format)
            if p.dtype in _HALF and "y_fp32" not in state and state["z"].dtype == torch.float32:
                # Also for state saved before this copy existed: the parameter holds y rounded, a fine start.
                state["y_fp32"] = p.detach().to(dtype=torch.float32, copy=True, memory_format=torch.preserve_format)
            tensors = [local_tensor(t) for t in (p, p.grad, state["z"], state["exp_avg"], state["exp_avg_sq"])]
            if torch.is_complex(tensors[0]):
                tensors = [torch.view_as_real(t) for t in tensors]
            for lst, t in zip((ys, gs, zs, ms, vs), tensors):
                lst.append(t)
            y32s.append(local_tensor(state["y_fp32"]) if "y_fp32" in state else None)
            steps.append(state["step"])
        return ys, gs, zs, ms, vs, y32s, steps

    def _load_stock_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Switch an Adam/AdamW run to GPA-AdamW: z = y = the current weights, m, v and step carried over.

        ``lr`` and ``initial_lr`` come from the saved groups (the schedule's position); every other hyper-parameter
        stays this optimizer's own. Any other optimizer's state raises a ``ValueError`` naming both.
        """
        self._check_stock_state(state_dict, {"step", "exp_avg", "exp_avg_sq"}, "Adam/AdamW")
        adopted = {}
        for p, saved in self._saved_param_states(state_dict):
            z = p.detach().to(dtype=state_dtype_for(p), copy=True, memory_format=torch.preserve_format)
            step = torch.tensor(float(saved["step"]), dtype=torch.float32)
            m, v = (saved[k].to(device=z.device, dtype=z.dtype, copy=True) for k in ("exp_avg", "exp_avg_sq"))
            adopted[p] = {"step": step, "z": z, "exp_avg": m, "exp_avg_sq": v}
        self._reset_state()
        self.state.update(adopted)
        self._adopt_schedule(state_dict)

    def _implementation(self, group: dict[str, Any], ys: list[torch.Tensor]) -> str:
        """The group's path: "forloop", "foreach", or "fused" (the device's kernel, where it takes the tensors)."""
        if group["foreach"] is False and not group["fused"]:
            return "forloop"
        if group["foreach"]:
            return "foreach"
        if all(self._fused_kernel(y) is not None for y in ys):
            return "fused"
        return "foreach"

    def _fused_kernel(self, y: torch.Tensor) -> str | None:
        """The fused kernel ("triton" or "cpu") that can take a tensor of this device and dtype, else None."""
        if self._fused_backend == "triton" or y.device.type == "cuda":
            from .kernels import triton_launch as _triton

            if _triton.triton_available() and _triton.supports([y]):
                return "triton"
            return None
        if y.device.type == "cpu" and y.dtype in _KERNEL_DTYPES and load_cpu_kernel() is not None:
            return "cpu"
        return None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss at y (optional)."""
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            ys, gs, zs, ms, vs, y32s, steps = self._init_group(group)
            if not ys:
                continue
            lr = group["lr"]
            if torch.is_tensor(lr):
                lr = lr.squeeze()  # a one-element lr of any shape is its 0-d value (torch's AdamW does the same)
            if group["averaging"] == "gpa":
                mu_x = group["mu_x"]
            else:
                averaged = averaging_mu_x(group["averaging"], group["mu_x"], float(lr), group["weight_sum"])
                mu_x, group["weight_sum"] = averaged
            torch._foreach_add_(steps, 1.0)
            hyper = dict(
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                mu_x=mu_x,
                mu_y=group["mu_y"],
                maximize=group["maximize"],
            )
            step_counts = [step.item() for step in steps]  # step lives on the CPU: no device synchronization
            if group["foreach"] is False and not group["fused"]:
                lr_f = float(lr)
                for y, g, z, m, v, y32, t in zip(ys, gs, zs, ms, vs, y32s, step_counts):
                    _single_tensor_gpa_adamw(y, g, z, m, v, y32, lr=lr_f, step=t, **hyper)
                continue
            if group["foreach"]:
                rest = list(range(len(ys)))
            else:
                rest = self._fused_step(ys, gs, zs, ms, vs, y32s, step_counts, lr, hyper)
            if rest:
                picked = [[lst[i] for i in rest] for lst in (ys, gs, zs, ms, vs, y32s, step_counts)]
                _foreach_gpa_adamw(*picked, lr=float(lr), **hyper)
        return loss

    def _fused_step(
        self,
        ys: list[torch.Tensor],
        gs: list[torch.Tensor],
        zs: list[torch.Tensor],
        ms: list[torch.Tensor],
        vs: list[torch.Tensor],
        y32s: list[torch.Tensor | None],
        step_counts: list[float],
        lr: float | torch.Tensor,
        hyper: dict[str, Any],
    ) -> list[int]:
        """Run the fused kernels on every tensor they take; return the indices left for foreach."""
        # (kernel, device, parameter dtype, has y32, step count): one C++ call or one Triton launch per bucket.
        buckets: dict[tuple, list[int]] = defaultdict(list)
        rest = []
        for i, y in enumerate(ys):
            kernel = self._fused_kernel(y)
            layout_ok = all(_same_dense_layout(y, t) for t in (gs[i], zs[i], ms[i], vs[i], y32s[i]) if t is not None)
            if kernel is None or not layout_ok or gs[i].dtype != y.dtype or zs[i].dtype in _HALF:
                rest.append(i)
            elif kernel == "cpu":  # the C++ kernel takes a step size per tensor
                buckets[("cpu", None, None, y32s[i] is not None, None)].append(i)
            else:
                buckets[("triton", y.device, y.dtype, y32s[i] is not None, step_counts[i])].append(i)
        beta1, beta2 = hyper["beta1"], hyper["beta2"]
        for (kernel, device, _, has_y32, t), idx in buckets.items():
            y_b, g_b, z_b, m_b, v_b = ([lst[i] for i in idx] for lst in (ys, gs, zs, ms, vs))
            y32_b = [y32s[i] for i in idx] if has_y32 else None
            if kernel == "cpu":
                lr_f = float(lr)
                step_sizes = [lr_f / (1.0 - beta1 ** step_counts[i]) for i in idx]
                bc2_sqrts = [math.sqrt(1.0 - beta2 ** step_counts[i]) for i in idx]
                load_cpu_kernel().gpa_adamw_step(
                    y_b, g_b, z_b, m_b, v_b, y32_b or [], step_sizes, bc2_sqrts, lr_f, beta1, beta2,
                    hyper["eps"], hyper["weight_decay"], hyper["mu_x"], hyper["mu_y"], hyper["maximize"],
                )  # fmt: skip
            else:
                from .kernels import triton_launch as _triton

                lr_arg = lr if torch.is_tensor(lr) and lr.device == device else float(lr)
                _triton.gpa_adamw_step(
                    y_b, g_b, z_b, m_b, v_b, y32_b, lr=lr_arg, bc1=1.0 - beta1**t, bc2_sqrt=math.sqrt(1.0 - beta2**t),
                    **hyper,
                )  # fmt: skip
        return rest


def _same_dense_layout(ref: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` lies in memory like ``ref`` and both are dense: an elementwise kernel may then run flat."""
    return (
        t.shape == ref.shape
        and t.stride() == ref.stride()
        and (ref.is_contiguous() or ref.is_contiguous(memory_format=torch.channels_last) or _dense(ref))
    )


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the strides, sorted, are those of a contiguous tensor of the permuted shape."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda s: s[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _single_tensor_gpa_adamw(
    y: torch.Tensor,
    g: torch.Tensor,
    z: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    y32: torch.Tensor | None,
    *,
    lr: float,
    step: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mu_x: float,
    mu_y: float,
    maximize: bool,
) -> None:
    """The ground truth: one tensor, plain ops, in the state dtype (``y32``: y's float32 copy, or None).

    State in a half-precision dtype (``state_dtype="param"``) is computed in float32 and rounded once at the end.
    """
    if z.dtype in _HALF:
        wide = [t.float() for t in (z, m, v)]
        _single_tensor_gpa_adamw(
            y, g, *wide, y32, lr=lr, step=step, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            mu_x=mu_x, mu_y=mu_y, maximize=maximize,
        )  # fmt: skip
        torch._foreach_copy_([z, m, v], wide)
        return
    g = g.to(z.dtype)
    if maximize:
        g = -g
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
    delta = torch.mul(z, -lr * weight_decay).addcdiv_(m, denom, value=-lr / (1.0 - beta1**step))  # z' - z
    y_acc = _exact_y(y, y32, z.dtype)
    y_acc.add_(torch.sub(z, y_acc), alpha=1.0 - mu_x).add_(delta, alpha=1.0 - mu_x * mu_y)
    z.add_(delta)
    if y32 is not None:
        y32.copy_(y_acc)
    y.copy_(y_acc)


def _exact_y(y: torch.Tensor, y32: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y in ``dtype`` (a new tensor): its float32 copy while the parameter still equals that copy rounded."""
    if y32 is None:
        return y.to(dtype, copy=True)
    return torch.where(y32.to(y.dtype) == y, y32, y.to(dtype))


def _foreach_gpa_adamw(
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
    """The same update as `_single_tensor_gpa_adamw` with foreach ops, one call per (device, dtype) bucket."""
    grouped = torch.optim.Optimizer._group_tensors_by_device_and_dtype([ys, gs, zs, ms, vs], with_indices=True)
    for (y_b, g_b, z_b, m_b, v_b), indices in grouped.values():
        stored = None
        if z_b[0].dtype in _HALF:  # state_dtype="param": computed in float32, rounded once at the end
            stored = z_b + m_b + v_b
            z_b, m_b, v_b = ([t.float() for t in lst] for lst in (z_b, m_b, v_b))
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
        y_acc = [y if ip else _exact_y(y, y32s[i], state_dtype) for y, i, ip in zip(y_b, indices, in_place)]
        torch._foreach_add_(y_acc, torch._foreach_sub(z_b, y_acc), alpha=1.0 - mu_x)
        torch._foreach_add_(y_acc, delta, alpha=1.0 - mu_x * mu_y)
        torch._foreach_add_(z_b, delta)
        y32_b = [y32s[i] for i in indices if y32s[i] is not None]
        if y32_b:
            torch._foreach_copy_(y32_b, [a for a, i in zip(y_acc, indices) if y32s[i] is not None])
        copied = [k for k, ip in enumerate(in_place) if not ip]
        if copied:
            torch._foreach_copy_([y_b[k] for k in copied], [y_acc[k] for k in copied])
        if stored is not None:
            torch._foreach_copy_(stored, z_b + m_b + v_b)
