"""Worker code for tests/test_gpa_diloco_trainer.py: GPATrainer with GPA across CPU processes (``--optim gpa_adamw
--gpa_distributed true``, gloo), one process a rank.

``two_ranks`` runs under ``accelerate launch --config_file configs/accelerate_ddp.yaml`` (the user's command), as
``diloco_trainer_workers`` does; ``dies`` is started as plain processes with torch.distributed's environment
variables (no launcher, whose agent would end the other processes itself), so that what a surviving process does
when another dies is its own:

    accelerate launch --config_file configs/accelerate_ddp.yaml --num_processes 2 \
        tests/gpa_diloco_trainer_workers.py two_ranks OUT_DIR
    RANK=r WORLD_SIZE=2 LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
        python tests/gpa_diloco_trainer_workers.py dies OUT_DIR

Workers only observe: each writes what it held after every step (inner weights, x, z), the batches and lr of every
training step (for the replay), what it saved and the errors it saw (``{scenario}_rank{r}.pt``).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import diloco_trainer_workers as dw
import torch
import torch.distributed as dist
from diloco_workers import error_of
from distributed_workers import trainer_args
from helpers import TokenDataset, tiny_llama
from transformers import TrainerCallback

from hf_gpa import GPATrainer
from hf_gpa.checkpoint import unwrap_gpa_optimizer
from hf_gpa.example_args import checkpoint_to_resume
from hf_gpa.optim import GPADiLoCo

# diloco_trainer_workers' run (`dw.SCHEDULE`): outer steps after steps 3 and 6, checkpoints at 2 (mid-period), 4 (after
# an outer step and one inner step) and 6 (an outer step)
STEPS, SYNC_STEPS, RESUME_FROM = dw.STEPS, dw.INNER_STEPS, dw.RESUME_FROM
OUTER = dict(gpa_outer_lr=1.5, gpa_mu_x=0.8, gpa_mu_y=0.6)  # mu_x != mu_y: not DiLoCo's diagonal
TIMEOUT_S = 15  # the collective timeout of the `dies` scenario (--ddp_timeout)
DIES_AT = 3  # in `dies`, rank 1 kills itself as step 3 begins (after checkpoint-2, before the outer step at 3)


def gpa_args(output_dir: Path, **overrides: Any) -> Any:
    """test_distributed's DDP Trainer arguments, with GPA across the processes (on `diloco_args`' schedule)."""
    gpa = dict(optim="gpa_adamw", gpa_distributed=True, gpa_sync_steps=SYNC_STEPS, **OUTER)
    return trainer_args(output_dir, 2, **{**gpa, **dw.SCHEDULE, **overrides})


class Recorder(dw.Recorder):
    """`diloco_trainer_workers.Recorder` (inner and outer weights x after every step, the mode during evaluation),
    with z after every step, and every training forward's inputs and the lr it stepped with (for the replay)."""

    def __init__(self, trainer: GPATrainer) -> None:
        super().__init__()
        self.batches: list[dict[str, Any]] = []
        self._trainer = trainer
        trainer.model.register_forward_pre_hook(self._record_batch, with_kwargs=True)

    def _record_batch(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        optimizer = unwrap_gpa_optimizer(self._trainer.optimizer)
        if module.training and optimizer is not None and optimizer.train_mode:
            inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
            self.batches.append({"inputs": inputs, "lr": optimizer.param_groups[0]["lr"]})

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw: Any):
        super().on_step_end(args, state, control, model=model, optimizer=optimizer, **kw)
        inner = unwrap_gpa_optimizer(optimizer)
        self.steps[-1]["z"] = {n: inner.state[p]["z"].clone() for n, p in model.named_parameters() if p in inner.state}


def run(out: Path, name: str, resume: str | None = None, **overrides: Any) -> dict[str, Any]:
    """One training run of the tiny Llama with the Recorder; what it held and saved."""
    trainer = GPATrainer(
        model=tiny_llama(),
        args=gpa_args(out / name, **overrides),
        train_dataset=TokenDataset(32, seed=1),
        eval_dataset=TokenDataset(8, seed=2),
    )
    recorder = Recorder(trainer)
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()  # after training: at x
    trainer.save_model(str(out / name / "final"))
    optimizer = unwrap_gpa_optimizer(trainer.optimizer)
    layout = optimizer.layout
    return {
        "optimizer": type(optimizer).__name__,
        "group": {k: v for k, v in optimizer.param_groups[0].items() if k != "params"},
        "steps": recorder.steps,
        "batches": recorder.batches,
        "train_mode_during_eval": recorder.train_mode_during_eval,
        "eval_loss": metrics["eval_loss"],
        "held_after_train": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "layout": {**layout.saved(), "worker": layout.worker},
        "wrapped": type(trainer.model_wrapped).__name__,
        "ddp_group_is_island": getattr(trainer.model_wrapped, "process_group", None) is layout.island_group,
    }


def replay(facts: dict[str, Any]) -> list[dict[str, Any]]:
    """GPADiLoCo's own loop across the processes (no Trainer) on the batches and lrs the Trainer's run recorded, with
    the Trainer's gradient clipping (--max_grad_norm 1.0): what the Trainer's run must equal."""
    model = tiny_llama()
    model.train()
    args = gpa_args(Path("unused"))
    optimizer = GPADiLoCo(
        model.parameters(),
        inner_steps=SYNC_STEPS,
        outer_lr=OUTER["gpa_outer_lr"],
        mu_x=OUTER["gpa_mu_x"],
        mu_y=OUTER["gpa_mu_y"],
        distributed=True,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )
    named = list(model.named_parameters())
    history = []
    for batch in facts["batches"]:
        for group in optimizer.param_groups:
            group["lr"] = batch["lr"]
        model(**batch["inputs"]).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        history.append(
            {
                "inner": {n: p.detach().clone() for n, p in named},
                "outer": {n: optimizer.state[p]["outer"].clone() for n, p in named},
                "z": {n: optimizer.state[p]["z"].clone() for n, p in named},
            }
        )
    return history


# ---------------------------------------------------------------- scenarios


def two_ranks(out: Path) -> dict[str, Any]:
    """M = W = 2: train with checkpoints and evaluations, replay the run with GPADiLoCo's own loop, resume from the
    middle of a period, and refuse a resume with another H, mu_x or mu_y, or as DiLoCo."""
    facts: dict[str, Any] = {"run": run(out, "run")}
    facts["replay"] = replay(facts["run"])
    facts["resumed"] = run(out, "resumed", resume=str(out / "run" / RESUME_FROM))

    checkpoint = str(out / "run" / RESUME_FROM)
    for key, overrides in (
        ("other_h", dict(gpa_sync_steps=2)),
        ("other_mu_x", dict(gpa_mu_x=0.9)),
        ("other_mu_y", dict(gpa_mu_y=0.5)),
        ("as_diloco", dict(optim="diloco_adamw", gpa_distributed=False, diloco_distributed=True, gpa_mu_x=None,
                           gpa_mu_y=0.7, gpa_outer_lr=None, gpa_sync_steps=32)),
    ):  # fmt: skip
        other = GPATrainer(
            model=tiny_llama(),
            args=gpa_args(out / key, eval_strategy="no", **overrides),
            train_dataset=TokenDataset(32, seed=1),
        )
        facts[f"{key}_refused"] = error_of(lambda: other.train(resume_from_checkpoint=checkpoint))  # noqa: B023
        facts[f"{key}_before_training"] = other.optimizer is None and other.state.global_step == 0
        script_args = gpa_args(
            out / key, eval_strategy="no", do_train=True, resume_from_checkpoint=checkpoint, **overrides
        )
        facts[f"{key}_refused_by_script"] = error_of(lambda: checkpoint_to_resume(script_args, logging.getLogger()))  # noqa: B023
    return facts


class DieAt(TrainerCallback):
    """Rank 1 kills itself (SIGKILL: no exception, no cleanup, as the OOM killer does) as step ``DIES_AT`` begins;
    rank 0 notes each step it reaches and whether it got past the outer step."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == DIES_AT:
            if dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            (self.out / "rank0_reached_the_outer_step").touch()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == DIES_AT:
            (self.out / "rank0_passed_the_outer_step").touch()


def dies(out: Path) -> dict[str, Any]:
    """Rank 1 dies after checkpoint-2, one step before the outer step: rank 0 must fail, not wait."""
    trainer = GPATrainer(
        model=tiny_llama(),
        args=gpa_args(out / "run", eval_strategy="no", ddp_timeout=TIMEOUT_S),
        train_dataset=TokenDataset(32, seed=1),
        callbacks=[DieAt(out)],
    )
    trainer.train()
    return {}


def diloco_dies(out: Path, **overrides: Any) -> dict[str, Any]:
    """`dies` with DiLoCo across the processes (outer step at 3) and ``overrides``: its compressed or overlapped
    outer sync, whose collectives (an all-gather of int8 shards, an all-reduce in the background) must fail too."""
    trainer = GPATrainer(
        model=tiny_llama(),
        args=dw.diloco_args(out / "run", eval_strategy="no", ddp_timeout=TIMEOUT_S, **overrides),
        train_dataset=TokenDataset(32, seed=1),
        callbacks=[DieAt(out)],
    )
    trainer.train()
    return {}


#: DiLoCo's compressed and overlapped outer syncs in the `dies` scenario: int8 (2 workers: an all-gather) with its
#: outer step at 3; streaming (fragment 1's sync started at step 2, in flight at checkpoint-2, applied at 3; fragment
#: 0's at 4, after rank 1 died).
DIES_DILOCO = {
    "dies_int8": dict(diloco_outer_dtype="int8"),
    "dies_overlap": dict(diloco_overlap_steps=1, **dw.STREAMING),
}


SCENARIOS = {
    "two_ranks": two_ranks,
    "dies": dies,
    **{name: functools.partial(diloco_dies, **overrides) for name, overrides in DIES_DILOCO.items()},
}


def main(scenario: str, out: str) -> None:
    dw.main(scenario, out, SCENARIOS, dies=("dies", *DIES_DILOCO))


if __name__ == "__main__":
    main(*sys.argv[1:])
