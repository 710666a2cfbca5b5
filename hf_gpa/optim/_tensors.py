"""Tensor helpers every hf_gpa optimizer shares: FSDP2 (DTensor) shards, complex views, layouts."""

from __future__ import annotations

import torch

__all__ = ["is_dtensor", "local_tensor", "real_view", "shard_like", "authoritative_y", "chunks"]


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
