"""Resuming another optimizer's state: an AdamW run switched to GPA continues, every other mismatch is refused.

Oracles: with mu_x = 0 GPA is its base, so an adopted AdamW state must continue exactly as AdamW itself would; the
checkpoint's own files (weights, m, v, lr) for the Trainer-level switch.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import load_file
from tensors import random_params
from torch import nn
from transformers import TrainerCallback

from hf_gpa import GPA, DiLoCo, GPAAdamW
from hf_gpa.checkpoint import unwrap_gpa_optimizer
from hf_gpa.optim import saved_optimizer_name
from hf_gpa.trainer import GPATrainer
from hf_gpa.training_args import GPATrainingArguments

ADOPTERS = {
    "gpa_adamw_forloop": lambda ps, **kw: GPAAdamW(ps, foreach=False, **kw),
    "gpa_adamw_foreach": lambda ps, **kw: GPAAdamW(ps, foreach=True, **kw),
    "gpa_adamw_fused": lambda ps, **kw: GPAAdamW(ps, fused=True, **kw),
    "gpa(adamw)": lambda ps, **kw: GPA(ps, base=torch.optim.AdamW, **kw),
}
SHAPES = ((6, 4), (4,), (3,))


def _clone(params: list[torch.Tensor]) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def _steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], start: int, stop: int) -> None:
    for t in range(start, stop):
        for p in params:
            p.grad = torch.sin(3 * p.detach() + t) + 0.3 * p.detach()
        opt.step()


def _adamw_run(lr: float = 1e-2) -> tuple[list[nn.Parameter], torch.optim.AdamW]:
    params = random_params(SHAPES, torch.float64)
    adamw = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=lr)
    _steps(adamw, params, 0, 5)
    return params, adamw


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]


@pytest.mark.parametrize("name", list(ADOPTERS))
def test_adamw_state_continues_as_gpa_with_mu_x_zero_exactly_as_adamw(name: str) -> None:
    """An AdamW state loaded into GPA(-AdamW) with mu_x = 0 continues exactly as AdamW itself (float64)."""
    params, adamw = _adamw_run()
    saved = copy.deepcopy(adamw.state_dict())
    switched_params = _clone(params)
    switched = ADOPTERS[name](_groups(switched_params), lr=1.0, mu_x=0.0, weight_decay=0.01)
    switched.load_state_dict(saved)
    _steps(adamw, params, 5, 10)
    _steps(switched, switched_params, 5, 10)
    for p, q in zip(params, switched_params):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-13)


@pytest.mark.parametrize("name", list(ADOPTERS))
def test_adamw_state_gives_z_equal_to_the_weights_and_keeps_the_new_hyperparameters(name: str) -> None:
    """After the switch z = y = the weights, m, v and step are AdamW's, lr is the saved one, mu_x/mu_y/betas new."""
    params, adamw = _adamw_run(lr=3e-3)
    switched = ADOPTERS[name](_groups(params), lr=1.0, betas=(0.8, 0.9), weight_decay=0.05, mu_x=0.9, mu_y=0.6)
    switched.load_state_dict(copy.deepcopy(adamw.state_dict()))  # torch's loaders may alias the tensors they load
    for p in params:
        state = switched.state[p]
        moments = state.get("base", state)
        assert torch.equal(state["z"], p.detach())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(moments[key], adamw.state[p][key]), key
    assert [g["lr"] for g in switched.param_groups] == [3e-3, 3e-3]
    assert [g["weight_decay"] for g in switched.param_groups] == [0.05, 0.0]  # AdamW saved [0.01, 0.0]
    assert all(g["betas"] == (0.8, 0.9) and g["mu_x"] == 0.9 and g["mu_y"] == 0.6 for g in switched.param_groups)
    assert switched.train_mode
    # The first step moves z as AdamW (with the new betas) moves the weights.
    oracle_params = _clone(params)
    oracle = torch.optim.AdamW(_groups(oracle_params))
    oracle.load_state_dict(copy.deepcopy(adamw.state_dict()))
    for group, mine in zip(oracle.param_groups, switched.param_groups):
        group.update(betas=mine["betas"], weight_decay=mine["weight_decay"])
    _steps(switched, params, 5, 6)
    _steps(oracle, oracle_params, 5, 6)
    for p, q in zip(params, oracle_params):
        torch.testing.assert_close(switched.state[p]["z"], q.detach(), rtol=0, atol=1e-13)


def _gpa_adamw(ps):
    return GPAAdamW(ps, lr=1e-2)


MISMATCHES = {
    # (what saved the state, what loads it)
    "gpa_adamw->diloco": (_gpa_adamw, lambda ps: DiLoCo(ps, lr=1e-2)),
    "diloco->gpa_adamw": (lambda ps: DiLoCo(ps, lr=1e-2), _gpa_adamw),
    "gpa_adamw->gpa(sgd)": (_gpa_adamw, lambda ps: GPA(ps, base=torch.optim.SGD, lr=1e-2)),
    "gpa(adamw)->gpa_adamw": (lambda ps: GPA(ps, lr=1e-2), _gpa_adamw),
    "gpa(adamw)->diloco(adamw)": (lambda ps: GPA(ps, lr=1e-2), lambda ps: DiLoCo(ps, lr=1e-2)),
    "sgd->gpa_adamw": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), _gpa_adamw),
    "adamw_amsgrad->gpa_adamw": (lambda ps: torch.optim.AdamW(ps, amsgrad=True), _gpa_adamw),
    "adamw->gpa(sgd)": (lambda ps: torch.optim.AdamW(ps), lambda ps: GPA(ps, base=torch.optim.SGD, lr=1e-2)),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_another_optimizers_state_is_refused_before_anything_changes(case: str) -> None:
    """Any other mismatch raises a ValueError naming both optimizers and what to do; the loader is unchanged."""
    make_saver, make_loader = MISMATCHES[case]
    params = random_params(SHAPES, torch.float64)
    saver = make_saver(params)
    _steps(saver, params, 0, 2)
    loader_params = _clone(params)
    loader = make_loader(loader_params)
    _steps(loader, loader_params, 0, 1)
    before = copy.deepcopy(loader.state_dict())
    with pytest.raises(ValueError, match=r"saved by .*not by .*Resume with the optimizer that saved it") as info:
        loader.load_state_dict(saver.state_dict())
    assert loader.optimizer_name in str(info.value)
    after = loader.state_dict()
    assert before["param_groups"] == after["param_groups"]
    assert before["state"].keys() == after["state"].keys()


def test_state_dicts_name_the_optimizer_that_saved_them() -> None:
    """Every hf_gpa state dict names its optimizer (and base); a stock one names none."""
    params = random_params(SHAPES, torch.float64)
    names = [
        saved_optimizer_name(opt.state_dict())
        for opt in (
            GPAAdamW(params),
            GPA(params, base=torch.optim.SGD, lr=0.1),
            DiLoCo(params),
            torch.optim.AdamW(params),
        )
    ]
    assert names == ["GPAAdamW", "GPA(SGD)", "DiLoCo(AdamW)", None]


# ---- the Trainer: an adamw_torch run resumed with --optim gpa_adamw ----


class _Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, 1)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.fc2(torch.tanh(self.fc1(features))).squeeze(-1)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class _Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.features = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
        self.labels = torch.sin(self.features.sum(-1))

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[i], "labels": self.labels[i]}


class _FirstStep(TrainerCallback):
    """Records the optimizer state and lr just before the first optimizer step of a (resumed) run."""

    def __init__(self) -> None:
        self.seen: dict | None = None

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):  # noqa: ANN001, ANN003
        if self.seen is None:
            inner = unwrap_gpa_optimizer(optimizer)
            names = {id(p): n for n, p in model.named_parameters()}
            ordered = [p for g in inner.param_groups for p in g["params"]]  # the order of the saved state's ids
            self.seen = {
                "lr": [g["lr"] for g in inner.param_groups],
                "state": [(names[id(p)], {k: v.clone() for k, v in inner.state[p].items()}) for p in ordered],
            }


def test_trainer_resumes_an_adamw_checkpoint_with_gpa_adamw(tmp_path) -> None:
    """--optim adamw_torch saved at step 4, resumed with --optim gpa_adamw: its first step starts from z = the
    checkpoint's weights with the checkpoint's m, v, step and lr, and training runs to the end."""

    def args(optim: str) -> GPATrainingArguments:
        gpa = dict(gpa_mu_x=0.9, gpa_mu_y=0.7) if optim == "gpa_adamw" else {}  # adamw_torch refuses GPA flags
        return GPATrainingArguments(
            output_dir=str(tmp_path / optim), report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
            max_steps=6, save_strategy="steps", save_steps=4, learning_rate=1e-2, warmup_steps=2,
            lr_scheduler_type="cosine", per_device_train_batch_size=8, optim=optim, **gpa,
        )  # fmt: skip

    GPATrainer(model=_Regressor(), args=args("adamw_torch"), train_dataset=_Data()).train()
    checkpoint = tmp_path / "adamw_torch" / "checkpoint-4"
    weights = load_file(checkpoint / "model.safetensors")
    adamw_state = torch.load(checkpoint / "optimizer.pt", weights_only=True)

    probe = _FirstStep()
    trainer = GPATrainer(model=_Regressor(), args=args("gpa_adamw"), train_dataset=_Data(), callbacks=[probe])
    output = trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 6 and torch.isfinite(torch.tensor(output.training_loss))
    assert probe.seen["lr"] == [g["lr"] for g in adamw_state["param_groups"]]
    assert len(probe.seen["state"]) == len(adamw_state["state"]) == 4
    for index, (name, state) in enumerate(probe.seen["state"]):
        saved = adamw_state["state"][index]
        assert torch.equal(state["z"], weights[name]), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[key], saved[key]), (name, key)
    final = os.path.join(trainer.args.output_dir, "checkpoint-6", "optimizer.pt")
    assert saved_optimizer_name(torch.load(final, weights_only=True)) == "GPAAdamW"


def test_a_gpa_checkpoint_resumed_with_a_stock_optim_is_refused_by_name(tmp_path) -> None:
    """--optim gpa_adamw saved at step 4, resumed with --optim adamw_torch: a ValueError naming both optimizers before
    any step (torch's AdamW alone would load GPA's state silently, keeping z as a stale entry)."""

    def args(optim: str) -> GPATrainingArguments:
        gpa = dict(gpa_mu_x=0.9, gpa_mu_y=0.7) if optim == "gpa_adamw" else {}  # adamw_torch refuses GPA flags
        return GPATrainingArguments(
            output_dir=str(tmp_path / optim), report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
            max_steps=6, save_strategy="steps", save_steps=4, learning_rate=1e-2, per_device_train_batch_size=8,
            optim=optim, **gpa,
        )  # fmt: skip

    GPATrainer(model=_Regressor(), args=args("gpa_adamw"), train_dataset=_Data()).train()
    checkpoint = tmp_path / "gpa_adamw" / "checkpoint-4"
    probe = _FirstStep()
    trainer = GPATrainer(model=_Regressor(), args=args("adamw_torch"), train_dataset=_Data(), callbacks=[probe])
    with pytest.raises(ValueError, match=r"GPAAdamW.*--optim adamw_torch.*--optim gpa_adamw"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert probe.seen is None  # no optimizer step was taken


@pytest.mark.parametrize("name", [*ADOPTERS, "diloco(adamw)"])
def test_an_adamw_state_of_another_shape_is_refused_naming_the_parameter(name: str) -> None:
    """A saved moment whose shape differs from its parameter's raises a ValueError naming it; nothing changes."""
    params, adamw = _adamw_run()
    saved = copy.deepcopy(adamw.state_dict())
    saved["state"][1]["exp_avg"] = torch.zeros(5, dtype=torch.float64)  # parameter 1 has shape (4,)
    factory = ADOPTERS.get(name, lambda ps, **kw: DiLoCo(ps, base=torch.optim.AdamW, **kw))
    loader_params = _clone(params)
    loader = factory(_groups(loader_params), lr=1.0)
    _steps(loader, loader_params, 0, 2)
    before = copy.deepcopy(loader.state_dict())
    with pytest.raises(ValueError, match=r"exp_avg.*\(5,\).*\(4,\)"):
        loader.load_state_dict(saved)
    after = loader.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert before["state"].keys() == after["state"].keys()


# ---- the kind is checked first, and adoption creates the state in the receiving optimizer's modes ----


def test_another_kind_with_another_grouping_is_refused_by_kind() -> None:
    """A state of another optimizer kind and another grouping names both optimizers, not the group sizes: the kind
    is checked before the layout (muon resumed with gpa_adamw, adamw resumed with gpa + muon)."""
    from hf_gpa import MuonWithAuxAdam

    params = random_params(SHAPES, torch.float64)
    muon = MuonWithAuxAdam([{"params": params[:1], "use_muon": True}, {"params": params[1:], "use_muon": False}])
    _steps(muon, params, 0, 2)
    with pytest.raises(ValueError, match=r"saved by MuonWithAuxAdam .*not by GPAAdamW"):
        GPAAdamW(_clone(params)).load_state_dict(muon.state_dict())
    adamw = torch.optim.AdamW(params)
    _steps(adamw, params, 0, 2)
    gpa = GPA([{"params": params[:1], "use_muon": True}, {"params": params[1:2], "use_muon": False},
               {"params": params[2:], "use_muon": False}], base=MuonWithAuxAdam)  # fmt: skip
    with pytest.raises(ValueError, match=r"saved by an optimizer outside .*\['exp_avg', .*not by GPA\(MuonWithAux"):
        gpa.load_state_dict(adamw.state_dict())


@pytest.mark.parametrize("wrapper", [GPA, DiLoCo])
@pytest.mark.parametrize("groups", ["muon_and_adamw", "adamw_only"])
def test_a_muon_with_aux_adam_run_continues_under_a_wrapper(wrapper: type, groups: str) -> None:
    """GPA/DiLoCo(MuonWithAuxAdam) adopt a MuonWithAuxAdam state (Muon and AdamW groups, or AdamW groups only): the
    base's state is carried over, and GPA with mu_x = 0 continues exactly as MuonWithAuxAdam."""
    from hf_gpa import MuonWithAuxAdam

    def grouping(ps: list) -> list[dict]:
        if groups == "adamw_only":
            return [{"params": ps, "use_muon": False}]
        return [{"params": ps[:1], "use_muon": True}, {"params": ps[1:], "use_muon": False}]

    params = random_params(SHAPES, torch.float64)
    muon = MuonWithAuxAdam(grouping(params), lr=1e-2)
    _steps(muon, params, 0, 3)
    loader_params = _clone(params)
    kwargs = dict(mu_x=0.0) if wrapper is GPA else dict(inner_steps=100)
    loader = wrapper(grouping(loader_params), base=MuonWithAuxAdam, lr=1e-2, **kwargs)
    loader.load_state_dict(muon.state_dict())
    for p, q in zip(params, loader_params):
        for key, value in muon.state[p].items():
            assert torch.equal(loader.state[q]["base"][key], value), key
    _steps(muon, params, 3, 5)
    _steps(loader, loader_params, 3, 5)
    for p, q in zip(params, loader_params):
        assert torch.equal(p, q)


def _state_bytes_per_weight(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> float:
    """Bytes of tensor state (nested base state included) per weight; 0-d step counts left out."""

    def walk(value: object) -> int:
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        return value.numel() * value.element_size() if torch.is_tensor(value) and value.dim() else 0

    return sum(walk(optimizer.state[p]) for p in params) / sum(p.numel() for p in params)


def test_an_adopted_adamw_state_keeps_state_dtype_param() -> None:
    """GPAAdamW(state_dtype="param") adopting a bf16 AdamW run keeps z, m, v in bf16 and no y_fp32: 6 bytes per
    weight, as a fresh run in that mode (not 16), and it continues as that fresh mode would from the same state."""
    params = random_params(SHAPES, torch.bfloat16, draw_dtype=torch.float64)
    adamw = torch.optim.AdamW(params, lr=1e-2)
    _steps(adamw, params, 0, 3)
    loader_params = _clone(params)
    loader = GPAAdamW(loader_params, lr=1e-2, mu_x=0.9, state_dtype="param")
    loader.load_state_dict(adamw.state_dict())
    assert _state_bytes_per_weight(loader, loader_params) == 6.0
    for p in loader_params:
        state = loader.state[p]
        assert "y_fp32" not in state and {state[k].dtype for k in ("z", "exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    fresh_params = _clone(params)
    fresh = GPAAdamW(fresh_params, lr=1e-2, mu_x=0.9, state_dtype="param")
    _steps(fresh, fresh_params, 0, 1)
    assert _state_bytes_per_weight(fresh, fresh_params) == 6.0
    _steps(loader, loader_params, 3, 5)  # a group of adopted states steps (foreach by default)
    assert all(torch.isfinite(p).all() for p in loader_params)
