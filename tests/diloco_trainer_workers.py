"""Worker code for tests/test_diloco_trainer.py: GPATrainer with DiLoCo across CPU processes (gloo), one per rank.

Launched by ``accelerate launch --config_file configs/accelerate_ddp.yaml`` (the user's command), with torch's flight
recorder on (``TORCH_FR_BUFFER_SIZE``), which records every collective of every process group on this process:

    accelerate launch --config_file configs/accelerate_ddp.yaml --num_processes 2 tests/diloco_trainer_workers.py \
        SCENARIO OUT_DIR

Workers only observe: each writes what it held after every step, what it saved, the collectives it took part in and
the errors it saw (``{scenario}_rank{r}.pt``); the tests compare those. The process group is destroyed in a
``finally``, also when the scenario raises.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from diloco_workers import error_of
from distributed_workers import trainer_args
from helpers import TokenDataset, logged_lines, tiny_llama
from transformers import TrainerCallback

from hf_gpa import GPATrainer, GPATrainingArguments
from hf_gpa.checkpoint import unwrap_gpa_optimizer
from hf_gpa.example_args import checkpoint_to_resume

STEPS = 6
INNER_STEPS = 3  # outer steps after steps 3 and 6
SAVE_STEPS = 2  # checkpoints at 2 (mid-period), 4 (after an outer step and one inner step) and 6 (an outer step)
RESUME_FROM = "checkpoint-4"
STREAMING = dict(diloco_inner_steps=4, diloco_fragments=2, max_steps=8)  # fragment 1 at steps 2, 6; fragment 0 at 4, 8


#: The run of DiLoCo's and GPA's workers alike (gpa_diloco_trainer_workers): evaluated after every outer step.
SCHEDULE = dict(
    max_steps=STEPS, save_steps=SAVE_STEPS, eval_strategy="steps", eval_steps=INNER_STEPS, lr_scheduler_type="cosine"
)


def diloco_args(output_dir: Path, **overrides: Any) -> GPATrainingArguments:
    """test_distributed's DDP Trainer arguments, with DiLoCo across the processes in place of GPA."""
    diloco = dict(optim="diloco_adamw", gpa_mu_x=None, diloco_distributed=True, diloco_inner_steps=INNER_STEPS)
    return trainer_args(output_dir, 2, **{**diloco, **SCHEDULE, **overrides})  # gpa_mu_x: GPA's, unread by DiLoCo


def full(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor: a DTensor's (FSDP2 inside the islands) gathered over its island, which every
    process of the island calls at once."""
    t = t.detach()
    return t.full_tensor() if type(t).__name__ == "DTensor" else t.clone()


def flight_records() -> list[dict[str, Any]] | None:
    """Every collective this process has issued so far, oldest first: its record id, process group, op and size
    (None where this torch cannot dump its flight recorder)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    trace = pickle.loads(dump(includeStackTraces=False))
    return [
        {
            "id": entry["record_id"],
            "group": entry["process_group"][0],
            "op": entry["profiling_name"],
            "numel": sum(math.prod(size) for size in entry["input_sizes"]),
        }
        for entry in trace["entries"]
    ]


def last_record_id() -> int:
    records = flight_records() or []
    return records[-1]["id"] if records else -1


class Recorder(TrainerCallback):
    """After every step: the inner weights (the parameters) and the outer weights (the optimizer's), by name, and the
    flight recorder's position at the start and end of the step (``records``) and at the end of the Trainer's
    bookkeeping after the step before (``window``: its logging, evaluation and saving; the batches of this step are
    read, and their tokens counted, inside it); during evaluation: the optimizer's mode."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.train_mode_during_eval: list[bool] = []
        self._begin = -1
        self._after_bookkeeping = -1

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._after_bookkeeping = last_record_id()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._begin = last_record_id()

    def _bookkeeping_done(self, *args: Any, **kwargs: Any) -> None:
        self._after_bookkeeping = last_record_id()

    on_log = on_evaluate = on_save = _bookkeeping_done

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw: Any):
        inner = unwrap_gpa_optimizer(optimizer)
        named = list(model.named_parameters())
        end = last_record_id()
        self.steps.append(
            {
                "step": state.global_step,
                "records": (self._begin, end),
                "window": (self._after_bookkeeping, end),
                "inner": {n: full(p) for n, p in named},
                "outer": {n: full(inner.state[p]["outer"]) for n, p in named if p in inner.state},
            }
        )
        self._after_bookkeeping = end

    def on_prediction_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.train_mode_during_eval.append(unwrap_gpa_optimizer(optimizer).train_mode)


def groups_of(trainer: GPATrainer) -> dict[str, list[int]]:
    """The global ranks of every process group the run's collectives can use, by the name the flight recorder gives."""
    layout = unwrap_gpa_optimizer(trainer.optimizer).layout
    groups = [dist.group.WORLD, layout.island_group, layout.outer_group]
    return {g.group_name: dist.get_process_group_ranks(g) for g in groups if g is not None}


class EarliestIsBest(TrainerCallback):
    """Every evaluation's metrics get ``eval_earliness`` = -step, so that with it as the metric for the best model
    (greater is better) the best checkpoint is the first one, whatever the losses do."""

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float], **kwargs: Any) -> None:
        metrics["eval_earliness"] = -state.global_step


def run(
    out: Path,
    name: str,
    resume: str | None = None,
    model: torch.nn.Module | None = None,
    callbacks: tuple[TrainerCallback, ...] = (),
    **overrides: Any,
) -> dict[str, Any]:
    """One training run with the Recorder (of ``model``, by default the tiny Llama); what it held, saved and
    communicated."""
    trainer = GPATrainer(
        model=tiny_llama() if model is None else model,
        args=diloco_args(out / name, **overrides),
        train_dataset=TokenDataset(32, seed=1),
        eval_dataset=TokenDataset(8, seed=2),
    )
    recorder = Recorder()
    trainer.add_callback(recorder)
    for callback in callbacks:
        trainer.add_callback(callback)
    first = last_record_id()
    with logged_lines("hf_gpa.workers", logging.INFO) as start_lines:  # the start line of a run across processes
        trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()  # after training: at the outer weights
    trainer.save_model(str(out / name / "final"))
    layout = unwrap_gpa_optimizer(trainer.optimizer).layout
    records = flight_records()
    return {
        "steps": recorder.steps,
        "train_mode_during_eval": recorder.train_mode_during_eval,
        "eval_loss": metrics["eval_loss"],
        "held_after_train": {n: full(p) for n, p in trainer.model.named_parameters()},
        "buffers_after_train": {n: b.clone() for n, b in trainer.model.named_buffers()},
        "records": None if records is None else [r for r in records if r["id"] > first],
        "groups": groups_of(trainer),
        "layout": {**layout.saved(), "worker": layout.worker},
        "island_size": layout.island_size,
        "wrapped": type(trainer.model_wrapped).__name__,
        "ddp_group_is_island": getattr(trainer.model_wrapped, "process_group", None) is layout.island_group,
        "shard_ranks": [
            dist.get_process_group_ranks(p.device_mesh.get_group())
            for p in trainer.model.parameters()
            if type(p).__name__ == "DTensor"
        ],
        "numel": sum(p.numel() for p in trainer.model.parameters()),
        "log_history": trainer.state.log_history,
        "start_lines": start_lines,
    }


# ---------------------------------------------------------------- scenarios


def two_ranks(out: Path) -> dict[str, Any]:
    """M = W = 2: train with checkpoints and evaluations, resume from the middle of a period, refuse a resume with
    another M; streaming (P = 2); M = 1 against single-worker DiLoCo under accelerate's DDP."""
    facts: dict[str, Any] = {"run": run(out, "run")}
    facts["resumed"] = run(out, "resumed", resume=str(out / "run" / RESUME_FROM))

    # Another M on the same checkpoint: refused by name before anything is trained or loaded, by the Trainer and by
    # the example scripts' resume check.
    other = GPATrainer(
        model=tiny_llama(),
        args=diloco_args(out / "other", diloco_workers=1, eval_strategy="no"),
        train_dataset=TokenDataset(32, seed=1),
    )
    checkpoint = str(out / "run" / RESUME_FROM)
    facts["other_m_refused"] = error_of(lambda: other.train(resume_from_checkpoint=checkpoint))
    facts["other_m_before_training"] = other.optimizer is None and other.state.global_step == 0
    script_args = diloco_args(
        out / "other", diloco_workers=1, eval_strategy="no", do_train=True, resume_from_checkpoint=checkpoint
    )
    facts["other_m_refused_by_script"] = error_of(lambda: checkpoint_to_resume(script_args, logging.getLogger()))

    # Another H (or outer lr, outer momentum) on the same checkpoint: refused by name too, before training.
    other = GPATrainer(
        model=tiny_llama(),
        args=diloco_args(out / "other_h", diloco_inner_steps=2, eval_strategy="no"),
        train_dataset=TokenDataset(32, seed=1),
    )
    facts["other_h_refused"] = error_of(lambda: other.train(resume_from_checkpoint=checkpoint))
    facts["other_h_before_training"] = other.optimizer is None and other.state.global_step == 0
    script_args = diloco_args(
        out / "other_h", diloco_inner_steps=2, eval_strategy="no", do_train=True, resume_from_checkpoint=checkpoint
    )
    facts["other_h_refused_by_script"] = error_of(lambda: checkpoint_to_resume(script_args, logging.getLogger()))

    # Logging, evaluation and checkpoints at the outer steps only: nothing else may leave a worker.
    facts["quiet"] = run(out, "quiet", logging_steps=INNER_STEPS, save_steps=INNER_STEPS)

    # Every rank builds its model from a seed of its own, with frozen parameters and a buffer of its own.
    model = tiny_llama(seed=dist.get_rank())
    model.model.embed_tokens.requires_grad_(False)
    model.model.norm.requires_grad_(False)
    model.register_buffer("rank_marker", torch.full((3,), float(dist.get_rank())))
    facts["unseeded_at_start"] = {
        "embed": model.model.embed_tokens.weight.detach().clone(),
        "norm": model.model.norm.weight.detach().clone(),
    }
    facts["unseeded"] = run(out, "unseeded", model=model, max_steps=INNER_STEPS, save_strategy="no")

    facts["streaming"] = run(out, "streaming", save_strategy="no", eval_strategy="no", **STREAMING)
    # Streaming with each fragment's sync overlapped by one inner step (--diloco_overlap_steps 1): 8 steps, so that
    # the last sync (fragment 0's, started after step 8) is still in flight when training ends.
    facts["overlapped"] = run(
        out, "overlapped", save_strategy="no", eval_strategy="no", logging_steps=1,
        **{**STREAMING, "max_steps": 8, "diloco_overlap_steps": 1, "diloco_overlap_alpha": 0.5},
    )  # fmt: skip
    # The outer all-reduce compressed to int8: the logs count the all-gather's payload.
    facts["int8"] = run(
        out, "int8", diloco_outer_dtype="int8", max_steps=INNER_STEPS, save_strategy="no", eval_strategy="no"
    )
    # One worker of both processes (an island of 2: DDP over it), against accelerate's DDP around single-worker DiLoCo.
    short = dict(max_steps=INNER_STEPS, save_strategy="no", eval_strategy="no")
    facts["one_worker"] = run(out, "one_worker", diloco_workers=1, **short)
    facts["stock_ddp"] = run_stock_ddp(out, **short)
    # 5 steps with H = 3: the last 2 steps form a partial period, synchronised at the end of training.
    facts["partial"] = run(out, "partial", max_steps=5, save_strategy="no", eval_strategy="no", logging_steps=1)
    # The overlapped sync with the best checkpoint loaded at the end (every checkpoint holds a sync in flight).
    # The best checkpoint is the first one (checkpoint-2), whose state holds a sync in flight.
    overlapped = {**STREAMING, "max_steps": 8, "diloco_overlap_steps": 1, "diloco_overlap_alpha": 0.5}
    facts["best"] = run(
        out, "best", callbacks=(EarliestIsBest(),), eval_steps=2, save_steps=2, load_best_model_at_end=True,
        metric_for_best_model="earliness", greater_is_better=True, **overlapped,
    )  # fmt: skip
    facts["best_checkpoint"] = trainer_state_best(out / "best")
    return facts


def trainer_state_best(output_dir: Path) -> str | None:
    """The best checkpoint the run recorded (its last checkpoint's trainer_state.json)."""
    import json

    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(output_dir))
    return json.loads((Path(last) / "trainer_state.json").read_text())["best_model_checkpoint"]


def run_stock_ddp(out: Path, **overrides: Any) -> dict[str, Any]:
    """Single-worker DiLoCo (no --diloco_distributed) under the DDP accelerate builds over all processes."""
    trainer = GPATrainer(
        model=tiny_llama(),
        args=diloco_args(out / "stock_ddp", diloco_distributed=False, **overrides),
        train_dataset=TokenDataset(32, seed=1),
    )
    trainer.train()
    return {"held_after_train": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}}


def four_ranks(out: Path) -> dict[str, Any]:
    """2 islands of 2 processes: gradients averaged in the island every step, pseudo-gradients across the islands."""
    return {"islands": run(out, "islands", diloco_workers=2, save_strategy="no", logging_steps=INNER_STEPS)}


def fsdp_islands(out: Path) -> dict[str, Any]:
    """Launched with the FSDP2 config on 4 processes: 2 islands of 2, each island's model sharded by FSDP2 over its
    processes; a resume from the middle of a period; the same run with the islands' DDP (the config's FSDP turned
    off), the unsharded reference; resumes of the sharded checkpoint on other layouts, refused."""
    islands = dict(diloco_workers=2, logging_steps=INNER_STEPS)
    facts: dict[str, Any] = {"run": run(out, "run", **islands)}
    checkpoint = str(out / "run" / RESUME_FROM)
    facts["resumed"] = run(out, "resumed", resume=checkpoint, **islands)
    script = dict(eval_strategy="no", do_train=True, resume_from_checkpoint=checkpoint, **islands)
    facts["script_resumes"] = checkpoint_to_resume(diloco_args(out / "script", **script), logging.getLogger())
    os.environ["ACCELERATE_USE_FSDP"] = "false"  # the reference: the same 2 workers with whole weights (DDP)
    facts["ddp"] = run(out, "ddp", save_strategy="no", **islands)
    os.environ["ACCELERATE_USE_FSDP"] = "true"
    # Every rank builds its model from a seed of its own; with lr 0 the model after training is the first process's.
    model = tiny_llama(seed=dist.get_rank())
    facts["own_seed_initial"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    facts["own_seed"] = run(
        out, "own_seed", model=model, learning_rate=0.0, max_steps=1, save_strategy="no", eval_strategy="no", **islands
    )
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    script_args = diloco_args(out / "script", **script)
    facts["ddp_refused_by_script"] = error_of(lambda: checkpoint_to_resume(script_args, logging.getLogger()))
    for name, overrides in (("ddp_refused", islands), ("other_m_refused", dict(diloco_workers=4))):
        other = GPATrainer(
            model=tiny_llama(),
            args=diloco_args(out / name, eval_strategy="no", **overrides),
            train_dataset=TokenDataset(32, seed=1),
        )
        facts[name] = error_of(lambda other=other: other.train(resume_from_checkpoint=checkpoint))
        facts[f"{name}_before_training"] = other.optimizer is None and other.state.global_step == 0
    return facts


SCENARIOS = {"two_ranks": two_ranks, "four_ranks": four_ranks, "fsdp_islands": fsdp_islands}


def main(scenario: str, out: str, scenarios: dict[str, Any] = SCENARIOS, dies: tuple[str, ...] = ()) -> None:
    """Run ``scenarios[scenario]`` on this rank and save its facts to ``out``; the process group is torn down at
    the end, except in a scenario of ``dies`` (after a peer died, tearing down may wait on it)."""
    out_dir = Path(out).resolve()
    torch.set_num_threads(1)  # the ranks share 2 cores in CI
    try:
        facts = scenarios[scenario](out_dir)
        torch.save(facts, out_dir / f"{scenario}_rank{dist.get_rank()}.pt")
        dist.barrier()  # every rank done before any tears its connections down (gloo can abort at exit otherwise)
    finally:
        if dist.is_initialized() and scenario not in dies:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
