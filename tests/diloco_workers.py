"""Worker code for tests/test_diloco_distributed.py: DiLoCo across 2 or 4 CPU processes (gloo), one process a rank.

Each process is started on its own (no launcher that would stop the others when one fails) and meets the others
through a file in the output directory:

    python tests/diloco_workers.py SCENARIO OUT_DIR RANK WORLD_SIZE

Workers only observe: each writes what it held after every step (``{scenario}_rank{r}.pt``) and the errors it saw;
the tests compare those with the single-process simulation (``diloco_simulation``). Every process ends its process
group in a ``finally``, also when its scenario raises.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from diloco_simulation import ADAMW_KW, OUTER_LR, OUTER_MOMENTUM, rank_rows
from distributed_workers import build_mlp, mse
from torch.nn.parallel import DistributedDataParallel

from hf_gpa.optim import DiLoCo, island_allreduce_hook
from hf_gpa.optim.diloco.layout import collective_timeout

#: The collective timeout of every launch: a process left alone in a collective fails after this, not after gloo's
#: default 30 minutes.
TIMEOUT_S = 20
STEPS = 7  # H = 3: outer steps at 3 and 6, and an inner step after the last
INNER_STEPS = 3
STREAMING = dict(inner_steps=4, num_fragments=2, steps=10)  # fragment 1 at steps 2, 6, 10; fragment 0 at 4, 8
RESUME_AT = 4  # between two outer steps of fragment 0, after one of fragment 1 (H = 4, P = 2)
#: The overlap's runs: H = 6, P = 2 (fragment 1 due at steps 3, 9; fragment 0 at 6, 12), so tau = 1 and 2 < H // P.
OVERLAP = dict(inner_steps=6, num_fragments=2, steps=14)
#: (overlap_steps, overlap_alpha) of each overlap run.
OVERLAPS = [(0, 0.0), (1, 0.0), (2, 0.0), (2, 0.5)]
OVERLAP_RESUME_AT = 4  # tau = 2: fragment 1's sync started after step 3 is in flight, its update due after step 5


def diloco(model: torch.nn.Module, **kwargs: Any) -> DiLoCo:
    return DiLoCo(
        model.parameters(), base=torch.optim.AdamW, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
        distributed=True, **{"inner_steps": INNER_STEPS, **ADAMW_KW, **kwargs},
    )  # fmt: skip


def snapshot(model: torch.nn.Module, optimizer: DiLoCo) -> dict[str, list[torch.Tensor]]:
    params = list(model.parameters())
    held = {
        "inner": [p.detach().clone() for p in params],
        "outer": [optimizer.state[p]["outer"].clone() for p in params],
        "momentum": [optimizer.state[p]["outer_momentum_buffer"].clone() for p in params],
    }
    if optimizer.sync.outer_dtype != "float32":
        zero = [torch.zeros_like(p) for p in params]
        held["residual"] = [optimizer.state[p].get("outer_residual", z).clone() for p, z in zip(params, zero)]
        held["server_residual"] = [
            optimizer.state[p].get("outer_server_residual", z).clone() for p, z in zip(params, zero)
        ]
    return held


def train(
    forward: torch.nn.Module,
    plain: torch.nn.Module,
    optimizer: DiLoCo,
    steps: range,
    history: list | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Inner steps on this rank's rows (``forward``: the model, or its DDP wrapper), a snapshot after each."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in steps:
        optimizer.zero_grad()
        mse(forward, *rank_rows(step, rank, world_size, dtype)).backward()
        optimizer.step()
        if history is not None:
            history.append(snapshot(plain, optimizer))


def error_of(build: Any) -> str:
    """The message of the ValueError ``build()`` raises ("" if it raises none)."""
    try:
        build()
    except ValueError as error:
        return str(error)
    return ""


# ---------------------------------------------------------------- scenarios


def two_ranks(out: Path, rank: int) -> None:
    """Two workers: plain DiLoCo and streaming (P = 2); one worker of two processes; a resume on the same layout,
    loads on another layout, M that does not divide W; other initial weights, a gradient on one rank only."""
    facts: dict[str, Any] = {}
    model = build_mlp(torch.float32)
    optimizer = diloco(model)
    facts["layout"] = {**optimizer.layout.saved(), "worker": optimizer.layout.worker}
    facts["plain"] = []
    train(model, model, optimizer, range(STEPS), facts["plain"])

    # One worker of both processes (M = 1): DDP over the whole group around single-worker DiLoCo.
    model = build_mlp(torch.float32)
    optimizer = diloco(model, num_workers=1)
    facts["one_worker_groups"] = [optimizer.layout.island_group is dist.group.WORLD, optimizer.layout.outer_group]
    facts["one_worker"] = []
    ddp = DistributedDataParallel(model, process_group=optimizer.layout.island_group)
    train(ddp, model, optimizer, range(STEPS), facts["one_worker"])

    h, p, steps = STREAMING["inner_steps"], STREAMING["num_fragments"], STREAMING["steps"]
    model = build_mlp(torch.float32)
    optimizer = diloco(model, inner_steps=h, num_fragments=p)
    facts["streaming"] = []
    train(model, model, optimizer, range(steps), facts["streaming"])

    # Resume in the middle of the period, from a state saved in eval mode: the model holds the outer weights (the same
    # on every rank), the optimizer state this worker's inner weights.
    model = build_mlp(torch.float32)
    optimizer = diloco(model, inner_steps=h, num_fragments=p)
    train(model, model, optimizer, range(RESUME_AT))
    optimizer.eval()
    saved_model, saved_optimizer = model.state_dict(), optimizer.state_dict()
    torch.save({"model": saved_model, "optimizer": saved_optimizer}, out / f"checkpoint_rank{rank}.pt")
    optimizer.train()
    facts["uninterrupted"] = []
    train(model, model, optimizer, range(RESUME_AT, steps), facts["uninterrupted"])

    checkpoint = torch.load(out / f"checkpoint_rank{rank}.pt", weights_only=True)
    model = build_mlp(torch.float32)
    optimizer = diloco(model, inner_steps=h, num_fragments=p)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    optimizer.train()
    facts["resumed"] = []
    train(model, model, optimizer, range(RESUME_AT, steps), facts["resumed"])

    # Loads on another layout are refused before anything changes.
    other_rank = torch.load(out / f"checkpoint_rank{1 - rank}.pt", weights_only=True)["optimizer"]
    for name, kwargs, state in [
        ("num_workers", dict(num_workers=1), checkpoint["optimizer"]),
        ("num_fragments", dict(num_fragments=1), checkpoint["optimizer"]),
        ("worker", {}, other_rank),
    ]:
        model = build_mlp(torch.float32)
        optimizer = diloco(model, **{"inner_steps": h, "num_fragments": p, **kwargs})
        before = snapshot(model, optimizer), [dict(g, params=None) for g in optimizer.param_groups]
        facts[f"load_other_{name}"] = error_of(lambda: optimizer.load_state_dict(state))  # noqa: B023
        after = snapshot(model, optimizer), [dict(g, params=None) for g in optimizer.param_groups]
        facts[f"load_other_{name}_unchanged"] = _same(before[0], after[0]) and before[1] == after[1]

    facts["bad_num_workers"] = error_of(lambda: diloco(build_mlp(torch.float32), num_workers=3))

    facts["default_outer_lr"] = default_outer_lrs()

    # Rank 1 starts from other weights, and each rank trains one head of its own (the other's takes no gradient
    # there): the construction gives every rank rank 0's weights, and every parameter takes part in every outer step.
    torch.manual_seed(0)
    heads = torch.nn.ModuleList([torch.nn.Linear(6, 1) for _ in range(2)])
    if rank == 1:
        with torch.no_grad():
            for p in heads.parameters():
                p.add_(1.0)
    optimizer = diloco(heads)
    facts["heads_at_start"] = [p.detach().clone() for p in heads.parameters()]
    for step in range(INNER_STEPS):
        optimizer.zero_grad()
        inputs, targets = rank_rows(step, rank, 2, torch.float32)
        torch.nn.functional.mse_loss(heads[rank](inputs), targets).backward()
        optimizer.step()
    facts["heads_outer"] = [optimizer.state[p]["outer"].clone() for p in heads.parameters()]
    torch.save(facts, out / f"two_ranks_rank{rank}.pt")


def default_outer_lrs() -> dict[tuple[str, int], float]:
    """An unset outer lr of DiLoCo and GPADiLoCo across processes, for one worker and for two: the single-worker
    default, the measured across-workers one."""
    from hf_gpa.optim import GPADiLoCo

    return {
        (cls.__name__, workers): cls(build_mlp(torch.float32).parameters(), distributed=True, num_workers=workers)
        .param_groups[0]["outer_lr"]
        for cls in (DiLoCo, GPADiLoCo)
        for workers in (1, 2)
    }


def four_ranks(out: Path, rank: int) -> None:
    """Four workers; two islands of two, with DDP in each island and with the hook on a DDP over all four."""
    facts: dict[str, Any] = {}
    model = build_mlp(torch.float32)
    optimizer = diloco(model)
    facts["four_workers"] = []
    train(model, model, optimizer, range(STEPS), facts["four_workers"])

    model = build_mlp(torch.float32)
    optimizer = diloco(model, num_workers=2)
    facts["layout"] = {**optimizer.layout.saved(), "worker": optimizer.layout.worker}
    facts["island_size"] = optimizer.layout.island_size
    groups = (optimizer.layout.island_group, optimizer.layout.outer_group)
    facts["group_timeouts_s"] = [collective_timeout(group).total_seconds() for group in groups]
    ddp = DistributedDataParallel(model, process_group=optimizer.layout.island_group)
    facts["islands_ddp"] = []
    train(ddp, model, optimizer, range(STEPS), facts["islands_ddp"])

    model = build_mlp(torch.float32)
    optimizer = diloco(model, num_workers=2)
    ddp = DistributedDataParallel(model)  # over all four processes, as accelerate builds it
    ddp.register_comm_hook(optimizer.layout.island_group, island_allreduce_hook)
    facts["islands_hook"] = []
    train(ddp, model, optimizer, range(STEPS), facts["islands_hook"])

    facts["bad_num_workers"] = error_of(lambda: diloco(build_mlp(torch.float32), num_workers=3))

    facts["default_outer_lr"] = default_outer_lrs()
    torch.save(facts, out / f"four_ranks_rank{rank}.pt")


def compressed(out: Path, rank: int) -> None:
    """M = W workers (2: all-gather; 4: the chunked reduce-scatter and all-gather) with the outer all-reduce in
    bfloat16 and in int8 (error feedback): the run, its outer traffic, a resume from a state saved in eval mode after
    the first outer step (residuals not zero); float32's traffic; and pseudo-gradients that both dtypes hold exactly,
    averaged by each dtype's collective (in each rank's own order with 2 workers, whose halved sums stay exact; in
    the same order with 4, whose average is then each worker's values, exact in both stages)."""
    from hf_gpa.optim.diloco import OuterSync
    from hf_gpa.workers import workers_start_line

    facts: dict[str, Any] = {}
    for outer_dtype in ("float32", "bfloat16", "int8"):
        model = build_mlp(torch.float32)
        optimizer = diloco(model, outer_dtype=outer_dtype)
        history: list = []
        train(model, model, optimizer, range(RESUME_AT), history)
        optimizer.eval()
        saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(saved, out / f"{outer_dtype}_{rank}.pt")
        optimizer.train()
        train(model, model, optimizer, range(RESUME_AT, STEPS), history)
        facts[outer_dtype] = history
        facts[f"{outer_dtype}_traffic"] = dataclasses.asdict(optimizer.outer_traffic)
        facts[f"{outer_dtype}_per_period"] = optimizer.outer_bytes_per_period()
        facts[f"{outer_dtype}_start_line"] = workers_start_line(optimizer)

        checkpoint = torch.load(out / f"{outer_dtype}_{rank}.pt", weights_only=True)
        model = build_mlp(torch.float32)
        optimizer = diloco(model, outer_dtype=outer_dtype)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        optimizer.train()
        facts[f"{outer_dtype}_resumed_traffic_at_start"] = dataclasses.asdict(optimizer.outer_traffic)
        facts[f"{outer_dtype}_resumed"] = []
        train(model, model, optimizer, range(RESUME_AT, STEPS), facts[f"{outer_dtype}_resumed"])

    # Exactly representable pseudo-gradients: integers in [-127, 127], 300 elements in two int8 blocks, each with 127
    # or -127 in it (its scale is 1), in an order of each rank's own: every dtype's average is float32's, bitwise, and
    # leaves no residual.
    layout = optimizer.layout
    blocks = [
        torch.cat([torch.arange(-127.0, 128.0), torch.zeros(1)]),
        torch.cat([torch.arange(-127.0, -84.0), torch.tensor([127.0])]),
    ]
    order = torch.Generator().manual_seed(rank if dist.get_world_size() == 2 else 0)
    values = torch.cat([b[torch.randperm(b.numel(), generator=order)] for b in blocks])
    inner = values.neg()  # outer 0: the pseudo-gradient is ``values``
    exact = {}
    for outer_dtype in ("float32", "bfloat16", "int8"):
        sync, state, param = OuterSync(layout, outer_dtype), {}, torch.zeros(300)
        sync.start([({}, param)], [torch.zeros(300)], [inner.clone()], [state])
        averaged = list(next(sync.ready()).pseudo_grads)
        kept = [state.get(key, torch.zeros(300)) for key in ("outer_residual", "outer_server_residual")]
        exact[outer_dtype] = (averaged[0].clone(), torch.cat(kept))
    facts["exact"] = exact
    torch.save(facts, out / f"compressed_rank{rank}.pt")


def one_rank_leaves(out: Path, rank: int) -> None:
    """Rank 1 raises before the first outer step; rank 0 goes on into the outer all-reduce and must fail."""
    model = build_mlp(torch.float32)
    optimizer = diloco(model)
    train(model, model, optimizer, range(INNER_STEPS - 1))
    if rank == 1:
        raise RuntimeError("rank 1 fails before the outer step")
    train(model, model, optimizer, range(INNER_STEPS - 1, INNER_STEPS))
    (out / "rank0_passed_the_outer_step").write_text("")  # must not happen


def seams(out: Path, rank: int) -> None:
    """M = W workers (2 or 4): the state cleared mid-period on every process, parameters unfrozen after construction
    (each rank training its own head), a checkpoint taken in train mode."""
    world_size = dist.get_world_size()
    facts: dict[str, Any] = {}

    # state.clear() after 2 of the 3 inner steps of the first period, on every process.
    model = build_mlp(torch.float32)
    optimizer = diloco(model)
    train(model, model, optimizer, range(INNER_STEPS - 1))
    optimizer.state.clear()
    facts["cleared"] = []
    train(model, model, optimizer, range(INNER_STEPS - 1, STEPS), facts["cleared"])

    # Two heads frozen when the optimizer is built, unfrozen on every process after it; rank r trains head r % 2 only
    # (so each head first has a gradient on some ranks, not on others).
    torch.manual_seed(0)
    heads = torch.nn.ModuleList([torch.nn.Linear(6, 1) for _ in range(2)]).requires_grad_(False)
    optimizer = diloco(heads)
    facts["unfrozen_start"] = [p.detach().clone() for p in heads.parameters()]
    heads.requires_grad_(True)
    for step in range(STEPS):
        optimizer.zero_grad()
        inputs, targets = rank_rows(step, rank, world_size, torch.float32)
        torch.nn.functional.mse_loss(heads[rank % 2](inputs), targets).backward()
        optimizer.step()
    facts["unfrozen_outer"] = [optimizer.state[p].get("outer") for p in heads.parameters()]

    # The DDP habit: in train mode (without eval()), the model saved by rank 0 and every rank's optimizer state, in the
    # middle of a period (the parameters hold each worker's own inner weights); a resume from those files, then the
    # outer steps at 3 and 6, against the uninterrupted run.
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        model = build_mlp(dtype)
        optimizer = diloco(model)
        train(model, model, optimizer, range(INNER_STEPS - 1), dtype=dtype)
        if rank == 0:
            torch.save(model.state_dict(), out / f"train_mode_model_{name}.pt")
        torch.save(optimizer.state_dict(), out / f"train_mode_optimizer_{name}_rank{rank}.pt")
        dist.barrier()  # rank 0's model file is written before any rank reads it
        facts[f"uninterrupted_{name}"] = []
        train(model, model, optimizer, range(INNER_STEPS - 1, STEPS), facts[f"uninterrupted_{name}"], dtype)
        model = build_mlp(dtype)
        optimizer = diloco(model)
        model.load_state_dict(torch.load(out / f"train_mode_model_{name}.pt", weights_only=True))
        optimizer.load_state_dict(torch.load(out / f"train_mode_optimizer_{name}_rank{rank}.pt", weights_only=True))
        facts[f"resumed_{name}"] = []
        train(model, model, optimizer, range(INNER_STEPS - 1, STEPS), facts[f"resumed_{name}"], dtype)
    torch.save(facts, out / f"seams_rank{rank}.pt")


def overlap(out: Path, rank: int) -> None:
    """Two workers, streaming (H = 6, P = 2) with the outer sync overlapped by tau = 0, 1, 2 inner steps (alpha 0 and
    0.5); a resume from a state saved with a sync in flight; the arguments refused at construction."""
    facts: dict[str, Any] = {}
    h, p, steps = OVERLAP["inner_steps"], OVERLAP["num_fragments"], OVERLAP["steps"]
    for tau, alpha in OVERLAPS:
        model = build_mlp(torch.float32)
        optimizer = diloco(model, inner_steps=h, num_fragments=p, overlap_steps=tau, overlap_alpha=alpha)
        facts[f"tau{tau}_alpha{alpha}"] = []
        train(model, model, optimizer, range(steps), facts[f"tau{tau}_alpha{alpha}"])
        facts[f"tau{tau}_alpha{alpha}_traffic"] = dataclasses.asdict(optimizer.outer_traffic)

    # Saved in eval mode after step 4 (tau = 2, alpha = 0.5), with fragment 1's sync of step 3 in flight.
    model = build_mlp(torch.float32)
    optimizer = diloco(model, inner_steps=h, num_fragments=p, overlap_steps=2, overlap_alpha=0.5)
    train(model, model, optimizer, range(OVERLAP_RESUME_AT))
    facts["in_flight_at_save"] = len(optimizer.sync.pending)
    optimizer.eval()
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(checkpoint, out / f"overlap_checkpoint_{rank}.pt")
    optimizer.train()
    facts["uninterrupted"] = []
    train(model, model, optimizer, range(OVERLAP_RESUME_AT, steps), facts["uninterrupted"])
    checkpoint = torch.load(out / f"overlap_checkpoint_{rank}.pt", weights_only=True)
    facts["saved_pending"] = [
        (index, entry["pending_steps"])
        for index, entry in checkpoint["optimizer"]["state"].items()
        if "pending_pseudo_gradient" in entry
    ]
    model = build_mlp(torch.float32)
    optimizer = diloco(model, inner_steps=h, num_fragments=p, overlap_steps=2, overlap_alpha=0.5)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    optimizer.train()
    facts["resumed"] = []
    train(model, model, optimizer, range(OVERLAP_RESUME_AT, steps), facts["resumed"])

    for name, kwargs in {
        "negative": dict(overlap_steps=-1),
        "too_long": dict(overlap_steps=3),
        "no_fragments": dict(overlap_steps=1, num_fragments=1),
        "compressed": dict(overlap_steps=1, outer_dtype="bfloat16"),
        "alpha": dict(overlap_steps=1, overlap_alpha=1.5),
        "alpha_without_overlap": dict(overlap_alpha=0.5),
        "one_worker": dict(overlap_steps=1, num_workers=1),
    }.items():
        facts[f"refused_{name}"] = error_of(
            lambda kwargs=kwargs: diloco(build_mlp(torch.float32), **{"inner_steps": h, "num_fragments": p, **kwargs})
        )
    torch.save(facts, out / f"overlap_rank{rank}.pt")


def _sharded_mlp(mesh: Any) -> torch.nn.Module:
    """``build_mlp`` sharded by FSDP2 (one group per Linear, then the root, as accelerate applies it) over ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    model = build_mlp(torch.float32)
    for module in model:
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (an all-gather over its mesh: every process of the mesh calls it), a copy."""
    return t.full_tensor().clone() if hasattr(t, "full_tensor") else t.detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def fsdp_snapshot(model: torch.nn.Module, optimizer: DiLoCo) -> dict[str, list[torch.Tensor]]:
    """`snapshot` of a model sharded inside the island: the whole tensors (gathered in the island), and this
    process's shards of the outer weights and momentum (``local_*``)."""
    params = list(model.parameters())
    held: dict[str, list[torch.Tensor]] = {
        "inner": [_full(p) for p in params],
        "outer": [_full(optimizer.state[p]["outer"]) for p in params],
        "momentum": [_full(optimizer.state[p]["outer_momentum_buffer"]) for p in params],
    }
    for key, state_key in (("inner", None), ("outer", "outer"), ("momentum", "outer_momentum_buffer")):
        held[f"local_{key}"] = [_local(p if state_key is None else optimizer.state[p][state_key]) for p in params]
    return held


def fsdp_islands(out: Path, rank: int) -> None:
    """FSDP2 inside each of 2 islands of 2 processes (a ("worker", "shard") mesh, ``fully_shard`` over "shard"): the
    run, a resume from a state taken in train mode mid-period (kept in memory, and saved to files with torch's
    distributed checkpoint as the docs' loop does), and the meshes that are not the island, refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    facts: dict[str, Any] = {}
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("worker", "shard"))
    model = _sharded_mlp(mesh["shard"])
    optimizer = diloco(model, num_workers=2)
    facts["layout"] = {**optimizer.layout.saved(), "worker": optimizer.layout.worker}
    facts["shard_ranks"] = mesh["shard"].mesh.tolist()
    facts["run"] = []
    for step in range(STEPS):
        optimizer.zero_grad()
        mse(model, *rank_rows(step, rank, world_size, torch.float32)).backward()
        optimizer.step()
        facts["run"].append(fsdp_snapshot(model, optimizer))
        if step + 1 == RESUME_AT:  # mid-period (H = 3: after the outer step at 3), in train mode
            saved = copy.deepcopy(optimizer.state_dict())
            for mode in ("eval", "train"):  # saved to files as the docs' loop saves: in eval mode; and in train mode
                if mode == "eval":
                    optimizer.eval()
                model_state, optimizer_state = get_state_dict(model, optimizer)
                dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(out / f"dcp_{mode}"))
                optimizer.train()

    for name in ("resumed", "dcp_resumed", "dcp_train_mode", "written_after_load"):
        model = _sharded_mlp(mesh["shard"])
        optimizer = diloco(model, num_workers=2)
        if name in ("resumed", "written_after_load"):
            optimizer.load_state_dict(saved)
        else:  # the template of the loading optimizer, filled from the files, loaded into model and optimizer
            optimizer.init_state(eval_mode=name == "dcp_resumed")
            model_state, optimizer_state = get_state_dict(model, optimizer)
            template = {"model": model_state, "optim": optimizer_state}
            dcp.load(template, checkpoint_id=str(out / ("dcp_eval" if name == "dcp_resumed" else "dcp_train")))
            set_state_dict(model, optimizer, model_state_dict=template["model"], optim_state_dict=template["optim"])
            optimizer.train()
        facts[name] = []
        for step in range(RESUME_AT, STEPS):
            optimizer.zero_grad()
            mse(model, *rank_rows(step, rank, world_size, torch.float32)).backward()
            if name == "written_after_load":  # rank 0 writes a parameter after the load, as a model loaded last would
                if rank == 0:
                    with torch.no_grad():
                        next(model.parameters()).to_local().add_(1.0)
                facts[f"{name}_refused"] = error_of(optimizer.step)
                break
            optimizer.step()
            facts[name].append(fsdp_snapshot(model, optimizer))

    # Meshes that are not this process's island: all 4 processes; the strided ranks {0, 2}, {1, 3}; HSDP's 2-D mesh.
    wrong = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("shard", "worker"))
    for name, other in (("all", init_device_mesh("cpu", (world_size,))), ("strided", wrong["shard"]), ("hsdp", mesh)):
        facts[f"refused_{name}"] = error_of(lambda other=other: diloco(_sharded_mlp(other), num_workers=2))
    overlapped = dict(inner_steps=4, num_fragments=2, overlap_steps=1)
    for name, kwargs in (("int8", dict(outer_dtype="int8")), ("overlap", overlapped)):
        facts[f"refused_{name}"] = error_of(
            lambda kwargs=kwargs: diloco(_sharded_mlp(mesh["shard"]), num_workers=2, **kwargs)
        )
    torch.save(facts, out / f"fsdp_islands_rank{rank}.pt")


def _same(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> bool:
    return all(torch.equal(x, y) for key in a for x, y in zip(a[key], b[key]))


SCENARIOS = {
    "two_ranks": two_ranks,
    "four_ranks": four_ranks,
    "one_rank_leaves": one_rank_leaves,
    "compressed": compressed,
    "seams": seams,
    "overlap": overlap,
    "fsdp_islands": fsdp_islands,
}


def main(scenario: str, out: str, rank: str, world_size: str) -> None:
    out_dir = Path(out).resolve()
    torch.set_num_threads(1)  # the ranks share 2 cores in CI
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/rendezvous",
        rank=int(rank),
        world_size=int(world_size),
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        SCENARIOS[scenario](out_dir, int(rank))
        dist.barrier()  # every rank done before any tears its connections down (gloo can abort at exit otherwise)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
