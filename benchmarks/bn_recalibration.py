"""BatchNorm statistics at x: accuracy with and without recomputing them, and how many batches it takes.

One run of ``run_vit_gpa.py --model_type resnet`` (the small ResNet on scikit-learn's digits, the script's embedded
default) with ``--gpa_bn_recalibration_batches 0``, saving a checkpoint every epoch: each checkpoint holds x with the
statistics of y (the "without" column), as every evaluation of that run sees it. For the checkpoints of the first
epoch, every ``--eval_every_epochs`` and the last, the statistics at x are recomputed from N training batches
(N = 1 ... 32, several sampling seeds, the same loader recipe as GPATrainer: shuffled, per-device batch size, the
training transforms) and measured:

* the validation accuracy at x with those statistics, and
* their error against a reference estimate from ``--reference_epochs`` passes over the training set: the mean over
  the BatchNorm layers of ||stat_N - stat_ref|| / ||stat_ref||, for the running mean and the running variance.

The run is the script's own (``run_vit_gpa.main`` on a command line), so what is measured is what a user trains;
the sweep reads its checkpoints afterwards, and its training batches come from the script's data functions with a
generator of their own (the run's random draws are left alone). Writes a JSON file and a Markdown table. A benchmark,
never a test.

    python -m benchmarks.bn_recalibration --out benchmarks/results/bn_recalibration      # the script's default run
    python -m benchmarks.bn_recalibration --out /tmp/bn --epochs 5 --seeds 2              # a quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import random
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from benchmarks import report
from hf_gpa.batchnorm import norm_layers, recalibrated_norm_statistics

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent


def _load_run_vit() -> Any:
    """The example script ``run_vit_gpa.py`` of the repository root, as a module."""
    spec = importlib.util.spec_from_file_location("run_vit_gpa", ROOT / "run_vit_gpa.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_vit_gpa"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def accuracy(model: torch.nn.Module, loader: Any) -> float:
    """Top-1 accuracy of ``model`` (eval mode) over ``loader``'s batches."""
    was_training = model.training
    model.eval()
    correct = total = 0
    for batch in loader:
        logits = model(pixel_values=batch["pixel_values"]).logits
        correct += int((logits.argmax(-1) == batch["labels"]).sum())
        total += len(batch["labels"])
    model.train(was_training)
    return correct / total


def _stats(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(m.running_mean.clone(), m.running_var.clone()) for _, m in norm_layers(model)]


def _rel_error(a: list[tuple[torch.Tensor, torch.Tensor]], ref: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    mean = statistics.fmean(float((x[0] - r[0]).norm() / r[0].norm()) for x, r in zip(a, ref))
    var = statistics.fmean(float((x[1] - r[1]).norm() / r[1].norm()) for x, r in zip(a, ref))
    return {"mean_rel_err": mean, "var_rel_err": var}


class ScriptData:
    """The run's training and validation data, built by the script's own functions from its command line: the
    training transforms (random resized crop, optional flip) draw from a generator of their own."""

    def __init__(self, run_vit: Any, flags: list[str], batch_size: int) -> None:
        model_args, self.data_args, training_args = run_vit.parse_args(flags)
        dataset = run_vit.load_raw_dataset(model_args, self.data_args, training_args.seed)
        if self.data_args.max_train_samples is not None:  # as the script selects them
            dataset["train"] = (
                dataset["train"].shuffle(seed=training_args.seed).select(range(self.data_args.max_train_samples))
            )
        labels = list(dataset["train"].features[self.data_args.label_column_name].names)
        self.image_processor = run_vit.build_image_processor(model_args, run_vit.build_config(model_args, labels))
        self.crop = partial(run_vit.random_resized_crop, min_scale=self.data_args.min_crop_scale)
        self.rng = random.Random(training_args.seed)
        dataset["train"].set_transform(partial(self._pixels, augment=True))
        dataset["validation"].set_transform(partial(self._pixels, augment=False))
        self.train, self.batch_size = dataset["train"], batch_size
        self.validation = torch.utils.data.DataLoader(dataset["validation"], 64, collate_fn=self.collate)

    def _pixels(self, batch: dict[str, list[Any]], augment: bool) -> dict[str, list[Any]]:
        images = [image.convert("RGB") for image in batch[self.data_args.image_column_name]]
        if augment:
            images = [self.crop(image, rng=self.rng) for image in images]
            if self.data_args.horizontal_flip:
                flip = Image.Transpose.FLIP_LEFT_RIGHT
                images = [image.transpose(flip) if self.rng.random() < 0.5 else image for image in images]
        batch["pixel_values"] = list(self.image_processor(images, return_tensors="pt")["pixel_values"])
        return batch

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pixel_values = torch.stack([example["pixel_values"] for example in examples])
        labels = torch.tensor([example[self.data_args.label_column_name] for example in examples])
        return {"pixel_values": pixel_values, "labels": labels}

    def loader(self, seed: int) -> torch.utils.data.DataLoader:
        """Shuffled training batches of the run's batch size (GPATrainer's recalibration recipe), seeded."""
        generator = torch.Generator().manual_seed(seed)
        return torch.utils.data.DataLoader(
            self.train, self.batch_size, shuffle=True, generator=generator, collate_fn=self.collate, drop_last=True
        )


def sweep_row(
    model: torch.nn.Module, data: ScriptData, batch_counts: list[int], seeds: int, reference_epochs: int
) -> dict[str, Any]:
    """For a model at x with y's statistics: its accuracy, the reference statistics' accuracy and y's error, and for
    each N of ``batch_counts`` the accuracy and error of statistics recomputed from N batches (mean over seeds)."""
    per_epoch = len(data.train) // data.batch_size
    row: dict[str, Any] = {"accuracy_y_stats": accuracy(model, data.validation)}
    y_stats = _stats(model)
    reference_loader = (batch for s in range(reference_epochs) for batch in data.loader(10**6 + s))
    with recalibrated_norm_statistics(model, reference_loader, per_epoch * reference_epochs):
        reference = _stats(model)
        row["accuracy_reference"] = accuracy(model, data.validation)
    row["y_stats"] = _rel_error(y_stats, reference)
    for n in batch_counts:
        accs, errors = [], []
        for seed in range(seeds):
            with recalibrated_norm_statistics(model, data.loader(seed), n):
                accs.append(accuracy(model, data.validation))
                errors.append(_rel_error(_stats(model), reference))
        row[f"N={n}"] = {
            "accuracy": statistics.fmean(accs),
            "accuracy_min": min(accs),
            "mean_rel_err": statistics.fmean(e["mean_rel_err"] for e in errors),
            "var_rel_err": statistics.fmean(e["var_rel_err"] for e in errors),
        }
    return row


def swept_checkpoints(output_dir: Path, every: int) -> list[tuple[float, int, Path]]:
    """(epoch, step, folder) of the checkpoints to sweep: after the first epoch, every ``every`` epochs, the last."""
    found = []
    for folder in output_dir.glob("checkpoint-*"):
        state = json.loads((folder / "trainer_state.json").read_text())
        found.append((round(state["epoch"], 3), state["global_step"], folder))
    found.sort()
    return [c for i, c in enumerate(found) if i == 0 or round(c[0]) % every == 0 or i == len(found) - 1]


def table(rows: list[dict[str, Any]], batch_counts: list[int]) -> str:
    header = ["epoch", "y's stats", *(f"N={n}" for n in batch_counts), "reference"]
    body = []
    for row in rows:
        cells = [f"{row['epoch']:g}", f"{row['accuracy_y_stats']:.4f} ({row['y_stats']['var_rel_err']:.3f})"]
        cells += [f"{row[f'N={n}']['accuracy']:.4f} ({row[f'N={n}']['var_rel_err']:.3f})" for n in batch_counts]
        cells.append(f"{row['accuracy_reference']:.4f}")
        body.append(cells)
    intro = "Accuracy at x (mean over seeds) and, in parentheses, the running-variance error against the reference:"
    return intro + "\n\n" + report.markdown_table(header, body) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for bn_recalibration.json / .md")
    parser.add_argument("--epochs", type=float, default=None, help="train epochs (default: the script's 30)")
    parser.add_argument("--eval_every_epochs", type=int, default=5)
    parser.add_argument("--batch_counts", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--seeds", type=int, default=3, help="sampling seeds per N")
    parser.add_argument("--reference_epochs", type=int, default=4)
    parser.add_argument("--max_train_samples", type=int, default=None, help="the script's flag (a smoke run)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)

    run_vit = _load_run_vit()
    batch_size = 32
    flags = ["--model_type", "resnet", "--gpa_bn_recalibration_batches", "0", "--per_device_train_batch_size"]
    flags += [str(batch_size), "--eval_strategy", "epoch", "--report_to", "none", "--disable_tqdm", "true"]
    if args.epochs is not None:
        flags += ["--num_train_epochs", str(args.epochs)]
    if args.max_train_samples is not None:
        flags += ["--max_train_samples", str(args.max_train_samples)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        metrics = run_vit.main(["--output_dir", tmp, "--save_strategy", "epoch", *flags])
        data = ScriptData(run_vit, ["--output_dir", tmp, *flags], batch_size)
        from transformers import AutoModelForImageClassification

        for epoch, step, folder in swept_checkpoints(Path(tmp), args.eval_every_epochs):
            model = AutoModelForImageClassification.from_pretrained(folder)  # x, with y's statistics
            row = {"epoch": epoch, "step": step}
            row |= sweep_row(model, data, args.batch_counts, args.seeds, args.reference_epochs)
            logger.info("bn sweep: %s", json.dumps(row))
            rows.append(row)
    command = " ".join(["python -m benchmarks.bn_recalibration", *(argv or sys.argv[1:])])
    result = {"command": command, "final_metrics": metrics, "rows": rows}
    text = f"`{command}`\n\n" + table(rows, args.batch_counts)
    report.write_outputs(args.out, "bn_recalibration", result, text)
    print(table(rows, args.batch_counts))


if __name__ == "__main__":
    main()
