"""How hf_gpa.optim reads: one update in a few files, one base module for the optimizers' shared contract."""

from __future__ import annotations

import pytest
import torch

from benchmarks.files_touched import files_touched
from hf_gpa.optim import GPA, DiLoCo, GPAAdamW, GPADiLoCo, MuonWithAuxAdam, ReferenceGPA
from hf_gpa.optim.kernels.cpu import load_cpu_kernel


@pytest.fixture(scope="module")
def touched() -> dict:
    if load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here: the step takes the foreach path, not counted here")
    return files_touched()


def test_step_runs_python_in_at_most_4_files(touched: dict) -> None:
    """GPAAdamW.step() on CPU (fp32 and bf16 parameters, the Trainer's 2 groups) runs Python in <= 4 optim files."""
    assert len(touched["step"]) <= 4, touched["step"]


def test_step_eval_and_train_run_python_in_at_most_6_files(touched: dict) -> None:
    """step(), eval() and train() together run Python in at most 6 files of hf_gpa/optim."""
    assert len(touched["union"]) <= 6, touched["union"]


@pytest.mark.parametrize("cls", [GPAAdamW, GPA, DiLoCo, MuonWithAuxAdam, ReferenceGPA], ids=lambda c: c.__name__)
def test_the_shared_contract_is_one_module(cls: type) -> None:
    """Every base class between an optimizer and torch.optim.Optimizer that is not its own family's lives in
    hf_gpa.optim._base (group checks, train/eval modes, loading)."""
    own = {
        "GPAAdamW": {"gpa_adamw", "_gpa_switch"},
        "GPA": {"gpa", "_gpa_switch", "_wrapper"},
        "DiLoCo": {"diloco.diloco", "diloco.outer", "_wrapper"},
        "MuonWithAuxAdam": {"muon"},
        "ReferenceGPA": {"reference"},
    }[cls.__name__]
    chain = cls.__mro__[: cls.__mro__.index(torch.optim.Optimizer)]
    assert {c.__module__ for c in chain} - {f"hf_gpa.optim.{m}" for m in own} == {"hf_gpa.optim._base"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cls", [GPA, DiLoCo, GPADiLoCo], ids=lambda c: c.__name__)
def test_the_wrappers_state_is_the_state_layouts(cls: type, dtype: torch.dtype) -> None:
    """GPA's, DiLoCo's and GPADiLoCo's own state after a first step has the keys and dtypes _state_layout creates."""
    from hf_gpa.optim._state_layout import diloco_state, gpa_diloco_state, gpa_y_fp32, gpa_z

    p = torch.nn.Parameter(torch.randn(4, 3).to(dtype))
    p.grad = torch.ones_like(p)
    opt = cls([p], lr=0.1)
    opt.step()
    if cls is GPA:
        y32 = gpa_y_fp32(p)
        expected = {"z": gpa_z(p), **({} if y32 is None else {"y_fp32": y32})}
    else:
        expected = (gpa_diloco_state if cls is GPADiLoCo else diloco_state)(p)
    own = {k: v for k, v in opt.state[p].items() if k != "base"}
    assert {k: (v.dtype, v.shape) for k, v in own.items()} == {k: (v.dtype, v.shape) for k, v in expected.items()}
