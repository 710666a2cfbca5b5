"""The integer residual that makes GPA's eval()/train() round trip bitwise (see ``_gpa_switch``).

x = (y - (1 - mu_y) z) / mu_y is rounded, and going back with y' = mu_y x + (1 - mu_y) z rounds again, so y' can
differ from y by a few units in the last place. Instead of keeping a second copy of y while in eval mode, ``eval()``
keeps the *integer* difference between the bit patterns of y and of its round trip y', and ``train()`` adds it back.
"""

from __future__ import annotations

import torch

__all__ = ["encode_residual", "decode_residual"]

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}



def encode_residual(target: torch.Tensor, approx: torch.Tensor, narrow: bool = True) -> torch.Tensor:
    """Integer difference of the bit patterns, ``bits(target) - bits(approx)``, in the smallest integer dtype.

    The subtraction wraps around in two's complement, so ``decode_residual`` restores ``target`` exactly whatever
    the values; the narrowing to int8/int16 is taken only when every difference fits (and ``narrow`` is set: shards
    of one DTensor must agree on a dtype without talking to each other, so they keep the full width).
    """
    int_dtype = _INT_VIEW[target.dtype]
    diff = target.view(int_dtype) - approx.view(int_dtype)
    for small in (torch.int8, torch.int16, torch.int32) if narrow else ():
        if small.itemsize >= int_dtype.itemsize:
            break
        info = torch.iinfo(small)
        if bool(((diff >= info.min) & (diff <= info.max)).all()):
            return diff.to(small)
    return diff


def decode_residual(approx: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Inverse of `encode_residual`: the exact target from its approximation and the stored residual."""
    int_dtype = _INT_VIEW[approx.dtype]
    return (approx.view(int_dtype) + residual.to(int_dtype)).view(approx.dtype)
