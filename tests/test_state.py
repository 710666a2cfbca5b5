"""State that did not come from this very optimizer's steps: ``init_state`` (no step taken), older pickles and
state dicts (torch's conventions: group defaults filled in, a Python-float ``step``), and state dicts without the
optimizer's name, which are told apart by their keys."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch

from hf_gpa import GPA, DiLoCo, GPAAdamW


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in ((4, 3), (5,))]


def _steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], start: int, stop: int) -> None:
    for t in range(start, stop):
        for i, p in enumerate(params):
            p.grad = torch.sin(3 * p.detach() + t) + 0.1 * i
        opt.step()


def test_init_state_takes_no_step() -> None:
    """GPAAdamW.init_state() creates z, m, v and the step count at 0 without stepping: the parameters are bitwise
    unchanged and the next steps equal a fresh optimizer's."""
    params, fresh_params = _params(), _params()
    opt = GPAAdamW(params, lr=1e-2, weight_decay=0.1, mu_x=0.9)
    opt.init_state()
    assert all(torch.equal(p, q) for p, q in zip(params, fresh_params))
    assert all(opt.state[p]["step"].item() == 0.0 for p in params)
    fresh = GPAAdamW(fresh_params, lr=1e-2, weight_decay=0.1, mu_x=0.9)
    _steps(opt, params, 0, 3)
    _steps(fresh, fresh_params, 0, 3)
    assert all(torch.equal(p, q) for p, q in zip(params, fresh_params))


def test_old_pickles_get_the_group_defaults() -> None:
    """Groups pickled before maximize/foreach/fused/averaging existed are filled in by __setstate__, as torch's
    optimizers do, and the copy steps like the original."""
    params = _params()
    opt = GPAAdamW(params, lr=1e-2, mu_x=0.9)
    _steps(opt, params, 0, 2)
    state = copy.deepcopy(opt.__getstate__())
    for group in state["param_groups"]:
        for key in ("maximize", "foreach", "fused", "averaging", "weight_sum"):
            del group[key]
    old = GPAAdamW.__new__(GPAAdamW)
    old.__setstate__(state)
    group = old.param_groups[0]
    assert (group["maximize"], group["foreach"], group["fused"], group["averaging"]) == (False, None, None, "gpa")
    restored = pickle.loads(pickle.dumps(old))
    copied_params = [p for g in restored.param_groups for p in g["params"]]
    _steps(restored, copied_params, 2, 4)
    _steps(opt, params, 2, 4)
    assert all(torch.equal(p, q) for p, q in zip(params, copied_params))


def _float_steps(state_dict: dict) -> dict:
    """The state dict as torch < 1.12 wrote it: every ``step`` a Python float (also in a wrapper's base state)."""
    state_dict = copy.deepcopy(state_dict)
    for s in state_dict["state"].values():
        for inner in (s, s.get("base", {})):
            if "step" in inner:
                inner["step"] = float(inner["step"])
    return state_dict


FACTORIES = {
    "gpa_adamw": lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9),
    "gpa_adamw_forloop": lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, foreach=False),
    "gpa(adamw)": lambda ps: GPA(ps, lr=1e-2, mu_x=0.9),
    "diloco(adamw)": lambda ps: DiLoCo(ps, inner_steps=2, lr=1e-2),
}


def _assert_resumes_bitwise(name: str, as_saved_then: Callable[[dict], dict]) -> None:
    """Three steps, the state dict rewritten by ``as_saved_then`` and loaded by a new optimizer: its next two steps
    equal the original run's."""
    params = _params()
    opt = FACTORIES[name](params)
    _steps(opt, params, 0, 3)
    saved, saved_params = as_saved_then(opt.state_dict()), [p.detach().clone() for p in params]
    _steps(opt, params, 3, 5)
    resumed_params = [torch.nn.Parameter(p) for p in saved_params]
    resumed = FACTORIES[name](resumed_params)
    resumed.load_state_dict(saved)
    _steps(resumed, resumed_params, 3, 5)
    assert all(torch.equal(p, q) for p, q in zip(params, resumed_params))


@pytest.mark.parametrize("name", list(FACTORIES))
def test_a_python_float_step_loads_and_steps(name: str) -> None:
    """A state dict whose step counts are Python floats loads, and the next steps equal the original run's."""
    _assert_resumes_bitwise(name, _float_steps)


def _nameless(state_dict: dict) -> dict:
    """The state dict as saved before hf_gpa recorded the optimizer's name in its groups."""
    state_dict = copy.deepcopy(state_dict)
    for group in state_dict["param_groups"]:
        del group["optimizer"]
    return state_dict


@pytest.mark.parametrize(
    ("saver", "loader"),
    [
        ("gpa_adamw", "gpa(sgd)"),
        ("gpa_adamw", "gpa(adamw)"),
        ("gpa(adamw)", "gpa_adamw"),
        ("gpa(sgd)", "gpa_adamw"),
    ],
)
def test_nameless_state_of_another_family_is_refused_by_its_keys(saver: str, loader: str) -> None:
    """An old state dict (no optimizer name) of GPAAdamW is not loaded into GPA(SGD) and the reverse: the keys of
    its per-parameter state tell the families apart, and nothing changes before the ValueError."""
    factories = {**FACTORIES, "gpa(sgd)": lambda ps: GPA(ps, base=torch.optim.SGD, lr=1e-2, momentum=0.9, mu_x=0.9)}
    params = _params()
    opt = factories[saver](params)
    _steps(opt, params, 0, 2)
    target_params = _params(1)
    target = factories[loader](target_params)
    _steps(target, target_params, 0, 1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match="saved by"):
        target.load_state_dict(_nameless(opt.state_dict()))
    after = target.state_dict()
    assert all(torch.equal(before["state"][i]["z"], s["z"]) for i, s in after["state"].items())


@pytest.mark.parametrize("name", ["gpa_adamw", "gpa(adamw)", "diloco(adamw)"])
def test_nameless_state_of_the_same_family_still_loads(name: str) -> None:
    """An old state dict of the same family loads and continues bitwise."""
    _assert_resumes_bitwise(name, _nameless)
