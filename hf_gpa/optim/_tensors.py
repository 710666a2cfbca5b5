"""Tensor helpers every hf_gpa optimizer shares: FSDP2 (DTensor) shards, complex views, memory layouts, bits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "INT_VIEW",
    "authoritative_y",
    "bits_differ",
    "bits_equal",
    "chunks",
    "is_dtensor",
    "local_tensor",
    "real_view",
    "same_dense_layout",
    "shard_like",
]

#: The integer dtype of each floating dtype's bit pattern (``t.view(INT_VIEW[t.dtype])``).
INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The process-local shard of a DTensor (FSDP2), or the tensor itself: GPA's update is elementwise."""
    return t.to_local() if is_dtensor(t) else t


def real_view(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real view (``torch.view_as_real``), as torch's optimizers treat it; else itself."""
    return torch.view_as_real(t) if t.is_complex() else t


def shard_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor sharded like ``param`` when ``param`` is one (so checkpoints gather and reshard it)."""
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def authoritative_y(param: torch.Tensor, y32: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y in ``dtype`` (a new tensor): the float32 copy ``y32`` where the parameter still equals it rounded, else the
    parameter, which something else wrote (``load_state_dict``, a re-initialised head, clipping) and which wins.

    The one statement of the rule "the parameter is authoritative" that every path of a bf16/fp16 parameter applies
    (the fused kernels compare the same way, element by element).
    """
    if y32 is None:
        return param.to(dtype, copy=True)
    return torch.where(y32.to(param.dtype) == param, y32, param.to(dtype))


#: Elements per piece of an elementwise pass that needs temporaries (eval()/train(), the step of half-precision state):
#: they are then a few MB whatever the size of the largest weight, instead of several copies of it.
CHUNK = 1 << 20


def chunks(*tensors: torch.Tensor) -> list[tuple[int, tuple[torch.Tensor, ...]]]:
    """(offset, flat slices) of each run of `CHUNK` elements of tensors of one shape, when every one is contiguous;
    else one run of the whole tensors. The slices are views: an in-place write goes to the tensor."""
    if not all(t.is_contiguous() for t in tensors):
        return [(0, tensors)]
    flat = [t.view(-1) for t in tensors]
    n = flat[0].numel()
    return [(i, tuple(f[i : i + CHUNK] for f in flat)) for i in range(0, max(n, 1), CHUNK)]


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


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where the bit patterns of ``a`` and ``b`` (one dtype) differ: a NaN equals the same NaN, unlike with ``!=``.

    What ``train()`` asks of x: is it still exactly what ``eval()`` put there (a NaN included), or was it written?
    """
    int_dtype = INT_VIEW[a.dtype]
    return a.view(int_dtype) != b.view(int_dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (one dtype and shape) hold the same bit patterns everywhere: `bits_differ` nowhere.

    One comparison pass without a mask; contiguous float32 tensors of an even size are compared as int64 pairs
    (on CPU ``torch.equal`` compares element by element, so half the elements take half the time).
    """
    pairs = a.dtype == torch.float32 and a.numel() % 2 == 0
    if pairs and all(t.is_contiguous() and t.storage_offset() % 2 == 0 for t in (a, b)):
        return torch.equal(a.view(-1).view(torch.int64), b.view(-1).view(torch.int64))
    int_dtype = INT_VIEW[a.dtype]
    return torch.equal(a.view(int_dtype), b.view(int_dtype))
