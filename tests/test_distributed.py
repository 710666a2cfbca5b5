"""GPA across processes: FSDP2 (``fully_shard``, DTensor shards) and DDP through `GPATrainer`, 2 CPU ranks on gloo.

Each scenario is one launch of ``tests/distributed_workers.py`` -- FSDP2 by ``torchrun --standalone`` (the OS picks
the port), DDP by ``accelerate launch`` with ``configs/accelerate_ddp.yaml`` on a free port -- in its own process
group, killed on timeout so that a hang fails the test instead of blocking CI.
The workers only report; the asserts here compare their files with an unsharded single-process run of the same
model on the same global batches. The launches are shared between tests through module-scoped fixtures.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import distributed_workers as dw
import pytest
import torch
from helpers import tiny_llama
from launching import LAUNCH_TIMEOUT_S, free_port, launch_env, run_logged
from safetensors.torch import load_file

from hf_gpa import GPA, DiLoCo, GPAAdamW
from hf_gpa.optim.kernels import cpu as _kernels

WORKERS = Path(__file__).with_name("distributed_workers.py")
NPROC = 2
F64 = dict(rtol=1e-10, atol=1e-12)  # reduction order only (the gradient all-reduce/reduce-scatter)
F32 = dict(rtol=1e-5, atol=1e-6)
# DDP vs one process, fp32 Llama: Adam's normalization turns the all-reduce's ~1e-7 gradient differences into up to
# ~5e-7 in the weights (measured), against updates of ~1e-2 (lr) per step.
DDP_TOL = dict(rtol=1e-4, atol=1e-5)


def launch(launcher: list[str], scenario: str, out: Path, timeout: float = LAUNCH_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run ``scenario`` with ``python <launcher...> distributed_workers.py`` and return each rank's facts.

    The launch runs in its own session, killed as a group on timeout; a failure or a hang fails the test with the
    end of the log (``launching.run_logged``).
    """
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, *launcher, str(WORKERS), scenario, str(out)]
    run_logged(cmd, out / "launch.log", launch_env(WORKERS.parent.parent), timeout, what=scenario)
    return [json.loads((out / f"facts_rank{r}.json").read_text()) for r in range(NPROC)]


def torchrun(scenario: str, out: Path) -> list[dict[str, Any]]:
    """``torchrun --standalone``: NPROC CPU ranks on a port the OS picks."""
    return launch(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}"], scenario, out)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by its new parent, counts as dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_hanging_launch_fails_and_its_ranks_are_killed(tmp_path: Path) -> None:
    """A launch that hangs fails at its timeout, and its whole process group, the ranks included, is killed."""
    # Stands in for a launcher whose rank never returns from a collective: no torch, so it starts in milliseconds.
    hang = (
        "import subprocess, sys, time; "
        "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "open(sys.argv[3] + '/rank.pid', 'w').write(str(rank.pid)); time.sleep(600)"
    )
    with pytest.raises(pytest.fail.Exception, match="hung"):
        launch(["-c", hang], "hang", tmp_path, timeout=5)
    pid = int((tmp_path / "rank.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:  # SIGKILL is delivered asynchronously
        time.sleep(0.05)
    assert not _alive(pid)


# ---------------------------------------------------------------- FSDP2 (fully_shard on CPU, gloo)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One launch of the FSDP2 scenario: per-rank facts and the full tensors rank 0 gathered."""
    _kernels.load_cpu_kernel()  # build (or find) the fused kernel here, once, not inside the timed-out launch
    out = tmp_path_factory.mktemp("fsdp2")
    facts = torchrun("fsdp2", out)
    return facts, torch.load(out / "full.pt", weights_only=True)


def _oracle(opt_cls: type, kwargs: dict[str, Any], dtype: torch.dtype, steps: int = dw.STEPS) -> tuple:
    """The unsharded single-process run: model and optimizer after ``steps`` full-batch steps."""
    model = dw.build_mlp(dtype)
    opt = opt_cls(model.parameters(), **kwargs)
    dw.oracle_steps(model, opt, range(steps), dtype)
    return model, opt


def _x_state_dict(model: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    opt.eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    opt.train()
    return sd


def _assert_all_close(actual: list[torch.Tensor], expected: list[torch.Tensor], tol: dict[str, float]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e.detach(), **tol)


def _assert_matches_at_y_and_x(
    full: dict[str, Any], run: str, model: torch.nn.Module, opt: Any, tol: dict[str, float]
) -> None:
    """The sharded run ``run`` (its gathered ``{run}_y`` and ``{run}_x``) equals the unsharded ``model`` and ``opt``
    at y (the parameters) and at x (the state dict under opt.eval())."""
    _assert_all_close(full[f"{run}_y"], list(model.parameters()), tol)
    expected_x = _x_state_dict(model, opt)
    _assert_all_close([full[f"{run}_x"][k] for k in expected_x], list(expected_x.values()), tol)


def test_fsdp2_gpa_adamw_step_on_shards_matches_unsharded(fsdp2: tuple) -> None:
    """y, z and both Adam moments after 3 sharded steps equal the unsharded for-loop run (fp64)."""
    _, full = fsdp2
    model, opt = _oracle(GPAAdamW, {**dw.ADAMW_KW, "foreach": False}, torch.float64)
    params = list(model.parameters())
    _assert_all_close(full["adamw_y"], params, F64)
    for key in ("z", "exp_avg", "exp_avg_sq"):
        _assert_all_close(full[f"adamw_{key}"], [opt.state[p][key] for p in params], F64)


def test_fsdp2_default_construction_matches_unsharded(fsdp2: tuple) -> None:
    """GPAAdamW's default path (fused CPU kernel on local shards) equals the unsharded run, at y and x (fp32)."""
    facts, full = fsdp2
    fused = _kernels.load_cpu_kernel() is not None
    for f in facts:
        assert f["fused_kernel_available"] == fused
        assert f["default_implementation"] == ("fused" if fused else "foreach")  # the shards are contiguous
    model, opt = _oracle(GPAAdamW, {**dw.ADAMW_KW, "foreach": False}, torch.float32)
    _assert_matches_at_y_and_x(full, "default_fp32", model, opt, F32)


def test_fsdp2_gpa_wrapper_matches_unsharded(fsdp2: tuple) -> None:
    """GPA(base=SGD Nesterov) builds its base on DTensor z shards and equals the unsharded run, at y and x."""
    _, full = fsdp2
    model, opt = _oracle(GPA, {"base": torch.optim.SGD, **dw.SGD_KW}, torch.float64)
    _assert_matches_at_y_and_x(full, "gpa_sgd", model, opt, F64)


def test_fsdp2_diloco_matches_unsharded(fsdp2: tuple) -> None:
    """DiLoCo around AdamW on shards (inner and outer steps) equals the unsharded run, at inner and outer weights."""
    _, full = fsdp2
    model, opt = _oracle(DiLoCo, {"base": torch.optim.AdamW, **dw.DILOCO_KW}, torch.float64)
    _assert_matches_at_y_and_x(full, "diloco", model, opt, F64)


def test_fsdp2_optimizer_state_created_lazily_after_wrapping(fsdp2: tuple) -> None:
    """No state before the first step; then z, m, v are DTensors sharded exactly like their parameters."""
    facts, full = fsdp2
    for f in facts:
        assert f["params_are_dtensors"]
        assert f["state_entries_before_step"] == 0 and f["prewrap_state_entries"] == 0
        assert f["state_keys"] == ["exp_avg", "exp_avg_sq", "step", "z"]
        assert f["state_sharded_like_params"]
    # Built before fully_shard and switched to the shards by accelerate's helper: the same run as built after.
    model, _ = _oracle(GPAAdamW, {**dw.ADAMW_KW, "foreach": False}, torch.float64)
    _assert_all_close(full["prewrap_y"], list(model.parameters()), F64)


def test_fsdp2_train_eval_switch_on_shards(fsdp2: tuple) -> None:
    """eval() puts x in the shards (the loss there is the unsharded x's), step() raises, train() restores y bitwise."""
    facts, _ = fsdp2
    model, opt = _oracle(GPAAdamW, {**dw.ADAMW_KW, "foreach": False}, torch.float64, steps=1)
    opt.eval()
    with torch.no_grad():
        expected = dw.mse(model, *dw.global_batch(0, torch.float64)).item()
    for f in facts:
        assert f["step_in_eval_raises"]
        assert f["y_bitwise_after_switch"]
        assert f["loss_at_x_after_step_1"] == pytest.approx(expected, rel=1e-12)


def test_fsdp2_x_export_gathers_full_state_dict(fsdp2: tuple) -> None:
    """The full state dict gathered at x on rank 0 equals the unsharded x; each rank keeps y bitwise, in train mode."""
    facts, full = fsdp2
    model, opt = _oracle(GPAAdamW, {**dw.ADAMW_KW, "foreach": False}, torch.float64)
    expected_x = _x_state_dict(model, opt)
    assert facts[0]["x_export_keys"] == sorted(expected_x)
    assert facts[1]["x_export_keys"] == []  # cpu_offload=True: only rank 0 holds the gathered copy
    for name, tensor in expected_x.items():
        torch.testing.assert_close(full["adamw_x"][name], tensor, **F64)
        assert not torch.allclose(full["adamw_x"][name], model.state_dict()[name])  # x really differs from y
    for f in facts:
        assert f["y_bitwise_after_export"] and f["train_mode_after_export"]


def test_fsdp2_state_is_three_times_the_param_shard(fsdp2: tuple) -> None:
    """Per rank, GPAAdamW's state (z, m, v) takes exactly 3.0x the bytes of that rank's parameter shard."""
    facts, _ = fsdp2
    for f in facts:
        assert f["local_state_bytes"] == 3 * f["local_param_bytes"]
    # The shards partition the model (no padding counted), so the per-rank figure is the real footprint.
    full_bytes = sum(p.nbytes for p in dw.build_mlp(torch.float64).parameters())
    assert sum(f["local_param_bytes"] for f in facts) == full_bytes
    assert min(f["local_param_bytes"] for f in facts) < full_bytes / 2 + 1  # really sharded, not replicated


def test_fsdp2_sharded_checkpoint_resumes_bitwise(fsdp2: tuple) -> None:
    """A DCP sharded checkpoint saved in train mode resumes on fresh shards and continues bitwise (y and z)."""
    facts, _ = fsdp2
    assert all(f["resume_train_mode_bitwise"] for f in facts)


def test_fsdp2_eval_mode_checkpoint_resumes_bitwise(fsdp2: tuple) -> None:
    """A DCP checkpoint saved in eval mode (x + sharded residual) resumes bitwise when loaded via init_state(True)."""
    facts, _ = fsdp2
    assert all(f["eval_mode_residuals_loaded"] for f in facts)
    assert all(f["resume_eval_mode_bitwise"] for f in facts)


# ---------------------------------------------------------------- the configs, as `accelerate launch` reads them

CONFIGS = Path(__file__).parent.parent / "configs"


def _launch_settings(config: Path) -> tuple[Any, dict[str, str]]:
    """The arguments and process environment `accelerate launch --config_file config` gives its workers."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(config), "x.py"]))
    return args, prepare_multi_gpu_env(args)


def test_fsdp2_config_builds_the_documented_plugin() -> None:
    """accelerate_fsdp2.yaml gives FSDP2, full sharding, FULL_STATE_DICT saves and no activation checkpointing."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    args, env = _launch_settings(CONFIGS / "accelerate_fsdp2.yaml")
    assert args.use_fsdp and not args.multi_gpu and args.num_processes == NPROC
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True  # FULL_SHARD: parameters re-sharded after the forward
    assert str(plugin.state_dict_type).endswith("FULL_STATE_DICT")  # save_model/checkpoints gather the full x
    assert plugin.activation_checkpointing is False
    assert not isinstance(plugin.cpu_offload, CPUOffloadPolicy)  # GPA's state stays next to its shard


def test_ddp_config_is_plain_data_parallel() -> None:
    """accelerate_ddp.yaml launches NPROC data-parallel processes with no FSDP or DeepSpeed plugin."""
    args, env = _launch_settings(CONFIGS / "accelerate_ddp.yaml")
    assert args.multi_gpu and not args.use_fsdp and not args.use_deepspeed and args.num_processes == NPROC
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"
    assert not any(key.startswith(("FSDP_", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")) for key in env)


# ---------------------------------------------------------------- DDP: GPATrainer under accelerate launch (CPU, gloo)

ACCELERATE_DDP_CONFIG = CONFIGS / "accelerate_ddp.yaml"


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One `accelerate launch` of the DDP scenario with the repository's config (MULTI_CPU here: no GPU)."""
    _kernels.load_cpu_kernel()  # built once here, not by both ranks inside the timed-out launch
    out = tmp_path_factory.mktemp("ddp")
    launcher = ["-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_DDP_CONFIG)]
    launcher += ["--num_processes", str(NPROC), "--main_process_port", str(free_port())]
    return out, launch(launcher, "ddp_trainer", out)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """The oracle: the same Trainer run in one process with the same global batch (NPROC x the per-device batch)."""
    out = tmp_path_factory.mktemp("single")
    trainer = dw.make_trainer(out / "run", NPROC * dw.DDP_PER_DEVICE_BATCH)
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(out / "run" / "final"))
    return out, eval_loss


def test_ddp_runs_on_cpu_gloo(ddp: tuple) -> None:
    """The DDP config launches 2 processes that accelerate runs as MULTI_CPU over gloo (no GPU needed)."""
    _, facts = ddp
    for f in facts:
        assert (f["distributed_type"], f["backend"], f["world_size"]) == ("DistributedType.MULTI_CPU", "gloo", NPROC)


def test_ddp_ranks_hold_bitwise_identical_y_and_z(ddp: tuple) -> None:
    """After training, every rank holds bitwise the same y (parameters) and z (optimizer state)."""
    out, _ = ddp
    states = [torch.load(out / f"y_z_rank{r}.pt", weights_only=True) for r in range(NPROC)]
    for key in ("y", "z"):
        for name, tensor in states[0][key].items():
            for other in states[1:]:
                assert torch.equal(other[key][name], tensor), (key, name)
    assert any(not torch.equal(states[0]["y"][n], states[0]["z"][n]) for n in states[0]["y"])  # y and z differ


@pytest.mark.parametrize("saved", ["checkpoint-2", "checkpoint-4", "final"])
def test_ddp_saved_x_matches_single_process(ddp: tuple, single_process: tuple, saved: str) -> None:
    """The x written under DDP equals the single-process run's x with the same global batch (fp32 reductions)."""
    out, _ = ddp
    single, _ = single_process
    actual = load_file(out / "run" / saved / "model.safetensors")
    expected = load_file(single / "run" / saved / "model.safetensors")
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **DDP_TOL)
    initial = tiny_llama().state_dict()
    moved = max((expected[n] - initial[n]).abs().max().item() for n in expected)
    assert moved > 100 * DDP_TOL["atol"]  # the tolerance is far below what training changed


def test_ddp_only_rank_zero_writes(ddp: tuple) -> None:
    """Rank 0 writes every model and optimizer file; the other ranks write only their own RNG state."""
    _, facts = ddp
    rank0 = {path for _, path in facts[0]["writes"]}
    for folder in ("run/checkpoint-2", "run/checkpoint-4", "run/final", "resumed/checkpoint-4", "resumed/final"):
        assert folder in {path for event, path in facts[0]["writes"] if event == "save_pretrained"}, folder
    assert {"run/checkpoint-2/optimizer.pt", "run/checkpoint-2/rng_state_0.pth"} <= rank0
    for rank, f in enumerate(facts[1:], start=1):
        assert f["writes"], "the spy saw nothing: it is not observing this rank"
        for event, path in f["writes"]:
            folder, name = os.path.split(path)
            checkpoint_dir = event == "os.mkdir" and name.startswith("checkpoint-")  # makedirs(exist_ok=True)
            own_rng = event == "torch.save" and name == f"rng_state_{rank}.pth"
            assert checkpoint_dir or (own_rng and os.path.basename(folder).startswith("checkpoint-")), (event, path)


def test_ddp_evaluation_runs_at_x_on_all_ranks(ddp: tuple, single_process: tuple) -> None:
    """Every rank evaluates with x in the parameters, gets the single-process eval loss, and is back at y after."""
    _, facts = ddp
    _, expected = single_process
    for f in facts:
        assert f["train_mode_during_eval"] and not any(f["train_mode_during_eval"])
        assert f["eval_loss"] == pytest.approx(expected, rel=1e-5)
        assert f["train_mode_after_eval"] and f["y_bitwise_after_eval"]


def test_ddp_resume_continues_bitwise(ddp: tuple) -> None:
    """Resuming at step 2 on every rank reaches the uninterrupted run's y and z bitwise, and writes the same x."""
    out, facts = ddp
    assert all(f["resume_bitwise"] for f in facts)
    resumed, uninterrupted = (load_file(out / d / "final" / "model.safetensors") for d in ("resumed", "run"))
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)
