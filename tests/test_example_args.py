"""hf_gpa.example_args: the example scripts' defaults (device-dependent, per --optim) and what --help shows."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType
from unittest import mock

import accelerate
import pytest
import torch
from packaging.version import Version
from torch import nn

from hf_gpa.example_args import DataArguments, HubArguments, parse_with_defaults
from hf_gpa.trainer import GPATrainer
from hf_gpa.training_args import GPATrainingArguments


def _parse(argv: list[str], tmp_path) -> GPATrainingArguments:
    _, _, args = parse_with_defaults(HubArguments, DataArguments, {}, {}, ["--output_dir", str(tmp_path), *argv])
    return args


@pytest.mark.parametrize("accelerator", [False, True], ids=["no-accelerator", "accelerator"])
def test_pin_memory_defaults_to_the_device_found(tmp_path, accelerator: bool) -> None:
    """Without an accelerator the dataloader does not pin memory by default; with one, transformers' default holds."""
    with mock.patch.object(torch.accelerator, "is_available", return_value=accelerator):
        assert _parse([], tmp_path).dataloader_pin_memory is accelerator


@pytest.mark.parametrize("argv", [["--dataloader_pin_memory", "true"], ["--dataloader_pin_memory=True"]])
def test_an_explicit_pin_memory_flag_wins(tmp_path, argv: list[str]) -> None:
    """A --dataloader_pin_memory given by the user is kept, also on a machine without an accelerator."""
    with mock.patch.object(torch.accelerator, "is_available", return_value=False):
        assert _parse(argv, tmp_path).dataloader_pin_memory is True


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": torch.full((2,), float(i)), "labels": torch.tensor(float(i))}


@pytest.mark.skipif(torch.accelerator.is_available(), reason="torch warns about pinning only without an accelerator")
def test_default_run_emits_no_pin_memory_warning(tmp_path) -> None:
    """The example scripts' defaults give a Trainer whose dataloader does not warn about pin_memory on this CPU."""
    args = _parse(["--report_to", "none"], tmp_path)
    trainer = GPATrainer(model=nn.Linear(2, 1), args=args, train_dataset=Rows())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        next(iter(trainer.get_train_dataloader()))
    assert not [w for w in caught if "pin_memory" in str(w.message)]


# ---- what --help shows, and defaults of flags the chosen --optim does not read ----


def _load_script(name: str) -> ModuleType:
    """Import a top-level example script as a module (the scripts are not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _help(script: str, capsys) -> str:
    """The --help text of an example script, with its line wrapping undone."""
    module = _load_script(script)
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("script", "shown"),
    [
        (
            "run_clm_gpa",
            [
                "(default: gpa_adamw)",
                "(default: 400; -1 with --dataset_name/--train_file/--validation_file)",
                "(default: 0.003; 5e-05 with --dataset_name/--train_file/--validation_file)",
                "(default: 4; None with --dataset_name/--train_file/--validation_file)",
                "(default: cosine)",
            ],
        ),
        (
            "run_vit_gpa",
            [
                "(default: gpa_adamw)",
                "(default: 30; 3.0 with --dataset_name/--train_dir/--validation_dir)",
                "(default: 8; None with --dataset_name/--train_dir/--validation_dir)",
            ],
        ),
    ],
)
def test_help_shows_the_defaults_the_script_applies(script: str, shown: list[str], capsys) -> None:
    """--help shows the script's own defaults (not transformers'), each once, and names no code constant."""
    text = _help(script, capsys)
    for default in shown:
        assert default in text, default
    assert "(default: adamw_torch" not in text and "DEFAULT_" not in text
    assert ". (default: 0.7). (default: 0.7)" not in text and "i.e. H = 32" not in text
    pin = "(default: False)" if not torch.accelerator.is_available() else "(default: True)"
    assert f"Whether or not to pin memory for DataLoader. {pin}" in text


def test_default_of_a_flag_the_given_optim_ignores_is_left_out(tmp_path) -> None:
    """The script's default --gpa_inner_steps is dropped for --optim adamw_torch (which refuses it), kept for gpa."""
    module = _load_script("run_clm_gpa")
    _, _, args = module.parse_args(["--output_dir", str(tmp_path), "--optim", "adamw_torch"])
    assert args.optim.value == "adamw_torch" and args.gpa_inner_steps is None
    _, _, args = module.parse_args(["--output_dir", str(tmp_path), "--optim=gpa", "--gpa_base_optim", "sgd"])
    assert args.gpa_inner_steps == 4
    _, _, args = module.parse_args(["--output_dir", str(tmp_path), "--optim", "diloco_adamw"])
    assert args.gpa_inner_steps is None


@pytest.mark.skipif(
    Version(accelerate.__version__) < Version("1.15"),
    reason=f"accelerate {accelerate.__version__} starts a process group from WORLD_SIZE alone while parsing",
)
def test_gpa_across_processes_drops_the_script_s_default_h(tmp_path, monkeypatch) -> None:
    """--gpa_distributed true (which refuses --gpa_inner_steps) without --gpa_mu_x: the script's default
    --gpa_inner_steps is left out, and mu_x is the outer step's default, 0.9."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    module = _load_script("run_clm_gpa")
    argv = ["--output_dir", str(tmp_path), "--optim", "gpa_adamw", "--gpa_distributed", "true"]
    _, _, args = module.parse_args(argv)
    assert args.gpa_distributed and args.gpa_inner_steps is None and args.gpa_mu_x == 0.9


def test_defaults_follow_the_value_the_parse_keeps(tmp_path) -> None:
    """A flag given twice: the script's defaults follow its last value, the one argparse keeps (argv is read once,
    with the same rule as the full parse). --optim adamw_torch, then gpa_adamw: GPA-AdamW, with the default H."""
    module = _load_script("run_clm_gpa")
    argv = ["--output_dir", str(tmp_path), "--optim", "adamw_torch", "--optim=gpa_adamw", "--do_eval", "--do_eval=0"]
    _, _, args = module.parse_args(argv)
    assert args.optim.value == "gpa_adamw" and args.gpa_inner_steps == 4
    assert args.do_train and not args.do_eval  # --do_eval off: --do_train is no longer the default's alone


def test_logged_size_counts_parameters_as_the_trainer_does() -> None:
    """The scripts log the size of a new model as the Trainer counts it (tied weights once), not in units of 2**20."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.trainer_pt_utils import get_model_param_count

    from hf_gpa.example_args import size_in_parameters

    model = LlamaForCausalLM(LlamaConfig(**_load_script("run_clm_gpa").DEFAULT_LLAMA_CONFIG, vocab_size=4096))
    assert get_model_param_count(model, trainable_only=True) == 2_557_632
    assert size_in_parameters(model) == "2,557,632 parameters (2.56M)"


@pytest.mark.parametrize("script", ["run_clm_gpa", "run_vit_gpa"])
def test_help_shows_the_gpa_flags_first(script: str, capsys) -> None:
    """--help starts with a short usage line and the GPA flags in their own group, ahead of the hundreds of stock
    flags: --optim and every flag GPATrainingArguments adds, in the first screenfuls."""
    import inspect

    module = _load_script(script)
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines[0]) < 120 and lines[0].startswith("usage:")
    group = next(i for i, line in enumerate(lines) if line.startswith("GPA"))
    options = next(i for i, line in enumerate(lines) if line == "options:")
    assert group < 7 < options  # the usage lines, then the GPA group
    for name in inspect.get_annotations(GPATrainingArguments):
        flag = next(i for i, line in enumerate(lines) if line.startswith(f"  --{name} "))
        assert group < flag < options, name


def test_hf_gpa_itself_imports_no_torchao() -> None:
    """hf_gpa imports torchao only where a low-bit optimizer is asked for: ``import hf_gpa``, ``hf_gpa.optim``,
    ``hf_gpa.data`` load no torchao (whose import prints "Failed to load ..._C_mxfp8" where its kernels do not match).
    transformers.modeling_utils imports torchao whenever it is installed, so the trainer and the scripts do: not ours
    to change."""
    import subprocess
    import sys

    code = "import sys, hf_gpa, hf_gpa.optim, hf_gpa.data, hf_gpa.extras; print('torchao' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
