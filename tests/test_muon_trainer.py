"""--optim muon, --optim gpa --gpa_base_optim muon and --optim diloco_muon through GPATrainer on a tiny Llama: the
groups (hidden matrices by Muon, embeddings and norms by AdamW, the stock weight-decay split), x in every checkpoint,
bitwise resume, the model card naming the base, and the flags' checks."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import (
    TokenDataset,
    assert_equal_dicts,
    make_args,
    max_abs_diff,
    params_of,
    run_llama,
    tiny_llama,
    train_losses,
)
from safetensors.torch import load_file

from hf_gpa import GPA, DiLoCo, GPATrainer, MuonWithAuxAdam
from hf_gpa.checkpoint import unwrap_gpa_optimizer
from hf_gpa.model_card import gpa_model_card_section

FLAGS = {
    "muon": dict(optim="muon"),
    "gpa_muon": dict(optim="gpa", gpa_base_optim="muon"),
    "diloco_muon": dict(optim="diloco_muon", diloco_inner_steps=2),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


pytestmark = pytest.mark.usefixtures("one_thread")


def test_decay_rule_is_the_stock_trainers(tmp_path) -> None:
    """decay_parameter_names(model) (which the muon groups use) names exactly the parameters a stock Trainer
    instance puts in its weight-decay group, on a Llama (RMSNorm) and on a model with LayerNorm and biases."""
    from helpers import TinyRegressor
    from transformers import Trainer, TrainingArguments

    from hf_gpa.optim_table import decay_parameter_names

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    for model in (tiny_llama(), TinyRegressor()):
        stock = Trainer(model=model, args=args).get_decay_parameter_names(model)
        assert decay_parameter_names(model) == stock and 0 < len(stock) < len(list(model.parameters()))


@pytest.mark.parametrize("name", list(FLAGS))
def test_optimizer_and_groups(name: str, tmp_path) -> None:
    """Each name builds its optimizer over MuonWithAuxAdam; the projections go to Muon with weight decay, the
    embedding and the (untied) head to AdamW with weight decay, the norms to AdamW without."""
    args = make_args(tmp_path, weight_decay=0.1, **FLAGS[name])
    trainer = GPATrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(8, 1))
    optimizer = trainer.create_optimizer()
    expected = {"muon": MuonWithAuxAdam, "gpa_muon": GPA, "diloco_muon": DiLoCo}[name]
    assert type(optimizer) is expected
    if name != "muon":
        assert optimizer.base_class is MuonWithAuxAdam
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    seen = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen[names[id(p)]] = (group["use_muon"], group["weight_decay"])
    assert len(seen) == len(list(trainer.model.parameters()))
    for param_name, (use_muon, weight_decay) in seen.items():
        if any(proj in param_name for proj in PROJECTIONS):
            assert (use_muon, weight_decay) == (True, 0.1), param_name
        elif param_name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert (use_muon, weight_decay) == (False, 0.1)
        else:
            assert "norm" in param_name and (use_muon, weight_decay) == (False, 0.0), param_name
    for group in optimizer.param_groups:
        assert group["lr"] == args.learning_rate and group["betas"] == (0.9, 0.999)


@pytest.fixture(scope="module")
def muon_runs(tmp_path_factory):
    """Per name: an uninterrupted 6-step run saving at 3 and 6, and one resumed from checkpoint-3."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            cache[name] = {"full": run_llama(root / "full", **FLAGS[name])}
            checkpoint = str(root / "full" / "checkpoint-3")
            cache[name]["resumed"] = run_llama(root / "resumed", resume=checkpoint, **FLAGS[name])
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(FLAGS))
def test_resume_is_bitwise_exact(name: str, muon_runs) -> None:
    """Resumed from checkpoint-3, the run gives the same losses and weights as the uninterrupted one, bitwise."""
    (full, full_snaps), (resumed, resumed_snaps) = muon_runs(name)["full"], muon_runs(name)["resumed"]
    full_losses, resumed_losses = train_losses(full), train_losses(resumed)
    assert_equal_dicts(resumed_snaps.at_start[1], full_snaps.y[3])
    for step in (4, 5, 6):
        assert resumed_losses[step] == full_losses[step], step
        assert_equal_dicts(resumed_snaps.y[step], full_snaps.y[step])
    assert_equal_dicts(params_of(resumed.model), params_of(full.model))


@pytest.mark.parametrize("name", ["gpa_muon", "diloco_muon"])
def test_checkpoints_hold_x(name: str, muon_runs) -> None:
    """GPA and DiLoCo over Muon save their evaluation weights (x, the outer weights), not the training weights."""
    trainer, snapshots = muon_runs(name)["full"]
    for step in (3, 6):
        path = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
        x_file = load_file(os.path.join(path, "model.safetensors"))
        assert_equal_dicts(x_file, snapshots.saved_x[step])
        if name == "gpa_muon" or step % 2:  # DiLoCo's outer step (H = 2) at step 6 resets the inner weights to x
            assert max_abs_diff(x_file, snapshots.saved_y[step]) > 1e-5
        assert_equal_dicts(snapshots.saved_y[step], snapshots.y[step])  # the save left y in place
        saved = torch.load(os.path.join(path, "optimizer.pt"))
        assert [g["use_muon"] for g in saved["param_groups"]] == [True, False, False]


def test_muon_baseline_checkpoint_is_its_weights(muon_runs) -> None:
    """--optim muon has no x: the checkpoint holds the trained weights, and no GPA optimizer is involved."""
    trainer, snapshots = muon_runs("muon")["full"]
    assert unwrap_gpa_optimizer(trainer.optimizer) is None
    x_file = load_file(os.path.join(trainer.args.output_dir, "checkpoint-3", "model.safetensors"))
    assert_equal_dicts(x_file, snapshots.y[3])


def test_gpa_with_mu_x_zero_is_the_muon_run_bitwise(tmp_path) -> None:
    """--optim gpa --gpa_base_optim muon --gpa_mu_x 0 gives --optim muon's weights bitwise after 4 Trainer steps
    (the model at x at the end of training: x = z exactly where y = z)."""
    runs = {}
    for name, flags in (("muon", FLAGS["muon"]), ("gpa_muon", {**FLAGS["gpa_muon"], "gpa_mu_x": 0.0})):
        args = make_args(tmp_path / name, max_steps=4, lr_scheduler_type="cosine", **flags)
        trainer = GPATrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(16, seed=1))
        trainer.train()
        runs[name] = params_of(trainer.model)
    assert_equal_dicts(runs["gpa_muon"], runs["muon"])


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("muon", ["## Optimizer: Muon (hf_gpa)", "`--optim muon`", "MuonWithAuxAdam"]),
        ("gpa_muon", ["## Optimizer: GPA (hf_gpa)", "around Muon (hf_gpa.MuonWithAuxAdam", "mu_x = 0.5"]),
        ("diloco_muon", ["single-worker DiLoCo", "`--optim diloco_muon`: Muon (hf_gpa.MuonWithAuxAdam", "H = 2"]),
    ],
)
def test_model_card_names_the_base(name: str, words: list[str], tmp_path) -> None:
    """The model card section names Muon (and GPA's / DiLoCo's constants)."""
    section = gpa_model_card_section(make_args(tmp_path, **FLAGS[name]))
    for word in words:
        assert word in section, (word, section)


@pytest.mark.parametrize("name", list(FLAGS))
def test_model_card_says_what_went_to_muon(name: str, tmp_path) -> None:
    """With the model, the card counts what Muon took (the 14 projections of the tiny Llama) and what AdamW took."""
    model = tiny_llama()
    section = gpa_model_card_section(make_args(tmp_path, **FLAGS[name]), model)
    muon = sum(p.numel() for n, p in model.named_parameters() if any(proj in n for proj in PROJECTIONS))
    assert f"Muon took 14 hidden weight matrices ({muon:,} weights), AdamW the other 7 parameters" in section, section


@pytest.mark.parametrize("name", list(FLAGS))
def test_a_model_without_hidden_matrices_is_refused(name: str, tmp_path) -> None:
    """Where nothing would go to Muon (only norms and biases), --optim muon raises instead of training AdamW alone."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.LayerNorm(4))
    trainer = GPATrainer(model=model, args=make_args(tmp_path, **FLAGS[name]), train_dataset=TokenDataset(8, 1))
    with pytest.raises(ValueError, match="no hidden weight matrix for Muon"):
        trainer.create_optimizer()


def test_gpa_over_muon_parses_from_the_command_line(tmp_path) -> None:
    """--optim gpa --gpa_base_optim muon passes HfArgumentParser and keeps its base name."""
    from transformers import HfArgumentParser

    from hf_gpa import GPATrainingArguments

    argv = ["--output_dir", str(tmp_path), "--report_to", "none", "--optim", "gpa", "--gpa_base_optim", "muon"]
    (args,) = HfArgumentParser(GPATrainingArguments).parse_args_into_dataclasses(argv)
    assert (args.optim.value, args.gpa_base_optim, args.uses_gpa) == ("gpa", "muon", True)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(optim="muon", gpa_base_optim="muon"), "--gpa_base_optim muon only applies to --optim gpa"),
        (dict(optim="diloco_muon", gpa_base_optim="muon"), "--gpa_base_optim muon only applies to --optim gpa"),
        (dict(optim="gpa", gpa_base_optim="muon_torch"), "--gpa_base_optim 'muon_torch' is not a stock"),
        (dict(optim="diloco_muon", diloco_inner_steps=0), "--diloco_inner_steps"),
    ],
)
def test_bad_flags_raise_before_any_work(overrides: dict, match: str, tmp_path) -> None:
    """Wrong combinations raise a ValueError naming the flag, in the arguments' constructor."""
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, **overrides)


def test_deepspeed_refusal_spares_only_the_muon_baseline(tmp_path, monkeypatch) -> None:
    """The DeepSpeed refusal is about switching to x: diloco_muon and gpa over muon are refused, muon is not."""
    args = make_args(tmp_path, **FLAGS["muon"])
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    args._refuse_deepspeed("muon")  # no x: nothing to refuse
    for name in ("diloco_muon", "gpa"):
        with pytest.raises(ValueError, match=f"--optim {name} cannot run under"):
            args._refuse_deepspeed(name)
