"""DeepSpeed and other wrappers that hide the real parameters from a GPA optimizer are refused before any step.

DeepSpeed steps the optimizer on its own float32 master copies, so GPA's eval()/train() switch would not reach the
weights the model runs with. DeepSpeed is not installed here: the refusals must come without importing it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import TrainingArguments

from hf_gpa.optim import GPAAdamW
from hf_gpa.trainer import GPATrainer
from hf_gpa.training_args import GPATrainingArguments


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 1)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.fc(features).squeeze(-1)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.arange(4, dtype=torch.float32) + i
        return {"features": x, "labels": x.sum()}


def _args(tmp_path, cls=GPATrainingArguments, **overrides):
    settings = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=2, save_strategy="no")
    if cls is GPATrainingArguments:
        settings["optim"] = "gpa_adamw"
    return cls(**{**settings, **overrides})


@pytest.mark.parametrize(
    "deepspeed", ["ds_config.json", {"zero_optimization": {"stage": 2}}], ids=["config-path", "config-dict"]
)
def test_arguments_refuse_deepspeed_with_gpa(tmp_path, deepspeed) -> None:
    """`--deepspeed` (a path or a dict) with a GPA optimizer is a ValueError naming FSDP2, not an ImportError."""
    with pytest.raises(ValueError, match=r"--optim gpa_adamw cannot run under --deepspeed.*FSDP2"):
        _args(tmp_path, deepspeed=deepspeed)


def test_arguments_refuse_accelerate_deepspeed_env(tmp_path, monkeypatch) -> None:
    """`accelerate launch` with a DeepSpeed config (ACCELERATE_USE_DEEPSPEED=true) and a GPA optimizer is refused."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match=r"ACCELERATE_USE_DEEPSPEED.*float32 master copies.*FSDP2"):
        _args(tmp_path, optim="diloco_adamw")


class _DeepSpeedEnabledTrainer(GPATrainer):
    """What accelerate's DeepSpeed plugin leaves behind: the Trainer's flag, set while it builds its accelerator."""

    def create_accelerator_and_postprocess(self, *args, **kwargs):
        super().create_accelerator_and_postprocess(*args, **kwargs)
        self.is_deepspeed_enabled = True


@pytest.mark.parametrize("route", ["gpa-args", "optimizers", "optimizer_cls_and_kwargs"])
def test_trainer_refuses_deepspeed_plugin_with_gpa(tmp_path, route) -> None:
    """A Trainer under DeepSpeed with a GPA optimizer (from --optim, optimizers= or optimizer_cls_and_kwargs=) fails
    at construction; a stock optimizer does not."""
    model = Regressor()
    kwargs = {}
    args = _args(tmp_path, cls=GPATrainingArguments if route == "gpa-args" else TrainingArguments)
    if route == "optimizers":
        kwargs["optimizers"] = (GPAAdamW(model.parameters()), None)
    elif route == "optimizer_cls_and_kwargs":
        kwargs["optimizer_cls_and_kwargs"] = (GPAAdamW, {"lr": 1e-3})
    with pytest.raises(ValueError, match="cannot run under DeepSpeed.*FSDP2"):
        _DeepSpeedEnabledTrainer(model=model, args=args, train_dataset=Data(), **kwargs)
    _DeepSpeedEnabledTrainer(model=Regressor(), args=_args(tmp_path, cls=TrainingArguments), train_dataset=Data())


class DeepSpeedZeroOptimizer:
    """Stands for DeepSpeed's ZeRO wrapper: the real optimizer behind `.optimizer`, stepping flat fp32 copies."""

    __module__ = "deepspeed.runtime.zero.stage_1_and_2"

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups

    def state_dict(self):
        return self.optimizer.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        return self.optimizer.step(closure)


@pytest.mark.parametrize("wrap", [False, True], ids=["copies", "deepspeed-wrapper"])
def test_trainer_refuses_an_optimizer_over_other_tensors(tmp_path, wrap) -> None:
    """A GPA optimizer stepping tensors that are not the model's parameters (master copies) is refused before the
    first step, and nothing has moved."""
    model = Regressor()
    before = model.fc.weight.detach().clone()
    copies = [p.detach().clone().requires_grad_() for p in model.parameters()]
    optimizer = GPAAdamW(copies)
    given = DeepSpeedZeroOptimizer(optimizer) if wrap else optimizer
    args = _args(tmp_path, cls=TrainingArguments)
    trainer = GPATrainer(model=model, args=args, train_dataset=Data(), optimizers=(given, None))
    message = "DeepSpeed's DeepSpeedZeroOptimizer" if wrap else "not parameters of the model"
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert trainer.state.global_step == 0 and not optimizer.state
    assert torch.equal(model.fc.weight, before) and torch.equal(copies[0], before)


def test_trainer_accepts_a_gpa_optimizer_on_the_model(tmp_path) -> None:
    """A GPA optimizer given directly on model.parameters() trains and the model ends at x (nothing refused)."""
    model = Regressor()
    before = model.fc.weight.detach().clone()
    trainer = GPATrainer(
        model=model,
        args=_args(tmp_path, cls=TrainingArguments),
        train_dataset=Data(),
        optimizers=(GPAAdamW(model.parameters(), lr=1e-2), None),
    )
    trainer.train()
    assert trainer.state.global_step == 2 and not torch.equal(model.fc.weight, before)
