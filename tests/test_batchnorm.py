"""Norm-layer running statistics at x (hf_gpa.batchnorm): the core recomputation, the plain-PyTorch helpers and
GPATrainer, on small conv nets and a tiny ResNet (transformers' ResNetConfig) on scikit-learn's digits.

Oracles: a plain re-implementation of the conv net's forward that records each norm layer's input (dropout off,
batch statistics in the norm layers), and forward hooks on the ResNet's BatchNorm layers; their batch means and
unbiased variances, averaged over the batches, are what the running statistics must hold.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from batchnorm_models import SEED, TRAIN, TRAIN_BATCH, Digits, conv_net, make_trainer, tiny_resnet
from helpers import eval_and_save_every
from launching import free_port, launch_env, run_logged, run_logged_together
from safetensors.torch import load_file
from torch import nn
from transformers import ResNetForImageClassification, TrainerCallback

from hf_gpa.batchnorm import (
    DEFAULT_RECALIBRATION_BATCHES,
    NormStatisticsAtX,
    norm_statistics,
    recalibrate_norm_statistics,
)
from hf_gpa.checkpoint import evaluation_weights, save_x_weights
from hf_gpa.optim import GPAAdamW
from hf_gpa.trainer import NORM_STATISTICS_Y_NAME, GPATrainer
from hf_gpa.training_args import GPATrainingArguments

F64 = dict(rtol=1e-10, atol=1e-12)
# float32 running averages (k-1)/k r + s/k against a direct mean over the batches: rounding of a few ulps per batch.
F32 = dict(rtol=1e-5, atol=1e-6)


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the core: recalibrate_norm_statistics on a conv net with BatchNorm, InstanceNorm and dropout ----


def oracle_statistics(model: nn.Sequential, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """conv_net's forward written out (dropout off, norm layers on batch statistics), averaging each norm input's
    batch mean and unbiased variance over the batches."""
    conv1, bn2d, _, _, conv2, inorm, _, linear, bn1d = model
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {1: [], 5: [], 8: []}
    with torch.no_grad():
        for x in batches:
            h = conv1(x)
            seen[1].append((h.mean((0, 2, 3)), h.var((0, 2, 3))))
            h = F.batch_norm(h, None, None, bn2d.weight, bn2d.bias, training=True, eps=bn2d.eps).relu()
            h = conv2(h)
            seen[5].append((h.mean((2, 3)).mean(0), h.var((2, 3)).mean(0)))  # per instance, averaged over it
            h = F.instance_norm(h, weight=inorm.weight, bias=inorm.bias, eps=inorm.eps)
            h = linear(h.flatten(1))
            seen[8].append((h.mean(0), h.var(0)))
    stats = {}
    for i, pairs in seen.items():
        stats[f"{i}.running_mean"] = torch.stack([m for m, _ in pairs]).mean(0)
        stats[f"{i}.running_var"] = torch.stack([v for _, v in pairs]).mean(0)
        stats[f"{i}.num_batches_tracked"] = torch.tensor(len(pairs))
    return stats


def assert_stats_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in actual:
        if key.endswith("num_batches_tracked"):
            assert int(actual[key]) == int(expected[key]), key
        else:
            torch.testing.assert_close(actual[key], expected[key], **tol, msg=key)


def assert_equal_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def stale(model: nn.Module) -> nn.Module:
    """Give every norm layer statistics far from the truth, as training at another point would."""
    model.train()
    for _ in range(3):
        model(torch.randn(8, 3, 6, 6, dtype=next(model.parameters()).dtype) * 5 + 3)
    return model


def image_batches(n: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 3, 6, 6, generator=g, dtype=dtype) * 2 + 1 for _ in range(n)]


def test_recalibration_matches_a_plain_reimplementation():
    """Statistics = the mean over N batches of batch means/unbiased variances, old values ignored, dropout off,
    only N batches drawn; modes, momenta and every global random generator are left as they were."""
    torch.manual_seed(0)
    model = stale(conv_net(torch.float64))
    model[3].train(False)  # a mixed mode that must come back as it was
    modes = [m.training for m in model.modules()]
    batches = image_batches(5)
    drawn = []
    source = (drawn.append(b) or b for b in batches)
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())

    used = recalibrate_norm_statistics(model, source, 3)

    assert used == 3 and len(drawn) == 3
    assert_stats_close(norm_statistics(model), oracle_statistics(model, batches[:3]), F64)
    assert [m.training for m in model.modules()] == modes
    assert model[1].momentum == 0.1 and model[5].momentum == 0.1
    assert torch.equal(rng[0], torch.get_rng_state()) and rng[1] == random.getstate()
    assert np.array_equal(rng[2], np.random.get_state()[1])


def test_nothing_to_recalibrate_draws_no_batch():
    """Without norm layers that keep running statistics (or with N = 0) no batch is drawn and nothing runs."""
    drawn = []
    source = (drawn.append(b) or b for b in image_batches(3))
    no_stats = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.InstanceNorm2d(4), nn.Flatten()).double()
    assert recalibrate_norm_statistics(no_stats, source, 3) == 0
    assert recalibrate_norm_statistics(conv_net(torch.float64), source, 0) == 0
    assert drawn == []
    with pytest.raises(ValueError, match="num_batches must be an integer >= 0"):
        recalibrate_norm_statistics(conv_net(), source, -1)


# ---- the plain-PyTorch helpers: evaluation_weights / save_x_weights with bn_batches ----


def test_helpers_recompute_statistics_at_x_and_restore_y_bitwise(tmp_path):
    """evaluation_weights/save_x_weights(bn_batches=...): x with the statistics recomputed at x inside and in the
    file; afterwards y and y's statistics bitwise; a shuffling DataLoader leaves the global RNG untouched."""
    torch.manual_seed(0)
    model = conv_net(torch.float32)
    optimizer = GPAAdamW(model.parameters(), lr=1e-2, mu_x=0.5, mu_y=0.7)
    for batch in image_batches(4, torch.float32, seed=2):
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    y = {k: v.clone() for k, v in model.state_dict().items()}
    batches = image_batches(4, torch.float32, seed=3)

    with evaluation_weights(optimizer, model, bn_batches=batches, bn_num_batches=2):
        inside = {k: v.clone() for k, v in model.state_dict().items()}
        expected = oracle_statistics(model, batches[:2])  # at x: the parameters the block holds
    assert_stats_close(norm_statistics_of(inside), expected, F32)
    assert_equal_dicts(dict(model.state_dict()), y)

    path = save_x_weights(model, optimizer, tmp_path, bn_batches=batches, bn_num_batches=2)
    assert_equal_dicts(load_file(path), inside)
    assert_equal_dicts(dict(model.state_dict()), y)

    loader = torch.utils.data.DataLoader(torch.stack(batches).flatten(0, 1), batch_size=6, shuffle=True)
    rng = torch.get_rng_state()
    with evaluation_weights(optimizer, model, bn_batches=loader):
        pass
    assert torch.equal(rng, torch.get_rng_state())
    assert_equal_dicts(dict(model.state_dict()), y)
    with pytest.raises(ValueError, match="bn_batches needs the model"):
        with evaluation_weights(optimizer, bn_batches=batches):
            pass


def test_the_holder_keeps_y_while_x_is_in_place():
    """NormStatisticsAtX: to_x recomputes at x and keeps y's, a second to_x is a no-op, to_y puts y's back bitwise;
    a recomputation that raises leaves y's in place; hold() keeps y's that came from elsewhere."""
    model = stale(conv_net(torch.float64))
    y = norm_statistics(model)
    batches = image_batches(3)
    statistics = NormStatisticsAtX(model)
    assert statistics.to_x(batches, 2) == 2 and statistics.at_x
    assert_equal_dicts(statistics.statistics_y, y)
    assert_stats_close(norm_statistics(model), oracle_statistics(model, batches[:2]), F64)
    x = norm_statistics(model)
    assert statistics.to_x(batches[2:], 1) == 0  # already at x: nothing recomputed
    assert_equal_dicts(norm_statistics(model), x)
    statistics.to_y()
    assert not statistics.at_x and statistics.statistics_y is None
    assert_equal_dicts(norm_statistics(model), y)

    def failing(model: nn.Module, batch: Any) -> None:
        model(batch)
        raise RuntimeError("a batch that fails half-way")

    with pytest.raises(RuntimeError, match="half-way"):
        statistics.to_x(batches, 2, forward=failing)
    assert not statistics.at_x
    assert_equal_dicts(norm_statistics(model), y)
    statistics.hold(x)  # the buffers hold y here, but say a checkpoint of x's just came in with these
    statistics.to_y()
    assert_equal_dicts(norm_statistics(model), x)


def test_trainer_and_the_plain_helpers_share_one_holder(tmp_path):
    """GPATrainer (evaluating at x) and evaluation_weights(bn_batches=...) both put x's statistics in place through
    NormStatisticsAtX: one mechanism, not two."""
    calls = []
    to_x = NormStatisticsAtX.to_x

    def recording(self: NormStatisticsAtX, *args: Any, **kwargs: Any) -> int:
        calls.append(self.model)
        return to_x(self, *args, **kwargs)

    model = conv_net(torch.float32)
    optimizer = GPAAdamW(model.parameters(), lr=1e-2)
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NormStatisticsAtX, "to_x", recording)
        with evaluation_weights(optimizer, model, bn_batches=image_batches(2, torch.float32)):
            pass
        trainer.train()  # ends at x: its statistics recomputed
        trainer.evaluate()
    assert calls[0] is model and trainer.model in calls[1:]


def norm_statistics_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: v
        for k, v in state.items()
        if k.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")
    }


# ---- GPATrainer on a tiny ResNet and the digits ----


class Snapshots(TrainerCallback):
    """y (parameters and buffers) after every step, and the statistics the model holds at every evaluation."""

    def __init__(self) -> None:
        self.y: dict[int, dict[str, torch.Tensor]] = {}
        self.at_eval: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.y[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.at_eval[state.global_step] = norm_statistics(model)


RUN = dict(max_steps=6, lr_scheduler_type="constant")
EVALS = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=3)


def run(output_dir: Path, resume: str | None = None, **overrides: Any) -> tuple[GPATrainer, Snapshots]:
    snapshots = Snapshots()
    trainer = make_trainer(output_dir, [snapshots], **{**RUN, **overrides})
    trainer.train(resume_from_checkpoint=resume)
    return trainer, snapshots


@pytest.fixture(scope="module")
def resnet_runs(tmp_path_factory):
    """Six steps: with evaluations (every 2) and saves (every 3), the same without recalibration, the same with
    neither evaluations nor saves; and, without augmentation (the stock Trainer restores the global random state
    only after fetching the first batch of a resumed run), a run with evaluations and saves and one resumed from its
    checkpoint-3."""
    root = tmp_path_factory.mktemp("resnet")
    runs = {"full": run(root / "full", **EVALS)}
    runs["no_recalibration"] = run(root / "no_recalibration", gpa_bn_recalibration_batches=0, **EVALS)
    runs["quiet"] = run(root / "quiet")
    runs["plain"] = run(root / "plain", augment=False, **EVALS)
    runs["resumed"] = run(root / "resumed", resume=str(root / "plain" / "checkpoint-3"), augment=False, **EVALS)
    return runs


def losses(trainer: GPATrainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def test_evaluations_and_saves_leave_training_bitwise(resnet_runs):
    """Evaluating (every 2 steps) and saving (every 3) with recalibration: losses, y and y's BatchNorm statistics
    (num_batches_tracked included) after every step are bitwise those of a run that does neither."""
    (full, full_snaps), (quiet, quiet_snaps) = resnet_runs["full"], resnet_runs["quiet"]
    no_recalibration, no_recalibration_snaps = resnet_runs["no_recalibration"]
    assert sorted(full_snaps.at_eval) == [2, 4, 6]
    assert losses(full) == losses(quiet) == losses(no_recalibration)
    for step in range(1, 7):
        assert_equal_dicts(full_snaps.y[step], quiet_snaps.y[step])
        assert_equal_dicts(full_snaps.y[step], no_recalibration_snaps.y[step])


def bn_input_oracle(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batch mean and unbiased variance of every BatchNorm input (forward hooks), averaged over the batches."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [
        m.register_forward_pre_hook(lambda m, i, name=name: seen.setdefault(name, []).append(i[0].detach()))
        for name, m in model.named_modules()
        if isinstance(m, nn.BatchNorm2d)
    ]
    model.train()
    with torch.no_grad():
        for batch in batches:
            model(pixel_values=batch["pixel_values"])
    for hook in hooks:
        hook.remove()
    stats = {}
    for name, inputs in seen.items():
        stats[f"{name}.running_mean"] = torch.stack([h.mean((0, 2, 3)) for h in inputs]).mean(0)
        stats[f"{name}.running_var"] = torch.stack([h.var((0, 2, 3)) for h in inputs]).mean(0)
        stats[f"{name}.num_batches_tracked"] = torch.tensor(len(inputs))
    return stats


def test_checkpoint_holds_x_with_its_recomputed_statistics(resnet_runs):
    """checkpoint-3/model.safetensors: BatchNorm buffers = the statistics of the saved x's BatchNorm inputs over the
    recalibration batches (GPATrainer's recipe: a train-set loader shuffled by a generator seeded with --seed, the
    global generators seeded with --seed); y's statistics are kept beside the optimizer state, bitwise."""
    full, snaps = resnet_runs["full"]
    checkpoint = Path(full.args.output_dir) / "checkpoint-3"
    saved = load_file(checkpoint / "model.safetensors")
    model = tiny_resnet()
    model.load_state_dict(saved)  # the x the checkpoint holds

    loader = torch.utils.data.DataLoader(
        Digits(TRAIN, augment=True),
        batch_size=TRAIN_BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(SEED),
        drop_last=True,
    )
    random.seed(SEED)
    batches = [batch for _, batch in zip(range(DEFAULT_RECALIBRATION_BATCHES), loader)]
    expected = bn_input_oracle(model, batches)
    assert_stats_close(norm_statistics_of(saved), expected, F32)

    y_stats = norm_statistics_of(snaps.y[3])
    assert not torch.allclose(
        norm_statistics_of(saved)["resnet.embedder.embedder.normalization.running_var"],
        y_stats["resnet.embedder.embedder.normalization.running_var"],
    )
    assert_equal_dicts(load_file(checkpoint / NORM_STATISTICS_Y_NAME), y_stats)


def test_recalibration_improves_evaluation_at_x(resnet_runs):
    """The same x scores a lower loss at every evaluation with statistics recomputed at x than with y's, and at
    least the same accuracy once above chance (at step 2 both are near 1/10)."""
    with_logs = [e for e in resnet_runs["full"][0].state.log_history if "eval_loss" in e]
    without_logs = [e for e in resnet_runs["no_recalibration"][0].state.log_history if "eval_loss" in e]
    assert [e["step"] for e in with_logs] == [e["step"] for e in without_logs] == [2, 4, 6]
    for with_, without in zip(with_logs, without_logs):
        assert with_["eval_loss"] < without["eval_loss"], with_["step"]
        if with_["step"] > 2:
            assert with_["eval_accuracy"] >= without["eval_accuracy"], with_["step"]


def test_resume_stays_bitwise(resnet_runs):
    """Resumed from checkpoint-3 (x and x's statistics in the model file, y's beside the optimizer state): y and its
    statistics after steps 4-6 and the final x with its statistics are bitwise those of the uninterrupted run."""
    (full, full_snaps), (resumed, resumed_snaps) = resnet_runs["plain"], resnet_runs["resumed"]
    for step in (4, 5, 6):
        assert_equal_dicts(resumed_snaps.y[step], full_snaps.y[step])
    assert_equal_dicts(resumed_snaps.at_eval[6], full_snaps.at_eval[6])
    assert_equal_dicts(dict(resumed.model.state_dict()), dict(full.model.state_dict()))


class CountingMLP(nn.Module):
    """An MLP with LayerNorm (no running statistics) that counts its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(256, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 10))
        self.calls = 0

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self.calls += 1
        logits = self.net(pixel_values)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def test_model_without_running_statistics_pays_nothing(tmp_path):
    """No norm layer with running statistics: training, evaluating and saving run no forward pass beyond the
    training steps and the evaluation batches."""
    model = CountingMLP()
    trainer = make_trainer(
        tmp_path,
        model=model,
        max_steps=2,
        per_device_eval_batch_size=128,
        **eval_and_save_every(1),
    )
    trainer.train()
    trainer.save_model()
    eval_batches = 256 // 128
    assert model.calls == 2 + 2 * eval_batches


@pytest.mark.parametrize("value", [-1, 1.5, True, "8"])
def test_bad_recalibration_flag_fails_clearly(value, tmp_path):
    """--gpa_bn_recalibration_batches takes an integer >= 0: anything else is a ValueError naming the flag."""
    with pytest.raises(ValueError, match="--gpa_bn_recalibration_batches must be an integer >= 0"):
        GPATrainingArguments(output_dir=str(tmp_path), gpa_bn_recalibration_batches=value, report_to="none")


# ---- DDP: 2 CPU processes ----

NPROC = 2


def bn_launch_env(workers: Path) -> dict[str, str]:
    """A launch's environment without GPAAdamW's fused kernel, which is beside the point here: its build lock, held by
    another process building it, must not cost a launch's timeout."""
    return {**launch_env(workers.parent.parent), "HF_GPA_DISABLE_CPU_KERNEL": "1"}


def torchrun(out: Path) -> None:
    """``torchrun --standalone`` (the OS picks the port) of tests/batchnorm_workers.py, in its own session, killed
    as a group on timeout so that a hang fails the test."""
    workers = Path(__file__).with_name("batchnorm_workers.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}"]
    run_logged([*cmd, str(workers), str(out)], out / "launch.log", bn_launch_env(workers), what="DDP")


def test_ddp_ranks_hold_the_same_statistics(tmp_path):
    """Under DDP (2 gloo ranks) each rank recomputes from its own batches and the statistics are averaged with
    all_reduce (weighted by batch counts): bitwise the same on every rank, equal to the average of the ranks' local
    statistics; GPATrainer's evaluation at x does the same."""
    torchrun(tmp_path)

    ranks = [torch.load(tmp_path / f"recalibrate{r}.pt", weights_only=True) for r in range(NPROC)]
    assert_equal_dicts(ranks[0]["reduced"], ranks[1]["reduced"])
    local0, local1 = ranks[0]["local"], ranks[1]["local"]  # rank 0 saw 2 batches, rank 1 saw 3
    expected = {k: (2 * local0[k] + 3 * local1[k]) / 5 for k in local0 if not k.endswith("num_batches_tracked")}
    expected |= {k: torch.tensor(5) for k in local0 if k.endswith("num_batches_tracked")}
    assert_stats_close(ranks[0]["reduced"], expected, F64)

    trained = [torch.load(tmp_path / f"trainer{r}.pt", weights_only=True) for r in range(NPROC)]
    assert trained[0]["world_size"] == NPROC
    assert_equal_dicts(trained[0]["x_stats"], trained[1]["x_stats"])
    assert not torch.equal(
        trained[0]["x_stats"]["resnet.embedder.embedder.normalization.running_mean"],
        trained[0]["y_stats"]["resnet.embedder.embedder.normalization.running_mean"],
    )


def test_two_nodes_without_shared_storage_finish_and_say_what_they_hold(tmp_path):
    """Two nodes (torchrun --nnodes 2 on loopback), each its own output_dir, save_on_each_node off,
    load_best_model_at_end: only node 0 finds the best checkpoint (and its norm_statistics_y); both finish (no
    collective rests on what one node's disk holds), node 0 holds the best x, node 1 the last x and says so."""
    workers = Path(__file__).with_name("batchnorm_workers.py")
    port = free_port()
    nodes = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}"]
        + ["--master_addr=127.0.0.1", f"--master_port={port}", str(workers), str(tmp_path), "two_nodes"]
        for node in range(2)
    ]
    logs = [tmp_path / f"node{node}.log" for node in range(2)]
    # The fused kernel is beside the point here: its build lock, held by another test run, must not cost the timeout.
    env = {**launch_env(workers.parent.parent), "HF_GPA_DISABLE_CPU_KERNEL": "1"}
    run_logged_together(nodes, logs, env, what="two nodes")

    node0, node1 = (torch.load(tmp_path / f"two_nodes{node}.pt", weights_only=True) for node in range(2))
    assert node0["best"] == node1["best"] == "checkpoint-2"
    best, last = node0["checkpoints"]["checkpoint-2"], node0["checkpoints"]["checkpoint-4"]
    assert_equal_dicts(node0["held"], {k: best[k] for k in node0["held"]})
    assert_equal_dicts(node1["held"], {k: last[k] for k in node1["held"]})
    assert not all(torch.equal(best[k], last[k]) for k in node0["held"])
    assert not any("holds the best x" in message for message in node1["warnings"]), node1["warnings"]
    assert any("holds the last step's x" in message for message in node1["warnings"]), node1["warnings"]
    assert not any("last step's x" in message for message in node0["warnings"]), node0["warnings"]


# ---- run_vit_gpa.py --model_type resnet ----


def test_run_vit_resnet_saves_x_with_its_statistics(tmp_path):
    """run_vit_gpa.py --model_type resnet trains the small ResNet on the embedded digits, and the saved model (x)
    carries BatchNorm statistics different from those of y, kept beside the optimizer state of its checkpoint."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_vit_gpa", Path(__file__).parent.parent / "run_vit_gpa.py")
    run_vit = importlib.util.module_from_spec(spec)
    sys.modules["run_vit_gpa"] = run_vit  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(run_vit)
    flags = dict(max_steps=4, per_device_train_batch_size=8, max_train_samples=64, max_eval_samples=32)
    flags |= dict(save_strategy="steps", save_steps=4, eval_strategy="no", report_to="none", disable_tqdm="true")
    flags |= dict(dataloader_pin_memory="false")
    argv = ["--output_dir", str(tmp_path), "--model_type", "resnet"]
    metrics = run_vit.main(argv + [f"--{k}={v}" for k, v in flags.items()])

    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    model = ResNetForImageClassification.from_pretrained(tmp_path)
    assert model.config.hidden_sizes == run_vit.DEFAULT_RESNET_CONFIG["hidden_sizes"]
    saved = norm_statistics_of(load_file(tmp_path / "model.safetensors"))
    y_stats = load_file(tmp_path / "checkpoint-4" / NORM_STATISTICS_Y_NAME)
    assert saved.keys() == y_stats.keys() and len(saved) == 3 * 9  # 9 BatchNorm layers
    assert int(saved["resnet.embedder.embedder.normalization.num_batches_tracked"]) == 64 // 8  # one pass: 8 batches
    assert int(y_stats["resnet.embedder.embedder.normalization.num_batches_tracked"]) == 4  # the 4 training steps
