"""The model card of a GPA run: a section naming the optimizer and its constants, the hf_gpa tags, and a truthful
line for a model trained from scratch.

Why a module of its own: what a card says about GPA (mu_x, mu_y, H, what went to Muon) is read from the arguments
and the model alone; `GPATrainer.create_model_card` only hands it the card transformers wrote.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import yaml
from torch import nn
from transformers import TrainingArguments

from hf_gpa.optim_table import HF_GPA_OPTIMIZERS, GPAOptimizerNames, muon_split, optim_value
from hf_gpa.workers import workers_in_words

__all__ = [
    "complete_model_card",
    "evaluation_results",
    "gpa_model_card_section",
    "gpa_optimizer_args",
    "gpa_run_summary",
    "task_and_dataset",
    "with_gpa_tags",
]

#: How the model card names Muon (``--optim muon``, and as the base of GPA and DiLoCo).
_MUON_CARD_NAME = (
    "Muon (hf_gpa.MuonWithAuxAdam: Muon on the hidden weight matrices, AdamW on embeddings, output head, norms and "
    "biases)"
)

#: What transformers' model card says of the optimizer's arguments when ``--optim_args`` is empty.
_NO_OPTIMIZER_ARGS = "No additional optimizer arguments"
#: The heading of transformers' table of the evaluations during training (empty when none ran during training).
_TRAINING_RESULTS = "### Training results\n\n"
#: Evaluation keys that are timings or counts, not results.
_NOT_RESULTS = ("runtime", "samples_per_second", "steps_per_second", "samples", "epoch", "step")

#: What transformers' model card says of a model whose config names no base model (trained from scratch).
_EMPTY_BASE_MODEL = "This model is a fine-tuned version of [](https://huggingface.co/) on "


def gpa_model_card_section(args: TrainingArguments, model: nn.Module | None = None) -> str:
    """The model-card paragraph naming the optimizer and its constants (empty for a stock ``--optim``); with the
    ``model``, where Muon is involved, also what went to Muon and what to AdamW."""
    described = _describe(args, model)
    if described is None:
        return ""
    saved = f" The weights in this repository are {described.weights}." if described.weights else ""
    return (
        f"## Optimizer: {described.title} (hf_gpa)\n\n"
        f"Trained with `--optim {args.optim.value}`{described.what}.{saved}{described.split}\n"
    )


def gpa_run_summary(args: TrainingArguments) -> str:
    """One line for the log at the start of training: the optimizer, its constants, and which weights evaluation and
    every save use (empty for a stock ``--optim`` and for Muon alone, which keeps one sequence of weights)."""
    described = _describe(args, None)
    if described is None or not described.weights:
        return ""
    return (
        f"hf_gpa: {described.title}, --optim {args.optim.value}{described.what}. Evaluation, prediction and every "
        f"save use {described.weights}; training steps at the {described.trained_at}, restored after each of them."
    )


class _Described(NamedTuple):
    """What a GPA ``--optim`` is: ``what`` follows its name (": ..."); ``weights``, the evaluation weights, and
    ``trained_at``, where the gradients are taken, are empty for Muon alone; ``split`` is empty without a model."""

    title: str
    what: str
    weights: str
    trained_at: str
    split: str


def _describe(args: TrainingArguments, model: nn.Module | None) -> _Described | None:
    """The description of a GPA ``--optim`` (None for a stock one)."""
    if not isinstance(getattr(args, "optim", None), GPAOptimizerNames):
        return None
    name = args.optim.value
    uses_muon = "muon" in (name, args.gpa_base_optim, name.removeprefix("diloco_"))
    split = f" {muon_split(model)}." if uses_muon and model is not None else ""
    if args.optim == GPAOptimizerNames.MUON:
        return _Described("Muon", f": {_MUON_CARD_NAME}", "", "", split)
    if args.optim in (GPAOptimizerNames.DILOCO_ADAMW, GPAOptimizerNames.DILOCO_MUON):
        inner = "AdamW" if args.optim == GPAOptimizerNames.DILOCO_ADAMW else _MUON_CARD_NAME
        kind, across = "single-worker DiLoCo", ""
        if getattr(args, "diloco_distributed", False):
            kind = "DiLoCo across workers"
            tau = getattr(args, "diloco_overlap_steps", 0)
            overlap = (
                f", each fragment's sync overlapped with the next {tau} inner step(s) (mixing alpha "
                f"{getattr(args, 'diloco_overlap_alpha', 0.0):g})"
                if tau
                else ""
            )
            across = (
                f"{_across_workers(args)}, each averaging its pseudo-gradient with the others' at every outer step "
                f"(sent in {getattr(args, 'diloco_outer_dtype', 'float32')}), in {args.diloco_fragments} "
                f"fragment(s){overlap}"
            )
        what = (
            f"{across}: {inner} inner steps with H = {args.diloco_inner_steps} inner steps, outer learning rate "
            f"{args.diloco_outer_lr} and outer Nesterov momentum {args.diloco_outer_momentum}"
        )
        return _Described(kind, what, "the outer (slow) weights", "inner weights", split)
    base = "AdamW" if args.optim == GPAOptimizerNames.GPA_ADAMW else f"`{args.gpa_base_optim}`"
    if args.gpa_base_optim == GPAOptimizerNames.MUON.value:
        base = _MUON_CARD_NAME
    if args.gpa_averaging == "schedule_free":
        # Schedule-Free's average has no mu_x, hence no H either.
        constants = f"mu_y = {args.gpa_mu_y:.6g}, averaging = schedule_free (x is the lr**2-weighted average of z)"
    else:
        steps = args.gpa_effective_inner_steps
        h = "" if steps is None else f", H = {steps:.4g} (mu_x = 0.9 ** (1 / H), the equivalent DiLoCo inner steps)"
        constants = f"mu_x = {args.gpa_mu_x:.6g}, mu_y = {args.gpa_mu_y:.6g}{h}, averaging = {args.gpa_averaging}"
    if getattr(args, "gpa_distributed", False):
        constants = (
            f"mu_x = {args.gpa_mu_x:.6g} and mu_y = {args.gpa_mu_y:.6g} per outer step, H = {args.gpa_sync_steps} "
            f"inner steps between two synchronisations, outer learning rate {args.gpa_outer_lr:.6g}, in "
            f"{args.diloco_fragments} fragment(s)"
        )
        what = f"{_across_workers(args)}: GPA's primal averaging as the outer step of {base} workers, with {constants}"
        return _Described("GPA across workers", what, "GPA's evaluation sequence x", "inner weights", split)
    what = f": Generalized Primal Averaging around {base} with {constants}"
    return _Described("GPA", what, "GPA's evaluation sequence x", "gradient point y", split)


def _across_workers(args: TrainingArguments) -> str:
    """The phrase " across the W processes of the run, as M workers of W / M processes (--diloco_workers)"."""
    world = int(os.environ.get("WORLD_SIZE", args.world_size))  # the launcher's, as the flags were checked
    workers = args.diloco_workers or world
    in_words = workers_in_words(workers, world // workers)
    return f" across the {world} processes of the run, as {in_words} (--diloco_workers)"


def with_gpa_tags(
    create_model_card: Any, args: tuple[Any, ...], kwargs: dict[str, Any], gpa_tags: tuple[str, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` for ``create_model_card`` with ``gpa_tags`` added to its ``tags`` argument, wherever the
    method's signature puts it; unchanged when it takes no ``tags`` or the arguments do not bind (it then raises its
    own error)."""
    try:
        signature = inspect.signature(create_model_card)
        bound = signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    if "tags" not in signature.parameters:
        return args, kwargs
    tags = bound.arguments.get("tags")
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    bound.arguments["tags"] = tags + [t for t in gpa_tags if t not in tags]
    return bound.args, bound.kwargs


def gpa_optimizer_args(args: TrainingArguments) -> str:
    """``lr=0.003, gpa_mu_x=0.974004, gpa_mu_y=0.7, ...``: the learning rate and every flag the hf_gpa ``--optim``
    reads, with its value in this run (empty for a stock ``--optim``)."""
    spec = HF_GPA_OPTIMIZERS.get(optim_value(getattr(args, "optim", "")))
    if spec is None:
        return ""
    values = {"lr": args.learning_rate, **{flag: getattr(args, flag, None) for flag in spec.flags}}
    return ", ".join(f"{name}={_value_text(value)}" for name, value in values.items() if value is not None)


def _value_text(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(getattr(value, "value", value))


def evaluation_results(
    results: Mapping[str, Any] | None, log_history: Sequence[Mapping[str, Any]]
) -> dict[str, float]:
    """The final evaluation's results by name (``loss``, ``perplexity``, ``accuracy``): from ``results`` where the
    script hands them (they hold what it computed after the evaluation, e.g. the perplexity), else from the last
    evaluation of the Trainer's ``log_history``; timings and counts left out."""
    if results is None:
        results = next((entry for entry in reversed(log_history) if "eval_loss" in entry), {})
    named = {}
    for key, value in results.items():
        name = key.removeprefix("eval_")
        if (key.startswith("eval_") or key == "perplexity") and name not in _NOT_RESULTS:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                named[name] = float(value)
    return named


def task_and_dataset(create_model_card: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The task and the dataset (its Hub tag, else its name) that ``create_model_card(*args, **kwargs)`` names, where
    its signature takes them (None each where not), for the card's ``model-index``."""
    try:
        bound = inspect.signature(create_model_card).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None, None

    def first(value: Any) -> Any:
        return value[0] if isinstance(value, (list, tuple)) and value else value or None

    return first(bound.get("tasks")), first(bound.get("dataset_tags")) or first(bound.get("dataset"))


def complete_model_card(
    path: str,
    section: str,
    *,
    optimizer_args: str = "",
    results: Mapping[str, float] | None = None,
    task: str | None = None,
    dataset: str | None = None,
) -> None:
    """Rewrite the card transformers wrote at ``path``: a model built from a config is said to be trained from
    scratch, the optimizer's arguments (`gpa_optimizer_args`) replace "No additional optimizer arguments", the final
    evaluation's ``results`` (`evaluation_results`) fill the empty "Training results" and, with the ``task`` and
    ``dataset`` they were measured on, the ``model-index`` (transformers drops a result without a dataset type), and
    ``section`` (`gpa_model_card_section`, possibly empty) is appended."""
    with open(path, encoding="utf-8") as f:
        card = f.read()
    # transformers names the base model from config._name_or_path, which is "" for a model built from a config:
    # its card would say "a fine-tuned version of [](https://huggingface.co/)".
    card = card.replace(_EMPTY_BASE_MODEL, "This model was trained from scratch on ")
    if optimizer_args:
        card = card.replace(_NO_OPTIMIZER_ARGS, optimizer_args)
    if results:
        card = _with_results(card, results, task, dataset)
    with open(path, "w", encoding="utf-8") as f:
        f.write(card + ("\n" + section if section else ""))


def _with_results(card: str, results: Mapping[str, float], task: str | None, dataset: str | None) -> str:
    """``card`` with the final evaluation in its empty "Training results" and, where the ``model-index`` has no
    result, there too (with the task and dataset, which the Hub requires of a result)."""
    table = "| Metric | Value |\n|:---|---:|\n" + "".join(f"| {k} | {v:.6g} |\n" for k, v in results.items())
    empty = _TRAINING_RESULTS + "\n"
    if empty in card:
        card = card.replace(empty, f"{_TRAINING_RESULTS}Final evaluation (at the evaluation weights):\n\n{table}", 1)
    head, sep, body = card[4:].partition("\n---\n")
    if not card.startswith("---\n") or not sep or task is None or dataset is None:
        return card
    metadata = yaml.safe_load(head) or {}
    index = metadata.get("model-index") or []
    if not index or index[0].get("results"):
        return card
    metrics = [{"name": name, "type": name, "value": value} for name, value in results.items()]
    index[0]["results"] = [{"task": {"type": task}, "dataset": {"name": dataset, "type": dataset}, "metrics": metrics}]
    return f"---\n{yaml.dump(metadata, sort_keys=False)}---\n{body}"
