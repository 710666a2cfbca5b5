"""Rank-side code for tests/test_batchnorm.py's DDP test: norm statistics recomputed at x under 2 CPU processes.

Launched once by ``torch.distributed.run`` (2 ranks, gloo). Each rank writes what it holds; the test compares the
ranks with each other and with the average of their local (not reduced) statistics:

* `trainer`: `GPATrainer` (DDP through accelerate) on a tiny ResNet: two steps, then an evaluation at x; the
  statistics the model holds after the last step (y's) and during the evaluation (x's).
* `recalibrate`: `recalibrate_norm_statistics` on rank-specific batches, once locally and once with
  ``all_reduce=True``.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import test_batchnorm as tb  # noqa: E402  (the models and data of the single-process tests)

from hf_gpa.batchnorm import norm_statistics, recalibrate_norm_statistics  # noqa: E402


def recalibrate(out: Path, rank: int) -> None:
    """`recalibrate_norm_statistics` on rank-specific batches (a different count per rank), local and reduced."""
    torch.manual_seed(0)
    model = tb.conv_net(torch.float64)
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
    run = tb.make_trainer(
        out / "run", [probe], max_steps=2, per_device_train_batch_size=16, eval_strategy="steps", eval_steps=2
    )
    run.train()
    facts = {"x_stats": probe.x_stats, "y_stats": probe.y_stats, "world_size": dist.get_world_size()}
    torch.save(facts, out / f"trainer{rank}.pt")


def main(out: str) -> None:
    """Both scenarios in one launch: the Trainer's accelerator starts the (gloo) process group."""
    out_dir = Path(out).resolve()
    torch.set_num_threads(1)
    try:
        trainer(out_dir, int(os.environ["RANK"]))
        recalibrate(out_dir, dist.get_rank())
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
