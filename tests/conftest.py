"""What the test files share: fixtures and helpers live here, not in one test module imported by another."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Every test ends with the environment it began with: accelerate writes RANK, LOCAL_RANK, WORLD_SIZE and
    MASTER_PORT into ``os.environ`` as it sets up a (simulated) launch, which ``monkeypatch`` does not undo, and a
    later test would then take itself for one process of a launch."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


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


def _peak_allocated(fn: Callable[[], object]) -> int:
    """The peak of CPU memory torch allocates while ``fn`` runs, above what was allocated before (torch's profiler:
    its allocation and free events, in order)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    level = peak = 0
    for event in sorted((e for e in events if e.device_type().name == "CPU"), key=lambda e: e.start_ns()):
        level += event.nbytes()
        peak = max(peak, level)
    return peak


@pytest.fixture
def peak_allocated() -> Callable[[Callable[[], object]], int]:
    """``peak_allocated(fn)``: the peak of CPU bytes torch allocates while ``fn()`` runs, above the level before."""
    return _peak_allocated
