"""GPAAdamW(state_dtype="compact"): bf16 parameters keep y and z as 24-bit values (the parameter or z's bf16 high word
and an int8 low word) and m, v in bf16: 8 bytes of state per weight, with the accuracy of the float32 state.

The numbers of the update itself are held to the for-loop on every path in test_implementations.py; here: the 24-bit
rounding, the byte count, the accuracy against an fp32 run, eval()/train(), saving and resuming, init_state(),
adopting an AdamW state."""

from __future__ import annotations

import pytest
import torch
from tensors import random_params

from benchmarks.workloads import least_squares_problem, least_squares_x
from hf_gpa.optim import GPAAdamW
from hf_gpa.optim._state_layout import join24, split24_

IMPLS = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "default": {}}
SHAPES = ((16, 8), (8,))


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def _y(opt: GPAAdamW, p: torch.Tensor) -> torch.Tensor:
    return join24(p.detach(), opt.state[p]["y_lo"])


def _z(opt: GPAAdamW, p: torch.Tensor) -> torch.Tensor:
    return join24(opt.state[p]["z"], opt.state[p]["z_lo"])


def test_the_24_bit_rounding() -> None:
    """split then join is float32 rounded to nearest even at 24 bits; the high word is the nearest bf16 (ties away
    from zero), so the parameter holds y rounded; a value already of 24 bits splits and joins exactly."""
    g = torch.Generator().manual_seed(0)
    u = torch.cat([torch.randn(4096, generator=g) * 10.0 ** torch.randint(-30, 30, (4096,), generator=g),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf")])])  # fmt: skip
    hi, lo = torch.empty_like(u, dtype=torch.bfloat16), torch.empty_like(u, dtype=torch.int8)
    split24_(u, hi, lo)
    joined = join24(hi, lo)
    bits = u.view(torch.int32).long() & 0xFFFFFFFF
    expected = (bits + 0x7F + ((bits >> 8) & 1)) & 0xFFFFFF00  # in int64: no wrapping to reason about
    assert torch.equal(joined.view(torch.int32).long() & 0xFFFFFFFF, expected)
    finite = torch.isfinite(hi) & (hi.float().abs() > 1e-37)  # normal bf16 numbers: a unit is 2^-7 of the value
    assert ((joined - hi.float()).abs() <= hi.float().abs() * 2.0**-8)[finite].all()  # within half a bf16 unit
    assert torch.equal(join24(*_split(joined)), joined)  # a 24-bit value splits and joins exactly
    assert torch.isnan(join24(*_split(torch.tensor([float("nan")])))).all()


def _split(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi, lo = torch.empty_like(u, dtype=torch.bfloat16), torch.empty_like(u, dtype=torch.int8)
    split24_(u, hi, lo)
    return hi, lo


@pytest.mark.parametrize("impl", IMPLS)
def test_state_is_eight_bytes_per_bf16_weight(impl: str) -> None:
    """z (bf16) + z's and y's low words (int8) + m, v (bf16): 8 bytes per weight beyond the parameter."""
    params = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float32)
    opt = GPAAdamW(params, weight_decay=0.1, state_dtype="compact", **IMPLS[impl])
    _run(opt, params, 3)
    for p in params:
        state = opt.state[p]
        assert set(state) == {"step", "z", "z_lo", "exp_avg", "exp_avg_sq", "y_lo"}
        assert sum(t.numel() * t.element_size() for k, t in state.items() if k != "step") == 8 * p.numel()
        assert state["y_lo"].dtype == state["z_lo"].dtype == torch.int8
        assert state["z"].dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


def test_fp16_and_fp32_parameters_keep_their_state() -> None:
    """state_dtype="compact" changes only bf16 parameters: fp16 keeps the float32 state and y's copy (fp16's 5-bit
    exponent has no 8-bit low word covering its range), fp32 its fp32 state."""
    half, single = random_params(SHAPES, torch.float16, draw_dtype=torch.float32), random_params(SHAPES)
    opt = GPAAdamW([{"params": half}, {"params": single}], state_dtype="compact")
    _run(opt, half + single, 2)
    assert all(opt.state[p]["z"].dtype == torch.float32 and "y_fp32" in opt.state[p] for p in half)
    assert all(opt.state[p]["z"].dtype == torch.float32 and "y_lo" not in opt.state[p] for p in single)


def test_bad_state_dtype_names_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="Invalid state_dtype: 'bf24' \\(must be one of float32, param, compact\\)"):
        GPAAdamW(random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float32), state_dtype="bf24")


def test_accuracy_against_the_fp32_run() -> None:
    """Least squares with noisy targets in bf16 (400 steps, cosine lr; benchmarks.bf16_lowmem_study's problem,
    seed 0): the final loss at x is within 1.2x of the fp32 run's (the noise floor), as with the float32 state;
    state_dtype="param" is not (5.75x over 5 seeds, docs/memory.md), so the test tells the modes apart."""
    a, b, _ = least_squares_problem(noise=0.3)

    def loss(dtype: torch.dtype, state_dtype: str) -> float:
        x = least_squares_x(dtype, {"state_dtype": state_dtype}, noise=0.3)
        return ((a @ x - b) ** 2).mean().item()

    loss32 = loss(torch.float32, "float32")
    losses = {s: loss(torch.bfloat16, s) for s in ("float32", "param", "compact")}
    assert losses["compact"] <= 1.2 * loss32, (losses, loss32)
    assert losses["param"] > 2.0 * loss32, (losses, loss32)


@pytest.mark.parametrize("impl", IMPLS)
def test_eval_computes_x_from_the_24_bit_values_and_train_restores_y_bitwise(impl: str) -> None:
    """eval(): x = z + (y - z) / mu_y from the joined y and z, rounded once to bf16; train(): the parameter and
    both low words bitwise as before."""
    params = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float32)
    opt = GPAAdamW(params, lr=0.1, weight_decay=0.1, mu_x=0.9, state_dtype="compact", **IMPLS[impl])
    _run(opt, params, 5)
    before = {p: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params}
    expected_x = [((_y(opt, p).double() - _z(opt, p).double()) / 0.7 + _z(opt, p).double()) for p in params]
    opt.eval()
    for p, x in zip(params, expected_x):
        torch.testing.assert_close(p.detach().double(), x, rtol=2**-8, atol=0)  # one bf16 rounding of x
        assert not torch.equal(p.detach(), before[p][0])
    opt.train()
    for p in params:
        assert torch.equal(p.detach(), before[p][0])
        for key, value in before[p][1].items():
            assert torch.equal(opt.state[p][key], value), key


def test_x_written_in_eval_mode_wins() -> None:
    """A weight of x written while in eval mode (a load, a re-initialized head) wins: train() gives a y whose x is
    the written value (y = mu_y x + (1 - mu_y) z within half a bf16 unit), the next eval() gives it back bitwise;
    every other weight of y comes back bitwise."""
    params = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float32)
    opt = GPAAdamW(params, lr=0.1, mu_x=0.9, state_dtype="compact")
    _run(opt, params, 5)
    p = params[0]
    y_before = _y(opt, p).clone()
    opt.eval()
    x_before = p.detach().clone()
    with torch.no_grad():
        p[0, 0] = 3.0
    opt.train()
    y = _y(opt, p)
    expected = torch.lerp(_z(opt, p), torch.full(p.shape, 3.0), 0.7)
    torch.testing.assert_close(y[0, 0], expected[0, 0], rtol=2**-8, atol=0)
    assert torch.equal(y.flatten()[1:], y_before.flatten()[1:])
    opt.eval()
    assert p[0, 0].item() == 3.0 and torch.equal(p.detach().flatten()[1:], x_before.flatten()[1:])


@pytest.mark.parametrize("eval_mode", [False, True])
def test_resume_from_a_state_dict_is_exact(eval_mode: bool) -> None:
    """Saved after 4 steps (in train or eval mode) and loaded into a new optimizer, 3 more steps equal the
    uninterrupted run's bitwise."""
    ref = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float32)
    ref_opt = GPAAdamW(ref, weight_decay=0.1, mu_x=0.9, state_dtype="compact")
    _run(ref_opt, ref, 4)
    _run(ref_opt, ref, 3, seed=2)
    params = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float32)
    opt = GPAAdamW(params, weight_decay=0.1, mu_x=0.9, state_dtype="compact")
    _run(opt, params, 4)
    if eval_mode:
        opt.eval()
    saved_params = [p.detach().clone() for p in params]
    saved = opt.state_dict()
    fresh = [torch.nn.Parameter(t.clone()) for t in saved_params]
    new_opt = GPAAdamW(fresh, weight_decay=0.1, mu_x=0.9, state_dtype="compact")
    if eval_mode:
        new_opt.init_state(eval_mode=True)
    new_opt.load_state_dict(saved)
    new_opt.train()
    _run(new_opt, fresh, 3, seed=2)
    for p, r in zip(fresh, ref):
        assert torch.equal(p, r)
        for key, value in ref_opt.state[r].items():
            assert torch.equal(new_opt.state[p][key], value), key


def test_init_state_creates_the_compact_state() -> None:
    """init_state(): the state a first step finds (z = y, zero low words and moments), in the mode's dtypes."""
    params = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float32)
    opt = GPAAdamW(params, state_dtype="compact")
    opt.init_state()
    for p in params:
        state = opt.state[p]
        assert state["z"].dtype == torch.bfloat16 and torch.equal(state["z"], p.detach())
        assert not state["y_lo"].any() and not state["z_lo"].any() and not state["exp_avg"].any()


def test_adopting_an_adamw_state_keeps_the_compact_dtypes() -> None:
    """An AdamW run's state loaded into GPAAdamW(state_dtype="compact"): m, v and step taken, in bf16, z = y."""
    params = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float32)
    adamw = torch.optim.AdamW(params, lr=1e-3)
    _run(adamw, params, 2)
    saved = adamw.state_dict()
    opt = GPAAdamW(params, state_dtype="compact")
    opt.load_state_dict(saved)
    for p in params:
        state = opt.state[p]
        assert {state[k].dtype for k in ("z", "exp_avg", "exp_avg_sq")} == {torch.bfloat16}
        assert state["y_lo"].dtype == state["z_lo"].dtype == torch.int8
        assert torch.equal(state["exp_avg"], adamw.state[p]["exp_avg"].to(torch.bfloat16))
        assert torch.equal(state["z"], p.detach()) and float(state["step"]) == 2.0
    _run(opt, params, 1)
