"""What the test files share: fixtures and helpers live here, not in one test module imported by another."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fused_needs_the_cpu_kernel(request: pytest.FixtureRequest) -> None:
    """A test parametrized with ``impl="fused"`` on CPU is skipped where the C++ kernel cannot be built: there,
    ``fused=True`` raises, as torch's optimizers do where no fused kernel applies."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("impl") != "fused":
        return
    from hf_gpa.optim.kernels.cpu import load_cpu_kernel

    if load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here (fused=True raises without it)")
