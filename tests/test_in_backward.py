"""The optimizer step inside backward (`hf_gpa.optim.in_backward`): the same numbers as stepping after backward,
bitwise, on every path; gradients freed as they are used; what cannot step per parameter refused."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from helpers import make_args, run_llama, train_losses
from torch import nn

from hf_gpa import GPA, DiLoCo, GPAAdamW
from hf_gpa.optim import kernels, step_in_backward
from hf_gpa.optim.kernels import cpu as _kernels
from hf_gpa.optim.kernels import triton_launch as _triton

IMPLS = ["forloop", "foreach", "cpu_kernel", "triton"]


class _Net(nn.Module):
    """Four parameter tensors of different shapes; ``skip`` leaves ``unused`` without a gradient."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(5, 7, generator=gen).to(dtype))
        self.b1 = nn.Parameter(torch.randn(5, generator=gen).to(dtype))
        self.w2 = nn.Parameter(torch.randn(3, 5, generator=gen).to(dtype))
        self.unused = nn.Parameter(torch.randn(4, generator=gen).to(dtype))

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        h = torch.tanh(x @ self.w1.T + self.b1) @ self.w2.T
        return h.square().mean() + (0.0 if skip else self.unused.sum())


def _impl_kwargs(impl: str) -> dict:
    return {"forloop": {"foreach": False}, "foreach": {"foreach": True}}.get(impl, {"fused": True})


def _run(
    impl: str,
    in_backward: bool,
    steps: int = 5,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    state_dtype: str = "float32",
) -> tuple[_Net, GPAAdamW]:
    """Train ``steps`` steps with a warm-up/decay schedule, three groups (one Schedule-Free, one maximizing), and a
    parameter that gets no gradient in every other step; ordinarily or inside backward."""
    net = _Net(dtype).to(device)
    groups = [
        {"params": [net.w1], "weight_decay": 0.1},
        {"params": [net.b1, net.unused], "averaging": "schedule_free", "mu_y": 0.5},
        {"params": [net.w2], "mu_x": 0.8, "maximize": True},
    ]
    opt = GPAAdamW(groups, lr=1e-2, mu_x=0.9, mu_y=0.7, state_dtype=state_dtype, **_impl_kwargs(impl))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 3) * 0.8**t)
    gen = torch.Generator().manual_seed(1)
    handle = step_in_backward(opt) if in_backward else None
    with mock.patch.dict(kernels.FORCE, backend="triton" if impl == "triton" else None):
        for t in range(steps):
            net(torch.randn(8, 7, generator=gen).to(device, dtype), skip=t % 2 == 1).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    if handle is not None:
        handle.remove()
    return net, opt


@pytest.mark.parametrize("impl", IMPLS)
def test_in_backward_is_bitwise_the_ordinary_step(impl: str) -> None:
    """y, z, m, v, the step counts, the Schedule-Free weight sums and x after eval() are bitwise those of stepping
    after backward, with an LR schedule and a parameter that is not stepped when it has no gradient."""
    if impl == "cpu_kernel" and _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    if impl == "triton" and not _triton.triton_available():
        pytest.skip("triton is not installed")
    ref_net, ref_opt = _run(impl, in_backward=False)
    net, opt = _run(impl, in_backward=True)
    for (name, r), p in zip(ref_net.named_parameters(), net.parameters()):
        assert torch.equal(p, r), name
        for key, value in ref_opt.state[r].items():
            assert torch.equal(opt.state[p][key], value), (name, key)
    assert float(opt.state[net.unused]["step"]) == 3.0  # stepped only in the steps where it had a gradient
    for g, r in zip(opt.param_groups, ref_opt.param_groups):
        assert g["weight_sum"] == r["weight_sum"] and g["lr"] == r["lr"]
    ref_opt.eval()
    opt.eval()
    for p, r in zip(net.parameters(), ref_net.parameters()):
        assert torch.equal(p, r)


def test_a_schedule_free_group_without_gradients_counts_its_steps_in_backward_too() -> None:
    """A Schedule-Free group whose only parameter gets no gradient in every other backward pass: its weight sum grows
    at every step inside backward, once (the optimizer.step() after backward adds nothing), as in the ordinary step;
    y and x bitwise."""

    def run(in_backward: bool) -> tuple[_Net, GPAAdamW]:
        net = _Net(torch.float32)
        groups = [
            {"params": [net.w1, net.b1, net.w2]},
            {"params": [net.unused], "averaging": "schedule_free"},
        ]
        opt = GPAAdamW(groups, lr=1e-2, mu_x=0.9, foreach=False)
        gen = torch.Generator().manual_seed(1)
        handle = step_in_backward(opt) if in_backward else None
        for t in range(6):
            net(torch.randn(8, 7, generator=gen), skip=t % 2 == 1).backward()
            opt.step()
            opt.zero_grad()
        if handle is not None:
            handle.remove()
        return net, opt

    (ref_net, ref_opt), (net, opt) = run(False), run(True)
    assert opt.param_groups[1]["weight_sum"] == ref_opt.param_groups[1]["weight_sum"] == pytest.approx(6e-4)
    ref_opt.eval()
    opt.eval()
    for p, r in zip(net.parameters(), ref_net.parameters()):
        assert torch.equal(p, r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run `python -m pytest -m gpu`")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_in_backward_is_bitwise_the_ordinary_step_on_cuda(dtype: torch.dtype) -> None:
    """On CUDA (the Triton kernel, the hooks on the engine's device thread): bitwise the ordinary step."""
    ref_net, ref_opt = _run("fused", in_backward=False, dtype=dtype, device="cuda")
    net, opt = _run("fused", in_backward=True, dtype=dtype, device="cuda")
    for p, r in zip(net.parameters(), ref_net.parameters()):
        assert torch.equal(p, r)
        for key, value in ref_opt.state[r].items():
            assert torch.equal(opt.state[p][key], value), key


def test_in_backward_bf16_keeps_the_float32_copy_of_y() -> None:
    """bf16 parameters (state in float32, y's float32 copy): bitwise the ordinary step, on the default path."""
    ref_net, ref_opt = _run("fused", in_backward=False, dtype=torch.bfloat16)
    net, opt = _run("fused", in_backward=True, dtype=torch.bfloat16)
    for p, r in zip(net.parameters(), ref_net.parameters()):
        assert torch.equal(p, r)
        assert set(opt.state[p]) == set(ref_opt.state[r]) and "y_fp32" in opt.state[p]
        for key, value in ref_opt.state[r].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("impl", ["forloop", "foreach", "cpu_kernel"])
def test_in_backward_bf16_compact_state(impl: str) -> None:
    """bf16 parameters with state_dtype="compact" (24-bit y and z): bitwise the ordinary step, low words included."""
    if impl == "cpu_kernel" and _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    ref_net, ref_opt = _run(impl, in_backward=False, dtype=torch.bfloat16, state_dtype="compact")
    net, opt = _run(impl, in_backward=True, dtype=torch.bfloat16, state_dtype="compact")
    for p, r in zip(net.parameters(), ref_net.parameters()):
        assert torch.equal(p, r)
        assert set(opt.state[p]) == set(ref_opt.state[r]) and "y_lo" in opt.state[p]
        for key, value in ref_opt.state[r].items():
            assert torch.equal(opt.state[p][key], value), key


def test_gradients_are_freed_as_they_are_used() -> None:
    """While backward runs, no parameter holds a gradient once it has been stepped: at most one exists at a time."""
    net = _Net(torch.float32)
    opt = GPAAdamW(net.parameters(), lr=1e-2)
    params = list(net.parameters())
    seen: list[int] = []

    def count(_: torch.Tensor) -> None:  # runs after hf_gpa's hook of the same parameter
        seen.append(sum(p.grad is not None for p in params))

    handle = step_in_backward(opt)
    for p in params:
        p.register_post_accumulate_grad_hook(count)
    net(torch.randn(8, 7), skip=False).backward()
    assert seen == [0] * len(params)
    assert all(p.grad is None for p in params)
    before = [p.detach().clone() for p in params]
    opt.step()  # nothing left to step
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    handle.remove()
    net(torch.randn(8, 7), skip=False).backward()
    assert all(p.grad is not None for p in params)  # hooks gone: gradients stay for an ordinary step


def test_resume_in_backward_matches_the_uninterrupted_run() -> None:
    """A state_dict saved in eval mode mid-run and loaded into a new optimizer, hooked again, continues bitwise."""
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 7, generator=gen) for _ in range(4)]
    ref = _Net(torch.float32)
    ref_opt = GPAAdamW(ref.parameters(), lr=1e-2, mu_x=0.9, mu_y=0.7)
    for x in data:
        ref(x, skip=False).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    net = _Net(torch.float32)
    opt = GPAAdamW(net.parameters(), lr=1e-2, mu_x=0.9, mu_y=0.7)
    with step_in_backward(opt):
        for x in data[:2]:
            net(x, skip=False).backward()
    opt.eval()  # saved as GPATrainer saves: parameters x, eval-mode state with the residual that restores y
    saved_weights = {k: v.clone() for k, v in net.state_dict().items()}
    saved_state = opt.state_dict()
    net2 = _Net(torch.float32)
    net2.load_state_dict(saved_weights)
    opt2 = GPAAdamW(net2.parameters(), lr=1e-2, mu_x=0.9, mu_y=0.7)
    opt2.load_state_dict(saved_state)
    opt2.train()
    with step_in_backward(opt2):
        for x in data[2:]:
            net2(x, skip=False).backward()
    for p, r in zip(net2.parameters(), ref.parameters()):
        assert torch.equal(p, r)


def test_eval_mode_refuses_to_step_in_backward() -> None:
    """A backward while the parameters hold x raises and names the call to make, before any parameter moves."""
    net = _Net(torch.float32)
    opt = GPAAdamW(net.parameters(), lr=1e-2)
    with step_in_backward(opt):
        net(torch.randn(8, 7), skip=False).backward()
        opt.eval()
        before = [p.detach().clone() for p in net.parameters()]
        with pytest.raises(RuntimeError, match=r"optimizer\.train\(\)"):
            net(torch.randn(8, 7), skip=False).backward()
        assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
        opt.train()
        net(torch.randn(8, 7), skip=False).backward()  # a new step starts normally after the refused one


def test_a_backward_that_raised_does_not_leak_into_the_next_step() -> None:
    """After a backward pass that raised half-way, the next backward is a new step: it takes the learning rate of
    that step (0 here: with mu_x = 0 and y = z, nothing moves), not the one the failed pass read."""
    net = _Net(torch.float32)
    opt = GPAAdamW(net.parameters(), lr=0.1, mu_x=0.0)
    hooks = step_in_backward(opt)
    net(torch.randn(8, 7), skip=False).backward()

    def fail(_: torch.Tensor) -> None:
        raise ValueError("a failing hook")

    failing = net.w2.register_post_accumulate_grad_hook(fail)  # w2's gradient is among the first: a pass cut short
    with pytest.raises(ValueError, match="a failing hook"):
        net(torch.randn(8, 7), skip=False).backward()
    failing.remove()
    for p in net.parameters():
        p.grad = None
    opt.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in net.parameters()]
    net(torch.randn(8, 7), skip=False).backward()
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    hooks.remove()


def test_grad_norm_is_the_global_norm_of_the_step() -> None:
    """track_grad_norm: the norm of all the step's gradients, as clip_grad_norm_ reports it."""
    net = _Net(torch.float32)
    x = torch.randn(8, 7)
    net(x, skip=False).backward()
    expected = nn.utils.clip_grad_norm_(net.parameters(), float("inf"))
    net.zero_grad()
    opt = GPAAdamW(net.parameters(), lr=1e-2)
    handle = step_in_backward(opt, track_grad_norm=True)
    net(x, skip=False).backward()
    torch.testing.assert_close(handle.grad_norm, expected, rtol=1e-6, atol=0)
    handle.remove()


@pytest.mark.parametrize(
    "make",
    [
        lambda params: GPA(params, base=torch.optim.AdamW, lr=1e-2),
        lambda params: DiLoCo(params, base=torch.optim.AdamW, lr=1e-2),
        lambda params: torch.optim.AdamW(params, lr=1e-2),
    ],
    ids=["GPA", "DiLoCo", "AdamW"],
)
def test_optimizers_without_a_per_parameter_step_are_refused(make) -> None:
    """GPA around a base optimizer (and anything else without a per-parameter step) raises, naming the class."""
    net = _Net(torch.float32)
    opt = make(net.parameters())
    with pytest.raises(TypeError, match=f"{type(opt).__name__} cannot step inside backward"):
        step_in_backward(opt)
    net(torch.randn(8, 7), skip=False).backward()
    assert all(p.grad is not None for p in net.parameters())  # no hook was left behind


# ---- GPATrainer and GPATrainingArguments: --gpa_step_in_backward ----


@pytest.mark.parametrize("precision", [{}, {"bf16": True}], ids=["fp32", "bf16_autocast"])
def test_trainer_in_backward_is_bitwise_the_ordinary_run(tmp_path, precision) -> None:
    """--gpa_step_in_backward: every step's y, every saved x, the losses and the final x equal the ordinary run
    (cosine schedule with warm-up, checkpoints; fp32 and bf16 autocast); the logged grad norm is the ordinary one;
    gradients are freed."""
    ref, ref_snap = run_llama(tmp_path / "ref", max_grad_norm=0.0, **precision)
    calls: list[int] = []
    step_params = GPAAdamW._step_params

    def counted(self, group, params, hyper):
        calls.append(len(params))
        step_params(self, group, params, hyper)

    with mock.patch.object(GPAAdamW, "_step_params", counted):
        ours, snap = run_llama(tmp_path / "in_backward", max_grad_norm=0.0, gpa_step_in_backward=True, **precision)
    n_params = len(list(ours.model.parameters()))
    assert calls == [1] * 6 * n_params  # every parameter stepped on its own, in backward
    assert snap.y.keys() == ref_snap.y.keys() == set(range(1, 7))
    for step in ref_snap.y:
        for name, value in ref_snap.y[step].items():
            assert torch.equal(snap.y[step][name], value), (step, name)
    for step in ref_snap.saved_x:
        for name, value in ref_snap.saved_x[step].items():
            assert torch.equal(snap.saved_x[step][name], value), (step, name)
    for (step, (loss, norm)), (ref_step, (ref_loss, ref_norm)) in zip(
        train_losses(ours).items(), train_losses(ref).items()
    ):
        assert step == ref_step and loss == ref_loss
        assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert all(p.grad is None for p in ours.model.parameters())
    assert ours._step_in_backward is None  # hooks removed when train() returns
    for p, r in zip(ours.model.parameters(), ref.model.parameters()):
        assert torch.equal(p, r)  # both at x


def test_trainer_resume_in_backward_matches_the_uninterrupted_run(tmp_path) -> None:
    """A run resumed with --gpa_step_in_backward from a checkpoint it wrote ends bitwise where the uninterrupted
    ordinary run ends."""
    ref, _ = run_llama(tmp_path / "ref", max_grad_norm=0.0)
    run_llama(tmp_path / "first", max_grad_norm=0.0, gpa_step_in_backward=True)
    checkpoint = str(tmp_path / "first" / "checkpoint-3")
    resumed, _ = run_llama(tmp_path / "resumed", resume=checkpoint, max_grad_norm=0.0, gpa_step_in_backward=True)
    for p, r in zip(resumed.model.parameters(), ref.model.parameters()):
        assert torch.equal(p, r)


@pytest.mark.parametrize(
    ("overrides", "env", "match"),
    [
        ({"max_grad_norm": 0.0, "gradient_accumulation_steps": 2}, {}, "--gradient_accumulation_steps 2"),
        ({}, {}, r"--max_grad_norm 1\.0 .*pass --max_grad_norm 0"),
        ({"max_grad_norm": 0.0, "fp16": True}, {}, "--fp16"),
        ({"max_grad_norm": 0.0}, {"WORLD_SIZE": "2"}, "2 processes"),
        ({"max_grad_norm": 0.0}, {"ACCELERATE_USE_FSDP": "true"}, "FSDP"),
        ({"max_grad_norm": 0.0, "fsdp": "full_shard"}, {}, "FSDP"),
        (
            {
                "max_grad_norm": 0.0,
                "gradient_checkpointing": True,
                "gradient_checkpointing_kwargs": '{"use_reentrant": true}',
            },
            {},
            "use_reentrant=True",
        ),
    ],
    ids=["accumulation", "clipping", "fp16", "ddp", "fsdp_env", "fsdp", "reentrant"],
)
def test_arguments_refuse_what_cannot_step_in_backward(tmp_path, overrides, env, match) -> None:
    """Each setting --gpa_step_in_backward cannot honour is refused at parse time, by name, with the reason."""
    with (
        mock.patch.dict("os.environ", env),
        pytest.raises(ValueError, match=f"--gpa_step_in_backward cannot run.*{match}"),
    ):
        make_args(tmp_path, gpa_step_in_backward=True, **overrides)


@pytest.mark.parametrize(
    "overrides", [{"optim": "gpa", "gpa_base_optim": "adamw_torch"}, {"optim": "adamw_torch"}], ids=["gpa", "stock"]
)
def test_arguments_refuse_step_in_backward_without_a_per_parameter_step(tmp_path, overrides) -> None:
    """Any --optim but gpa_adamw (GPA around a base optimizer steps all its tensors at once) is refused by name."""
    with pytest.raises(ValueError, match="--gpa_step_in_backward cannot run with --optim .*: only --optim gpa_adamw"):
        make_args(tmp_path, gpa_step_in_backward=True, max_grad_norm=0.0, **overrides)


def test_arguments_refuse_a_step_in_backward_that_is_not_a_bool(tmp_path) -> None:
    """A value that is not a bool (a string from Python code) is refused, naming the flag."""
    with pytest.raises(ValueError, match="Invalid --gpa_step_in_backward: 'false'"):
        make_args(tmp_path, gpa_step_in_backward="false", max_grad_norm=0.0)


def test_arguments_accept_step_in_backward(tmp_path) -> None:
    """--optim gpa_adamw with --max_grad_norm 0 on one process parses; the flag defaults to off."""
    assert make_args(tmp_path, gpa_step_in_backward=True, max_grad_norm=0.0).gpa_step_in_backward
    assert not make_args(tmp_path).gpa_step_in_backward


def test_a_group_added_later_steps_after_backward() -> None:
    """Parameters of a group added after the hooks keep their gradients; optimizer.step() steps them as usual."""
    net = _Net(torch.float32)
    opt = GPAAdamW([net.w1, net.b1, net.w2], lr=1e-2)
    with step_in_backward(opt):
        opt.add_param_group({"params": [net.unused]})
        before = net.unused.detach().clone()
        net(torch.randn(8, 7), skip=False).backward()
        assert net.w1.grad is None and net.unused.grad is not None
        opt.step()
    assert not torch.equal(net.unused, before) and float(opt.state[net.unused]["step"]) == 1.0


def _run_schedule_free_with_a_step_without_hooked_gradients(how: str, in_backward: bool) -> tuple[list, GPAAdamW]:
    """Six steps of a hooked Schedule-Free ``w`` (the third without a gradient for it: ``how`` says what that step does
    instead) and a ``later`` group added after the hooks; ordinarily or inside backward."""
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(5, generator=gen))
    unhooked = nn.Parameter(torch.randn(3, generator=gen))  # in no optimizer
    later = nn.Parameter(torch.randn(4, generator=gen))
    opt = GPAAdamW([w], lr=1e-2, mu_x=0.9, mu_y=0.7, averaging="schedule_free")
    handle = step_in_backward(opt) if in_backward else None
    opt.add_param_group({"params": [later], "averaging": "schedule_free"})  # not hooked: it steps in step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.8**t)
    for t in range(6):
        x = torch.randn(5, generator=gen)
        if t != 2:
            ((w * x).sum().square() + later.square().sum()).backward()
        elif how == "unhooked_backward":
            unhooked.square().sum().backward()
        elif how == "later_group_only":
            later.square().sum().backward()
        opt.step()
        opt.zero_grad()
        unhooked.grad = None
        sched.step()
    if handle is not None:
        handle.remove()
    return [w, later], opt


@pytest.mark.parametrize("how", ["no_backward", "unhooked_backward", "later_group_only"])
def test_a_step_without_hooked_gradients_counts_at_the_step_after_it(how: str) -> None:
    """A training step in which no hooked parameter gets a gradient (no backward at all, a backward through a
    parameter that is not hooked, or through a group added after the hooks only) counts in the hooked group's
    Schedule-Free weight sum at the optimizer.step() after it, as step() counts it: weight sums, y and x bitwise."""
    ref_params, ref_opt = _run_schedule_free_with_a_step_without_hooked_gradients(how, in_backward=False)
    params, opt = _run_schedule_free_with_a_step_without_hooked_gradients(how, in_backward=True)
    assert [g["weight_sum"] for g in opt.param_groups] == [g["weight_sum"] for g in ref_opt.param_groups]
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    ref_opt.eval()
    opt.eval()
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)


def test_a_step_after_the_hooks_are_removed_does_not_count_their_pass_again() -> None:
    """Hooks held for one backward pass only (``with step_in_backward(opt): loss.backward()``, then ``opt.step()``):
    the step() after the pass does not count the pass's step a second time; Schedule-Free weight sums, y and x bitwise
    those of the ordinary loop."""

    def run(in_backward: bool) -> tuple[_Net, GPAAdamW]:
        net = _Net(torch.float32)
        opt = GPAAdamW(net.parameters(), lr=1e-2, mu_x=0.9, mu_y=0.7, averaging="schedule_free")
        gen = torch.Generator().manual_seed(1)
        for t in range(4):
            with step_in_backward(opt) if in_backward else contextlib.nullcontext():
                net(torch.randn(8, 7, generator=gen), skip=t % 2 == 1).backward()
            opt.step()
            opt.zero_grad()
        return net, opt

    (ref_net, ref_opt), (net, opt) = run(False), run(True)
    assert opt.param_groups[0]["weight_sum"] == ref_opt.param_groups[0]["weight_sum"]
    for p, r in zip(net.parameters(), ref_net.parameters()):
        assert torch.equal(p, r)
    ref_opt.eval()
    opt.eval()
    for p, r in zip(net.parameters(), ref_net.parameters()):
        assert torch.equal(p, r)
