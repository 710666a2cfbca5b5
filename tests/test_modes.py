"""train()/eval() switching and state_dict round trips: exact to the bit for every optimizer and dtype."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from tensors import random_params

from hf_gpa import GPA, DiLoCo, GPAAdamW
from hf_gpa.optim._gpa_switch import decode_residual, decode_residual_, encode_residual
from hf_gpa.optim._state_layout import join24
from hf_gpa.optim._tensors import bits_differ, bits_equal

FACTORIES = {
    "gpa_adamw": lambda ps: GPAAdamW(ps, lr=1e-2, weight_decay=0.1, mu_x=0.99, mu_y=0.7),
    "gpa_adamw_sf": lambda ps: GPAAdamW(ps, lr=1e-2, averaging="schedule_free", mu_y=0.9),
    "gpa_adamw_foreach": lambda ps: GPAAdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "gpa_sgd": lambda ps: GPA(ps, base=torch.optim.SGD, lr=1e-2, momentum=0.9, mu_x=0.99, mu_y=0.8),
    "diloco": lambda ps: DiLoCo(ps, base=torch.optim.AdamW, inner_steps=4, lr=1e-2, weight_decay=0.1),
}
SHAPES = ((64, 33), (33,), (5, 7))


def _steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], start: int, stop: int) -> None:
    for t in range(start, stop):
        for p in params:
            y = p.detach().float()
            p.grad = (torch.cos(2 * y + t) + 0.2 * y).to(p.dtype)
        opt.step()


def _stepped(
    make, steps: int, dtype: torch.dtype = torch.float32
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Fresh parameters (`random_params` of `SHAPES`) and the optimizer ``make(params)`` (a `FACTORIES` or `WRITERS`
    entry) after ``steps`` steps (`_steps`)."""
    params = random_params(SHAPES, dtype, draw_dtype=torch.float32)
    opt = make(params)
    _steps(opt, params, 0, steps)
    return params, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", list(FACTORIES))
def test_thousand_toggles_restore_y_bitwise(name: str, dtype: torch.dtype) -> None:
    """1000 eval()/train() alternations leave the training weights torch.equal to what they were."""
    params, opt = _stepped(FACTORIES[name], 7, dtype)
    before = [p.detach().clone() for p in params]
    opt.eval()
    x = [p.detach().clone() for p in params]
    assert any(not torch.equal(a, b) for a, b in zip(x, before)), "eval() must change the weights"
    for _ in range(1000):
        opt.train()
        opt.eval()
        assert all(torch.equal(p, a) for p, a in zip(params, x))
    opt.train()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_residual_is_compact() -> None:
    """While in eval mode GPA keeps an int8 residual per parameter (a quarter of an fp32 copy), nothing in train."""
    params, opt = _stepped(FACTORIES["gpa_adamw"], 5)
    opt.eval()
    assert all(opt.state[p]["y_residual"].dtype == torch.int8 for p in params)
    opt.train()
    assert all("y_residual" not in opt.state[p] and "y_residual_overflow" not in opt.state[p] for p in params)


def _with_tiny_y(dtype: torch.dtype = torch.float32) -> tuple[list[torch.nn.Parameter], GPAAdamW]:
    """A run where a few y are tiny against z: the round trip's error there is far more than 127 units of y."""
    params, opt = _stepped(FACTORIES["gpa_adamw"], 5, dtype)
    with torch.no_grad():
        params[0][0, :4] = torch.tensor([1e-6, -3e-7, 2e-8, 0.0])
        opt.state[params[0]]["z"][0, :4] = torch.tensor([1.0, -2.0, 3.0, 0.5])
    return params, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)  # bf16/fp16: y_fp32, no residual
def test_residual_stays_one_byte_per_weight_when_a_few_elements_overflow(dtype: torch.dtype) -> None:
    """Elements whose difference needs more than int8 go to a sparse list; the rest stays int8; train() is bitwise."""
    params, opt = _with_tiny_y(dtype)
    y = [p.detach().clone() for p in params]
    opt.eval()
    residual, overflow = opt.state[params[0]]["y_residual"], opt.state[params[0]]["y_residual_overflow"]
    assert residual.dtype == torch.int8 and residual.shape == params[0].shape
    assert 1 <= len(overflow) <= 4 and set(overflow[:, 0].tolist()) <= {0, 1, 2, 3}
    opt.train()
    assert all(torch.equal(p, b) for p, b in zip(params, y))


def test_dropped_overflow_list_falls_back_to_rounded_y_there() -> None:
    """An eval-mode state loaded without the overflow list: y bitwise except the listed elements, which are close."""
    params, opt = _with_tiny_y()
    y = [p.detach().clone() for p in params]
    opt.eval()
    state = copy.deepcopy(opt.state_dict())
    for s in state["state"].values():
        del s["y_residual_overflow"]
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = FACTORIES["gpa_adamw"](fresh_params)
    fresh.load_state_dict(state)
    fresh.train()
    assert torch.equal(fresh_params[0][1:], y[0][1:]) and torch.equal(fresh_params[0][0, 4:], y[0][0, 4:])
    torch.testing.assert_close(fresh_params[0][0, :4], y[0][0, :4], rtol=0, atol=3 * 2**-23)
    assert all(torch.equal(p, b) for p, b in zip(fresh_params[1:], y[1:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_residual_round_trip_for_arbitrary_values(dtype: torch.dtype) -> None:
    """encode/decode restore any target exactly, also across sign changes, zeros and huge gaps (wrap-around)."""
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(4096, generator=gen, dtype=torch.float64).to(dtype)
    target[:8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e4, -3e4, 1.0, -1.0], dtype=torch.float64).to(dtype)
    for approx in (target.flip(0), -target, target * 1.0001, torch.zeros_like(target)):
        for narrow in (True, False):
            residual, overflow = encode_residual(target, approx, narrow=narrow)
            assert residual.dtype == torch.int8 or not narrow
            restored = decode_residual(approx, residual, overflow)
            assert torch.equal(restored.view(torch.uint8), target.view(torch.uint8))
    # not contiguous: the overflow's indices are into the flattened (logical) order
    target2, approx2 = target.view(64, 64).t(), (target * 1.0001).view(64, 64).t()
    assert torch.equal(decode_residual(approx2, *encode_residual(target2, approx2)), target2)
    # in place (what train() uses): the same bits, written into the approximation itself, also not contiguous
    for tgt, apx in ((target, target * 1.0001), (target2, approx2)):
        inplace = apx.clone()
        assert decode_residual_(inplace, *encode_residual(tgt, apx)) is inplace
        assert torch.equal(inplace.contiguous().view(torch.uint8), tgt.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bits_equal_is_bits_differ_nowhere(dtype: torch.dtype) -> None:
    """bits_equal (int64 pairs for float32) says what bits_differ(...).any() says: NaN and -0 by their bits."""
    base = torch.tensor([0.0, -0.0, float("nan"), 1.0, -2.5, float("inf"), 3.0], dtype=dtype)
    for a in (base, base[1:], base[:6], base[1:].view(2, 3).t()):  # odd size, odd offset, not contiguous
        assert bits_equal(a, a.clone())
        for k, index in enumerate(itertools.product(*map(range, a.shape))):
            b = a.clone()
            b[index] = -b[index] if k % 2 else 7.0  # -0 vs 0 and -nan vs nan differ by a bit
            assert bits_equal(a, b) is not bool(bits_differ(a, b).any())


@pytest.mark.parametrize("name", list(FACTORIES))
def test_eval_and_train_are_idempotent_and_start_in_train(name: str) -> None:
    """A new optimizer is in train mode; repeated eval() or train() calls change nothing further."""
    params = random_params(SHAPES)
    opt = FACTORIES[name](params)
    assert opt.train_mode
    opt.eval()  # before any step: x = y, nothing to do
    assert all(torch.equal(p, q) for p, q in zip(params, random_params(SHAPES)))
    opt.train()
    _steps(opt, params, 0, 9)
    opt.eval()
    x = [p.detach().clone() for p in params]
    opt.eval()
    assert not opt.train_mode and all(torch.equal(p, a) for p, a in zip(params, x))
    opt.train()
    y = [p.detach().clone() for p in params]
    opt.train()
    assert opt.train_mode and all(torch.equal(p, a) for p, a in zip(params, y))


@pytest.mark.parametrize("name", list(FACTORIES))
def test_step_in_eval_mode_raises(name: str) -> None:
    """step() after eval() raises a RuntimeError that says to call .train()."""
    params, opt = _stepped(FACTORIES[name], 2)
    opt.eval()
    with pytest.raises(RuntimeError, match=r"optimizer\.train\(\)"):
        _steps(opt, params, 2, 3)


@pytest.mark.parametrize("eval_mode_save", [False, True])
@pytest.mark.parametrize("name", list(FACTORIES))
def test_state_dict_round_trip_continues_bitwise(name: str, eval_mode_save: bool) -> None:
    """Saving mid-run (in train or eval mode) and loading into a fresh model + optimizer continues bitwise."""
    ref_params = random_params(SHAPES)
    ref = FACTORIES[name](ref_params)
    _steps(ref, ref_params, 0, 14)

    params, opt = _stepped(FACTORIES[name], 6)
    if eval_mode_save:
        opt.eval()  # what a checkpoint writer does: the weights on disk are x
    saved_weights = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    del opt, params

    params = [torch.nn.Parameter(w.clone()) for w in saved_weights]
    opt = FACTORIES[name](params)
    opt.load_state_dict(saved_state)
    assert opt.train_mode is not eval_mode_save
    opt.train()
    _steps(opt, params, 6, 14)
    assert all(torch.equal(p, r) for p, r in zip(params, ref_params))


def test_dropped_residual_falls_back_to_rounded_y() -> None:
    """An eval-mode state loaded without its residual still restores y, to within a couple of ulps."""
    params, opt = _stepped(FACTORIES["gpa_adamw"], 5)
    y = [p.detach().clone() for p in params]
    opt.eval()
    state = copy.deepcopy(opt.state_dict())
    for s in state["state"].values():
        del s["y_residual"], s["y_residual_overflow"]
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = FACTORIES["gpa_adamw"](fresh_params)
    fresh.load_state_dict(state)
    fresh.train()
    for p, ref in zip(fresh_params, y):
        torch.testing.assert_close(p.detach(), ref, rtol=4e-7, atol=1e-7)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_init_state_gives_an_eval_mode_template(name: str) -> None:
    """init_state(eval_mode=True) creates every state key an eval-mode checkpoint has, and keeps lr and grads."""
    params, opt = _stepped(FACTORIES[name], 3)
    opt.eval()
    saved = opt.state_dict()
    fresh = FACTORIES[name](random_params(SHAPES))
    fresh.init_state(eval_mode=True)
    template = fresh.state_dict()
    assert not fresh.train_mode
    assert [g["lr"] for g in template["param_groups"]] == [g["lr"] for g in saved["param_groups"]]
    assert all(p.grad is None for g in fresh.param_groups for p in g["params"])
    assert {i: set(s) for i, s in template["state"].items()} == {i: set(s) for i, s in saved["state"].items()}


def test_init_state_after_an_early_eval_is_consistent() -> None:
    """eval() before any step, then init_state(eval_mode=True): the state really is in eval mode, with its residual."""
    params = random_params(SHAPES)
    opt = FACTORIES["gpa_adamw"](params)
    opt.eval()  # nothing to switch yet
    opt.init_state(eval_mode=True)
    assert not opt.train_mode
    assert all("y_residual" in opt.state[p] for p in params)


WRITERS = {
    "gpa_adamw_forloop": lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, mu_y=0.7, foreach=False),
    "gpa_adamw_foreach": lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, mu_y=0.7, foreach=True),
    "gpa_adamw_fused": lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, mu_y=0.7, fused=True),
    "gpa(adamw)": lambda ps: GPA(ps, base=torch.optim.AdamW, lr=1e-2, mu_x=0.9, mu_y=0.7),
    "gpa(sgd)": lambda ps: GPA(ps, base=torch.optim.SGD, lr=1e-2, momentum=0.9, mu_x=0.9, mu_y=0.7),
}


def _z(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    """z in float64 (joined with its low word under GPAAdamW's state_dtype="compact")."""
    state = opt.state[p]
    return (join24(state["z"], state["z_lo"]) if "z_lo" in state else state["z"]).double()


def _assert_rounded(actual: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> None:
    """``actual`` is ``exact`` rounded to its dtype, up to float32 roundings of terms of size ``scale``."""
    tol = 2 * torch.finfo(actual.dtype).eps * exact.abs() + 8 * torch.finfo(torch.float32).eps * scale
    assert bool(((actual.double() - exact).abs() <= tol).all()), (actual.double() - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(WRITERS))
def test_weights_written_in_train_mode_are_kept_by_eval_and_train(name: str, dtype: torch.dtype) -> None:
    """A write into y (a loaded/re-initialized/clipped weight): eval() gives x of the written y, train() that y."""
    params, opt = _stepped(WRITERS[name], 5, dtype)
    with torch.no_grad():
        params[0].clamp_(-0.5, 0.5)  # clipping
        params[1].normal_(generator=torch.Generator().manual_seed(9))  # re-initializing a head
        params[2].copy_(torch.full_like(params[2], 0.25))  # model.load_state_dict
    written = [p.detach().clone() for p in params]
    # y in float64: y's float32 copy (bf16/fp16) where the parameter still equals it rounded, else the parameter;
    # under state_dtype="compact" the written high word with y's low word (y rounds to the written value)
    y32s = [opt.state[p].get("y_fp32") for p in params]
    exact = [y.double() if y32 is None else torch.where(y32.to(dtype) == y, y32, y.float()).double()
             for y, y32 in zip(written, y32s)]  # fmt: skip
    exact = [join24(y, opt.state[p]["y_lo"]).double() if "y_lo" in opt.state[p] else e
             for p, y, e in zip(params, written, exact)]  # fmt: skip
    opt.eval()
    for p, y in zip(params, exact):
        z = _z(opt, p)
        _assert_rounded(p.detach(), (y - 0.3 * z) / 0.7, (y.abs() + z.abs()) / 0.7)
    opt.train()
    assert all(torch.equal(p, y) for p, y in zip(params, written))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["gpa_adamw_fused", "gpa(sgd)"])
def test_weights_written_in_eval_mode_are_kept_by_train(name: str, dtype: torch.dtype) -> None:
    """A write into x while in eval mode: train() gives y = mu_y x + (1 - mu_y) z there, the old y elsewhere."""
    params, opt = _stepped(WRITERS[name], 5, dtype)
    y_before = [p.detach().clone() for p in params]
    opt.eval()
    with torch.no_grad():
        params[0][:3].fill_(0.125)
    opt.train()
    z = _z(opt, params[0])[:3]
    _assert_rounded(params[0][:3].detach(), 0.7 * 0.125 + 0.3 * z, 0.125 + z.abs())
    assert torch.equal(params[0][3:], y_before[0][3:])
    assert all(torch.equal(p, b) for p, b in zip(params[1:], y_before[1:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(WRITERS))
@pytest.mark.parametrize("new_mu_y", [1.0, 0.3])
def test_mu_y_changed_in_eval_mode_applies_from_the_next_step(name: str, dtype: torch.dtype, new_mu_y: float) -> None:
    """mu_y changed while in eval mode (to 1.0 as well: x = y): train() still gives y back bitwise, with no residual
    left in the state, also through a state dict saved in eval mode; the next step uses the new mu_y. (train()
    inverted x with the new mu_y: y off, and at mu_y = 1 the residual stayed in the state.)"""
    params, opt = _stepped(WRITERS[name], 5, dtype)
    y = [p.detach().clone() for p in params]
    opt.eval()
    for group in opt.param_groups:
        group["mu_y"] = new_mu_y
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = WRITERS[name](twin_params)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # saved in eval mode, after the change
    for o, ps in ((opt, params), (twin, twin_params)):
        o.train()
        assert all(torch.equal(p, b) for p, b in zip(ps, y))
        assert not any(k.startswith("y_residual") for p in ps for k in o.state[p])
        assert all("eval_mu_y" not in g for g in o.param_groups)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = WRITERS[name](fresh_params)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))  # saved in train mode with the new mu_y
    for o, ps in ((opt, params), (fresh, fresh_params)):
        for p in ps:
            p.grad = torch.ones_like(p)
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(params, fresh_params))


SWITCHERS = {
    "gpa_adamw": lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, mu_y=0.3),
    "gpa(sgd)": lambda ps: GPA(ps, base=torch.optim.SGD, lr=1e-2, mu_x=0.9, mu_y=0.3),
}


def _with_state(name: str, y: list[float], z: list[float], dtype: torch.dtype) -> tuple:
    """An optimizer whose one parameter holds y and whose state holds z (``init_state``, then z written)."""
    p = torch.nn.Parameter(torch.tensor(y, dtype=torch.float64).to(dtype))
    opt = SWITCHERS[name]([p])
    opt.init_state()
    opt.state[p]["z"].copy_(torch.tensor(z, dtype=torch.float64))
    return opt, p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(SWITCHERS))
def test_x_written_in_eval_mode_wins_where_the_residual_overflowed(name: str, dtype: torch.dtype) -> None:
    """Writing x in eval mode where |y| << |z| (residuals int8 cannot hold): train() gives y = mu_y x + (1 - mu_y) z
    there, not the old x's residual added to it (which gave -4.10 instead of 1.75)."""
    z = [1.0, -2.0, 0.4, 5.0]
    opt, p = _with_state(name, [1e-6, -3e-7, 0.5, 2e-8], z, dtype)
    opt.eval()
    with torch.no_grad():
        p.fill_(1.0)
    opt.train()
    expected = 0.3 * 1.0 + 0.7 * torch.tensor(z, dtype=torch.float64)
    torch.testing.assert_close(p.detach().double(), expected, rtol=4 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(SWITCHERS))
def test_y_comes_back_where_x_is_nan(name: str, dtype: torch.dtype) -> None:
    """Where eval() wrote a NaN x (z NaN, or y = z = inf), train() gives y back bitwise: a NaN x eval() wrote is
    not a write."""
    inf, nan = float("inf"), float("nan")
    opt, p = _with_state(name, [5.0, inf, 0.25], [nan, inf, 0.5], dtype)
    y = p.detach().clone()
    opt.eval()
    assert bool(p.detach()[:2].isnan().all())
    opt.train()
    assert torch.equal(p.detach(), y), p.detach()


def test_x_of_mu_x_zero_is_z_exactly() -> None:
    """With y = z (mu_x = 0 after a step), eval() gives x = z bitwise: x is computed as z + (y - z) / mu_y."""
    z = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    opt, p = _with_state("gpa(sgd)", z.tolist(), z.tolist(), torch.float32)
    opt.eval()
    assert torch.equal(p.detach(), z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eval_and_train_switch_a_large_weight_in_chunks(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked and whole-tensor switching give the same x, residual and overflow list, and y back bitwise."""
    from hf_gpa.optim import _tensors

    def run(chunk: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
        monkeypatch.setattr(_tensors, "CHUNK", chunk)
        p = torch.nn.Parameter(torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype))
        opt = GPAAdamW([p], lr=1e-2, mu_x=0.9, mu_y=0.3, state_dtype="float32")  # "compact": test_compact_state
        for i in range(3):
            p.grad = torch.randn(1000, generator=torch.Generator().manual_seed(i + 1)).to(dtype)
            opt.step()
        with torch.no_grad():  # tiny y against z in several chunks: differences int8 cannot hold
            p[[3, 250, 251, 777, 999]] = torch.tensor([1e-6, -3e-7, 2e-8, 0.0, 5e-7], dtype=dtype)
            opt.state[p]["z"][[3, 250, 251, 777, 999]] = torch.tensor([1.0, -2.0, 3.0, 0.5, -1.5])
            if "y_fp32" in opt.state[p]:
                opt.state[p]["y_fp32"].copy_(p)
        y = p.detach().clone()
        opt.eval()
        x, state = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items() if k.startswith("y_residual")}
        opt.train()
        assert torch.equal(p, y)
        return x, state, y

    x_whole, state_whole, _ = run(1 << 20)
    x_chunked, state_chunked, _ = run(100)
    assert torch.equal(x_chunked, x_whole)
    assert state_chunked.keys() == state_whole.keys()
    assert all(torch.equal(state_chunked[k], state_whole[k]) for k in state_whole)
    if dtype == torch.float32:
        assert len(state_whole["y_residual_overflow"]) >= 3  # the list spans chunks


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_train_kernel_is_the_torch_ops_bitwise(dtype: torch.dtype, layout: str, monkeypatch) -> None:
    """train()'s C++ pass (fp32/fp64 on CPU) gives the torch ops' y bitwise: residual, overflow list across chunks,
    x written in eval mode (also to NaN, -0 and inf, also where the residual overflowed) and NaN x eval() wrote."""
    from hf_gpa.optim import _tensors
    from hf_gpa.optim.kernels import FORCE, kernel_for

    if kernel_for(torch.zeros(1)) != "cpu":
        pytest.skip("the C++ kernel is not available here")
    monkeypatch.setattr(_tensors, "CHUNK", 1000)  # several pieces, each with listed elements
    gen = torch.Generator().manual_seed(0)
    y0, z0 = torch.randn(2, 60, 50, generator=gen, dtype=torch.float64).to(dtype)
    y0.view(-1)[::97] *= 1e-7  # |y| << |z|: differences int8 cannot hold
    z0.view(-1)[5], y0.view(-1)[6], z0.view(-1)[6] = float("nan"), float("inf"), float("inf")  # x NaN from eval()
    written = {11: 1.0, 97: 2.5, 194: float("nan"), 300: -0.0, 2001: float("-inf"), 2999: 0.0}

    def run(backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setitem(FORCE, "backend", backend)
        t = y0.clone() if layout == "contiguous" else y0.clone().t().contiguous().t()
        p = torch.nn.Parameter(t)
        opt = SWITCHERS["gpa(sgd)"]([p])
        opt.init_state()
        opt.state[p]["z"].copy_(z0)
        opt.eval()
        assert len(opt.state[p]["y_residual_overflow"]) > 3
        memory = (p.detach() if layout == "contiguous" else p.detach().t()).view(-1)  # in memory order
        for i, value in written.items():
            memory[i] = value
        x = p.detach().clone()
        opt.train()
        return x, p.detach().clone()

    x_kernel, y_kernel = run(None)
    x_ops, y_ops = run("foreach")
    assert bits_equal(x_kernel, x_ops) and not bits_equal(x_kernel, y0)
    assert bits_equal(y_kernel, y_ops)
    assert bits_equal(y_kernel.reshape(-1)[:5], y0.reshape(-1)[:5])  # not written: y back bitwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eval_and_train_allocate_about_one_byte_per_weight(dtype: torch.dtype, peak_allocated) -> None:
    """Beyond the int8 residual eval() keeps, neither call allocates more than a few MB for a 4M-weight matrix."""
    p = torch.nn.Parameter(torch.randn(2048, 2048).to(dtype))
    opt = GPAAdamW([p], lr=1e-2, mu_x=0.9, mu_y=0.3, foreach=True)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    eval_peak = peak_allocated(opt.eval)
    train_peak = peak_allocated(opt.train)
    numel, budget = p.numel(), 40 << 20  # a whole-tensor switch allocates several copies: >= 48 MB here
    assert eval_peak <= (numel if dtype == torch.float32 else 0) + budget, eval_peak / numel
    assert train_peak <= budget, train_peak / numel
