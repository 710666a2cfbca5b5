"""torch.optim's contract, checked for every hf_gpa optimizer (in the spirit of torch's OptimizerInfo tests).

Each test runs every optimizer on small float64 parameters with a deterministic, state-dependent gradient, and holds
it to an independent oracle: the same run without the operation under test (a round trip, a copy, hooks), separate
optimizers per group, the run on real views for complex parameters, or torch's own optimizers.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable

import pytest
import torch
from tensors import random_params
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hf_gpa import GPA, DiLoCo, GPAAdamW, GPADiLoCo, ReferenceGPA

Factory = Callable[..., torch.optim.Optimizer]

OPTIMIZERS: dict[str, Factory] = {
    "gpa_adamw": lambda ps, **kw: GPAAdamW(ps, **{"lr": 1e-2, "weight_decay": 0.1, "mu_x": 0.9, **kw}),
    "gpa_adamw_foreach": lambda ps, **kw: GPAAdamW(ps, foreach=True, **{"lr": 1e-2, "mu_x": 0.9, **kw}),
    "gpa_adamw_forloop": lambda ps, **kw: GPAAdamW(ps, foreach=False, **{"lr": 1e-2, "mu_x": 0.9, **kw}),
    "gpa(adamw)": lambda ps, **kw: GPA(ps, **{"lr": 1e-2, "weight_decay": 0.1, "mu_x": 0.9, **kw}),
    "gpa(sgd)": lambda ps, **kw: GPA(ps, base=torch.optim.SGD, **{"lr": 1e-2, "momentum": 0.9, "mu_x": 0.9, **kw}),
    "diloco(adamw)": lambda ps, **kw: DiLoCo(ps, base=torch.optim.AdamW, **{"inner_steps": 2, "lr": 1e-2, **kw}),
    "gpa_diloco(adamw)": lambda ps, **kw: GPADiLoCo(
        ps, **{"inner_steps": 2, "lr": 1e-2, "mu_x": 0.8, "mu_y": 0.6, **kw}
    ),
    "reference": lambda ps, **kw: ReferenceGPA(ps, **{"lr": 1e-2, "weight_decay": 0.1, "mu_x": 0.9, **kw}),
}
NAMES = list(OPTIMIZERS)
SHAPES = ((4, 3), (5,), (2, 1, 3))


def _clone(params: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grad(p: torch.Tensor, t: int) -> torch.Tensor:
    y = torch.view_as_real(p.detach()) if p.is_complex() else p.detach()
    g = torch.sin(3 * y + t) + 0.3 * y
    return torch.view_as_complex(g) if p.is_complex() else g


def _steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], start: int, stop: int) -> None:
    for t in range(start, stop):
        for p in params:
            p.grad = _grad(p, t)
        opt.step()


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _state_equal(a: object, b: object) -> bool:
    """Deep equality of optimizer state (tensors with torch.equal), keys and values alike."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_through_weights_only_load(name: str) -> None:
    """state_dict() -> torch.save -> torch.load(weights_only=True) -> load_state_dict continues bitwise."""
    params = random_params(SHAPES, torch.float64)
    opt = OPTIMIZERS[name](params)
    _steps(opt, params, 0, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    twin_params = _clone(params)
    twin = OPTIMIZERS[name](twin_params)
    twin.load_state_dict(loaded)
    _steps(opt, params, 3, 6)
    _steps(twin, twin_params, 3, 6)
    assert _equal(params, twin_params)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name", NAMES)
def test_copies_step_like_the_original_on_their_own_tensors(name: str, how: str) -> None:
    """A deepcopy / pickle round trip steps exactly like the original, and only moves the copy's own tensors."""
    params = random_params(SHAPES, torch.float64)
    opt = OPTIMIZERS[name](params)
    _steps(opt, params, 0, 3)
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in params]
    _steps(twin, twin_params, 3, 6)
    assert _equal(params, before), "stepping the copy changed the original's parameters"
    _steps(opt, params, 3, 6)
    assert _equal(params, twin_params)


@pytest.mark.parametrize("name", NAMES)
def test_groups_added_later_step_like_separate_optimizers(name: str) -> None:
    """add_param_group after some steps: the new group moves, and each group equals an optimizer of its own."""
    params = random_params(SHAPES, torch.float64)
    first, later = params[:1], params[1:]
    opt = OPTIMIZERS[name](first)
    solo_first, solo_later = _clone(first), _clone(later)
    ref_first = OPTIMIZERS[name](solo_first)
    _steps(opt, first, 0, 3)
    _steps(ref_first, solo_first, 0, 3)
    opt.add_param_group({"params": later, "lr": 3e-2})
    ref_later = OPTIMIZERS[name](solo_later, lr=3e-2)
    start = [p.detach().clone() for p in later]
    _steps(opt, params, 3, 7)
    _steps(ref_first, solo_first, 3, 7)
    _steps(ref_later, solo_later, 3, 7)
    assert not any(torch.equal(p, s) for p, s in zip(later, start)), "the added group did not move"
    assert _equal(first, solo_first) and _equal(later, solo_later)


@pytest.mark.parametrize("name", NAMES)
def test_step_hooks_fire_once_per_step(name: str) -> None:
    """Global and per-instance step pre/post hooks each fire once per step(), with the optimizer stepped."""
    params = random_params(SHAPES, torch.float64)
    opt = OPTIMIZERS[name](params)
    calls: list[tuple[str, object]] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global_pre", o))),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global_post", o))),
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o))),
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o))),
    ]
    try:
        _steps(opt, params, 0, 3)
    finally:
        for handle in handles:
            handle.remove()
    assert sorted(kind for kind, _ in calls) == sorted(["global_pre", "global_post", "pre", "post"] * 3)
    assert all(o is opt for _, o in calls)


@pytest.mark.parametrize("name", NAMES)
def test_closure_loss_is_returned_and_its_gradient_used(name: str) -> None:
    """step(closure) returns the closure's loss at the current point and equals step() after the same backward."""
    target = random_params(SHAPES, torch.float64, seed=1)
    params, twin_params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
    opt, twin = OPTIMIZERS[name](params), OPTIMIZERS[name](twin_params)

    def loss_at(ps: list[torch.Tensor]) -> torch.Tensor:
        return sum(((p - q) ** 2).sum() for p, q in zip(ps, target))

    for _ in range(3):

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_at(params)
            loss.backward()
            return loss

        expected = loss_at(twin_params).detach()
        loss = opt.step(closure)
        twin.zero_grad()
        loss_at(twin_params).backward()
        twin.step()
        assert torch.equal(loss.detach(), expected)
    assert _equal(params, twin_params)


@pytest.mark.parametrize("scheduler", ["lambda", "cosine"])
@pytest.mark.parametrize("name", NAMES)
def test_lr_schedulers_drive_the_update(name: str, scheduler: str) -> None:
    """LambdaLR / CosineAnnealingLR set each step's lr: the run equals one with the same lrs written by hand."""
    params, manual_params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
    opt, manual = OPTIMIZERS[name](params), OPTIMIZERS[name](manual_params)
    if scheduler == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    else:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    lrs = []
    for t in range(5):
        lrs.append(opt.param_groups[0]["lr"])
        _steps(opt, params, t, t + 1)
        sched.step()
    for t, lr in enumerate(lrs):
        for group in manual.param_groups:
            group["lr"] = lr
        _steps(manual, manual_params, t, t + 1)
    assert len(set(lrs)) == len(lrs), "the schedule must change the lr"
    assert _equal(params, manual_params)


@pytest.mark.parametrize("name", NAMES)
def test_tensor_lr_equals_float_lr(name: str) -> None:
    """lr=torch.tensor(1e-2) gives the float lr's trajectory (float64, 1e-12)."""
    params, tensor_params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
    opt = OPTIMIZERS[name](params, lr=1e-2)
    tensor_opt = OPTIMIZERS[name](tensor_params, lr=torch.tensor(1e-2, dtype=torch.float64))
    _steps(opt, params, 0, 4)
    _steps(tensor_opt, tensor_params, 0, 4)
    for p, q in zip(params, tensor_params):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_zero_size_parameters(name: str) -> None:
    """Zero-size parameters beside normal ones: steps, eval/train and a state_dict round trip work."""
    params = random_params(((0,), (3, 0), (4, 3)), torch.float64)
    opt = OPTIMIZERS[name](params)
    _steps(opt, params, 0, 3)
    if hasattr(opt, "eval"):
        opt.eval()
        opt.train()
    twin_params = _clone(params)
    twin = OPTIMIZERS[name](twin_params)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    _steps(opt, params, 3, 5)
    _steps(twin, twin_params, 3, 5)
    assert [p.shape for p in params] == [(0,), (3, 0), (4, 3)] and _equal(params, twin_params)


@pytest.mark.parametrize("name", NAMES)
def test_params_without_grads_are_untouched_and_stateless(name: str) -> None:
    """A parameter that never has a gradient is never changed (eval() included) and gets no state; the others
    step as they would alone."""
    params = random_params(SHAPES, torch.float64)
    frozen = params[1].detach().clone()
    solo = _clone([params[0], params[2]])
    opt, ref = OPTIMIZERS[name](params), OPTIMIZERS[name](solo)
    for t in range(4):
        for i, p in enumerate(params):
            p.grad = None if i == 1 else _grad(p, t)
        opt.step()
        _steps(ref, solo, t, t + 1)
    assert torch.equal(params[1], frozen) and not opt.state.get(params[1])
    assert _equal([params[0], params[2]], solo)
    if hasattr(opt, "eval"):
        opt.eval()
        assert torch.equal(params[1], frozen)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "gpa(sgd)"])  # SGD takes sparse gradients
def test_a_step_that_raises_changes_nothing(name: str) -> None:
    """A step rejected for a sparse gradient leaves parameters and state as they were (exactly; GPA's fp64 y, which
    its first pass scales in place, within a rounding); training goes on as if it had never been tried."""
    params, twin_params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
    opt, twin = OPTIMIZERS[name](params), OPTIMIZERS[name](twin_params)
    _steps(opt, params, 0, 2)
    _steps(twin, twin_params, 0, 2)
    before_params = [p.detach().clone() for p in params]
    before_state = copy.deepcopy(opt.state_dict())
    for p in params:
        p.grad = _grad(p, 2)
    params[-1].grad = params[-1].grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert _state_equal(opt.state_dict(), before_state)
    inexact = name.startswith("gpa(")  # y came back as y / mu_x + (1 - mu_y) z: within a rounding, not bitwise
    for p, before in zip(params, before_params):
        if inexact:
            torch.testing.assert_close(p, before, rtol=0, atol=4 * torch.finfo(p.dtype).eps)
        else:
            assert torch.equal(p, before)
    _steps(opt, params, 2, 4)
    _steps(twin, twin_params, 2, 4)
    for p, q in zip(params, twin_params):
        torch.testing.assert_close(p, q, rtol=1e-12 if inexact else 0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_complex_parameters_behave_as_their_real_views(name: str) -> None:
    """Complex parameters follow torch's optimizers (view_as_real): the run equals the one on the real views."""
    complex_params = [
        torch.nn.Parameter(torch.view_as_complex(p.detach())) for p in random_params(((4, 2), (3, 2)), torch.float64)
    ]
    real_params = [torch.nn.Parameter(torch.view_as_real(p.detach()).clone()) for p in complex_params]
    opt, ref = OPTIMIZERS[name](complex_params), OPTIMIZERS[name](real_params)
    _steps(opt, complex_params, 0, 4)
    _steps(ref, real_params, 0, 4)
    for p, r in zip(complex_params, real_params):
        torch.testing.assert_close(torch.view_as_real(p.detach()), r.detach(), rtol=0, atol=1e-12)
    if hasattr(opt, "eval"):
        opt.eval()
        ref.eval()
        for p, r in zip(complex_params, real_params):
            torch.testing.assert_close(torch.view_as_real(p.detach()), r.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_bad_learning_rates_raise_value_errors(name: str) -> None:
    """A negative lr raises ValueError at construction, and in a group added later (which is then not added)."""
    with pytest.raises(ValueError, match="learning rate"):
        OPTIMIZERS[name](random_params(SHAPES, torch.float64), lr=-1e-3)
    params = random_params(SHAPES, torch.float64)
    opt = OPTIMIZERS[name](params[:1])
    with pytest.raises(ValueError, match="learning rate"):
        opt.add_param_group({"params": params[1:], "lr": -1.0})
    assert len(opt.param_groups) == 1
