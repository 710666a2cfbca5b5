"""What the example scripts share: the flags they both declare, parsing with defaults that any given flag overrides,
logging, the checkpoint to resume from, the run itself (`run_example`), the end of the process group.

``run_clm_gpa.py`` and ``run_vit_gpa.py`` parse the command line or one JSON file with ``HfArgumentParser``, as
transformers' examples do, into their ``ModelArguments`` (on `HubArguments`), ``DataTrainingArguments`` (on
`DataArguments`) and `GPATrainingArguments`, and fill in a default only for the flags that were not given. Defaults,
in the order they apply (a flag given on the command line or in the JSON file always wins):

* the script's recipe defaults, always: `GPA_RECIPE_DEFAULTS` (``--optim gpa_adamw``, 10% linear warmup, cosine
  decay, weight decay 0.1, gradient clipping at 1.0: the paper's recipe) and what the script adds to it;
* the script's sizing of its embedded data (``EMBEDDED_DEFAULTS``), when none of the flags that name data
  (`DataArguments.data_source_flags`: ``--dataset_name`` and the script's files or folders) is given;
* ``--do_train --do_eval`` unless a ``--do_*`` flag is turned on (``--do_eval false`` trains without evaluating).

A flag given also wins over a default it acts against: ``--save_steps N`` saves every N steps although the embedded
data's default is ``--save_strategy no`` (`STRATEGY_OF`). ``--resume_from_checkpoint`` must name a ``checkpoint-N``
folder (a run's final folder has no optimizer state and is refused before any data is read).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import datasets
import transformers
from transformers import HfArgumentParser, TrainingArguments
from transformers.hf_argparser import string_to_bool
from transformers.trainer_utils import get_last_checkpoint

from hf_gpa.optim_table import unused_flags
from hf_gpa.training_args import GPATrainingArguments
from hf_gpa.workers import refuse_other_checkpoint

logger = logging.getLogger(__name__)

__all__ = [
    "given_flags",
    "given_switches",
    "defaults_for",
    "show_script_defaults",
    "device_defaults",
    "parse_with_defaults",
    "setup_logging",
    "apply_config_overrides",
    "check_model_source",
    "checkpoint_to_resume",
    "finished_run",
    "start_run",
    "run_example",
    "train_and_evaluate",
    "write_model_card",
    "results_of_finished_run",
    "end_process_group",
    "COUPLED_FLAGS",
    "GPA_RECIPE_DEFAULTS",
    "DataArguments",
    "HubArguments",
    "run_main",
    "RefusedArgument",
    "size_in_parameters",
]

#: The steps a script runs; ``--do_train --do_eval`` unless one of them is turned on.
DO_FLAGS = ("do_train", "do_eval", "do_predict")

#: A flag that acts only under one value of a strategy flag: given without that strategy flag, it sets the value over
#: a script default (``--save_steps 2`` saves every 2 steps although the embedded data's default is ``--save_strategy
#: no``). Where the script has no default for the strategy, transformers' own default holds.
STRATEGY_OF: dict[str, tuple[str, str]] = {
    "save_steps": ("save_strategy", "steps"),
    "eval_steps": ("eval_strategy", "steps"),
}

#: The paper's recipe for GPA-AdamW (Section 5), which both example scripts apply unless the flag is given.
GPA_RECIPE_DEFAULTS: dict[str, Any] = {
    "optim": "gpa_adamw",
    "warmup_steps": 0.1,  # a float in [0, 1) is a ratio of the total steps
    "lr_scheduler_type": "cosine",
    "weight_decay": 0.1,
    "max_grad_norm": 1.0,
}

#: Defaults of both scripts beyond the recipe. DDP without unused parameters: transformers asks DDP to look for them
#: in every step of a model without activation checkpointing, and DDP warns on every process that it found none (the
#: scripts' models use every parameter; a model that does not needs ``--ddp_find_unused_parameters true``).
RUN_DEFAULTS: dict[str, Any] = {"ddp_find_unused_parameters": False}

#: Defaults of both scripts that are left out when the user gives any of the flags they are coupled to: the length of
#: training is one of --max_steps and --num_train_epochs (a script's default for one gives way to the other given);
#: Schedule-Free averaging takes no H, so a given --gpa_averaging drops the default H with it, and so does a given
#: --gpa_mu_x; GPA across the processes (--gpa_distributed) refuses --gpa_inner_steps, whose per-step mu_x it has no
#: use for.
COUPLED_FLAGS: dict[str, tuple[str, ...]] = {
    "max_steps": ("num_train_epochs",),
    "num_train_epochs": ("max_steps",),
    "gpa_inner_steps": ("gpa_mu_x", "gpa_averaging", "gpa_distributed"),
}

#: The --help usage line (also printed above a refused argument): the GPA flags, then the rest, listed by --help.
USAGE = (
    "%(prog)s [-h] [--optim gpa_adamw] [--gpa_mu_x MU_X | --gpa_inner_steps H]\n"
    "       [--gpa_mu_y MU_Y] [--gpa_averaging {gpa,schedule_free}] [--output_dir DIR]\n"
    "       [any model, data or TrainingArguments flag ...]\n"
    "   or: %(prog)s ARGS.json"
)

#: A flag whose choices take more than this many characters shows a short metavar and lists them, wrapped, in its
#: help text (argparse puts them all on the flag's line: --optim's 46 names made a line of 900 characters).
_CHOICES_WIDTH = 40


#: Seconds the other processes of a launch wait, after refusing an argument, before they exit (`run_main`).
REFUSAL_GRACE_S = 2.0


@dataclass
class HubArguments:
    """The Hub arguments of both scripts' ``ModelArguments`` (as in transformers' examples): where pretrained files
    are cached, which revision, the token, whether remote code may run, and a pretrained config other than the
    model's. Each script adds the model itself (``--model_name_or_path``, ``--model_type``, ``--config_overrides``:
    the same flags in both, with help texts that name the script's own models)."""

    cache_dir: str | None = field(
        default=None, metadata={"help": "Where to store the pretrained models and datasets downloaded from the Hub"}
    )
    model_revision: str = field(
        default="main",
        metadata={"help": "The specific model version to use (can be a branch name, tag name or commit id)."},
    )
    token: str | None = field(
        default=None,
        metadata={
            "help": (
                "The token to use as HTTP bearer authorization for remote files. If not specified, will use the "
                "token generated when running `hf auth login` (stored in `~/.huggingface`)."
            )
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": (
                "Whether to trust the execution of code from datasets/models defined on the Hub. This option should "
                "only be set to `True` for repositories you trust and in which you have read the code, as it will "
                "execute code present on the Hub on your local machine."
            )
        },
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Pretrained config name or path if not the same as model_name"}
    )

    @property
    def pretrained_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of every ``from_pretrained`` call of the scripts."""
        return {
            "cache_dir": self.cache_dir,
            "revision": self.model_revision,
            "token": self.token,
            "trust_remote_code": self.trust_remote_code,
        }


@dataclass
class DataArguments:
    """The data arguments of both scripts' ``DataTrainingArguments`` (as in transformers' examples): a dataset of the
    datasets library, and how many of its examples a run uses. With none of `data_source_flags` given, a script uses
    its embedded data, and the sizing defaults that go with it (`parse_with_defaults`)."""

    #: The flags that name the data; a script adds its own (data files, image folders).
    data_source_flags: ClassVar[tuple[str, ...]] = ("dataset_name",)

    dataset_name: str | None = field(
        default=None, metadata={"help": "The name of the dataset to use (via the datasets library)."}
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "The configuration name of the dataset to use (via the datasets library)."}
    )
    max_train_samples: int | None = field(
        default=None,
        metadata={
            "help": (
                "For debugging purposes or quicker training, truncate the number of training examples to this "
                "value if set."
            )
        },
    )
    max_eval_samples: int | None = field(
        default=None,
        metadata={
            "help": (
                "For debugging purposes or quicker training, truncate the number of evaluation examples to this "
                "value if set."
            )
        },
    )

    @property
    def uses_embedded_data(self) -> bool:
        """True when none of `data_source_flags` names data, so the script uses its embedded data."""
        return all(getattr(self, flag) is None for flag in self.data_source_flags)


ModelArgsT = TypeVar("ModelArgsT")
DataArgsT = TypeVar("DataArgsT", bound=DataArguments)


def check_model_source(model_args: Any, model_types: Sequence[str], kind: str) -> None:
    """The checks both scripts' ``ModelArguments`` make: ``--config_overrides`` only for a model built from a config,
    ``--model_type`` one of ``model_types`` (``kind``: "causal-LM", "image-classification")."""
    if model_args.config_overrides is not None and (
        model_args.config_name is not None or model_args.model_name_or_path is not None
    ):
        raise ValueError("--config_overrides can't be used in combination with --config_name or --model_name_or_path")
    if model_args.model_type is not None and model_args.model_type not in model_types:
        raise ValueError(
            f"--model_type {model_args.model_type!r} is not {'an' if kind[0] in 'aeiou' else 'a'} {kind} model "
            f"type; use one of {tuple(model_types)}"
        )


def apply_config_overrides(config: Any, config_overrides: str | None, script_logger: logging.Logger) -> None:
    """``--config_overrides`` (``"hidden_size=64,num_hidden_layers=2"``) applied to a config built from scratch,
    logged."""
    if config_overrides is not None:
        script_logger.info(f"Overriding config: {config_overrides}")
        config.update_from_string(config_overrides)
        script_logger.info(f"New config: {config}")


class RefusedArgument(ValueError):
    """An argument the script refused before any work (a value out of range, an unknown flag, a checkpoint that
    cannot continue the run). Called as a program (`run_main`), the script prints it as argparse prints a usage
    error, once for the whole launch, and exits with status 2; called as a function, it is a ``ValueError``."""


def given_flags(argv: Sequence[str]) -> dict[str, str | bool]:
    """The flags in argv by field name, with their values as given, read in one pass: ``--name V`` and ``--name=V``
    give ``"V"``, a flag followed by another flag (or by nothing) ``True``, ``--no_name`` ``False`` for ``name``;
    dashes or underscores. A flag given twice keeps its last value, as argparse does."""
    given: dict[str, str | bool] = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        flag, equals, value = arg[2:].partition("=")
        name = flag.replace("-", "_")
        if equals:
            given[name] = value
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            given[name] = argv[i + 1]
        else:
            given[name] = True
        if name.startswith("no_"):
            del given[name]
            given[name[3:]] = False
    return given


def device_defaults() -> dict[str, Any]:
    """Defaults that depend on the machine: no pinned dataloader memory where there is no accelerator.

    transformers turns ``--dataloader_pin_memory`` off only with ``--use_cpu``; on a machine without a GPU (or other
    accelerator) torch's DataLoader then warns that pinning was asked for but no accelerator is found.
    """
    import torch

    return {} if torch.accelerator.is_available() else {"dataloader_pin_memory": False}


def given_switches(given: Sequence[str] | Mapping[str, Any], *, from_argv: bool = False) -> dict[str, bool]:
    """The --do_* flags given, with their values (``--do_eval`` -> True, ``--do_eval false`` -> False), from argv, from
    its `given_flags` (``from_argv``) or from the dict of a JSON file; read as `HfArgumentParser` reads a bool flag.
    From argv, a value it cannot read as a bool is left out (the full parse then refuses it, naming the flag)."""
    if not isinstance(given, Mapping):
        given, from_argv = given_flags(given), True
    switches = {}
    for name, value in given.items():
        if name not in DO_FLAGS:
            continue
        try:
            switches[name] = string_to_bool(value) if isinstance(value, str) else bool(value)
        except argparse.ArgumentTypeError:
            if not from_argv:
                raise
    return switches


def defaults_for(
    given: set[str],
    recipe: Mapping[str, Any],
    embedded: Mapping[str, Any] | None,
    coupled: Mapping[str, Sequence[str]],
    optim: str | None = None,
    switches: Mapping[str, bool] | None = None,
) -> dict[str, Any]:
    """The defaults for every flag not given; ``embedded`` (None when a dataset is named) adds the data sizing.

    A default is also left out when the user gives a flag it is coupled to (``--num_train_epochs`` drops a default
    ``--max_steps``), and when the chosen ``--optim`` (``optim``: the given one, else the recipe's) does not read it
    (``--optim adamw_torch`` drops a default ``--gpa_inner_steps``); a given flag of `STRATEGY_OF` sets its strategy
    over a default. ``--do_train --do_eval`` is the default unless a ``--do_*`` flag is turned on (``switches``: the
    given ones with their values); one turned off (``--do_eval false``) turns off only itself.
    """
    defaults = {**recipe, **(embedded or {})}
    switches = switches or {}
    steps = {} if any(switches.values()) else {"do_train": True, "do_eval": True}
    defaults.update(steps)
    if not {**steps, **switches}.get("do_eval", False):
        # No evaluation asked for: a default evaluation strategy would turn --do_eval back on (transformers does).
        defaults.pop("eval_strategy", None)
    for flag, (strategy, value) in STRATEGY_OF.items():
        if flag in given and strategy in defaults:
            defaults[strategy] = value
    chosen = optim if optim is not None else defaults.get("optim")
    unused = set(unused_flags(chosen)) if chosen is not None else set()
    return {
        name: value
        for name, value in defaults.items()
        if name not in given and not given & set(coupled.get(name, ())) and name not in unused
    }


def parse_with_defaults(
    model_args_type: type[ModelArgsT],
    data_args_type: type[DataArgsT],
    recipe: Mapping[str, Any],
    embedded: Mapping[str, Any],
    argv: Sequence[str] | None = None,
) -> tuple[ModelArgsT, DataArgsT, GPATrainingArguments]:
    """Parse the command line (or one JSON file) into a script's model and data arguments and the
    `GPATrainingArguments`, filling in defaults for flags not given (`defaults_for`, with `COUPLED_FLAGS`).

    The embedded data sizing ``embedded`` applies only when none of the ``data_source_flags`` of ``data_args_type`` is
    given; the ``recipe``, `RUN_DEFAULTS` and `device_defaults` apply always, unless the flag is given. A refused
    argument raises `RefusedArgument`.
    """
    data_source_flags = data_args_type.data_source_flags
    with _as_refused_argument():
        parser = HfArgumentParser((model_args_type, data_args_type, GPATrainingArguments), usage=USAGE)
        recipe = {**RUN_DEFAULTS, **device_defaults(), **recipe}
        argv = list(sys.argv[1:] if argv is None else argv)
        if len(argv) == 1 and argv[0].endswith(".json"):
            given_dict: dict[str, Any] = json.loads(Path(argv[0]).read_text())
            uses_embedded = not any(given_dict.get(flag) for flag in data_source_flags)
            defaults = defaults_for(
                set(given_dict),
                recipe,
                embedded if uses_embedded else None,
                COUPLED_FLAGS,
                given_dict.get("optim"),
                given_switches(given_dict),
            )
            known = option_strings(parser)
            unknown = [f"--{key}" for key in given_dict if f"--{key}" not in known]
            if unknown:
                raise RefusedArgument(unknown_flags_message(parser, unknown))
            return parser.parse_dict({**defaults, **given_dict})
        if "-h" in argv or "--help" in argv:
            show_script_defaults(parser, recipe, embedded, data_source_flags)
            return parser.parse_args_into_dataclasses(args=argv)  # prints the help of every dataclass and exits
        given = given_flags(argv)  # argv read once; the full parse below is the second and last time
        uses_embedded = not any(given.get(flag) for flag in data_source_flags)
        optim = given.get("optim")
        defaults = defaults_for(
            set(given),
            recipe,
            embedded if uses_embedded else None,
            COUPLED_FLAGS,
            optim if isinstance(optim, str) else None,
            given_switches(given, from_argv=True),
        )
        prefix: list[str] = []
        for name, value in defaults.items():
            prefix += [f"--{name}", str(value)]
        *parsed, remaining = parser.parse_args_into_dataclasses(args=prefix + argv, return_remaining_strings=True)
        if remaining:
            raise RefusedArgument(unknown_flags_message(parser, remaining))
        return tuple(parsed)


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string ``parser`` takes (``--gpa_mu_x``, ``--gpa-mu-x``, ``-h``, ...)."""
    return [option for action in parser._actions for option in action.option_strings]  # argparse: no public list


def unknown_flags_message(parser: argparse.ArgumentParser, remaining: Sequence[str]) -> str:
    """``unknown flag --gpa_mu_xx; did you mean --gpa_mu_x?`` for each flag of ``remaining`` (the strings the parse
    left over) that ``parser`` does not take, with the nearest of its flags where one is near; a left-over value
    that follows no flag is named as argparse names it."""
    known = option_strings(parser)
    parts = []
    for item in remaining:
        if not item.startswith("-"):
            continue
        flag = item.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1)
        parts.append(f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else " (see --help)"))
    return "; ".join(parts) or f"unrecognized arguments: {' '.join(remaining)}"


@contextlib.contextmanager
def _as_refused_argument() -> Iterator[None]:
    """A ``ValueError`` raised inside (HfArgumentParser's unused flags, a dataclass's ``__post_init__`` checks) goes
    on as a `RefusedArgument`."""
    try:
        yield
    except RefusedArgument:
        raise
    except ValueError as error:
        raise RefusedArgument(str(error)) from error


def show_script_defaults(
    parser: argparse.ArgumentParser,
    recipe: Mapping[str, Any],
    embedded: Mapping[str, Any],
    data_source_flags: Sequence[str],
) -> None:
    """Make ``parser``'s --help readable and true: the GPA flags first (`_gpa_flags_first`), each flag under its
    underscore name alone (the dashed one is said once), long choices wrapped in the help text, and the defaults the
    script applies rather than the dataclasses' own.

    A recipe default replaces the shown default; an embedded-data default too, with the default that holds when a
    dataset is named beside it where the two differ; an unset ``--output_dir`` shows the folder transformers writes
    to. A default that the chosen ``--optim`` ignores is still shown: it applies with the script's default ``--optim``.
    """
    _gpa_flags_first(parser)
    data_flags = "/".join(f"--{flag}" for flag in data_source_flags)
    for action in parser._actions:  # argparse has no public iterator over its actions
        _shorten(action)
        dest = action.dest
        if dest in recipe:
            action.default = recipe[dest]
        elif dest in embedded and str(embedded[dest]) == str(action.default):
            pass  # the same default with or without a dataset
        elif dest in embedded:
            # "%(default)s" in the help text keeps argparse from appending its own "(default: ...)".
            action.help = f"{action.help or ''} (default: {embedded[dest]}; %(default)s with {data_flags})".strip()
            continue
        elif dest == "output_dir" and action.default is None:
            action.default = _unset_output_dir()
        elif dest in ("do_train", "do_eval") and action.option_strings[0].startswith("--do"):
            action.help = (
                f"{action.help or ''} (default: true unless a --do_* flag is turned on, else %(default)s; "
                "--do_eval false alone trains without evaluating)"
            ).strip()


def _shorten(action: argparse.Action) -> None:
    """One name per flag in --help (the underscore one; the dashed one parses too), and long choices as a short
    metavar with the choices listed in the help text, where argparse wraps them."""
    if len(action.option_strings) > 1 and all(s.startswith("--") for s in action.option_strings):
        action.option_strings = action.option_strings[:1]
    choices = [str(choice) for choice in action.choices or ()]
    if len(",".join(choices)) > _CHOICES_WIDTH:
        action.metavar = "NAME"
        action.help = f"{action.help or ''} Choices: {', '.join(choices)}.".strip()


def _unset_output_dir() -> str:
    """Where transformers writes when no --output_dir is given (``TrainingArguments.__post_init__`` decides)."""
    import transformers.utils.logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # it logs that it chose the folder
    try:
        return str(TrainingArguments(report_to="none").output_dir)
    finally:
        hf_logging.set_verbosity(verbosity)


def _gpa_flags_first(parser: argparse.ArgumentParser) -> None:
    """Move --optim and the flags `GPATrainingArguments` adds into an argument group of their own, shown before the
    hundreds of stock flags (`HfArgumentParser` puts every field of a dataclass in one group).

    argparse has no public way to move an action between groups: its group lists are rearranged here, for --help
    only (parsing does not look at groups).
    """
    gpa_flags = set(inspect.get_annotations(GPATrainingArguments))
    group = parser.add_argument_group(
        "GPA (hf_gpa)",
        "The optimizer and the flags of hf_gpa's optimizers; the stock flags follow under options. Every flag is "
        "also taken with dashes (--gpa-mu-x).",
    )
    for action in list(parser._optionals._group_actions):
        if action.dest in gpa_flags:
            parser._optionals._group_actions.remove(action)
            group._group_actions.append(action)
    parser._action_groups.remove(group)
    parser._action_groups.insert(0, group)


def setup_logging(training_args: TrainingArguments, logger: logging.Logger) -> None:
    """Logging as in transformers' examples: per-process level from ``--log_level``, hf_gpa included."""
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        # The default of training_args.log_level is passive, so we set log level at info here to have that default.
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    logging.getLogger("hf_gpa").setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.warning(
        f"Process rank: {training_args.local_process_index}, device: {training_args.device}, "
        f"n_gpu: {training_args.n_gpu}, distributed training: {training_args.parallel_mode.value == 'distributed'}, "
        f"16-bits training: {training_args.fp16 or training_args.bf16}"
    )
    # CPU results depend on the thread count (torch splits some reductions by thread): a figure needs it stated.
    import torch

    logger.info(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    logger.info(f"Training/evaluation parameters {training_args}")


def size_in_parameters(model: Any) -> str:
    """``"2,557,632 parameters (2.56M)"``: counted as the Trainer's log counts them (tied weights once)."""
    from transformers.trainer_pt_utils import get_model_param_count

    count = get_model_param_count(model)
    return f"{count:,} parameters ({count / 1e6:.2f}M)"


def checkpoint_to_resume(training_args: TrainingArguments, logger: logging.Logger) -> str | None:
    """The checkpoint training continues from: ``--resume_from_checkpoint``, else the newest ``checkpoint-*`` folder
    in ``--output_dir`` (as run_clm.py does); None for a new run.

    Checked before any data is read: a folder without a run's training state (a run's final output folder, a
    ``--save_only_model`` checkpoint) cannot continue the run; the Trainer would load its weights, start a fresh
    optimizer and lr schedule, and save over it. It is refused, saying what is missing and what to pass instead.
    """
    if not training_args.do_train:
        return None
    given = training_args.resume_from_checkpoint
    last = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
    checkpoint = given or last
    if checkpoint is None:
        return None
    flag = f"--resume_from_checkpoint {given}" if given else f"The newest checkpoint in --output_dir, {checkpoint},"
    if not os.path.isdir(checkpoint):
        raise RefusedArgument(
            f"{flag} is not a folder: pass a checkpoint-N folder that a run wrote with --save_steps N"
        )
    missing = _missing_training_state(checkpoint)
    if missing:
        raise RefusedArgument(
            f"{flag} cannot continue a run: it has no {' and no '.join(missing)} (a run's final output folder, or a "
            "--save_only_model checkpoint, holds the model alone; resuming would start a fresh optimizer and lr "
            "schedule). To continue a run, pass a checkpoint-N folder that it wrote (runs keep them with "
            f"--save_steps N or --save_strategy epoch); to start a new run from these weights, pass "
            f"--model_name_or_path {checkpoint} instead."
        )
    # DiLoCo or GPA across processes resumes only on the layout that saved it (world size, --diloco_workers, ...), and
    # DiLoCo and GPA only with the constants that saved them (--diloco_inner_steps, ..., --gpa_mu_x, --gpa_sync_steps).
    with _as_refused_argument():
        refuse_other_checkpoint(checkpoint, training_args, training_args.process_index)
    if not given:
        logger.info(
            f"Checkpoint detected, resuming training at {checkpoint}. To avoid this behavior, change "
            "the `--output_dir` or remove its checkpoint-* folders."
        )
    return checkpoint


def finished_run(training_args: TrainingArguments) -> str | None:
    """Why ``--output_dir`` already holds this training run, finished; None when there is training to do.

    The same command run again must not train again: resuming from a run's last checkpoint at step ``--max_steps``
    would take one more step and write over the final model and metrics. A run is finished when the newest
    ``checkpoint-N`` in ``--output_dir`` (else the final ``trainer_state.json`` that the scripts write after training)
    reached the requested ``--max_steps`` (with ``--num_train_epochs``: the steps and epochs it planned, and as many
    epochs as requested). An explicit ``--resume_from_checkpoint`` and a run without ``--do_train`` are left alone.
    """
    output_dir = training_args.output_dir
    if not training_args.do_train or training_args.resume_from_checkpoint or not os.path.isdir(output_dir):
        return None
    last = get_last_checkpoint(output_dir)
    source = os.path.join(last or output_dir, "trainer_state.json")
    try:
        with open(source, encoding="utf-8") as f:
            state = json.load(f)
        step = int(state["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if training_args.max_steps > 0:
        done = step >= training_args.max_steps
        target = f"--max_steps {training_args.max_steps}"
    else:
        epochs = state.get("num_train_epochs") or 0
        done = step >= int(state.get("max_steps") or 0) > 0 and epochs >= training_args.num_train_epochs
        target = f"--num_train_epochs {training_args.num_train_epochs:g}"
    if not done:
        return None
    return (
        f"finished: {output_dir} holds a run that reached step {step} ({source}), the end of {target}; nothing to "
        "do. To train again, pass another --output_dir (or remove this one); to continue this run, a larger "
        f"{target.split()[0]} (it resumes from the newest checkpoint-N)."
    )


def results_of_finished_run(training_args: TrainingArguments, logger: logging.Logger) -> dict[str, float] | None:
    """Where ``--output_dir`` holds this run finished (`finished_run`): say so and return the metrics it wrote to
    ``all_results.json`` (empty where it wrote none), so that the script ends without training or writing anything;
    None when there is training to do."""
    finished = finished_run(training_args)
    if finished is None:
        return None
    logger.warning(finished)
    try:
        with open(os.path.join(training_args.output_dir, "all_results.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def start_run(training_args: TrainingArguments, script_logger: logging.Logger) -> tuple[dict | None, str | None]:
    """The start both scripts share, before any data is read: logging (`setup_logging`); then either the results of
    this run where ``--output_dir`` holds it finished (`results_of_finished_run`: `run_example` returns them and
    does nothing else), or None and the checkpoint to resume from (`checkpoint_to_resume`)."""
    setup_logging(training_args, script_logger)
    previous = results_of_finished_run(training_args, script_logger)
    if previous is not None:
        return previous, None
    return None, checkpoint_to_resume(training_args, script_logger)


def run_example(
    args: tuple[ModelArgsT, DataArgsT, GPATrainingArguments],
    build_trainer: Callable[[ModelArgsT, DataArgsT, GPATrainingArguments], Any],
    model_card: Callable[[ModelArgsT, DataArgsT], Mapping[str, Any]],
    script_logger: logging.Logger,
    *,
    add_eval_metrics: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """What both scripts' ``main`` does with the arguments it parsed (``args``: the model, data and training
    arguments), as transformers' examples do: `start_run`, the trainer that ``build_trainer`` makes of the arguments,
    `train_and_evaluate` (with ``add_eval_metrics``) and the model card (`write_model_card`, with what ``model_card``
    says of the model and the data). Returns the metrics written to ``all_results.json``; where ``--output_dir``
    holds this run finished, the metrics it wrote then, with nothing built, trained or written."""
    model_args, data_args, training_args = args
    previous, checkpoint = start_run(training_args, script_logger)
    if previous is not None:
        return previous  # the same command ran to its end before: nothing to train, nothing to write
    trainer = build_trainer(model_args, data_args, training_args)
    all_metrics = train_and_evaluate(trainer, checkpoint, add_eval_metrics=add_eval_metrics)
    write_model_card(trainer, all_metrics, **model_card(model_args, data_args))
    return all_metrics


def train_and_evaluate(
    trainer: Any,
    checkpoint: str | None,
    *,
    add_eval_metrics: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """What both scripts do with their trainer, as transformers' examples do: train (from ``checkpoint``), save the
    model (GPATrainer writes the evaluation weights) and the trainer state, then evaluate; each step's metrics logged,
    written to ``{train,eval}_results.json`` and returned together (``all_results.json``). ``train_samples`` and
    ``eval_samples`` count the examples of a dataset that has a length (a streamed one has none);
    ``add_eval_metrics`` adds what a script computes from the evaluation's metrics (the perplexity)."""
    args, all_metrics = trainer.args, {}
    if args.do_train:
        metrics = trainer.train(resume_from_checkpoint=checkpoint).metrics
        trainer.save_model()  # Saves the processing class too; GPATrainer writes the evaluation weights x.
        if isinstance(trainer.train_dataset, Sized):
            metrics["train_samples"] = len(trainer.train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        all_metrics.update(metrics)
    if args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        if isinstance(trainer.eval_dataset, Sized):
            metrics["eval_samples"] = len(trainer.eval_dataset)
        if add_eval_metrics is not None:
            add_eval_metrics(metrics)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        all_metrics.update(metrics)
    return all_metrics


def write_model_card(trainer: Any, results: Mapping[str, float], **card: Any) -> None:
    """The model card with the run's ``results`` (`GPATrainer.create_model_card`), pushed with the model under
    ``--push_to_hub``."""
    if trainer.args.push_to_hub:
        trainer.push_to_hub(results=results, **card)
    else:
        trainer.create_model_card(results=results, **card)


def run_main(main: Callable[[], object]) -> None:
    """Run an example script's ``main()`` and then end torch.distributed's default process group, where one was
    started (as accelerate's ``end_training`` does), also when ``main()`` raises. A multi-process run that leaves it
    to the interpreter's exit may abort after its work is done (gloo's teardown: "terminate called without an active
    exception"), and so may one whose processes tear their connections down while another still uses them: after
    ``main()`` returned every process is waited for first, within the group's timeout; after an error nothing waits,
    since the others may never arrive. `GPATrainer`, like `Trainer`, leaves this to the script that runs it.

    A `RefusedArgument` ends the program as argparse ends it on a bad flag: the usage line and the message on the
    first process only (``RANK`` 0: under ``accelerate launch`` every process refuses the same argument), no
    traceback, exit status 2."""
    finished = False
    try:
        main()
        finished = True
    except RefusedArgument as error:
        if os.environ.get("RANK", "0") == "0":
            prog = os.path.basename(sys.argv[0])
            sys.stderr.write(f"usage: {USAGE % {'prog': prog}}\n{prog}: error: {error}\n")
        else:
            # The launcher stops every process once one exits: give the first one the time to print the message.
            time.sleep(REFUSAL_GRACE_S)
        raise SystemExit(2) from None
    finally:
        end_process_group(finished=finished)


def end_process_group(*, finished: bool) -> None:
    """Destroy the default process group, where one was started; ``finished`` (the run ended without an error): wait
    for every process first (see `run_main`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def _missing_training_state(folder: str) -> list[str]:
    """What of a run's training state ``folder`` lacks: the trainer state, the optimizer state (``optimizer.pt``,
    or as FSDP and DeepSpeed write it: ``optimizer*``, ``global_step*``)."""
    names = os.listdir(folder)
    missing = [] if "trainer_state.json" in names else ["trainer_state.json"]
    if not any(name.startswith(("optimizer", "global_step")) for name in names):
        missing.append("optimizer state (optimizer.pt)")
    return missing
