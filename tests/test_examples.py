"""The example scripts run_clm_gpa.py and run_vit_gpa.py, run end to end on tiny settings, offline.

Each script's ``main()`` runs in-process under a patched ``sys.argv`` (as transformers' own example tests do), on the
embedded default data with a tiny model and a few steps; the tests read ``all_results.json`` and reload what the
script saved. Argument parsing (defaults, overrides, bad flags) is checked without training.
"""

# ruff: noqa: E402  (offline mode must be set before huggingface_hub / transformers are first imported)
from __future__ import annotations

import os

for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")

import dataclasses
import importlib.util
import json
import math
import sys
from itertools import chain
from pathlib import Path
from types import ModuleType
from unittest.mock import patch

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_gpa.data import load_stdlib_texts

REPO = Path(__file__).resolve().parents[1]

# A one-layer Llama and a 512-token BPE: a few seconds per run on one CPU core.
TINY_LLAMA = "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2"
TINY_CLM: dict[str, object] = {
    "max_steps": 4,
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 4,
    "block_size": 32,
    "max_eval_samples": 8,
    "tokenizer_vocab_size": 512,
    "tokenizer_train_bytes": 300_000,
    "config_overrides": TINY_LLAMA,
    "report_to": "none",
    "disable_tqdm": True,
    "dataloader_pin_memory": False,
}


def _as_argv(flags: dict[str, object]) -> list[str]:
    return [item for name, value in flags.items() for item in (f"--{name}", str(value))]


def _load_script(name: str) -> ModuleType:
    """Import a top-level example script as a module (the scripts are not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_clm() -> ModuleType:
    return _load_script("run_clm_gpa")


@pytest.fixture(autouse=True)
def _tokenizer_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the locally trained tokenizers out of the user's cache (shared by all tests of a session)."""
    monkeypatch.setenv("HF_GPA_CACHE", str(tmp_path_factory.getbasetemp() / "hf_gpa_cache"))


def _run_main(module: ModuleType, argv: list[str]) -> dict[str, float]:
    """Run ``module.main()`` exactly as the command line would, with ``sys.argv`` patched."""
    with patch.object(sys, "argv", [f"{module.__name__}.py", *argv]):
        return module.main()


def _results(output_dir: Path) -> dict[str, float]:
    return json.loads((output_dir / "all_results.json").read_text())


# --- run_clm_gpa.py --------------------------------------------------------------------------------------------------


# Tokenizing all 9 MB of the stdlib corpus takes longer than the rest of a tiny run, so the default-corpus run reads
# only the first files of each split (in the same order as the full corpus).
CORPUS_FILES = 24


def _first_stdlib_texts(split: str = "train") -> list[str]:
    return load_stdlib_texts(split)[:CORPUS_FILES]


@pytest.fixture(scope="module")
def clm_default_run(tmp_path_factory: pytest.TempPathFactory, run_clm: ModuleType) -> Path:
    """One tiny training run of run_clm_gpa.py on the embedded stdlib corpus with the default GPA recipe."""
    output_dir = tmp_path_factory.mktemp("clm")
    cache = tmp_path_factory.getbasetemp() / "hf_gpa_cache"
    with (
        patch.dict(os.environ, {"HF_GPA_CACHE": str(cache)}),
        patch.object(run_clm, "load_stdlib_texts", _first_stdlib_texts),
    ):
        _run_main(run_clm, ["--output_dir", str(output_dir), "--max_train_samples", "64", *_as_argv(TINY_CLM)])
    return output_dir


def test_clm_default_run_reports_metrics(clm_default_run: Path) -> None:
    """all_results.json has train and eval metrics, and perplexity is exp(eval_loss)."""
    results = _results(clm_default_run)
    for key in ("train_loss", "train_runtime", "eval_loss", "eval_accuracy", "perplexity", "eval_samples"):
        assert key in results, key
    assert results["eval_samples"] == 8
    assert math.isfinite(results["eval_loss"]) and 0.0 <= results["eval_accuracy"] <= 1.0
    assert results["perplexity"] == pytest.approx(math.exp(results["eval_loss"]), rel=1e-9)
    state = json.loads((clm_default_run / "trainer_state.json").read_text())
    assert state["global_step"] == 4


def test_clm_default_run_uses_the_gpa_recipe(clm_default_run: Path) -> None:
    """With no flags the run trains with gpa_adamw, cosine schedule, 10% warmup, weight decay 0.1 and clip 1.0."""
    args = torch.load(clm_default_run / "training_args.bin", weights_only=False)
    assert str(getattr(args.optim, "value", args.optim)) == "gpa_adamw"
    assert str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == "cosine"
    assert (args.warmup_steps, args.weight_decay, args.max_grad_norm) == (0.1, 0.1, 1.0)


def test_clm_saved_model_reproduces_eval_loss(clm_default_run: Path) -> None:
    """model.safetensors holds the evaluated weights (x): reloading it gives the reported eval_loss."""
    assert (clm_default_run / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(clm_default_run)
    tokenizer = AutoTokenizer.from_pretrained(clm_default_run)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tokenizer) == 512
    # The script's eval set: the validation files tokenized, concatenated and cut into blocks of 32; the first 8.
    ids = list(chain(*tokenizer(_first_stdlib_texts("validation"))["input_ids"]))[: 8 * 32]
    blocks = torch.tensor(ids).view(8, 32)
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=blocks[i : i + 4], labels=blocks[i : i + 4]).loss for i in (0, 4)]
    torch.testing.assert_close(
        torch.stack(losses).mean().item(), _results(clm_default_run)["eval_loss"], rtol=1e-4, atol=1e-5
    )


def test_clm_saves_the_local_tokenizer(clm_default_run: Path) -> None:
    """The locally trained BPE is saved with the model and round-trips Python source."""
    tokenizer = AutoTokenizer.from_pretrained(clm_default_run)
    text = "def f(x):\n    return x ** 2  # square\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|endoftext|>"


def test_clm_user_train_file_from_json_config(tmp_path: Path, run_clm: ModuleType) -> None:
    """A user --train_file (text) works, here given through a JSON config, with the validation split carved off."""
    train_file = tmp_path / "corpus.txt"
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}" for i in range(400)]
    train_file.write_text("\n".join(lines), encoding="utf-8")
    config = {**TINY_CLM, "output_dir": str(tmp_path / "out"), "train_file": str(train_file)}
    config["validation_split_percentage"] = 10
    config_file = tmp_path / "args.json"
    config_file.write_text(json.dumps(config))
    _run_main(run_clm, [str(config_file)])
    results = _results(tmp_path / "out")
    assert math.isfinite(results["eval_loss"]) and results["train_samples"] > 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.hidden_size == 32


def test_clm_defaults_yield_to_user_flags(run_clm: ModuleType) -> None:
    """Script defaults fill only the flags not given; coupled flags (epochs vs max_steps) switch defaults off."""
    _, data_args, args = run_clm.parse_args(["--output_dir", "unused"])
    assert args.optim.value == "gpa_adamw" and args.do_train and args.do_eval
    assert (args.max_steps, args.learning_rate, data_args.block_size) == (400, 3e-3, 256)
    _, data_args, args = run_clm.parse_args(
        ["--output_dir", "unused", "--optim", "adamw_torch", "--weight_decay", "0", "--num_train_epochs", "2",
         "--do_eval"]
    )  # fmt: skip
    assert args.optim.value == "adamw_torch" and args.weight_decay == 0.0
    assert args.max_steps == -1 and args.num_train_epochs == 2
    assert args.do_eval and not args.do_train and args.gpa_inner_steps is None  # AdamW reads no H
    with pytest.raises(ValueError, match="--gpa_mu_x 0.9 only applies to --optim gpa_adamw or gpa"):
        run_clm.parse_args(["--output_dir", "unused", "--optim", "adamw_torch", "--gpa_mu_x", "0.9"])
    _, data_args, args = run_clm.parse_args(["--output_dir", "unused", "--train_file", "data.txt"])
    assert args.optim.value == "gpa_adamw" and args.lr_scheduler_type.value == "cosine"
    assert args.max_steps == -1 and data_args.block_size is None  # the embedded sizing applies to stdlib only


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
def test_a_given_flag_wins_over_a_data_default(script: str) -> None:
    """A flag the user gives acts even where the embedded data's sizing sets a default against it: --save_steps
    alone saves (the embedded default is --save_strategy no), --eval_steps alone evaluates every N steps."""
    module = _load_script(script)
    _, _, args = module.parse_args(["--output_dir", "unused"])
    assert args.save_strategy == "no"
    _, _, args = module.parse_args(["--output_dir", "unused", "--save_steps", "2"])
    assert (args.save_strategy, args.save_steps) == ("steps", 2)
    _, _, args = module.parse_args(["--output_dir", "unused", "--save_steps", "2", "--save_strategy", "epoch"])
    assert args.save_strategy == "epoch"  # both given: the user's strategy
    _, _, args = module.parse_args(["--output_dir", "unused", "--eval_steps", "5"])
    if script == "run_vit_gpa":  # the embedded default evaluates every epoch
        assert (args.eval_strategy, args.eval_steps) == ("steps", 5)
    else:  # no default to override: as transformers, --eval_steps alone needs --eval_strategy steps
        assert args.eval_strategy == "no"


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
@pytest.mark.parametrize(
    ("argv", "do_train", "do_eval"),
    [
        ([], True, True),
        (["--do_eval", "false"], True, False),
        (["--do_eval=False"], True, False),
        (["--do_train", "false"], False, True),
        (["--do_eval"], False, True),  # asking for one step alone: as in transformers' scripts
        (["--do_train", "true"], True, False),
        (["--do_predict", "false"], True, True),
    ],
)
def test_do_flags_turn_off_only_themselves(script: str, argv: list[str], do_train: bool, do_eval: bool) -> None:
    """--do_train --do_eval is the default; a --do_* flag given false turns off only itself (--do_eval false still
    trains), one given true asks for that step alone."""
    _, _, args = _load_script(script).parse_args(["--output_dir", "unused", *argv])
    assert (args.do_train, args.do_eval) == (do_train, do_eval)


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
def test_the_config_overrides_example_of_the_help_applies_to_the_default_model(script: str) -> None:
    """--config_overrides as its --help shows it, given to the script: the default model's config takes every value
    (an example of another model's keys stops the run with "key ... isn't in the original config dict")."""
    module = _load_script(script)
    fields = dataclasses.fields(module.ModelArguments)
    (overrides,) = [f.metadata["help"] for f in fields if f.name == "config_overrides"]
    example = overrides.rsplit("Example: ", 1)[1].strip()
    model_args, _, _ = module.parse_args(["--output_dir", "unused", "--config_overrides", example])
    if script == "run_clm_gpa":

        class Tokenizer:  # what build_config reads of a tokenizer: its size and special tokens
            bos_token_id = eos_token_id = pad_token_id = None

            def __len__(self) -> int:
                return 512

        config = module.build_config(model_args, Tokenizer())
    else:
        config = module.build_config(model_args, ["a", "b"])
    for pair in example.split(","):
        key, value = pair.split("=")
        assert str(getattr(config, key)).lower() == value.lower()


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
def test_do_flags_in_a_json_file(script: str, tmp_path: Path) -> None:
    """The same rule for arguments given as one JSON file."""
    config = tmp_path / "args.json"
    config.write_text(json.dumps({"output_dir": str(tmp_path), "do_eval": False}))
    _, _, args = _load_script(script).parse_args([str(config)])
    assert (args.do_train, args.do_eval) == (True, False)


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("run_clm_gpa", ["--not_a_flag", "1"], "unknown flag --not_a_flag"),
        ("run_clm_gpa", ["--train_file", "data.parquet"], "csv, a json or a txt file"),
        ("run_clm_gpa", ["--gpa_mu_x", "1.5"], "gpa_mu_x"),
        ("run_clm_gpa", ["--validation_split_percentage", "0"], "validation_split_percentage"),
        ("run_clm_gpa", ["--model_type", "vit"], "causal-LM model type"),
        ("run_vit_gpa", ["--not_a_flag", "1"], "unknown flag --not_a_flag"),
        ("run_vit_gpa", ["--train_dir", "/nonexistent/images"], "not a directory"),
        ("run_vit_gpa", ["--min_crop_scale", "0"], "min_crop_scale"),
        ("run_vit_gpa", ["--gpa_mu_y", "0"], "gpa_mu_y"),
        ("run_vit_gpa", ["--model_type", "llama"], "image-classification model type"),
    ],
)
def test_bad_flags_fail_clearly(script: str, argv: list[str], message: str) -> None:
    """A wrong flag fails before any data or model is loaded, with a ValueError that names it."""
    with pytest.raises(ValueError, match=message):
        _load_script(script).parse_args(["--output_dir", "unused", *argv])


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
def test_ddp_does_not_look_for_unused_parameters_unless_asked(script: str) -> None:
    """Under DDP the scripts do not ask DDP to look for unused parameters (transformers' default for a model without
    activation checkpointing, which makes DDP warn on every process that it found none); the flag still wins."""
    module = _load_script(script)
    assert module.parse_args(["--output_dir", "unused"])[2].ddp_find_unused_parameters is False
    given = module.parse_args(["--output_dir", "unused", "--ddp_find_unused_parameters", "true"])
    assert given[2].ddp_find_unused_parameters is True


def _final_output_folder(path: Path) -> Path:
    """What a finished run leaves in --output_dir: the model, its config and the trainer state, no optimizer."""
    path.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "trainer_state.json", "all_results.json"):
        (path / name).write_text("{}")
    return path


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
def test_resuming_from_a_final_output_folder_is_refused_before_any_data(script: str, tmp_path: Path) -> None:
    """--resume_from_checkpoint naming a run's final folder (no optimizer state: it would start a fresh optimizer and
    schedule, then overwrite the folder) fails before any data is read, saying what is missing and what to pass."""
    module = _load_script(script)
    folder = _final_output_folder(tmp_path / "finished")
    loader = "load_raw_datasets" if script == "run_clm_gpa" else "load_raw_dataset"
    argv = ["--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", str(folder)]
    with (
        patch.object(module, loader, side_effect=AssertionError("data was read")),
        pytest.raises(ValueError, match="no optimizer state") as error,
    ):
        module.main(argv)
    assert f"--model_name_or_path {folder}" in str(error.value) and "--save_steps" in str(error.value)
    with pytest.raises(ValueError, match="not a folder"):
        module.main(["--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", str(tmp_path / "missing")])


def test_clm_save_steps_writes_checkpoints_that_resume(tmp_path: Path, run_clm: ModuleType) -> None:
    """--save_steps 2 alone writes checkpoint-2 and checkpoint-4 (the docs' recipe); after a stop at step 2 the same
    command again continues from checkpoint-2 and ends where the uninterrupted run ended, bitwise."""
    import shutil

    output_dir = tmp_path / "out"
    argv = ["--output_dir", str(output_dir), "--max_train_samples", "32", "--save_steps", "2", *_as_argv(TINY_CLM)]
    with patch.object(run_clm, "load_stdlib_texts", _first_stdlib_texts):
        uninterrupted = _run_main(run_clm, argv)
        assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
        assert (output_dir / "checkpoint-2" / "optimizer.pt").is_file()
        shutil.rmtree(output_dir / "checkpoint-4")  # as if the run had stopped after step 2
        written = (output_dir / "checkpoint-2" / "optimizer.pt").stat().st_mtime_ns
        resumed = _run_main(run_clm, argv)
    # Continued, not started anew: checkpoint-2 was not written again, checkpoint-4 was.
    assert (output_dir / "checkpoint-2" / "optimizer.pt").stat().st_mtime_ns == written
    assert json.loads((output_dir / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert resumed["eval_loss"] == uninterrupted["eval_loss"]


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder``: its modification time and contents."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(
    "flags",
    [["--save_steps", "2"], ["--save_steps", "2", "--streaming", "true"], ["--optim", "adamw_torch"]],
    ids=["checkpoints", "streaming", "adamw-no-checkpoints"],
)
def test_clm_the_same_command_again_does_not_train_again(
    flags: list[str], tmp_path: Path, run_clm: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    """A finished run's command run again (its newest checkpoint, or without checkpoints its final trainer state, at
    --max_steps) says the run is finished and ends without training or writing anything: no checkpoint-5, no file
    rewritten; it returns the metrics the run wrote."""
    output_dir = tmp_path / "out"
    argv = ["--output_dir", str(output_dir), "--max_train_samples", "32", *_as_argv(TINY_CLM), *flags]
    with patch.object(run_clm, "load_stdlib_texts", _first_stdlib_texts):
        first = _run_main(run_clm, argv)
        before = _snapshot(output_dir)
        caplog.clear()
        with caplog.at_level("WARNING"):
            again = _run_main(run_clm, argv)
    assert _snapshot(output_dir) == before
    assert again == _results(output_dir) and again["eval_loss"] == first["eval_loss"]
    (message,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("finished: ")]
    assert "nothing to do" in message and "--output_dir" in message and "--max_steps 4" in message


def test_clm_a_run_shorter_than_one_outer_period_is_warned_at_the_start(
    tmp_path: Path, run_clm: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    """DiLoCo with H = 32 for 2 steps (the docs' DiLoCo command at test sizes): one warning at the start of training
    says that no outer step will happen before the end."""
    argv = ["--output_dir", str(tmp_path / "out"), "--max_train_samples", "16", *_as_argv(TINY_CLM)]
    argv += ["--max_steps", "2", "--optim", "diloco_adamw", "--diloco_inner_steps", "32", "--do_eval", "false"]
    with patch.object(run_clm, "load_stdlib_texts", _first_stdlib_texts), caplog.at_level("WARNING"):
        _run_main(run_clm, argv)
    (warning,) = [r.getMessage() for r in caplog.records if "fewer than one outer period" in r.getMessage()]
    assert "2 steps" in warning and "H = 32" in warning and "no outer step" in warning


# --- run_vit_gpa.py --------------------------------------------------------------------------------------------------

TINY_VIT: dict[str, object] = {
    "max_steps": 4,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 16,
    "max_train_samples": 64,
    "max_eval_samples": 32,
    "config_overrides": "hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=32",
    "eval_strategy": "no",
    "report_to": "none",
    "disable_tqdm": True,
    "dataloader_pin_memory": False,
}


@pytest.fixture(scope="module")
def run_vit() -> ModuleType:
    return _load_script("run_vit_gpa")


@pytest.fixture(scope="module")
def vit_default_run(tmp_path_factory: pytest.TempPathFactory, run_vit: ModuleType) -> Path:
    """One tiny training run of run_vit_gpa.py on scikit-learn's digits with the default GPA recipe."""
    output_dir = tmp_path_factory.mktemp("vit")
    _run_main(run_vit, ["--output_dir", str(output_dir), *_as_argv(TINY_VIT)])
    return output_dir


def test_vit_the_same_command_again_after_its_epochs_does_not_train_again(
    tmp_path: Path, run_vit: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    """A run sized in epochs (--num_train_epochs, no --max_steps), run again after it finished, says so and writes
    nothing."""
    flags = {name: value for name, value in TINY_VIT.items() if name != "max_steps"}
    argv = ["--output_dir", str(tmp_path / "out"), *_as_argv(flags), "--num_train_epochs", "1"]
    first = _run_main(run_vit, argv)
    before = _snapshot(tmp_path / "out")
    with caplog.at_level("WARNING"):
        again = _run_main(run_vit, argv)
    assert _snapshot(tmp_path / "out") == before and again == first
    assert any("--num_train_epochs 1; nothing to do" in r.getMessage() for r in caplog.records)


def test_vit_default_run_reports_accuracy(vit_default_run: Path) -> None:
    """all_results.json has train metrics and eval accuracy (from the local evaluate module) on 32 images."""
    results = _results(vit_default_run)
    for key in ("train_loss", "train_runtime", "eval_loss", "eval_accuracy", "eval_samples"):
        assert key in results, key
    assert results["eval_samples"] == 32 and results["train_samples"] == 64
    assert 0.0 <= results["eval_accuracy"] <= 1.0 and math.isfinite(results["eval_loss"])
    args = torch.load(vit_default_run / "training_args.bin", weights_only=False)
    assert str(getattr(args.optim, "value", args.optim)) == "gpa_adamw" and args.remove_unused_columns is False


def test_vit_saved_model_and_processor_reproduce_eval(vit_default_run: Path) -> None:
    """model.safetensors and the saved image processor reload and give the reported eval loss and accuracy."""
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from hf_gpa.data import load_digits_dataset

    assert (vit_default_run / "model.safetensors").is_file()
    assert (vit_default_run / "preprocessor_config.json").is_file()
    model = AutoModelForImageClassification.from_pretrained(vit_default_run).eval()
    processor = AutoImageProcessor.from_pretrained(vit_default_run)
    assert model.config.id2label == {i: str(i) for i in range(10)}
    # The script's eval set: 15% split off (seed 42, stratified), shuffled with the seed, the first 32.
    split = load_digits_dataset().train_test_split(0.15, seed=42, stratify_by_column="label")
    validation = split["test"].shuffle(seed=42).select(range(32))
    pixels = processor([image.convert("RGB") for image in validation["image"]], return_tensors="pt")["pixel_values"]
    labels = torch.tensor(validation["label"])
    with torch.no_grad():
        output = model(pixel_values=pixels, labels=labels)
    results = _results(vit_default_run)
    accuracy = (output.logits.argmax(-1) == labels).float().mean().item()
    assert accuracy == pytest.approx(results["eval_accuracy"], abs=1e-6)
    torch.testing.assert_close(output.loss.item(), results["eval_loss"], rtol=1e-4, atol=1e-5)


def test_vit_user_train_dir(tmp_path: Path, run_vit: ModuleType) -> None:
    """A user image folder (--train_dir, imagefolder layout) trains, with its class names as the labels."""
    from PIL import Image
    from transformers import AutoConfig

    generator = torch.Generator().manual_seed(0)
    for label, channel in (("cat", 0), ("dog", 2)):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(10):
            pixels = torch.randint(0, 80, (12, 12, 3), generator=generator, dtype=torch.uint8)
            pixels[..., channel] += 150
            Image.fromarray(pixels.numpy()).save(tmp_path / "images" / label / f"{i}.png")
    flags = {**TINY_VIT, "max_train_samples": 16, "max_eval_samples": 4, "train_val_split": 0.2}
    _run_main(
        run_vit, ["--output_dir", str(tmp_path / "out"), "--train_dir", str(tmp_path / "images"), *_as_argv(flags)]
    )
    results = _results(tmp_path / "out")
    assert results["eval_samples"] == 4 and math.isfinite(results["eval_loss"])
    assert AutoConfig.from_pretrained(tmp_path / "out").id2label == {0: "cat", 1: "dog"}


def test_vit_defaults_yield_to_user_flags(run_vit: ModuleType) -> None:
    """Script defaults fill only the flags not given; the digits sizing applies only to the embedded dataset."""
    _, data_args, args = run_vit.parse_args(["--output_dir", "unused"])
    assert args.optim.value == "gpa_adamw" and args.do_train and args.do_eval
    assert (args.num_train_epochs, args.gpa_inner_steps, data_args.horizontal_flip) == (30, 8, False)
    _, data_args, args = run_vit.parse_args(["--output_dir", "unused", "--max_steps", "10", "--horizontal_flip"])
    assert args.max_steps == 10 and args.num_train_epochs == 3.0 and data_args.horizontal_flip
    _, data_args, args = run_vit.parse_args(["--output_dir", "unused", "--dataset_name", "user/images"])
    assert args.lr_scheduler_type.value == "cosine" and args.remove_unused_columns is False
    assert args.num_train_epochs == 3.0 and data_args.min_crop_scale == 0.08


def test_vit_missing_label_column_fails_clearly(tmp_path: Path, run_vit: ModuleType) -> None:
    """A --label_column_name absent from the dataset fails before the model is built, listing the columns."""
    with pytest.raises(ValueError, match="one of image, label"):
        run_vit.main(["--output_dir", str(tmp_path), "--label_column_name", "digit"])


def test_random_resized_crop_stays_inside_and_repeats(run_vit: ModuleType) -> None:
    """Crops are sub-rectangles of at least min_scale of the area (up to rounding), identical for equal seeds."""
    import random

    from PIL import Image

    image = Image.new("RGB", (8, 8))
    crops = [run_vit.random_resized_crop(image, 0.5, random.Random(3)).size for _ in range(2)]
    assert crops[0] == crops[1]
    rng = random.Random(0)
    for _ in range(200):
        width, height = run_vit.random_resized_crop(image, 0.5, rng).size
        assert 0 < width <= 8 and 0 < height <= 8 and width * height >= 0.5 * 64 * 0.7


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
def test_main_takes_the_command_line_only(script: str) -> None:
    """main(argv) is what the command line runs; a caller that wants the trainer (to add a callback) builds it with
    build_trainer where the script offers it."""
    import inspect

    module = _load_script(script)
    assert list(inspect.signature(module.main).parameters) == ["argv"]


@pytest.mark.parametrize(
    ("script", "flags"),
    [("run_clm_gpa", ("--block_size", "--gpa_mu_x")), ("run_vit_gpa", ("--min_crop_scale", "--gpa_mu_x"))],
)
def test_help_lists_all_argument_groups(
    script: str, flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """--help exits 0 and lists the model, data and GPA training flags together."""
    module = _load_script(script)
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--model_name_or_path" in out and all(flag in out for flag in flags)


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
def test_help_is_readable_and_shows_the_defaults_the_script_uses(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--help: a usage line naming the GPA flags, no line over 100 characters (--optim's choices wrapped), the
    defaults the script applies (--output_dir: the folder transformers writes to; a data-size default that is the
    same with a dataset shown once)."""
    with patch.object(sys, "argv", [f"{script}.py"]), pytest.raises(SystemExit):
        _load_script(script).parse_args(["--help"])
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    assert usage.startswith(f"usage: {script}.py") and "--gpa_mu_x" in usage and "--optim gpa_adamw" in usage
    assert [line for line in out.splitlines() if len(line) > 100] == []
    assert "adamw_torch_fused" in out.split("\n  --gpa_base_optim")[0]  # the --optim choices, in its help text
    output_dir = out.split("\n  --output_dir")[1].split("\n  --")[0]
    assert "(default: trainer_output)" in " ".join(output_dir.split())
    batch = " ".join(out.split("\n  --per_device_train_batch_size")[1].split("\n  --")[0].split())
    assert "with one of them" not in out
    assert batch.endswith(
        "(default: 8)"
        if script == "run_clm_gpa"
        else "(default: 32; 8 with --dataset_name/--train_dir/--validation_dir)"
    )


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
def test_the_script_ends_its_process_group(script: str, tmp_path: Path) -> None:
    """Run as a program under a launcher (here: a process group of one, as `accelerate launch` leaves it), the script
    destroys the default process group when it ends, also when main() raises: a group left to the interpreter's exit
    makes gloo abort some multi-process runs after their work is done."""
    import runpy

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        with (
            patch.object(sys, "argv", [f"{script}.py", "--gpa_mu_x", "1.5"]),
            patch.object(dist, "barrier", wraps=dist.barrier) as barrier,
            pytest.raises(SystemExit),
        ):
            runpy.run_path(str(REPO / f"{script}.py"), run_name="__main__")
        assert not dist.is_initialized()
        assert barrier.call_count == 0  # after an error nothing waits: the other processes may never arrive
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("finished", [True, False])
def test_a_finished_run_waits_for_every_process_before_ending_the_group(finished: bool, tmp_path: Path) -> None:
    """run_main: after main() returned it waits for every process (a barrier) before destroying the group, so that no
    process tears its connections down while another still uses them (gloo aborted a finished 4-process run at exit
    so); after main() raised it destroys the group without waiting and the error goes on."""
    import torch.distributed as dist

    from hf_gpa.example_args import run_main

    def main() -> None:
        if not finished:
            raise RuntimeError("main failed")

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        with patch.object(dist, "barrier", wraps=dist.barrier) as barrier:
            if finished:
                run_main(main)
            else:
                with pytest.raises(RuntimeError, match="main failed"):
                    run_main(main)
        assert barrier.call_count == int(finished)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_refused_flag_ends_the_program_as_argparse_does(
    script: str, rank: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run as a program, a refused flag prints the usage line and the message naming the flag, no traceback, exit
    status 2 (argparse's usage error); under a launcher only the first process prints it (every process refuses)."""
    import runpy

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr("hf_gpa.example_args.REFUSAL_GRACE_S", 0.0)
    with patch.object(sys, "argv", [f"{script}.py", "--gpa_mu_x", "1.5"]), pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / f"{script}.py"), run_name="__main__")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    if rank == "0":
        assert err.startswith(f"usage: {script}.py [-h] [--optim gpa_adamw] [--gpa_mu_x MU_X")
        (line,) = [line for line in err.splitlines() if line.startswith(f"{script}.py: error: ")]
        assert "--gpa_mu_x" in line and "1.5" in line
    else:
        assert err == ""
    assert "Traceback" not in err


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
def test_a_mistyped_flag_gets_the_nearest_flag(
    script: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mistyped flag ends the program with "unknown flag --gpa_mu_xx; did you mean --gpa_mu_x?", exit status 2, no
    traceback, before any work; so does the same key in a JSON file of arguments."""
    import runpy

    monkeypatch.delenv("RANK", raising=False)
    json_args = tmp_path / "args.json"
    json_args.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "gpa_mu_xx": 0.99}))
    for argv in (["--output_dir", str(tmp_path / "out"), "--gpa_mu_xx", "0.99"], [str(json_args)]):
        with patch.object(sys, "argv", [f"{script}.py", *argv]), pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(REPO / f"{script}.py"), run_name="__main__")
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"{script}.py: error: unknown flag --gpa_mu_xx; did you mean --gpa_mu_x?" in err
        assert "Traceback" not in err and "HfArgumentParser" not in err
    assert not (tmp_path / "out").exists()


def test_a_refused_flag_under_accelerate_launch_is_printed_once_without_a_traceback_of_the_script(
    tmp_path: Path,
) -> None:
    """Under ``accelerate launch`` with 2 processes (the DDP config, gloo on CPU), a refused flag is printed once and
    the first process exits with status 2 (the launcher's report names it as the root cause, exitcode 2), with no
    traceback through the script; the launcher's own traceback (ChildFailedError) and status 1 follow, as
    docs/examples.md says."""
    from launching import free_port, launch_env, run_together

    log = tmp_path / "launch.log"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs/accelerate_ddp.yaml"),
    ]
    cmd += ["--num_processes", "2", "--main_process_port", str(free_port()), str(REPO / "run_clm_gpa.py")]
    cmd += ["--output_dir", str(tmp_path / "out"), "--gpa_mu_x", "1.5"]
    (code,) = run_together([cmd], [log], launch_env(REPO), 240)
    text = log.read_text(errors="replace")
    assert text.count("run_clm_gpa.py: error: Invalid --gpa_mu_x: 1.5") == 1, text[-4000:]
    assert "exitcode  : 2" in text and "ChildFailedError" in text
    assert f'File "{REPO / "run_clm_gpa.py"}"' not in text
    assert code == 1


def test_a_checkpoint_that_cannot_continue_is_a_refused_argument(tmp_path: Path) -> None:
    """The resume checks of the example scripts refuse by `RefusedArgument` (a ValueError), so that a program run
    ends on them as on any other refused flag."""
    from hf_gpa.example_args import RefusedArgument

    module = _load_script("run_clm_gpa")
    folder = _final_output_folder(tmp_path / "finished")
    with pytest.raises(RefusedArgument, match="no optimizer state"):
        module.main(["--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", str(folder)])
