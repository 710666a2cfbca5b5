"""The fused kernels' arithmetic where a naive formula loses precision: AdamW's first moment with small beta1.

m <- m + (1 - beta1)(g - m) loses g when beta1 = 0 and |g| << |m| (Schedule-Free averaging runs with beta1 = 0);
torch's lerp (m + w (g - m) for |w| < 0.5, else g - (1 - w)(g - m)) gives g exactly. Every path must do the same.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from hf_gpa import GPAAdamW
from hf_gpa.optim import kernels
from hf_gpa.optim.kernels import cpu as _kernels
from hf_gpa.optim.kernels import triton_launch as _triton

IMPLS = {
    "forloop": {"foreach": False},
    "foreach": {"foreach": True},
    "cpu_kernel": {"fused": True},
    "triton": {"fused": True},
}


def _skip_unavailable(impl: str) -> None:
    if impl == "cpu_kernel" and _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    if impl == "triton" and not _triton.triton_available():
        pytest.skip("triton is not installed")


def _moment_after(impl: str, dtype: torch.dtype, betas: tuple[float, float], grads: list[float]) -> torch.Tensor:
    p = torch.nn.Parameter(torch.ones(4099, dtype=dtype))  # more than one Triton block
    opt = GPAAdamW([p], lr=1e-3, betas=betas, **IMPLS[impl])
    # "triton" sends CPU tensors through Triton's interpreter; fused=True raises if the kernel does not take p.
    with mock.patch.dict(kernels.FORCE, backend="triton" if impl == "triton" else None):
        if impl in ("cpu_kernel", "triton"):  # the kernel itself runs, not the foreach fallback
            assert kernels.kernel_for(p) == ("cpu" if impl == "cpu_kernel" else "triton")
        for g in grads:
            p.grad = torch.full_like(p, g)
            opt.step()
    return opt.state[p]["exp_avg"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_beta1_zero_keeps_a_small_gradient_exactly(impl: str, dtype: torch.dtype) -> None:
    """betas (0, 0), gradients 0.3 then 1e-5: m is the last gradient bitwise (the old kernels gave 1.0014e-5)."""
    _skip_unavailable(impl)
    m = _moment_after(impl, dtype, (0.0, 0.0), [0.3, 1e-5])
    expected = torch.tensor(1e-5, dtype=dtype).to(m.dtype)
    assert torch.equal(m, torch.full_like(m, expected.item())), m[0].item()


@pytest.mark.parametrize("beta1", [0.0, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_first_moment_matches_torch_lerp(impl: str, beta1: float) -> None:
    """m after mixed-scale gradients equals torch.lerp's within one float32 rounding, on both sides of w = 0.5."""
    _skip_unavailable(impl)
    grads = [0.3, -2e-6, 1e-5, 7.0, 3e-7]
    m = _moment_after(impl, torch.float32, (beta1, 0.999), grads)
    ref = torch.zeros((), dtype=torch.float32)
    for g in grads:
        ref = torch.lerp(ref, torch.tensor(g, dtype=torch.float32), 1.0 - beta1)
    torch.testing.assert_close(m, torch.full_like(m, ref.item()), rtol=2**-23, atol=0)


def test_kernels_round_to_bf16_as_torch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ kernel's float32 -> bf16 rounding (branch-free, so that its loops vectorize) equals torch's bit for bit:
    ties to even, infinities, signed zeros, subnormals, overflow; NaN of any payload stays NaN (written by the
    wrapper's after pass with alpha = 0: y <- bf16(y32))."""
    if _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    from hf_gpa.optim._wrapper_passes import pass_after_base_

    special = torch.tensor(
        [0x7F800001, 0xFF800001, 0x7FC00000, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x807FFFFF,
         0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0xFF7F8000, 0x007F8000],
        dtype=torch.int64,
    ).to(torch.int32)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    bits = torch.cat([special, torch.randint(-(2**31), 2**31 - 1, (100_000,), generator=gen, dtype=torch.int32)])
    y32 = bits.view(torch.float32)
    y = torch.zeros(y32.shape, dtype=torch.bfloat16)
    pass_after_base_([y], [torch.full_like(y32, -0.0)], 0.0, [y32.clone()])  # y32 + 0 * (-0) is y32, -0 included
    expected = y32.to(torch.bfloat16)
    nan = y32.isnan()  # NaN stays NaN (torch's own scalar and vector conversions write different NaN bits)
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int16), expected[~nan].view(torch.int16))
