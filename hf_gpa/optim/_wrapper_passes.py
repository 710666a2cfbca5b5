"""The two elementwise passes the GPA wrapper adds around its base optimizer's step.

    before the base step:  y <- mu_x (y - (1 - mu_y) z)     (= mu_x mu_y x)
    after it:              y <- y + (1 - mu_x mu_y) z'

Each is one pass over memory: the C++ kernel on CPU, the Triton kernel on CUDA (when triton imports), foreach ops
for what neither takes (other dtypes, tensors of different layouts): the choice and the bucketing are
``kernels.fused_buckets``, the rule GPAAdamW's fused path uses too; the kernels take z in the parameter's
`_state_layout.wide_dtype` (float32 for bf16/fp16 parameters) and y's copy in float32. Complex tensors are passed as
pairs of reals.

bf16/fp16 parameters may come with a float32 copy of y (``y32s``, one entry per parameter, None where there is
none), which then carries y: before the base step only the copy moves (``y`` is left as it was; the base does not
read it), after it the copy moves and the parameter receives it rounded. y's rounding errors then no longer
accumulate into x. The copy is used only while the parameter still equals it rounded, so a parameter written by
something else in between wins.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ._state_layout import wide_dtype
from ._tensors import authoritative_y, real_view
from .kernels import FORCE, fused_buckets, kernel_module

__all__ = ["pass_before_base_", "pass_after_base_"]


def pass_before_base_(
    ys: list[torch.Tensor],
    zs: list[torch.Tensor],
    alpha: float,
    scale: float,
    y32s: list[torch.Tensor | None] | None = None,
) -> None:
    """y <- scale * (y - alpha * z), with z possibly of a wider dtype than y (with a y32: y32 <- ..., y kept)."""
    _wrapper_pass(ys, zs, y32s, alpha, scale, before=True)


def pass_after_base_(
    ys: list[torch.Tensor], zs: list[torch.Tensor], c: float, y32s: list[torch.Tensor | None] | None = None
) -> None:
    """y <- y + c * z, with z possibly of a wider dtype than y (with a y32: y32 <- y32 + c z, y <- y32 rounded)."""
    _wrapper_pass(ys, zs, y32s, c, 1.0, before=False)


def _wrapper_pass(
    ys: list[torch.Tensor],
    zs: list[torch.Tensor],
    y32s: list[torch.Tensor | None] | None,
    alpha: float,
    scale: float,
    before: bool,
) -> None:
    ys, zs = [real_view(y) for y in ys], [real_view(z) for z in zs]
    y32s = list(y32s) if y32s is not None else [None] * len(ys)
    kernel_buckets, foreach_buckets = _buckets(ys, zs, y32s)
    for (kind, _, absent, *_), idx in kernel_buckets.items():
        y32_b = [] if absent[-1] else [y32s[i] for i in idx]
        kernel_module(kind).gpa_wrapper_pass([ys[i] for i in idx], [zs[i] for i in idx], y32_b, alpha, scale, before)
    for (_, _, _, (_, y32_dtype)), idx in foreach_buckets.items():
        y32_b = None if y32_dtype is None else [y32s[i] for i in idx]
        _foreach_pass([ys[i] for i in idx], [zs[i] for i in idx], y32_b, alpha, scale, before)


#: The buckets of the last few lists, as GPAAdamW's plans keep theirs: a step's two passes and the next steps reuse
#: them instead of deciding per tensor again (0.65 ms a pass for 219 tensors on CPU). Keyed by what the decision
#: reads of each tensor (identity, address, dtype, strides, shape); an entry holds its tensors, so no identity in a
#: cached key can be reused by another tensor.
_BUCKETS: OrderedDict[tuple, tuple] = OrderedDict()
_BUCKETS_CACHE_SIZE = 8


def _buckets(
    ys: list[torch.Tensor], zs: list[torch.Tensor], y32s: list[torch.Tensor | None]
) -> tuple[dict[tuple, list[int]], dict[tuple, list[int]]]:
    """`kernels.fused_buckets` of a pass's lists, cached."""
    key = (
        FORCE["backend"],
        *((id(t), t.data_ptr(), t.dtype, t.stride(), t.shape) if t is not None else None for t in (*ys, *zs, *y32s)),
    )
    hit = _BUCKETS.get(key)
    if hit is not None:
        _BUCKETS.move_to_end(key)
        return hit[1], hit[2]
    calls = [("pass", (wide_dtype(y.dtype), None if y32 is None else torch.float32)) for y, y32 in zip(ys, y32s)]
    kernel_buckets, foreach_buckets = fused_buckets(ys, list(zip(zs, y32s)), calls)
    _BUCKETS[key] = ((list(ys), list(zs), list(y32s)), kernel_buckets, foreach_buckets)
    if len(_BUCKETS) > _BUCKETS_CACHE_SIZE:
        _BUCKETS.popitem(last=False)
    return kernel_buckets, foreach_buckets


def _foreach_pass(
    ys: list[torch.Tensor],
    zs: list[torch.Tensor],
    y32s: list[torch.Tensor] | None,
    alpha: float,
    scale: float,
    before: bool,
) -> None:
    """The same passes with foreach ops (one parameter dtype; z in the state dtype)."""
    if y32s is not None:
        if before:
            exact = [authoritative_y(y, y32, y32.dtype) for y, y32 in zip(ys, y32s)]
            torch._foreach_copy_(y32s, exact)
            torch._foreach_sub_(y32s, zs, alpha=alpha)
            torch._foreach_mul_(y32s, scale)
        else:
            torch._foreach_add_(y32s, zs, alpha=alpha)
            torch._foreach_copy_(ys, y32s)
        return
    same_dtype = all(y.dtype == z.dtype for y, z in zip(ys, zs))
    acc = ys if same_dtype else [y.to(z.dtype) for y, z in zip(ys, zs)]
    if before:
        torch._foreach_sub_(acc, zs, alpha=alpha)
        torch._foreach_mul_(acc, scale)
    else:
        torch._foreach_add_(acc, zs, alpha=alpha)
    if not same_dtype:
        torch._foreach_copy_(ys, acc)
