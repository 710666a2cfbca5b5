"""GPA inside TRL (`hf_gpa.trl`) and any other `Trainer` subclass: GPATrainer as a cooperative mixin.

Offline: a 2-layer Llama from a config and a word-level tokenizer trained here on a few generated sentences. Each
TRL trainer (SFT, DPO, reward) trains 6 steps with checkpoints at 3 and 6, once straight through and once resumed
from checkpoint-3; the runs are shared by the tests through a module-scoped fixture.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from helpers import TINY_LLAMA, RecordXY, all_weights, x_then_y
from safetensors.torch import load_file
from transformers import (
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from hf_gpa.checkpoint import unwrap_gpa_optimizer
from hf_gpa.trainer import GPATrainer
from hf_gpa.training_args import GPAOptimizerNames, GPATrainingArguments

trl = pytest.importorskip("trl")
from hf_gpa.trl import (  # noqa: E402  (after the skip: these need trl)
    GPADPOConfig,
    GPADPOTrainer,
    GPARewardConfig,
    GPARewardTrainer,
    GPASFTConfig,
    GPASFTTrainer,
    SyncRefModelAtX,
)

STEPS, SAVE_STEPS = 6, 3
WORDS = "the a cat dog bird sat ran flew on under over mat log tree red blue small big quick slow".split()


# ---- offline tokenizer, models, data ----


def _sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(_sentences(64, 0), trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def _config(tokenizer: PreTrainedTokenizerFast, **extra: Any) -> LlamaConfig:
    return LlamaConfig(
        **{**TINY_LLAMA, "vocab_size": len(tokenizer), "max_position_embeddings": 64},
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **extra,
    )


def _model(kind: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "reward":
        return LlamaForSequenceClassification(_config(tokenizer, num_labels=1))
    return LlamaForCausalLM(_config(tokenizer))


def _datasets(kind: str) -> tuple[datasets.Dataset, datasets.Dataset]:
    texts = _sentences(64, 1)
    if kind == "sft":
        data = datasets.Dataset.from_dict({"text": texts})
    elif kind == "dpo":
        data = datasets.Dataset.from_dict(
            {"prompt": texts[:32], "chosen": [" " + t for t in texts[32:]], "rejected": [" " + t for t in texts[:32]]}
        )
    else:
        data = datasets.Dataset.from_dict({"chosen": texts[:32], "rejected": texts[32:]})
    return data, data.select(range(8))


GPA_CLASSES = {
    "sft": (GPASFTConfig, GPASFTTrainer),
    "dpo": (GPADPOConfig, GPADPOTrainer),
    "reward": (GPARewardConfig, GPARewardTrainer),
}
STOCK_CLASSES = {
    "sft": (trl.SFTConfig, trl.SFTTrainer),
    "dpo": (trl.DPOConfig, trl.DPOTrainer),
    "reward": (trl.RewardConfig, trl.RewardTrainer),
}


def _trainer(
    kind: str,
    tokenizer,
    output_dir: Path,
    model: torch.nn.Module,
    stock: bool = False,
    arg_overrides: dict[str, Any] | None = None,
    **extra,
):
    config_cls, trainer_cls = (STOCK_CLASSES if stock else GPA_CLASSES)[kind]
    gpa = {} if stock else {"optim": "gpa_adamw", "gpa_mu_x": 0.5, "gpa_mu_y": 0.7}
    settings = dict(
        output_dir=str(output_dir),
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,  # TRL's configs default to bf16 where fp16 is off
        seed=0,
        logging_steps=1,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        **gpa,
    )
    args = config_cls(**{**settings, **(arg_overrides or {})})
    train, evaluation = _datasets(kind)
    if kind == "dpo":
        extra.setdefault("ref_model", _model(kind, tokenizer, seed=1))
    return trainer_cls(
        model=model, args=args, train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer, **extra
    )


@dataclass
class Run:
    kind: str
    output_dir: Path
    record: RecordXY
    x: dict[str, torch.Tensor]  # the live weights after train() (x) and the y the optimizer switches back to
    y: dict[str, torch.Tensor]
    eval_metrics: dict[str, float]
    resumed_x: dict[str, torch.Tensor]
    resumed_y: dict[str, torch.Tensor]
    trainer: Any


@pytest.fixture(scope="module", params=["sft", "dpo", "reward"])
def run(request, tokenizer, tmp_path_factory) -> Run:
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    record = RecordXY()
    trainer = _trainer(kind, tokenizer, root / "full", _model(kind, tokenizer), callbacks=[record])
    trainer.train()
    trainer.save_model(str(root / "final"))
    eval_metrics = trainer.evaluate()
    x, y = x_then_y(trainer)

    resumed = _trainer(kind, tokenizer, root / "resumed", _model(kind, tokenizer))
    resumed.train(resume_from_checkpoint=str(root / "full" / f"checkpoint-{SAVE_STEPS}"))
    resumed_x, resumed_y = x_then_y(resumed)
    return Run(kind, root, record, x, y, eval_metrics, resumed_x, resumed_y, trainer)


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _weights_file(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _subset(state: dict[str, torch.Tensor], keys) -> dict[str, torch.Tensor]:
    return {k: state[k] for k in keys}


# ---- the TRL trainers with GPA ----


def test_trl_checkpoints_and_final_save_hold_x(run: Run) -> None:
    """Every checkpoint holds that step's x (not y), and the final save equals the last checkpoint and the live x."""
    for step in (SAVE_STEPS, STEPS):
        saved = _weights_file(run.output_dir / "full" / f"checkpoint-{step}")
        _assert_equal(saved, _subset(run.record.x[step], saved))
        assert not all(torch.equal(saved[k], run.record.y[step][k]) for k in saved)
    final = _weights_file(run.output_dir / "final")
    _assert_equal(final, _weights_file(run.output_dir / "full" / f"checkpoint-{STEPS}"))
    _assert_equal(final, _subset(run.x, final))


def test_trl_evaluate_runs_at_x(run: Run, tokenizer, tmp_path) -> None:
    """`evaluate()` of the GPA trainer equals the stock TRL trainer's evaluation of the saved x (and not of y)."""
    model_cls = type(run.trainer.model)

    def stock_eval_loss(weights: dict[str, torch.Tensor]) -> float:
        model = _model(run.kind, tokenizer, seed=2)
        model.load_state_dict(weights)
        return _trainer(run.kind, tokenizer, tmp_path, model, stock=True).evaluate()["eval_loss"]

    assert model_cls.__name__ in ("LlamaForCausalLM", "LlamaForSequenceClassification")
    at_x, at_y = stock_eval_loss(run.x), stock_eval_loss(run.y)
    assert run.eval_metrics["eval_loss"] == pytest.approx(at_x, rel=1e-6, abs=0.0)
    assert abs(at_x - at_y) > 1e-4


def test_trl_resume_from_middle_checkpoint_is_bitwise(run: Run) -> None:
    """A run resumed from checkpoint-3 ends with the same x and y, bitwise, as the uninterrupted run."""
    _assert_equal(run.resumed_x, run.x)
    _assert_equal(run.resumed_y, run.y)


def test_trl_model_card_names_gpa(run: Run) -> None:
    """TRL's model card (written at each checkpoint) carries the hf_gpa tags and the GPA section."""
    card = (run.output_dir / "full" / "README.md").read_text()
    assert "hf_gpa" in card and "gpa_adamw" in card and "## Optimizer: GPA (hf_gpa)" in card


@pytest.mark.parametrize("run", ["dpo"], indirect=True)
def test_dpo_reference_model_is_never_optimized(run: Run, tokenizer) -> None:
    """DPO's reference model is not among the optimizer's parameters and its weights are unchanged by training."""
    trainer = run.trainer
    optimized = {id(p) for group in unwrap_gpa_optimizer(trainer.optimizer).param_groups for p in group["params"]}
    assert optimized and not optimized & {id(p) for p in trainer.ref_model.parameters()}
    assert optimized <= {id(p) for p in trainer.model.parameters()}
    _assert_equal(all_weights(trainer.ref_model), all_weights(_model("dpo", tokenizer, seed=1)))  # as built, bitwise
    assert not torch.equal(trainer.model.model.embed_tokens.weight, trainer.ref_model.model.embed_tokens.weight)


def test_dpo_sync_ref_model_copies_x_not_y(tokenizer, tmp_path) -> None:
    """With sync_ref_model=True (mixup alpha 1: a plain copy) the reference model receives the policy's x at the sync
    step, bitwise, not the y TRL's callback would read from the live parameters; training itself is unchanged."""
    record = RecordXY()
    overrides = dict(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=1.0, save_strategy="no")
    trainer = _trainer(
        "dpo", tokenizer, tmp_path, _model("dpo", tokenizer), arg_overrides=overrides, callbacks=[record]
    )
    syncs = [c for c in trainer.callback_handler.callbacks if isinstance(c, trl.SyncRefModelCallback)]
    assert [type(c) for c in syncs] == [SyncRefModelAtX]
    trainer.train()
    reference = all_weights(trainer.ref_model)
    _assert_equal(reference, _subset(record.x[STEPS], reference))
    assert not any(torch.equal(reference[k], record.y[STEPS][k]) for k in reference if k.endswith("proj.weight"))


# ---- configs ----


@pytest.mark.parametrize("kind", ["sft", "dpo", "reward"])
def test_trl_configs_parse_gpa_flags_and_keep_trl_defaults(kind: str, tmp_path) -> None:
    """The GPA configs parse the GPA flags, keep every TRL default, and reject a bad GPA flag with a ValueError."""
    config_cls, stock_cls = GPA_CLASSES[kind][0], STOCK_CLASSES[kind][0]
    defaults = {f.name: (f.default, f.default_factory) for f in dataclasses.fields(config_cls)}
    stock_defaults = {f.name: (f.default, f.default_factory) for f in dataclasses.fields(stock_cls)}
    assert {name: defaults[name] for name in stock_defaults} == stock_defaults  # e.g. SFT's learning rate 2e-5
    (args,) = HfArgumentParser(config_cls).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--optim", "gpa_adamw", "--gpa_mu_x", "0.5", "--use_cpu", "true"]
    )
    stock = stock_cls(output_dir=str(tmp_path), use_cpu=True)
    assert args.optim == GPAOptimizerNames.GPA_ADAMW and args.gpa_mu_x == 0.5
    assert args.learning_rate == stock.learning_rate and args.bf16 == stock.bf16
    with pytest.raises(ValueError, match="--gpa_mu_y"):
        config_cls(output_dir=str(tmp_path), use_cpu=True, optim="gpa_adamw", gpa_mu_y=2.0)


def test_trl_parser_takes_the_gpa_config(tmp_path) -> None:
    """TRL's scripts parse with `TrlParser((ScriptArguments, GPASFTConfig, ModelConfig))`: the GPA flags reach the
    config."""
    parser = trl.TrlParser((trl.ScriptArguments, GPASFTConfig, trl.ModelConfig))
    common = ["--dataset_name", "d", "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"]
    _, training_args, _ = parser.parse_args_and_config([*common, "--optim", "gpa_adamw", "--gpa_mu_x", "0.9"])
    assert isinstance(training_args, GPASFTConfig)
    assert training_args.optim == GPAOptimizerNames.GPA_ADAMW and training_args.gpa_mu_x == 0.9


def test_recipe_keeps_the_other_configs_own_defaults(tmp_path) -> None:
    """The two-class recipe on any TrainingArguments subclass keeps that subclass's redeclared defaults."""

    @dataclass
    class OtherArguments(TrainingArguments):
        learning_rate: float = 3e-4
        other_flag: int = 7

    @dataclass
    class GPAOtherArguments(GPATrainingArguments, OtherArguments):
        gpa_mu_y: float = 0.5  # the new class's own declarations still win

    args = GPAOtherArguments(output_dir=str(tmp_path), use_cpu=True, optim="gpa_adamw")
    assert (args.learning_rate, args.other_flag, args.gpa_mu_y, args.weight_decay) == (3e-4, 7, 0.5, 0.0)
    assert [f.name for f in dataclasses.fields(GPAOtherArguments)][:3] == [
        f.name for f in dataclasses.fields(TrainingArguments)
    ][:3]


def test_trl_classes_are_lazy_names_of_hf_gpa() -> None:
    """`hf_gpa.GPASFTTrainer` and friends resolve to the classes of `hf_gpa.trl`."""
    import hf_gpa

    assert hf_gpa.GPASFTTrainer is GPASFTTrainer and hf_gpa.GPADPOConfig is GPADPOConfig
    assert {"GPASFTTrainer", "GPADPOTrainer", "GPARewardTrainer"} <= set(hf_gpa.__all__)


def test_missing_trl_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without trl, importing hf_gpa.trl raises an ImportError that names `pip install "hf_gpa[trl]"`."""
    monkeypatch.setitem(sys.modules, "trl", None)  # makes `import trl` raise ImportError
    monkeypatch.delitem(sys.modules, "hf_gpa.trl")
    with pytest.raises(ImportError, match=r'pip install "hf_gpa\[trl\]"'):
        importlib.import_module("hf_gpa.trl")


# ---- any Trainer subclass: overrides pass through what the next class takes ----


class _Recorder(Trainer):
    """Stands for a Trainer subclass with its own signatures (TRL's create_model_card, Seq2Seq's gen_kwargs)."""

    def __init__(self, args) -> None:  # no real Trainer: only what the overrides read
        self.args, self.optimizer, self.calls = args, None, []

    def _record(self, name: str, *args: Any, **kwargs: Any) -> str:
        self.calls.append((name, args, kwargs))
        return name

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval", **gen_kwargs):
        return self._record("evaluate", eval_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test", **gen_kwargs):
        return self._record("predict", test_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)

    def save_model(self, output_dir=None, _internal_call=False, *, extra=None):
        return self._record("save_model", output_dir, _internal_call, extra=extra)

    def _save_checkpoint(self, model, trial, *, extra=None):
        return self._record("_save_checkpoint", model, trial, extra=extra)

    def _load_optimizer_and_scheduler(self, checkpoint, *, extra=None):
        return self._record("_load_optimizer_and_scheduler", checkpoint, extra=extra)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        return self._record("train", resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        with open(f"{self.args.output_dir}/README.md", "w") as card:  # each call writes a new card, as TRL's do
            card.write(f"# {model_name}\n")
        return self._record("create_model_card", model_name, dataset_name, tags)


class _Mixed(GPATrainer, _Recorder):
    pass


def test_overrides_pass_through_the_next_classes_arguments(tmp_path) -> None:
    """Each GPATrainer override hands the next class in the MRO exactly the arguments it was called with."""
    trainer = _Mixed(GPATrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"))
    trainer.evaluate("data", None, "val", max_new_tokens=3)
    trainer.predict("data", ["k"], metric_key_prefix="test", num_beams=2)
    trainer.save_model("out", True, extra=1)
    trainer._save_checkpoint("model", None, extra=2)
    trainer._load_optimizer_and_scheduler(None, extra=3)
    trainer.train("ckpt", None, None, extra=4)
    assert trainer.calls == [
        ("evaluate", ("data", None, "val"), {"max_new_tokens": 3}),
        ("predict", ("data", ["k"], "test"), {"num_beams": 2}),
        ("save_model", ("out", True), {"extra": 1}),
        ("_save_checkpoint", ("model", None), {"extra": 2}),
        ("_load_optimizer_and_scheduler", (None,), {"extra": 3}),
        ("train", ("ckpt", None, None), {"extra": 4}),
    ]


def test_model_card_tags_follow_the_next_classes_signature(tmp_path) -> None:
    """The hf_gpa tags land in ``tags`` of a TRL-style create_model_card, given by position, keyword or not at all."""
    trainer = _Mixed(GPATrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", optim="gpa_adamw"))
    trainer.create_model_card("m", "d")
    trainer.create_model_card("m", None, "mine")
    trainer.create_model_card(model_name="m", tags=["mine", "hf_gpa"])
    assert [call[1][2] for call in trainer.calls] == [
        ["hf_gpa", "gpa_adamw"],
        ["mine", "hf_gpa", "gpa_adamw"],
        ["mine", "hf_gpa", "gpa_adamw"],
    ]
    assert (tmp_path / "README.md").read_text().count("## Optimizer: GPA (hf_gpa)") == 1  # on the last card
