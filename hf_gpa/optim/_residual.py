"""The integer residual that makes GPA's eval()/train() round trip bitwise (see ``_gpa_switch``).

x = (y - (1 - mu_y) z) / mu_y is rounded, and going back with y' = mu_y x + (1 - mu_y) z rounds again, so y' can
differ from y by a few units in the last place. Instead of keeping a second copy of y while in eval mode, ``eval()``
keeps the *integer* difference between the bit patterns of y and of its round trip y', and ``train()`` adds it back.

Almost every difference is a few units, but where |y| is much smaller than |x| or |z| the round trip's error, in
units of y's last place, is large, and one such element would force a wide integer onto the whole tensor (a 1M-weight
matrix needed int32 after 20 steps: 4 bytes per weight). So the residual is int8, one byte per weight, and the rare
differences that do not fit are kept apart as a sparse list of (flat index, difference) pairs (16 bytes each).
"""

from __future__ import annotations

import torch

__all__ = ["encode_residual", "decode_residual", "decode_residual_", "residual_dtype", "bits_differ", "bits_equal"]

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where the bit patterns of ``a`` and ``b`` (one dtype) differ: a NaN equals the same NaN, unlike with ``!=``.

    What ``train()`` asks of x: is it still exactly what ``eval()`` put there (a NaN included), or was it written?
    """
    int_dtype = _INT_VIEW[a.dtype]
    return a.view(int_dtype) != b.view(int_dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (one dtype and shape) hold the same bit patterns everywhere: `bits_differ` nowhere.

    One comparison pass without a mask; contiguous float32 tensors of an even size are compared as int64 pairs
    (on CPU ``torch.equal`` compares element by element, so half the elements take half the time).
    """
    pairs = a.dtype == torch.float32 and a.numel() % 2 == 0
    if pairs and all(t.is_contiguous() and t.storage_offset() % 2 == 0 for t in (a, b)):
        return torch.equal(a.view(-1).view(torch.int64), b.view(-1).view(torch.int64))
    int_dtype = _INT_VIEW[a.dtype]
    return torch.equal(a.view(int_dtype), b.view(int_dtype))


def residual_dtype(dtype: torch.dtype, narrow: bool = True) -> torch.dtype:
    """The dtype of `encode_residual`'s residual for a target of ``dtype``: int8, or its full bit width."""
    return torch.int8 if narrow else _INT_VIEW[dtype]


def encode_residual(
    target: torch.Tensor, approx: torch.Tensor, narrow: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``bits(target) - bits(approx)`` as an int8 tensor of ``target``'s shape and an int64 overflow list.

    The subtraction wraps around in two's complement, so ``decode_residual`` restores ``target`` exactly whatever the
    values. Differences outside int8's range are 0 in the int8 tensor and listed in the overflow, a ``(k, 2)`` int64
    tensor of (index into the flattened tensor, difference). Without ``narrow`` (shards of one DTensor: the residual
    is sharded like the parameter, and the shards cannot agree on a list) the residual keeps the full width of the
    bit pattern and the overflow list is empty.
    """
    int_dtype = _INT_VIEW[target.dtype]
    diff = target.view(int_dtype) - approx.view(int_dtype)
    if not narrow:
        return diff, torch.empty(0, 2, dtype=torch.int64, device=diff.device)
    small = diff.to(torch.int8)  # wraps; exact where the difference fits
    overflow = small != diff
    index = overflow.flatten().nonzero().squeeze(1)
    small.masked_fill_(overflow, 0)
    return small, torch.stack((index, diff.flatten()[index].to(torch.int64)), dim=1)


def decode_residual(
    approx: torch.Tensor, residual: torch.Tensor, overflow: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of `encode_residual`: the exact target from its approximation, the residual and its overflow list.

    Without the overflow list (a loader that dropped it) the listed elements come back as their approximation: within
    a rounding of the larger of |x| and |z|, not bitwise.
    """
    return decode_residual_(approx.clone(memory_format=torch.preserve_format), residual, overflow)


def decode_residual_(
    approx: torch.Tensor, residual: torch.Tensor, overflow: torch.Tensor | None = None
) -> torch.Tensor:
    """`decode_residual` in place: ``approx`` becomes the target (no temporary of its size) and is returned."""
    int_dtype = _INT_VIEW[approx.dtype]
    bits = approx.view(int_dtype)
    listed = overflow is not None and overflow.numel() > 0
    if listed:  # the listed elements are their approximation plus the listed difference, whatever the residual says
        index = overflow[:, 0]
        listed_bits = bits.reshape(-1)[index] + overflow[:, 1].to(int_dtype)
    bits.add_(residual)  # two's complement: wraps like encode_residual's subtraction
    if listed:
        if bits.is_contiguous():
            bits.view(-1)[index] = listed_bits
        else:  # indices are into the flattened (logical) order
            flat = bits.flatten()
            flat[index] = listed_bits
            bits.copy_(flat.view(bits.shape))
    return approx
