"""The `--optim` table: the names hf_gpa adds, in one table (`HF_GPA_OPTIMIZERS`) of what each name is, how it is
built and which flags it reads, the enum `GPAOptimizerNames` made from it, and `optimizer_cls_and_kwargs`, which
builds the optimizer of an ``--optim`` value (ours from the table, a stock one by the stock Trainer).

Why a module of its own: `GPATrainingArguments` parses and checks the flags, `GPATrainer` builds what they name; both
read this table, and neither needs the other's code to do so. A builder takes a `BuildContext`, the few values it
reads, as transformers' own optimizer handlers take a small context rather than the whole arguments.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn
from transformers import TrainingArguments
from transformers.trainer_optimizer import is_optimizer_factory
from transformers.trainer_pt_utils import get_parameter_names
from transformers.training_args import OptimizerNames
from transformers.utils import ExplicitEnum

from hf_gpa.optim import GPA, DiLoCo, GPAAdamW, GPADiLoCo, MuonWithAuxAdam, check_num_fragments, muon_param_groups
from hf_gpa.optim.diloco import fragments, rules

__all__ = [
    "GPA_OPTIM_NAMES",
    "HF_GPA_OPTIMIZERS",
    "STOCK_OPTIM_NAMES",
    "BuildContext",
    "GPAOptimizerNames",
    "OptimizerSpec",
    "FLAG_READERS",
    "check_base_optim",
    "decay_parameter_names",
    "optim_help",
    "optim_that_saved",
    "muon_split",
    "optim_value",
    "optimizer_cls_and_kwargs",
    "reads_adam_flags",
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


# ---- what a builder reads ----


@dataclass(frozen=True)
class BuildContext:
    """The values an hf_gpa optimizer builder reads: the flags of the same names, as `GPATrainingArguments` checked
    them (`from_args`). A flag that a new builder reads is one more field here."""

    optim: str
    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    gpa_base_optim: str | None
    gpa_mu_x: float | None  # None with Schedule-Free averaging, which has no averaging constant
    gpa_mu_y: float
    gpa_averaging: str
    gpa_distributed: bool
    gpa_sync_steps: int
    gpa_outer_lr: float | None  # None unless --gpa_distributed, which derives it when unset
    diloco_inner_steps: int
    diloco_outer_lr: float
    diloco_outer_momentum: float
    diloco_distributed: bool
    diloco_workers: int | None  # None: every process a worker
    diloco_fragments: int
    diloco_outer_dtype: str
    diloco_overlap_steps: int = 0
    diloco_overlap_alpha: float = 0.0
    #: What the stock Trainer builds a stock ``--gpa_base_optim`` from (its handlers read ``--optim_args`` and more).
    stock_args: TrainingArguments | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_args(cls, args: TrainingArguments) -> BuildContext:
        """The context of ``args`` (`GPATrainingArguments` or a subclass): each field from the flag of its name."""
        flags = [f.name for f in dataclasses.fields(cls) if f.name not in ("optim", "stock_args")]
        return cls(optim=optim_value(args.optim), stock_args=args, **{flag: getattr(args, flag) for flag in flags})


#: ``build(context, model) -> (optimizer class, keyword arguments)``, as transformers' optimizer handlers.
Builder = Callable[[BuildContext, "nn.Module | None"], tuple[type, dict[str, Any]]]


# ---- the --optim names hf_gpa adds: one table ----


@dataclass(frozen=True)
class OptimizerSpec:
    """One ``--optim`` name added by hf_gpa: what it is, how it is built, and which hf_gpa flags it reads.

    A flag of `GPATrainingArguments` that the chosen ``--optim`` does not read (and that differs from its default) is
    refused, naming the ``--optim`` values that read it; the example scripts leave out their defaults for such flags.
    """

    #: The --help text of the name (in parentheses after it).
    description: str
    #: ``build(context, model) -> (optimizer class, keyword arguments)``.
    build: Builder
    #: The GPATrainingArguments fields it reads (the stock flags such as --learning_rate are not listed).
    flags: tuple[str, ...]
    #: The class name a checkpoint of it records (``saved_optimizer_name``), to name the --optim that resumes it.
    optimizer_name: str
    #: Whether ``--optim gpa --gpa_base_optim NAME`` may wrap it.
    gpa_base: bool = False
    #: Whether it keeps evaluation weights x apart from the training weights (False: a plain optimizer, muon).
    evaluation_weights: bool = True
    #: Whether its AdamW reads --adam_beta1, --adam_beta2 and --adam_epsilon (``--optim gpa``: as its base does).
    reads_adam_flags: bool = True


#: Parameters the stock Trainer exempts from weight decay by name (biases, norm layers' weights), searched in the
#: lower-cased qualified name; it also exempts every parameter of an ``nn.LayerNorm``.
_NO_DECAY_NAME = r"bias|layernorm|rmsnorm|(?:^|\.|_)norm(?:$|\.)"


def decay_parameter_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s parameters that take weight decay by the stock Trainer's rule (the decay group of
    `Trainer.create_optimizer`: not biases, not norm layers), for groups built outside the Trainer's own."""
    return get_parameter_names(model, [nn.LayerNorm], [_NO_DECAY_NAME])


def _adam_kwargs(ctx: BuildContext) -> dict[str, Any]:
    # The same keys, from the same flags, as the stock `--optim adamw_torch` handler.
    return {"lr": ctx.learning_rate, "betas": (ctx.adam_beta1, ctx.adam_beta2), "eps": ctx.adam_epsilon}


def _gpa_kwargs(ctx: BuildContext) -> dict[str, Any]:
    kwargs = {"mu_y": ctx.gpa_mu_y, "averaging": ctx.gpa_averaging}
    if ctx.gpa_mu_x is not None:  # None with schedule_free averaging, which has no averaging constant
        kwargs["mu_x"] = ctx.gpa_mu_x
    return kwargs


def _build_gpa_adamw(ctx: BuildContext, model: nn.Module | None) -> tuple[type, dict[str, Any]]:
    if ctx.gpa_distributed:
        return _build_gpa_across_workers(ctx, model)
    return GPAAdamW, {**_adam_kwargs(ctx), **_gpa_kwargs(ctx)}


def _build_gpa_across_workers(ctx: BuildContext, model: nn.Module | None) -> tuple[type, dict[str, Any]]:
    """``--optim gpa_adamw --gpa_distributed``: GPA across the processes, `GPADiLoCo` around AdamW, its outer step
    GPA's with --gpa_mu_x and --gpa_mu_y per outer step, every --gpa_sync_steps inner steps."""
    return GPADiLoCo, {
        "base": torch.optim.AdamW,
        "inner_steps": ctx.gpa_sync_steps,
        "outer_lr": ctx.gpa_outer_lr,
        "mu_x": ctx.gpa_mu_x,
        "mu_y": ctx.gpa_mu_y,
        **_adam_kwargs(ctx),
        **_diloco_workers_kwargs(ctx, model),
    }


def _build_base(ctx: BuildContext, model: nn.Module | None) -> tuple[Any, dict[str, Any]]:
    """What ``--optim <--gpa_base_optim>`` builds with the same flags: ours from the table, a stock one by the stock
    Trainer."""
    base = ctx.gpa_base_optim
    if base in HF_GPA_OPTIMIZERS:
        return HF_GPA_OPTIMIZERS[base].build(dataclasses.replace(ctx, optim=base), model)
    from transformers import Trainer

    if ctx.stock_args is None:
        raise ValueError(f"--gpa_base_optim {base} is a stock name: its context needs the stock_args to build it")
    stock_args = copy.copy(ctx.stock_args)
    stock_args.optim = OptimizerNames(base)
    return Trainer.get_optimizer_cls_and_kwargs(stock_args, model)


def _build_gpa(ctx: BuildContext, model: nn.Module | None) -> tuple[type, dict[str, Any]]:
    # Whatever `--optim <base>` builds, with the same flags, becomes GPA's base optimizer.
    base_cls, base_kwargs = _build_base(ctx, model)
    if is_optimizer_factory(base_cls) or "model" in base_kwargs or "optimizer_dict" in base_kwargs:
        raise ValueError(
            f"--gpa_base_optim {ctx.gpa_base_optim} does not build a plain torch.optim.Optimizer in this "
            "transformers version, so GPA cannot wrap it"
        )
    clashes = {"base", "mu_x", "mu_y", "averaging"} & set(base_kwargs)
    if clashes:
        raise ValueError(f"--gpa_base_optim {ctx.gpa_base_optim} takes arguments GPA uses itself: {sorted(clashes)}")
    return GPA, {"base": base_cls, **_gpa_kwargs(ctx), **base_kwargs}


def _build_diloco_adamw(ctx: BuildContext, model: nn.Module | None) -> tuple[type, dict[str, Any]]:
    return DiLoCo, {
        "base": torch.optim.AdamW,
        "inner_steps": ctx.diloco_inner_steps,
        "outer_lr": ctx.diloco_outer_lr,
        "outer_momentum": ctx.diloco_outer_momentum,
        **_adam_kwargs(ctx),
        **_diloco_workers_kwargs(ctx, model),
    }


def _diloco_workers_kwargs(ctx: BuildContext, model: nn.Module | None) -> dict[str, Any]:
    """DiLoCo (or GPA) across the processes of the run (``--diloco_distributed``, ``--gpa_distributed``): M workers, P
    fragments, the outer sync's dtype and overlap. P and an int8 sync are checked here against the model's trainable
    tensors, which the flags alone cannot know, by the optimizer's own rules."""
    if not (ctx.diloco_distributed or ctx.gpa_distributed):
        return {}
    if model is not None:
        numels = [p.numel() for p in model.parameters() if p.requires_grad]
        check_num_fragments(ctx.diloco_fragments, num_tensors=len(numels), name="--diloco_fragments")
        sizes = [0] * ctx.diloco_fragments
        for numel, fragment in zip(numels, fragments.fragment_of_each(numels, ctx.diloco_fragments)):
            sizes[fragment] += numel
        names = {"outer_dtype": "--diloco_outer_dtype", "num_fragments": "--diloco_fragments"}
        rules.check_fragment_sizes(ctx.diloco_outer_dtype, sizes, names)
    return {
        "distributed": True,
        "num_workers": ctx.diloco_workers,
        "num_fragments": ctx.diloco_fragments,
        "outer_dtype": ctx.diloco_outer_dtype,
        "overlap_steps": ctx.diloco_overlap_steps,
        "overlap_alpha": ctx.diloco_overlap_alpha,
    }


def _build_muon(ctx: BuildContext, model: nn.Module | None) -> tuple[type, dict[str, Any]]:
    # The groups come with the kwargs ("params", as the stock GaLore handler does): Muon takes the hidden weight
    # matrices, AdamW the rest, each split by the stock Trainer's weight-decay rule (no decay on biases and norms).
    if model is None:
        raise ValueError(f"--optim {ctx.optim} needs the model to build its groups (hidden matrices vs the rest)")
    decay = set(decay_parameter_names(model))
    names = {id(p): n for n, p in model.named_parameters()}
    muon_groups = muon_param_groups(model)
    if not any(group["use_muon"] for group in muon_groups):
        raise ValueError(
            f"--optim {ctx.optim}: {type(model).__name__} has no hidden weight matrix for Muon (no "
            "trainable 2-D or 3-D parameter outside its embeddings and output head), so Muon would train nothing "
            "and this would be AdamW alone: use --optim adamw_torch (or gpa_adamw) for this model"
        )
    groups = []
    for group in muon_groups:
        for weight_decay, params in (
            (ctx.weight_decay, [p for p in group["params"] if names[id(p)] in decay]),
            (0.0, [p for p in group["params"] if names[id(p)] not in decay]),
        ):
            if params:
                groups.append({**group, "params": params, "weight_decay": weight_decay})
    return MuonWithAuxAdam, {"params": groups, **_adam_kwargs(ctx)}


def muon_split(model: nn.Module) -> str:
    """What ``--optim muon`` gives Muon and what AdamW in ``model``, as the model card says it."""
    groups = muon_param_groups(model)
    counts = {g["use_muon"]: (len(g["params"]), sum(p.numel() for p in g["params"])) for g in groups}
    muon, adamw = counts.get(True, (0, 0)), counts.get(False, (0, 0))
    return (
        f"Muon took {muon[0]} hidden weight matrices ({muon[1]:,} weights), AdamW the other {adamw[0]} parameters "
        f"({adamw[1]:,} weights)"
    )


def _build_diloco_muon(ctx: BuildContext, model: nn.Module | None) -> tuple[type, dict[str, Any]]:
    base_cls, base_kwargs = _build_muon(ctx, model)
    _, diloco_kwargs = _build_diloco_adamw(ctx, model)
    return DiLoCo, {**diloco_kwargs, **base_kwargs, "base": base_cls}


#: GPA's averaging flags (read by every optimizer that keeps GPA's x, y and z).
_GPA_AVERAGING_FLAGS = ("gpa_mu_x", "gpa_inner_steps", "gpa_mu_y", "gpa_averaging")
#: Read by the Trainer for any hf_gpa optimizer with evaluation weights x.
_EVALUATION_FLAGS = ("gpa_bn_recalibration_batches",)
#: The outer sync of an optimizer across the processes of the run: M islands, P fragments, its dtype and overlap.
_WORKERS_FLAGS = (
    "diloco_workers",
    "diloco_fragments",
    "diloco_outer_dtype",
    "diloco_overlap_steps",
    "diloco_overlap_alpha",
)
#: DiLoCo's flags: its constants, and where it runs.
_DILOCO_FLAGS = (
    "diloco_inner_steps",
    "diloco_outer_lr",
    "diloco_outer_momentum",
    "diloco_distributed",
    *_WORKERS_FLAGS,
)
#: GPA across the processes (``--gpa_distributed``): H, the outer lr, and where it runs.
_GPA_WORKERS_FLAGS = ("gpa_distributed", "gpa_sync_steps", "gpa_outer_lr", *_WORKERS_FLAGS)

#: Every --optim name hf_gpa adds. Adding a name is one entry here (the enum below and --help follow).
HF_GPA_OPTIMIZERS: dict[str, OptimizerSpec] = {
    "gpa_adamw": OptimizerSpec(
        "GPA around AdamW; across the processes with --gpa_distributed",
        _build_gpa_adamw,
        (*_GPA_AVERAGING_FLAGS, *_EVALUATION_FLAGS, "gpa_step_in_backward", *_GPA_WORKERS_FLAGS),
        "GPAAdamW",
    ),
    "gpa": OptimizerSpec(
        "GPA around --gpa_base_optim",
        _build_gpa,
        ("gpa_base_optim", *_GPA_AVERAGING_FLAGS, *_EVALUATION_FLAGS),
        "GPA",
        reads_adam_flags=False,  # its base decides (reads_adam_flags)
    ),
    "diloco_adamw": OptimizerSpec(
        "DiLoCo around AdamW: single-worker, or across the processes with --diloco_distributed",
        _build_diloco_adamw,
        (*_DILOCO_FLAGS, *_EVALUATION_FLAGS),
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
        "DiLoCo around muon: single-worker, or across the processes with --diloco_distributed",
        _build_diloco_muon,
        (*_DILOCO_FLAGS, *_EVALUATION_FLAGS),
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


def optimizer_cls_and_kwargs(args: TrainingArguments, model: nn.Module | None = None) -> tuple[Any, dict[str, Any]]:
    """The optimizer class and keyword arguments for ``args.optim``: hf_gpa's table, else the stock Trainer's."""
    spec = HF_GPA_OPTIMIZERS.get(optim_value(getattr(args, "optim", None)))
    if spec is not None:
        return spec.build(BuildContext.from_args(args), model)
    from transformers import Trainer

    return Trainer.get_optimizer_cls_and_kwargs(args, model)


def reads_adam_flags(optim: str, gpa_base_optim: str | None = None) -> bool:
    """Whether ``--optim optim`` builds an optimizer that reads --adam_beta1, --adam_beta2 and --adam_epsilon.

    hf_gpa's names around AdamW (and Muon, for its AdamW groups) do; ``--optim gpa`` does when its base does; a stock
    name does when its transformers handler passes them on: the AdamW family (``adamw_torch``, fused, 4- and 8-bit,
    paged, APOLLO, StableAdamW, Schedule-Free AdamW, ...), but not GaLore's AdamW or GrokAdamW, which take theirs
    from ``--optim_args`` or not at all. Adafactor, SGD and the rest ignore them.
    """
    if optim == "gpa":
        return gpa_base_optim is not None and reads_adam_flags(gpa_base_optim)
    spec = HF_GPA_OPTIMIZERS.get(optim)
    if spec is not None:
        return spec.reads_adam_flags
    return "adamw" in optim and not optim.startswith(("galore_", "grokadamw"))


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
