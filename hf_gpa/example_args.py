"""What the example scripts share: parsing with defaults that any given flag overrides, logging, resume detection.

``run_clm_gpa.py`` and ``run_vit_gpa.py`` apply the paper's GPA recipe by default, and their sizing of the embedded
default data only when no dataset is named. Both parse the command line or one JSON file with ``HfArgumentParser``,
as transformers' examples do, and fill in a default only for the flags that were not given.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import transformers
from transformers import HfArgumentParser, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

__all__ = [
    "given_flag_names",
    "defaults_for",
    "device_defaults",
    "parse_with_defaults",
    "setup_logging",
    "detect_last_checkpoint",
]


def given_flag_names(argv: Sequence[str]) -> set[str]:
    """The field names of the flags in argv (``--do-train=true`` -> ``do_train``, ``--no_x`` -> ``x``)."""
    names = set()
    for arg in argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].replace("-", "_")
            names.add(name[3:] if name.startswith("no_") else name)
    return names


def device_defaults() -> dict[str, Any]:
    """Defaults that depend on the machine: no pinned dataloader memory where there is no accelerator.

    transformers turns ``--dataloader_pin_memory`` off only with ``--use_cpu``; on a machine without a GPU (or other
    accelerator) torch's DataLoader then warns that pinning was asked for but no accelerator is found.
    """
    import torch

    return {} if torch.accelerator.is_available() else {"dataloader_pin_memory": False}


def defaults_for(
    given: set[str],
    recipe: Mapping[str, Any],
    embedded: Mapping[str, Any] | None,
    coupled: Mapping[str, Sequence[str]],
) -> dict[str, Any]:
    """The defaults for every flag not given; ``embedded`` (None when a dataset is named) adds the data sizing.

    A default is also left out when the user gives a flag it is coupled to (``--num_train_epochs`` drops a default
    ``--max_steps``). ``--do_train --do_eval`` is the default when none of the ``--do_*`` flags is given.
    """
    defaults = {**recipe, **(embedded or {})}
    if not given & {"do_train", "do_eval", "do_predict"}:
        defaults.update(do_train=True, do_eval=True)
    return {
        name: value
        for name, value in defaults.items()
        if name not in given and not given & set(coupled.get(name, ()))
    }


def parse_with_defaults(
    dataclass_types: tuple[type, ...],
    data_args_type: type,
    data_source_flags: Sequence[str],
    recipe: Mapping[str, Any],
    embedded: Mapping[str, Any],
    coupled: Mapping[str, Sequence[str]],
    argv: Sequence[str] | None = None,
) -> tuple[Any, ...]:
    """Parse the command line (or one JSON file) into ``dataclass_types``, filling in defaults for flags not given.

    The embedded data sizing applies only when none of ``data_source_flags`` (fields of ``data_args_type``) is set;
    the `device_defaults` apply always, unless the flag is given.
    """
    parser = HfArgumentParser(dataclass_types)
    recipe = {**device_defaults(), **recipe}
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        given_dict: dict[str, Any] = json.loads(Path(argv[0]).read_text())
        uses_embedded = not any(given_dict.get(flag) for flag in data_source_flags)
        defaults = defaults_for(set(given_dict), recipe, embedded if uses_embedded else None, coupled)
        return parser.parse_dict({**defaults, **given_dict})
    if "-h" in argv or "--help" in argv:
        return parser.parse_args_into_dataclasses(args=argv)  # prints the help of every dataclass and exits
    # A first pass over the data flags only, to learn whether the embedded data is used.
    (data_args, _) = HfArgumentParser(data_args_type).parse_args_into_dataclasses(
        args=argv, return_remaining_strings=True
    )
    uses_embedded = not any(getattr(data_args, flag) for flag in data_source_flags)
    defaults = defaults_for(given_flag_names(argv), recipe, embedded if uses_embedded else None, coupled)
    prefix: list[str] = []
    for name, value in defaults.items():
        prefix += [f"--{name}", str(value)]
    return parser.parse_args_into_dataclasses(args=prefix + argv)


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
    logger.info(f"Training/evaluation parameters {training_args}")


def detect_last_checkpoint(training_args: TrainingArguments, logger: logging.Logger) -> str | None:
    """The newest ``checkpoint-*`` folder in ``--output_dir`` when training, to resume from (as run_clm.py does)."""
    if not (os.path.isdir(training_args.output_dir) and training_args.do_train):
        return None
    last_checkpoint = get_last_checkpoint(training_args.output_dir)
    if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
        logger.info(
            f"Checkpoint detected, resuming training at {last_checkpoint}. To avoid this behavior, change "
            "the `--output_dir` or remove its checkpoint-* folders."
        )
    return last_checkpoint
