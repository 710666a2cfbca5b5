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
