"""The Triton kernels of GPA-AdamW's step and of the GPA wrapper's two passes (multi-tensor, one launch per bucket).

Imported only by ``triton_launch`` (the launcher), when the Triton path is taken: this module needs ``triton``. Each
program updates one block of one tensor: it finds the tensor in the block map, turns the tensor's int64 address from
the table into a typed pointer, and reads and writes each element once. Arithmetic is float32 (the state dtype);
divisions and square roots are correctly rounded, as in torch. ``triton_launch`` also loads a second copy of this
source with Triton's interpreter on, for CPU tensors (tests).
"""

import triton
import triton.language as tl

__all__ = ["gpa_adamw_compact_kernel", "gpa_adamw_kernel", "wrapper_pass_kernel"]


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    # float32 -> DTYPE, rounding to nearest even. bf16 by bit arithmetic: the interpreter's cast truncates.
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def block_of(block_tensor, block_start, numels, BLOCK: tl.constexpr):
    """The tensor, offsets and mask of this program's block (blocks start at multiples of BLOCK)."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    offs = tl.multiple_of(tl.load(block_start + pid), BLOCK) + tl.arange(0, BLOCK)
    return t, offs, offs < tl.load(numels + t)


@triton.jit
def pointer(table, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Tensor t's address from the table as a typed pointer; ALIGNED (checked by the host): 16-byte aligned, which
    lets full blocks use vector loads."""
    ptr = tl.load(table + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def load(ptr, offs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0.0)
    else:
        return tl.load(ptr + offs)


@triton.jit
def store(ptr, offs, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value, mask=mask)
    else:
        tl.store(ptr + offs, value)


@triton.jit
def adamw_pointers(y_ptrs, g_ptrs, z_ptrs, m_ptrs, v_ptrs, t, PARAM: tl.constexpr, GRAD: tl.constexpr,
                   STATE: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """Typed pointers to tensor t's y (PARAM), gradient (GRAD), z, m and v (STATE): every AdamW kernel's five."""
    return (
        pointer(y_ptrs, t, PARAM, ALIGNED),
        pointer(g_ptrs, t, GRAD, ALIGNED),
        pointer(z_ptrs, t, STATE, ALIGNED),
        pointer(m_ptrs, t, STATE, ALIGNED),
        pointer(v_ptrs, t, STATE, ALIGNED),
    )


@triton.jit
def load_grad(g_ptr, offs, mask, MASKED: tl.constexpr, MAXIMIZE: tl.constexpr):
    """The gradient in float32, negated when maximizing."""
    g = load(g_ptr, offs, mask, MASKED).to(tl.float32)
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def lr_scales(lr_ptr, step_scale, decay_scale, LR_ON_DEVICE: tl.constexpr):
    """(lr / bc1, lr * weight_decay): the host passes them whole, or without lr where lr is read on the device."""
    lr = 1.0
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr).to(tl.float32)
    return lr * step_scale, lr * decay_scale


@triton.jit
def adamw_gpa_update(g, m, v, z, y, step_size, decay, bc2_sqrt, beta1, beta2, eps, one_minus_mu_x, c):
    """The update in float32: (m', v', z' - z, y'), every kernel's (the C++ kernel's and the for-loop's formulas)."""
    # torch's lerp(m, g, w): m + w (g - m) if |w| < 0.5, else g - (1 - w) (g - m) (exact for w = 1, i.e. beta1 = 0)
    w = 1.0 - beta1
    w_small = (w < 0.5) & (w > -0.5)
    m = tl.where(w_small, m, g) + tl.where(w_small, w, w - 1.0) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    delta = -decay * z - step_size * tl.div_rn(m, denom)  # z' - z
    y = y + one_minus_mu_x * (z - y) + c * delta  # = mu_x mu_y x + (1 - mu_x mu_y) z'
    return m, v, delta, y


@triton.jit
def gpa_adamw_kernel(
    y_ptrs, g_ptrs, z_ptrs, m_ptrs, v_ptrs, y32_ptrs, numels, block_tensor, block_start,
    lr_ptr, step_scale, decay_scale, bc2_sqrt, beta1, beta2, eps, one_minus_mu_x, c,
    PARAM: tl.constexpr, GRAD: tl.constexpr, HAS_Y32: tl.constexpr, LR_ON_DEVICE: tl.constexpr,
    MAXIMIZE: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t, offs, mask = block_of(block_tensor, block_start, numels, BLOCK)
    y_ptr, g_ptr, z_ptr, m_ptr, v_ptr = adamw_pointers(
        y_ptrs, g_ptrs, z_ptrs, m_ptrs, v_ptrs, t, PARAM, GRAD, tl.float32, ALIGNED
    )
    step_size, decay = lr_scales(lr_ptr, step_scale, decay_scale, LR_ON_DEVICE)

    g = load_grad(g_ptr, offs, mask, MASKED, MAXIMIZE)
    m = load(m_ptr, offs, mask, MASKED)
    v = load(v_ptr, offs, mask, MASKED)
    z = load(z_ptr, offs, mask, MASKED)
    y_param = load(y_ptr, offs, mask, MASKED)
    y = y_param.to(tl.float32)
    if HAS_Y32:
        y32_ptr = pointer(y32_ptrs, t, tl.float32, ALIGNED)
        y32 = load(y32_ptr, offs, mask, MASKED)
        # The float32 copy is y unless something else wrote the parameter since the last step.
        y = tl.where(round_to(y32, PARAM).to(tl.float32) == y, y32, y)

    m, v, delta, y = adamw_gpa_update(g, m, v, z, y, step_size, decay, bc2_sqrt, beta1, beta2, eps, one_minus_mu_x, c)
    store(m_ptr, offs, m, mask, MASKED)
    store(v_ptr, offs, v, mask, MASKED)
    store(z_ptr, offs, z + delta, mask, MASKED)
    store(y_ptr, offs, round_to(y, PARAM), mask, MASKED)
    if HAS_Y32:
        store(y32_ptr, offs, y, mask, MASKED)


@triton.jit
def join24(hi, lo):
    """The float32 value of a bf16 high word and an int8 low word: (hi << 16) + (lo << 8), with lo ignored where
    hi = +-0 and lo < 0 or hi = +-inf (see optim/_state_layout)."""
    hi_bits = hi.to(tl.uint16, bitcast=True).to(tl.uint32)
    magnitude = hi_bits & 0x7FFF
    low = lo.to(tl.int32)
    low = tl.where(((magnitude == 0) & (low < 0)) | (magnitude == 0x7F80), 0, low)
    bits = (hi_bits << 16) + (low.to(tl.uint32, bitcast=True) << 8)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def split24(u):
    """float32 rounded to 24 bits (nearest even), as its bf16 high word (nearest, ties away) and int8 low word; a NaN
    as bf16's quiet NaN and 0."""
    bits = u.to(tl.uint32, bitcast=True)
    b24 = ((bits + 0x7F + ((bits >> 8) & 1)) >> 8) << 8
    nan = u != u
    hi = tl.where(nan, 0x7FC0, (b24 + 0x8000) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    lo = tl.where(nan, 0, (b24 >> 8) & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True)
    return hi, lo


@triton.jit
def gpa_adamw_compact_kernel(
    y_ptrs, g_ptrs, z_ptrs, m_ptrs, v_ptrs, y_lo_ptrs, z_lo_ptrs, numels, block_tensor, block_start,
    lr_ptr, step_scale, decay_scale, bc2_sqrt, beta1, beta2, eps, one_minus_mu_x, c,
    LR_ON_DEVICE: tl.constexpr, MAXIMIZE: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """gpa_adamw_kernel's update for state_dtype="compact": bf16 y, g, z, m, v; y and z joined with their int8 low
    words, computed in float32, rounded once to 24 bits and split; m and v rounded to bf16."""
    t, offs, mask = block_of(block_tensor, block_start, numels, BLOCK)
    y_ptr, g_ptr, z_ptr, m_ptr, v_ptr = adamw_pointers(
        y_ptrs, g_ptrs, z_ptrs, m_ptrs, v_ptrs, t, tl.bfloat16, tl.bfloat16, tl.bfloat16, ALIGNED
    )
    y_lo_ptr = pointer(y_lo_ptrs, t, tl.int8, ALIGNED)
    z_lo_ptr = pointer(z_lo_ptrs, t, tl.int8, ALIGNED)
    step_size, decay = lr_scales(lr_ptr, step_scale, decay_scale, LR_ON_DEVICE)

    g = load_grad(g_ptr, offs, mask, MASKED, MAXIMIZE)
    m = load(m_ptr, offs, mask, MASKED).to(tl.float32)
    v = load(v_ptr, offs, mask, MASKED).to(tl.float32)
    z = join24(load(z_ptr, offs, mask, MASKED), load(z_lo_ptr, offs, mask, MASKED))
    y = join24(load(y_ptr, offs, mask, MASKED), load(y_lo_ptr, offs, mask, MASKED))

    m, v, delta, y = adamw_gpa_update(g, m, v, z, y, step_size, decay, bc2_sqrt, beta1, beta2, eps, one_minus_mu_x, c)
    store(m_ptr, offs, round_to(m, tl.bfloat16), mask, MASKED)
    store(v_ptr, offs, round_to(v, tl.bfloat16), mask, MASKED)
    z_hi, z_lo = split24(z + delta)
    store(z_ptr, offs, z_hi, mask, MASKED)
    store(z_lo_ptr, offs, z_lo, mask, MASKED)
    y_hi, y_lo = split24(y)
    store(y_ptr, offs, y_hi, mask, MASKED)
    store(y_lo_ptr, offs, y_lo, mask, MASKED)


@triton.jit
def wrapper_pass_kernel(
    y_ptrs, z_ptrs, y32_ptrs, numels, block_tensor, block_start, alpha, scale,
    PARAM: tl.constexpr, HAS_Y32: tl.constexpr, BEFORE: tl.constexpr, MASKED: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t, offs, mask = block_of(block_tensor, block_start, numels, BLOCK)
    y_ptr = pointer(y_ptrs, t, PARAM, ALIGNED)
    z_ptr = pointer(z_ptrs, t, tl.float32, ALIGNED)
    z = load(z_ptr, offs, mask, MASKED)
    if HAS_Y32:
        y32_ptr = pointer(y32_ptrs, t, tl.float32, ALIGNED)
        y = load(y32_ptr, offs, mask, MASKED)
        if BEFORE:  # the float32 copy is y unless something else wrote the parameter since the last step
            y_param = load(y_ptr, offs, mask, MASKED)
            y = tl.where(round_to(y, PARAM).to(tl.float32) == y_param.to(tl.float32), y, y_param.to(tl.float32))
    else:
        y = load(y_ptr, offs, mask, MASKED).to(tl.float32)
    if BEFORE:
        y = scale * (y - alpha * z)
    else:
        y = y + alpha * z
    if HAS_Y32:
        store(y32_ptr, offs, y, mask, MASKED)
        if not BEFORE:  # before the base step only the float32 copy moves
            store(y_ptr, offs, round_to(y, PARAM), mask, MASKED)
    else:
        store(y_ptr, offs, round_to(y, PARAM), mask, MASKED)
