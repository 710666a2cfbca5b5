"""Generalized Primal Averaging (GPA): a fast GPA-AdamW and a wrapper that puts GPA around any base optimizer.

Both store the memory-efficient form of the paper (Algorithm 3): the parameters hold the gradient point y, the
optimizer state holds z (plus the base optimizer's own state), and the evaluation weights x are recovered when
``eval()`` is called. One step with learning rate lr, base direction d and weight decay wd (Algorithm 1):

    z' = (1 - lr wd) z - lr d
    x' = mu_x x + (1 - mu_x) z'
    y' = mu_y x' + (1 - mu_y) z'  =  mu_x (y - (1 - mu_y) z) + (1 - mu_x mu_y) z'

The last identity (x = (y - (1 - mu_y) z) / mu_y) is what lets the optimizer update y without storing x.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._checks import base_defaults, check_adam, check_averaging, check_lr, check_mu
from ._kernels import load_cpu_kernel
from ._modes import (
    PrimalAveragingOptimizer,
    decode_residual,
    encode_residual,
    is_dtensor,
    local_tensor,
    shard_like,
    state_dtype_for,
)
from .schedules import averaging_mu_x

__all__ = ["GPAAdamW", "GPA"]

_GPA_KEYS = ("mu_x", "mu_y", "averaging", "weight_sum", "train_mode")


def _x_from_y(y: torch.Tensor, z: torch.Tensor, mu_y: float) -> torch.Tensor:
    """x = (y - (1 - mu_y) z) / mu_y, computed in z's dtype, returned in y's dtype."""
    return torch.sub(y.to(z.dtype), z, alpha=1.0 - mu_y).div_(mu_y).to(y.dtype)


def _y_from_x(x: torch.Tensor, z: torch.Tensor, mu_y: float) -> torch.Tensor:
    """y = mu_y x + (1 - mu_y) z, computed in z's dtype, returned in x's dtype."""
    return torch.lerp(z, x.to(z.dtype), mu_y).to(x.dtype)


class _GPAModes(PrimalAveragingOptimizer):
    """eval(): parameters y -> x; train(): x -> y, exact through the bit-pattern residual (see ``_modes``)."""

    def _params_to_eval(self, group: dict[str, Any]) -> None:
        mu_y = group["mu_y"]
        for p in group["params"]:
            state = self.state.get(p)
            if not state or "z" not in state or mu_y == 1.0:
                continue  # never stepped (x = y = z), or mu_y = 1 (x = y)
            y, z = local_tensor(p), local_tensor(state["z"])
            x = _x_from_y(y, z, mu_y)
            residual = encode_residual(y, _y_from_x(x, z, mu_y), narrow=not is_dtensor(p))
            state["y_residual"] = shard_like(residual, p)
            y.copy_(x)

    def _params_to_train(self, group: dict[str, Any]) -> None:
        mu_y = group["mu_y"]
        for p in group["params"]:
            state = self.state.get(p)
            if not state or "z" not in state or mu_y == 1.0:
                continue
            x, z = local_tensor(p), local_tensor(state["z"])
            y = _y_from_x(x, z, mu_y)
            if "y_residual" in state:
                y = decode_residual(y, local_tensor(state.pop("y_residual")))
            # else: a loader dropped the residual (see _modes); y is rebuilt by rounding, not bitwise.
            x.copy_(y)

    def _closure_loss(self, closure: Callable[[], Any] | None) -> Any:
        self._check_train_mode()
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


class GPAAdamW(_GPAModes):
    r"""GPA around AdamW, with a fused single-pass CPU kernel.

    .. math::
        \begin{aligned}
            & m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \quad v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2,
              \quad g_t = \nabla f(y_t) \\
            & z_{t+1} = (1 - \gamma_t \lambda) z_t - \gamma_t \frac{m_t / (1 - \beta_1^t)}
              {\sqrt{v_t / (1 - \beta_2^t)} + \epsilon} \\
            & x_{t+1} = \mu_x x_t + (1 - \mu_x) z_{t+1}, \qquad y_{t+1} = \mu_y x_{t+1} + (1 - \mu_y) z_{t+1}
        \end{aligned}

    The parameters hold y; the state holds exactly ``z``, ``exp_avg`` (m) and ``exp_avg_sq`` (v), 3.0x the
    parameter bytes for fp32 parameters. For bf16/fp16 parameters z, m and v are kept in float32 (z is the
    unrounded copy of the weights), and y is rounded to the parameter dtype after each step. Weight decay is
    decoupled and acts on z, as in Algorithm 1 of the paper. ``mu_x = 0`` is AdamW; ``mu_y = 1`` is stochastic
    primal averaging. Call ``eval()`` before evaluating or saving (the parameters then hold x) and ``train()``
    before the next step (y comes back bitwise).

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate, driven by the usual LR schedulers (default: 1e-3).
        betas: AdamW's coefficients for the running averages of the gradient and its square (default: (0.9, 0.999)).
        eps: term added to the denominator (default: 1e-8).
        weight_decay: decoupled weight decay on z (default: 0).
        mu_x: averaging constant of x in [0, 1); ``mu_x_from_inner_steps(H)`` maps DiLoCo's H (default: 0.9967).
        mu_y: interpolation constant of the gradient point y in (0, 1] (default: 0.7).
        averaging: ``"gpa"`` (exponential average with ``mu_x``) or ``"schedule_free"`` (Schedule-Free's average
            weighted by lr_t^2, paper eq. 5; ``mu_x`` is then unused) (default: "gpa").
        foreach: use the foreach implementation (default: None, meaning the fused kernel on CPU when it can be
            built, foreach on other devices).
        fused: use the fused single-pass CPU kernel; it is built once per machine (default: None).
        maximize: maximize the objective instead of minimizing it (default: False).

    Paper: Defazio, Mishchenko, Raman, Shi, Xiao, "Smoothing DiLoCo with Primal Averaging for Faster Training of
    LLMs" (Generalized Primal Averaging).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        mu_x: float = 0.9967,
        mu_y: float = 0.7,
        *,
        averaging: str = "gpa",
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
    ) -> None:
        check_lr(lr)
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
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            check_lr(group["lr"])
            check_adam(group["betas"], group["eps"], group["weight_decay"])
            check_mu(group["mu_x"], group["mu_y"])
            check_averaging(group["averaging"])

    def _init_group(self, group: dict[str, Any]) -> tuple[list[torch.Tensor], ...]:
        ys, gs, zs, ms, vs, steps = [], [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("GPAAdamW does not support sparse gradients")
            state = self.state[p]
            if "z" not in state:
                # Created lazily, after any wrapping (FSDP2 replaces parameters by DTensor shards in prepare()).
                dtype = state_dtype_for(p)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["z"] = p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format)
                state["exp_avg"] = torch.zeros_like(state["z"], memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(state["z"], memory_format=torch.preserve_format)
            ys.append(local_tensor(p))
            gs.append(local_tensor(p.grad))
            zs.append(local_tensor(state["z"]))
            ms.append(local_tensor(state["exp_avg"]))
            vs.append(local_tensor(state["exp_avg_sq"]))
            steps.append(state["step"])
        return ys, gs, zs, ms, vs, steps

    def _implementation(self, group: dict[str, Any], ys: list[torch.Tensor]) -> str:
        if group["foreach"] is False and not group["fused"]:
            return "forloop"
        all_cpu_contiguous = all(t.device.type == "cpu" and t.is_contiguous() for t in ys)
        if group["fused"] is not False and not group["foreach"] and all_cpu_contiguous:
            if load_cpu_kernel() is not None:
                return "fused"
        return "foreach"

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss at y (optional)."""
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            ys, gs, zs, ms, vs, steps = self._init_group(group)
            if not ys:
                continue
            lr = group["lr"]
            mu_x, group["weight_sum"] = averaging_mu_x(group["averaging"], group["mu_x"], lr, group["weight_sum"])
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            step_sizes = [lr / (1.0 - beta1 ** step.item()) for step in steps]
            bc2_sqrts = [math.sqrt(1.0 - beta2 ** step.item()) for step in steps]
            hyper = dict(
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                mu_x=mu_x,
                mu_y=group["mu_y"],
                maximize=group["maximize"],
            )
            impl = self._implementation(group, ys)
            if impl == "fused":
                # The extension takes its scalars positionally, in the order of `hyper`.
                load_cpu_kernel().gpa_adamw_step(ys, gs, zs, ms, vs, step_sizes, bc2_sqrts, *hyper.values())
            elif impl == "foreach":
                _foreach_gpa_adamw(ys, gs, zs, ms, vs, step_sizes, bc2_sqrts, **hyper)
            else:
                for args in zip(ys, gs, zs, ms, vs, step_sizes, bc2_sqrts):
                    _single_tensor_gpa_adamw(*args, **hyper)
        return loss


def _single_tensor_gpa_adamw(
    y: torch.Tensor,
    g: torch.Tensor,
    z: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step_size: float,
    bc2_sqrt: float,
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
    """The ground truth: one tensor, plain ops, in the state dtype."""
    g = g.to(z.dtype)
    if maximize:
        g = -g
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    y_acc = y.to(z.dtype, copy=True)
    y_acc.sub_(z, alpha=1.0 - mu_y).mul_(mu_x)  # mu_x * mu_y * x, with x the average before this step
    z.mul_(1.0 - lr * weight_decay).addcdiv_(m, denom, value=-step_size)
    y_acc.add_(z, alpha=1.0 - mu_x * mu_y)
    y.copy_(y_acc)


def _foreach_gpa_adamw(
    ys: list[torch.Tensor],
    gs: list[torch.Tensor],
    zs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    step_sizes: list[float],
    bc2_sqrts: list[float],
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
        ss = [-step_sizes[i] for i in indices]
        bc = [bc2_sqrts[i] for i in indices]
        half = y_b[0].dtype != z_b[0].dtype
        y_acc = [y.to(z_b[0].dtype) for y in y_b] if half else y_b
        g_acc = [g.to(z_b[0].dtype) for g in g_b] if half else g_b
        if maximize:
            g_acc = torch._foreach_neg(g_acc)
        torch._foreach_lerp_(m_b, g_acc, 1.0 - beta1)
        torch._foreach_mul_(v_b, beta2)
        torch._foreach_addcmul_(v_b, g_acc, g_acc, 1.0 - beta2)
        denom = torch._foreach_sqrt(v_b)
        torch._foreach_div_(denom, bc)
        torch._foreach_add_(denom, eps)
        torch._foreach_sub_(y_acc, z_b, alpha=1.0 - mu_y)
        torch._foreach_mul_(y_acc, mu_x)
        torch._foreach_mul_(z_b, 1.0 - lr * weight_decay)
        torch._foreach_addcdiv_(z_b, m_b, denom, ss)
        torch._foreach_add_(y_acc, z_b, alpha=1.0 - mu_x * mu_y)
        if half:
            torch._foreach_copy_(y_b, y_acc)


class GPA(_GPAModes):
    r"""GPA around any ``torch.optim.Optimizer``: the base moves z with the gradient taken at y.

    The base optimizer is built lazily (at the first step, after any FSDP wrapping) on the z tensors, which hold the
    parameters' gradients during its step; its own weight decay therefore acts on z, as in Algorithm 1. Around the
    base step GPA adds two passes over the parameters (single-pass C++ loops on CPU, foreach ops elsewhere):

    .. math::
        y \leftarrow \mu_x (y - (1 - \mu_y) z), \qquad z \leftarrow \mathrm{base}(z, \nabla f(y)), \qquad
        y \leftarrow y + (1 - \mu_x \mu_y) z

    The state of each parameter holds ``z`` and, under ``"base"``, the base's own state of z, so ``state_dict()``
    carries both. Per-group hyper-parameters (``lr``, ``weight_decay``, ``mu_x``, ``mu_y`` and the base's own) are
    forwarded to the base before every step, so LR schedulers act on this optimizer as usual.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        base: the base optimizer class, e.g. ``torch.optim.SGD``, ``torch.optim.AdamW``, ``torch.optim.Adafactor``,
            ``torch.optim.Muon`` (2-D parameters) (default: ``torch.optim.AdamW``).
        mu_x: averaging constant of x in [0, 1) (default: 0.9967).
        mu_y: interpolation constant of the gradient point y in (0, 1] (default: 0.7).
        averaging: ``"gpa"`` or ``"schedule_free"`` (Schedule-Free's lr^2-weighted uniform average) (default: "gpa").
        **base_kwargs: the base optimizer's own arguments (lr, momentum, betas, weight_decay, ...).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        base: type[torch.optim.Optimizer] = torch.optim.AdamW,
        mu_x: float = 0.9967,
        mu_y: float = 0.7,
        averaging: str = "gpa",
        **base_kwargs: Any,
    ) -> None:
        check_mu(mu_x, mu_y)
        check_averaging(averaging)
        base_hypers = base_defaults(base, base_kwargs, _GPA_KEYS, "GPA")
        defaults = dict(base_hypers, mu_x=mu_x, mu_y=mu_y, averaging=averaging, weight_sum=0.0)
        super().__init__(params, defaults)
        for group in self.param_groups:
            check_mu(group["mu_x"], group["mu_y"])
            check_averaging(group["averaging"])
            if "lr" in group:
                check_lr(group["lr"])
        self.base_class = base
        self._base_keys = tuple(base_hypers)
        self._base: torch.optim.Optimizer | None = None

    def _build_base(self) -> torch.optim.Optimizer:
        base_groups = []
        for group in self.param_groups:
            zs = []
            for p in group["params"]:
                state = self.state[p]
                if "z" not in state:
                    dtype = state_dtype_for(p)
                    state["z"] = p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format)
                zs.append(state["z"])
            base_groups.append({"params": zs, **{k: group[k] for k in self._base_keys if k in group}})
        base = self.base_class(base_groups)
        # The base's state of z lives inside this optimizer's state of p (one dict object), so it is saved and
        # loaded with it; it starts empty so that the base initializes it lazily as usual.
        for group in self.param_groups:
            for p in group["params"]:
                base.state[self.state[p]["z"]] = self.state[p].setdefault("base", {})
        return base

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The base optimizer acting on z (built on first use)."""
        if self._base is None:
            self._base = self._build_base()
        return self._base

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss at y (optional)."""
        loss = self._closure_loss(closure)
        base = self.base_optimizer
        stepped = []
        for group, base_group in zip(self.param_groups, base.param_groups):
            for key in self._base_keys:
                if key in group:
                    base_group[key] = group[key]
            ys, zs = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                z = self.state[p]["z"]
                z.grad = p.grad if p.grad.dtype == z.dtype else p.grad.to(z.dtype)
                ys.append(local_tensor(p))
                zs.append(local_tensor(z))
            if not ys:
                continue
            lr = float(group.get("lr", 0.0))
            mu_x, group["weight_sum"] = averaging_mu_x(group["averaging"], group["mu_x"], lr, group["weight_sum"])
            mu_y = group["mu_y"]
            _foreach_axpby_(ys, zs, 1.0 - mu_y, mu_x)  # y <- mu_x (y - (1 - mu_y) z) = mu_x mu_y x
            stepped.append((ys, zs, 1.0 - mu_x * mu_y))
        base.step()
        for ys, zs, c in stepped:
            _foreach_add_scaled_(ys, zs, c)  # y <- mu_x mu_y x + (1 - mu_x mu_y) z'
            for z in zs:
                z.grad = None
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load z and the base's state; the base is rebuilt on the loaded z tensors."""
        super().load_state_dict(state_dict)
        self._base = None


def _cpu_pass_kernel(ys: list[torch.Tensor], zs: list[torch.Tensor]) -> Any:
    """The fused CPU kernel module when every tensor is a contiguous CPU tensor and it can be had, else None."""
    if all(t.device.type == "cpu" and t.is_contiguous() for t in (*ys, *zs)):
        return load_cpu_kernel()
    return None


def _foreach_axpby_(ys: list[torch.Tensor], zs: list[torch.Tensor], alpha: float, scale: float) -> None:
    """y <- scale * (y - alpha * z), with z possibly of a wider dtype than y."""
    kernel = _cpu_pass_kernel(ys, zs)
    if kernel is not None:
        kernel.gpa_wrapper_pass(ys, zs, alpha, scale, True)
    elif all(y.dtype == z.dtype for y, z in zip(ys, zs)):
        torch._foreach_sub_(ys, zs, alpha=alpha)
        torch._foreach_mul_(ys, scale)
    else:
        for y, z in zip(ys, zs):
            y.copy_(torch.sub(y.to(z.dtype), z, alpha=alpha).mul_(scale))


def _foreach_add_scaled_(ys: list[torch.Tensor], zs: list[torch.Tensor], c: float) -> None:
    """y <- y + c * z, with z possibly of a wider dtype than y."""
    kernel = _cpu_pass_kernel(ys, zs)
    if kernel is not None:
        kernel.gpa_wrapper_pass(ys, zs, c, 1.0, False)
    elif all(y.dtype == z.dtype for y, z in zip(ys, zs)):
        torch._foreach_add_(ys, zs, alpha=c)
    else:
        for y, z in zip(ys, zs):
            y.copy_(torch.add(y.to(z.dtype), z, alpha=c))
