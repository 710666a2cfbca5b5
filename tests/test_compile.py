"""``torch.compile(optimizer.step)`` works for every hf_gpa optimizer and steps exactly like the eager step.

Dynamo treats a method named ``_init_group`` as torch's own (it runs it eagerly and expects torch's signature:
lists filled in place, a bool returned); GPAAdamW has none (its step runs a cached plan). The compiled step runs
with the ``eager`` backend (dynamo's tracing, no code generation), which is where the crash was, and keeps the test
cheap.
"""

from __future__ import annotations

import pytest
import torch
from tensors import random_params

from hf_gpa import GPA, DiLoCo, GPAAdamW, ReferenceGPA
from hf_gpa.optim.kernels import cpu as _kernels

FACTORIES = {
    "gpa_adamw": lambda ps: GPAAdamW(ps, lr=1e-2, weight_decay=0.1, mu_x=0.9),
    "gpa_adamw_foreach": lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, foreach=True),
    "gpa_adamw_forloop": lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, foreach=False),
    "gpa(adamw)": lambda ps: GPA(ps, lr=1e-2, weight_decay=0.1, mu_x=0.9),
    "gpa(sgd)": lambda ps: GPA(ps, base=torch.optim.SGD, lr=1e-2, momentum=0.9, mu_x=0.9),
    "diloco(adamw)": lambda ps: DiLoCo(ps, inner_steps=2, lr=1e-2),
    "reference": lambda ps: ReferenceGPA(ps, lr=1e-2, mu_x=0.9),
}
SHAPES = ((4, 3), (5,))


def _run(name: str, compiled: bool) -> list[torch.Tensor]:
    params = random_params(SHAPES)
    opt = FACTORIES[name](params)
    step = torch.compile(opt.step, backend="eager") if compiled else opt.step
    for t in range(3):
        for p in params:
            p.grad = torch.sin(3 * p.detach() + t)
        step()
    return [p.detach().clone() for p in params]


#: The wrappers (GPA, DiLoCo) build their base optimizer lazily inside ``step()``; dynamo before torch 2.13 refuses
#: that attribute write ("Attempted setattr on a user-defined object ...", seen with torch 2.10 and 2.11). Strict: a
#: torch that compiles them fails this mark, so the note in docs/install.md is dropped with it.
WRAPPERS_NEED_2_13 = pytest.mark.xfail(
    torch.torch_version.TorchVersion(torch.__version__) < "2.13",
    reason="torch.compile of the GPA/DiLoCo wrapper step needs torch >= 2.13",
    strict=True,
)


@pytest.mark.parametrize("name", [pytest.param(n, marks=WRAPPERS_NEED_2_13) if "(" in n else n for n in FACTORIES])
def test_compiled_step_equals_the_eager_step(name: str) -> None:
    """torch.compile(opt.step) runs and gives the eager step's parameters."""
    torch._dynamo.reset()
    try:
        compiled = _run(name, compiled=True)
    finally:
        torch._dynamo.reset()
    eager = _run(name, compiled=False)
    for c, e in zip(compiled, eager):
        # Under dynamo torch's AdamW (the wrappers' base) takes its traceable branch, which rounds differently.
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "dtype"),
    [({"foreach": False}, torch.float32), ({"foreach": False}, torch.bfloat16), ({"fused": True}, torch.float32),
     ({"foreach": True}, torch.float32)],
    ids=["forloop", "forloop_bf16_compact", "fused", "foreach"],
)  # fmt: skip
def test_inductor_compiled_step_equals_the_eager_step(kwargs: dict, dtype: torch.dtype) -> None:
    """torch.compile with its default backend (inductor): the for-loop and the fused kernel step bitwise as eagerly
    (the for-loop drifted by 1e-3 in 3 steps: dynamo made its step count a symbolic float); foreach, whose ops inductor
    fuses and rounds its own way, within a float32 rounding per step."""
    if "fused" in kwargs and _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")

    def run(compiled: bool) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in ((4, 3), (5,))]
        opt = GPAAdamW(params, lr=1e-2, weight_decay=0.1, mu_x=0.9, **kwargs)
        step = torch.compile(opt.step) if compiled else opt.step
        for t in range(4):
            for p in params:
                p.grad = torch.sin(3 * p.detach().float() + t).to(dtype)
            step()
        return [p.detach().clone() for p in params] + [opt.state[p]["z"].clone() for p in params]

    torch._dynamo.reset()
    try:
        compiled = run(compiled=True)
    finally:
        torch._dynamo.reset()
    for c, e in zip(compiled, run(compiled=False)):
        if kwargs.get("foreach"):
            torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(c, e)
