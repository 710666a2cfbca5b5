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
         "--do_eval", "--gpa_mu_x", "0.9"]
    )  # fmt: skip
    assert args.optim.value == "adamw_torch" and args.weight_decay == 0.0
    assert args.max_steps == -1 and args.num_train_epochs == 2
    assert args.do_eval and not args.do_train and args.gpa_mu_x == 0.9
    _, data_args, args = run_clm.parse_args(["--output_dir", "unused", "--train_file", "data.txt"])
    assert args.optim.value == "gpa_adamw" and args.lr_scheduler_type.value == "cosine"
    assert args.max_steps == -1 and data_args.block_size is None  # the embedded sizing applies to stdlib only


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--not_a_flag", "1"], "not used by the HfArgumentParser"),
        (["--train_file", "data.parquet"], "csv, a json or a txt file"),
        (["--gpa_mu_x", "1.5"], "gpa_mu_x"),
        (["--validation_split_percentage", "0"], "validation_split_percentage"),
        (["--model_type", "vit"], "causal-LM model type"),
    ],
)
def test_clm_bad_flags_fail_clearly(run_clm: ModuleType, argv: list[str], message: str) -> None:
    """A wrong flag fails before any data or model is loaded, with a ValueError that names it."""
    with pytest.raises(ValueError, match=message):
        run_clm.parse_args(["--output_dir", "unused", *argv])
