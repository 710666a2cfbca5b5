"""GPAAdamW's state layouts: every pair of words of the 24-bit format is a number near its high word, on every path;
a state follows its parameters into another dtype exactly (a cast model, a checkpoint loaded into parameters of
another dtype, in train or eval mode), or is refused before anything changes."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from hf_gpa import GPAAdamW
from hf_gpa.optim import kernels
from hf_gpa.optim._state_layout import join24, split24_
from hf_gpa.optim.kernels import cpu as _kernels
from hf_gpa.optim.kernels import triton_launch as _triton

IMPLS = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "cpu_kernel": {"fused": True}, "triton": {}}


def _impl(name: str) -> tuple[dict, str | None]:
    """The optimizer's arguments and the kernels' test switch of a path (skipped where it cannot run here)."""
    if name == "cpu_kernel" and _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    if name == "triton":
        if not _triton.triton_available():
            pytest.skip("triton is not installed")
        return {"fused": True}, "triton"
    return IMPLS[name], None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int8)


def test_every_join_is_a_number_within_half_a_unit_of_its_high_word() -> None:
    """All 65,536 high words with all 256 low words: where the high word is finite the join is finite and within half
    a bf16 unit of it (the spacing towards the join), and split gives back what it joins (a NaN as a NaN)."""
    hi = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    lo = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    his, los = hi.repeat_interleave(256), lo.repeat(hi.numel())
    joined = join24(his, los)
    finite = torch.isfinite(his)
    assert torch.isfinite(joined[finite]).all()
    assert torch.equal(joined[his.isinf()], his[his.isinf()].float())  # inf stays inf, whatever the low word
    assert joined[his.isnan()].isnan().all()
    # The bf16 neighbour of hi towards the join: half the gap to it bounds the offset.
    h = his[finite].float().double()
    j = joined[finite].double()
    bits = his[finite].view(torch.int16).int()
    away = (j.abs() > h.abs()) | (h == 0)
    neighbour = torch.where(away, bits + 1, bits - 1).to(torch.int16).view(torch.bfloat16).double()
    neighbour = torch.where(h == 0, torch.where(j < 0, -(2.0**-133), 2.0**-133), neighbour.copysign(h))
    assert ((j - h).abs() <= (neighbour - h).abs() / 2).all()
    hi2, lo2 = torch.empty_like(his[finite]), torch.empty_like(los[finite])
    split24_(joined[finite], hi2, lo2)
    assert torch.equal(join24(hi2, lo2), joined[finite])  # the join is a 24-bit value: split and joined back exactly
    nan_hi, nan_lo = torch.empty(1, dtype=torch.bfloat16), torch.empty(1, dtype=torch.int8)
    nan = torch.tensor([-1], dtype=torch.int32).view(torch.float32)  # bits 0xFFFFFFFF: a NaN that rounds to a zero
    split24_(nan, nan_hi, nan_lo)
    assert nan_hi.isnan().all() and nan_lo.item() == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_kernels_join_and_split_as_the_forloop(impl: str) -> None:
    """Every (high word, low word) pair through a step that keeps y and z (lr = 0, zero gradient, z = y): each path
    writes bitwise the words the for-loop writes, NaNs included. Under triton < 3.9 (the lowest pass's 3.6) the
    interpreter keeps z = -0.0 where the for-loop writes +0.0 (3 of the 327,680 pairs, high word -0.0): there the
    sign of a zero is let go, every other word is still bitwise."""
    kwargs, force = _impl(impl)
    zero_sign_free = False
    if impl == "triton":
        import triton

        zero_sign_free = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9)
    hi = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    lows = torch.tensor([-128, -1, 0, 1, 127], dtype=torch.int8)

    def words(kwargs: dict, force: str | None) -> tuple[torch.Tensor, ...]:
        p = torch.nn.Parameter(hi.repeat_interleave(len(lows)).clone())
        opt = GPAAdamW([p], lr=0.0, mu_x=0.5, **kwargs)
        opt.init_state()
        state = opt.state[p]
        state["y_lo"].copy_(lows.repeat(hi.numel()))
        state["z"].copy_(p.detach())
        state["z_lo"].copy_(state["y_lo"])
        p.grad = torch.zeros_like(p)
        with mock.patch.dict(kernels.FORCE, backend=force):
            opt.step()
        return tuple(_bits(t) for t in (p.detach(), state["y_lo"], state["z"], state["z_lo"]))

    ref = words({"foreach": False}, None)
    for actual, expected in zip(words(kwargs, force), ref):
        if zero_sign_free and expected.dtype == torch.int16:
            zero = (expected & 0x7FFF) == 0
            assert torch.equal(actual[zero] & 0x7FFF, expected[zero] & 0x7FFF)
            actual, expected = actual[~zero], expected[~zero]
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_zero_written_into_a_compact_parameter_trains_on(impl: str) -> None:
    """A bias set to 0.0 after 3 steps (its low word stale, often negative): 5 more steps move it off zero, x stays
    finite, as the for-loop computes it (the 24-bit join of +0 with a negative low word used to be a NaN)."""
    kwargs, force = _impl(impl)

    def run(kwargs: dict, force: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 8).to(torch.bfloat16)
        opt = GPAAdamW(lin.parameters(), lr=1e-2, mu_x=0.9, **kwargs)
        with mock.patch.dict(kernels.FORCE, backend=force):
            for t in range(8):
                if t == 3:
                    torch.nn.init.zeros_(lin.bias)
                for p in lin.parameters():
                    p.grad = (torch.sin(3 * p.detach().float() + t) + 0.1).to(p.dtype)
                opt.step()
        y = lin.bias.detach().clone()
        opt.eval()
        return y, lin.bias.detach().clone()

    y, x = run(kwargs, force)
    assert (y != 0).all() and torch.isfinite(x).all()
    y_ref, x_ref = run({"foreach": False}, None)
    torch.testing.assert_close(y, y_ref, rtol=2**-7, atol=0)  # one bf16 unit: the kernels' float32 rounding
    torch.testing.assert_close(x, x_ref, rtol=2**-7, atol=0)


def _bf16_run(state_dtype: str = "compact", steps: int = 3) -> tuple[list[torch.nn.Parameter], GPAAdamW]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16)) for s in ((16, 8), (8,))]
    opt = GPAAdamW(params, lr=1e-2, weight_decay=0.1, mu_x=0.9, state_dtype=state_dtype)
    _steps(opt, params, 0, steps)
    return params, opt


def _steps(opt: GPAAdamW, params: list[torch.Tensor], start: int, stop: int) -> None:
    for t in range(start, stop):
        gen = torch.Generator().manual_seed(t)  # gradients that do not depend on the parameters' dtype
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _exact(opt: GPAAdamW, params: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """y, z, m, v and step of a compact run, exactly, in float32."""
    out = []
    for p in params:
        s = opt.state[p]
        y, z = join24(p.detach(), s["y_lo"]), join24(s["z"], s["z_lo"])
        out.append({"y": y, "z": z, "exp_avg": s["exp_avg"].float(), "exp_avg_sq": s["exp_avg_sq"].float(),
                    "step": s["step"].clone()})  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_compact_state_follows_its_parameters_to_a_wider_dtype_exactly(dtype: torch.dtype) -> None:
    """bf16 parameters cast to fp32/fp64 under a compact state (``p.data = p.data.float()``): the next step takes y
    and z exactly (24 bits widened), and steps as an optimizer of those parameters given that state (it crashed)."""
    params, opt = _bf16_run()
    exact = _exact(opt, params)
    for p in params:
        p.data = p.data.to(dtype)
    _steps(opt, params, 3, 5)
    ref = [torch.nn.Parameter(e["y"].to(dtype)) for e in exact]
    ref_opt = GPAAdamW(ref, lr=1e-2, weight_decay=0.1, mu_x=0.9)
    ref_opt.init_state()
    for r, e in zip(ref, exact):
        for key in ("z", "exp_avg", "exp_avg_sq", "step"):
            ref_opt.state[r][key].copy_(e[key])
    _steps(ref_opt, ref, 3, 5)
    for p, r in zip(params, ref):
        assert set(opt.state[p]) == {"step", "z", "exp_avg", "exp_avg_sq"}
        assert torch.equal(p, r)
        for key in ("z", "exp_avg", "exp_avg_sq", "step"):
            mine, theirs = opt.state[p][key], ref_opt.state[r][key]
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), key


@pytest.mark.parametrize("eval_mode", [False, True])
def test_a_compact_state_loaded_into_fp16_parameters_is_converted_exactly(eval_mode: bool) -> None:
    """A bf16 run's compact state loaded into an fp16 copy of the model (saved in train mode, or in eval mode with x
    in the weights, as GPATrainer's checkpoints): float32 state with y and z exactly the 24-bit values, the parameter
    y rounded to fp16; x as the bf16 run's x computed in float32, within half an fp16 unit (it was off by 0.35)."""
    params, opt = _bf16_run()
    exact = _exact(opt, params)
    x_exact = [e["z"] + (e["y"] - e["z"]) / 0.7 for e in exact]
    if eval_mode:
        opt.eval()
    saved = copy.deepcopy(opt.state_dict())
    half = [torch.nn.Parameter(p.detach().to(torch.float16)) for p in params]
    new_opt = GPAAdamW(half, lr=1e-2, weight_decay=0.1, mu_x=0.9)
    new_opt.load_state_dict(saved)
    if eval_mode:
        new_opt.train()
    else:
        new_opt.eval()
        new_opt.train()
    for p, e in zip(half, exact):
        state = new_opt.state[p]
        assert set(state) == {"step", "z", "exp_avg", "exp_avg_sq", "y_fp32"}
        for key in ("z", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[key], e[key]), key
        assert torch.equal(state["y_fp32"], e["y"]) and torch.equal(p.detach(), e["y"].to(torch.float16))
    new_opt.eval()
    for p, x in zip(half, x_exact):
        torch.testing.assert_close(p.detach().float(), x, rtol=2**-11, atol=0)
    new_opt.train()
    _steps(new_opt, half, 3, 5)  # and it trains on
    assert all(torch.isfinite(p).all() for p in half)


def test_a_float64_state_into_float32_parameters_is_refused_before_anything_changes() -> None:
    """fp64 z, m, v cannot become an fp32 parameter's state exactly: load_state_dict raises a ValueError naming both
    dtypes and the parameter, and the receiving optimizer is as it was; a model cast the same way raises at the step,
    before any update."""
    gen = torch.Generator().manual_seed(0)
    wide = [torch.nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64))]
    wide_opt = GPAAdamW(wide, lr=1e-2, mu_x=0.9)
    _steps(wide_opt, wide, 0, 2)
    narrow = [torch.nn.Parameter(wide[0].detach().float())]
    opt = GPAAdamW(narrow, lr=1e-2, mu_x=0.9)
    _steps(opt, narrow, 0, 1)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"parameter 0 .*float64.*float32"):
        opt.load_state_dict(wide_opt.state_dict())
    after = opt.state_dict()
    assert all(torch.equal(after["state"][0][k], v) for k, v in before["state"][0].items())
    wide[0].data = wide[0].data.float()
    y = wide[0].detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] .*float64.*float32"):
        _steps(wide_opt, wide, 2, 3)
    assert torch.equal(wide[0].detach(), y)


def test_a_refused_cast_leaves_the_other_parameters_of_the_group_as_they_are() -> None:
    """A model cast to fp16 whose group holds a bf16 parameter with a float32 state (which a cast between bf16 and
    fp16 would give y rounded to fp16) before a float64 one (refused): the step raises, and the fp16 parameter keeps
    the values the cast gave it, y's copy untouched (the refusal came after the first had been rewritten)."""
    gen = torch.Generator().manual_seed(0)
    half = torch.nn.Parameter(torch.randn(64, generator=gen).to(torch.bfloat16))
    wide = torch.nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64))
    opt = GPAAdamW([half, wide], lr=1e-2, mu_x=0.9, state_dtype="float32")
    _steps(opt, [half, wide], 0, 3)
    assert not torch.equal(opt.state[half]["y_fp32"].half(), half.detach().half())  # the cast rounds otherwise
    for p in (half, wide):
        p.data = p.data.half()
    cast, y32 = half.detach().clone(), opt.state[half]["y_fp32"].clone()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] .*float64.*float16"):
        _steps(opt, [half, wide], 3, 4)
    assert torch.equal(half.detach(), cast) and torch.equal(opt.state[half]["y_fp32"], y32)


@pytest.mark.parametrize("state_dtype", ["float32", "param", "compact"])
def test_every_bf16_layout_follows_a_cast_to_fp32_exactly(state_dtype: str) -> None:
    """bf16 parameters cast to fp32 under each layout: the state becomes the fp32 parameter's (z, m, v in float32,
    nothing else), holding exactly the values it held, and the parameter holds y exactly (24 bits, y's float32 copy,
    or the bf16 value)."""
    params, opt = _bf16_run(state_dtype)
    expected = []
    for p in params:
        s = opt.state[p]
        if state_dtype == "compact":
            y, z = join24(p.detach(), s["y_lo"]), join24(s["z"], s["z_lo"])
        else:
            y, z = s.get("y_fp32", p.detach()).float(), s["z"].float()
        expected.append((y, z, s["exp_avg"].float(), s["exp_avg_sq"].float()))
    for p in params:
        p.data = p.data.float()
    opt.eval()  # converts (train mode), then x
    opt.train()
    for p, (y, z, m, v) in zip(params, expected):
        state = opt.state[p]
        assert set(state) == {"step", "z", "exp_avg", "exp_avg_sq"}
        assert all(state[k].dtype == torch.float32 for k in ("z", "exp_avg", "exp_avg_sq"))
        assert torch.equal(p.detach(), y) and torch.equal(state["z"], z)
        assert torch.equal(state["exp_avg"], m) and torch.equal(state["exp_avg_sq"], v)


@pytest.mark.parametrize("impl", ["forloop", "foreach", "cpu_kernel"])
def test_the_functional_steps_as_the_optimizer(impl: str) -> None:
    """gpa_adamw() over plain tensor lists (fp32 parameters, bf16 ones with float32 state and with compact state) gives
    bitwise what GPAAdamW.step() gives with the same state."""
    from hf_gpa.optim.gpa_adamw import gpa_adamw

    kwargs, _ = _impl(impl)
    gen = torch.Generator().manual_seed(0)
    shapes_dtypes = [((6, 5), torch.float32), ((7,), torch.bfloat16), ((3, 4), torch.bfloat16)]
    values = [torch.randn(s, generator=gen).to(d) for s, d in shapes_dtypes]
    groups = [{"params": [torch.nn.Parameter(v.clone())], "state_dtype": sd} for v, sd in
              zip(values, ("float32", "float32", "compact"))]  # fmt: skip
    opt = GPAAdamW(groups, lr=1e-2, weight_decay=0.1, mu_x=0.9, **kwargs)
    params = [torch.nn.Parameter(v.clone()) for v in values]
    twin = GPAAdamW([{"params": [p], "state_dtype": g["state_dtype"]} for p, g in zip(params, groups)])
    twin.init_state()
    states = [twin.state[p] for p in params]
    for t in range(3):
        grads = [torch.sin(3 * p.detach().float() + t).to(p.dtype) for p in params]
        for g, group in zip(grads, opt.param_groups):
            group["params"][0].grad = g.clone()
        opt.step()
        gpa_adamw(
            params, grads, [s["z"] for s in states], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], [s["step"] for s in states], [s.get("y_fp32") for s in states],
            [s.get("y_lo") for s in states], [s.get("z_lo") for s in states], foreach=kwargs.get("foreach"),
            fused=kwargs.get("fused"), lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, mu_x=0.9,
            mu_y=0.7,
        )  # fmt: skip
    for group, p, state in zip(opt.param_groups, params, states):
        q = group["params"][0]
        assert torch.equal(q, p)
        for key, value in opt.state[q].items():
            assert torch.equal(state[key], value), key


def test_a_pure_bf16_checkpoint_resumed_in_fp16_trains_on(tmp_path) -> None:
    """GPATrainer: a pure-bf16 run's checkpoint (compact state) resumed with the model in fp16 (a GPU without bf16,
    ``model.half()``) continues the run: its losses stay within fp16's rounding of the uninterrupted bf16 run's,
    where stepping the fp16 bits as bf16 ones took the loss from 4.1 to 17-21."""
    from helpers import RUN, TokenDataset, make_args, tiny_llama, train_losses

    from hf_gpa.trainer import GPATrainer

    def run(dtype: torch.dtype, resume: str | None = None) -> dict[int, tuple[float, float]]:
        trainer = GPATrainer(
            model=tiny_llama().to(dtype),
            args=make_args(tmp_path / "run", **RUN),
            train_dataset=TokenDataset(16, seed=1),
        )
        trainer.train(resume_from_checkpoint=resume)
        return train_losses(trainer)

    full = run(torch.bfloat16)
    resumed = run(torch.float16, resume=str(tmp_path / "run" / "checkpoint-3"))
    for step in (4, 5, 6):  # the resumed run's log history begins with the checkpoint's steps 1-3
        assert abs(resumed[step][0] - full[step][0]) < 0.02 * full[step][0], (step, resumed[step], full[step])


def _half_run(dtype: torch.dtype, state_dtype: str) -> tuple[list[torch.nn.Parameter], GPAAdamW]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in ((16, 8), (8,))]
    opt = GPAAdamW(params, lr=1e-2, weight_decay=0.1, mu_x=0.9, state_dtype=state_dtype)
    _steps(opt, params, 0, 3)
    return params, opt


def _y_z(opt: GPAAdamW, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y and z of a bf16/fp16 parameter's state exactly, in float32 (train mode)."""
    s = opt.state[p]
    if "y_lo" in s:
        return join24(p.detach(), s["y_lo"]), join24(s["z"], s["z_lo"])
    return s["y_fp32"].clone(), s["z"].clone()


@pytest.mark.parametrize("wide", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("value", [0.123456789, 1e5 + 0.1234])
@pytest.mark.parametrize(
    "dtype, state_dtype",
    [(torch.bfloat16, "float32"), (torch.float16, "float32"), (torch.bfloat16, "compact")],
    ids=["bf16-float32", "fp16-float32", "bf16-compact"],
)
def test_x_written_in_eval_mode_after_a_widening_cast_gives_y_exactly(
    dtype: torch.dtype, state_dtype: str, value: float, wide: torch.dtype
) -> None:
    """eval(), the model cast to fp32/fp64, x written in part of a weight, train(): y = mu_y x + (1 - mu_y) z there,
    computed in the new dtype from the written x (it went through fp16: 6e-4 off, NaN for |x| = 1e5), and y exactly
    as it was elsewhere."""
    params, opt = _half_run(dtype, state_dtype)
    exact = [_y_z(opt, p) for p in params]
    opt.eval()
    for p in params:
        p.data = p.data.to(wide)
    with torch.no_grad():
        params[0][:3].fill_(value)
    opt.train()
    y0, z0 = exact[0]
    expected = torch.lerp(z0[:3].to(wide), torch.full_like(z0[:3], value, dtype=wide), 0.7)
    assert torch.equal(params[0][:3], expected)
    assert torch.equal(params[0][3:], y0[3:].to(wide))
    assert torch.equal(params[1], exact[1][0].to(wide))


@pytest.mark.parametrize("target", [torch.float16, torch.float32], ids=str)
def test_a_weight_written_after_a_cast_of_a_compact_state_is_kept(target: torch.dtype) -> None:
    """bf16 parameters with the compact state, the model cast (``model.half()``, ``model.float()``), a weight written
    with values bf16 cannot hold, eval(), train(): the weight is back as written (an eighth of it came back through
    bf16 with the stale low word, up to 7.8e-3 off), the other weight holds y exactly (24 bits, rounded to fp16)."""
    params, opt = _half_run(torch.bfloat16, "compact")
    y_other = _y_z(opt, params[1])[0]
    for p in params:
        p.data = p.data.to(target)
    written = torch.randn(params[0].shape, generator=torch.Generator().manual_seed(5)).to(target)
    with torch.no_grad():
        params[0].copy_(written)
    opt.eval()
    opt.train()
    assert torch.equal(params[0].detach(), written)
    assert torch.equal(params[1].detach(), y_other.to(target))
    if target == torch.float16:
        assert torch.equal(opt.state[params[1]]["y_fp32"], y_other)
