"""GPA-AdamW: GPA around AdamW in one fused update, with a for-loop (the ground truth), foreach and CPU-kernel paths.

One step with learning rate lr, AdamW direction d and weight decay wd (paper, Algorithm 1):

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

from ._checks import check_adam, check_averaging, check_lr, check_mu
from ._gpa_modes import GPAModes
from ._kernels import load_cpu_kernel
from ._modes import local_tensor, state_dtype_for
from .schedules import averaging_mu_x

__all__ = ["GPAAdamW"]


class GPAAdamW(GPAModes):
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
