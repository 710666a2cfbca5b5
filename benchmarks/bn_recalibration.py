"""BatchNorm statistics at x: accuracy with and without recomputing them, and how many batches it takes.

One run of ``run_vit_gpa.py --model_type resnet`` (the small ResNet on scikit-learn's digits, the script's embedded
default) with ``--gpa_bn_recalibration_batches 0``: every evaluation of that run is at x with the statistics of y
(the "without" column). At each evaluation a callback also recomputes the statistics at x from N training batches
(N = 1 ... 32, several sampling seeds, the same loader recipe as GPATrainer: shuffled, per-device batch size, the
training transforms) and measures

* the validation accuracy at x with those statistics, and
* their error against a reference estimate from ``--reference_epochs`` passes over the training set: the mean over
  the BatchNorm layers of ||stat_N - stat_ref|| / ||stat_ref||, for the running mean and the running variance.

The training trajectory does not depend on N (GPATrainer restores y's statistics bitwise; tests/test_batchnorm.py),
so one run serves every N. Writes a JSON file and a Markdown table. A benchmark, never a test.

    python benchmarks/bn_recalibration.py --out benchmarks/results/bn_recalibration      # the script's default run
    python benchmarks/bn_recalibration.py --out /tmp/bn --epochs 5 --seeds 2              # a quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from hf_gpa.batchnorm import norm_layers, recalibrated_norm_statistics

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent


def _load_run_vit() -> Any:
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


class Sweep(TrainerCallback):
    """At every evaluation (model at x with y's statistics): accuracy and statistics error for each N."""

    def __init__(
        self, batch_counts: list[int], seeds: int, reference_epochs: int, batch_size: int, every: int
    ) -> None:
        self.batch_counts, self.seeds, self.reference_epochs = batch_counts, seeds, reference_epochs
        self.batch_size, self.every = batch_size, every
        self.evaluations = 0
        self.rows: list[dict[str, Any]] = []

    def _loader(self, dataset: Any, collate_fn: Any, seed: int) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(seed)
        return torch.utils.data.DataLoader(
            dataset, self.batch_size, shuffle=True, generator=generator, collate_fn=collate_fn, drop_last=True
        )

    def on_evaluate(self, args, state, control, model=None, train_dataloader=None, eval_dataloader=None, **kwargs):
        self.evaluations += 1
        last = state.global_step >= state.max_steps
        if (self.evaluations % self.every and self.evaluations != 1 and not last) or (
            self.rows and self.rows[-1]["step"] == state.global_step  # the script's evaluation after training
        ):
            return
        dataset, collate_fn = train_dataloader.dataset, train_dataloader.collate_fn
        per_epoch = len(dataset) // self.batch_size
        row: dict[str, Any] = {"epoch": round(state.epoch or 0.0, 3), "step": state.global_step}
        row["accuracy_y_stats"] = accuracy(model, eval_dataloader)
        y_stats = _stats(model)
        reference_loader = (
            batch for s in range(self.reference_epochs) for batch in self._loader(dataset, collate_fn, 10**6 + s)
        )
        with recalibrated_norm_statistics(model, reference_loader, per_epoch * self.reference_epochs):
            reference = _stats(model)
            row["accuracy_reference"] = accuracy(model, eval_dataloader)
        row["y_stats"] = _rel_error(y_stats, reference)
        for n in self.batch_counts:
            accs, errors = [], []
            for seed in range(self.seeds):
                with recalibrated_norm_statistics(model, self._loader(dataset, collate_fn, seed), n):
                    accs.append(accuracy(model, eval_dataloader))
                    errors.append(_rel_error(_stats(model), reference))
            row[f"N={n}"] = {
                "accuracy": statistics.fmean(accs),
                "accuracy_min": min(accs),
                "mean_rel_err": statistics.fmean(e["mean_rel_err"] for e in errors),
                "var_rel_err": statistics.fmean(e["var_rel_err"] for e in errors),
            }
        logger.info("bn sweep: %s", json.dumps(row))
        self.rows.append(row)


def table(rows: list[dict[str, Any]], batch_counts: list[int]) -> str:
    head = "| epoch | y's stats | " + " | ".join(f"N={n}" for n in batch_counts) + " | reference |"
    lines = [
        "Accuracy at x (mean over seeds) and, in parentheses, the running-variance error against the reference:",
        "",
        head,
        "|" + "---|" * (len(batch_counts) + 3),
    ]
    for row in rows:
        cells = [f"{row['epoch']:g}", f"{row['accuracy_y_stats']:.4f} ({row['y_stats']['var_rel_err']:.3f})"]
        cells += [f"{row[f'N={n}']['accuracy']:.4f} ({row[f'N={n}']['var_rel_err']:.3f})" for n in batch_counts]
        cells.append(f"{row['accuracy_reference']:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for bn_recalibration.json / .md")
    parser.add_argument("--epochs", type=float, default=None, help="train epochs (default: the script's 30)")
    parser.add_argument("--eval_every_epochs", type=int, default=5)
    parser.add_argument("--batch_counts", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--seeds", type=int, default=3, help="sampling seeds per N")
    parser.add_argument("--reference_epochs", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)

    run_vit = _load_run_vit()
    sweep = Sweep(args.batch_counts, args.seeds, args.reference_epochs, batch_size=32, every=args.eval_every_epochs)
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--output_dir", tmp, "--model_type", "resnet", "--gpa_bn_recalibration_batches", "0"]
        flags += ["--eval_strategy", "epoch", "--report_to", "none", "--disable_tqdm", "true"]
        flags += ["--per_device_train_batch_size", "32"]
        if args.epochs is not None:
            flags += ["--num_train_epochs", str(args.epochs)]
        metrics = run_vit.main(flags, callbacks=[sweep])
    rows = sweep.rows
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(["python", "benchmarks/bn_recalibration.py", *(argv or sys.argv[1:])])}
    result |= {"final_metrics": metrics, "rows": sweep.rows}
    (args.out / "bn_recalibration.json").write_text(json.dumps(result, indent=1))
    (args.out / "bn_recalibration.md").write_text(f"`{result['command']}`\n\n" + table(rows, args.batch_counts))
    print(table(rows, args.batch_counts))


if __name__ == "__main__":
    main()
