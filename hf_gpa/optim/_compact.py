"""The 24-bit values of ``state_dtype="compact"``: a float32 rounded to 24 bits, kept as a bf16 high word and an int8
low word.

A bf16 parameter's y and its z are kept to 24 bits (sign, 8 exponent bits, 15 mantissa bits) instead of float32's
32: the update is computed in float32 and rounded once per step, as every path does it bitwise:

* ``u24 = round-to-nearest-even of u's bit pattern b to a multiple of 256``: ``(b + 0x7F + ((b >> 8) & 1)) & ~0xFF``
  (float32's own rounding, 8 bits shorter; it carries into the exponent as a float rounding does);
* ``hi = (u24 + 0x8000) >> 16``: the bf16 nearest to u24 (ties away from zero), so the parameter holds y rounded to
  nearest, the gradient point within half a bf16 unit as it is with the float32 default;
* ``lo = (u24 >> 8) & 0xFF`` read as a signed byte: u24's bits 15..8, which are exactly ``(u24 - hi << 16) >> 8``
  in [-128, 127] (where the 0x8000 carried, bits 15..8 are >= 128 and their signed reading is the negative rest).

So ``u24 = (hi << 16) + (lo << 8)`` (32-bit integer arithmetic): join and split are exact inverses. The relative
precision is 2^-16 (float32: 2^-24, bf16: 2^-8): the increments of late training (lr times an Adam direction, times
1 - mu_x mu_y on y) that bf16 rounds away are kept. A NaN stays a NaN and +-inf stays +-inf; float32 values within
2^-16 of the largest finite float round to inf.
"""

from __future__ import annotations

import torch

__all__ = ["join24", "split24_"]


def join24(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float32 value of a bf16 high word and an int8 low word (a new tensor)."""
    bits = hi.view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
    return bits.add_(lo.to(torch.int32).bitwise_left_shift_(8)).view(torch.float32)


def split24_(u: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Round float32 ``u`` to 24 bits, writing its high word into ``hi`` (bf16) and its low word into ``lo`` (int8)."""
    b = u.view(torch.int32)
    b24 = torch.bitwise_right_shift(b, 8).bitwise_and_(1).add_(b).add_(0x7F).bitwise_and_(-256)
    hi.view(torch.int16).copy_(torch.add(b24, 0x8000).bitwise_right_shift_(16).to(torch.int16))
    lo.view(torch.uint8).copy_(torch.bitwise_right_shift(b24, 8).bitwise_and_(0xFF).to(torch.uint8))
