"""Every implementation of GPA-AdamW's step (for-loop, foreach, C++ kernel, Triton kernel through Triton's
interpreter) against the for-loop ground truth, in float32, float64, bfloat16 and float16, so the copies of the
update cannot drift apart; and the GPA wrapper's two passes on each path against their closed form. The Triton
kernels run on CPU tensors through Triton's interpreter (the optimizers' private switch sends CPU tensors there)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from tensors import random_params

from hf_gpa import GPAAdamW
from hf_gpa.optim import _wrapper_passes as _passes
from hf_gpa.optim import kernels
from hf_gpa.optim._state_layout import join24
from hf_gpa.optim.kernels import cpu as _kernels
from hf_gpa.optim.kernels import triton_launch as _triton

SIZES = [(0,), (1,), (7,), (1023,), (4097,), (33, 65)]  # 4097 and 33 x 65 span several Triton blocks
IMPLS = ["forloop", "foreach", "cpu_kernel", "triton"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _impl_kwargs(impl: str) -> dict:
    kwargs = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "triton_default": {}}
    return kwargs.get(impl, {"fused": True})


def _groups(params: list[torch.nn.Parameter], dtype: torch.dtype) -> list[dict]:
    """Groups with their own lr (float, 0-d and one-element 1-D tensors), weight decay, mu_x, mu_y, maximize and
    averaging."""
    lr_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return [
        {"params": params[:3], "weight_decay": 0.1},
        {"params": params[3:4], "lr": torch.tensor(2e-2, dtype=lr_dtype), "mu_x": 0.8, "mu_y": 0.9, "maximize": True},
        {"params": params[4:5], "averaging": "schedule_free", "mu_y": 0.5, "weight_decay": 0.0},
        {"params": params[5:], "lr": torch.tensor([5e-3], dtype=lr_dtype), "mu_x": 0.0},
    ]


def _train(
    impl: str, dtype: torch.dtype, steps: int = 4, state_dtype: str = "float32"
) -> tuple[list[torch.Tensor], GPAAdamW]:
    params = random_params(SIZES, dtype, draw_dtype=torch.float64)
    kwargs = _impl_kwargs(impl)
    opt = GPAAdamW(_groups(params, dtype), lr=1e-2, mu_x=0.9, mu_y=0.7, state_dtype=state_dtype, **kwargs)
    with mock.patch.dict(kernels.FORCE, backend="triton" if impl.startswith("triton") else None):
        _steps(opt, params, dtype, steps)
    return params, opt


def _steps(opt: GPAAdamW, params: list[torch.nn.Parameter], dtype: torch.dtype, steps: int) -> None:
    for t in range(steps):
        for i, p in enumerate(params):
            y = p.detach().double()
            p.grad = (torch.sin(3 * y + t) + 0.3 * y - 0.1 * i).to(dtype)
        for k, group in enumerate(opt.param_groups):
            lr = 1e-2 * (1 + k) * (0.5 + 0.5 * math.cos(math.pi * t / steps))
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr)  # a tensor lr is changed in place, as torch's schedulers do
            else:
                group["lr"] = lr
        opt.step()


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: relative error <= 1e-6; fp64: 1e-13; bf16/fp16 tensors: one unit in the last place of the dtype."""
    scale = expected.double().abs().max().item() if expected.numel() else 0.0
    if dtype in (torch.bfloat16, torch.float16):
        tol = torch.finfo(dtype).eps
        torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol * 1e-3)
    else:
        tol = 1e-13 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(actual.double(), expected.double(), rtol=0, atol=tol * max(scale, 1.0))


def _close_compact(opt: GPAAdamW, p: torch.Tensor, ref_opt: GPAAdamW, r: torch.Tensor, impl: str) -> None:
    """state_dtype="compact": foreach is the for-loop bitwise (the same torch ops, the same 24-bit rounding); the
    kernels' 24-bit y and z (high and low words joined) are within 2^-15 of their largest value, two units of the
    24-bit format (the C++ kernel's float32 arithmetic contracts to fused multiply-adds and multiplies by 1 / sqrt(bc2)
    where torch's ops round twice and divide: a value differs in its last bit now and then, and so may a bf16 m, v),
    m and v within one bf16 unit."""
    state, ref = opt.state[p], ref_opt.state[r]
    if impl == "foreach":
        assert torch.equal(p, r) and all(torch.equal(state[k], v) for k, v in ref.items()), "foreach != for-loop"
        return
    for hi, lo, ref_hi, ref_lo in ((p.detach(), state["y_lo"], r.detach(), ref["y_lo"]),
                                   (state["z"], state["z_lo"], ref["z"], ref["z_lo"])):  # fmt: skip
        expected = join24(ref_hi, ref_lo).double()
        scale = expected.abs().max().item() if expected.numel() else 0.0
        torch.testing.assert_close(join24(hi, lo).double(), expected, rtol=0, atol=2**-15 * max(scale, 1.0))
    for key in ("exp_avg", "exp_avg_sq"):
        assert state[key].dtype == torch.bfloat16
        _close(state[key], ref[key], torch.bfloat16)


@pytest.mark.parametrize("state_dtype", ["float32", "compact"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_every_implementation_matches_the_forloop(impl: str, dtype: torch.dtype, state_dtype: str) -> None:
    """Each path equals the for-loop: y, the state (z, m, v, y's float32 copy; the low words of "compact") and x
    after eval()."""
    if state_dtype == "compact" and dtype != torch.bfloat16:
        pytest.skip('state_dtype="compact" changes only bf16 parameters (see test_compact_state.py)')
    if impl == "cpu_kernel" and _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    if impl == "triton":
        if not _triton.triton_available():
            pytest.skip("triton is not installed")
        if dtype == torch.float64:
            pytest.skip("the Triton kernel takes fp32/bf16/fp16 parameters (fp64 goes to foreach)")
    ref, ref_opt = _train("forloop", dtype, state_dtype=state_dtype)
    params, opt = _train(impl, dtype, state_dtype=state_dtype)
    if impl in ("cpu_kernel", "triton"):  # the kernel itself ran, not the foreach fallback
        with mock.patch.dict(kernels.FORCE, backend="triton" if impl == "triton" else None):
            assert {kernels.kernel_for(p) for p in params} == {"cpu" if impl == "cpu_kernel" else "triton"}
        expected = "cpu" if impl == "cpu_kernel" else "triton"  # every tensor, "compact" state included
        assert {b.kind for plan in opt._plans.values() for b in plan.buckets} == {expected}
    for p, r in zip(params, ref):
        _close(p.detach(), r.detach(), dtype)
        if state_dtype == "compact":
            _close_compact(opt, p, ref_opt, r, impl)
            continue
        for key, value in ref_opt.state[r].items():
            if key != "step":
                _close(opt.state[p][key], value, torch.float32 if dtype != torch.float64 else dtype)
    if dtype in (torch.bfloat16, torch.float16):
        assert all(("y_lo" if state_dtype == "compact" else "y_fp32") in opt.state[p] for p in params)
    ref_opt.eval()
    opt.eval()
    for p, r in zip(params, ref):
        _close(p.detach(), r.detach(), dtype)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float64 (complex128 for complex tensors) copy, as pairs of reals for the comparison."""
    return torch.view_as_real(t.to(torch.complex128)) if t.is_complex() else t.to(torch.float64)


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (float64 pairs of reals) rounded to ``dtype`` (complex64: float32 pairs), back in float64."""
    return t.to(torch.float32 if dtype == torch.complex64 else dtype).to(torch.float64)


@pytest.mark.parametrize(
    ("dtype", "with_y32"),
    [(dtype, False) for dtype in (*DTYPES, torch.complex64)] + [(torch.bfloat16, True), (torch.float16, True)],
    ids=lambda v: str(v) if isinstance(v, torch.dtype) else ("y_fp32" if v else "y"),
)
@pytest.mark.parametrize("impl", ["foreach", "cpu_kernel", "triton"])
def test_wrapper_passes_match_their_closed_form(
    impl: str, dtype: torch.dtype, with_y32: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPA's two passes on every path equal y <- scale (y - alpha z), then y <- y + c z', computed in float64;
    with y's float32 copy, the copy carries y, the first pass leaves the parameter alone, and a parameter written
    by something else is taken instead of its stale copy."""
    half = dtype in (torch.bfloat16, torch.float16)
    if impl == "cpu_kernel" and _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    if impl == "triton" and (not _triton.triton_available() or dtype == torch.float64):
        pytest.skip("triton is not installed, or fp64 (not taken by the Triton kernel)")
    monkeypatch.setitem(kernels.FORCE, "backend", {"foreach": "foreach", "triton": "triton"}.get(impl))
    gen = torch.Generator().manual_seed(1)
    state_dtype = torch.float32 if half else dtype

    def rand(dt: torch.dtype) -> list[torch.Tensor]:
        return [torch.randn(s, generator=gen, dtype=torch.float64).to(dt) for s in SIZES]

    ys, zs, new_zs = rand(dtype), rand(state_dtype), rand(state_dtype)
    y32s = None
    if with_y32:  # each parameter holds its copy rounded, except the last one, which something else wrote
        y32s = [y.float() + 1e-3 * torch.randn(y.shape, generator=gen) for y in ys]
        for y, y32 in zip(ys[:-1], y32s[:-1]):
            y.copy_(y32)
        y32s[-1] = ys[-1].float() + 0.25 + 0.5 * ys[-1].float().abs()  # stale: never equal to the parameter
    starts = [_wide(y32s[i] if with_y32 and i < len(ys) - 1 else y) for i, y in enumerate(ys)]
    # The oracle rounds where the passes store: the intermediate y (or its copy) and the result.
    mid_dtype = torch.float32 if with_y32 else dtype
    mids = [_round(0.97 * (start - 0.3 * _wide(z)), mid_dtype) for start, z in zip(starts, zs)]
    expected = [_round(mid + 0.4 * _wide(z_new), mid_dtype) for mid, z_new in zip(mids, new_zs)]
    params_before, zs_before = [y.clone() for y in ys], [z.clone() for z in zs]
    _passes.pass_before_base_(ys, zs, 0.3, 0.97, y32s)
    if with_y32:
        assert all(torch.equal(y, before) for y, before in zip(ys, params_before))
    for z, z_new in zip(zs, new_zs):
        z.copy_(z_new)  # the base optimizer's step
    _passes.pass_after_base_(ys, zs, 0.4, y32s)
    for i, y in enumerate(ys):
        actual = _wide(y32s[i] if with_y32 else y)
        # Each stored value is rounded once more than in float64 (and the ops round, or fuse into an FMA): allow
        # a few units in the last place of the operands, elementwise.
        finfo = torch.finfo(torch.float32 if mid_dtype == torch.complex64 else mid_dtype)
        operands = starts[i].abs() + 0.3 * _wide(zs_before[i]).abs() + mids[i].abs() + 0.4 * _wide(zs[i]).abs()
        bound = 4 * finfo.eps * operands + finfo.tiny
        excess = ((actual - expected[i]).abs() / bound).max().item() if actual.numel() else 0.0
        assert excess <= 1.0, (i, excess)
        if with_y32:
            assert torch.equal(y, y32s[i].to(dtype))


def test_without_triton_the_triton_buckets_take_foreach(monkeypatch: pytest.MonkeyPatch) -> None:
    """triton is optional: where it cannot be imported, what would go to the Triton kernel takes the foreach path
    (bitwise the foreach result), for GPAAdamW's default step and for the wrapper's passes; fused=True raises, as
    torch's optimizers do where no fused kernel applies."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    _triton.triton_available.cache_clear()
    try:
        assert not _triton.triton_available()
        with pytest.raises(RuntimeError, match="fused=True"):
            _train("triton", torch.float32)
        params, opt = _train("triton_default", torch.float32)
        ref, _ = _train("foreach", torch.float32)
        assert all(torch.equal(p, r) for p, r in zip(params, ref))
        monkeypatch.setitem(kernels.FORCE, "backend", "triton")
        ys, zs = [torch.ones(5)], [torch.full((5,), 2.0)]
        _passes.pass_before_base_(ys, zs, 0.5, 2.0)
        assert torch.equal(ys[0], torch.zeros(5))
    finally:
        _triton.triton_available.cache_clear()


@pytest.mark.parametrize(
    ("state_dtype", "fused", "kind"),
    [("compact", None, "foreach"), ("compact", True, "triton"), ("float32", None, "triton")],
)
def test_compact_state_takes_the_triton_kernel_only_when_fused_asks(state_dtype: str, fused: bool | None, kind: str):
    """bf16 parameters with compact state go to foreach under fused=None where the kernel would be Triton's (on an
    H200 its compiled compact kernel ended 8 ulps from the for-loop, see StateLayout.triton_by_default); fused=True
    still takes it, and float32 state keeps the Triton kernel by default. The C++ kernel on CPU is not affected."""
    if not _triton.triton_available():
        pytest.skip("triton is not installed")
    p = torch.nn.Parameter(torch.randn(4097, dtype=torch.bfloat16))
    opt = GPAAdamW([p], lr=1e-2, state_dtype=state_dtype, fused=fused)
    p.grad = torch.randn_like(p)
    with mock.patch.dict(kernels.FORCE, backend="triton"):
        opt.step()
    assert [b.kind for plan in opt._plans.values() for b in plan.buckets] == [kind]
    if state_dtype == "compact" and fused is None and _kernels.load_cpu_kernel() is not None:
        q = torch.nn.Parameter(torch.randn(7, dtype=torch.bfloat16))
        cpu_opt = GPAAdamW([q], lr=1e-2)
        q.grad = torch.randn_like(q)
        cpu_opt.step()
        assert [b.kind for plan in cpu_opt._plans.values() for b in plan.buckets] == ["cpu"]


def test_kernels_compile_for_cuda_without_a_gpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter accepts code the compiler may not: the Triton kernels also compile for an H100 (sm_90) down
    to a cubin, and full aligned blocks use 16-byte vector loads and stores."""
    if not _triton.triton_available():
        pytest.skip("triton is not installed")
    import triton
    import triton.language as tl

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build has no ptxas")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_gpa.optim.kernels import triton_source as _triton_kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    step_types = ["*i64"] * 7 + ["*i32", "*i64", "*fp32"] + ["fp32"] * 8  # tables, maps, lr pointer, scalars
    pass_types = ["*i64"] * 4 + ["*i32", "*i64", "fp32", "fp32"]
    compact_types = ["*i64"] * 8 + ["*i32", "*i64", "*fp32"] + ["fp32"] * 8  # two more tables: the low words
    cases = [
        (_triton_kernels.gpa_adamw_compact_kernel, compact_types, dict(LR_ON_DEVICE=True, MAXIMIZE=False,
         MASKED=False, ALIGNED=True, BLOCK=_triton.BLOCK)),
        (_triton_kernels.gpa_adamw_compact_kernel, compact_types, dict(LR_ON_DEVICE=False, MAXIMIZE=True,
         MASKED=True, ALIGNED=False, BLOCK=_triton.BLOCK)),
        (_triton_kernels.gpa_adamw_kernel, step_types, dict(PARAM=tl.bfloat16, GRAD=tl.bfloat16, HAS_Y32=True,
         LR_ON_DEVICE=True, MAXIMIZE=False, MASKED=False, ALIGNED=True, BLOCK=_triton.BLOCK)),
        (_triton_kernels.gpa_adamw_kernel, step_types, dict(PARAM=tl.float32, GRAD=tl.float32, HAS_Y32=False,
         LR_ON_DEVICE=False, MAXIMIZE=True, MASKED=True, ALIGNED=False, BLOCK=_triton.BLOCK)),
        (_triton_kernels.wrapper_pass_kernel, pass_types, dict(PARAM=tl.float16, HAS_Y32=True, BEFORE=True,
         MASKED=False, ALIGNED=True, BLOCK=_triton.BLOCK)),
        (_triton_kernels.wrapper_pass_kernel, pass_types, dict(PARAM=tl.float32, HAS_Y32=False, BEFORE=False,
         MASKED=True, ALIGNED=True, BLOCK=_triton.BLOCK)),
    ]  # fmt: skip
    for fn, types, constexprs in cases:
        signature = dict(zip(fn.arg_names, types + ["constexpr"] * len(constexprs)))
        compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"]
        if not constexprs["MASKED"]:
            assert "ld.global.v4" in compiled.asm["ptx"] and "st.global.v4" in compiled.asm["ptx"]
