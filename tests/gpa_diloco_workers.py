"""Worker code for tests/test_gpa_diloco.py: `GPADiLoCo` across 2 or 4 CPU processes (gloo), one process a rank.

    python tests/gpa_diloco_workers.py SCENARIO OUT_DIR RANK WORLD_SIZE

Started and met as ``diloco_workers``' processes are (its ``main``); each writes what it held after every step
(``{scenario}_rank{r}.pt``), and the tests compare it with ``gpa_diloco_simulation``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import diloco_workers
import torch
import torch.distributed as dist
from diloco_simulation import ADAMW_KW, rank_rows
from distributed_workers import build_mlp, mse
from gpa_diloco_simulation import MU_X, MU_Y, OUTER_LR
from torch.nn.parallel import DistributedDataParallel

from hf_gpa.optim import GPADiLoCo

INNER_STEPS, STEPS = 3, 7  # outer steps at 3 and 6, and an inner step after the last
RESUME_AT = 4  # in the middle of the second period
STREAMING = dict(inner_steps=4, num_fragments=2, steps=10)


def gpa_diloco(model: torch.nn.Module, **kwargs: Any) -> GPADiLoCo:
    return GPADiLoCo(
        model.parameters(), distributed=True,
        **{"outer_lr": OUTER_LR, "mu_x": MU_X, "mu_y": MU_Y, "inner_steps": INNER_STEPS, **ADAMW_KW, **kwargs},
    )  # fmt: skip


def snapshot(model: torch.nn.Module, optimizer: GPADiLoCo) -> dict[str, list[torch.Tensor]]:
    params = list(model.parameters())
    return {
        "inner": [p.detach().clone() for p in params],
        "x": [optimizer.state[p]["outer"].clone() for p in params],
        "z": [optimizer.state[p]["z"].clone() for p in params],
    }


def train(forward: torch.nn.Module, model: torch.nn.Module, optimizer: GPADiLoCo, steps: range) -> list:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    history = []
    for step in steps:
        optimizer.zero_grad()
        mse(forward, *rank_rows(step, rank, world_size, torch.float32)).backward()
        optimizer.step()
        history.append(snapshot(model, optimizer))
    return history


def evaluation_weights(model: torch.nn.Module, optimizer: GPADiLoCo) -> dict[str, Any]:
    """The parameters in eval mode, and whether train() gave the inner weights back bitwise."""
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.eval()
    shown = [p.detach().clone() for p in model.parameters()]
    optimizer.train()
    return {"eval": shown, "train_back": all(torch.equal(a, p) for a, p in zip(before, model.parameters()))}


def two_ranks(out: Path, rank: int) -> None:
    """Two workers, plain and streaming; one worker of two processes (DDP); mu_x = mu_y against DiLoCo; a resume
    from every rank's eval-mode checkpoint in the middle of a period; bad num_workers."""
    facts: dict[str, Any] = {}
    model = build_mlp(torch.float32)
    optimizer = gpa_diloco(model)
    facts["plain"] = train(model, model, optimizer, range(STEPS))
    facts["plain_eval"] = evaluation_weights(model, optimizer)

    h, p, steps = STREAMING["inner_steps"], STREAMING["num_fragments"], STREAMING["steps"]
    model = build_mlp(torch.float32)
    optimizer = gpa_diloco(model, inner_steps=h, num_fragments=p)
    facts["streaming"] = train(model, model, optimizer, range(steps))

    model = build_mlp(torch.float32)
    optimizer = gpa_diloco(model, num_workers=1)
    ddp = DistributedDataParallel(model, process_group=optimizer.layout.island_group)
    facts["one_worker"] = train(ddp, model, optimizer, range(STEPS))

    # mu_x = mu_y = 0.9, outer_lr = 0.7 / (1 - 0.9): DiLoCo with outer lr 0.7 and momentum 0.9 (diloco_workers').
    model, twin = build_mlp(torch.float32), build_mlp(torch.float32)
    optimizer = gpa_diloco(model, outer_lr=0.7 / (1 - 0.9), mu_x=0.9, mu_y=0.9)
    diloco = diloco_workers.diloco(twin)
    assert (diloco_workers.OUTER_LR, diloco_workers.OUTER_MOMENTUM) == (0.7, 0.9)
    ours = train(model, model, optimizer, range(STEPS))
    history: list = []
    diloco_workers.train(twin, twin, diloco, range(STEPS), history)
    facts["as_diloco"] = [(a["inner"], b["inner"]) for a, b in zip(ours, history)]

    # Resume: every rank saves the model (x, the same everywhere) and its optimizer state in eval mode.
    model = build_mlp(torch.float32)
    optimizer = gpa_diloco(model)
    train(model, model, optimizer, range(RESUME_AT))
    optimizer.eval()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out / f"checkpoint_rank{rank}.pt")
    optimizer.train()
    facts["uninterrupted"] = train(model, model, optimizer, range(RESUME_AT, STEPS))
    checkpoint = torch.load(out / f"checkpoint_rank{rank}.pt", weights_only=True)
    model = build_mlp(torch.float32)
    optimizer = gpa_diloco(model)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    optimizer.train()
    facts["resumed"] = train(model, model, optimizer, range(RESUME_AT, STEPS))

    # The DDP habit: in train mode, the model saved by rank 0 (its own inner weights) and every rank's optimizer state
    # (which then holds its worker's inner weights).
    model = build_mlp(torch.float32)
    optimizer = gpa_diloco(model)
    train(model, model, optimizer, range(RESUME_AT))
    if rank == 0:
        torch.save(model.state_dict(), out / "train_mode_model.pt")
    torch.save(optimizer.state_dict(), out / f"train_mode_optimizer_rank{rank}.pt")
    dist.barrier()  # rank 0's model file is written before any rank reads it
    facts["train_mode_uninterrupted"] = train(model, model, optimizer, range(RESUME_AT, STEPS))
    model = build_mlp(torch.float32)
    optimizer = gpa_diloco(model)
    model.load_state_dict(torch.load(out / "train_mode_model.pt", weights_only=True))
    optimizer.load_state_dict(torch.load(out / f"train_mode_optimizer_rank{rank}.pt", weights_only=True))
    facts["train_mode_resumed"] = train(model, model, optimizer, range(RESUME_AT, STEPS))

    facts["bad_num_workers"] = diloco_workers.error_of(lambda: gpa_diloco(build_mlp(torch.float32), num_workers=3))
    facts.update(syncs(rank))
    torch.save(facts, out / f"two_ranks_rank{rank}.pt")


def syncs(rank: int) -> dict[str, Any]:
    """The same outer sync objects as DiLoCo's: compressed (bfloat16, int8), overlapped (streaming, tau 1, alpha
    0.5), and the end-of-training sync of a partial period (5 steps, H = 3)."""
    facts: dict[str, Any] = {}
    for outer_dtype in ("bfloat16", "int8"):
        model = build_mlp(torch.float32)
        facts[outer_dtype] = train(model, model, gpa_diloco(model, outer_dtype=outer_dtype), range(STEPS))
    h, p, steps = STREAMING["inner_steps"], STREAMING["num_fragments"], STREAMING["steps"]
    model = build_mlp(torch.float32)
    optimizer = gpa_diloco(model, inner_steps=h, num_fragments=p, overlap_steps=1, overlap_alpha=0.5)
    facts["overlapped"] = train(model, model, optimizer, range(steps))
    model = build_mlp(torch.float32)
    optimizer = gpa_diloco(model)
    facts["partial"] = train(model, model, optimizer, range(5))
    optimizer.synchronize()
    facts["partial"][-1] = snapshot(model, optimizer)
    return facts


def four_ranks(out: Path, rank: int) -> None:
    """Four workers; two islands of two processes (DDP in each island)."""
    facts: dict[str, Any] = {}
    model = build_mlp(torch.float32)
    optimizer = gpa_diloco(model)
    facts["four_workers"] = train(model, model, optimizer, range(STEPS))
    facts["four_workers_eval"] = evaluation_weights(model, optimizer)

    model = build_mlp(torch.float32)
    optimizer = gpa_diloco(model, num_workers=2)
    ddp = DistributedDataParallel(model, process_group=optimizer.layout.island_group)
    facts["islands"] = train(ddp, model, optimizer, range(STEPS))
    facts["islands_eval"] = evaluation_weights(model, optimizer)

    model = build_mlp(torch.float32)  # 4 workers: the compressed sync in two stages
    facts["int8"] = train(model, model, gpa_diloco(model, outer_dtype="int8"), range(STEPS))
    torch.save(facts, out / f"four_ranks_rank{rank}.pt")


if __name__ == "__main__":
    diloco_workers.SCENARIOS = {"two_ranks": two_ranks, "four_ranks": four_ranks}
    diloco_workers.main(*sys.argv[1:])
