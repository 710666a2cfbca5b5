"""The optimizer state of one parameter, for every hf_gpa optimizer: which keys, in which dtypes, how they are created.

**GPAAdamW** keeps its state in one of three layouts, which every path asks and nothing else decides (below).
**The wrappers** keep their own tensors beside their base's state (``state["base"]``), in `wide_dtype` of the
parameter's (float32 for bf16/fp16 parameters, the parameter's own otherwise), created here: `GPA`'s z (`gpa_z`, the
tensor its base moves) and, for bf16/fp16 parameters, y's float32 copy ``y_fp32`` (`gpa_y_fp32`, the parameter holds
it rounded, as under `FLOAT32`); `DiLoCo`'s outer weights ``outer`` and outer momentum ``outer_momentum_buffer`` and,
for bf16/fp16 parameters, the inner weights ``inner_fp32`` its base steps (`diloco_state`). How a wrapper's state
follows a cast of its parameters is the wrapper's (``gpa.py``, ``diloco.py``), with the checks of `refusal`.

**GPAAdamW's layouts.** Beside its step count, a parameter's state holds z (the unaveraged iterate), AdamW's moments
m and v, and, where the parameter's own dtype cannot carry y to float32's precision, more of y. A layout says which
tensors, in which dtypes, and what is done with them:

* ``"param"`` (`PARAM`): z, m and v in the parameter's dtype. The layout of every fp32/fp64 parameter, and of
  bf16/fp16 ones under ``state_dtype="param"`` (6 bytes per bf16 weight, y and z rounded to 16 bits each step).
* ``"float32"`` (`FLOAT32`): bf16/fp16 parameters, z, m, v and y's copy ``y_fp32`` in float32 (16 bytes per weight);
  the parameter holds y rounded. fp16 parameters take it under ``state_dtype="compact"`` too.
* ``"compact"`` (`COMPACT`, the default for bf16 parameters): y and z as 24-bit values, a bf16 high word and an int8
  low word each (y's high word is the parameter, its low word ``y_lo``; z's high word ``z``, its low word ``z_lo``),
  m and v in bf16: 8 bytes per weight with float32 state's accuracy (`join24`, `split24_`).

A layout owns: its keys and their dtypes for a parameter dtype (`StateLayout.dtypes`); how a new state is created
(`StateLayout.create`); how the for-loop and foreach paths widen the state to float32 working copies and round them
back once per step (`StateLayout.widen`, `StateLayout.narrow_`); which tensors a fused kernel takes, in which dtypes
and through which entry (`StateLayout.kernel_dtypes`, `StateLayout.kernel`, `StateLayout.kernel_lists`: the kernels'
bucketing asks it); how eval()/train() read y and z exactly (`StateLayout.exact`, `StateLayout.store_y`); and how a
state becomes another parameter dtype's (`convert_`: a cast model, a checkpoint loaded into parameters of another
dtype): converted exactly into that dtype's widest layout (`widest`), or refused (`refusal`) where it cannot be.

The layout of a state is read from its keys (`layout_of`); the one of a new state from the parameter's dtype and the
group's ``state_dtype`` (`layout_for`). A state whose dtypes do not fit its parameter any more (`StateLayout.fits`)
is converted before anything reads it. What clearing or replacing a state means is torch's: the next step creates it
afresh (GPAAdamW's plans check that the state they hold is still the one in ``optimizer.state``).
"""

from __future__ import annotations

from typing import Any

import torch

from ._tensors import authoritative_y, local_tensor, shard_like
from ._types import EXP_AVG, EXP_AVG_SQ, INNER_FP32, OUTER, OUTER_MOMENTUM_BUFFER, Y_FP32, Y_LO, Z_LO, Z

__all__ = [
    "COMPACT",
    "FLOAT32",
    "HALF_DTYPES",
    "PARAM",
    "StateLayout",
    "convert_",
    "diloco_state",
    "gpa_y_fp32",
    "gpa_z",
    "join24",
    "layout_for",
    "layout_of",
    "held_through_half",
    "refusal",
    "split24_",
    "wide_dtype",
    "widest",
]

#: Parameter dtypes too narrow to carry z or y to float32's precision.
HALF_DTYPES = (torch.bfloat16, torch.float16)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a parameter's state is kept at full precision: float32 for bf16/fp16 parameters (z is the
    only unaveraged copy of the weights, and small updates would vanish in bf16), the parameter's own otherwise. The
    dtype of the GPA wrapper's and DiLoCo's state, and of `FLOAT32`'s."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


# ---- the wrappers' own state ----


def gpa_z(p: torch.Tensor) -> torch.Tensor:
    """The GPA wrapper's z of a parameter before its first step: y, in `wide_dtype` of its dtype (its base moves z)."""
    return p.detach().to(dtype=wide_dtype(p.dtype), copy=True, memory_format=torch.preserve_format)


def gpa_y_fp32(p: torch.Tensor) -> torch.Tensor | None:
    """The GPA wrapper's float32 copy of y (``state["y_fp32"]``) of a bf16/fp16 parameter, which holds it rounded, as
    in GPAAdamW's `FLOAT32` (x stays as exact as z); None for an fp32/fp64 parameter, which holds y itself."""
    if p.dtype not in HALF_DTYPES:
        return None
    return p.detach().to(torch.float32, memory_format=torch.preserve_format)


def diloco_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """DiLoCo's own state of a parameter before its first step, in `wide_dtype` of its dtype: the outer weights (the
    current weights), a zero outer momentum and, for a bf16/fp16 parameter, the inner weights its base steps (the
    parameter holds them rounded)."""
    dtype = wide_dtype(p.dtype)
    state = {
        OUTER: p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format),
        OUTER_MOMENTUM_BUFFER: torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format),
    }
    if dtype != p.dtype:
        state[INNER_FP32] = p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format)
    return state


def gpa_diloco_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPA across workers' own state of a parameter before its first step: `diloco_state` with z (``state["z"]``)
    beside x (``state["outer"]``), both the current weights, and no outer momentum (its outer step has none)."""
    state = diloco_state(p)
    del state[OUTER_MOMENTUM_BUFFER]
    state[Z] = state[OUTER].clone(memory_format=torch.preserve_format)
    return state


def diloco_residual(outer: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A compressed outer sync's error-feedback residual of a parameter (``state["outer_residual"]``, and with more
    than two workers ``state["outer_server_residual"]``), created at its first compressed outer step: zeros in the
    dtype of its outer weights (``outer``, this process's local tensor), contiguous (the flat buckets view it), and
    sharded as ``p`` is."""
    return shard_like(torch.zeros(outer.shape, dtype=outer.dtype, device=outer.device), p)


# ---- the 24-bit values of "compact" ----
#
# A float32 u is rounded to 24 bits (sign, 8 exponent bits, 15 mantissa bits) and kept as two words:
#
# * u24 = round-to-nearest-even of u's bit pattern b to a multiple of 256: (b + 0x7F + ((b >> 8) & 1)) & ~0xFF
#   (float32's own rounding, 8 bits shorter; it carries into the exponent as a float rounding does);
# * hi = (u24 + 0x8000) >> 16, the bf16 nearest to u24 (ties away from zero): the parameter holds y rounded to nearest;
# * lo = (u24 >> 8) & 0xFF read as a signed byte: u24's bits 15..8, which are exactly (u24 - hi << 16) >> 8 in
#   [-128, 127], an offset of the magnitude in 1/256ths of hi's last place.
#
# join(hi, lo) = (hi << 16) + (lo << 8) in 32-bit integers, the exact inverse of split for every pair split writes.
# A high word written by something else (a weight set to 0.0, a re-initialised bias) meets a stale low word; every
# such pair must still be a number within half a bf16 unit of hi. Only two kinds of pair leave the finite numbers:
# hi = +-0 with lo < 0 (a magnitude below zero: the bits wrap to a NaN) and hi = +-inf with lo != 0; join takes hi
# alone for them (0 and inf are their own 24-bit values). split writes a NaN as bf16's quiet NaN with lo = 0 (the
# rounding above would carry some NaN bit patterns into a zero). The relative precision is 2^-16 (float32: 2^-24,
# bf16: 2^-8); float32 values within 2^-16 of the largest finite float round to inf. The C++ and Triton kernels
# (``kernels/csrc/gpa_adamw.cpp``, ``kernels/triton_source.py``) compute the same words, bit for bit.


def join24(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float32 value of a bf16 high word and an int8 low word (a new tensor); finite for every finite ``hi``."""
    hi_bits = hi.view(torch.int16).to(torch.int32)
    magnitude = hi_bits.bitwise_and(0x7FFF)
    # lo is ignored where it would leave the numbers: hi = +-0 with lo < 0, hi = +-inf.
    ignored = ((magnitude == 0) & (lo < 0)) | (magnitude == 0x7F80)
    low = lo.to(torch.int32).masked_fill_(ignored, 0).bitwise_left_shift_(8)
    return hi_bits.bitwise_left_shift_(16).add_(low).view(torch.float32)


def split24_(u: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Round float32 ``u`` to 24 bits, writing its high word into ``hi`` (bf16) and its low word into ``lo`` (int8)."""
    b = u.view(torch.int32)
    b24 = torch.bitwise_right_shift(b, 8).bitwise_and_(1).add_(b).add_(0x7F).bitwise_and_(-256)
    nan = u.isnan()
    high = torch.add(b24, 0x8000).bitwise_right_shift_(16).masked_fill_(nan, 0x7FC0)
    hi.view(torch.int16).copy_(high.to(torch.int16))
    low = torch.bitwise_right_shift(b24, 8).bitwise_and_(0xFF).masked_fill_(nan, 0)
    lo.view(torch.uint8).copy_(low.to(torch.uint8))


# ---- the layouts ----

_MOMENTS = (Z, EXP_AVG, EXP_AVG_SQ)

Cols = list[list[torch.Tensor]]  # a bucket's state tensors: one list per key of the layout, in its order
Wide = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]  # y, z, m, v


class StateLayout:
    """One way of keeping a parameter's state (see the module docstring); `PARAM`, `FLOAT32` and `COMPACT` are the
    three there are. Lists hold one entry per tensor of a bucket, ``cols`` one list per key of ``keys``."""

    #: The name ``state_dtype`` gives it.
    name: str
    #: The state tensors of the update beside y, in the order of the fused kernels' arguments: z, m, v, then the
    #: layout's own.
    keys: tuple[str, ...]
    #: The fused kernels' entry that takes this layout (``gpa_adamw_step`` or ``gpa_adamw_step_compact``).
    kernel: str = "gpa_adamw_step"
    #: Whether ``fused=None`` takes the Triton kernel (CUDA) for this layout; else only ``fused=True`` does and the
    #: default is foreach.
    triton_by_default: bool = True

    def dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The dtype of each key, for a parameter of ``dtype``."""
        raise NotImplementedError

    def fits(self, dtype: torch.dtype, state: dict[str, Any]) -> bool:
        """Whether ``state`` (of this layout) is right for a parameter of ``dtype``; else it is converted."""
        return all(key in state and state[key].dtype == d for key, d in zip(self.keys, self.dtypes(dtype)))

    def create(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of a parameter before its first step: z = y, m = v = 0 (the step count is the optimizer's)."""
        z = p.detach().to(dtype=self.dtypes(p.dtype)[0], copy=True, memory_format=torch.preserve_format)
        return {
            Z: z,
            EXP_AVG: torch.zeros_like(z, memory_format=torch.preserve_format),
            EXP_AVG_SQ: torch.zeros_like(z, memory_format=torch.preserve_format),
        }

    # ---- the step ----

    def widens(self, dtype: torch.dtype) -> bool:
        """Whether the update runs on float32 working copies of this state (`widen`): then the foreach path works a
        piece of each tensor at a time, so that the copies take a few MB."""
        return False

    def widen(self, ys: list[torch.Tensor], cols: Cols) -> Wide:
        """y, z, m, v as the update computes them (float32 for bf16/fp16 parameters), updated in place and rounded
        back by `narrow_`: the tensors themselves where they are that already."""
        return ys, cols[0], cols[1], cols[2]

    def narrow_(self, wide: Wide, ys: list[torch.Tensor], cols: Cols) -> None:
        """Write `widen`'s working copies back into the parameters and the state, rounding each once."""

    def kernel_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...] | None:
        """The dtypes a fused kernel takes the gradient and ``keys`` in, for a parameter of ``dtype`` (None where no
        kernel takes this state: the bucketing sends it to foreach)."""
        return (dtype, *self.dtypes(dtype))

    def kernel_lists(self, cols: Cols) -> list[list[torch.Tensor]]:
        """``cols`` as the kernel's entry takes them after y and the gradients."""
        return cols

    # ---- eval() and train() ----

    def switch_tensors(self, state: dict[str, Any]) -> list[torch.Tensor]:
        """State tensors that eval()/train() read beside y and z (the low words of `COMPACT`)."""
        return []

    def exact(self, y: torch.Tensor, z: torch.Tensor, extra: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """y and z as the update keeps them (``extra``: `switch_tensors`, sliced as y and z are)."""
        return y, z

    def store_y(self, y_wide: torch.Tensor, y: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
        """``y_wide`` in the parameter's form: rounded to its dtype (`COMPACT`: split, the low word written)."""
        return y_wide.to(y.dtype)

    # ---- conversion ----

    def saved_dtypes(self, state: dict[str, Any]) -> tuple[torch.dtype, ...]:
        """The dtypes the parameters this state was made for may have had (one, but for `FLOAT32`'s bf16 or fp16)."""
        return (state[Z].dtype,)

    def wide_y(self, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """y exactly, from ``y`` (the parameter in one of `saved_dtypes`, holding y) and the state, in float32 or
        wider."""
        return y.to(torch.promote_types(y.dtype, torch.float32))

    def wide_state(self, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """z, m and v exactly, each in float32 or wider (local tensors)."""
        wide = (local_tensor(state[key]) for key in _MOMENTS)
        return tuple(t.to(torch.promote_types(t.dtype, torch.float32)) for t in wide)

    def from_wide(
        self, p: torch.Tensor, y: torch.Tensor, wide: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The state of local parameter ``p`` holding exact values y, z, m, v (as `widest` of ``p``'s dtype; `refusal`
        said they fit), the parameter written with y in its form."""
        raise NotImplementedError


class _Param(StateLayout):
    name = "param"
    keys = _MOMENTS

    def dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (dtype, dtype, dtype)

    def widens(self, dtype: torch.dtype) -> bool:
        return dtype in HALF_DTYPES

    def widen(self, ys: list[torch.Tensor], cols: Cols) -> Wide:
        if ys[0].dtype not in HALF_DTYPES:
            return ys, cols[0], cols[1], cols[2]
        return [y.float() for y in ys], *([t.float() for t in col] for col in cols)

    def narrow_(self, wide: Wide, ys: list[torch.Tensor], cols: Cols) -> None:
        if ys[0].dtype in HALF_DTYPES:
            torch._foreach_copy_([*ys, *cols[0], *cols[1], *cols[2]], [t for lst in wide for t in lst])

    def kernel_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...] | None:
        return None if dtype in HALF_DTYPES else super().kernel_dtypes(dtype)

    def kernel_lists(self, cols: Cols) -> list[list[torch.Tensor]]:
        return [*cols, []]  # no copies of y

    def from_wide(
        self, p: torch.Tensor, y: torch.Tensor, wide: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        p.copy_(y)
        return {key: t.to(p.dtype) for key, t in zip(self.keys, wide)}


class _Float32(StateLayout):
    name = "float32"
    keys = (*_MOMENTS, Y_FP32)

    def dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (torch.float32,) * 4

    def fits(self, dtype: torch.dtype, state: dict[str, Any]) -> bool:
        return dtype in HALF_DTYPES and super().fits(dtype, state)

    def create(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        y32 = p.detach().to(dtype=torch.float32, copy=True, memory_format=torch.preserve_format)
        return {**super().create(p), Y_FP32: y32}

    def widen(self, ys: list[torch.Tensor], cols: Cols) -> Wide:
        # y from its float32 copy, where the parameter still holds it rounded (else it was written, and wins).
        return [authoritative_y(y, y32, torch.float32) for y, y32 in zip(ys, cols[3])], cols[0], cols[1], cols[2]

    def narrow_(self, wide: Wide, ys: list[torch.Tensor], cols: Cols) -> None:
        torch._foreach_copy_(cols[3], wide[0])
        torch._foreach_copy_(ys, wide[0])

    def saved_dtypes(self, state: dict[str, Any]) -> tuple[torch.dtype, ...]:
        return HALF_DTYPES  # the state fits both

    def wide_y(self, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        return authoritative_y(y, local_tensor(state[Y_FP32]), torch.float32)

    def from_wide(
        self, p: torch.Tensor, y: torch.Tensor, wide: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        y32 = y.to(torch.float32, copy=True)
        p.copy_(y32)
        return {**{key: t.to(torch.float32) for key, t in zip(_MOMENTS, wide)}, Y_FP32: y32}


class _Compact(StateLayout):
    name = "compact"
    keys = (*_MOMENTS, Y_LO, Z_LO)
    kernel = "gpa_adamw_step_compact"
    # On an H200 (torch 2.11, Triton 3.6) the compiled compact kernel ended up to 8 bf16 ulps from the for-loop after
    # 5 steps, first in a tensor of 4097 elements (tests/test_gpu.py), where foreach matched the for-loop and the
    # interpreter matches it on CPU: not yet explained, so fused=None keeps compact state on foreach on CUDA
    # (docs/gpu.md, "Found on a GPU").
    triton_by_default = False

    def dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16,) * 3 + (torch.int8,) * 2

    def fits(self, dtype: torch.dtype, state: dict[str, Any]) -> bool:
        return dtype == torch.bfloat16 and super().fits(dtype, state)

    def create(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = super().create(p)
        # y and z are exactly the parameter's value: their low words are zero.
        for key in (Y_LO, Z_LO):
            state[key] = torch.zeros_like(state[Z], dtype=torch.int8, memory_format=torch.preserve_format)
        return state

    def widens(self, dtype: torch.dtype) -> bool:
        return True

    def widen(self, ys: list[torch.Tensor], cols: Cols) -> Wide:
        zs, ms, vs, y_los, z_los = cols
        return (
            [join24(y, lo) for y, lo in zip(ys, y_los)],
            [join24(z, lo) for z, lo in zip(zs, z_los)],
            [m.float() for m in ms],
            [v.float() for v in vs],
        )

    def narrow_(self, wide: Wide, ys: list[torch.Tensor], cols: Cols) -> None:
        zs, ms, vs, y_los, z_los = cols
        for u, hi, lo in zip([*wide[0], *wide[1]], [*ys, *zs], [*y_los, *z_los]):
            split24_(u, hi, lo)
        torch._foreach_copy_([*ms, *vs], [*wide[2], *wide[3]])

    def switch_tensors(self, state: dict[str, Any]) -> list[torch.Tensor]:
        return [local_tensor(state[Y_LO]), local_tensor(state[Z_LO])]

    def exact(self, y: torch.Tensor, z: torch.Tensor, extra: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return join24(y, extra[0]), join24(z, extra[1])

    def store_y(self, y_wide: torch.Tensor, y: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
        hi = torch.empty_like(y)
        split24_(y_wide, hi, extra[0])
        return hi

    def saved_dtypes(self, state: dict[str, Any]) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16,)

    def wide_y(self, y: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        return join24(y, local_tensor(state[Y_LO]))

    def wide_state(self, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z, m, v, y_lo, z_lo = (local_tensor(state[key]) for key in self.keys)
        return join24(z, z_lo), m.float(), v.float()


PARAM: StateLayout = _Param()
FLOAT32: StateLayout = _Float32()
COMPACT: StateLayout = _Compact()
_BY_NAME = {layout.name: layout for layout in (PARAM, FLOAT32, COMPACT)}  # the values of ``state_dtype``


def layout_for(dtype: torch.dtype, state_dtype: str) -> StateLayout:
    """The layout of a new state of a parameter of ``dtype`` under the group's ``state_dtype``: fp32/fp64 parameters
    keep `PARAM` whatever it says, fp16 ones `FLOAT32` under "compact" (fp16's 5-bit exponent leaves no 8-bit low
    word covering its range)."""
    if dtype not in HALF_DTYPES:
        return PARAM
    if state_dtype == "compact" and dtype != torch.bfloat16:
        return FLOAT32
    return _BY_NAME[state_dtype]


def layout_of(state: dict[str, Any]) -> StateLayout:
    """The layout of an existing state, read from its keys."""
    if Y_LO in state:
        return COMPACT
    if Y_FP32 in state:
        return FLOAT32
    return PARAM


def widest(dtype: torch.dtype) -> StateLayout:
    """The layout every state converts into for a parameter of ``dtype``, if into any: `FLOAT32` for bf16/fp16
    parameters, `PARAM` for fp32/fp64 ones (its state dtype is then the parameter's own)."""
    return FLOAT32 if dtype in HALF_DTYPES else PARAM


def held_through_half(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Where ``param`` (cast from bf16 or fp16 to its dtype) holds ``value`` rounded to bf16 or to fp16: what a cast
    left of a half-precision parameter that held ``value`` rounded (bit patterns compared, a NaN equals itself)."""
    int_view = {torch.float64: torch.int64, torch.float32: torch.int32}.get(param.dtype, torch.int16)
    bits = param.view(int_view)
    held = torch.zeros_like(param, dtype=torch.bool)
    for half in HALF_DTYPES:
        held |= bits == value.to(half).to(param.dtype).view(int_view)
    return held


def refusal(
    state: dict[str, Any],
    dtype: torch.dtype,
    keys: tuple[str, ...] = (*_MOMENTS, Y_FP32),
    wide: torch.dtype | None = None,
) -> str | None:
    """Why ``state`` cannot become the state of a parameter of ``dtype`` exactly (a sentence to go after "the state
    of parameter ..."), or None where it fits or converts exactly: only a float64 state into narrower parameters.
    ``keys``: the state's tensors to check; ``wide``: the dtype they would become (`wide_dtype` of ``dtype``)."""
    wide = wide or wide_dtype(dtype)
    for key in keys:
        value = state.get(key)
        exact = torch.is_tensor(value) and (value.is_floating_point() or value.is_complex())
        if exact and torch.promote_types(value.dtype, wide) != wide:
            return (
                f"holds {value.dtype} values ({key!r}: the state of {value.dtype} parameters), but the parameter is "
                f"{dtype}, whose state is {wide} and cannot hold them exactly; use {value.dtype} parameters with it"
            )
    return None


def convert_(
    p: torch.Tensor, state: dict[str, Any], y: torch.Tensor, wide: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """Turn ``state`` (not fitting ``p``'s dtype; `refusal` said it converts) into `widest` of ``p``'s dtype, exactly:
    ``wide`` is z, m and v exactly (`StateLayout.wide_state`: 24-bit z and bf16 m and v widen to float32 losslessly),
    ``y`` y exactly in `wide_dtype` of ``p``'s dtype (a local tensor; which value the parameter's cast or a write left
    there is the caller's to decide), and ``p`` receives y in its own form."""
    local = local_tensor(p)
    for key in layout_of(state).keys:
        del state[key]
    for key, value in widest(p.dtype).from_wide(local, y, wide).items():
        state[key] = shard_like(value, p)
