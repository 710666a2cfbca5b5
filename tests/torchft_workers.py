"""Worker code for tests/test_torchft_distributed.py: one replica group of one process on torchft (gloo, CPU).

    python tests/torchft_workers.py SCENARIO OUT GROUP ATTEMPT LIGHTHOUSE [LIGHTHOUSE ...]

Each group is a process of its own, started by the test beside the lighthouses it started. The groups meet through
the lighthouse and coordinate with the test through files in OUT, never through the clock:

* ``ready_<run>_<g>``: the group's Manager is up (heartbeating). Every group waits for all of them before it joins,
  so that the first quorum holds every group: the lighthouse waits for a group that heartbeats, not for one that is
  still starting;
* ``blocked_<g>`` (kill): the group stopped in the middle of a period, for the test to SIGKILL it;
* ``held_<g>``, then ``go`` (kill): a survivor waits after its outer sync at `HOLD_AT` until the test has seen the
  restarted group ask the lighthouse for its quorum, so that the restart cannot miss the survivors' last syncs;
* ``<scenario>_<g>_<attempt>.pt``: what the group held (after every step, or at the end) and its syncs' records.

The model and the batches are those of ``diloco_simulation`` (group g is worker g of 3); group g > 0 starts from other
weights than group 0 (the join must replace them with group 0's, as the broadcast at construction does). The
optimizers (`ALGORITHMS`) and `initial_model` are those tests/test_torchft_sync.py runs in one process too.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from diloco_simulation import ADAMW_KW, OUTER_LR, OUTER_MOMENTUM, rank_rows
from distributed_workers import build_mlp, mse
from gpa_diloco_simulation import MU_X, MU_Y
from gpa_diloco_simulation import OUTER_LR as GPA_OUTER_LR

from hf_gpa.optim import DiLoCo, GPADiLoCo
from hf_gpa.optim.diloco import TorchftSync

NUM_GROUPS = 3
INNER_STEPS = 3
NOFAIL_STEPS = 10  # 3 outer syncs and a step after the last
KILL_STEPS = 18  # outer syncs at 3, 6, ..., 18
KILL_AT = 7  # group 2 stops after inner step 7, one step into the period that ends at 9
HOLD_AT = 12  # the survivors wait after their sync at 12; the restarted group heals at 15
#: The bound of every wait for a file; past it the worker fails (the test's own timeout is shorter).
WAIT_S = 600.0
TIMEOUTS = dict(timeout_s=30.0, quorum_timeout_s=180.0, connect_timeout_s=30.0)


def diloco(model: torch.nn.Module, **kwargs: Any) -> DiLoCo:
    return DiLoCo(
        model.parameters(), outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, inner_steps=INNER_STEPS,
        **ADAMW_KW, **kwargs,
    )  # fmt: skip


def gpa(model: torch.nn.Module, **kwargs: Any) -> GPADiLoCo:
    return GPADiLoCo(
        model.parameters(), outer_lr=GPA_OUTER_LR, mu_x=MU_X, mu_y=MU_Y, inner_steps=INNER_STEPS,
        **ADAMW_KW, **kwargs,
    )  # fmt: skip


ALGORITHMS = {"DiLoCo": diloco, "GPADiLoCo": gpa}
#: The second outer tensor of each algorithm: DiLoCo's momentum, GPA's z.
SECOND = {"DiLoCo": "outer_momentum_buffer", "GPADiLoCo": "z"}


def initial_model(seed: int) -> torch.nn.Module:
    """``build_mlp``'s weights, moved by ``seed`` (0: unchanged)."""
    model = build_mlp(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * seed)
    return model


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S} s")
        time.sleep(0.05)


def touch(path: Path) -> None:
    path.write_text("")


def barrier(out: Path, name: str, group: int) -> None:
    touch(out / f"{name}_{group}")
    for g in range(NUM_GROUPS):
        wait_for(out / f"{name}_{g}")


def connect(lighthouse: str, group: int, min_replicas: int) -> TorchftSync:
    return TorchftSync.connect(lighthouse, str(group), min_replicas=min_replicas, host="localhost", **TIMEOUTS)


def snapshot(model: torch.nn.Module, optimizer: Any, algorithm: str) -> dict[str, list[torch.Tensor]]:
    params = list(model.parameters())
    return {
        "inner": [p.detach().clone() for p in params],
        "outer": [optimizer.state[p]["outer"].clone() for p in params],
        "second": [optimizer.state[p][SECOND[algorithm]].clone() for p in params],
    }


def step(model: torch.nn.Module, optimizer: Any, group: int) -> None:
    optimizer.zero_grad()
    mse(model, *rank_rows(optimizer.param_groups[0]["inner_step"], group, NUM_GROUPS, torch.float32)).backward()
    optimizer.step()


def records(sync: TorchftSync) -> list[dict[str, Any]]:
    return [dataclasses.asdict(record) for record in sync.records]


# ---------------------------------------------------------------- scenarios


def nofail(out: Path, group: int, attempt: int, lighthouses: list[str]) -> None:
    """DiLoCo, then GPA, on torchft (one lighthouse each) with no failure; then both again as our own run across
    workers (torch.distributed, gloo, the groups as ranks): every step's inner and outer tensors of each."""
    facts: dict[str, Any] = {}
    for (name, make), lighthouse in zip(ALGORITHMS.items(), lighthouses):
        with connect(lighthouse, group, min_replicas=NUM_GROUPS) as sync:
            barrier(out, f"ready_{name}", group)
            model = initial_model(group)
            optimizer = make(model, sync=sync)
            sync.join()
            history = []
            for _ in range(NOFAIL_STEPS):
                step(model, optimizer, group)
                history.append(snapshot(model, optimizer, name))
            facts[name] = {"history": history, "records": records(sync), "traffic": optimizer.outer_traffic}
    dist.init_process_group(
        "gloo", init_method=f"file://{out / 'rendezvous'}", rank=group, world_size=NUM_GROUPS,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        for name, make in ALGORITHMS.items():
            model = initial_model(group)
            optimizer = make(model, distributed=True)  # broadcast from rank 0 at construction
            history = []
            for _ in range(NOFAIL_STEPS):
                step(model, optimizer, group)
                history.append(snapshot(model, optimizer, name))
            facts[f"{name}_torch_distributed"] = {"history": history, "traffic": optimizer.outer_traffic}
    finally:
        dist.destroy_process_group()
    torch.save(facts, out / f"nofail_{group}_{attempt}.pt")


def kill(out: Path, group: int, attempt: int, lighthouses: list[str]) -> None:
    """GPA across 3 groups; group 2 stops in the middle of a period and is SIGKILLed by the test, the survivors hold
    after their sync at HOLD_AT until the restarted group (attempt 1, other initial weights) asks for its quorum;
    every group writes what it holds at the end, the inner steps it read batches at, and its syncs."""
    with connect(lighthouses[0], group, min_replicas=2) as sync:
        if attempt == 0:
            barrier(out, "ready", group)
        model = initial_model(group + 1000 * attempt)
        optimizer = gpa(model, sync=sync)
        sync.join()
        joined_at = optimizer.param_groups[0]["inner_step"]
        read = []
        while optimizer.param_groups[0]["inner_step"] < KILL_STEPS:
            if group == NUM_GROUPS - 1 and attempt == 0 and optimizer.param_groups[0]["inner_step"] == KILL_AT:
                touch(out / f"blocked_{group}")
                wait_for(out / "never")  # SIGKILLed here by the test
            read.append(optimizer.param_groups[0]["inner_step"])
            step(model, optimizer, group)
            if group < NUM_GROUPS - 1 and optimizer.param_groups[0]["inner_step"] == HOLD_AT:
                touch(out / f"held_{group}")
                wait_for(out / "go")
        facts = {
            "final": snapshot(model, optimizer, "GPADiLoCo"),
            "inner_step": optimizer.param_groups[0]["inner_step"],
            "joined_at": joined_at,
            "read": read,
            "records": records(sync),
            "traffic": optimizer.outer_traffic,
        }
    torch.save(facts, out / f"kill_{group}_{attempt}.pt")


SCENARIOS = {"nofail": nofail, "kill": kill}

if __name__ == "__main__":
    scenario, out_dir, group_id, attempt_id, *addresses = sys.argv[1:]
    torch.set_num_threads(1)
    SCENARIOS[scenario](Path(out_dir), int(group_id), int(attempt_id), addresses)
