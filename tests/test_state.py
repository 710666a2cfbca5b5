"""State that did not come from this very optimizer's steps: ``init_state`` (no step taken, for GPAAdamW and the
wrappers), state dicts loaded by a new optimizer, and state dicts without the optimizer's name (refused)."""

from __future__ import annotations

import copy

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


FACTORIES = {
    "gpa_adamw": lambda ps: GPAAdamW(ps, lr=1e-2, weight_decay=0.1, mu_x=0.9),
    "gpa_adamw_forloop": lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, foreach=False),
    "gpa(adamw)": lambda ps: GPA(ps, lr=1e-2, weight_decay=0.1, mu_x=0.9),
    "diloco(adamw)": lambda ps: DiLoCo(ps, inner_steps=2, lr=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_init_state_takes_no_step(name: str) -> None:
    """init_state() creates the state (z, the base's moments, step counts at 0) without stepping: the parameters are
    bitwise unchanged and the next steps equal a fresh optimizer's, GPAAdamW and the wrappers alike."""
    params, fresh_params = _params(), _params()
    opt = FACTORIES[name](params)
    opt.init_state()
    assert all(torch.equal(p, q) for p, q in zip(params, fresh_params))
    for p in params:
        state = opt.state[p].get("base", opt.state[p])
        assert state["step"].item() == 0.0 and not state["exp_avg"].any()
    fresh = FACTORIES[name](fresh_params)
    _steps(opt, params, 0, 3)
    _steps(fresh, fresh_params, 0, 3)
    assert all(torch.equal(p, q) for p, q in zip(params, fresh_params))


def test_init_state_keeps_existing_state() -> None:
    """init_state() after steps creates only what is missing: the state of a stepped parameter is left as it was."""
    params = _params()
    opt = GPA(params[:1], lr=1e-2, mu_x=0.9)
    _steps(opt, params[:1], 0, 2)
    opt.add_param_group({"params": params[1:]})
    before = copy.deepcopy(opt.state[params[0]])
    opt.init_state()
    assert torch.equal(opt.state[params[0]]["z"], before["z"])
    assert opt.state[params[0]]["base"]["step"].item() == 2.0 and opt.state[params[1]]["base"]["step"].item() == 0.0


@pytest.mark.parametrize("name", list(FACTORIES))
def test_a_state_dict_resumes_bitwise(name: str) -> None:
    """Three steps, the state dict loaded by a new optimizer: its next two steps equal the original run's."""
    params = _params()
    opt = FACTORIES[name](params)
    _steps(opt, params, 0, 3)
    saved, saved_params = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    _steps(opt, params, 3, 5)
    resumed_params = [torch.nn.Parameter(p) for p in saved_params]
    resumed = FACTORIES[name](resumed_params)
    resumed.load_state_dict(saved)
    _steps(resumed, resumed_params, 3, 5)
    assert all(torch.equal(p, q) for p, q in zip(params, resumed_params))


def _nameless(state_dict: dict) -> dict:
    """The state dict without the optimizer's name in its groups (no hf_gpa version wrote one: not loaded as one)."""
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
    """A state dict of GPAAdamW without its name is not loaded into GPA(SGD) and the reverse: its per-parameter
    state is not the keys of a run they continue, and nothing changes before the ValueError."""
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
