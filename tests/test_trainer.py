"""GPATrainer: optimizer construction, evaluation and saving at x, exact resume, best model, Hub push, bf16.

Models are built from configs (a 2-layer Llama, a small plain `nn.Module`), nothing is downloaded. The long-running
pieces (a few short training runs) are shared between tests through module-scoped fixtures.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import types
from unittest import mock

import pytest
import torch
from helpers import (  # noqa: E402
    MU_X,
    MU_Y,
    RegressionDataset,
    Snapshots,
    TinyRegressor,
    TokenDataset,
    assert_equal_dicts,
    eval_and_save_every,
    llama_trainer,
    make_args,
    max_abs_diff,
    params_of,
    run_llama,
    tiny_llama,
    train_losses,
)
from huggingface_hub import HfApi
from safetensors.torch import load_file
from torch import nn
from transformers import (
    DefaultFlowCallback,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_scheduler,
)
from transformers.training_args import OptimizerNames

from hf_gpa.checkpoint import unwrap_gpa_optimizer
from hf_gpa.optim import GPA, DiLoCo, GPAAdamW
from hf_gpa.trainer import EvaluationWeightsAtTrainEnd, GPATrainer
from hf_gpa.training_args import GPAOptimizerNames, GPATrainingArguments

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- optimizer construction ----


def test_gpa_adamw_class_groups_and_hyperparameters(tmp_path):
    """--optim gpa_adamw builds GPAAdamW with the Trainer's decay/no-decay groups and the AdamW flags."""
    args = make_args(tmp_path, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    trainer = GPATrainer(model=TinyRegressor(), args=args)
    optimizer = trainer.create_optimizer()
    assert type(optimizer) is GPAAdamW
    decay, no_decay = optimizer.param_groups
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == ["fc1.weight", "fc2.weight"]
    assert sorted(names[id(p)] for p in no_decay["params"]) == ["fc1.bias", "fc2.bias", "norm.bias", "norm.weight"]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    for group in optimizer.param_groups:
        assert (group["lr"], group["betas"], group["eps"]) == (1e-2, (0.8, 0.95), 1e-6)
        assert (group["mu_x"], group["mu_y"]) == (MU_X, MU_Y)
    assert optimizer.train_mode


@pytest.mark.parametrize("base", ["adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "adagrad", "rmsprop"])
def test_gpa_wraps_what_the_stock_trainer_builds(base, tmp_path):
    """--optim gpa --gpa_base_optim NAME wraps exactly the class and kwargs the stock Trainer builds for NAME."""
    args = make_args(tmp_path, optim="gpa", gpa_base_optim=base, gpa_mu_x=None, gpa_inner_steps=16)
    cls, kwargs = GPATrainer.get_optimizer_cls_and_kwargs(args)
    stock_cls, stock_kwargs = Trainer.get_optimizer_cls_and_kwargs(make_args(tmp_path, optim=base))
    assert cls is GPA
    assert kwargs == {"base": stock_cls, "mu_x": 0.9 ** (1 / 16), "mu_y": MU_Y, "averaging": "gpa", **stock_kwargs}
    # And it builds and steps inside the Trainer.
    model = TinyRegressor().double()
    trainer = GPATrainer(model=model, args=args)
    optimizer = trainer.create_optimizer()
    batch = RegressionDataset(8, seed=1)[:]
    model(**batch)["loss"].backward()
    before = params_of(model)
    optimizer.step()
    assert max_abs_diff(before, params_of(model)) > 0


def test_diloco_adamw_class_and_hyperparameters(tmp_path):
    """--optim diloco_adamw builds DiLoCo around AdamW with the --diloco_* flags in its groups."""
    args = make_args(tmp_path, optim="diloco_adamw", diloco_inner_steps=4, diloco_outer_lr=0.5)
    trainer = GPATrainer(model=TinyRegressor(), args=args)
    optimizer = trainer.create_optimizer()
    assert type(optimizer) is DiLoCo
    for group in optimizer.param_groups:
        assert (group["inner_steps"], group["outer_lr"], group["outer_momentum"], group["lr"]) == (4, 0.5, 0.9, 1e-2)


@pytest.mark.parametrize("name", ["adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "schedule_free_adamw"])
def test_stock_optim_built_as_by_trainer(name, tmp_path):
    """With a stock --optim, GPATrainer builds the same optimizer class and kwargs as Trainer."""
    args = make_args(tmp_path, optim=name)
    assert args.optim is OptimizerNames(name)
    assert GPATrainer.get_optimizer_cls_and_kwargs(args) == Trainer.get_optimizer_cls_and_kwargs(args)


# ---- against an independent oracle: the paper's three sequences, float64 ----


def three_sequence_oracle(args: GPATrainingArguments, base: str, data: dict[str, torch.Tensor], steps: int):
    """GPA as in the paper's Algorithm 1: z by the base optimizer at gradients taken at y, x and y interpolated.

    The base optimizer is torch's own, driven by transformers' scheduler, with the Trainer's decay groups.
    Returns the (x, y) parameter dicts after every step.
    """
    model = TinyRegressor().double()
    torch.manual_seed(0)
    model.load_state_dict(ORACLE_INIT)
    z = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = {n: p.detach().clone() for n, p in model.named_parameters()}
    no_decay = [n for n in z if "bias" in n or "norm" in n]
    groups = [
        {"params": [z[n] for n in z if n not in no_decay], "weight_decay": args.weight_decay},
        {"params": [z[n] for n in z if n in no_decay], "weight_decay": 0.0},
    ]
    if base == "sgd":
        base_opt = torch.optim.SGD(groups, lr=args.learning_rate, momentum=0.9)
    else:
        betas = (args.adam_beta1, args.adam_beta2)
        base_opt = torch.optim.AdamW(groups, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon)
    scheduler = get_scheduler(
        args.lr_scheduler_type, base_opt, num_warmup_steps=args.get_warmup_steps(steps), num_training_steps=steps
    )
    history, weight_sum = [], 0.0
    for _ in range(steps):
        lr = base_opt.param_groups[0]["lr"]
        if args.gpa_averaging == "gpa":
            mu_x = args.gpa_mu_x
        else:  # Schedule-Free's average weighted by lr**2 (paper eq. 5); it stays put while all weights are 0
            weight_sum += lr**2
            mu_x = 1.0 - (lr**2 / weight_sum if weight_sum > 0 else 0.0)
        model.zero_grad()
        model(**data)["loss"].backward()  # the model's parameters hold y
        for n, p in model.named_parameters():
            z[n].grad = p.grad.clone()
        base_opt.step()
        scheduler.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                x[n].mul_(mu_x).add_(z[n], alpha=1 - mu_x)
                p.copy_(args.gpa_mu_y * x[n] + (1 - args.gpa_mu_y) * z[n])
        history.append(({n: t.clone() for n, t in x.items()}, params_of(model)))
    return history


torch.manual_seed(0)
ORACLE_INIT = TinyRegressor().double().state_dict()


@pytest.mark.parametrize(
    ("optim", "base", "averaging"),
    [
        ("gpa_adamw", "adamw", "gpa"),
        ("gpa_adamw", "adamw", "schedule_free"),
        ("gpa", "adamw_torch", "gpa"),
        ("gpa", "sgd", "gpa"),
    ],
    ids=["gpa_adamw", "gpa_adamw-schedule_free", "adamw_torch", "sgd-momentum"],
)
def test_trainer_matches_three_sequence_oracle(optim, base, averaging, tmp_path):
    """Trainer-driven GPA (cosine warm-up schedule, decay groups) follows the paper's x/y/z recursion in fp64."""
    # Also the plain nn.Module case: the checkpoint's model.safetensors is x (the oracle's, and the optimizer's
    # bitwise), not y, and evaluate() equals the loss of the oracle's x.
    steps = 5
    train, held_out = RegressionDataset(16, seed=1), RegressionDataset(8, seed=2)
    args = make_args(
        tmp_path,
        optim=optim,
        gpa_base_optim=None if optim == "gpa_adamw" else base,
        gpa_averaging=averaging,
        optim_args="momentum=0.9" if base == "sgd" else None,  # reaches the base as with the stock --optim sgd
        learning_rate=0.05,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=0.2,
        max_steps=steps,
        per_device_train_batch_size=16,  # full batch: the oracle does not depend on the sampling order
        per_device_eval_batch_size=8,
        max_grad_norm=0.0,
        save_strategy="steps",
        save_steps=3,
    )
    model = TinyRegressor().double()
    model.load_state_dict(ORACLE_INIT)
    snapshots = Snapshots()
    trainer = GPATrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out, callbacks=[snapshots])
    trainer.train()
    history = three_sequence_oracle(args, base, train[:], steps)
    tol = {"rtol": 1e-9, "atol": 1e-12}

    x_file = load_file(os.path.join(tmp_path, "checkpoint-3", "model.safetensors"))
    x3, y3 = history[2]
    torch.testing.assert_close(x_file, x3, **tol)
    assert_equal_dicts(x_file, snapshots.saved_x[3])
    assert max_abs_diff(x_file, y3) > 1e-4  # far from y: the file is not the training point

    x5, y5 = history[-1]
    torch.testing.assert_close(params_of(trainer.model), x5, **tol)  # after train() the model holds x
    expected_loss = TinyRegressor().double()
    expected_loss.load_state_dict(x5)
    expected = expected_loss(**held_out[:])["loss"].item()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-10)
    unwrap_gpa_optimizer(trainer.optimizer).train()
    torch.testing.assert_close(params_of(trainer.model), y5, **tol)


# ---- the Llama runs shared by the checkpoint, evaluation and resume tests ----


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    """Per optimizer: an uninterrupted run with evaluations, the same without, and one resumed at step 3."""
    cache: dict[str, dict[str, tuple[GPATrainer, Snapshots]]] = {}

    def get(optim: str) -> dict[str, tuple[GPATrainer, Snapshots]]:
        if optim not in cache:
            root = tmp_path_factory.mktemp(optim)
            with_eval = dict(optim=optim, eval_strategy="steps", eval_steps=2)
            runs = {"full": run_llama(root / "full", **with_eval)}
            runs["resumed"] = run_llama(root / "resumed", resume=str(root / "full" / "checkpoint-3"), **with_eval)
            if optim == "gpa_adamw":
                runs["no_eval"] = run_llama(root / "no_eval", optim=optim)
            cache[optim] = runs
        return cache[optim]

    return get


@pytest.mark.parametrize("optim", ["gpa_adamw", "adamw_torch"])
def test_resume_is_bitwise_exact(optim, llama_runs):
    """Resuming from a mid-epoch checkpoint gives the same losses and weights, bitwise (adamw_torch: control)."""
    runs = llama_runs(optim)
    (full, full_snaps), (resumed, resumed_snaps) = runs["full"], runs["resumed"]
    full_losses, resumed_losses = train_losses(full), train_losses(resumed)
    assert sorted(resumed_losses) == list(range(1, 7))
    assert resumed_snaps.at_start[0]  # right after loading, before any step: train mode, y of step 3
    assert_equal_dicts(resumed_snaps.at_start[1], full_snaps.y[3])
    for step in (4, 5, 6):
        assert resumed_losses[step] == full_losses[step], step
        assert_equal_dicts(resumed_snaps.y[step], full_snaps.y[step])
    assert_equal_dicts(params_of(resumed.model), params_of(full.model))
    if optim == "gpa_adamw":
        assert not unwrap_gpa_optimizer(full.optimizer).train_mode  # both hold x after train()
        for trainer in (full, resumed):
            unwrap_gpa_optimizer(trainer.optimizer).train()
        assert_equal_dicts(params_of(resumed.model), params_of(full.model))
        assert_equal_dicts(params_of(full.model), full_snaps.y[6])


def test_evaluation_does_not_perturb_training(llama_runs):
    """Evaluating at x every 2 steps leaves the training trajectory (losses, y) bitwise unchanged."""
    runs = llama_runs("gpa_adamw")
    (with_eval, with_snaps), (without, without_snaps) = runs["full"], runs["no_eval"]
    assert any("eval_loss" in e for e in with_eval.state.log_history)
    assert train_losses(with_eval) == train_losses(without)
    for step in range(1, 7):
        assert_equal_dicts(with_snaps.y[step], without_snaps.y[step])


def test_checkpoint_same_with_or_without_preceding_evaluation(llama_runs):
    """Step 6 is saved right after an evaluation in one run and without one in the other: same files."""
    runs = llama_runs("gpa_adamw")
    full_dir, no_eval_dir = runs["full"][0].args.output_dir, runs["no_eval"][0].args.output_dir
    for step in (3, 6):
        assert_equal_dicts(
            load_file(os.path.join(full_dir, f"checkpoint-{step}", "model.safetensors")),
            load_file(os.path.join(no_eval_dir, f"checkpoint-{step}", "model.safetensors")),
        )
        a, b = (torch.load(os.path.join(d, f"checkpoint-{step}", "optimizer.pt")) for d in (full_dir, no_eval_dir))
        assert a["param_groups"] == b["param_groups"]
        assert all(not g["train_mode"] for g in a["param_groups"])  # saved in eval mode, with what restores y
        for index, state in a["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][key])), (index, key)


def test_checkpoint_holds_x_and_loads_with_from_pretrained(llama_runs):
    """Each checkpoint's model.safetensors is x (bitwise), not y; from_pretrained gives x; training kept y."""
    trainer, snapshots = llama_runs("gpa_adamw")["full"]
    for step in (3, 6):
        path = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
        x_file = load_file(os.path.join(path, "model.safetensors"))
        assert_equal_dicts(x_file, snapshots.saved_x[step])
        assert max_abs_diff(x_file, snapshots.saved_y[step]) > 1e-4
        assert_equal_dicts(snapshots.saved_y[step], snapshots.y[step])  # the save left y in place
        assert_equal_dicts(params_of(LlamaForCausalLM.from_pretrained(path)), snapshots.saved_x[step])
        saved_args = torch.load(os.path.join(path, "training_args.bin"), weights_only=False)
        assert type(saved_args) is GPATrainingArguments and saved_args.optim is GPAOptimizerNames.GPA_ADAMW
        assert (saved_args.gpa_mu_x, saved_args.gpa_mu_y) == (MU_X, MU_Y)


def manual_loss(model: nn.Module, dataset: TokenDataset) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        out = model.eval()(input_ids=dataset.ids, labels=dataset.ids)
    return out.loss.item(), out.logits


def test_evaluate_and_predict_run_at_x(llama_runs, tmp_path):
    """evaluate()/predict() metrics equal a hand-written evaluation of the saved x weights, during and after train."""
    trainer, _ = llama_runs("gpa_adamw")["full"]
    held_out = trainer.eval_dataset
    # During training: the step-6 evaluation ran at the x that checkpoint-6 holds.
    logged = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e and e["step"] == 6]
    x6 = LlamaForCausalLM.from_pretrained(os.path.join(trainer.args.output_dir, "checkpoint-6"))
    loss6, logits6 = manual_loss(x6, held_out)
    assert logged == [pytest.approx(loss6, rel=1e-6)]
    # Afterwards, called by the user: same x, and the optimizer's mode is left as found.
    unwrap_gpa_optimizer(trainer.optimizer).train()
    y = params_of(trainer.model)
    metrics = trainer.evaluate()
    prediction = trainer.predict(held_out)
    assert metrics["eval_loss"] == pytest.approx(loss6, rel=1e-6)
    assert prediction.metrics["test_loss"] == pytest.approx(loss6, rel=1e-6)
    torch.testing.assert_close(torch.as_tensor(prediction.predictions), logits6, rtol=1e-5, atol=1e-6)
    assert unwrap_gpa_optimizer(trainer.optimizer).train_mode
    assert_equal_dicts(params_of(trainer.model), y)
    trainer.save_model(str(tmp_path))
    assert_equal_dicts(params_of(LlamaForCausalLM.from_pretrained(tmp_path)), params_of(x6))
    assert_equal_dicts(params_of(trainer.model), y)


# ---- failures while saving ----


class FailingSave(GPATrainer):
    fail_in = ""

    def _save(self, *args, **kwargs):
        if self.fail_in == "_save":
            raise OSError("disk full (injected)")
        return super()._save(*args, **kwargs)

    def _save_optimizer_and_scheduler(self, *args, **kwargs):
        if self.fail_in == "_save_optimizer_and_scheduler":
            raise OSError("disk full (injected)")
        return super()._save_optimizer_and_scheduler(*args, **kwargs)


@pytest.mark.parametrize("fail_in", ["_save", "_save_optimizer_and_scheduler"])
def test_failed_checkpoint_leaves_y_bitwise(fail_in, tmp_path):
    """A checkpoint save that raises half-way leaves the parameters at y bitwise and the optimizer in train mode."""
    snapshots = Snapshots()
    args = make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    trainer = FailingSave(model=tiny_llama(), args=args, train_dataset=TokenDataset(8, seed=1), callbacks=[snapshots])
    trainer.fail_in = fail_in
    with pytest.raises(OSError, match="injected"):
        trainer.train()
    assert unwrap_gpa_optimizer(trainer.optimizer).train_mode
    assert_equal_dicts(params_of(trainer.model), snapshots.y[2])
    # And a user-called save_model() that fails is just as harmless.
    trainer.fail_in = "_save"
    with pytest.raises(OSError, match="injected"):
        trainer.save_model()
    assert_equal_dicts(params_of(trainer.model), snapshots.y[2])


# ---- best model, Hub, bf16 ----


def test_load_best_model_at_end_loads_best_x(tmp_path):
    """load_best_model_at_end loads the best checkpoint's x; its evaluation reproduces the logged one; y is exact."""
    snapshots = Snapshots()
    args = make_args(
        tmp_path,
        max_steps=4,
        **eval_and_save_every(1),
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    trainer = llama_trainer(args, snapshots)
    # A score that peaks at step 2, so that the best checkpoint is neither the first nor the last.
    trainer.compute_metrics = lambda prediction: {"score": -abs(trainer.state.global_step - 2)}
    with mock.patch.object(
        Trainer, "_load_optimizer_and_scheduler", autospec=True, side_effect=Trainer._load_optimizer_and_scheduler
    ) as loader:
        trainer.train()
    assert trainer.state.best_model_checkpoint == os.path.join(str(tmp_path), "checkpoint-2")
    # The optimizer state came through the Trainer's own loader (FSDP, devices), with its scheduler.
    assert loader.call_args_list[-1].args[1:] == (trainer.state.best_model_checkpoint,)
    assert trainer.lr_scheduler.last_epoch == 2
    assert_equal_dicts(
        params_of(trainer.model), load_file(os.path.join(tmp_path, "checkpoint-2", "model.safetensors"))
    )
    assert_equal_dicts(params_of(trainer.model), snapshots.saved_x[2])
    logged = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e and e["step"] == 2]
    assert [trainer.evaluate()["eval_loss"]] == logged
    unwrap_gpa_optimizer(trainer.optimizer).train()  # the optimizer state came with the best x: its y is exact
    assert_equal_dicts(params_of(trainer.model), snapshots.y[2])


class HubCapture:
    """Stands in for the Hub at the huggingface_hub API boundary: records each upload's files as they are then."""

    def __init__(self) -> None:
        self.uploads: list[tuple[str, dict[str, bytes]]] = []

    def create_repo(self, repo_id, *args, **kwargs):
        return types.SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"user/{repo_id}")

    def upload_folder(self, *args, repo_id, folder_path, path_in_repo=None, run_as_future=False, **kwargs):
        ignore = kwargs.get("ignore_patterns") or []
        files = {}
        for root, _, names in os.walk(folder_path):
            for name in names:
                rel = os.path.relpath(os.path.join(root, name), folder_path)
                top = rel.split(os.sep)[0]
                if any(top.startswith(p.rstrip("*")) for p in ignore):
                    continue
                with open(os.path.join(root, name), "rb") as f:
                    files[rel] = f.read()
        self.uploads.append((path_in_repo or "", files))
        if run_as_future:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(None)
            return future
        return types.SimpleNamespace(commit_url="https://huggingface.co/user/tiny-gpa/commit/0")


def test_push_to_hub_uploads_x_and_names_the_optimizer(tmp_path):
    """--push_to_hub (hub_strategy checkpoint) and push_to_hub() upload x; the model card names mu_x, mu_y, H."""
    from safetensors.torch import load as load_bytes

    hub = HubCapture()
    snapshots = Snapshots()
    with (
        mock.patch.object(HfApi, "create_repo", side_effect=hub.create_repo),
        mock.patch.object(HfApi, "upload_folder", side_effect=hub.upload_folder),
    ):
        args = make_args(
            tmp_path,
            max_steps=2,
            save_strategy="steps",
            save_steps=2,
            push_to_hub=True,
            hub_model_id="user/tiny-gpa",
            hub_strategy="checkpoint",
            gpa_mu_x=None,
            gpa_inner_steps=4,
        )
        trainer = GPATrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(8, 1), callbacks=[snapshots])
        trainer.train()
        during = list(hub.uploads)
        trainer.push_to_hub()
    x = snapshots.saved_x[2]
    assert {path for path, _ in during} == {"", "last-checkpoint"}
    for _, files in during:
        assert_equal_dicts(load_bytes(files["model.safetensors"]), x)
    final_path, final = hub.uploads[-1]
    assert final_path == ""
    assert_equal_dicts(load_bytes(final["model.safetensors"]), x)
    assert max_abs_diff(load_bytes(final["model.safetensors"]), snapshots.y[2]) > 1e-4
    card = final["README.md"].decode()
    mu_x = 0.9 ** (1 / 4)
    assert "gpa_adamw" in card and "hf_gpa" in card
    assert f"mu_x = {mu_x:.6g}" in card and f"mu_y = {MU_Y:.6g}" in card and "H = 4" in card
    assert math.isclose(float(card.split("mu_x = ")[1].split(",")[0]), mu_x, rel_tol=1e-5)
    assert "README.md" in dict(during)[""]  # the checkpoint pushes carry the card too


def test_bf16_autocast_trains_and_saves_fp32_x(tmp_path):
    """--bf16 (CPU autocast) trains, and the checkpoint holds x in fp32 (bitwise the optimizer's x), not y."""
    snapshots = Snapshots()
    args = make_args(tmp_path, bf16=True, max_steps=3, save_strategy="steps", save_steps=3)
    trainer = GPATrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(12, 1), callbacks=[snapshots])
    trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16"
    assert all(math.isfinite(loss) for loss, _ in train_losses(trainer).values())
    x_file = load_file(os.path.join(tmp_path, "checkpoint-3", "model.safetensors"))
    assert {t.dtype for t in x_file.values()} == {torch.float32}
    assert_equal_dicts(x_file, snapshots.saved_x[3])
    assert max_abs_diff(x_file, snapshots.saved_y[3]) > 1e-4
    assert max_abs_diff(x_file, params_of(tiny_llama())) > 1e-4


def test_diloco_adamw_trains_and_saves_outer_weights(tmp_path):
    """--optim diloco_adamw trains in the Trainer and its checkpoint holds the eval weights the optimizer gives."""
    snapshots = Snapshots()
    args = make_args(
        tmp_path, optim="diloco_adamw", diloco_inner_steps=2, max_steps=3, save_strategy="steps", save_steps=3
    )
    trainer = GPATrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(12, 1), callbacks=[snapshots])
    trainer.train()
    x_file = load_file(os.path.join(tmp_path, "checkpoint-3", "model.safetensors"))
    assert_equal_dicts(x_file, snapshots.saved_x[3])
    assert_equal_dicts(snapshots.saved_y[3], snapshots.y[3])


class ImageDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.pixel_values = torch.randn(n, 3, 8, 8, generator=g)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixel_values[i], "labels": self.labels[i]}


def test_vit_image_classification_evaluates_and_saves_x(tmp_path):
    """A small ViT classifier: evaluate() loss and accuracy equal a hand evaluation of the saved x weights."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    torch.manual_seed(0)
    held_out = ImageDataset(12, seed=2)

    def accuracy(prediction) -> dict[str, float]:
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    args = make_args(tmp_path, max_steps=3, per_device_eval_batch_size=12, learning_rate=0.05)
    trainer = GPATrainer(
        model=ViTForImageClassification(config),
        args=args,
        train_dataset=ImageDataset(12, seed=1),
        eval_dataset=held_out,
        compute_metrics=accuracy,
    )
    trainer.train()
    trainer.save_model()
    metrics = trainer.evaluate()
    x_model = ViTForImageClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        out = x_model(pixel_values=held_out.pixel_values, labels=held_out.labels)
    assert metrics["eval_loss"] == pytest.approx(out.loss.item(), rel=1e-6)
    assert metrics["eval_accuracy"] == (out.logits.argmax(-1) == held_out.labels).double().mean().item()
    unwrap_gpa_optimizer(trainer.optimizer).train()
    assert max_abs_diff(params_of(x_model), params_of(trainer.model)) > 1e-4  # x was saved, y is what trains


def test_stock_optim_run_is_the_stock_trainer_run(tmp_path):
    """With --optim adamw_torch, GPATrainer trains, evaluates and saves bitwise as transformers' Trainer does."""
    results = []
    for cls in (Trainer, GPATrainer):
        model = TinyRegressor().double()
        model.load_state_dict(ORACLE_INIT)
        out = tmp_path / cls.__name__
        args = make_args(out, optim="adamw_torch", max_steps=3, save_strategy="steps", save_steps=3)
        trainer = cls(
            model=model, args=args, train_dataset=RegressionDataset(12, 1), eval_dataset=RegressionDataset(8, 2)
        )
        trainer.train()
        results.append(
            (
                train_losses(trainer),
                trainer.evaluate()["eval_loss"],
                load_file(out / "checkpoint-3" / "model.safetensors"),
            )
        )
    (stock_losses, stock_eval, stock_file), (losses, eval_loss, saved) = results
    assert losses == stock_losses and eval_loss == stock_eval
    assert_equal_dicts(saved, stock_file)


def test_user_built_gpa_optimizer_with_plain_training_arguments(tmp_path):
    """A GPAAdamW passed via optimizers=(...) with plain TrainingArguments is also evaluated and saved at x."""
    from transformers import TrainingArguments

    snapshots = Snapshots()
    model = tiny_llama()
    optimizer = GPAAdamW(model.parameters(), lr=1e-2, mu_x=MU_X, mu_y=MU_Y)
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=2, save_strategy="steps", save_steps=2
    )
    trainer = GPATrainer(
        model=model, args=args, train_dataset=TokenDataset(8, 1), optimizers=(optimizer, None), callbacks=[snapshots]
    )
    trainer.train()
    x_file = load_file(os.path.join(tmp_path, "checkpoint-2", "model.safetensors"))
    assert_equal_dicts(x_file, snapshots.saved_x[2])
    assert max_abs_diff(x_file, snapshots.saved_y[2]) > 1e-4


def test_accelerated_optimizer_forwards_modes_and_closure(tmp_path):
    """trainer.optimizer (accelerate's wrapper) forwards train()/eval() and step(closure) to GPAAdamW."""
    from accelerate.optimizer import AcceleratedOptimizer

    model = TinyRegressor().double()
    data = RegressionDataset(8, 1)
    trainer = GPATrainer(model=model, args=make_args(tmp_path, max_steps=1), train_dataset=data)
    trainer.train()
    assert isinstance(trainer.optimizer, AcceleratedOptimizer)
    inner = unwrap_gpa_optimizer(trainer.optimizer)
    assert type(inner) is GPAAdamW and not inner.train_mode
    trainer.optimizer.train()
    assert inner.train_mode
    with pytest.raises(RuntimeError, match="eval mode"):
        trainer.optimizer.eval()
        trainer.optimizer.step()
    trainer.optimizer.train()

    losses = []

    def closure() -> torch.Tensor:
        model.zero_grad()
        loss = model(**data[:])["loss"]
        loss.backward()
        losses.append(loss.item())
        return loss

    before = params_of(model)
    expected = model(**data[:])["loss"].item()  # at y
    trainer.optimizer.step(closure)  # accelerate's wrapper forwards the closure (and drops its return value)
    assert losses == [expected]
    assert max_abs_diff(before, params_of(model)) > 0
    assert inner.step(closure).item() == losses[-1]  # the optimizer itself returns the closure's loss


class SaveAtTrainEnd(TrainerCallback):
    """What a logging integration uploading the model in on_train_end (W&B, DVCLive) would save."""

    def __init__(self) -> None:
        self.saved: dict[str, torch.Tensor] | None = None

    def on_train_end(self, args, state, control, model=None, **kwargs) -> None:
        self.saved = params_of(model)


def test_on_train_end_callbacks_see_x(tmp_path):
    """Every on_train_end callback (given at construction or added later) sees x: the final checkpoint's weights."""
    args = make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=4, per_device_train_batch_size=8)
    given, added = SaveAtTrainEnd(), SaveAtTrainEnd()
    trainer = GPATrainer(
        model=TinyRegressor().double(), args=args, train_dataset=RegressionDataset(32, seed=1), callbacks=[given]
    )
    trainer.add_callback(added)
    trainer.train()
    x = {name: t.double() for name, t in load_file(tmp_path / "checkpoint-4" / "model.safetensors").items()}
    assert_equal_dicts(given.saved, x)
    assert_equal_dicts(added.saved, x)
    unwrap_gpa_optimizer(trainer.optimizer).train()
    assert max_abs_diff(params_of(trainer.model), x) > 1e-3  # y is far from x: the test tells them apart


# ---- the callback list: the stock Trainer's, with one callback more only when a GPA optimizer is in use ----


def _callback_types(trainer: Trainer) -> list[type]:
    return [type(callback) for callback in trainer.callback_handler.callbacks]


@pytest.mark.parametrize("disable_tqdm", [True, False])
@pytest.mark.parametrize("args_type", ["TrainingArguments", "GPATrainingArguments"])
def test_stock_optim_keeps_the_stock_callback_list(args_type, disable_tqdm, tmp_path):
    """With a stock --optim, GPATrainer's callbacks are the stock Trainer's, in the same order, before and after the
    optimizer is created (none given, one class given at construction, one instance added later)."""
    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=disable_tqdm)
    args = TrainingArguments(**common) if args_type == "TrainingArguments" else GPATrainingArguments(**common)
    for given in (None, [SaveAtTrainEnd]):
        stock = Trainer(model=TinyRegressor(), args=args, callbacks=given)
        ours = GPATrainer(model=TinyRegressor(), args=args, callbacks=given)
        assert _callback_types(ours) == _callback_types(stock)
        for trainer in (stock, ours):
            trainer.add_callback(SaveAtTrainEnd())
            trainer.create_optimizer_and_scheduler(num_training_steps=4)
        assert _callback_types(ours) == _callback_types(stock)
        assert type(ours.callback_handler.callbacks[0]) is DefaultFlowCallback


def _gpa_trainer(route: str, tmp_path, **kwargs) -> GPATrainer:
    """A GPATrainer whose GPA optimizer comes from --optim, optimizers= or optimizer_cls_and_kwargs=."""
    model = TinyRegressor().double()
    if route == "optim":
        return GPATrainer(model=model, args=make_args(tmp_path), **kwargs)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=True)
    if route == "optimizers":
        optimizer = GPAAdamW(model.parameters(), lr=1e-2, mu_x=MU_X, mu_y=MU_Y)
        return GPATrainer(model=model, args=args, optimizers=(optimizer, None), **kwargs)
    cls_and_kwargs = (GPAAdamW, {"lr": 1e-2, "mu_x": MU_X, "mu_y": MU_Y})
    return GPATrainer(model=model, args=args, optimizer_cls_and_kwargs=cls_and_kwargs, **kwargs)


@pytest.mark.parametrize("route", ["optim", "optimizers", "optimizer_cls_and_kwargs"])
def test_gpa_callback_comes_right_after_the_default_flow(route, tmp_path):
    """With a GPA optimizer, callbacks[0] is still DefaultFlowCallback (code that indexes the list keeps working) and
    the callback that puts x in place comes next, before the printer and every callback given or added."""
    trainer = _gpa_trainer(route, tmp_path, callbacks=[SaveAtTrainEnd])
    trainer.add_callback(SaveAtTrainEnd())
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    types_ = _callback_types(trainer)
    assert types_[:2] == [DefaultFlowCallback, EvaluationWeightsAtTrainEnd]
    assert types_.count(EvaluationWeightsAtTrainEnd) == 1
    stock = Trainer(model=TinyRegressor(), args=trainer.args, callbacks=[SaveAtTrainEnd])
    stock.add_callback(SaveAtTrainEnd())
    assert types_[:1] + types_[2:] == _callback_types(stock)


class GPAOptimizerOfItsOwn(GPATrainer):
    """A subclass that builds its GPA optimizer itself, in create_optimizer, from stock TrainingArguments."""

    def create_optimizer(self, *args, **kwargs):
        if self.optimizer is None:
            self.optimizer = GPAAdamW(self.model.parameters(), lr=1e-2, mu_x=MU_X, mu_y=MU_Y)
        return self.optimizer


def test_a_gpa_optimizer_created_after_init_still_gives_x_at_train_end(tmp_path):
    """A GPA optimizer that exists only once train() creates it still puts x in place before every on_train_end
    callback (given at construction or added later), right after DefaultFlowCallback."""
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=True, max_steps=4,
        per_device_train_batch_size=8, save_strategy="steps", save_steps=4,
    )  # fmt: skip
    given, added = SaveAtTrainEnd(), SaveAtTrainEnd()
    trainer = GPAOptimizerOfItsOwn(
        model=TinyRegressor().double(), args=args, train_dataset=RegressionDataset(32, seed=1), callbacks=[given]
    )
    trainer.add_callback(added)
    assert EvaluationWeightsAtTrainEnd not in _callback_types(trainer)  # no GPA optimizer yet: the stock list
    trainer.train()
    assert _callback_types(trainer)[:2] == [DefaultFlowCallback, EvaluationWeightsAtTrainEnd]
    x = {name: t.double() for name, t in load_file(tmp_path / "checkpoint-4" / "model.safetensors").items()}
    assert_equal_dicts(given.saved, x)
    assert_equal_dicts(added.saved, x)


# ---- evaluation and saving leave training's random state alone ----


class DropoutRegressor(TinyRegressor):
    """TinyRegressor with dropout: every training step draws its mask from torch's global generator."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.5)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.fc2(self.dropout(torch.tanh(self.norm(self.fc1(features))))).squeeze(-1)
        loss = None if labels is None else nn.functional.mse_loss(out, labels)
        return {"loss": loss, "logits": out}


def dropout_run(output_dir, **overrides) -> dict[str, torch.Tensor]:
    """Ten steps over two and a half epochs of a dropout model; its weights y after the last step."""
    torch.manual_seed(0)
    trainer = GPATrainer(
        model=DropoutRegressor().double(),
        args=make_args(output_dir, max_steps=10, **overrides),
        train_dataset=RegressionDataset(16, seed=1),
        eval_dataset=RegressionDataset(8, seed=2),
    )
    snapshots = Snapshots()
    trainer.add_callback(snapshots)
    trainer.train()
    return snapshots.y[10]


@pytest.mark.parametrize("optim", ["gpa_adamw", "adamw_torch"])
def test_evaluation_and_saving_leave_the_random_state_alone(optim, tmp_path):
    """With dropout, evaluating and saving every 2 steps trains on the same masks as neither: bitwise equal y."""
    quiet = dropout_run(tmp_path / "quiet", optim=optim)
    busy = dropout_run(tmp_path / "busy", optim=optim, **eval_and_save_every(2))
    assert_equal_dicts(busy, quiet)


def test_evaluate_leaves_the_global_generators_as_found(tmp_path):
    """evaluate() called by the user draws nothing from Python's, NumPy's or torch's global generators."""
    import random

    import numpy as np

    trainer = GPATrainer(
        model=DropoutRegressor().double(),
        args=make_args(tmp_path, max_steps=2),
        train_dataset=RegressionDataset(16, seed=1),
        eval_dataset=RegressionDataset(8, seed=2),
    )
    trainer.train()
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    trainer.evaluate()
    trainer.save_model(str(tmp_path / "model"))
    assert random.getstate() == states[0]
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])


def test_model_card_of_a_model_trained_from_scratch(tmp_path):
    """The card of a model built from a config says "trained from scratch" and names the optimizer as typed."""
    trainer = GPATrainer(model=tiny_llama(), args=make_args(tmp_path, max_steps=1), train_dataset=TokenDataset(8, 1))
    trainer.train()
    trainer.create_model_card(dataset="tokens")
    card = (tmp_path / "README.md").read_text()
    assert "This model was trained from scratch on the tokens dataset." in card
    assert "[](https://huggingface.co/)" not in card
    assert "GPAOptimizerNames" not in card and "Use gpa_adamw with betas=(0.9,0.999)" in card
    assert card.count("## Optimizer: GPA (hf_gpa)") == 1


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            dict(),
            [
                "hf_gpa: GPA, --optim gpa_adamw: Generalized Primal Averaging around AdamW",
                "GPA's evaluation sequence x",
                "gradient point y",
            ],
        ),
        (
            dict(optim="diloco_adamw", diloco_inner_steps=2),
            ["single-worker DiLoCo", "H = 2", "the outer (slow) weights"],
        ),
        (dict(optim="adamw_torch"), []),
    ],
)
def test_the_log_says_which_weights_evaluation_and_saves_use(overrides, said, tmp_path, caplog):
    """One INFO line at the start of training names the optimizer, its constants and that evaluation and every save
    use the evaluation weights; each save says so again; a stock --optim logs neither."""
    args = make_args(tmp_path, max_steps=2, **eval_and_save_every(1), **overrides)
    with caplog.at_level("INFO", logger="hf_gpa.trainer"):
        llama_trainer(args).train()
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_gpa.trainer"]
    starts = [line for line in lines if "Evaluation, prediction and every save use" in line]
    saves = [line for line in lines if line.startswith("hf_gpa: saving the evaluation weights")]
    if not said:
        assert starts == [] and saves == []
        return
    assert len(starts) == 1 and all(part in starts[0] for part in said), starts
    assert [line.split(" to ")[1].split(";")[0] for line in saves] == [
        os.path.join(str(tmp_path), f"checkpoint-{step}") for step in (1, 2)
    ]


@pytest.mark.parametrize(
    ("optim", "overrides", "named"),
    [
        ("gpa_adamw", dict(gpa_mu_x=0.95), "saved with --gpa_mu_x 0.8, this run asks for 0.95"),
        ("gpa_adamw", dict(gpa_mu_y=0.9), "saved with --gpa_mu_y 0.6, this run asks for 0.9"),
        ("gpa_adamw", dict(gpa_mu_x=None, gpa_averaging="schedule_free"),
         "saved with --gpa_averaging 'gpa', this run asks for 'schedule_free'"),
        ("gpa", dict(gpa_base_optim="sgd", gpa_mu_x=0.95), "saved with --gpa_mu_x 0.8, this run asks for 0.95"),
    ],
)  # fmt: skip
def test_a_resume_with_other_gpa_constants_is_refused_before_training(tmp_path, optim, overrides, named):
    """A GPA checkpoint (mu_x 0.8, mu_y 0.6) resumed with another --gpa_mu_x, --gpa_mu_y or --gpa_averaging: a
    ValueError naming the flag and both values before anything is loaded (torch's load_state_dict would keep the
    saved constants over the flags without a word); with the same flags the resume goes on."""
    base = {"gpa_base_optim": "sgd"} if optim == "gpa" else {}
    first = llama_trainer(make_args(tmp_path / "run", optim=optim, gpa_mu_x=0.8, gpa_mu_y=0.6, max_steps=2,
                                    save_strategy="steps", save_steps=2, **base))  # fmt: skip
    first.train()
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    flags = {"gpa_mu_x": 0.8, "gpa_mu_y": 0.6, **base, **overrides}
    other = llama_trainer(make_args(tmp_path / "other", optim=optim, max_steps=3, **flags))
    with pytest.raises(ValueError, match=named):
        other.train(resume_from_checkpoint=checkpoint)
    assert other.optimizer is None and other.state.global_step == 0
    same = llama_trainer(make_args(tmp_path / "same", optim=optim, max_steps=3, gpa_mu_x=0.8, gpa_mu_y=0.6, **base))
    same.train(resume_from_checkpoint=checkpoint)
    assert same.state.global_step == 3
