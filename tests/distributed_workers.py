"""Worker code for tests/test_distributed.py: each scenario runs in 2 CPU processes (gloo), started by a launcher.

Workers only observe and write what they saw to an output directory (full tensors gathered on rank 0 as ``*.pt``,
per-rank facts as ``facts_rank{r}.json``); the tests compare those files with an unsharded single-process run
computed in the pytest process. The model and data helpers below are shared by both sides, so the oracle sees the
same initial weights and the same global batches.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_workers.py fsdp2 OUT_DIR
    accelerate launch --config_file configs/accelerate_ddp.yaml tests/distributed_workers.py ddp_trainer OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tensors import TokenDataset
from torch import nn

STEPS = 3  # steps of every FSDP2 scenario
GLOBAL_BATCH = 8  # rows per step, split evenly over the ranks
ADAMW_KW: dict[str, Any] = dict(lr=0.05, betas=(0.9, 0.99), weight_decay=0.1, mu_x=0.9, mu_y=0.5)
SGD_KW: dict[str, Any] = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, mu_x=0.9, mu_y=0.5)
DILOCO_KW: dict[str, Any] = dict(inner_steps=2, outer_lr=0.7, outer_momentum=0.9, lr=0.05, weight_decay=0.1)


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


# ---------------------------------------------------------------- DDP through GPATrainer (shared with the oracle)

DDP_STEPS = 4  # checkpoints at steps 2 and 4; the resume starts from step 2
DDP_PER_DEVICE_BATCH = 2  # x NPROC ranks = the oracle's single-process batch


def trainer_args(output_dir: Path, per_device_train_batch_size: int, **overrides: Any) -> Any:
    from hf_gpa import GPATrainingArguments

    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir),
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        max_steps=DDP_STEPS,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        learning_rate=1e-2,
        per_device_train_batch_size=per_device_train_batch_size,
        per_device_eval_batch_size=2,
        optim="gpa_adamw",
        gpa_mu_x=0.5,  # a short memory: x, y and z are far apart after a few steps
        gpa_mu_y=0.7,
    )
    kwargs.update(overrides)
    return GPATrainingArguments(**kwargs)


def make_trainer(output_dir: Path, per_device_train_batch_size: int, **overrides: Any) -> Any:
    from helpers import tiny_llama

    from hf_gpa import GPATrainer

    return GPATrainer(
        model=tiny_llama(),
        args=trainer_args(output_dir, per_device_train_batch_size, **overrides),
        train_dataset=TokenDataset(32, seed=1),
        eval_dataset=TokenDataset(8, seed=2),
    )


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
    from hf_gpa.optim._tensors import local_tensor

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

    from hf_gpa import GPA, DiLoCo, GPAAdamW
    from hf_gpa.optim.kernels.cpu import load_cpu_kernel

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
    facts["default_implementation"] = ",".join(sorted({plan.impl for plan in opt._plans.values()}))  # the steps taken
    full["default_fp32_y"] = [p.full_tensor() for p in model.parameters()]
    full["default_fp32_x"] = _full_x(model, opt)

    # The GPA wrapper around SGD (Nesterov): the base optimizer is built lazily on the DTensor z shards.
    model = _shard(build_mlp(f64))
    opt = GPA(model.parameters(), base=torch.optim.SGD, **SGD_KW)
    _train_steps(model, opt, range(STEPS), f64)
    full["gpa_sgd_y"] = [p.full_tensor() for p in model.parameters()]
    full["gpa_sgd_x"] = _full_x(model, opt)

    # DiLoCo (the baseline) around AdamW: one outer step within the 3 steps; its outer weights are its x.
    model = _shard(build_mlp(f64))
    opt = DiLoCo(model.parameters(), base=torch.optim.AdamW, **DILOCO_KW)
    _train_steps(model, opt, range(STEPS), f64)
    full["diloco_y"] = [p.full_tensor() for p in model.parameters()]
    full["diloco_x"] = _full_x(model, opt)

    # The optimizer built before wrapping (as Trainer.create_optimizer does), its parameters then switched to the
    # shards by accelerate's own helper: nothing was created early, so nothing is lost.
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters

    model = build_mlp(f64)
    opt = GPAAdamW(model.parameters(), **ADAMW_KW, foreach=True)
    names = [n for n, _ in model.named_parameters()]
    old = {n: p.data_ptr for n, p in model.named_parameters()}  # the helper looks params up by `p.data_ptr`
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
        if mode == "eval_mode":  # the load template must hold the eval-mode keys (DCP fills only those)
            opt.init_state(eval_mode=True)
        _load_sharded(model, opt, out / f"ckpt_{mode}")
        if mode == "eval_mode":  # what train() needs to restore y from x: every shard's own residual
            facts["eval_mode_residuals_loaded"] = all("y_residual" in opt.state[p] for p in model.parameters())
        opt.train()
        _train_steps(model, opt, range(2, 4), f64)
        z = _locals(opt.state[p]["z"] for p in model.parameters())
        facts[f"resume_{mode}_bitwise"] = _all_equal(y_ref, _locals(model.parameters())) and _all_equal(z_ref, z)

    _write(out, rank, facts, full)


class _WriteSpy:
    """Records what this rank writes under ``root``: Python-level opens for writing, mkdir/rename (audit hook), plus
    ``torch.save`` and ``save_pretrained`` calls, whose bytes are written from native code the hook cannot see."""

    def __init__(self, root: Path) -> None:
        import transformers

        self.root, self.events = str(root), []
        sys.addaudithook(self._audit)
        save, save_pretrained = torch.save, transformers.PreTrainedModel.save_pretrained

        def spy_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            self._record("torch.save", f)
            return save(obj, f, *args, **kwargs)

        def spy_save_pretrained(model: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
            self._record("save_pretrained", save_directory)
            return save_pretrained(model, save_directory, *args, **kwargs)

        torch.save = spy_save
        transformers.PreTrainedModel.save_pretrained = spy_save_pretrained

    def _record(self, event: str, path: Any) -> None:
        if isinstance(path, (str, os.PathLike)) and os.path.abspath(path).startswith(self.root):
            self.events.append([event, os.path.relpath(os.path.abspath(path), self.root)])

    def _audit(self, event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[1], str) and set(args[1]) & set("wax+"):
            self._record(event, args[0])
        elif event in ("os.mkdir", "os.rename", "os.remove", "shutil.rmtree"):
            self._record(event, args[0])


def _y_and_z(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """y (the parameters, in train mode) and z of every parameter, by name."""
    from hf_gpa.checkpoint import unwrap_gpa_optimizer

    opt = unwrap_gpa_optimizer(trainer.optimizer)
    opt.train()
    named = list(trainer.model.named_parameters())
    return {
        "y": {n: p.detach().clone() for n, p in named},
        "z": {n: opt.state[p]["z"].detach().clone() for n, p in named},
    }


def ddp_trainer(out: Path) -> None:
    """GPATrainer under DDP (launched by accelerate): train, evaluate at x, save x, and resume from step 2."""
    from transformers import TrainerCallback

    from hf_gpa.checkpoint import unwrap_gpa_optimizer

    class EvalModeProbe(TrainerCallback):
        """At each evaluation batch: does the optimizer hold x (eval mode) in the parameters?"""

        def __init__(self) -> None:
            self.train_mode_during_eval: list[bool] = []

        def on_prediction_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
            self.train_mode_during_eval.append(unwrap_gpa_optimizer(optimizer).train_mode)

    spy = _WriteSpy(out)
    trainer = make_trainer(out / "run", DDP_PER_DEVICE_BATCH)
    import torch.distributed as dist

    rank = dist.get_rank()
    probe = EvalModeProbe()
    trainer.add_callback(probe)
    trainer.train()
    y_before_eval = _y_and_z(trainer)["y"]
    metrics = trainer.evaluate()
    facts: dict[str, Any] = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "eval_loss": metrics["eval_loss"],
        "train_mode_during_eval": probe.train_mode_during_eval,
        "train_mode_after_eval": unwrap_gpa_optimizer(trainer.optimizer).train_mode,
        "y_bitwise_after_eval": all(torch.equal(y_before_eval[n], p) for n, p in trainer.model.named_parameters()),
    }
    trainer.save_model(str(out / "run" / "final"))
    uninterrupted = _y_and_z(trainer)

    resumed = make_trainer(out / "resumed", DDP_PER_DEVICE_BATCH)
    resumed.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
    resumed.save_model(str(out / "resumed" / "final"))
    after_resume = _y_and_z(resumed)
    facts["resume_bitwise"] = all(
        torch.equal(uninterrupted[k][n], after_resume[k][n]) for k in ("y", "z") for n in uninterrupted[k]
    )
    facts["writes"] = list(spy.events)
    dist.barrier()
    torch.save(uninterrupted, out / f"y_z_rank{rank}.pt")  # after the spy's events were taken
    _write(out, rank, facts)


SCENARIOS: dict[str, Callable[[Path], None]] = {"fsdp2": fsdp2, "ddp_trainer": ddp_trainer}


def _write(out: Path, rank: int, facts: dict[str, Any], full: dict[str, Any] | None = None) -> None:
    (out / f"facts_rank{rank}.json").write_text(json.dumps(facts, indent=1, sort_keys=True))
    if full is not None and rank == 0:
        torch.save(full, out / "full.pt")


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    scenario, out = argv[0], Path(argv[1]).resolve()
    torch.set_num_threads(1)  # CI shares 2 cores among 2 ranks
    if not dist.is_initialized() and scenario != "ddp_trainer":  # the Trainer's accelerator starts its own
        dist.init_process_group("gloo")
    try:
        SCENARIOS[scenario](out)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
