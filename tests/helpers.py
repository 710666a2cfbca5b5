"""Helpers the trainer-side test files share (tiny models and data, arguments, snapshots, the shared Llama run, the
checks of runs across processes, log lines).

A plain module beside the tests, imported as ``from helpers import ...``: test modules do not import each other, and
fixtures live in ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tensors import TokenDataset  # noqa: F401  (re-exported: the trainer-side tests take it from here)
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback

from hf_gpa.checkpoint import evaluation_weights, unwrap_gpa_optimizer, x_state_dict
from hf_gpa.trainer import GPATrainer
from hf_gpa.training_args import GPATrainingArguments

MU_X, MU_Y = 0.5, 0.7  # a short memory so that x, y and the initial weights are far apart after a few steps


# ---- tiny models and data ----


#: The config of `tiny_llama`: 2 layers, a 64-token vocabulary.
TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
#: A narrower `tiny_llama` (width 16, one key-value head): ``tiny_llama(**NARROW_LLAMA)``.
NARROW_LLAMA: dict[str, Any] = dict(
    hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16
)


def tiny_llama(seed: int = 0, **config: Any) -> LlamaForCausalLM:
    """A Llama of the `TINY_LLAMA` config, with ``config``'s fields over it, initialised from ``seed``."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **config}))


class TinyRegressor(nn.Module):
    """A plain nn.Module (not a PreTrainedModel) the Trainer accepts: it returns a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.fc2(torch.tanh(self.norm(self.fc1(features)))).squeeze(-1)
        loss = None if labels is None else nn.functional.mse_loss(out, labels)
        return {"loss": loss, "logits": out}


class RegressionDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int, dtype: torch.dtype = torch.float64) -> None:
        g = torch.Generator().manual_seed(seed)
        self.features = torch.randn(n, 4, generator=g, dtype=dtype)
        self.labels = torch.sin(self.features.sum(-1))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[i], "labels": self.labels[i]}


def make_args(output_dir, **overrides) -> GPATrainingArguments:
    kwargs = dict(
        output_dir=str(output_dir),
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        optim="gpa_adamw",
        gpa_mu_x=MU_X,
        gpa_mu_y=MU_Y,
    )
    if overrides.get("gpa_averaging") == "schedule_free":
        del kwargs["gpa_mu_x"]  # Schedule-Free's average has no mu_x: giving one is an error
    if overrides.get("optim", kwargs["optim"]) not in ("gpa_adamw", "gpa"):
        del kwargs["gpa_mu_x"], kwargs["gpa_mu_y"]  # an optimizer that does not read them refuses them
    kwargs.update(overrides)
    return GPATrainingArguments(**kwargs)


def eval_and_save_every(steps: int) -> dict[str, Any]:
    """The arguments that evaluate and save every ``steps`` steps."""
    return dict(eval_strategy="steps", eval_steps=steps, save_strategy="steps", save_steps=steps)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_equal_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def equal_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether ``a`` and ``b`` hold the same names and, under each, the same bits."""
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


class Snapshots(TrainerCallback):
    """Records y after every step and, at every save, y and x as the optimizer gives them (through eval())."""

    def __init__(self) -> None:
        self.at_start: tuple[bool, dict[str, torch.Tensor]] | None = None
        self.y: dict[int, dict[str, torch.Tensor]] = {}
        self.saved_y: dict[int, dict[str, torch.Tensor]] = {}
        self.saved_x: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        inner = unwrap_gpa_optimizer(optimizer)
        self.at_start = (inner is None or inner.train_mode, params_of(model))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.y[state.global_step] = params_of(model)

    def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.saved_y[state.global_step] = params_of(model)
        with evaluation_weights(optimizer):
            self.saved_x[state.global_step] = params_of(model)


def all_weights(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``state`` if given, else a copy of the model's state dict: every weight. `RecordXY` and `x_then_y` take any
    such ``pick(model, state=None)``, which may keep fewer (a test of adapters keeps the adapters')."""
    return state if state is not None else {name: t.detach().clone() for name, t in model.state_dict().items()}


class RecordXY(TrainerCallback):
    """Records y (the live weights) and x (from the optimizer, `x_state_dict`) after every optimizer step, as
    ``pick`` keeps them."""

    def __init__(self, pick: Callable[..., dict[str, torch.Tensor]] = all_weights) -> None:
        self.pick = pick
        self.x: dict[int, dict[str, torch.Tensor]] = {}
        self.y: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.y[state.global_step] = self.pick(model)
        self.x[state.global_step] = self.pick(model, x_state_dict(model, optimizer))


def x_then_y(
    trainer: Trainer, pick: Callable[..., dict[str, torch.Tensor]] = all_weights
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The weights the model holds after train() (x), then those its GPA optimizer's train() gives back (y), as
    ``pick`` keeps them; the optimizer is left in eval mode, as train() left it."""
    x = pick(trainer.model)
    inner = unwrap_gpa_optimizer(trainer.optimizer)
    inner.train()
    y = pick(trainer.model)
    inner.eval()
    return x, y


def train_losses(trainer: Trainer) -> dict[int, tuple[float, float]]:
    return {e["step"]: (e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e}


def llama_trainer(args: GPATrainingArguments, *callbacks: TrainerCallback) -> GPATrainer:
    """`tiny_llama` under GPATrainer with ``args``, on 16 training and 8 evaluation sequences."""
    return GPATrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=TokenDataset(16, seed=1),
        eval_dataset=TokenDataset(8, seed=2),
        callbacks=list(callbacks),
    )


RUN = dict(max_steps=6, save_strategy="steps", save_steps=3, lr_scheduler_type="cosine", warmup_steps=0.1)


def run_llama(output_dir, resume: str | None = None, **overrides) -> tuple[GPATrainer, Snapshots]:
    """Six steps, 4 per epoch (so the resume at step 3 is mid-epoch and crosses an epoch boundary)."""
    snapshots = Snapshots()
    trainer = llama_trainer(make_args(output_dir, **{**RUN, **overrides}), snapshots)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, snapshots


# ---- runs across processes ----


def assert_ranks_agree_on_outer(first: dict[str, Any], second: dict[str, Any], *keys: str) -> None:
    """Two ranks' records of a run of DiLoCo or GPA across 2 workers (``{"steps": [{"inner": ..., "outer": ...,
    ...}], "held_after_train": ..., "eval_loss": ...}``): after every step they hold bitwise the same outer weights
    (and ``keys``, e.g. GPA's z), not the same inner weights after step 2 (each worker its own data); after training
    both hold the last outer weights and evaluate to the same loss."""
    for a, b in zip(first["steps"], second["steps"]):
        assert all(equal_dicts(a[key], b[key]) for key in ("outer", *keys)), a["step"]
    assert not equal_dicts(first["steps"][1]["inner"], second["steps"][1]["inner"])
    last = first["steps"][-1]["outer"]
    for run in (first, second):
        assert equal_dicts(run["held_after_train"], last)
    assert first["eval_loss"] == second["eval_loss"]


def assert_evaluated_in_eval_mode(runs: list[dict[str, Any]]) -> None:
    """Every rank's run evaluated, and every evaluation batch ran with the optimizer in eval mode (at the outer
    weights; GPA's x)."""
    for run in runs:
        assert run["train_mode_during_eval"] and not any(run["train_mode_during_eval"])


def saved_and_step(out: Path, run: dict[str, Any], checkpoint: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``out/run/{checkpoint}/model.safetensors`` (``checkpoint`` "final": save_model()'s after training) and the
    record of the step of ``run`` it was saved after."""
    step = run["steps"][-1]["step"] if checkpoint == "final" else int(checkpoint.split("-")[1])
    saved = load_file(out / "run" / checkpoint / "model.safetensors")
    return saved, next(s for s in run["steps"] if s["step"] == step)


class _Lines(logging.Handler):
    def __init__(self, level: int, lines: list[str]) -> None:
        super().__init__(level)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def logged_lines(name: str, level: int) -> Iterator[list[str]]:
    """The messages the logger ``name`` (and those below it) logs at ``level`` or above inside the block, in the
    list it gives; the logger lets them through meanwhile (its level lowered to ``level`` where it was higher)."""
    logger, lines = logging.getLogger(name), []
    handler, before = _Lines(level, lines), logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
