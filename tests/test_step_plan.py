"""GPAAdamW's step plan: host work per step that does not grow with the number of tensors (also with the Trainer's
two groups), a plan that never outlives what it was built on (loaded or replaced state, new groups, replaced
parameters, gradients of another dtype; a cleared state: tests/test_state_lifecycle.py), a per-tensor choice of the
state layout, and the two methods a step from a backward hook uses (``_begin_group_step``, ``_step_params``)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from tensors import random_params
from torch.profiler import ProfilerActivity, profile

from hf_gpa import GPAAdamW
from hf_gpa.optim import kernels
from hf_gpa.optim.kernels import cpu as _kernels
from hf_gpa.optim.kernels import triton_launch as _triton

# The paths whose host work must stay constant: the default (the C++ kernel on CPU) and the Triton path (run by
# Triton's interpreter on CPU tensors). torch's foreach ops loop over the tensors on CPU (their per-tensor fallback),
# so the foreach path's count grows there as torch's foreach AdamW's does.
PATHS = ["cpu_kernel", "triton"]
SHAPES = ((33, 17), (129,), (5, 3, 2))


@contextmanager
def _path(name: str) -> Iterator[None]:
    if name == "cpu_kernel" and _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    if name == "triton" and not _triton.triton_available():
        pytest.skip("triton is not installed")
    with mock.patch.dict(kernels.FORCE, backend="triton" if name == "triton" else None):
        yield


def _grads(params: list[torch.Tensor], t: int) -> None:
    for p in params:
        p.grad = torch.sin(3 * p.detach() + t) + 0.1


def _host_ops(n_tensors: int, state_dtype: str = "float32", two_groups: bool = False) -> int:
    """aten ops recorded by the profiler in one steady-state step over ``n_tensors`` small tensors (bf16 ones for
    ``state_dtype="compact"``), in one group or in the Trainer's two (weights with decay, biases without)."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if state_dtype == "compact" else torch.float32
    params = [torch.nn.Parameter(torch.randn(64, generator=gen).to(dtype)) for _ in range(n_tensors)]
    groups = [{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}] if two_groups else params
    opt = GPAAdamW(groups, lr=torch.tensor(1e-3), weight_decay=0.1, fused=True, state_dtype=state_dtype)
    for t in range(2):  # the plan is built at the first step; the second is a steady one already
        _grads(params, t)
        opt.step()
    _grads(params, 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


@pytest.mark.parametrize("state_dtype", ["float32", "compact"])
@pytest.mark.parametrize("path", PATHS)
def test_host_ops_per_step_do_not_grow_with_the_tensors(path: str, state_dtype: str) -> None:
    """A step over 200 tensors records at most 2x the host (aten) ops of a step over 20 (was 10x: ~5 per tensor),
    also for bf16 parameters with state_dtype="compact"."""
    with _path(path):
        few, many = _host_ops(20, state_dtype), _host_ops(200, state_dtype)
    assert many <= 2 * few, f"{path}: {few} aten ops per step for 20 tensors, {many} for 200"


@pytest.mark.parametrize("state_dtype", ["float32", "compact"])
@pytest.mark.parametrize("path", PATHS)
def test_two_groups_keep_their_plans(path: str, state_dtype: str) -> None:
    """With the Trainer's two groups (decay and no decay) a step over 200 tensors records at most 2x the aten ops of
    a step over 20: each group keeps its own plan (building one used to drop the other's: 178 ops for 20 tensors,
    1,618 for 200)."""
    with _path(path):
        few, many = _host_ops(20, state_dtype, two_groups=True), _host_ops(200, state_dtype, two_groups=True)
    assert many <= 2 * few, f"{path}: {few} aten ops per step for 20 tensors, {many} for 200"


def _train(params: list[torch.nn.Parameter], opt: GPAAdamW, start: int, stop: int) -> None:
    for t in range(start, stop):
        _grads(params, t)
        opt.step()


IMPLS = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "cpu_kernel": {"fused": True}}


def _impl(name: str) -> dict:
    if name == "cpu_kernel" and _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    return IMPLS[name]


def _impl_and_switch(name: str) -> tuple[dict, str | None]:
    """`_impl`, and "triton": the fused path with the kernels' test switch on the Triton kernel."""
    if name != "triton":
        return _impl(name), None
    if not _triton.triton_available():
        pytest.skip("triton is not installed")
    return {"fused": True}, "triton"


@pytest.mark.parametrize("impl", IMPLS)
def test_loading_state_drops_the_plan(impl: str) -> None:
    """After load_state_dict the step updates the loaded tensors (not those the plan was built on): a run that
    loads its own earlier state continues exactly as a fresh optimizer given that state."""
    kwargs = _impl(impl)
    params = random_params(SHAPES)
    opt = GPAAdamW(params, lr=1e-2, mu_x=0.9, **kwargs)
    _train(params, opt, 0, 2)
    saved, saved_params = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    _train(params, opt, 2, 4)  # the plan is built and in use
    with torch.no_grad():
        for p, s in zip(params, saved_params):
            p.copy_(s)
    opt.load_state_dict(copy.deepcopy(saved))
    _train(params, opt, 2, 4)
    twin = [torch.nn.Parameter(s.clone()) for s in saved_params]
    twin_opt = GPAAdamW(twin, lr=1e-2, mu_x=0.9, **kwargs)
    twin_opt.load_state_dict(copy.deepcopy(saved))
    _train(twin, twin_opt, 2, 4)
    for p, q in zip(params, twin):
        assert torch.equal(p, q)
        for key, value in twin_opt.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("impl", IMPLS)
def test_new_groups_and_replaced_parameters_get_a_new_plan(impl: str) -> None:
    """A group added after steps and a parameter replaced in its group (or given new storage) are stepped, with
    fresh state, exactly as by an optimizer that had them from the start."""
    kwargs = _impl(impl)
    params, extra = random_params(SHAPES, seed=0), random_params(SHAPES, seed=1)
    opt = GPAAdamW(params[:2], lr=1e-2, mu_x=0.9, **kwargs)
    _train(params[:2], opt, 0, 2)
    opt.add_param_group({"params": extra})
    new = torch.nn.Parameter(params[2].detach().clone())
    opt.param_groups[0]["params"][1] = new  # replaced: its old state stays behind, unused
    params[0].data = params[0].data.clone()  # new storage, same Parameter
    _train([params[0], new, *extra], opt, 2, 4)
    ref_new, ref_extra = torch.nn.Parameter(params[2].detach().clone()), random_params(SHAPES, seed=1)
    ref = GPAAdamW([{"params": [ref_new]}, {"params": ref_extra}], lr=1e-2, mu_x=0.9, **kwargs)
    _train([ref_new, *ref_extra], ref, 2, 4)
    for p, q in zip([new, *extra], [ref_new, *ref_extra]):
        assert torch.equal(p, q)
    ref0 = random_params(SHAPES, seed=0)[0]
    ref0_opt = GPAAdamW([ref0], lr=1e-2, mu_x=0.9, **kwargs)
    _train([ref0], ref0_opt, 0, 4)
    assert torch.equal(params[0], ref0)
    single = random_params(SHAPES, seed=2)[:1]
    opt.add_param_group({"params": single})
    _train(single, opt, 0, 1)  # a one-parameter plan, which binds no counters
    opt.param_groups[-1]["params"][0] = torch.nn.Parameter(single[0].detach().clone())
    _train(opt.param_groups[-1]["params"], opt, 1, 2)
    held = [q for plan in opt._plans.values() for q in plan.params]
    assert all(q is not params[1] and q is not single[0] for q in held)  # replaced ones are let go with their state


@pytest.mark.parametrize("impl", IMPLS)
def test_a_group_mixing_state_layouts_steps_each_as_alone(impl: str) -> None:
    """bf16 parameters of one group, one with state in the parameter's dtype, one with float32 state and y's
    float32 copy and one with 24-bit y and z ("compact"), step exactly as each would in a group of its own (the
    layout is decided per tensor)."""
    kwargs = _impl(impl)
    param_state, f32_state, compact_state = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float32)
    opt = GPAAdamW([param_state, f32_state, compact_state], lr=1e-2, mu_x=0.9, state_dtype="param", **kwargs)
    _train([param_state], opt, 0, 1)  # its state: z, m, v in bf16
    opt.param_groups[0]["state_dtype"] = "compact"
    _train([param_state, compact_state], opt, 1, 2)  # the third one's state: 24-bit y and z
    opt.param_groups[0]["state_dtype"] = "float32"
    _train([param_state, f32_state, compact_state], opt, 2, 5)  # the second one's state: float32, with y's copy
    assert opt.state[param_state]["z"].dtype == torch.bfloat16 and "y_fp32" not in opt.state[param_state]
    assert opt.state[f32_state]["y_fp32"].dtype == torch.float32
    assert opt.state[compact_state]["z_lo"].dtype == torch.int8 and "y_fp32" not in opt.state[compact_state]
    alone_param, alone_f32, alone_compact = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float32)
    opt_param = GPAAdamW([alone_param], lr=1e-2, mu_x=0.9, state_dtype="param", **kwargs)
    _train([alone_param], opt_param, 0, 5)
    opt_f32 = GPAAdamW([alone_f32], lr=1e-2, mu_x=0.9, state_dtype="float32", **kwargs)
    _train([alone_f32], opt_f32, 2, 5)
    opt_compact = GPAAdamW([alone_compact], lr=1e-2, mu_x=0.9, state_dtype="compact", **kwargs)
    _train([alone_compact], opt_compact, 1, 5)
    pairs = ((param_state, alone_param, opt_param), (f32_state, alone_f32, opt_f32))
    for mixed, alone, alone_opt in (*pairs, (compact_state, alone_compact, opt_compact)):
        assert torch.equal(mixed, alone)
        for key, value in alone_opt.state[alone].items():
            assert torch.equal(opt.state[mixed][key], value), key


@pytest.mark.parametrize("impl", [*IMPLS, "triton"])
def test_one_parameter_at_a_time_equals_the_step(impl: str) -> None:
    """_begin_group_step once per group, then _step_params one parameter at a time (as a backward hook does) gives
    bitwise what step() gives, for both averaging modes, without dropping the group's plan."""
    kwargs, force = _impl_and_switch(impl)

    def build(params: list[torch.nn.Parameter]) -> GPAAdamW:
        groups = [{"params": params[:2]}, {"params": params[2:], "averaging": "schedule_free"}]
        return GPAAdamW(groups, lr=1e-2, weight_decay=0.1, mu_x=0.9, **kwargs)

    with mock.patch.dict(kernels.FORCE, backend=force):
        params, hooked = random_params(SHAPES), random_params(SHAPES)
        opt, hooked_opt = build(params), build(hooked)
        _train(params, opt, 0, 4)
        _train(hooked, hooked_opt, 0, 1)  # the group's plan exists and must survive the one-parameter calls
        plans = dict(hooked_opt._plans)
        for t in range(1, 4):
            _grads(hooked, t)
            for group in hooked_opt.param_groups:
                hyper = hooked_opt._begin_group_step(group)
                for p in group["params"]:
                    hooked_opt._step_params(group, [p], hyper)
        assert all(hooked_opt._plans.get(k) is v for k, v in plans.items())
    for p, q in zip(params, hooked):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(hooked_opt.state[q][key], value), key
    assert opt.state_dict()["param_groups"] == hooked_opt.state_dict()["param_groups"]


@pytest.mark.parametrize("path", PATHS)
def test_wrapper_passes_follow_a_parameter_given_new_storage(path: str) -> None:
    """The GPA wrapper's passes cache their buckets; a parameter given storage of another layout (``p.data = ...``)
    is bucketed again (foreach: its z keeps the old layout) and the pass still computes y + c z."""
    from hf_gpa.optim._wrapper_passes import pass_after_base_

    gen = torch.Generator().manual_seed(0)
    y, z = torch.nn.Parameter(torch.randn(33, 65, generator=gen)), torch.randn(33, 65, generator=gen)
    with _path(path), torch.no_grad():
        expected = y.detach() + 0.5 * z
        pass_after_base_([y], [z], 0.5)  # a kernel takes it: the buckets are cached
        torch.testing.assert_close(y.detach(), expected, rtol=0, atol=1e-6)
        y.data = y.data.t().contiguous().t()  # same values and shape, transposed strides: z's layout no longer
        expected = y.detach() + 0.5 * z
        pass_after_base_([y], [z], 0.5)
        torch.testing.assert_close(y.detach(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_a_parameter_or_gradient_of_another_layout_is_planned_again(path: str) -> None:
    """A parameter given storage of another layout (``p.data = ...``) or a gradient assigned in another layout than
    its parameter's goes where its tensors' layouts allow, and the step equals the for-loop's."""

    def run(kwargs: dict) -> tuple[torch.nn.Parameter, GPAAdamW]:
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(33, 65, generator=gen))
        opt = GPAAdamW([p, torch.nn.Parameter(torch.randn(7, generator=gen))], lr=1e-2, mu_x=0.9, **kwargs)
        for t in range(4):
            if t == 2:
                p.data = p.data.t().contiguous().t()  # same values, transposed strides
            for q in opt.param_groups[0]["params"]:
                q.grad = torch.sin(3 * q.detach() + t)
            if t == 3:
                p.grad = p.grad.t().contiguous().t()
            opt.step()
        return p, opt

    with _path(path):
        p, opt = run({"fused": True})
    ref, ref_opt = run({"foreach": False})
    torch.testing.assert_close(p, ref, rtol=0, atol=1e-6)
    for key in ("z", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state[p][key], ref_opt.state[ref][key], rtol=0, atol=1e-6)


@pytest.mark.parametrize("state_dtype", ["float32", "compact"])
@pytest.mark.parametrize("impl", [*IMPLS, "triton"])
def test_a_gradient_of_another_dtype_is_planned_again(impl: str, state_dtype: str) -> None:
    """bf16 parameters whose gradients come in float32 from the third step on (``p.grad_dtype = None``, as with
    gradients accumulated in float32): every path steps them, as the for-loop does (the kernels raised)."""
    kwargs, force = _impl_and_switch(impl)

    def run(kwargs: dict, force: str | None) -> tuple[list[torch.nn.Parameter], GPAAdamW]:
        params = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float32)
        for p in params:
            p.grad_dtype = None  # any dtype may be assigned
        opt = GPAAdamW(params, lr=1e-2, mu_x=0.9, state_dtype=state_dtype, **kwargs)
        with mock.patch.dict(kernels.FORCE, backend=force):
            for t in range(5):
                for p in params:
                    g = torch.sin(3 * p.detach().float() + t) + 0.1
                    p.grad = g if t in (2, 3) else g.to(torch.bfloat16)
                opt.step()
        return params, opt

    params, opt = run(kwargs, force)
    ref, ref_opt = run({"foreach": False}, None)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=2**-7, atol=0)  # the kernels' float32 rounding: one bf16 unit
        torch.testing.assert_close(opt.state[p]["z"].float(), ref_opt.state[r]["z"].float(), rtol=2**-7, atol=0)
