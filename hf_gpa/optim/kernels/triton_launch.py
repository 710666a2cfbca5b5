"""Launching the multi-tensor Triton kernels (``triton_source``): GPA-AdamW's step and the GPA wrapper's passes.

All tensors of a (device, dtype) bucket go through two launches, full blocks (unmasked: vector loads) and the
partial last blocks (masked): the host passes tables of the tensors' addresses (int64) and sizes, plus a block ->
(tensor, offset) map; each program updates one block of one tensor. Each element
of y, g, z, m, v is read once and y, z, m, v are written once (plus the float32 copy of y for bf16/fp16 parameters).
The tables depend only on the tensors' addresses and sizes, which do not change from step to step, so they are built
once and cached on the device: a step launches kernels and never synchronizes with the host. A 0-d learning rate
tensor on the device is read by the kernel itself.

Triton is optional: this module imports only torch, and the kernels module (which imports triton) is loaded on the
first launch. CUDA tensors run the compiled kernels. CPU tensors (reached only through the optimizers' private test
switch) run the same kernel source through Triton's interpreter, as ``TRITON_INTERPRET=1`` would, loaded as a
second copy with Triton's interpret knob set, so interpreted CPU tests and compiled CUDA kernels can share a process;
that is how CI tests the kernels. bf16 rounding is done by explicit round-to-nearest-even bit arithmetic, which
matches torch under the interpreter and on the GPU.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

__all__ = ["triton_available", "supports", "gpa_adamw_step", "gpa_adamw_step_compact", "gpa_wrapper_pass"]

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


@cache
def _kernels(interpret: bool) -> ModuleType:
    """The kernels module: compiled (CUDA tensors), or a second copy run by Triton's interpreter (CPU tensors)."""
    if not interpret:
        from . import triton_source

        return triton_source
    import importlib.util

    import triton

    name = f"{__package__}.triton_source_interpreted"
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("triton_source.py"))
    module = importlib.util.module_from_spec(spec)
    with triton.knobs.runtime.scope():  # triton.jit reads the knob when the module's kernels are defined
        triton.knobs.runtime.interpret = True
        spec.loader.exec_module(module)
    return module


def supports(tensors: list[torch.Tensor]) -> bool:
    """Whether the Triton kernels can take these tensors: CUDA (CPU through the interpreter), fp32/bf16/fp16."""
    return all(t.device.type in ("cuda", "cpu") for t in tensors) and all(
        t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in tensors
    )


def _tables_for(lists: list[list[torch.Tensor]], device: torch.device) -> tuple[Any, ...]:
    """Address tables (one per list), sizes, the block -> (tensor, start) maps of full and of partial blocks, and
    whether every address is 16-byte aligned; cached by addresses and sizes.

    Full blocks run unmasked (vector loads where aligned), the partial last blocks in a second, masked launch. Empty
    tensors are left out. The result is a pure function of the key, so a cached entry is always right.
    """
    keep = [i for i, t in enumerate(lists[0]) if t.numel() > 0]
    numels = [lists[0][i].numel() for i in keep]
    addresses = [[lst[i].data_ptr() for i in keep] if lst else [] for lst in lists]
    key = (device, tuple(numels), *(tuple(a) for a in addresses))
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        return hit
    full_tensor, full_start, tail_tensor, tail_start = [], [], [], []
    for j, n in enumerate(numels):
        n_full = n // BLOCK
        full_tensor.extend([j] * n_full)
        full_start.extend(range(0, n_full * BLOCK, BLOCK))
        if n % BLOCK:
            tail_tensor.append(j)
            tail_start.append(n_full * BLOCK)
    host = [torch.tensor(a or [0], dtype=torch.int64) for a in addresses]
    host.append(torch.tensor(numels or [0], dtype=torch.int64))
    for tensors, starts in ((full_tensor, full_start), (tail_tensor, tail_start)):
        host += [torch.tensor(tensors, dtype=torch.int32), torch.tensor(starts, dtype=torch.int64)]
    if device.type == "cuda":  # pinned staging so the copy does not wait for the stream
        host = [h.pin_memory().to(device, non_blocking=True) for h in host]
    aligned = all(address % 16 == 0 for a in addresses for address in a)
    entry = (*host, aligned)
    _tables[key] = entry
    if len(_tables) > _TABLE_CACHE_SIZE:
        _tables.popitem(last=False)
    return entry


def _dtype(tl: Any, dtype: torch.dtype) -> Any:
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _launches(n: int, keys: list[tuple[float, float]]) -> dict[tuple[float, float], list[int]]:
    """Positions by (bc1, bc2_sqrt), one launch each: one, unless the step counts differ."""
    if keys.count(keys[0]) == n:
        return {keys[0]: list(range(n))}
    by_key: dict[tuple[float, float], list[int]] = {}
    for k, key in enumerate(keys):
        by_key.setdefault(key, []).append(k)
    return by_key


def gpa_adamw_step(*args: Any) -> None:
    """One GPA-AdamW step over tensors of one device and parameter dtype (float32 state), with the C++ kernel's
    arguments: the lists ys, gs, zs, ms, vs, y32s (empty where absent), bc1s, bc2_sqrts, then lr, beta1, beta2, eps,
    weight_decay, mu_x, mu_y, maximize; one launch pair per distinct bias correction.

    ``lr`` is a float, or a 0-d tensor on the tensors' device that the kernel reads itself (no host sync).
    """
    _step(list(args[:6]), *args[6:8], args[8:], compact=False)


def gpa_adamw_step_compact(*args: Any) -> None:
    """The step of ``state_dtype="compact"`` (bf16 y, g, z, m, v; int8 low words of y and z), with the C++ kernel's
    ``gpa_adamw_step_compact`` arguments: the lists ys, gs, zs, ms, vs, y_los, z_los, then as `gpa_adamw_step`."""
    _step(list(args[:7]), *args[7:9], args[9:], compact=True)


def _step(
    all_lists: list[list[torch.Tensor]],
    bc1s: list[float],
    bc2_sqrts: list[float],
    hyper: tuple[Any, ...],
    compact: bool,
) -> None:
    """Launch the step kernel (``compact``: its 24-bit form) over the tensor lists (y's first), one launch pair per
    distinct bias correction."""
    ys = all_lists[0]
    if not ys:
        return
    lr, beta1, beta2, eps, weight_decay, mu_x, mu_y, maximize = hyper
    device = ys[0].device
    kernels = _kernels(device.type == "cpu")
    lr_on_device = torch.is_tensor(lr)
    for (bc1, bc2_sqrt), pos in _launches(len(ys), list(zip(bc1s, bc2_sqrts))).items():
        lists = all_lists
        if len(pos) != len(ys):
            lists = [[lst[k] for k in pos] if lst else lst for lst in lists]
        *tables, numels, full_tensor, full_start, tail_tensor, tail_start, aligned = _tables_for(lists, device)
        if lr_on_device:
            step_scale, decay_scale, lr_ptr = 1.0 / bc1, weight_decay, lr
        else:
            step_scale, decay_scale, lr_ptr = lr / bc1, lr * weight_decay, numels  # lr_ptr unused
        for block_tensor, block_start, masked in ((full_tensor, full_start, False), (tail_tensor, tail_start, True)):
            if block_tensor.numel() == 0:
                continue
            args = (
                *tables, numels, block_tensor, block_start,
                lr_ptr, step_scale, decay_scale, bc2_sqrt, beta1, beta2, eps, 1.0 - mu_x, 1.0 - mu_x * mu_y,
            )  # fmt: skip
            flags = {"LR_ON_DEVICE": lr_on_device, "MAXIMIZE": bool(maximize), "MASKED": masked, "ALIGNED": aligned}
            if compact:
                kernels.gpa_adamw_compact_kernel[(block_tensor.numel(),)](*args, **flags, BLOCK=BLOCK)
                continue
            kernels.gpa_adamw_kernel[(block_tensor.numel(),)](
                *args, PARAM=_dtype(kernels.tl, ys[0].dtype), GRAD=_dtype(kernels.tl, all_lists[1][0].dtype),
                HAS_Y32=bool(all_lists[5]), **flags, BLOCK=BLOCK,
            )  # fmt: skip


def gpa_wrapper_pass(
    ys: list[torch.Tensor], zs: list[torch.Tensor], y32s: list[torch.Tensor], alpha: float, scale: float, before: bool
) -> None:
    """before: y <- scale (y - alpha z); after: y <- y + alpha z (one parameter dtype, float32 z): the C++ kernel's
    arguments (``y32s`` empty where absent).

    With ``y32s`` (bf16/fp16 parameters) the float32 copy carries y: before the base step only it moves (the
    parameter is not read by the base), after it the parameter receives it rounded.
    """
    if not ys:
        return
    kernels = _kernels(ys[0].device.type == "cpu")
    *tables, numels, full_tensor, full_start, tail_tensor, tail_start, aligned = _tables_for(
        [ys, zs, y32s], ys[0].device
    )
    for block_tensor, block_start, masked in ((full_tensor, full_start, False), (tail_tensor, tail_start, True)):
        if block_tensor.numel() == 0:
            continue
        kernels.wrapper_pass_kernel[(block_tensor.numel(),)](
            *tables, numels, block_tensor, block_start, alpha, scale,
            PARAM=_dtype(kernels.tl, ys[0].dtype), HAS_Y32=bool(y32s), BEFORE=before, MASKED=masked,
            ALIGNED=aligned, BLOCK=BLOCK,
        )  # fmt: skip
