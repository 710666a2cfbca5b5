"""The one rule that picks GPA-AdamW's implementation (torch's ``fused``/``foreach`` semantics) and the one kernel
switch that GPAAdamW's step and the GPA wrapper's passes share."""

from __future__ import annotations

import pytest
import torch
from tensors import random_params

import hf_gpa.optim.gpa_adamw as gpa_adamw_module
from hf_gpa import GPAAdamW
from hf_gpa.optim import kernels
from hf_gpa.optim.kernels import cpu as _kernels

SHAPES = ((33, 17), (129,), (5, 3, 2))


def _run(params: list[torch.nn.Parameter], steps: int = 5, **kwargs) -> GPAAdamW:
    opt = GPAAdamW(params, lr=1e-2, weight_decay=0.1, mu_x=0.9, **kwargs)
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.sin(3 * p.detach() + t) + 0.1 * i
        opt.step()
    return opt


@pytest.mark.parametrize(
    ("foreach", "fused", "expected"),
    [
        (None, None, "_fused_gpa_adamw"),
        (None, True, "_fused_gpa_adamw"),
        (None, False, "_multi_tensor_gpa_adamw"),  # fused=False never fuses; foreach is the default then
        (True, None, "_multi_tensor_gpa_adamw"),
        (True, False, "_multi_tensor_gpa_adamw"),
        (False, None, "_single_tensor_gpa_adamw"),
        (False, False, "_single_tensor_gpa_adamw"),
    ],
)
def test_fused_and_foreach_pick_the_implementation_as_in_torch(
    foreach: bool | None, fused: bool | None, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpa_adamw(...) calls exactly the implementation torch's rule names, and fused=False gives foreach's result."""
    if _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    called = []
    for name in ("_fused_gpa_adamw", "_multi_tensor_gpa_adamw", "_single_tensor_gpa_adamw"):
        impl = getattr(gpa_adamw_module, name)
        monkeypatch.setattr(gpa_adamw_module, name, lambda *a, _n=name, _f=impl, **k: (called.append(_n), _f(*a, **k)))
    params = random_params(SHAPES)
    _run(params, foreach=foreach, fused=fused)
    assert set(called) == {expected}
    if fused is False and foreach is None:
        monkeypatch.undo()
        reference = random_params(SHAPES)
        _run(reference, foreach=True)
        assert all(torch.equal(p, r) for p, r in zip(params, reference))


def test_fused_false_never_runs_the_kernel() -> None:
    """GPAAdamW(fused=False) is the foreach path bitwise, not the fused kernel (whose rounding differs)."""
    if _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    unfused, foreach, fused = random_params(SHAPES), random_params(SHAPES), random_params(SHAPES)
    _run(unfused, fused=False)
    _run(foreach, foreach=True)
    _run(fused, fused=True)
    assert all(torch.equal(p, q) for p, q in zip(unfused, foreach))
    assert not all(torch.equal(p, q) for p, q in zip(unfused, fused))  # the two paths are told apart


def test_fused_true_without_a_kernel_raises_like_torch() -> None:
    """fused=True where no kernel takes the tensors raises torch's RuntimeError at the step; None falls back."""
    p = torch.nn.Parameter(torch.zeros(4, device="meta"))
    p.grad = torch.zeros(4, device="meta")
    with pytest.raises(RuntimeError, match="`fused=True` requires"):
        GPAAdamW([p], fused=True).step()
    GPAAdamW([p]).step()  # fused=None: foreach on what no kernel takes
    with pytest.raises(RuntimeError, match="`fused=True` requires"):
        torch.optim.AdamW([p], fused=True).step()  # the behaviour followed


def test_one_switch_sends_both_the_step_and_the_passes_to_foreach(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.FORCE["backend"] = "foreach" sends GPAAdamW's default step and the wrapper's passes to foreach."""
    monkeypatch.setitem(kernels.FORCE, "backend", "foreach")
    params = random_params(SHAPES)
    opt = _run(params)
    assert {plan.impl for plan in opt._plans.values()} == {"foreach"}
    assert kernels.kernel_for(params[0]) is None
    reference = random_params(SHAPES)
    _run(reference, foreach=True)
    assert all(torch.equal(p, r) for p, r in zip(params, reference))


def test_layout_rule() -> None:
    """Dense tensors of one layout go to a kernel; an overlapping or strided view, or a companion of another layout,
    does not."""
    base = torch.zeros(4, 6)
    assert kernels.same_dense_layout(base, [torch.zeros(4, 6), None])
    assert kernels.same_dense_layout(base.t(), [torch.zeros(4, 6).t()])  # a dense permutation
    assert not kernels.same_dense_layout(base.t(), [torch.zeros(6, 4)])  # another layout
    assert not kernels.same_dense_layout(base[:, ::2], [])  # strided: not dense
    assert not kernels.same_dense_layout(torch.zeros(1, 6).expand(4, 6), [])  # overlapping
