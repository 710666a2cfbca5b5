"""Rank-side code for tests/test_batchnorm.py's DDP test: norm statistics recomputed at x under 2 CPU processes.

Launched once by ``torch.distributed.run`` (2 ranks, gloo). Each rank writes what it holds; the test compares the
ranks with each other and with the average of their local (not reduced) statistics:

* `trainer`: `GPATrainer` (DDP through accelerate) on a tiny ResNet: two steps, then an evaluation at x; the
  statistics the model holds after the last step (y's) and during the evaluation (x's).
* `recalibrate`: `recalibrate_norm_statistics` on rank-specific batches, once locally and once with
  ``all_reduce=True``.

And, launched as two single-process nodes (``torchrun --nnodes 2`` on loopback, one launch per node):

* `two_nodes`: `GPATrainer` with ``load_best_model_at_end``, each node its own output_dir and ``save_on_each_node``
  off, so only node 0's disk holds the best checkpoint's weights and ``norm_statistics_y.safetensors``. Each node
  writes what its model holds at the end and the warnings hf_gpa logged.

    python tests/batchnorm_workers.py OUT_DIR [ddp | two_nodes]    (under a launcher)
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from batchnorm_models import conv_net, make_trainer  # beside this script, which the launcher runs by its path
from helpers import eval_and_save_every, logged_lines
from torch import nn

from hf_gpa.batchnorm import norm_statistics, recalibrate_norm_statistics


def recalibrate(out: Path, rank: int) -> None:
    """`recalibrate_norm_statistics` on rank-specific batches (a different count per rank), local and reduced."""
    torch.manual_seed(0)
    model = conv_net(torch.float64)
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(6, 3, 6, 6, dtype=torch.float64, generator=generator) * (1 + rank) for _ in range(2 + rank)]
    local = copy.deepcopy(model)
    recalibrate_norm_statistics(local, batches, 8)
    recalibrate_norm_statistics(model, batches, 8, all_reduce=True)
    torch.save({"local": norm_statistics(local), "reduced": norm_statistics(model)}, out / f"recalibrate{rank}.pt")


def trainer(out: Path, rank: int) -> None:
    """`GPATrainer` under DDP: two steps, an evaluation at x after the second; y's and x's statistics."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: nn.Module = None, **kwargs: Any) -> None:
            self.y_stats = norm_statistics(model)

        def on_evaluate(self, args: Any, state: Any, control: Any, model: nn.Module = None, **kwargs: Any) -> None:
            self.x_stats = norm_statistics(model)

    probe = Probe()
    run = make_trainer(
        out / "run", [probe], max_steps=2, per_device_train_batch_size=16, eval_strategy="steps", eval_steps=2
    )
    run.train()
    facts = {"x_stats": probe.x_stats, "y_stats": probe.y_stats, "world_size": dist.get_world_size()}
    torch.save(facts, out / f"trainer{rank}.pt")


def two_nodes(out: Path, node: int) -> None:
    """Best-model loading where only node 0 has the checkpoints: both nodes finish; what each holds and logs."""
    import logging

    from safetensors.torch import load_file

    with logged_lines("hf_gpa", logging.WARNING) as warnings:
        run = make_trainer(
            out / f"node{node}",
            max_steps=4,
            per_device_train_batch_size=16,
            **eval_and_save_every(2),
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
            greater_is_better=True,  # the higher loss: checkpoint-2, so that the best and the last model differ
            save_on_each_node=False,
            gpa_bn_recalibration_batches=2,
        )
        run.train()
    folders = sorted((out / "node0").glob("checkpoint-*")) if node == 0 else []  # only node 0 has weights
    facts = {
        "held": {name: p.detach().clone() for name, p in run.model.named_parameters()},
        "best": Path(run.state.best_model_checkpoint).name,
        "checkpoints": {folder.name: load_file(str(folder / "model.safetensors")) for folder in folders},
        "warnings": warnings,
    }
    torch.save(facts, out / f"two_nodes{node}.pt")


def main(out: str, scenario: str = "ddp") -> None:
    """One launch: the Trainer's accelerator starts the (gloo) process group."""
    out_dir = Path(out).resolve()
    torch.set_num_threads(1)
    try:
        if scenario == "two_nodes":
            two_nodes(out_dir, int(os.environ["GROUP_RANK"]))
        else:
            trainer(out_dir, int(os.environ["RANK"]))
            recalibrate(out_dir, dist.get_rank())
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
