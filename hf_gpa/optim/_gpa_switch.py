"""What GPAAdamW and the GPA wrapper share: eval() writes x = (y - (1 - mu_y) z) / mu_y, train() restores y bitwise.

Both optimizers store the memory-efficient form of the paper (Algorithm 3): the parameters hold the gradient point y,
the optimizer state holds z, and x is recovered only when ``eval()`` is called.

bf16/fp16 parameters carry y in float32 (``state["y_fp32"]``, the parameter holds it rounded). The parameter stays
authoritative, as in ``step()``: where it no longer equals that copy rounded (a ``load_state_dict``, a re-initialized
head, clipped weights), ``eval()`` takes x from the written value; likewise, where x in the parameter was written
while in eval mode, ``train()`` takes y from the written x. fp32/fp64 parameters follow the same rule: where x is no
longer bitwise what ``eval()`` wrote (recomputed from the restored y; a NaN x that eval() wrote is still its own), the
written x wins and y = mu_y x + (1 - mu_y) z, instead of the residual of the old x being added to it.

Under ``state_dtype="compact"`` (GPAAdamW, bf16 parameters) y and z are 24-bit values whose low words stay in the
state: ``eval()`` computes x from them, and the residual restores the parameter's high word of y, the low word being
kept as it is; where x was written in eval mode, y = mu_y x + (1 - mu_y) z is rounded to 24 bits. How y and z are
read is the state's layout's (``_state_layout``); `to_eval_` and `to_train_` switch one parameter.

**The residual** that makes the round trip bitwise (`encode_residual`, `decode_residual`). x = (y - (1 - mu_y) z) /
mu_y is rounded, and going back with y' = mu_y x + (1 - mu_y) z rounds again, so y' can differ from y by a few units
in the last place. Instead of keeping a second copy of y while in eval mode, ``eval()`` keeps the *integer*
difference between the bit patterns of y and of its round trip y', and ``train()`` adds it back.

Almost every difference is a few units, but where |y| is much smaller than |x| or |z| the round trip's error, in
units of y's last place, is large, and one such element would force a wide integer onto the whole tensor (a 1M-weight
matrix needed int32 after 20 steps: 4 bytes per weight). So the residual is int8, one byte per weight, and the rare
differences that do not fit are kept apart as a sparse list of (flat index, difference) pairs (16 bytes each).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from ._base import TrainEvalOptimizer
from ._state_layout import FLOAT32, HALF_DTYPES, held_through_half, layout_of, wide_dtype
from ._tensors import (
    INT_VIEW,
    authoritative_y,
    bits_differ,
    bits_equal,
    chunks,
    is_dtensor,
    local_tensor,
    real_view,
    same_dense_layout,
    shard_like,
)
from ._types import EVAL_MU_Y, MU_Y, Y_FP32, Y_RESIDUAL, Y_RESIDUAL_OVERFLOW, Z
from .kernels import FORCE, kernel_for, kernel_module

__all__ = [
    "GPASwitch",
    "decode_residual",
    "decode_residual_",
    "encode_residual",
    "follow_half_cast_",
    "residual_dtype",
    "to_eval_",
    "to_train_",
    "x_mu_y",
    "y_across_cast",
]

#: The dtypes whose train() the C++ kernel takes (``gpa_train_residual``); bf16/fp16 with state in their own dtype
#: round every operation to 16 bits, which the torch ops below do.
_TRAIN_KERNEL_DTYPES = (torch.float32, torch.float64)


def _x_from_y(y: torch.Tensor, z: torch.Tensor, mu_y: float) -> torch.Tensor:
    """x = (y - (1 - mu_y) z) / mu_y, computed in z's dtype as z + (y - z) / mu_y, returned in y's dtype.

    Written as a correction to z, x is z exactly where y = z: with mu_x = 0 (x = z after every step) the evaluation
    weights are the base optimizer's bitwise, and where y and z are close the rounding is that of the small difference.
    """
    return torch.sub(y.to(z.dtype), z).div_(mu_y).add_(z).to(y.dtype)


def _y_from_x(x: torch.Tensor, z: torch.Tensor, mu_y: float) -> torch.Tensor:
    """y = mu_y x + (1 - mu_y) z, computed in z's dtype, returned in x's dtype."""
    return torch.lerp(z, x.to(z.dtype), mu_y).to(x.dtype)


def _kernel_takes(x: torch.Tensor, z: torch.Tensor, approx: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether ``gpa_train_residual`` takes these tensors: one dtype (a loaded state keeps its saved dtypes), a
    residual it reads, one contiguous layout (the overflow list's indices are into the logical order)."""
    return (
        z.dtype == approx.dtype == x.dtype
        and residual.dtype in (torch.int8, residual_dtype(x.dtype, narrow=False))
        and x.is_contiguous()
        and same_dense_layout(x, (z, approx, residual))
    )


def x_mu_y(group: dict[str, Any]) -> float:
    """The mu_y that relates the group's parameters to y: in eval mode the one eval() computed x with (recorded in
    the group, so that a mu_y changed in eval mode applies from the next step and train() still restores y bitwise),
    else the group's."""
    return group.get(EVAL_MU_Y, group[MU_Y])


class GPASwitch(TrainEvalOptimizer):
    """eval(): parameters y -> x; train(): x -> y, exact through the bit-pattern residual (`encode_residual`)."""

    def _params_to_eval(self, group: dict[str, Any]) -> None:
        mu_y = group[EVAL_MU_Y] = group[MU_Y]
        for p, state in self._switched(group, mu_y):
            to_eval_(p, state, mu_y)

    def _params_to_train(self, group: dict[str, Any]) -> None:
        mu_y = x_mu_y(group)
        for p, state in self._switched(group, mu_y):
            to_train_(p, state, mu_y, kernel=self._train_kernel(p))
        group.pop(EVAL_MU_Y, None)

    def _train_kernel(self, p: torch.Tensor) -> ModuleType | None:
        """The C++ module whose ``gpa_train_residual`` takes train()'s pass of ``p`` (fp32/fp64 where the kernels'
        rule, `kernels.kernel_for`, gives its tensors the CPU kernel), else None (torch ops). Resolved once per test
        switch (`kernels.FORCE`), device and dtype, so that train() runs no dispatch code."""
        x = real_view(local_tensor(p))
        key = (FORCE["backend"], x.device, x.dtype)
        resolved = self.__dict__.setdefault("_train_kernels", {})  # not pickled: resolved again in a copy
        if key not in resolved:
            takes = x.dtype in _TRAIN_KERNEL_DTYPES and kernel_for(x) == "cpu"
            resolved[key] = kernel_module("cpu") if takes else None
        return resolved[key]

    def _switched(self, group: dict[str, Any], mu_y: float) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """The group's parameters that have a state and whose x and y differ (never stepped: x = y = z; mu_y = 1:
        x = y)."""
        if mu_y == 1.0:
            return []
        return [(p, self.state[p]) for p in group["params"] if Z in self.state.get(p, ())]


def follow_half_cast_(p: torch.Tensor, state: dict[str, Any], mu_y: float, *, train_mode: bool) -> None:
    """A float32 state (y's float32 copy) fits bf16 and fp16 parameters alike, so a cast between the two
    (``model.half()`` on a bf16 model, a bf16 checkpoint loaded into an fp16 copy) leaves it as it is, while the
    parameter holds y (x in eval mode) rounded to the old dtype, which would read as a write and cost y's float32
    copy. Where the whole tensor holds exactly that (the state's value rounded through the other half dtype, and not
    to its own), it receives the value rounded to its own dtype, as if the run had been in it. A tensor written since
    (clipped, re-initialised, loaded: not every element the state's value through the other dtype) stays written."""
    layout = layout_of(state)
    local = local_tensor(p)
    if layout is not FLOAT32 or local.dtype not in HALF_DTYPES:
        return
    other = torch.float16 if local.dtype == torch.bfloat16 else torch.bfloat16
    param, z, y32 = real_view(local), real_view(local_tensor(state[Z])), real_view(local_tensor(state[Y_FP32]))
    pieces = chunks(param, z, y32)

    def wide_of(zc: torch.Tensor, y32c: torch.Tensor) -> torch.Tensor:
        return y32c if train_mode else _x_from_y(y32c, zc, mu_y)

    cast = False
    for _, (pc, zc, y32c) in pieces:
        wide = wide_of(zc, y32c)
        if bool(bits_differ(pc, wide.to(other).to(pc.dtype)).any()):
            return  # written (or never of the other dtype): the parameter's values are its own
        cast = cast or bool(bits_differ(pc, wide.to(pc.dtype)).any())
    if cast:  # recomputed piece by piece, not held: in eval mode each piece's x is a float32 temporary
        for _, (pc, zc, y32c) in pieces:
            pc.copy_(wide_of(zc, y32c))


def y_across_cast(
    p: torch.Tensor, state: dict[str, Any], z: torch.Tensor, mu_y: float, *, train_mode: bool
) -> torch.Tensor:
    """y exactly, in `wide_dtype` of ``p``'s dtype, of a parameter whose dtype changed under its state (a cast model,
    a checkpoint loaded into parameters of another dtype), for `_state_layout.convert_`; ``z``: z exactly
    (`StateLayout.wide_state`), ``train_mode``: whether the parameter holds y (else x, as eval() wrote it).

    Element by element, where the parameter holds what the state says it held (y, or eval()'s x) rounded to the old
    dtype, y is the state's, exactly; elsewhere it was written since and wins: y is the parameter in train mode, and
    mu_y x + (1 - mu_y) z computed in the new dtype's state dtype from the written x in eval mode (nothing rounds the
    written value through the old dtype). Under ``"compact"`` in train mode y's high word is the parameter alone, so a
    write shows only as values bf16 cannot hold: the tensor is the unit there, one such value and the whole tensor is
    taken as written (y = the parameter, no stale low word); a write of bf16 values only reads as the cast."""
    source = layout_of(state)
    local = local_tensor(p)
    wide = wide_dtype(local.dtype)
    if source is FLOAT32:
        y32 = local_tensor(state[Y_FP32])
        # What the parameter held before its rounding to the old dtype, bf16 or fp16.
        kept = held_through_half(local, y32 if train_mode else _x_from_y(y32, z, mu_y))
        y_state = y32
    else:
        (old,) = source.saved_dtypes(state)
        narrow = local.to(old, copy=True)
        kept = ~bits_differ(narrow.to(local.dtype), local)
        if not train_mode:  # y where eval()'s x was not written, and where it was
            found = torch.zeros_like(narrow, dtype=torch.bool)
            to_train_(narrow, state, mu_y, written_out=found)
            kept &= ~found
        elif source.switch_tensors(state) and not bool(kept.all()):
            kept.zero_()
        y_state = source.wide_y(narrow, state)
    written = local.to(wide) if train_mode else torch.lerp(z.to(wide), local.to(wide), mu_y)
    return torch.where(kept, y_state.to(wide), written)


def to_eval_(p: torch.Tensor, state: dict[str, Any], mu_y: float) -> None:
    """eval() of one parameter: y -> x in ``p`` (a parameter, or a plain tensor standing for one), with what gives y
    back stored in ``state``."""
    y, z = real_view(local_tensor(p)), real_view(local_tensor(state[Z]))
    layout = layout_of(state)
    if layout is FLOAT32:  # bf16/fp16: x from the float32 y; train() restores y from it, no residual
        y32 = real_view(local_tensor(state[Y_FP32]))
        for _, (yc, zc, y32c) in chunks(y, z, y32):
            y32c.copy_(authoritative_y(yc, y32c, y32c.dtype))
            yc.copy_(_x_from_y(y32c, zc, mu_y))
        return
    narrow = not is_dtensor(p)
    residual = torch.empty_like(y, dtype=residual_dtype(y.dtype, narrow))
    overflows = []
    for offset, (yc, zc, rc, *extra) in chunks(y, z, residual, *layout.switch_tensors(state)):
        y_exact, z_exact = layout.exact(yc, zc, extra)
        xc = _x_from_y(y_exact, z_exact, mu_y).to(yc.dtype)
        small, overflow = encode_residual(yc, _y_from_x(xc, z_exact, mu_y), narrow=narrow)
        rc.copy_(small)
        overflow[:, 0] += offset  # indices into the whole flattened tensor
        overflows.append(overflow)
        yc.copy_(xc)
    state[Y_RESIDUAL] = shard_like(residual, p)
    if narrow:  # a DTensor's shards keep a full-width residual and no list (see `encode_residual`)
        state[Y_RESIDUAL_OVERFLOW] = torch.cat(overflows)


def to_train_(
    p: torch.Tensor,
    state: dict[str, Any],
    mu_y: float,
    written_out: torch.Tensor | None = None,
    kernel: ModuleType | None = None,
) -> None:
    """train() of one parameter: x -> y in ``p``, bitwise the y `to_eval_` found (where x was not written since).
    ``written_out`` (bool, ``p``'s shape, contiguous), if given, is set where x was written since. ``kernel``: the C++
    module that takes the pass where its tensors allow (`GPASwitch._train_kernel`), None: torch ops alone."""
    x, z = real_view(local_tensor(p)), real_view(local_tensor(state[Z]))
    layout = layout_of(state)
    marks = () if written_out is None else (real_view(written_out),)
    if layout is FLOAT32:
        _float32_to_train_(x, z, real_view(local_tensor(state[Y_FP32])), mu_y, marks)
        return
    if Y_RESIDUAL not in state:  # a loader dropped the residual (see `encode_residual`): y by rounding, not bitwise
        extra = layout.switch_tensors(state)
        _, z_exact = layout.exact(x, z, extra)
        x.copy_(layout.store_y(torch.lerp(z_exact, x.to(z_exact.dtype), mu_y), x, extra))
        if written_out is not None:
            written_out.fill_(True)  # nothing tells eval()'s x: every element is taken from x, as if written
        return
    residual = local_tensor(state.pop(Y_RESIDUAL))
    overflow = state.pop(Y_RESIDUAL_OVERFLOW, None)
    pieces = chunks(x, z, residual, *marks, *layout.switch_tensors(state))
    if overflow is not None and overflow.numel():
        # Where each piece's entries start in the (index-sorted) list: one search, one read to the host.
        starts = torch.tensor([offset for offset, _ in pieces] + [x.numel()], device=overflow.device)
        rows = torch.searchsorted(overflow[:, 0].contiguous(), starts).tolist()
    if marks:
        kernel = None  # it tells no written elements
    for k, (offset, (xc, zc, rc, *rest)) in enumerate(pieces):
        mark, extra = rest[: len(marks)], rest[len(marks) :]
        listed = None
        if overflow is not None and overflow.numel():
            listed = overflow[rows[k] : rows[k + 1]] - torch.tensor([offset, 0], device=overflow.device)
        _, z_exact = layout.exact(xc, zc, extra)
        approx = _y_from_x(xc, z_exact, mu_y)
        if not extra and kernel is not None and _kernel_takes(xc, zc, approx, rc):
            # The rest of the pass below in one pass over memory (held to it bitwise by tests/test_modes.py).
            none = torch.empty(0, 2, dtype=torch.int64)
            kernel.gpa_train_residual(xc, zc, approx, rc, none if listed is None else listed, mu_y)
            continue
        y = decode_residual_(approx, rc, listed)
        # The residual restores the y of the x eval() wrote; where x was written since, x wins (as for bf16).
        # One pass compares the whole piece; the mask is built only where something was written.
        y_exact, _ = layout.exact(y, zc, extra)
        x_again = _x_from_y(y_exact, z_exact, mu_y).to(xc.dtype)
        if not bits_equal(xc, x_again):
            written = bits_differ(xc, x_again)
            if mark:
                mark[0].copy_(written)
            y_lo = extra[0].clone() if extra else None
            y_new = layout.store_y(torch.lerp(z_exact, xc.to(z_exact.dtype), mu_y), xc, extra)
            if extra:  # the low words of the elements not written stay those eval() kept
                extra[0].copy_(torch.where(written, extra[0], y_lo))
            y = torch.where(written, y_new, y)
        xc.copy_(y)


def _float32_to_train_(
    x: torch.Tensor, z: torch.Tensor, y32: torch.Tensor, mu_y: float, marks: tuple[torch.Tensor, ...]
) -> None:
    """`to_train_` of the float32 layout: y from its float32 copy ``y32``, where x holds what eval() wrote; where x
    was written since, y from x (``marks``: where, if asked)."""
    for _, (xc, zc, y32c, *mark) in chunks(x, z, y32, *marks):
        written = bits_differ(xc, _x_from_y(y32c, zc, mu_y).to(xc.dtype))  # eval()'s x, recomputed
        if mark:
            mark[0].copy_(written)
        if bool(written.any()):
            y32c.copy_(torch.where(written, _y_from_x(xc.to(y32c.dtype), zc, mu_y), y32c))
        xc.copy_(y32c)


# ---- the residual ----


def residual_dtype(dtype: torch.dtype, narrow: bool = True) -> torch.dtype:
    """The dtype of `encode_residual`'s residual for a target of ``dtype``: int8, or its full bit width."""
    return torch.int8 if narrow else INT_VIEW[dtype]


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
    int_dtype = INT_VIEW[target.dtype]
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
    int_dtype = INT_VIEW[approx.dtype]
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
