"""Multi-tensor Triton kernels: GPA-AdamW's step and the GPA wrapper's two passes, a few launches per bucket.

All tensors of a (device, dtype) bucket go through one launch: the host passes tables of the tensors' addresses
(int64) and sizes, plus a block -> (tensor, offset) map; each program updates one block of one tensor. Each element
of y, g, z, m, v is read once and y, z, m, v are written once (plus the float32 copy of y for bf16/fp16 parameters).
The tables depend only on the tensors' addresses and sizes, which do not change from step to step, so they are built
once and cached on the device: a step launches kernels and never synchronizes with the host. A 0-d learning rate
tensor on the device is read by the kernel itself.

Triton is optional: this module is imported only when the Triton path is taken (CUDA with triton installed), and
its kernels are created on first use. Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors through
Triton's interpreter (how CI tests them); bf16 rounding is then done by explicit round-to-nearest-even bit
arithmetic, which matches torch on every backend.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from functools import cache
from typing import Any

import torch

__all__ = ["triton_available", "interpreting", "supports", "gpa_adamw_step", "wrapper_pass"]

BLOCK = 2048
_TABLE_CACHE_SIZE = 64
_tables: OrderedDict[tuple, tuple[torch.Tensor, ...]] = OrderedDict()


@cache
def triton_available() -> bool:
    """Whether ``import triton`` works (cached; never raises)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken triton install means: no Triton path
        return False
    return True


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1``): the kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def supports(tensors: list[torch.Tensor]) -> bool:
    """Whether the Triton kernels can take these tensors: CUDA (or CPU under the interpreter), fp32/bf16/fp16."""
    device_ok = ("cpu",) if interpreting() else ("cuda",)
    return all(t.device.type in device_ok for t in tensors) and all(
        t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in tensors
    )


@cache
def _kernels(interpret: bool) -> Any:
    """The jitted (or interpreted) kernels, created on first use in the mode asked for."""
    import triton
    import triton.language as tl

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction as jit
    else:
        jit = triton.jit

    @jit
    def round_to(x, DTYPE: tl.constexpr):
        # float32 -> DTYPE, rounding to nearest even. bf16 by bit arithmetic: the interpreter's cast truncates.
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
            return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(DTYPE)

    @jit
    def block_of(block_tensor, block_start, numels, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        offs = tl.load(block_start + pid) + tl.arange(0, BLOCK)
        return t, offs, offs < tl.load(numels + t)

    @jit
    def gpa_adamw_kernel(
        y_ptrs, g_ptrs, z_ptrs, m_ptrs, v_ptrs, y32_ptrs, numels, block_tensor, block_start,
        lr_ptr, step_scale, decay_scale, bc2_sqrt, beta1, beta2, eps, one_minus_mu_x, c,
        PARAM: tl.constexpr, GRAD: tl.constexpr, HAS_Y32: tl.constexpr, LR_ON_DEVICE: tl.constexpr,
        MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        t, offs, mask = block_of(block_tensor, block_start, numels, BLOCK)
        y_ptr = tl.load(y_ptrs + t).to(tl.pointer_type(PARAM))
        g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(GRAD))
        z_ptr = tl.load(z_ptrs + t).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32))
        lr = 1.0
        if LR_ON_DEVICE:
            lr = tl.load(lr_ptr).to(tl.float32)
        step_size = lr * step_scale  # lr / bc1
        decay = lr * decay_scale  # lr * weight_decay

        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if MAXIMIZE:
            g = -g
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        z = tl.load(z_ptr + offs, mask=mask, other=0.0)
        y_param = tl.load(y_ptr + offs, mask=mask, other=0.0)
        y = y_param.to(tl.float32)
        if HAS_Y32:
            y32_ptr = tl.load(y32_ptrs + t).to(tl.pointer_type(tl.float32))
            y32 = tl.load(y32_ptr + offs, mask=mask, other=0.0)
            # The float32 copy is y unless something else wrote the parameter since the last step.
            y = tl.where(round_to(y32, PARAM) == y_param, y32, y)

        m = m + (1.0 - beta1) * (g - m)
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        delta = -decay * z - step_size * tl.div_rn(m, denom)  # z' - z
        y = y + one_minus_mu_x * (z - y) + c * delta  # = mu_x mu_y x + (1 - mu_x mu_y) z'

        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(z_ptr + offs, z + delta, mask=mask)
        tl.store(y_ptr + offs, round_to(y, PARAM), mask=mask)
        if HAS_Y32:
            tl.store(y32_ptr + offs, y, mask=mask)

    @jit
    def wrapper_pass_kernel(
        y_ptrs, z_ptrs, y32_ptrs, numels, block_tensor, block_start, alpha, scale,
        PARAM: tl.constexpr, HAS_Y32: tl.constexpr, BEFORE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        t, offs, mask = block_of(block_tensor, block_start, numels, BLOCK)
        y_ptr = tl.load(y_ptrs + t).to(tl.pointer_type(PARAM))
        z_ptr = tl.load(z_ptrs + t).to(tl.pointer_type(tl.float32))
        z = tl.load(z_ptr + offs, mask=mask, other=0.0)
        y_param = tl.load(y_ptr + offs, mask=mask, other=0.0)
        y = y_param.to(tl.float32)
        if HAS_Y32:
            y32_ptr = tl.load(y32_ptrs + t).to(tl.pointer_type(tl.float32))
            y32 = tl.load(y32_ptr + offs, mask=mask, other=0.0)
            if BEFORE:
                y = tl.where(round_to(y32, PARAM) == y_param, y32, y)
            else:
                y = y32  # the parameter is not written between the two passes
        if BEFORE:
            y = scale * (y - alpha * z)
        else:
            y = y + alpha * z
        if HAS_Y32:
            tl.store(y32_ptr + offs, y, mask=mask)
        if not (HAS_Y32 and BEFORE):  # before the base step only the float32 copy moves
            tl.store(y_ptr + offs, round_to(y, PARAM), mask=mask)

    return gpa_adamw_kernel, wrapper_pass_kernel, tl


def _tables_for(lists: list[list[torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Address tables (one per list), sizes, and the block -> (tensor, start) map, cached by addresses and sizes.

    Empty tensors are left out. The result is a pure function of the key, so a cached entry is always right.
    """
    keep = [i for i, t in enumerate(lists[0]) if t.numel() > 0]
    numels = [lists[0][i].numel() for i in keep]
    key = (device, tuple(numels), *(tuple(lst[i].data_ptr() for i in keep) if lst else () for lst in lists))
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        return hit
    block_tensor, block_start = [], []
    for j, n in enumerate(numels):
        starts = range(0, n, BLOCK)
        block_tensor.extend([j] * len(starts))
        block_start.extend(starts)
    host = [torch.tensor([lst[i].data_ptr() for i in keep] if lst else [0], dtype=torch.int64) for lst in lists]
    host += [
        torch.tensor(numels or [0], dtype=torch.int64),
        torch.tensor(block_tensor, dtype=torch.int32),
        torch.tensor(block_start, dtype=torch.int64),
    ]
    if device.type == "cuda":  # pinned staging so the copy does not wait for the stream
        host = [h.pin_memory().to(device, non_blocking=True) for h in host]
    entry = tuple(host)
    _tables[key] = entry
    if len(_tables) > _TABLE_CACHE_SIZE:
        _tables.popitem(last=False)
    return entry


def _dtype(tl: Any, dtype: torch.dtype) -> Any:
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def gpa_adamw_step(
    ys: list[torch.Tensor],
    gs: list[torch.Tensor],
    zs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    y32s: list[torch.Tensor] | None,
    *,
    lr: float | torch.Tensor,
    bc1: float,
    bc2_sqrt: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mu_x: float,
    mu_y: float,
    maximize: bool,
) -> None:
    """One GPA-AdamW step over tensors of one device, parameter dtype and step count (float32 state).

    ``lr`` is a float, or a 0-d tensor on the tensors' device that the kernel reads itself (no host sync).
    ``y32s``: the float32 copies of y (bf16/fp16 parameters), or None.
    """
    if not ys:
        return
    kernel, _, tl = _kernels(interpreting())
    device = ys[0].device
    y_t, g_t, z_t, m_t, v_t, y32_t, numels, block_tensor, block_start = _tables_for(
        [ys, gs, zs, ms, vs, y32s or []], device
    )
    n_blocks = block_tensor.numel() if any(t.numel() for t in ys) else 0
    if n_blocks == 0:
        return
    lr_on_device = torch.is_tensor(lr)
    if lr_on_device:
        step_scale, decay_scale, lr_ptr = 1.0 / bc1, weight_decay, lr
    else:
        step_scale, decay_scale, lr_ptr = lr / bc1, lr * weight_decay, numels  # lr_ptr unused
    kernel[(n_blocks,)](
        y_t, g_t, z_t, m_t, v_t, y32_t, numels, block_tensor, block_start,
        lr_ptr, step_scale, decay_scale, bc2_sqrt, beta1, beta2, eps, 1.0 - mu_x, 1.0 - mu_x * mu_y,
        PARAM=_dtype(tl, ys[0].dtype), GRAD=_dtype(tl, gs[0].dtype), HAS_Y32=y32s is not None,
        LR_ON_DEVICE=lr_on_device, MAXIMIZE=bool(maximize), BLOCK=BLOCK,
    )  # fmt: skip


def wrapper_pass(
    ys: list[torch.Tensor],
    zs: list[torch.Tensor],
    y32s: list[torch.Tensor] | None,
    alpha: float,
    scale: float,
    before: bool,
) -> None:
    """before: y <- scale (y - alpha z); after: y <- y + alpha z (one parameter dtype, float32 z).

    With ``y32s`` (bf16/fp16 parameters) the float32 copy carries y: before the base step only it moves (the
    parameter is not read by the base), after it the parameter receives it rounded.
    """
    if not ys or not any(t.numel() for t in ys):
        return
    _, kernel, tl = _kernels(interpreting())
    y_t, z_t, y32_t, numels, block_tensor, block_start = _tables_for([ys, zs, y32s or []], ys[0].device)
    kernel[(block_tensor.numel(),)](
        y_t, z_t, y32_t, numels, block_tensor, block_start, alpha, scale,
        PARAM=_dtype(tl, ys[0].dtype), HAS_Y32=y32s is not None, BEFORE=before, BLOCK=BLOCK,
    )  # fmt: skip
