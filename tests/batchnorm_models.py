"""The models and data of the norm-statistics tests, shared by ``test_batchnorm.py`` and the launched
``batchnorm_workers.py`` (a plain module: test modules do not import each other)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import ResNetConfig, ResNetForImageClassification, TrainerCallback

from hf_gpa.trainer import GPATrainer
from hf_gpa.training_args import GPATrainingArguments


def conv_net(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """conv -> BatchNorm2d -> ReLU -> Dropout -> conv -> InstanceNorm2d (running stats) -> linear -> BatchNorm1d."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
        nn.Flatten(),
        nn.Linear(64, 5),
        nn.BatchNorm1d(5),
    ).to(dtype)


SEED = 0
TRAIN_BATCH = 32


class Digits(torch.utils.data.Dataset):
    """scikit-learn's digits upscaled to 16x16; the train split shifts the brightness by a draw from Python's global
    generator, as run_vit_gpa.py's augmentation does (a recalibration that drew from it would change training's
    data; the stock Trainer's evaluation loop itself draws from torch's global generator, not from this one)."""

    def __init__(self, split: slice, augment: bool) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images[split], dtype=torch.float32) / 16.0
        self.images = images.repeat_interleave(2, 1).repeat_interleave(2, 2).unsqueeze(1)
        self.labels = torch.tensor(digits.target[split])
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        image = self.images[i]
        if self.augment:
            image = image + 0.2 * random.random()
        return {"pixel_values": image, "labels": self.labels[i]}


TRAIN, VALID = slice(0, 768), slice(1500, 1756)


def tiny_resnet() -> ResNetForImageClassification:
    torch.manual_seed(SEED)
    config = ResNetConfig(
        num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=10
    )
    return ResNetForImageClassification(config)


def make_trainer(
    output_dir: Path,
    callbacks: list[TrainerCallback] = (),
    model: nn.Module | None = None,
    augment: bool = True,
    **overrides: Any,
) -> GPATrainer:
    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir),
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=SEED,
        logging_steps=1,
        learning_rate=1e-2,
        per_device_train_batch_size=TRAIN_BATCH,
        per_device_eval_batch_size=128,
        optim="gpa_adamw",
        gpa_mu_x=0.8,  # a short memory: x lags y by a few steps, so their statistics differ
        gpa_mu_y=0.7,
        save_strategy="no",
        dataloader_pin_memory=False,
    )
    kwargs.update(overrides)
    return GPATrainer(
        model=model if model is not None else tiny_resnet(),
        args=GPATrainingArguments(**kwargs),
        train_dataset=Digits(TRAIN, augment=augment),
        eval_dataset=Digits(VALID, augment=False),
        compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())},
        callbacks=list(callbacks),
    )
