#!/usr/bin/env python
"""Image classification (ViT and other AutoModelForImageClassification models) with the GPA optimizer.

This is transformers' ``examples/pytorch/image-classification/run_image_classification.py`` with two names changed
(``TrainingArguments`` -> ``GPATrainingArguments``, ``Trainer`` -> ``GPATrainer``), an offline default for every
input, and the paper's training recipe as the default. Accuracy comes from `evaluate` loaded from the metric module
that ships in hf_gpa (:data:`hf_gpa.metrics.ACCURACY`), since evaluate's Hub metrics need a network.

With no dataset and no model named, the script needs no network:

* data: scikit-learn's bundled handwritten digits (:func:`hf_gpa.data.load_digits_dataset`, 1,797 8x8 images),
  15% split off for validation, stratified by label, with ``--seed``;
* model: a small ViT built from a config (:data:`DEFAULT_VIT_CONFIG`, 16x16 inputs in 4x4 patches) and a matching
  ``ViTImageProcessor`` (resize to 16x16, normalize to [-1, 1]); with ``--model_type resnet`` a small ResNet with
  BatchNorm (:data:`DEFAULT_RESNET_CONFIG`, 32x32 inputs), whose statistics GPATrainer recomputes at x
  (``--gpa_bn_recalibration_batches``);
* training: :data:`EMBEDDED_DEFAULTS` (30 epochs of 32 images), a few minutes on 2 CPU cores.

Train-time augmentation is a random resized crop (``--min_crop_scale``) and an optional horizontal flip
(``--horizontal_flip``), done on the PIL image before the image processor; evaluation sees the whole image.
Without torchvision this uses PIL only. It draws from Python's global generator, seeded by ``--seed``, which
GPATrainer's BatchNorm recalibration leaves untouched: it forwards augmented training batches without changing
training's own random draws.

Defaults: :data:`RECIPE_DEFAULTS` (the paper's recipe and ``--remove_unused_columns false``, since the image column
must reach the transform) always, :data:`EMBEDDED_DEFAULTS` when no ``--dataset_name``/``--train_dir``/
``--validation_dir`` is given. ``hf_gpa.example_args`` says how the scripts apply their defaults (a flag given always
wins) and what else they share.

Examples::

    python run_vit_gpa.py --output_dir outputs/vit-gpa                       # the embedded default
    python run_vit_gpa.py --output_dir outputs/vit-adamw --optim adamw_torch   # the same run with AdamW
    python run_vit_gpa.py --output_dir outputs/resnet-gpa --model_type resnet  # a small ResNet (BatchNorm)
    python run_vit_gpa.py --train_dir my_images/train --validation_dir my_images/val --output_dir outputs/mine
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hf_gpa.extras import requires_extra

with requires_extra("run_vit_gpa.py", "examples"):  # without it, stop here with the pip command that installs it
    import datasets
    import evaluate
    import numpy as np
    import torch
    from datasets import DatasetDict, load_dataset
    from PIL import Image
    from transformers import (
        CONFIG_MAPPING,
        MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING,
        AutoConfig,
        AutoImageProcessor,
        AutoModelForImageClassification,
        EvalPrediction,
        PreTrainedConfig,
        ViTConfig,
        ViTImageProcessorPil,
        set_seed,
    )
    from transformers.image_processing_utils import BaseImageProcessor

    from hf_gpa import GPATrainer, GPATrainingArguments
    from hf_gpa.data import load_digits_dataset
    from hf_gpa.example_args import (
        GPA_RECIPE_DEFAULTS,
        DataArguments,
        HubArguments,
        apply_config_overrides,
        check_model_source,
        parse_with_defaults,
        run_example,
        run_main,
        size_in_parameters,
    )
    from hf_gpa.metrics import ACCURACY

logger = logging.getLogger(__name__)

MODEL_CONFIG_CLASSES = list(MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING.keys())
MODEL_TYPES = tuple(conf.model_type for conf in MODEL_CONFIG_CLASSES)

#: The paper's recipe (`hf_gpa.example_args.GPA_RECIPE_DEFAULTS`), applied unless the flag is given. The image column
#: must survive until the on-the-fly transform, hence remove_unused_columns=False (which upstream's README passes by
#: hand).
RECIPE_DEFAULTS: dict[str, Any] = {**GPA_RECIPE_DEFAULTS, "remove_unused_columns": False}

#: Sizing of the embedded default (digits, small ViT): a few minutes on 2 CPU cores, well above chance accuracy.
#: Applied unless the flag is given, and only when no dataset or image folder is named.
EMBEDDED_DEFAULTS: dict[str, Any] = {
    "num_train_epochs": 30,
    "learning_rate": 2e-3,
    "per_device_train_batch_size": 32,
    "per_device_eval_batch_size": 64,
    "logging_steps": 20,
    "eval_strategy": "epoch",
    "save_strategy": "no",
    # Digits are not mirror-symmetric, and 8x8 images have little room to crop.
    "horizontal_flip": False,
    "min_crop_scale": 0.7,
    # 1,440 steps: a shorter averaging window than the paper's H = 32 (mu_x = 0.9967) tuned for ~10^4 steps.
    "gpa_inner_steps": 8,
}

#: The default model: a 4-layer ViT on 16x16 images in 4x4 patches (16 patches + CLS; about 0.3M parameters).
DEFAULT_VIT_CONFIG: dict[str, Any] = {
    "image_size": 16,
    "patch_size": 4,
    "num_channels": 3,
    "hidden_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 192,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}

#: ``--model_type resnet``: a 3-stage ResNet of basic blocks (widths 16/32/64, one block each; about 80K
#: parameters, 9 BatchNorm layers) on the digits upscaled to 32x32 (``image_size`` sizes the image processor).
DEFAULT_RESNET_CONFIG: dict[str, Any] = {
    "image_size": 32,
    "num_channels": 3,
    "embedding_size": 16,
    "hidden_sizes": [16, 32, 64],
    "depths": [1, 1, 1],
    "layer_type": "basic",
}

#: Model types that train from scratch with a small config of the script's rather than the type's stock default.
SMALL_CONFIGS: dict[str, dict[str, Any]] = {"resnet": DEFAULT_RESNET_CONFIG}

#: How --help names the default models.
DEFAULT_VIT_TEXT = (
    f"a small ViT ({DEFAULT_VIT_CONFIG['num_hidden_layers']} layers, hidden size {DEFAULT_VIT_CONFIG['hidden_size']}, "
    f"{DEFAULT_VIT_CONFIG['image_size']}x{DEFAULT_VIT_CONFIG['image_size']} inputs in "
    f"{DEFAULT_VIT_CONFIG['patch_size']}x{DEFAULT_VIT_CONFIG['patch_size']} patches)"
)
DEFAULT_RESNET_TEXT = (
    f"a small ResNet with BatchNorm (widths {'/'.join(map(str, DEFAULT_RESNET_CONFIG['hidden_sizes']))}, "
    f"{DEFAULT_RESNET_CONFIG['image_size']}x{DEFAULT_RESNET_CONFIG['image_size']} inputs)"
)


@dataclass
class DataTrainingArguments(DataArguments):
    """What data to train and evaluate on. No dataset or folder: scikit-learn's bundled digits."""

    data_source_flags: ClassVar[tuple[str, ...]] = (*DataArguments.data_source_flags, "train_dir", "validation_dir")

    # DataArguments' flag, its help saying what unset means here.
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": (
                "Name of a dataset from the hub (could be your own, possibly private dataset hosted on the hub). "
                "Unset (and no --train_dir/--validation_dir): scikit-learn's bundled digits."
            )
        },
    )
    train_dir: str | None = field(default=None, metadata={"help": "A folder containing the training data."})
    validation_dir: str | None = field(default=None, metadata={"help": "A folder containing the validation data."})
    train_val_split: float | None = field(
        default=0.15, metadata={"help": "Percent to split off of train for validation."}
    )
    image_column_name: str = field(
        default="image",
        metadata={"help": "The name of the dataset column containing the image data. Defaults to 'image'."},
    )
    label_column_name: str = field(
        default="label",
        metadata={"help": "The name of the dataset column containing the labels. Defaults to 'label'."},
    )
    min_crop_scale: float = field(
        default=0.08,
        metadata={
            "help": (
                "Train-time augmentation: the smallest area fraction of the random resized crop, in (0, 1] "
                "(1 keeps whole images; 0.08 as torchvision's RandomResizedCrop)."
            )
        },
    )
    horizontal_flip: bool = field(
        default=True, metadata={"help": "Train-time augmentation: flip images left-right with probability 1/2."}
    )

    def __post_init__(self) -> None:
        if self.train_val_split is not None and not 0.0 <= self.train_val_split < 1.0:
            raise ValueError(f"--train_val_split must lie in [0, 1), got {self.train_val_split}")
        if not 0.0 < self.min_crop_scale <= 1.0:
            raise ValueError(f"--min_crop_scale must lie in (0, 1], got {self.min_crop_scale}")
        for flag in ("train_dir", "validation_dir"):
            path = getattr(self, flag)
            if path is not None and not os.path.isdir(path):
                raise ValueError(f"--{flag} {path!r} is not a directory (the imagefolder loader reads a folder)")


@dataclass
class ModelArguments(HubArguments):
    """Which model/config/image processor to fine-tune, or train from scratch."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": (
                "Path to pretrained model or model identifier from huggingface.co/models. Unset: train a model from "
                f"scratch (by default {DEFAULT_VIT_TEXT})."
            )
        },
    )
    model_type: str | None = field(
        default=None,
        metadata={
            "help": (
                "If training from scratch, the model type whose default config to use, one of: "
                + ", ".join(MODEL_TYPES)
                + f". Unset: {DEFAULT_VIT_TEXT}; resnet: {DEFAULT_RESNET_TEXT}."
            )
        },
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": (
                "Override some existing default config settings when a model is trained from scratch. Example: "
                "hidden_size=64,num_hidden_layers=2"
            )
        },
    )
    image_processor_name: str | None = field(
        default=None,
        metadata={
            "help": (
                "Name or path of preprocessor config. Unset (and no --model_name_or_path): a ViTImageProcessor "
                "that resizes to the config's image_size and normalizes to [-1, 1]."
            )
        },
    )
    ignore_mismatched_sizes: bool = field(
        default=False,
        metadata={"help": "Will enable to load a pretrained model whose head dimensions are different."},
    )

    def __post_init__(self) -> None:
        check_model_source(self, MODEL_TYPES, "image-classification")


def parse_args(
    argv: Sequence[str] | None = None,
) -> tuple[ModelArguments, DataTrainingArguments, GPATrainingArguments]:
    """Parse the command line (or one JSON file), filling in the script's defaults for flags not given."""
    return parse_with_defaults(ModelArguments, DataTrainingArguments, RECIPE_DEFAULTS, EMBEDDED_DEFAULTS, argv)


def load_raw_dataset(model_args: ModelArguments, data_args: DataTrainingArguments, seed: int) -> datasets.DatasetDict:
    """The train and validation splits as named by the flags (validation split off train when missing)."""
    if data_args.uses_embedded_data:
        logger.info("No dataset given: using scikit-learn's bundled digits (hf_gpa.data.load_digits_dataset)")
        dataset = DatasetDict({"train": load_digits_dataset()})
    elif data_args.dataset_name is not None:
        dataset = load_dataset(
            data_args.dataset_name,
            data_args.dataset_config_name,
            cache_dir=model_args.cache_dir,
            token=model_args.token,
            trust_remote_code=model_args.trust_remote_code,
        )
    else:
        data_files = {}
        if data_args.train_dir is not None:
            data_files["train"] = os.path.join(data_args.train_dir, "**")
        if data_args.validation_dir is not None:
            data_files["validation"] = os.path.join(data_args.validation_dir, "**")
        dataset = load_dataset("imagefolder", data_files=data_files, cache_dir=model_args.cache_dir)

    # If we don't have a validation split, split off a percentage of train as validation (seeded, and stratified
    # when the labels are a ClassLabel, so that every class is in both splits).
    if "validation" not in dataset and data_args.train_val_split:
        if "train" not in dataset:
            raise ValueError("No train split to take a validation split from: pass --validation_dir or a dataset")
        stratify = data_args.label_column_name
        if not isinstance(dataset["train"].features.get(stratify), datasets.ClassLabel):
            stratify = None
        split = dataset["train"].train_test_split(data_args.train_val_split, seed=seed, stratify_by_column=stratify)
        dataset["train"] = split["train"]
        dataset["validation"] = split["test"]
    return dataset


def build_config(model_args: ModelArguments, labels: list[str]) -> PreTrainedConfig:
    """The model config with this dataset's labels: pretrained, a stock model type's default, or the small ViT."""
    label2id = {label: i for i, label in enumerate(labels)}
    id2label = dict(enumerate(labels))
    common: dict[str, Any] = {
        "num_labels": len(labels),
        "label2id": label2id,
        "id2label": id2label,
        "finetuning_task": "image-classification",
    }
    name = model_args.config_name or model_args.model_name_or_path
    if name:
        return AutoConfig.from_pretrained(
            name,
            **model_args.pretrained_kwargs,
            **common,
        )
    if model_args.model_type is None:
        config = ViTConfig(**DEFAULT_VIT_CONFIG, **common)
    elif model_args.model_type in SMALL_CONFIGS:
        config = CONFIG_MAPPING[model_args.model_type](**SMALL_CONFIGS[model_args.model_type], **common)
    else:
        config = CONFIG_MAPPING[model_args.model_type](**common)
    logger.warning("You are instantiating a new config instance from scratch.")
    apply_config_overrides(config, model_args.config_overrides, logger)
    return config


def build_image_processor(model_args: ModelArguments, config: PreTrainedConfig) -> BaseImageProcessor:
    """The image processor: pretrained when named (or when a model is), else one sized to config.image_size."""
    name = model_args.image_processor_name or model_args.model_name_or_path
    if name:
        return AutoImageProcessor.from_pretrained(
            name,
            **model_args.pretrained_kwargs,
        )
    image_size = getattr(config, "image_size", 224)
    # The PIL backend needs no torchvision; a saved preprocessor_config.json loads with AutoImageProcessor.
    return ViTImageProcessorPil(
        size={"height": image_size, "width": image_size}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )


def random_resized_crop(image: Image.Image, min_scale: float, rng: random.Random | None = None) -> Image.Image:
    """A crop of random area fraction in [min_scale, 1] and aspect ratio in [3/4, 4/3] (torchvision's recipe).

    ``rng`` defaults to Python's global generator. The crop keeps its own size; the image processor resizes it
    afterwards. Falls back to the whole image when ten draws do not fit, as torchvision does (its fallback is a
    center crop; the whole image is the same for squares).
    """
    draw: Any = rng if rng is not None else random  # the module's functions use its global generator
    width, height = image.size
    area = width * height
    for _ in range(10):
        target_area = area * draw.uniform(min_scale, 1.0)
        aspect = math.exp(draw.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = draw.randint(0, width - w)
            top = draw.randint(0, height - h)
            return image.crop((left, top, left + w, top + h))
    return image


def labels_of(dataset: datasets.DatasetDict, data_args: DataTrainingArguments) -> list[str]:
    """The class names of the label column, after checking that the image and label columns exist."""
    some_split = dataset["train"] if "train" in dataset else dataset["validation"]
    for flag in ("image_column_name", "label_column_name"):
        column = getattr(data_args, flag)
        if column not in some_split.column_names:
            raise ValueError(
                f"--{flag} {column!r} not found in dataset '{data_args.dataset_name}'. Make sure to set "
                f"`--{flag}` to the correct column - one of {', '.join(some_split.column_names)}."
            )
    label_feature = some_split.features[data_args.label_column_name]
    if not isinstance(label_feature, datasets.ClassLabel):
        raise ValueError(f"--label_column_name {data_args.label_column_name!r} must be a ClassLabel column")
    return list(label_feature.names)


def build_model(model_args: ModelArguments, config: PreTrainedConfig) -> Any:
    """The model: pretrained when named, else built from ``config``."""
    if model_args.model_name_or_path:
        return AutoModelForImageClassification.from_pretrained(
            model_args.model_name_or_path,
            config=config,
            **model_args.pretrained_kwargs,
            ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
        )
    model = AutoModelForImageClassification.from_config(config, trust_remote_code=model_args.trust_remote_code)
    logger.info(f"Training new model from scratch - {size_in_parameters(model)}")
    return model


def set_transforms(
    dataset: datasets.DatasetDict,
    image_processor: BaseImageProcessor,
    data_args: DataTrainingArguments,
    training_args: GPATrainingArguments,
) -> None:
    """The splits the run needs, cut to --max_*_samples, each with its transform: the random augmentation and the
    image processor for training, the image processor alone for evaluation."""

    # Augmentation draws from Python's global generator: seeded by set_seed(--seed) above and isolated from
    # GPATrainer's BatchNorm recalibration (which also forwards augmented training batches), so that runs repeat
    # and their training does not depend on whether the statistics are recomputed.
    def _augment(image: Image.Image) -> Image.Image:
        image = random_resized_crop(image, data_args.min_crop_scale)
        if data_args.horizontal_flip and random.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return image

    def train_transforms(example_batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """Apply the random augmentation, then the image processor, across a batch."""
        images = [_augment(image.convert("RGB")) for image in example_batch[data_args.image_column_name]]
        example_batch["pixel_values"] = list(image_processor(images, return_tensors="pt")["pixel_values"])
        return example_batch

    def val_transforms(example_batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """Apply the image processor alone across a batch."""
        images = [image.convert("RGB") for image in example_batch[data_args.image_column_name]]
        example_batch["pixel_values"] = list(image_processor(images, return_tensors="pt")["pixel_values"])
        return example_batch

    for split, flag, max_samples, transform in (
        ("train", "do_train", data_args.max_train_samples, train_transforms),
        ("validation", "do_eval", data_args.max_eval_samples, val_transforms),
    ):
        if not getattr(training_args, flag):
            continue
        if split not in dataset:
            raise ValueError(f"--{flag} requires a {split} dataset")
        if max_samples is not None:
            dataset[split] = dataset[split].shuffle(seed=training_args.seed).select(range(max_samples))
        dataset[split].set_transform(transform)


def build_trainer(
    model_args: ModelArguments, data_args: DataTrainingArguments, training_args: GPATrainingArguments
) -> GPATrainer:
    """The trainer `main` runs: the seeded model, the datasets with their transforms, the metric. A caller that
    measures something during training adds its callback to it (``trainer.add_callback(...)``) and trains it."""
    # Set seed before initializing model.
    set_seed(training_args.seed)

    dataset = load_raw_dataset(model_args, data_args, training_args.seed)
    labels = labels_of(dataset, data_args)

    # Load the accuracy metric from the module that ships with hf_gpa (no Hub access).
    metric = evaluate.load(ACCURACY, cache_dir=model_args.cache_dir)

    # Define our compute_metrics function. It takes an `EvalPrediction` object (a namedtuple with a
    # predictions and label_ids field) and has to return a dictionary string to float.
    def compute_metrics(p: EvalPrediction) -> dict[str, float]:
        """Computes accuracy on a batch of predictions"""
        return metric.compute(predictions=np.argmax(p.predictions, axis=1), references=p.label_ids)

    def collate_fn(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pixel_values = torch.stack([example["pixel_values"] for example in examples])
        labels = torch.tensor([example[data_args.label_column_name] for example in examples])
        return {"pixel_values": pixel_values, "labels": labels}

    config = build_config(model_args, labels)
    model = build_model(model_args, config)
    image_processor = build_image_processor(model_args, config)
    set_transforms(dataset, image_processor, data_args, training_args)

    # Initialize our trainer
    return GPATrainer(
        model=model,
        args=training_args,
        train_dataset=dataset["train"] if training_args.do_train else None,
        eval_dataset=dataset["validation"] if training_args.do_eval else None,
        compute_metrics=compute_metrics,
        processing_class=image_processor,
        data_collator=collate_fn,
    )


def model_card_kwargs(model_args: ModelArguments, data_args: DataTrainingArguments) -> dict[str, Any]:
    """What the model card says of the base model, the task and the dataset."""
    return {
        "finetuned_from": model_args.model_name_or_path,
        "tasks": "image-classification",
        "dataset": data_args.dataset_name or ("scikit-learn digits" if data_args.uses_embedded_data else None),
        "tags": ["image-classification", "vision", "gpa"],
    }


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Run the script on ``argv`` (default: ``sys.argv[1:]``); returns the metrics written to all_results.json."""
    return run_example(parse_args(argv), build_trainer, model_card_kwargs, logger)


if __name__ == "__main__":
    run_main(main)  # ends the process group under accelerate launch / torchrun, also when main() raises
