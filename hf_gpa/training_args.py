"""`GPATrainingArguments`: transformers' `TrainingArguments` plus the GPA flags and three more `--optim` names.

Why a subclass and not a new field on the side: a user's script switches to GPA by changing two names
(`TrainingArguments` -> `GPATrainingArguments`, `Trainer` -> `GPATrainer`) and nothing else. Two things in
transformers stand in the way of a new `--optim` value, and both are handled here without patching transformers:

* `HfArgumentParser` turns the stock `optim: OptimizerNames | str` field into argparse choices taken from the
  `OptimizerNames` enum, so `--optim gpa_adamw` would be rejected before any of our code runs. The field is
  redeclared here as a `str` whose choices are every stock name plus ours.
* `TrainingArguments.__post_init__` converts `optim` with `OptimizerNames(...)`. `__post_init__` below hands the
  stock code a stock name and puts the GPA name (a `GPAOptimizerNames` member) back afterwards; stock names go
  through unchanged and stay `OptimizerNames` members.

Every check runs in `__post_init__`, so a bad flag fails with a `ValueError` naming it before any model or data is
loaded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn
from transformers import TrainingArguments
from transformers.trainer_optimizer import is_optimizer_factory
from transformers.training_args import OptimizerNames
from transformers.utils import ExplicitEnum
from transformers.utils.generic import strtobool

from hf_gpa.batchnorm import DEFAULT_RECALIBRATION_BATCHES, check_recalibration_batches
from hf_gpa.optim import (
    GPA,
    DiLoCo,
    GPAAdamW,
    MuonWithAuxAdam,
    inner_steps_from_mu_x,
    mu_x_from_inner_steps,
    muon_param_groups,
)

# The defaults, ranges and checks are the optimizers' own: one source of truth, called here with the flag's name.
from hf_gpa.optim._checks import (
    check_averaging,
    check_inner_steps,
    check_mu_x,
    check_mu_y,
    check_outer_lr,
    check_outer_momentum,
)
from hf_gpa.optim._types import (
    AVERAGING_MODES,
    DEFAULT_AVERAGING,
    DEFAULT_INNER_STEPS,
    DEFAULT_MU_X,
    DEFAULT_MU_Y,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
)

__all__ = [
    "DEFAULT_MU_X",
    "DEFAULT_MU_Y",
    "HF_GPA_OPTIMIZERS",
    "GPAOptimizerNames",
    "GPATrainingArguments",
    "OptimizerSpec",
    "optimizer_cls_and_kwargs",
]

DEEPSPEED_REFUSAL = (
    "DeepSpeed wraps the optimizer and steps its own float32 master copies of the parameters, so GPA's switch "
    "between y (training) and x (evaluation) would not reach the weights the model runs with: evaluation and every "
    "checkpoint would silently be y. Shard with FSDP2 instead (accelerate launch --config_file "
    "configs/accelerate_fsdp2.yaml), or use DDP."
)

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

    A flag of this file that the chosen ``--optim`` does not read (and that differs from its default) is refused,
    naming the ``--optim`` values that read it; the example scripts leave out their defaults for such flags.
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
    groups = []
    for group in muon_param_groups(model):
        for weight_decay, params in (
            (args.weight_decay, [p for p in group["params"] if names[id(p)] in decay]),
            (0.0, [p for p in group["params"] if names[id(p)] not in decay]),
        ):
            if params:
                groups.append({**group, "params": params, "weight_decay": weight_decay})
    return MuonWithAuxAdam, {"params": groups, **_adam_kwargs(args)}


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
        "GPA around AdamW", _build_gpa_adamw, (*_GPA_AVERAGING_FLAGS, *_EVALUATION_FLAGS), "GPAAdamW"
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
_READ_BY: dict[str, tuple[str, ...]] = {}
for _name, _spec in HF_GPA_OPTIMIZERS.items():
    for _flag in _spec.flags:
        _READ_BY.setdefault(_flag, ())
        _READ_BY[_flag] += (_name,)


def _optim_value(value: Any) -> Any:
    """The plain string of an --optim value given as an enum member (stock or ours), else the value itself."""
    return value.value if isinstance(value, Enum) else value


def _as_optim_member(name: str) -> Enum:
    """The enum member of an --optim name: ours from GPAOptimizerNames, a stock one from OptimizerNames."""
    return GPAOptimizerNames(name) if name in HF_GPA_OPTIMIZERS else OptimizerNames(name)


def optimizer_cls_and_kwargs(args: TrainingArguments, model: nn.Module | None = None) -> tuple[Any, dict[str, Any]]:
    """The optimizer class and keyword arguments for ``args.optim``: hf_gpa's table, else the stock Trainer's."""
    spec = HF_GPA_OPTIMIZERS.get(_optim_value(getattr(args, "optim", None)))
    if spec is not None:
        return spec.build(args, model)
    from transformers import Trainer

    return Trainer.get_optimizer_cls_and_kwargs(args, model)


def unused_flags(optim: str) -> tuple[str, ...]:
    """The hf_gpa flags that ``--optim optim`` does not read (their defaults are then left out by the scripts)."""
    spec = HF_GPA_OPTIMIZERS.get(_optim_value(optim))
    used = spec.flags if spec is not None else ()
    return tuple(flag for flag in _READ_BY if flag not in used)


def _optim_help() -> str:
    ours = ", ".join(f"{name} ({spec.description})" for name, spec in HF_GPA_OPTIMIZERS.items())
    return f"The optimizer to use: {ours}, or any stock transformers name."


@dataclass
class GPATrainingArguments(TrainingArguments):
    """`TrainingArguments` with the GPA optimizer flags.

    `--optim gpa_adamw` is GPA around AdamW and takes `--learning_rate`, `--adam_beta1`, `--adam_beta2`,
    `--adam_epsilon` and `--weight_decay` exactly as `--optim adamw_torch` does. `--optim gpa --gpa_base_optim NAME`
    wraps whatever the stock Trainer builds for `--optim NAME`. `--optim diloco_adamw` is the single-worker DiLoCo
    baseline. Every stock `--optim` value keeps working unchanged.

    The averaging constant is `--gpa_mu_x` or, equivalently, `--gpa_inner_steps H` with mu_x = 0.9 ** (1 / H)
    (paper, Table 4). Both may be given only when they agree (as they do in a saved configuration). With
    `--gpa_averaging schedule_free` there is no averaging constant: giving either flag is an error, and both stay
    None.

    A flag that the chosen `--optim` does not read (`--gpa_*` without a GPA optimizer, `--diloco_*` without
    `diloco_adamw`) is an error when it differs from its default, naming the `--optim` values that read it.
    """

    optim: str = field(
        default=TrainingArguments.default_optim,
        metadata={"help": _optim_help(), "choices": GPA_OPTIM_NAMES + STOCK_OPTIM_NAMES},
    )
    gpa_base_optim: str | None = field(
        default=None,
        metadata={
            "help": (
                "With --optim gpa: the stock --optim name of the base optimizer GPA wraps (e.g. adamw_torch_fused, "
                "sgd, adafactor, lion_32bit). Required with --optim gpa and only valid with it."
            ),
        },
    )
    gpa_mu_x: float | None = field(
        default=None,
        metadata={
            "help": (
                "GPA's averaging constant mu_x in [0, 1) for the evaluation sequence x; mu_x = 0 recovers the base "
                "optimizer. Unset: derived from --gpa_inner_steps when that is set, else "
                f"{DEFAULT_MU_X} (0.9 ** (1 / H) for H = {DEFAULT_INNER_STEPS})."
            )
        },
    )
    gpa_mu_y: float = field(
        default=DEFAULT_MU_Y,
        metadata={"help": "GPA's interpolation constant mu_y in (0, 1] for the gradient point y."},
    )
    gpa_inner_steps: int | None = field(
        default=None,
        metadata={
            "help": (
                f"Set mu_x from an equivalent number H >= 1 of DiLoCo inner steps: mu_x = {DEFAULT_OUTER_MOMENTUM} ** "
                "(1 / H) (paper, Table 4). Conflicts with a different --gpa_mu_x."
            )
        },
    )
    gpa_averaging: str = field(
        default=DEFAULT_AVERAGING,
        metadata={
            "help": (
                "How x averages z: gpa (an exponential moving average with constant mu_x, needs an lr schedule) or "
                "schedule_free (Schedule-Free's lr**2-weighted uniform average; takes no --gpa_mu_x)."
            ),
            "choices": AVERAGING_MODES,
        },
    )
    diloco_inner_steps: int = field(
        default=DEFAULT_INNER_STEPS,
        metadata={"help": "With --optim diloco_adamw: inner AdamW steps H between outer steps (>= 1)."},
    )
    diloco_outer_lr: float = field(
        default=DEFAULT_OUTER_LR,
        metadata={"help": "With --optim diloco_adamw: the outer (Nesterov) learning rate (finite, > 0)."},
    )
    diloco_outer_momentum: float = field(
        default=DEFAULT_OUTER_MOMENTUM,
        metadata={"help": "With --optim diloco_adamw: the outer Nesterov momentum in [0, 1)."},
    )
    gpa_bn_recalibration_batches: int = field(
        default=DEFAULT_RECALIBRATION_BATCHES,
        metadata={
            "help": (
                "Training batches forwarded at x (no gradients) to recompute the running statistics of BatchNorm "
                "and other norm layers that keep them, wherever GPATrainer evaluates or saves at x (the statistics "
                "of y are restored for training). Models without such layers pay nothing. 0 turns it off."
            )
        },
    )

    def __post_init__(self) -> None:
        # Validate our flags first: a wrong flag should fail before anything else happens.
        self.gpa_bn_recalibration_batches = check_recalibration_batches(self.gpa_bn_recalibration_batches)
        optim = _optim_value(self.optim)
        if optim not in GPA_OPTIM_NAMES and optim not in STOCK_OPTIM_NAMES:
            raise ValueError(
                f"--optim {optim!r} is not a known optimizer: use one of {', '.join(GPA_OPTIM_NAMES)} or a stock "
                f"transformers name ({', '.join(STOCK_OPTIM_NAMES)})"
            )
        self._check_gpa_flags(optim)
        self._refuse_deepspeed(optim)
        with self._stock_name_inside(optim):
            super().__post_init__()
        self._warn_constant_schedule(optim)

    def _warn_constant_schedule(self, optim: str) -> None:
        """GPA's exponential average needs a decaying lr: with a constant one x lags y to the end (warned, not refused:
        a short constant-lr probe is legitimate). Schedule-Free averaging is made for a constant lr."""
        import warnings  # here, not at the top: the one user in this file

        schedule = str(getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type))  # a SchedulerType member
        averages = "gpa_averaging" not in unused_flags(optim) and self.gpa_averaging == "gpa"
        if averages and schedule in ("constant", "constant_with_warmup"):  # the lr never decays
            warnings.warn(
                f"--optim {optim} with --lr_scheduler_type {schedule}: GPA's evaluation weights x average the last "
                "~1 / (1 - mu_x) steps and only reach the training weights' quality when the lr decays; use "
                "--lr_scheduler_type cosine (the paper's recipe, with --warmup_steps 0.1), or --gpa_averaging "
                "schedule_free for a constant lr",
                UserWarning,
                stacklevel=2,
            )

    @contextlib.contextmanager
    def _stock_name_inside(self, optim: str) -> Iterator[None]:
        """Inside, ``self.optim`` is a stock name; on exit (also by an exception) it is ``optim``'s enum member.

        The one place where hf_gpa's names meet transformers' code that converts ``optim`` with
        ``OptimizerNames(...)`` (`__post_init__`, `set_optimizer`): it is handed a stock name, and the object never
        keeps a name the user did not give.
        """
        if optim not in HF_GPA_OPTIMIZERS:
            yield
            return
        self.optim = OptimizerNames.ADAMW_TORCH
        try:
            yield
        finally:
            self.optim = GPAOptimizerNames(optim)

    # ---- composing with other TrainingArguments subclasses (TRL's configs, Seq2SeqTrainingArguments) ----

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Let ``class C(GPATrainingArguments, SFTConfig)`` keep the defaults SFTConfig redeclares.

        `dataclasses` collects fields base by base in reverse MRO order, and every dataclass carries all fields it
        inherited: the stock `TrainingArguments` fields that GPATrainingArguments inherits would be collected after
        SFTConfig's and reset, e.g., its learning rate to the stock default. Each field is therefore declared
        again on the new class, taken from the class that comes first in the MRO, as Python's attribute lookup
        would do; the class's own declarations still win, and the field order is unchanged.
        """
        super().__init_subclass__(**kwargs)
        own = inspect.get_annotations(cls)
        collected: dict[str, dataclasses.Field] = {}
        for base in reversed(cls.__mro__[1:]):
            collected.update(getattr(base, "__dataclass_fields__", {}))
        redeclared: dict[str, dataclasses.Field] = {}
        for name, collected_field in collected.items():
            if name in own:
                continue
            declarer = next((b for b in cls.__mro__[1:] if name in inspect.get_annotations(b)), None)
            first = getattr(declarer, "__dataclass_fields__", {}).get(name)
            if first is not None and first is not collected_field:
                redeclared[name] = first
        if not redeclared:
            return
        annotations = dict(own)
        for name, first in redeclared.items():
            annotations[name] = first.type
            setattr(cls, name, _copy_field(first))
        cls.__annotations__ = annotations

    # ---- DeepSpeed: refused before any work starts ----

    def _refuse_deepspeed(self, optim: str) -> None:
        """DeepSpeed hides the parameters from a GPA optimizer: refuse the combination, without importing it."""
        if optim not in GPA_OPTIM_NAMES or not HF_GPA_OPTIMIZERS[optim].evaluation_weights:
            return
        if self.deepspeed:
            route = f"--deepspeed {self.deepspeed!r}" if isinstance(self.deepspeed, str) else "--deepspeed (a dict)"
        elif strtobool(os.environ.get("ACCELERATE_USE_DEEPSPEED", "false")):
            route = "ACCELERATE_USE_DEEPSPEED=true (accelerate's DeepSpeed plugin)"
        else:
            return
        raise ValueError(f"--optim {optim} cannot run under {route}: {DEEPSPEED_REFUSAL}")

    def _check_gpa_flags(self, optim: str) -> None:
        given = {flag: getattr(self, flag) for flag in _READ_BY}
        if optim == "gpa":
            if self.gpa_base_optim is None:
                raise ValueError(
                    "--optim gpa needs --gpa_base_optim NAME (a stock --optim name such as adamw_torch or sgd)"
                )
            self.gpa_base_optim = _check_base_optim(_optim_value(self.gpa_base_optim))

        self.gpa_averaging = check_averaging(self.gpa_averaging, "--gpa_averaging")
        if self.gpa_averaging == "schedule_free":
            # Schedule-Free's average has no constant: a given mu_x or H would be silently ignored.
            for flag in ("gpa_mu_x", "gpa_inner_steps"):
                if getattr(self, flag) is not None:
                    raise ValueError(
                        f"--{flag} {getattr(self, flag)} does not apply with --gpa_averaging schedule_free (its "
                        "average weights each step by lr**2 and has no averaging constant); leave it out"
                    )
        elif self.gpa_inner_steps is not None:
            self.gpa_inner_steps = check_inner_steps(self.gpa_inner_steps, "--gpa_inner_steps")
            mu_x = mu_x_from_inner_steps(self.gpa_inner_steps, DEFAULT_OUTER_MOMENTUM)
            if not mu_x < 1.0:
                # In floating point 0.9 ** (1 / H) is 1.0 for H beyond about 10**15: x would never move.
                raise ValueError(
                    f"Invalid --gpa_inner_steps: {self.gpa_inner_steps} (mu_x = {DEFAULT_OUTER_MOMENTUM} ** (1 / H) "
                    f"rounds to {mu_x!r}, outside [0, 1) where x never moves; use a smaller H)"
                )
            # Both flags are fine when they agree: a saved configuration carries both.
            if self.gpa_mu_x is not None:
                given_mu_x = check_mu_x(self.gpa_mu_x, "--gpa_mu_x")
                if not math.isclose(given_mu_x, mu_x, rel_tol=0.0, abs_tol=1e-12):
                    raise ValueError(
                        f"--gpa_inner_steps {self.gpa_inner_steps} sets mu_x = {DEFAULT_OUTER_MOMENTUM} ** "
                        f"(1 / {self.gpa_inner_steps}) = {mu_x!r}, which conflicts with --gpa_mu_x {self.gpa_mu_x}; "
                        "give only one of the two"
                    )
            self.gpa_mu_x = mu_x
        else:
            self.gpa_mu_x = check_mu_x(DEFAULT_MU_X if self.gpa_mu_x is None else self.gpa_mu_x, "--gpa_mu_x")
        self.gpa_mu_y = check_mu_y(self.gpa_mu_y, "--gpa_mu_y")

        self.diloco_inner_steps = check_inner_steps(self.diloco_inner_steps, "--diloco_inner_steps")
        self.diloco_outer_lr = check_outer_lr(self.diloco_outer_lr, "--diloco_outer_lr")
        self.diloco_outer_momentum = check_outer_momentum(self.diloco_outer_momentum, "--diloco_outer_momentum")
        self._refuse_unused_flags(optim, given)

    def _refuse_unused_flags(self, optim: str, given: dict[str, Any]) -> None:
        """A flag set away from its default that ``--optim optim`` does not read is an error, not silently ignored."""
        defaults = {name: f.default for name, f in self.__dataclass_fields__.items() if name in _READ_BY}
        defaults_too = {"gpa_mu_x": (DEFAULT_MU_X,)}  # the value an unset --gpa_mu_x takes (a saved config has it)
        for flag in unused_flags(optim):
            value = _optim_value(given[flag])
            if value == defaults[flag] or value in defaults_too.get(flag, ()):
                continue
            readers = _READ_BY[flag]
            raise ValueError(
                f"--{flag} {value} only applies to --optim {' or '.join(readers)} (got --optim {optim}), which "
                f"{'reads' if len(readers) == 1 else 'read'} it; --optim {optim} would ignore it. Leave it out, or "
                f"choose --optim {readers[0] if len(readers) == 1 else 'one of ' + ', '.join(readers)}."
            )

    def set_optimizer(
        self,
        name: str | OptimizerNames | GPAOptimizerNames = "adamw_torch",
        learning_rate: float = 5e-5,
        weight_decay: float = 0,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        args: str | None = None,
    ) -> GPATrainingArguments:
        """`TrainingArguments.set_optimizer` that also takes gpa_adamw, gpa and diloco_adamw, and checks the flags.

        A name or flag it rejects leaves the arguments exactly as they were.
        """
        value = _optim_value(name)
        before = dict(self.__dict__)
        try:
            with self._stock_name_inside(value):
                stock_name = OptimizerNames.ADAMW_TORCH if value in HF_GPA_OPTIMIZERS else value
                super().set_optimizer(stock_name, learning_rate, weight_decay, beta1, beta2, epsilon, args)
            self._check_gpa_flags(value)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise
        return self

    @property
    def uses_gpa(self) -> bool:
        """True when `--optim` is one of hf_gpa's optimizers with evaluation weights x (all but muon)."""
        return isinstance(self.optim, GPAOptimizerNames) and HF_GPA_OPTIMIZERS[self.optim.value].evaluation_weights

    @property
    def gpa_effective_inner_steps(self) -> float | None:
        """H with mu_x = 0.9 ** (1 / H): the DiLoCo inner steps GPA's averaging matches (None when mu_x = 0 or with
        schedule_free averaging)."""
        if self.gpa_inner_steps is not None:
            return float(self.gpa_inner_steps)
        if self.gpa_mu_x is None or not 0.0 < self.gpa_mu_x < 1.0:  # None: schedule_free, which has no mu_x
            return None
        return inner_steps_from_mu_x(self.gpa_mu_x, DEFAULT_OUTER_MOMENTUM)


def _check_base_optim(base: str) -> str:
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


def _copy_field(original: dataclasses.Field) -> Any:
    """A new `dataclasses.field` with the same default and settings (a Field may belong to one class only)."""
    return field(
        default=original.default,
        default_factory=original.default_factory,
        init=original.init,
        repr=original.repr,
        hash=original.hash,
        compare=original.compare,
        metadata=original.metadata,
        kw_only=original.kw_only,
    )
