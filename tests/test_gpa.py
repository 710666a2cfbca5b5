"""GPAAdamW and GPA(base=...) against independent oracles: the paper's three-sequence form, torch's own optimizers,
Proposition 1 (Nesterov), plus argument checks, per-group settings, dtypes and convergence."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import pytest
import torch
from tensors import random_params

from benchmarks.workloads import least_squares_x
from hf_gpa import GPA, DiLoCo, GPAAdamW, ReferenceGPA
from hf_gpa.optim.kernels import cpu as _kernels

IMPLS = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
SHAPES = ((7, 5), (5,), (3, 4, 2), (11,))
COMPLEX_SHAPES = ((5, 3), (7,))


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """Three groups with their own lr, weight decay, mu_x and mu_y (the Trainer's decay/no-decay split and more)."""
    return [
        {"params": params[:2]},
        {"params": params[2:3], "weight_decay": 0.0, "mu_x": 0.8, "mu_y": 0.9},
        {"params": params[3:], "lr": 3e-2, "mu_y": 1.0},
    ]


def _fake_grads(params: list[torch.Tensor], t: int) -> None:
    """A deterministic, state-dependent gradient (so an error in y shows up in the next gradient)."""
    for i, p in enumerate(params):
        y = p.detach().double()
        p.grad = (torch.sin(3 * y + t) + 0.3 * y - 0.1 * i).to(p.dtype)


def _steps(
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    steps: int,
    grads: Callable[[list[torch.Tensor], int], None] = _fake_grads,
) -> None:
    """``steps`` steps at the optimizer's own lr, on the deterministic gradients ``grads(params, t)``, t = 0, 1, ...
    (two optimizers run one after the other see the same gradients as run in lockstep)."""
    for t in range(steps):
        grads(params, t)
        opt.step()


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, lr0: float = 1e-2) -> None:
    for t in range(steps):
        _fake_grads(params, t)
        for k, group in enumerate(opt.param_groups):
            group["lr"] = lr0 * (1 + k) * (0.5 + 0.5 * math.cos(math.pi * t / steps))  # a changing schedule
        opt.step()


def _assert_follows_reference(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], ref: ReferenceGPA, ref_params: list[torch.Tensor]
) -> None:
    """Both run 60 steps under a changing lr (`_run`): opt's y equals the reference's y, and after opt.eval() its x
    the reference's x (float64, 1e-12)."""
    _run(ref, ref_params, 60)
    _run(opt, params, 60)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-12)
    opt.eval()
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), ref.x(r), rtol=0, atol=1e-12)


@pytest.mark.parametrize("averaging", ["gpa", "schedule_free"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_gpa_adamw_matches_three_sequence_reference(impl: str, averaging: str) -> None:
    """Every GPAAdamW path equals Algorithm 1 (explicit x, y, z) in float64 over many steps, at y and at x."""
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, mu_x=0.95, mu_y=0.7, averaging=averaging)
    ref_params, params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
    ref = ReferenceGPA(_groups(ref_params), base="adamw", **kwargs)
    opt = GPAAdamW(_groups(params), **kwargs, **IMPLS[impl])
    _assert_follows_reference(opt, params, ref, ref_params)


@pytest.mark.parametrize("averaging", ["gpa", "schedule_free"])
@pytest.mark.parametrize(
    ("base", "ref_base", "base_kwargs"),
    [
        (torch.optim.AdamW, "adamw", {"betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}),
        (torch.optim.SGD, "sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
        (torch.optim.SGD, "sgd", {"momentum": 0.0, "weight_decay": 0.0}),
    ],
)
def test_wrapper_matches_three_sequence_reference(base, ref_base: str, base_kwargs: dict, averaging: str) -> None:
    """GPA(base=AdamW/SGD) equals Algorithm 1 in float64; the base's own weight decay acts on z."""
    mu = dict(mu_x=0.95, mu_y=0.7, averaging=averaging)
    ref_params, params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
    ref = ReferenceGPA(_groups(ref_params), base=ref_base, lr=1e-2, **mu, **base_kwargs)
    opt = GPA(_groups(params), base=base, lr=1e-2, **mu, **base_kwargs)
    _assert_follows_reference(opt, params, ref, ref_params)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_mu_x_zero_is_adamw(impl: str) -> None:
    """mu_x = 0 makes x = y = z: GPAAdamW's y equals torch.optim.AdamW's iterate (float64, 1e-12)."""
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ref_params, params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
    ref = torch.optim.AdamW(ref_params, **kwargs, foreach=False)
    opt = GPAAdamW(params, **kwargs, mu_x=0.0, mu_y=0.7, **IMPLS[impl])
    _run(ref, ref_params, 40)
    _run(opt, params, 40)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("base", "base_kwargs"),
    [
        (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-2}),
        (torch.optim.Adam, {"lr": 1e-2}),
        (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        (torch.optim.Adagrad, {"lr": 1e-2}),
        (torch.optim.RMSprop, {"lr": 1e-3}),
        (torch.optim.Adafactor, {"lr": 1e-2}),
    ],
)
def test_wrapper_with_mu_x_zero_is_the_base_bitwise(base, base_kwargs: dict) -> None:
    """GPA(base, mu_x=0) reproduces the base optimizer bit for bit (y = 0 * (...) + 1 * z')."""
    ref_params = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
    params = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
    ref = base(ref_params, **base_kwargs)
    opt = GPA(params, base=base, mu_x=0.0, mu_y=0.7, **base_kwargs)
    _steps(ref, ref_params, 10)
    _steps(opt, params, 10)
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)


def test_wrapper_with_muon_on_matrices() -> None:
    """GPA(torch.optim.Muon) runs on 2-D parameters and, with mu_x = 0, equals Muon itself."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        pytest.skip("torch.optim.Muon is not in this torch")
    ref_params = random_params(((8, 6), (8, 6)))
    params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    ref, opt = muon(ref_params, lr=1e-2), GPA(params, base=muon, mu_x=0.0, lr=1e-2)
    _steps(ref, ref_params, 5)
    _steps(opt, params, 5)
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)


def test_proposition_1_nesterov() -> None:
    """SGD base, constant lr, mu_x = mu_y = mu: y is PyTorch's Nesterov SGD iterate with lr (1 - mu) lr."""
    mu, lr = 0.9, 0.05
    ref_params, params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
    ref = torch.optim.SGD(ref_params, lr=(1 - mu) * lr, momentum=mu, nesterov=True)
    opt = GPA(params, base=torch.optim.SGD, lr=lr, mu_x=mu, mu_y=mu)
    _steps(ref, ref_params, 100)
    _steps(opt, params, 100)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-11)


def test_fused_matches_forloop_in_fp32_and_bf16() -> None:
    """The fused CPU kernel agrees with the for-loop ground truth: fp32 to rounding, bf16 parameters bitwise."""
    if _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.0)):
        a = random_params(SHAPES, dtype, draw_dtype=torch.float64)
        b = random_params(SHAPES, dtype, draw_dtype=torch.float64)
        opt_a = GPAAdamW(_groups(a), weight_decay=0.1, foreach=False)
        opt_b = GPAAdamW(_groups(b), weight_decay=0.1, fused=True)
        _run(opt_a, a, 30)
        _run(opt_b, b, 30)
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=tol, atol=tol)


def test_foreach_matches_forloop_bitwise() -> None:
    """The foreach path performs the for-loop's operations in the same order: fp32 results are torch.equal."""
    a = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
    b = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
    opt_a, opt_b = GPAAdamW(_groups(a), weight_decay=0.1, foreach=False), GPAAdamW(_groups(b), weight_decay=0.1)
    opt_b.param_groups[0]["foreach"] = opt_b.param_groups[1]["foreach"] = opt_b.param_groups[2]["foreach"] = True
    _run(opt_a, a, 20)
    _run(opt_b, b, 20)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_bf16_state_is_float32_and_survives_loading() -> None:
    """With state_dtype="float32" bf16 parameters keep z, m, v in float32, and load_state_dict does not cast that
    state to bf16 (also into an optimizer whose state_dtype is the default)."""
    params = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float64)
    opt = GPAAdamW(params, weight_decay=0.1, state_dtype="float32")
    _run(opt, params, 3)
    state = opt.state[params[0]]
    assert state["z"].dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    fresh = GPAAdamW(params, weight_decay=0.1)
    fresh.load_state_dict(opt.state_dict())
    for p in params:
        for key in ("z", "exp_avg", "exp_avg_sq"):
            assert fresh.state[p][key].dtype == torch.float32
            assert torch.equal(fresh.state[p][key], opt.state[p][key])


def test_state_is_three_parameter_copies() -> None:
    """GPAAdamW keeps exactly z, m, v (plus a scalar step): 3.0x the parameter bytes."""
    params = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
    opt = GPAAdamW(params)
    _run(opt, params, 1)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    tensor_state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert sum(t.numel() * t.element_size() for t in tensor_state) == 3 * param_bytes
    assert all(set(s) == {"step", "z", "exp_avg", "exp_avg_sq"} for s in opt.state.values())


def test_params_without_grads_and_empty_groups() -> None:
    """Parameters without gradients are untouched and get no state; empty groups are allowed."""
    params = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
    frozen = params[1].detach().clone()
    opt = GPAAdamW([{"params": params}, {"params": []}], weight_decay=0.1)
    for t in range(5):
        _fake_grads(params, t)
        params[1].grad = None
        opt.step()
    assert torch.equal(params[1], frozen)
    assert params[1] not in opt.state
    opt.eval()
    assert torch.equal(params[1], frozen)
    wrapper_params = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
    wrapper = GPA([{"params": wrapper_params}, {"params": []}], base=torch.optim.SGD, lr=0.1)
    frozen = wrapper_params[1].detach().clone()
    for t in range(3):
        _fake_grads(wrapper_params, t)
        wrapper_params[1].grad = None
        wrapper.step()
    assert torch.equal(wrapper_params[1], frozen)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_schedule_free_without_weight_decay_is_the_schedulefree_package(impl: str) -> None:
    """GPAAdamW(averaging="schedule_free", betas=(0, b2), mu_y=beta, weight_decay=0) under a linear warm-up, then a
    constant lr, is schedulefree.AdamWScheduleFree(betas=(beta, b2), warmup_steps=...): y, z and eval()'s x (float64,
    1e-12): the differences docs/concepts.md names (where weight decay acts, the averaging weights under a decaying
    lr, the warm-up given from outside here) are all left out."""
    schedulefree = pytest.importorskip("schedulefree", reason="schedulefree is the `bench` extra")
    lr, warmup, beta, beta2 = 2e-2, 5, 0.9, 0.95
    ref_params, params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
    ref = schedulefree.AdamWScheduleFree(
        ref_params, lr=lr, betas=(beta, beta2), eps=1e-8, warmup_steps=warmup, foreach=False
    )
    ref.train()  # schedulefree starts in eval mode
    opt = GPAAdamW(params, lr=lr, betas=(0.0, beta2), eps=1e-8, mu_y=beta, averaging="schedule_free", **IMPLS[impl])
    for t in range(40):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (t + 1) / warmup)  # schedulefree's own warm-up, given to ours from outside
        _fake_grads(ref_params, t)
        ref.step()
        _fake_grads(params, t)
        opt.step()
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(opt.state[p]["z"], ref.state[r]["z"], rtol=0, atol=1e-12)
    opt.eval()
    ref.eval()
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1e-12)


def test_schedule_free_tolerates_zero_lr_warmup_start() -> None:
    """Schedule-Free averaging with a warm-up that starts at lr = 0 stays finite and keeps x where it was."""
    params = random_params(SHAPES, torch.float64)
    start = [p.detach().clone() for p in params]
    opt = GPAAdamW(params, lr=0.0, averaging="schedule_free")
    _fake_grads(params, 0)
    opt.step()
    opt.eval()
    for p, s in zip(params, start):
        torch.testing.assert_close(p.detach(), s, rtol=0, atol=1e-15)


def test_maximize_flips_the_gradient() -> None:
    """maximize=True equals minimizing with negated gradients, on every path."""
    for impl in IMPLS.values():
        a, b = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
        opt_a, opt_b = GPAAdamW(a, maximize=True, **impl), GPAAdamW(b, **impl)
        for t in range(5):
            _fake_grads(a, t)
            _fake_grads(b, t)
            for p in b:
                p.grad.neg_()
            opt_a.step()
            opt_b.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-14)


def test_closure_is_evaluated_at_y() -> None:
    """step(closure) returns the closure's loss, computed at y before the update."""
    w = torch.nn.Parameter(torch.tensor([2.0]))
    opt = GPAAdamW([w], lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 4.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "learning rate"),
        ({"betas": (1.0, 0.999)}, "beta"),
        ({"betas": (0.9, -0.1)}, "beta"),
        ({"eps": -1e-8}, "epsilon"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"mu_x": 1.0}, r"mu_x.*\[0, 1\)"),
        ({"mu_x": -0.1}, r"mu_x.*\[0, 1\)"),
        ({"mu_y": 0.0}, r"mu_y.*\(0, 1\]"),
        ({"mu_y": 1.5}, r"mu_y.*\(0, 1\]"),
        ({"averaging": "uniform"}, "averaging"),
        ({"fused": True, "foreach": True}, "fused"),
    ],
)
def test_gpa_adamw_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    """Every out-of-range argument raises ValueError naming the argument, before any state exists."""
    with pytest.raises(ValueError, match=match):
        GPAAdamW(random_params(SHAPES, torch.float64), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"base": "adamw"}, "base"),
        ({"base": torch.optim.SGD, "lr": -1.0}, "learning rate"),
        ({"mu_x": 1.0}, "mu_x"),
        ({"mu_y": 0.0}, "mu_y"),
        ({"averaging": "ema"}, "averaging"),
        ({"group_mu": True}, "mu_y"),
    ],
)
def test_wrapper_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    """GPA(base=...) checks its own and the base's arguments (also per group) with a ValueError."""
    params: list = random_params(SHAPES, torch.float64)
    if kwargs.pop("group_mu", False):
        params = [{"params": params, "mu_y": 2.0}]
    with pytest.raises(ValueError, match=match):
        GPA(params, **kwargs)


def test_per_group_values_are_checked() -> None:
    """A per-group mu_x outside [0, 1) is rejected like the default one."""
    with pytest.raises(ValueError, match="mu_x"):
        GPAAdamW([{"params": random_params(SHAPES, torch.float64), "mu_x": 1.2}])


def test_converges_on_least_squares() -> None:
    """GPA-AdamW with a cosine schedule drives a noisy least-squares loss near its optimum, measured at x."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 10, generator=gen)
    w_true = torch.randn(10, generator=gen)
    b = a @ w_true
    w = torch.nn.Parameter(torch.zeros(10))
    opt = GPAAdamW([w], lr=0.05, mu_x=0.98, mu_y=0.7)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=600)
    for _ in range(600):
        idx = torch.randint(0, 256, (32,), generator=gen)
        loss = ((a[idx] @ w - b[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    opt.eval()
    assert ((a @ w - b) ** 2).mean().item() < 1e-3


def test_kernel_fallback_warns_once_and_matches_foreach(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a buildable kernel the default path warns once and gives the foreach results."""
    monkeypatch.setattr(_kernels, "_state", {"module": None, "failed": False})
    monkeypatch.setenv("HF_GPA_DISABLE_CPU_KERNEL", "1")
    a = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
    b = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
    opt_a, opt_b = GPAAdamW(a, weight_decay=0.1), GPAAdamW(b, weight_decay=0.1, foreach=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(opt_a, a, 5)
        _run(opt_b, b, 5)
    assert len([w for w in caught if "fused CPU kernel" in str(w.message)]) == 1
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("impl", list(IMPLS))
def test_bf16_x_tracks_the_fp32_run(impl: str) -> None:
    """With bf16 parameters x stays within about a bf16 rounding of the fp32 run's x (y is kept in float32)."""
    x32 = least_squares_x(torch.float32, IMPLS[impl])
    x16 = least_squares_x(torch.bfloat16, IMPLS[impl])
    ulps = (x16 - x32).abs() / (torch.finfo(torch.bfloat16).eps * x32.abs().clamp_min(1e-3))
    assert ulps.mean().item() < 1.0  # before y was kept in float32: ~30 bf16 ulps, and 0.95 loss against 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("base_kwargs", [{"foreach": True}, {"fused": True}], ids=["foreach_base", "fused_base"])
def test_wrapper_low_precision_x_tracks_the_fp32_run(base_kwargs: dict, dtype: torch.dtype) -> None:
    """GPA(AdamW) with bf16/fp16 parameters keeps y in float32 too: x within about one rounding of the fp32 run's x."""
    x32 = least_squares_x(torch.float32, base_kwargs, optimizer=GPA)
    x16 = least_squares_x(dtype, base_kwargs, optimizer=GPA)
    ulps = (x16 - x32).abs() / (torch.finfo(dtype).eps * x32.abs().clamp_min(1e-3))
    assert ulps.mean().item() < 1.0  # with y rounded to the parameter dtype at every step: tens of ulps


def test_bf16_state_holds_y_in_float32() -> None:
    """With state_dtype="float32" bf16 parameters keep y_fp32 (the parameter holds it rounded): state = 8x the bf16
    parameter bytes; eval() and train() go through it exactly, without a residual."""
    params = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float64)
    opt = GPAAdamW(_groups(params), weight_decay=0.1, state_dtype="float32")
    _run(opt, params, 3)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step")
    assert state_bytes == 8 * param_bytes
    ys = [p.detach().clone() for p in params]
    for p in params:
        assert torch.equal(p.detach(), opt.state[p]["y_fp32"].to(torch.bfloat16))
    opt.eval()
    for p, group_mu_y in zip(params, [0.7, 0.7, 0.9, 1.0]):
        s = opt.state[p]
        expected_x = ((s["y_fp32"] - (1 - group_mu_y) * s["z"]) / group_mu_y).to(torch.bfloat16)
        assert torch.equal(p.detach(), expected_x) and "y_residual" not in s
    opt.train()
    assert all(torch.equal(p.detach(), y) for p, y in zip(params, ys))


@pytest.mark.parametrize("impl", list(IMPLS))
def test_written_parameter_wins_over_its_float32_copy(impl: str) -> None:
    """A bf16 parameter written between steps (a load, a manual edit) is where the next step starts from
    (state_dtype="float32"; "compact" takes it with y's low word, test_modes.py)."""
    import copy

    params = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float64)
    opt = GPAAdamW(params, weight_decay=0.1, state_dtype="float32", **IMPLS[impl])
    _run(opt, params, 3)
    with torch.no_grad():
        params[0].mul_(0.5)
    fresh_params = [p.detach().clone().requires_grad_() for p in params]
    fresh = GPAAdamW(fresh_params, weight_decay=0.1, **IMPLS[impl])
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    del fresh.state[fresh_params[0]]["y_fp32"]  # the oracle: no copy, so the step starts from the parameter
    for ps, o in ((params, opt), (fresh_params, fresh)):
        _fake_grads(ps, 5)
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(params, fresh_params))


@pytest.mark.parametrize("impl", list(IMPLS))
def test_zero_lr_from_x_equal_z_leaves_y_bitwise(impl: str) -> None:
    """Steps with lr = 0 from a fresh start (x = y = z) leave y and z bitwise unchanged, on every path."""
    for dtype in (torch.float32, torch.bfloat16):
        params = random_params(SHAPES, dtype, draw_dtype=torch.float64)
        start = [p.detach().clone() for p in params]
        opt = GPAAdamW(_groups(params), weight_decay=0.1, **IMPLS[impl])
        for t in range(100):
            _fake_grads(params, t)
            for group in opt.param_groups:
                group["lr"] = 0.0
            opt.step()
        assert all(torch.equal(p.detach(), s) for p, s in zip(params, start))
        assert all(torch.equal(opt.state[p]["z"], s.to(opt.state[p]["z"].dtype)) for p, s in zip(params, start))


def test_non_contiguous_tensors_on_the_default_path() -> None:
    """Transposed gradients, channels_last parameters and state in another layout than the parameter work on the
    default path and equal the for-loop."""

    def make() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(3)
        matrix = torch.nn.Parameter(torch.randn(6, 9, generator=gen))
        conv = torch.nn.Parameter(torch.randn(4, 3, 5, 5, generator=gen).to(memory_format=torch.channels_last))
        plain = torch.nn.Parameter(torch.randn(2, 3, 4, 4, generator=gen))
        return [matrix, conv, plain]

    results = []
    for impl in ({"foreach": False}, {}):
        params = make()
        opt = GPAAdamW([{"params": [p]} for p in params], weight_decay=0.1, **impl)  # each decides its own path
        for t in range(4):
            gen = torch.Generator().manual_seed(t)
            params[0].grad = torch.randn(9, 6, generator=gen).t()  # transposed gradient
            params[1].grad = torch.randn(params[1].shape, generator=gen)  # contiguous grad, channels_last param
            params[2].grad = torch.randn(params[2].shape, generator=gen)
            opt.step()
            if t == 0:  # state of the contiguous parameter loaded from a channels_last model
                for key in ("z", "exp_avg", "exp_avg_sq"):
                    opt.state[params[2]][key] = opt.state[params[2]][key].to(memory_format=torch.channels_last)
        opt.eval()
        results.append(params)
    for p, q in zip(*results):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_tensor_learning_rates_behave_as_torch(impl: str) -> None:
    """A 0-d and a one-element 1-D or 2-D tensor lr give the float lr's result on every path (torch's AdamW takes
    all three)."""
    reference = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
    opt = GPAAdamW(reference, lr=1e-2, weight_decay=0.1, **IMPLS[impl])
    _steps(opt, reference, 3)
    for lr in (torch.tensor(1e-2), torch.tensor([1e-2]), torch.tensor([[1e-2]])):
        params = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
        opt = GPAAdamW(params, lr=lr, weight_decay=0.1, **IMPLS[impl])
        _steps(opt, params, 3)
        for p, r in zip(params, reference):
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_multi_element_lr_is_rejected() -> None:
    """A learning rate tensor with more than one element raises a ValueError naming the learning rate."""
    with pytest.raises(ValueError, match="learning rate"):
        GPAAdamW(random_params(SHAPES, torch.float64), lr=torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match="learning rate"):
        GPAAdamW([{"params": random_params(SHAPES, torch.float64), "lr": torch.tensor([1e-3, 1e-3])}])


def _complex_grads(params: list[torch.Tensor], t: int) -> None:
    for p in params:
        y = p.detach()
        p.grad = torch.sin(y + t) + 0.3 * y.conj()


@pytest.mark.parametrize("impl", list(IMPLS))
def test_complex_parameters_follow_torch_adamw(impl: str) -> None:
    """Complex parameters are optimized as pairs of reals: mu_x = 0 equals torch's AdamW (view_as_real), and
    eval()/train() restore y bitwise."""
    ref_params = random_params(COMPLEX_SHAPES, torch.complex128, seed=4)
    params = random_params(COMPLEX_SHAPES, torch.complex128, seed=4)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=False)
    opt = GPAAdamW(params, lr=1e-2, weight_decay=0.1, mu_x=0.0, **IMPLS[impl])
    _steps(ref, ref_params, 3, _complex_grads)
    _steps(opt, params, 3, _complex_grads)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-12)
    averaged = random_params(COMPLEX_SHAPES, torch.complex128, seed=4)
    opt = GPAAdamW(averaged, lr=1e-2, mu_x=0.9, **IMPLS[impl])
    _steps(opt, averaged, 3, _complex_grads)
    ys = [p.detach().clone() for p in averaged]
    opt.eval()
    opt.train()
    assert all(torch.equal(p.detach(), y) for p, y in zip(averaged, ys))


def test_wrapper_takes_complex_parameters() -> None:
    """GPA(base=AdamW, mu_x=0) on complex parameters equals torch's AdamW (the passes see pairs of reals)."""
    ref_params = random_params(COMPLEX_SHAPES, torch.complex128, seed=4)
    params = random_params(COMPLEX_SHAPES, torch.complex128, seed=4)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    opt = GPA(params, base=torch.optim.AdamW, mu_x=0.0, lr=1e-2, foreach=False)
    _steps(ref, ref_params, 3, _complex_grads)
    _steps(opt, params, 3, _complex_grads)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("failing_step", [0, 3])
@pytest.mark.parametrize("wrapper", ["gpa", "diloco"])
def test_wrapper_step_whose_base_raises_changes_nothing(
    wrapper: str, failing_step: int, dtype: torch.dtype, failing_adamw: type[torch.optim.AdamW]
) -> None:
    """GPA / DiLoCo: a step whose base raises (Schedule-Free's first step, where mu_x = 0, or a later one) leaves z,
    the base's state, keys and groups torch.equal to before, and bf16 parameters too; GPA's fp64 y (and y's float32
    copy) come back by the first pass's inverse, within a rounding. The run then goes on as if the step was never
    tried."""
    make = {
        "gpa": lambda ps: GPA(ps, base=failing_adamw, lr=1e-2, mu_x=0.9, averaging="schedule_free"),
        "diloco": lambda ps: DiLoCo(ps, base=failing_adamw, inner_steps=2, lr=1e-2),
    }[wrapper]
    inexact = wrapper == "gpa" and failing_step > 0  # y was scaled in place before the base raised
    close = dict(rtol=0, atol=4 * torch.finfo(torch.float32 if dtype == torch.bfloat16 else dtype).eps)
    params = random_params(SHAPES, dtype, draw_dtype=torch.float64)
    twin_params = random_params(SHAPES, dtype, draw_dtype=torch.float64)
    opt, twin = make(params), make(twin_params)
    _run(opt, params, failing_step)
    _run(twin, twin_params, failing_step)
    before = [p.detach().clone() for p in params]
    before_state = copy.deepcopy(opt.state_dict())
    _fake_grads(params, 99)
    with failing_adamw.failing(), pytest.raises(torch.OutOfMemoryError):
        opt.step()
    for p, b in zip(params, before):
        if inexact and dtype == torch.float64:
            torch.testing.assert_close(p, b, **close)
        else:
            assert torch.equal(p, b)
    after_state = opt.state_dict()
    assert after_state["param_groups"] == before_state["param_groups"]
    assert after_state["state"].keys() == before_state["state"].keys()
    for i, s in before_state["state"].items():
        assert s.keys() == after_state["state"][i].keys()
        for key, value in s.items():
            if key == "y_fp32" and inexact:
                torch.testing.assert_close(value, after_state["state"][i][key], **close)
            elif torch.is_tensor(value):
                assert torch.equal(value, after_state["state"][i][key]), key
            elif isinstance(value, dict):
                assert value.keys() == after_state["state"][i][key].keys()
                assert all(torch.equal(v, after_state["state"][i][key][k]) for k, v in value.items())
    _run(opt, params, 4)
    _run(twin, twin_params, 4)
    for p, q in zip(params, twin_params):
        if inexact:
            torch.testing.assert_close(p, q, rtol=torch.finfo(dtype).eps if dtype == torch.bfloat16 else 1e-12, atol=0)
        else:
            assert torch.equal(p, q)


def test_wrapper_at_zero_lr_moves_y_towards_z_and_rests_where_x_equals_z() -> None:
    """lr = 0 (z fixed): from a fresh start (x = y = z) y stays within one rounding per step of where it was (100
    steps, fp32); after training, y moves with x towards z exactly as Algorithm 1 says."""
    params = random_params(SHAPES, torch.float32, draw_dtype=torch.float64)
    start = [p.detach().clone() for p in params]
    opt = GPA(params, lr=0.0, mu_x=0.9967, mu_y=0.7)
    _steps(opt, params, 100)
    for p, s in zip(params, start):
        bound = 100 * torch.finfo(torch.float32).eps
        torch.testing.assert_close(p.detach(), s, rtol=bound, atol=bound)
    ref_params, params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
    ref = ReferenceGPA(ref_params, lr=1e-2, mu_x=0.9, mu_y=0.7)
    opt = GPA(params, lr=1e-2, mu_x=0.9, mu_y=0.7, weight_decay=0.0)
    _run(ref, ref_params, 5)
    _run(opt, params, 5)
    for o in (ref, opt):
        for group in o.param_groups:
            group["lr"] = 0.0
    moved = [p.detach().clone() for p in params]
    for t in range(5):
        for ps, o in ((ref_params, ref), (params, opt)):
            _fake_grads(ps, t)
            o.step()
    for p, r, m in zip(params, ref_params, moved):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-12)
        assert not torch.equal(p.detach(), m)


@pytest.mark.parametrize("eval_mode", [False, True])
def test_gpa_bf16_parameters_cast_to_fp32_receive_y_exactly(eval_mode: bool) -> None:
    """GPA(AdamW) on bf16 parameters, the model cast to fp32 (in train mode, or between eval() and train()): the
    parameter holds y's float32 copy exactly, the copy goes, and the run steps on bitwise as an fp32 run given those
    values, as GPAAdamW's state does (the parameter kept y rounded to bf16: one bf16 unit off a run never cast)."""
    kw = dict(base=torch.optim.AdamW, lr=1e-2, mu_x=0.9, weight_decay=0.1)
    w = torch.nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16))
    opt = GPA([w], **kw)
    for t in range(3):
        w.grad = torch.randn(16, generator=torch.Generator().manual_seed(t)).to(w.dtype)
        opt.step()
    y32 = opt.state[w]["y_fp32"].clone()
    z, base = opt.state[w]["z"].clone(), {k: v.clone() for k, v in opt.state[w]["base"].items()}
    if eval_mode:
        opt.eval()
    w.data = w.data.float()
    opt.train()
    assert torch.equal(w.detach(), y32) and "y_fp32" not in opt.state[w]
    ref = torch.nn.Parameter(y32.clone())
    ref_opt = GPA([ref], **kw)
    ref_opt.init_state()
    ref_opt.state[ref]["z"].copy_(z)
    for key, value in base.items():
        ref_opt.state[ref]["base"][key].copy_(value)
    for t in range(3, 6):
        for p in (w, ref):
            p.grad = torch.randn(16, generator=torch.Generator().manual_seed(t))
        opt.step()
        ref_opt.step()
    assert torch.equal(w.detach(), ref.detach()) and torch.equal(opt.state[w]["z"], ref_opt.state[ref]["z"])


def _grads_skipping_a_group(params: list[torch.Tensor], t: int) -> None:
    """`_fake_grads`, but the last group of `_groups` (params[3:]) gets no gradient at steps 2-5 and 9."""
    _fake_grads(params, t)
    if 2 <= t <= 5 or t == 9:
        for p in params[3:]:
            p.grad = None


@pytest.mark.parametrize(
    "make",
    [
        *(pytest.param(lambda ps, kw, i=i: GPAAdamW(ps, **kw, **i), id=f"gpa_adamw_{n}") for n, i in IMPLS.items()),
        pytest.param(lambda ps, kw: GPA(ps, base=torch.optim.AdamW, **kw), id="gpa(adamw)"),
    ],
)
def test_schedule_free_counts_a_step_without_gradients_in_the_weight_sum(make: Callable) -> None:
    """Schedule-Free averaging with a group that gets no gradient at some steps: every group's weight sum grows by
    lr^2 at every step, as ReferenceGPA and schedule_free's optimizers do, so x and y equal the reference's (the fast
    paths kept the sum of such a group: 3e-3 apart after 8 steps)."""
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, mu_x=0.95, mu_y=0.7)
    kwargs["averaging"] = "schedule_free"
    ref_params, params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
    ref = ReferenceGPA(_groups(ref_params), base="adamw", **kwargs)
    opt = make(_groups(params), kwargs)
    _steps(ref, ref_params, 12, _grads_skipping_a_group)
    _steps(opt, params, 12, _grads_skipping_a_group)
    assert [g["weight_sum"] for g in opt.param_groups] == [g["weight_sum"] for g in ref.param_groups]
    opt.eval()
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), ref.x(r), rtol=0, atol=1e-12)
