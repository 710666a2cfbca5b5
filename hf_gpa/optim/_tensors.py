"""Tensor helpers every hf_gpa optimizer shares: the state dtype, FSDP2 (DTensor) shards, complex views, layouts."""

from __future__ import annotations

import torch

__all__ = ["state_dtype_for", "is_dtensor", "local_tensor", "real_view", "shard_like"]


def state_dtype_for(param: torch.Tensor) -> torch.dtype:
    """The dtype of z and of the base optimizer's moments for a parameter.

    Half-precision parameters (bf16, fp16) keep their optimizer state, z included, in float32: z is the only
    unaveraged copy of the weights and small updates would vanish in bf16. fp32 and fp64 keep their own dtype.
    """
    return torch.float32 if param.dtype in (torch.bfloat16, torch.float16) else param.dtype


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
