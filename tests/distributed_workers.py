"""Worker code for tests/test_distributed.py: each scenario runs inside 2 CPU processes started by torchrun (gloo).

Workers only observe and write what they saw to an output directory (full tensors gathered on rank 0 as ``*.pt``,
per-rank facts as ``facts_rank{r}.json``); the tests compare those files with an unsharded single-process run
computed in the pytest process. The model and data helpers below are shared by both sides, so the oracle sees the
same initial weights and the same global batches.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_workers.py SCENARIO OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS = 3  # steps of every FSDP2 scenario
GLOBAL_BATCH = 8  # rows per step, split evenly over the ranks
ADAMW_KW: dict[str, Any] = dict(lr=0.05, betas=(0.9, 0.99), weight_decay=0.1, mu_x=0.9, mu_y=0.5)
SGD_KW: dict[str, Any] = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, mu_x=0.9, mu_y=0.5)


# ---------------------------------------------------------------- shared with the oracle


def build_mlp(dtype: torch.dtype) -> nn.Sequential:
    """A small MLP whose shapes shard unevenly over 2 ranks (15 -> 8 + 7 rows; the last weight has 1 row, so one
    rank holds an empty shard)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 15), nn.Tanh(), nn.Linear(15, 9), nn.Tanh(), nn.Linear(9, 1)).to(dtype)


def global_batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs (GLOBAL_BATCH, 6) and targets (GLOBAL_BATCH, 1)."""
    gen = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(GLOBAL_BATCH, 6, generator=gen, dtype=dtype)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def mse(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(inputs), targets)


def oracle_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, dtype: torch.dtype) -> None:
    """Single-process training on the full global batch: what the sharded run must reproduce."""
    for step in steps:
        mse(model, *global_batch(step, dtype)).backward()
        optimizer.step()
        optimizer.zero_grad()


# ---------------------------------------------------------------- FSDP2 helpers (workers only)


def _rank_rows(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's half of the global batch; FSDP2 averages the gradients over ranks, giving the global mean."""
    import torch.distributed as dist

    inputs, targets = global_batch(step, dtype)
    rows = GLOBAL_BATCH // dist.get_world_size()
    sl = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
    return inputs[sl], targets[sl]


def _shard(model: nn.Module) -> nn.Module:
    """FSDP2 as accelerate applies it: one group per Linear, then the root."""
    from torch.distributed.fsdp import fully_shard

    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module)
    return fully_shard(model)


def _train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, dtype: torch.dtype) -> None:
    for step in steps:
        mse(model, *_rank_rows(step, dtype)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _locals(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    from hf_gpa.optim._modes import local_tensor

    return [local_tensor(t).detach().clone() for t in tensors]


def _all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer, key: str) -> list[torch.Tensor]:
    """Full (unsharded) ``optimizer.state[p][key]`` for every parameter, gathered on every rank."""
    return [optimizer.state[p][key].full_tensor() for p in model.parameters()]


def _full_x(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The README's x export under FSDP2: switch to x, gather a full state dict (on rank 0, offloaded to CPU)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hf_gpa.checkpoint import evaluation_weights

    with evaluation_weights(optimizer):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _global_loss(model: nn.Module, step: int, dtype: torch.dtype) -> float:
    import torch.distributed as dist

    with torch.no_grad():
        loss = mse(model, *_rank_rows(step, dtype)).detach()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item()


def _save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def _load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """DCP's resume recipe: the fresh optimizer's state dict is the load target (DCP creates its state first)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])


# ---------------------------------------------------------------- scenarios


def fsdp2(out: Path) -> None:
    """GPA on FSDP2 shards: steps, train/eval switching, x export, memory, lazy state, sharded save/resume."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hf_gpa import GPA, GPAAdamW
    from hf_gpa.optim._kernels import load_cpu_kernel

    rank = dist.get_rank()
    f64 = torch.float64
    facts: dict[str, Any] = {"world_size": dist.get_world_size()}
    full: dict[str, Any] = {}

    # GPAAdamW, foreach path, fp64; the optimizer is built after wrapping, as accelerate does under FSDP2.
    model = _shard(build_mlp(f64))
    opt = GPAAdamW(model.parameters(), **ADAMW_KW, foreach=True)
    facts["params_are_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
    facts["state_entries_before_step"] = len(opt.state)
    _train_steps(model, opt, range(1), f64)
    # Train/eval switching on shards after the first step: x in the parameters, y back bitwise.
    y_before = _locals(model.parameters())
    opt.eval()
    opt.eval()
    facts["loss_at_x_after_step_1"] = _global_loss(model, 0, f64)
    try:
        opt.step()
        facts["step_in_eval_raises"] = False
    except RuntimeError:
        facts["step_in_eval_raises"] = True
    opt.train()
    opt.train()
    facts["y_bitwise_after_switch"] = _all_equal(y_before, _locals(model.parameters()))
    _train_steps(model, opt, range(1, STEPS), f64)

    states = [opt.state[p] for p in model.parameters()]
    facts["state_keys"] = sorted({k for s in states for k in s})
    facts["state_sharded_like_params"] = all(
        isinstance(s[k], DTensor) and s[k].placements == p.placements and s[k].device_mesh == p.device_mesh
        for p, s in zip(model.parameters(), states)
        for k in ("z", "exp_avg", "exp_avg_sq")
    )
    shard_bytes = sum(p.to_local().nbytes for p in model.parameters())
    state_bytes = sum(s[k].to_local().nbytes for s in states for k in ("z", "exp_avg", "exp_avg_sq"))
    facts["local_param_bytes"] = shard_bytes
    facts["local_state_bytes"] = state_bytes
    full["adamw_y"] = [p.full_tensor() for p in model.parameters()]
    for key in ("z", "exp_avg", "exp_avg_sq"):
        full[f"adamw_{key}"] = _full_state(model, opt, key)
    y_before = _locals(model.parameters())
    x_sd = _full_x(model, opt)
    facts["x_export_keys"] = sorted(x_sd)
    facts["y_bitwise_after_export"] = _all_equal(y_before, _locals(model.parameters()))
    facts["train_mode_after_export"] = opt.train_mode
    full["adamw_x"] = x_sd

    # The default construction (fused CPU kernel when it builds, else foreach), fp32.
    model = _shard(build_mlp(torch.float32))
    opt = GPAAdamW(model.parameters(), **ADAMW_KW)
    _train_steps(model, opt, range(STEPS), torch.float32)
    facts["fused_kernel_available"] = load_cpu_kernel() is not None
    full["default_fp32_y"] = [p.full_tensor() for p in model.parameters()]
    full["default_fp32_x"] = _full_x(model, opt)

    # The GPA wrapper around SGD (Nesterov): the base optimizer is built lazily on the DTensor z shards.
    model = _shard(build_mlp(f64))
    opt = GPA(model.parameters(), base=torch.optim.SGD, **SGD_KW)
    _train_steps(model, opt, range(STEPS), f64)
    full["gpa_sgd_y"] = [p.full_tensor() for p in model.parameters()]
    full["gpa_sgd_x"] = _full_x(model, opt)

    # The optimizer built before wrapping (as Trainer.create_optimizer does), its parameters then switched to the
    # shards by accelerate's own helper: nothing was created early, so nothing is lost.
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters

    model = build_mlp(f64)
    opt = GPAAdamW(model.parameters(), **ADAMW_KW, foreach=True)
    names = [n for n, _ in model.named_parameters()]
    old = {n: p.data_ptr for n, p in model.named_parameters()}
    facts["prewrap_state_entries"] = len(opt.state)
    _shard(model)
    new = dict(model.named_parameters())
    fsdp2_switch_optimizer_parameters(opt, {old[n]: new[n] for n in names})
    _train_steps(model, opt, range(STEPS), f64)
    full["prewrap_y"] = [p.full_tensor() for p in model.parameters()]

    # Sharded (DCP) checkpoint after 2 of 4 steps, in train mode and in eval mode; both resumes must continue
    # bitwise like the uninterrupted run.
    model = _shard(build_mlp(f64))
    opt = GPAAdamW(model.parameters(), **ADAMW_KW, foreach=True)
    _train_steps(model, opt, range(2), f64)
    _save_sharded(model, opt, out / "ckpt_train_mode")
    opt.eval()
    _save_sharded(model, opt, out / "ckpt_eval_mode")
    opt.train()
    _train_steps(model, opt, range(2, 4), f64)
    y_ref, z_ref = _locals(model.parameters()), _locals(opt.state[p]["z"] for p in model.parameters())
    for mode in ("train_mode", "eval_mode"):
        model = _shard(build_mlp(f64))
        opt = GPAAdamW(model.parameters(), **ADAMW_KW, foreach=True)
        _load_sharded(model, opt, out / f"ckpt_{mode}")
        opt.train()
        _train_steps(model, opt, range(2, 4), f64)
        z = _locals(opt.state[p]["z"] for p in model.parameters())
        facts[f"resume_{mode}_bitwise"] = _all_equal(y_ref, _locals(model.parameters())) and _all_equal(z_ref, z)

    _write(out, rank, facts, full)


SCENARIOS: dict[str, Callable[[Path], None]] = {"fsdp2": fsdp2}


def _write(out: Path, rank: int, facts: dict[str, Any], full: dict[str, Any] | None = None) -> None:
    (out / f"facts_rank{rank}.json").write_text(json.dumps(facts, indent=1, sort_keys=True))
    if full is not None and rank == 0:
        torch.save(full, out / "full.pt")


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    scenario, out = argv[0], Path(argv[1])
    torch.set_num_threads(1)  # CI shares 2 cores among 2 ranks
    dist.init_process_group("gloo")
    try:
        SCENARIOS[scenario](out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
