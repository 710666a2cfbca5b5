"""The `--optim` names hf_gpa adds: one table (`HF_GPA_OPTIMIZERS`) of what each name is, how it is built and which
flags it reads, the enum `GPAOptimizerNames` made from it, and `optimizer_cls_and_kwargs`, which builds the optimizer
of an ``--optim`` value (ours from the table, a stock one by the stock Trainer).

Why a module of its own: `GPATrainingArguments` parses and checks the flags, `GPATrainer` builds what they name; both
read this table, and neither needs the other's code to do so.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import TrainingArguments
from transformers.trainer_optimizer import is_optimizer_factory
from transformers.training_args import OptimizerNames
from transformers.utils import ExplicitEnum

from hf_gpa.optim import GPA, DiLoCo, GPAAdamW, MuonWithAuxAdam, muon_param_groups

if TYPE_CHECKING:
    from hf_gpa.training_args import GPATrainingArguments

__all__ = [
    "GPA_OPTIM_NAMES",
    "HF_GPA_OPTIMIZERS",
    "STOCK_OPTIM_NAMES",
    "GPAOptimizerNames",
    "OptimizerSpec",
    "FLAG_READERS",
    "check_base_optim",
    "optim_help",
    "optim_that_saved",
    "muon_split",
    "optim_value",
    "optimizer_cls_and_kwargs",
    "unused_flags",
]

STOCK_OPTIM_NAMES: tuple[str, ...] = tuple(name.value for name in OptimizerNames)

# Stock optimizers that `--optim gpa` cannot wrap: LOMO fuses its update into backward, the layer-wise variants
# step inside hooks (the Trainer only sees a dummy optimizer), and Schedule-Free already averages its iterates.
_UNWRAPPABLE_BASES: frozenset[str] = frozenset(
    name
    for name in STOCK_OPTIM_NAMES
    if name in ("lomo", "adalomo") or name.endswith("_layerwise") or name.startswith("schedule_free")
)


# ---- the --optim names hf_gpa adds: one table ----

Builder = Callable[["GPATrainingArguments", "nn.Module | None"], tuple[type, dict[str, Any]]]


@dataclass(frozen=True)
class OptimizerSpec:
    """One ``--optim`` name added by hf_gpa: what it is, how it is built, and which hf_gpa flags it reads.

    A flag of `GPATrainingArguments` that the chosen ``--optim`` does not read (and that differs from its default) is
    refused, naming the ``--optim`` values that read it; the example scripts leave out their defaults for such flags.
    """

    #: The --help text of the name (in parentheses after it).
    description: str
    #: ``build(args, model) -> (optimizer class, keyword arguments)``, as transformers' optimizer handlers.
    build: Builder
    #: The GPATrainingArguments fields it reads (the stock flags such as --learning_rate are not listed).
    flags: tuple[str, ...]
    #: The class name a checkpoint of it records (``saved_optimizer_name``), to name the --optim that resumes it.
    optimizer_name: str
    #: Whether ``--optim gpa --gpa_base_optim NAME`` may wrap it.
    gpa_base: bool = False
    #: Whether it keeps evaluation weights x apart from the training weights (False: a plain optimizer, muon).
    evaluation_weights: bool = True


def _adam_kwargs(args: TrainingArguments) -> dict[str, Any]:
    # The same keys, from the same flags, as the stock `--optim adamw_torch` handler.
    return {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}


def _gpa_kwargs(args: GPATrainingArguments) -> dict[str, Any]:
    kwargs = {"mu_y": args.gpa_mu_y, "averaging": args.gpa_averaging}
    if args.gpa_mu_x is not None:  # None with schedule_free averaging, which has no averaging constant
        kwargs["mu_x"] = args.gpa_mu_x
    return kwargs


def _build_gpa_adamw(args: GPATrainingArguments, model: nn.Module | None) -> tuple[type, dict[str, Any]]:
    return GPAAdamW, {**_adam_kwargs(args), **_gpa_kwargs(args)}


def _build_gpa(args: GPATrainingArguments, model: nn.Module | None) -> tuple[type, dict[str, Any]]:
    # Whatever `--optim <base>` builds, with the same flags, becomes GPA's base optimizer.
    base_args = copy.copy(args)
    base_args.optim = _as_optim_member(args.gpa_base_optim)
    base_cls, base_kwargs = optimizer_cls_and_kwargs(base_args, model)
    if is_optimizer_factory(base_cls) or "model" in base_kwargs or "optimizer_dict" in base_kwargs:
        raise ValueError(
            f"--gpa_base_optim {args.gpa_base_optim} does not build a plain torch.optim.Optimizer in this "
            "transformers version, so GPA cannot wrap it"
        )
    clashes = {"base", "mu_x", "mu_y", "averaging"} & set(base_kwargs)
    if clashes:
        raise ValueError(f"--gpa_base_optim {args.gpa_base_optim} takes arguments GPA uses itself: {sorted(clashes)}")
    return GPA, {"base": base_cls, **_gpa_kwargs(args), **base_kwargs}


def _build_diloco_adamw(args: GPATrainingArguments, model: nn.Module | None) -> tuple[type, dict[str, Any]]:
    return DiLoCo, {
        "base": torch.optim.AdamW,
        "inner_steps": args.diloco_inner_steps,
        "outer_lr": args.diloco_outer_lr,
        "outer_momentum": args.diloco_outer_momentum,
        **_adam_kwargs(args),
    }


def _build_muon(args: GPATrainingArguments, model: nn.Module | None) -> tuple[type, dict[str, Any]]:
    # The groups come with the kwargs ("params", as the stock GaLore handler does): Muon takes the hidden weight
    # matrices, AdamW the rest, each split by the stock Trainer's weight-decay rule (no decay on biases and norms).
    from transformers import Trainer

    if model is None:
        raise ValueError(f"--optim {args.optim} needs the model to build its groups (hidden matrices vs the rest)")
    decay = set(Trainer.get_decay_parameter_names(None, model))  # the stock rule; it does not use the trainer
    names = {id(p): n for n, p in model.named_parameters()}
    muon_groups = muon_param_groups(model)
    if not any(group["use_muon"] for group in muon_groups):
        raise ValueError(
            f"--optim {optim_value(args.optim)}: {type(model).__name__} has no hidden weight matrix for Muon (no "
            "trainable 2-D or 3-D parameter outside its embeddings and output head), so Muon would train nothing "
            "and this would be AdamW alone: use --optim adamw_torch (or gpa_adamw) for this model"
        )
    groups = []
    for group in muon_groups:
        for weight_decay, params in (
            (args.weight_decay, [p for p in group["params"] if names[id(p)] in decay]),
            (0.0, [p for p in group["params"] if names[id(p)] not in decay]),
        ):
            if params:
                groups.append({**group, "params": params, "weight_decay": weight_decay})
    return MuonWithAuxAdam, {"params": groups, **_adam_kwargs(args)}


def muon_split(model: nn.Module) -> str:
    """What ``--optim muon`` gives Muon and what AdamW in ``model``, as the model card says it."""
    groups = muon_param_groups(model)
    counts = {g["use_muon"]: (len(g["params"]), sum(p.numel() for p in g["params"])) for g in groups}
    muon, adamw = counts.get(True, (0, 0)), counts.get(False, (0, 0))
    return (
        f"Muon took {muon[0]} hidden weight matrices ({muon[1]:,} weights), AdamW the other {adamw[0]} parameters "
        f"({adamw[1]:,} weights)"
    )


def _build_diloco_muon(args: GPATrainingArguments, model: nn.Module | None) -> tuple[type, dict[str, Any]]:
    base_cls, base_kwargs = _build_muon(args, model)
    _, diloco_kwargs = _build_diloco_adamw(args, model)
    return DiLoCo, {**diloco_kwargs, **base_kwargs, "base": base_cls}


#: GPA's averaging flags (read by every optimizer that keeps GPA's x, y and z).
_GPA_AVERAGING_FLAGS = ("gpa_mu_x", "gpa_inner_steps", "gpa_mu_y", "gpa_averaging")
#: Read by the Trainer for any hf_gpa optimizer with evaluation weights x.
_EVALUATION_FLAGS = ("gpa_bn_recalibration_batches",)

#: Every --optim name hf_gpa adds. Adding a name is one entry here (the enum below and --help follow).
HF_GPA_OPTIMIZERS: dict[str, OptimizerSpec] = {
    "gpa_adamw": OptimizerSpec(
        "GPA around AdamW",
        _build_gpa_adamw,
        (*_GPA_AVERAGING_FLAGS, *_EVALUATION_FLAGS, "gpa_step_in_backward"),  # the one per-parameter step
        "GPAAdamW",
    ),
    "gpa": OptimizerSpec(
        "GPA around --gpa_base_optim",
        _build_gpa,
        ("gpa_base_optim", *_GPA_AVERAGING_FLAGS, *_EVALUATION_FLAGS),
        "GPA",
    ),
    "diloco_adamw": OptimizerSpec(
        "single-worker DiLoCo around AdamW",
        _build_diloco_adamw,
        ("diloco_inner_steps", "diloco_outer_lr", "diloco_outer_momentum", *_EVALUATION_FLAGS),
        "DiLoCo",
    ),
    "muon": OptimizerSpec(
        "Muon on the hidden weight matrices, AdamW on embeddings, heads, norms and biases: hf_gpa.MuonWithAuxAdam",
        _build_muon,
        (),
        "MuonWithAuxAdam",
        gpa_base=True,
        evaluation_weights=False,
    ),
    "diloco_muon": OptimizerSpec(
        "single-worker DiLoCo around muon",
        _build_diloco_muon,
        ("diloco_inner_steps", "diloco_outer_lr", "diloco_outer_momentum", *_EVALUATION_FLAGS),
        "DiLoCo(MuonWithAuxAdam)",
    ),
}


class _OptimName(ExplicitEnum):
    """An --optim value that prints as itself (a model card reads ``gpa_adamw``, not the enum's member name)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


GPAOptimizerNames = _OptimName(
    "GPAOptimizerNames",
    [(name.upper(), name) for name in HF_GPA_OPTIMIZERS],
    module=__name__,
    qualname="GPAOptimizerNames",
)
GPAOptimizerNames.__doc__ = (
    "The `--optim` values added by hf_gpa (the stock ones stay `transformers.training_args.OptimizerNames`)."
)
GPA_OPTIM_NAMES: tuple[str, ...] = tuple(HF_GPA_OPTIMIZERS)

#: The hf_gpa flags whose applicability depends on --optim: each is read by the names listed.
FLAG_READERS: dict[str, tuple[str, ...]] = {}
for _name, _spec in HF_GPA_OPTIMIZERS.items():
    for _flag in _spec.flags:
        FLAG_READERS.setdefault(_flag, ())
        FLAG_READERS[_flag] += (_name,)


def optim_value(value: Any) -> Any:
    """The plain string of an --optim value given as an enum member (stock or ours), else the value itself."""
    return value.value if isinstance(value, Enum) else value


def _as_optim_member(name: str) -> Enum:
    """The enum member of an --optim name: ours from GPAOptimizerNames, a stock one from OptimizerNames."""
    return GPAOptimizerNames(name) if name in HF_GPA_OPTIMIZERS else OptimizerNames(name)


def optimizer_cls_and_kwargs(args: TrainingArguments, model: nn.Module | None = None) -> tuple[Any, dict[str, Any]]:
    """The optimizer class and keyword arguments for ``args.optim``: hf_gpa's table, else the stock Trainer's."""
    spec = HF_GPA_OPTIMIZERS.get(optim_value(getattr(args, "optim", None)))
    if spec is not None:
        return spec.build(args, model)
    from transformers import Trainer

    return Trainer.get_optimizer_cls_and_kwargs(args, model)


def optim_that_saved(saved: str) -> str:
    """The --optim name whose optimizer records ``saved`` (``"GPA(SGD)"`` -> ``gpa``) in its checkpoints."""
    by_class = {spec.optimizer_name: name for name, spec in HF_GPA_OPTIMIZERS.items()}
    return by_class.get(saved, by_class.get(saved.split("(")[0], "gpa_adamw"))  # "DiLoCo(MuonWithAuxAdam)" is its own


def unused_flags(optim: str) -> tuple[str, ...]:
    """The hf_gpa flags that ``--optim optim`` does not read (their defaults are then left out by the scripts)."""
    spec = HF_GPA_OPTIMIZERS.get(optim_value(optim))
    used = spec.flags if spec is not None else ()
    return tuple(flag for flag in FLAG_READERS if flag not in used)


def optim_help() -> str:
    ours = ", ".join(f"{name} ({spec.description})" for name, spec in HF_GPA_OPTIMIZERS.items())
    return f"The optimizer to use: {ours}, or any stock transformers name."


def check_base_optim(base: str) -> str:
    """``--gpa_base_optim base`` as a name GPA can wrap: a stock one (not LOMO, layer-wise or Schedule-Free) or an
    hf_gpa one marked ``gpa_base``."""
    wrappable_ours = [name for name, spec in HF_GPA_OPTIMIZERS.items() if spec.gpa_base]
    if base in wrappable_ours:
        return base
    if base not in STOCK_OPTIM_NAMES:
        allowed = [*wrappable_ours, *(n for n in STOCK_OPTIM_NAMES if n not in _UNWRAPPABLE_BASES)]
        raise ValueError(
            f"--gpa_base_optim {base!r} is not a stock transformers optimizer name; use one of {', '.join(allowed)}"
        )
    if base in _UNWRAPPABLE_BASES:
        raise ValueError(
            f"--gpa_base_optim {base} cannot be wrapped by GPA (LOMO and the layer-wise optimizers step "
            "inside backward hooks, and Schedule-Free already averages its iterates)"
        )
    return base
