"""The fused kernels of hf_gpa's optimizers and the one rule that picks them.

* ``cpu``: the C++ kernel (``csrc/gpa_adamw.cpp``), built once per environment by torch's loader;
* ``triton_launch``: the multi-tensor Triton launcher (imports only torch), ``triton_source``: the kernels (triton).

This module holds what GPAAdamW's step and the GPA wrapper's passes share, once: which implementation a call takes
(`default_to_fused_or_foreach`, torch's rule), which kernel takes a tensor (`kernel_for`), which layouts a kernel
takes (`same_dense_layout`), how the tensors are bucketed into kernel calls and foreach groups (`fused_buckets`),
the one kernel caller (`kernel_module`: the C++ module and the Triton launcher take the same arguments), and the
private test switch (`FORCE`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from types import ModuleType

import torch

from .._types import state_dtype_for
from .cpu import load_cpu_kernel

__all__ = ["FORCE", "default_to_fused_or_foreach", "fused_buckets", "kernel_for", "kernel_module", "same_dense_layout"]

#: Private switch for tests: ``FORCE["backend"] = "triton"`` sends every tensor the Triton kernel takes to it on any
#: device (CPU tensors run through Triton's interpreter); ``"foreach"`` sends everything to the foreach ops.
FORCE: dict[str, str | None] = {"backend": None}

_CPU_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

#: What a companion tensor's dtype must be for a kernel: the parameter's own, its state dtype (`state_dtype_for`;
#: the parameter's own for a tensor with low words), or int8 (the low words of ``state_dtype="compact"``).
PARAM_DTYPE, STATE_DTYPE, LOW_WORD = "param", "state", "low"
#: The kernels that take the 24-bit y and z of ``state_dtype="compact"`` (``gpa_adamw_step_compact``).
_COMPACT_KERNELS = ("cpu", "triton")


def kernel_for(t: torch.Tensor) -> str | None:
    """The fused kernel ("triton" or "cpu") that takes a tensor of this device and dtype, else None."""
    backend = FORCE["backend"]
    if backend == "foreach":
        return None
    if backend == "triton" or t.device.type == "cuda":
        from . import triton_launch

        return "triton" if triton_launch.triton_available() and triton_launch.supports([t]) else None
    if t.device.type == "cpu" and t.dtype in _CPU_KERNEL_DTYPES and load_cpu_kernel() is not None:
        return "cpu"
    return None


def kernel_module(kind: str) -> ModuleType:
    """The one kernel caller: the module whose ``gpa_adamw_step`` and ``gpa_wrapper_pass`` run a bucket of kind
    "cpu" (the C++ extension) or "triton" (the launcher); both take the same arguments, lists of tensors first."""
    if kind == "cpu":
        return load_cpu_kernel()
    from . import triton_launch

    return triton_launch


def default_to_fused_or_foreach(
    tensors: Sequence[torch.Tensor], foreach: bool | None, fused: bool | None
) -> tuple[bool, bool]:
    """(use fused, use foreach), torch's ``_default_to_fused_or_foreach`` rule for hf_gpa's kernels.

    ``fused=True`` takes the kernels and raises a ``RuntimeError`` (as torch does) where no kernel takes a tensor's
    device and dtype; ``fused=False`` never takes them; ``fused=None`` takes them where every tensor has one, unless
    ``foreach`` is set. ``foreach=False`` (without fused) is the for-loop. What a kernel cannot take for its layout
    (tensors of one parameter that differ in strides) goes to foreach inside the fused path (`fused_buckets`).
    """
    if fused:
        missing = [t for t in tensors if kernel_for(t) is None]
        if missing:
            t = missing[0]
            raise RuntimeError(
                f"`fused=True` requires all the params to be floating point tensors on CPU (fp32, fp64, bf16, fp16, "
                f"with the C++ kernel built) or CUDA (fp32, bf16, fp16, with triton installed), got {t.dtype} on "
                f"{t.device.type}"
            )
        return True, False
    if fused is False or foreach is not None:
        return False, foreach is not False  # not fused: foreach unless the for-loop is asked for
    if tensors and all(kernel_for(t) is not None for t in tensors):
        return True, False
    return False, True


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the strides, sorted, are those of a contiguous tensor of the permuted shape."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda s: s[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def same_dense_layout(ref: torch.Tensor, others: Sequence[torch.Tensor | None]) -> bool:
    """Whether ``ref`` is dense and every other tensor (None: absent) lies in memory like it: an elementwise kernel
    may then run over all of them as flat arrays."""
    shape, stride = ref.shape, ref.stride()
    return all(t is None or (t.shape == shape and t.stride() == stride) for t in others) and _dense(ref)


def fused_buckets(
    ys: Sequence[torch.Tensor],
    companions: Sequence[tuple[Sequence[torch.Tensor | None], str]],
    use_kernels: bool = True,
) -> tuple[dict[tuple, list[int]], dict[tuple, list[int]]]:
    """Bucket the indices of ``ys`` into kernel calls and foreach calls, deciding per tensor.

    ``companions``: the other tensor lists of the update (gradients, z, moments, y's float32 copy), each with the dtype
    a kernel needs it in (`PARAM_DTYPE`, `STATE_DTYPE` or `LOW_WORD`); a None entry is a tensor that this parameter
    does not have (the y32 of an fp32 parameter). An index goes to a kernel when one takes ``ys[i]`` (`kernel_for`),
    all its tensors share one dense layout and have the dtypes needed; a parameter with low words
    (``state_dtype="compact"``: its state is in its own dtype) only to the kernels that take them. A kernel bucket is
    one C++ call (which takes any mix of dtypes), keyed ``("cpu", None, None, absent)``, or one Triton launch per
    device and dtype, keyed ``("triton", device, dtype, absent)``; ``absent`` tells which companions are missing. The
    rest is grouped for foreach by ``(device, dtype of y, dtype of each companion or None)``: every tensor's own
    dtypes, so one group never mixes, say, float32 state with state in the parameter's dtype. ``use_kernels=False``:
    foreach groups only.
    """
    kernel_buckets: dict[tuple, list[int]] = defaultdict(list)
    foreach_buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, y in enumerate(ys):
        kernel = kernel_for(y) if use_kernels else None
        tensors = [lst[i] for lst, _ in companions]
        compact = any(t is not None and need == LOW_WORD for t, (_, need) in zip(tensors, companions))
        ok = kernel is not None and same_dense_layout(y, tensors) and (not compact or kernel in _COMPACT_KERNELS)
        if ok:
            state_dtype = y.dtype if compact else state_dtype_for(y)
            need_dtype = {PARAM_DTYPE: y.dtype, STATE_DTYPE: state_dtype, LOW_WORD: torch.int8}
            ok = all(t is None or t.dtype == need_dtype[need] for t, (_, need) in zip(tensors, companions))
        if not ok:
            foreach_buckets[(y.device, y.dtype, tuple(None if t is None else t.dtype for t in tensors))].append(i)
            continue
        absent = tuple(t is None for t in tensors)
        if kernel == "cpu":
            kernel_buckets[("cpu", None, None, absent)].append(i)
        else:
            kernel_buckets[("triton", y.device, y.dtype, absent)].append(i)
    return kernel_buckets, foreach_buckets
