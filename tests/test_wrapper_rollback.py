"""The GPA wrapper's rollback when its base raises: y comes back by the first pass's inverse, within a stated bound.

The first pass y <- mu_x (y - (1 - mu_y) z) is done in place before the base steps (a copy of y per step would cost
2.2x the wrapper's step); it is not invertible bitwise (it is a contraction, and it loses y's low bits where
|(1 - mu_y) z| >> |y|). The inverse y / mu_x + (1 - mu_y) z gives y back within 4 u (|y| + (1 - mu_y) |z|), u the
unit roundoff of y's dtype (2^-24 for float32): five roundings, each relative to a term of that size. In units of
y's own last place there is no bound where y is near 0 (45 ulps were seen at mu_x = 0.9, mu_y = 0.3).
"""

from __future__ import annotations

import pytest
import torch

from hf_gpa import GPA
from hf_gpa.optim import _wrapper_passes as _passes
from hf_gpa.optim import kernels
from hf_gpa.optim.gpa import _unscale_

BOUND = 4.0  # in units of u (|y| + (1 - mu_y) |z|); measured at most 2.99 over the sweep below


def _excess(restored: torch.Tensor, y: torch.Tensor, z: torch.Tensor, mu_y: float) -> float:
    """max |restored - y| / (u (|y| + (1 - mu_y) |z|))."""
    u = torch.finfo(y.dtype).eps / 2
    scale = u * (y.double().abs() + (1.0 - mu_y) * z.double().abs())
    return ((restored.double() - y.double()).abs() / scale).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("path", ["kernel", "foreach"])
def test_first_pass_and_its_inverse_stay_within_the_bound(path: str, dtype: torch.dtype, monkeypatch) -> None:
    """The passes (C++ kernel or foreach) and the inverse, over mu_x, mu_y and the scale of y against z."""
    monkeypatch.setitem(kernels.FORCE, "backend", "foreach" if path == "foreach" else None)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for mu_x in (1e-4, 0.3, 0.9, 0.9967, 0.99999):
        for mu_y in (0.01, 0.3, 0.7, 1.0):
            for scale in (1e-6, 1e-2, 1.0, 1e2):
                y = (torch.randn(20000, generator=gen, dtype=torch.float64) * scale).to(dtype)
                z = torch.randn(20000, generator=gen, dtype=torch.float64).to(dtype)
                restored = y.clone()
                _passes.pass_before_base_([restored], [z], 1.0 - mu_y, mu_x)
                _unscale_([restored], [z], [None], 1.0 - mu_y, mu_x)
                worst = max(worst, _excess(restored, y, z, mu_y))
    assert worst <= BOUND, worst


def test_a_failed_step_gives_y_back_within_the_bound(failing_adamw: type[torch.optim.AdamW]) -> None:
    """GPA(AdamW), fp32, mu_x = 0.9, mu_y = 0.3 (where 45 ulps of y were seen): y within the bound, z exact."""
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((257, 33), (1000,))]
    opt = GPA(params, base=failing_adamw, lr=1e-2, mu_x=0.9, mu_y=0.3)
    for t in range(6):
        for p in params:
            p.grad = torch.sin(3 * p.detach() + t)
        opt.step()
    with torch.no_grad():
        params[1][:10] = 1e-7  # y near 0 against z: many ulps of y, still within the bound
    y = [p.detach().clone() for p in params]
    z = [opt.state[p]["z"].clone() for p in params]
    with failing_adamw.failing(), pytest.raises(torch.OutOfMemoryError):
        opt.step()
    for p, y0, z0 in zip(params, y, z):
        assert torch.equal(opt.state[p]["z"], z0)
        assert _excess(p.detach(), y0, z0, 0.3) <= BOUND
