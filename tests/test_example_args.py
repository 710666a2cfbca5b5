"""hf_gpa.example_args: the example scripts' device-dependent dataloader defaults (and that a given flag wins)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
from torch import nn

from hf_gpa.example_args import parse_with_defaults
from hf_gpa.trainer import GPATrainer
from hf_gpa.training_args import GPATrainingArguments


@dataclass
class DataArgs:
    dataset_name: str | None = field(default=None)


def _parse(argv: list[str], tmp_path) -> GPATrainingArguments:
    args, _ = parse_with_defaults(
        (GPATrainingArguments, DataArgs),
        DataArgs,
        ("dataset_name",),
        {},
        {},
        {},
        ["--output_dir", str(tmp_path), *argv],
    )
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
