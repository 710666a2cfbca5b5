"""The fused kernels of hf_gpa's optimizers and the one rule that picks them.

* ``cpu``: the C++ kernel (``csrc/gpa_adamw.cpp``), built once per environment by torch's loader;
* ``triton_launch``: the multi-tensor Triton launcher (imports only torch), ``triton_source``: the kernels (triton).

This module holds what GPAAdamW's step and the GPA wrapper's passes share, once: which implementation a call takes
(`default_to_fused_or_foreach`, torch's rule), which kernel takes a tensor of a device and dtype (`kernel_for`),
which memory layouts a kernel takes (`same_dense_layout`, from ``_tensors``), how the tensors are bucketed into
kernel calls and foreach groups (`fused_buckets`), the one kernel caller (`kernel_module`: the C++ module and the
Triton launcher take the same arguments), and the private test switch (`FORCE`). Which dtypes a kernel takes a
parameter's state in is not decided here: the caller says it per tensor (GPAAdamW asks the state's layout,
``_state_layout``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from types import ModuleType

import torch

from .._tensors import same_dense_layout
from .cpu import load_cpu_kernel

__all__ = ["FORCE", "default_to_fused_or_foreach", "fused_buckets", "kernel_for", "kernel_module", "same_dense_layout"]

#: Private switch for tests: ``FORCE["backend"] = "triton"`` sends every tensor the Triton kernel takes to it on any
#: device (CPU tensors run through Triton's interpreter); ``"foreach"`` sends everything to the foreach ops.
FORCE: dict[str, str | None] = {"backend": None}

_CPU_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


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


def fused_buckets(
    ys: Sequence[torch.Tensor],
    others: Sequence[Sequence[torch.Tensor | None]],
    calls: Sequence[tuple[Hashable, Sequence[torch.dtype | None] | None]],
    use_kernels: bool = True,
) -> tuple[dict[tuple, list[int]], dict[tuple, list[int]]]:
    """Bucket the indices of ``ys`` into kernel calls and foreach calls, deciding per tensor.

    ``others[i]``: the other tensors one call reads and writes for ``ys[i]`` (its gradient, its state; None: one it
    does not have, such as y's float32 copy of an fp32 parameter). ``calls[i]``: (what call it joins, a hashable such
    as GPAAdamW's state layout; the dtype a kernel takes each of ``others[i]`` in, None where it is absent), the
    dtypes being None where no kernel takes this tensor's state. An index goes to a kernel when one takes ``ys[i]``
    (`kernel_for`), all its tensors share one dense layout and have the dtypes asked for. A kernel bucket is one C++
    call (which takes any mix of parameter dtypes), keyed ``("cpu", call, absent)``, or one Triton launch per device
    and dtype, keyed ``("triton", call, absent, device, dtype)``; ``absent`` tells which of the others are None. The
    rest is grouped for foreach by ``(call, device, dtype of y, dtype of each other or None)``: every tensor's own
    dtypes, so one group never mixes, say, a float32 gradient with bf16 ones. ``use_kernels=False``: foreach only.
    """
    kernel_buckets: dict[tuple, list[int]] = defaultdict(list)
    foreach_buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, y in enumerate(ys):
        call, dtypes = calls[i]
        tensors = others[i]
        kernel = kernel_for(y) if use_kernels and dtypes is not None else None
        ok = (
            kernel is not None
            and same_dense_layout(y, tensors)
            and all((t is None) == (d is None) and (t is None or t.dtype == d) for t, d in zip(tensors, dtypes))
        )
        if not ok:
            dtypes_now = tuple(None if t is None else t.dtype for t in tensors)
            foreach_buckets[(call, y.device, y.dtype, dtypes_now)].append(i)
            continue
        absent = tuple(t is None for t in tensors)
        if kernel == "cpu":
            kernel_buckets[("cpu", call, absent)].append(i)
        else:
            kernel_buckets[("triton", call, absent, y.device, y.dtype)].append(i)
    return kernel_buckets, foreach_buckets
