"""State that did not come from this very optimizer's steps: ``init_state`` (no step taken, for GPAAdamW and the
wrappers), state dicts loaded by a new optimizer, state dicts without the optimizer's name (refused), a base whose
constructor makes state (Adagrad), and a cleared state (created afresh)."""

from __future__ import annotations

import copy
import pickle
from collections import defaultdict

import pytest
import torch
from tensors import random_params

from hf_gpa import GPA, DiLoCo, GPAAdamW

SHAPES = ((4, 3), (5,))


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
    params, fresh_params = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)
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
    params = random_params(SHAPES, torch.float64)
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
    params = random_params(SHAPES, torch.float64)
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
    params = random_params(SHAPES, torch.float64)
    opt = factories[saver](params)
    _steps(opt, params, 0, 2)
    target_params = random_params(SHAPES, torch.float64, seed=1)
    target = factories[loader](target_params)
    _steps(target, target_params, 0, 1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match="saved by"):
        target.load_state_dict(_nameless(opt.state_dict()))
    after = target.state_dict()
    assert all(torch.equal(before["state"][i]["z"], s["z"]) for i, s in after["state"].items())


ADAGRAD = {
    "gpa(adagrad)": lambda ps: GPA(ps, base=torch.optim.Adagrad, lr=1e-1, mu_x=0.9),
    "diloco(adagrad)": lambda ps: DiLoCo(ps, base=torch.optim.Adagrad, inner_steps=2, lr=1e-1),
}


@pytest.mark.parametrize("how", ["load_state_dict", "deepcopy", "pickle"])
@pytest.mark.parametrize("name", list(ADAGRAD))
def test_a_base_that_makes_its_state_in_its_constructor_resumes_bitwise(name: str, how: str) -> None:
    """torch's Adagrad creates its state when constructed; the base rebuilt after a load, a deepcopy or a pickle round
    trip keeps the state the wrapper holds, so the run goes on bitwise (a fresh Adagrad state used to replace it)."""
    params = random_params(SHAPES, torch.float64)
    opt = ADAGRAD[name](params)
    _steps(opt, params, 0, 3)
    saved, saved_params = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    if how == "load_state_dict":
        resumed_params = [torch.nn.Parameter(p) for p in saved_params]
        resumed = ADAGRAD[name](resumed_params)
        resumed.load_state_dict(saved)
    else:
        copied = copy.deepcopy if how == "deepcopy" else lambda obj: pickle.loads(pickle.dumps(obj))
        resumed_params, resumed = copied((params, opt))
    _steps(opt, params, 3, 6)
    _steps(resumed, resumed_params, 3, 6)
    assert all(torch.equal(p, q) for p, q in zip(params, resumed_params))
    assert all(resumed.state[p]["base"]["step"].item() == 6.0 for p in resumed_params)


@pytest.mark.parametrize("name", list(ADAGRAD))
def test_a_first_gradient_keeps_the_state_of_a_base_that_makes_it_in_its_constructor(name: str) -> None:
    """A parameter's first gradient after 3 steps rebuilds the base; the other parameter's Adagrad state goes on (its
    steps as in an optimizer of it alone, bitwise)."""
    params, alone = random_params(SHAPES, torch.float64), random_params(SHAPES, torch.float64)[:1]
    opt, alone_opt = ADAGRAD[name](params), ADAGRAD[name](alone)
    for t in range(6):
        for p in params if t >= 3 else params[:1]:
            p.grad = torch.sin(3 * p.detach() + t)
        alone[0].grad = torch.sin(3 * alone[0].detach() + t)
        opt.step()
        alone_opt.step()
    assert torch.equal(params[0], alone[0])
    assert opt.state[params[0]]["base"]["step"].item() == 6.0 and opt.state[params[1]]["base"]["step"].item() == 3.0


CLEARED = {
    "gpa_adamw_forloop": (lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, foreach=False), torch.float32),
    "gpa_adamw_foreach": (lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, foreach=True), torch.float32),
    "gpa_adamw": (lambda ps: GPAAdamW(ps, lr=1e-2, weight_decay=0.1, mu_x=0.9), torch.float32),
    "gpa_adamw_forloop_compact": (lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, foreach=False), torch.bfloat16),
    "gpa_adamw_foreach_compact": (lambda ps: GPAAdamW(ps, lr=1e-2, mu_x=0.9, foreach=True), torch.bfloat16),
    "gpa_adamw_compact": (lambda ps: GPAAdamW(ps, lr=1e-2, weight_decay=0.1, mu_x=0.9), torch.bfloat16),
    "gpa(adamw)": (FACTORIES["gpa(adamw)"], torch.float64),
    "gpa(adagrad)": (ADAGRAD["gpa(adagrad)"], torch.float64),
    "diloco(adamw)": (FACTORIES["diloco(adamw)"], torch.float64),
}


@pytest.mark.parametrize("how", ["clear", "del", "new_dict"])
@pytest.mark.parametrize("name", list(CLEARED))
def test_cleared_state_is_created_afresh(name: str, how: str) -> None:
    """``optimizer.state.clear()`` (or ``del optimizer.state[p]``, or a new dict) after steps: the next steps create
    the state afresh from the parameters, as torch's optimizers do, bitwise as a new optimizer with the same group
    counters, and ``state_dict()`` and ``eval()`` see it (GPAAdamW's plan went on updating the orphaned tensors, GPA
    raised a KeyError, DiLoCo's base went on with the old moments)."""
    factory, dtype = CLEARED[name]
    params = random_params(SHAPES, dtype, draw_dtype=torch.float64)
    opt = factory(params)
    _steps(opt, params, 0, 3)
    if how == "clear":
        opt.state.clear()
    elif how == "del":
        for p in params:
            del opt.state[p]
    else:
        opt.state = defaultdict(dict)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = factory(fresh_params)
    for group, old in zip(fresh.param_groups, opt.param_groups):
        group.update({k: old[k] for k in ("inner_step", "weight_sum") if k in old})  # group values are not state
    _steps(opt, params, 3, 6)
    _steps(fresh, fresh_params, 3, 6)
    assert len(opt.state_dict()["state"]) == len(params)
    assert all(torch.equal(p, q) for p, q in zip(params, fresh_params))
    for p, q in zip(params, fresh_params):
        assert opt.state[p].keys() == fresh.state[q].keys()
    opt.eval()
    fresh.eval()
    assert all(torch.equal(p, q) for p, q in zip(params, fresh_params))
