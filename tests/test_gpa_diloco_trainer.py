"""GPATrainer with GPA across processes (``--optim gpa_adamw --gpa_distributed true``): 2 CPU ranks (gloo).

One ``accelerate launch`` of ``tests/gpa_diloco_trainer_workers.py`` with ``configs/accelerate_ddp.yaml`` (the user's
command) trains a tiny Llama with 2 workers (H = 3, 6 steps: outer steps at 3 and 6, checkpoints at 2, 4 and 6),
replays the run with `GPADiLoCo`'s own loop across the same 2 processes (which tests/test_gpa_diloco.py holds to the
single-process simulation of the same workers), resumes it from checkpoint-4 and refuses resumes with other outer
constants. A second start, without a launcher, kills one rank after a checkpoint. Each is killed on its timeout.

The resume refusals that need no launch are tested here too, on files written in-process.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import gpa_diloco_trainer_workers as gw
import pytest
import torch
from helpers import assert_evaluated_in_eval_mode, assert_ranks_agree_on_outer, equal_dicts, saved_and_step
from launching import accelerate_launch, free_port, launch_env, run_documented_command, run_together, tail
from safetensors.torch import load_file

from hf_gpa.optim import WorkerLayout, saved_diloco_layout
from hf_gpa.workers import refuse_other_layout, refuse_other_outer, requested_layout

WORKERS = Path(__file__).with_name("gpa_diloco_trainer_workers.py")
REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "accelerate_ddp.yaml"
ENV = {"HF_GPA_DISABLE_CPU_KERNEL": "1"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("gpa_diloco_trainer")
    return out, accelerate_launch(WORKERS, "two_ranks", 2, out, CONFIG, **ENV)


# ---------------------------------------------------------------- the run: GPADiLoCo's, bitwise


def test_the_trainer_builds_gpa_across_the_two_processes(two_ranks: tuple) -> None:
    """The flags build GPADiLoCo around AdamW with H, the outer lr, mu_x and mu_y given, one worker per process, and
    the model in a DDP over the worker's island only."""
    _, facts = two_ranks
    for rank, f in enumerate(facts):
        run = f["run"]
        assert run["optimizer"] == "GPADiLoCo"
        group = run["group"]
        assert (group["inner_steps"], group["outer_lr"], group["mu_x"], group["mu_y"]) == (3, 1.5, 0.8, 0.6)
        assert run["layout"] == {"world_size": 2, "num_workers": 2, "num_fragments": 1, "worker": rank}
        assert run["wrapped"] == "DistributedDataParallel" and run["ddp_group_is_island"]


def test_the_trainer_s_run_equals_gpa_diloco_s_own_loop_bitwise(two_ranks: tuple) -> None:
    """After every one of the 6 steps, every rank's inner weights, x and z equal bitwise those of GPADiLoCo's own loop
    across the same 2 processes on the same batches and lrs (with the Trainer's gradient clipping): the Trainer adds
    nothing to the algorithm."""
    _, facts = two_ranks
    for f in facts:
        steps, replayed = f["run"]["steps"], f["replay"]
        assert len(steps) == len(replayed) == gw.STEPS
        for held, want in zip(steps, replayed):
            for key in ("inner", "outer", "z"):
                assert equal_dicts(held[key], want[key]), (held["step"], key)


def test_x_and_z_are_the_same_bits_on_every_rank_after_every_step(two_ranks: tuple) -> None:
    """x and z are the same on both ranks after every step, the inner weights are not (each worker its own data), and
    after training both ranks hold x and evaluate to the same loss."""
    _, (first, second) = two_ranks
    assert_ranks_agree_on_outer(first["run"], second["run"], "z")


def test_evaluation_runs_at_x(two_ranks: tuple) -> None:
    """Every evaluation batch (after steps 3 and 6 and after training) ran with the optimizer in eval mode."""
    _, facts = two_ranks
    assert_evaluated_in_eval_mode([f["run"] for f in facts])


@pytest.mark.parametrize("checkpoint", ["checkpoint-2", "checkpoint-4", "checkpoint-6", "final"])
def test_every_save_holds_x(two_ranks: tuple, checkpoint: str) -> None:
    """model.safetensors of every checkpoint and of save_model() holds x of its step (at step 2 the initial weights,
    at 4 those of the outer step at 3), not the inner weights."""
    out, (first, _) = two_ranks
    saved, step = saved_and_step(out, first["run"], checkpoint)
    assert equal_dicts(saved, step["outer"])
    if checkpoint == "checkpoint-4":
        assert not equal_dicts(saved, step["inner"])


def test_checkpoints_keep_every_worker_s_state(two_ranks: tuple) -> None:
    """Every checkpoint holds one optimizer state per process (GPADiLoCo's, recording its worker), none in
    optimizer.pt; the two workers' states differ (their inner weights)."""
    out, _ = two_ranks
    for checkpoint in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        names = {p.name for p in (out / "run" / checkpoint).iterdir()}
        assert {"optimizer_rank0.pt", "optimizer_rank1.pt", "rng_state_0.pth", "rng_state_1.pth"} <= names
        assert "optimizer.pt" not in names and "scheduler.pt" in names
    states = [torch.load(out / "run" / "checkpoint-4" / f"optimizer_rank{r}.pt", weights_only=True) for r in range(2)]
    for rank, state in enumerate(states):
        group = state["param_groups"][0]
        assert group["optimizer"] == "GPADiLoCo(AdamW)"
        assert saved_diloco_layout(state) == {"world_size": 2, "num_workers": 2, "num_fragments": 1, "worker": rank}
        assert set(state["state"][0]) == {"z", f"worker{rank}"} and set(state["state"][0][f"worker{rank}"]) == {
            "outer", "base"
        }  # fmt: skip
    inner = [s["state"][0][f"worker{rank}"]["outer"] for rank, s in enumerate(states)]  # eval mode: inner weights
    assert not torch.equal(*inner)


# ---------------------------------------------------------------- resume


def test_resume_is_bitwise_on_every_rank(two_ranks: tuple) -> None:
    """Resumed from checkpoint-4 (one step after an outer step), every rank's inner weights, x and z after steps 5 and
    6, the final evaluation and the saved model equal the uninterrupted run's bitwise."""
    out, facts = two_ranks
    for f in facts:
        uninterrupted = {s["step"]: s for s in f["run"]["steps"]}
        assert [s["step"] for s in f["resumed"]["steps"]] == [5, 6]
        for resumed in f["resumed"]["steps"]:
            for key in ("inner", "outer", "z"):
                assert equal_dicts(resumed[key], uninterrupted[resumed["step"]][key]), (resumed["step"], key)
        assert f["resumed"]["eval_loss"] == f["run"]["eval_loss"]
    resumed, uninterrupted = (load_file(out / d / "final" / "model.safetensors") for d in ("resumed", "run"))
    assert equal_dicts(resumed, uninterrupted)


@pytest.mark.parametrize(
    ("key", "named"),
    [
        ("other_h", "its GPA across workers state was saved with --gpa_sync_steps 3, this run asks for 2"),
        ("other_mu_x", "its GPA across workers state was saved with --gpa_mu_x 0.8, this run asks for 0.9"),
        ("other_mu_y", "its GPA across workers state was saved with --gpa_mu_y 0.6, this run asks for 0.5"),
        ("as_diloco", "its state was saved by GPA across workers, which this run (--optim diloco_adamw"),
    ],
)
def test_a_resume_with_other_outer_steps_is_refused_before_training(two_ranks: tuple, key: str, named: str) -> None:
    """Another H, mu_x or mu_y on a checkpoint of GPA across workers (whose state would keep its own over the flags),
    or a resume as DiLoCo across workers: GPATrainer.train and the example scripts' resume check raise a ValueError
    naming the flag and the saved value, before the optimizer exists or a step is taken."""
    _, facts = two_ranks
    for f in facts:
        assert named in f[f"{key}_refused"], f[f"{key}_refused"]
        assert named in f[f"{key}_refused_by_script"], f[f"{key}_refused_by_script"]
        assert f[f"{key}_before_training"]


def _checkpoint(folder: Path, name: str, groups: dict[str, Any]) -> Path:
    """A checkpoint of 2 workers over 2 processes whose optimizer files hold ``name``'s param groups only."""
    folder.mkdir()
    for rank in range(2):
        saved = {"diloco_layout": {**WorkerLayout(2, 2, 1).saved(), "worker": rank}, "optimizer": name, **groups}
        torch.save({"state": {}, "param_groups": [{"params": [0], **saved}]}, folder / f"optimizer_rank{rank}.pt")
    return folder


class _Args:
    def __init__(self, **flags: Any) -> None:
        defaults = dict(optim="gpa_adamw", gpa_distributed=True, diloco_distributed=False, diloco_workers=None,
                        diloco_fragments=1, gpa_sync_steps=3, gpa_outer_lr=1.5, gpa_mu_x=0.8,
                        gpa_mu_y=0.6)  # fmt: skip
        self.__dict__.update({**defaults, **flags})


GPA_GROUPS = {"inner_steps": 3, "outer_lr": 1.5, "mu_x": 0.8, "mu_y": 0.6, "outer_momentum": 0.0}


@pytest.mark.parametrize(
    ("flag", "value"), [("gpa_sync_steps", 4), ("gpa_outer_lr", 3.0), ("gpa_mu_x", 0.9), ("gpa_mu_y", 0.5)]
)
def test_a_gpa_state_with_other_outer_steps_is_refused_by_flag(tmp_path: Path, flag: str, value: Any) -> None:
    """A checkpoint of GPA across processes saved with H = 3, outer lr 1.5, mu_x 0.8, mu_y 0.6: resumed with another
    value of one flag, a ValueError names it and both values; with the same values it passes on both ranks."""
    checkpoint = str(_checkpoint(tmp_path / "checkpoint-4", "GPADiLoCo(AdamW)", GPA_GROUPS))
    for rank in range(2):
        refuse_other_outer(checkpoint, _Args(), rank)
        with pytest.raises(ValueError, match=f"saved with --{flag} .*, this run asks for {value}"):
            refuse_other_outer(checkpoint, _Args(**{flag: value}), rank)


def test_a_state_of_the_other_outer_step_is_refused_by_name(tmp_path: Path) -> None:
    """DiLoCo's state resumed with --gpa_distributed, and GPA's resumed as DiLoCo (--optim diloco_adamw
    --diloco_distributed), each refused naming what saved it and the flags that resume it; resumed without either,
    GPA's checkpoint names --gpa_distributed."""
    diloco = _checkpoint(tmp_path / "diloco", "DiLoCo(AdamW)", {"inner_steps": 3, "outer_lr": 1.5,
                                                                 "outer_momentum": 0.9})  # fmt: skip
    gpa = _checkpoint(tmp_path / "gpa", "GPADiLoCo(AdamW)", GPA_GROUPS)
    with pytest.raises(ValueError, match=r"saved by DiLoCo, .*: resume it with --optim diloco_adamw"):
        refuse_other_outer(str(diloco), _Args(), 0)
    as_diloco = _Args(optim="diloco_adamw", gpa_distributed=False, diloco_distributed=True, diloco_inner_steps=3,
                      diloco_outer_lr=1.5, diloco_outer_momentum=0.9)  # fmt: skip
    with pytest.raises(ValueError, match=r"saved by GPA across workers, .*--optim gpa_adamw --gpa_distributed true"):
        refuse_other_outer(str(gpa), as_diloco, 0)
    with pytest.raises(ValueError, match=r"of a GPA run across processes .*\(--gpa_distributed true --diloco_workers"):
        refuse_other_layout(str(gpa), requested_layout(_Args(gpa_distributed=False), 2, 0), 0)
    refuse_other_layout(str(gpa), requested_layout(_Args(), 2, 0), 0)


# ---------------------------------------------------------------- a rank that dies


@pytest.mark.parametrize("scenario", ["dies", *gw.DIES_DILOCO])
def test_a_rank_killed_after_a_checkpoint_makes_the_other_fail_and_leaves_the_checkpoint_intact(
    tmp_path: Path, scenario: str
):
    """Rank 1 is killed (SIGKILL) as step 3 begins, after checkpoint-2: rank 0 fails in the next outer sync's
    collective within the run's collective timeout (--ddp_timeout 15 s) instead of waiting, and checkpoint-2 is
    complete and loadable (both workers' states, the model at the outer weights, trainer_state.json). GPA across
    workers (its all-reduce at step 3), and DiLoCo with its outer sync in int8 (an all-gather at step 3) or
    overlapped (streaming: a sync in flight at checkpoint-2, saved with it; the next one, at step 4, fails)."""
    port = str(free_port())
    cmds, envs, logs = [], [], []
    for rank in range(2):
        cmds.append([sys.executable, str(WORKERS), scenario, str(tmp_path)])
        logs.append(tmp_path / f"rank{rank}.log")
        envs.append({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": port, "ACCELERATE_USE_CPU": "true"})  # fmt: skip
    env = {**launch_env(REPO, WORKERS.parent), **ENV}
    start = time.monotonic()
    codes = _run_each(cmds, logs, env, envs, timeout=gw.TIMEOUT_S + 90)
    elapsed = time.monotonic() - start
    text = "\n".join(f"--- {log}\n{tail(log)}" for log in logs)
    assert codes is not None, f"hung for {elapsed:.0f} s:\n{text}"
    assert codes[1] == -9, text  # killed
    assert codes[0] != 0, text  # failed, not finished
    if scenario == "dies":
        assert "in _average" in tail(logs[0]) and "all_reduce" in tail(logs[0]), text  # outer step's
    assert (tmp_path / "rank0_reached_the_outer_step").exists()
    # the overlapped run's step 3 applies the sync that finished before rank 1 died; its next sync is at step 4
    assert (tmp_path / "rank0_passed_the_outer_step").exists() == (scenario == "dies_overlap")
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert not (tmp_path / "run" / "checkpoint-4").exists()
    names = {p.name for p in checkpoint.iterdir()}
    assert {"model.safetensors", "optimizer_rank0.pt", "optimizer_rank1.pt", "trainer_state.json"} <= names
    assert load_file(checkpoint / "model.safetensors")
    for rank in range(2):
        state = torch.load(checkpoint / f"optimizer_rank{rank}.pt", weights_only=True)
        assert saved_diloco_layout(state)["worker"] == rank
        if scenario == "dies_overlap":  # fragment 1's sync, in flight at step 2, saved to be applied after step 3
            assert {entry.get("pending_steps") for entry in state["state"].values()} == {None, 1}
    diloco = dict(optim="diloco_adamw", gpa_distributed=False, diloco_distributed=True)
    args = _Args() if scenario == "dies" else _Args(**diloco, **gw.DIES_DILOCO[scenario])
    refuse_other_layout(str(checkpoint), requested_layout(args, 2, 0), 0)  # resumable on the same layout


def _run_each(
    cmds: list[list[str]], logs: list[Path], env: dict[str, str], envs: list[dict[str, str]], timeout: float
) -> list[int] | None:
    """`launching.run_together` with an environment of its own for each command (the rank's variables)."""
    # run_together takes one environment for all: each command gets its rank's variables through `env VAR=... cmd`.
    wrapped = [["env", *(f"{k}={v}" for k, v in extra.items()), *cmd] for cmd, extra in zip(cmds, envs)]
    return run_together(wrapped, logs, env, timeout)


# ---------------------------------------------------------------- the documented command

DOC = REPO / "docs" / "gpa_across_workers.md"


@pytest.mark.slow
def test_the_documented_command_runs_on_four_cpu_processes(tmp_path: Path) -> None:
    """The GPA page's accelerate launch of run_clm_gpa.py with --gpa_distributed, as written plus --use_cpu and
    the README's tiny settings (H = 2): 2 workers of 2 processes train, save a checkpoint with every process's
    GPADiLoCo state and evaluate."""
    from test_diloco_trainer import TINY_CLM

    tiny = TINY_CLM.replace("--diloco_inner_steps", "--gpa_sync_steps")
    env = {**ENV, "HF_GPA_CACHE": str(tmp_path / "cache")}
    command = run_documented_command(DOC, "test_gpa_diloco_trainer", tiny, tmp_path, **env)
    assert "--gpa_distributed true" in command
    checkpoint = tmp_path / "outputs" / "clm-gpa-workers" / "checkpoint-3"
    assert {f"optimizer_rank{r}.pt" for r in range(4)} <= {p.name for p in checkpoint.iterdir()}
    state = torch.load(checkpoint / "optimizer_rank3.pt", weights_only=True)
    assert state["param_groups"][0]["optimizer"] == "GPADiLoCo(AdamW)"
    assert saved_diloco_layout(state) == {"world_size": 4, "num_workers": 2, "num_fragments": 1, "worker": 1}
    assert "eval_loss" in (tmp_path / "outputs" / "clm-gpa-workers" / "all_results.json").read_text()
