"""Command-line parsing shared by the example scripts: script defaults that any flag the user gives overrides.

``run_clm_gpa.py`` and ``run_vit_gpa.py`` apply the paper's GPA recipe by default, and their sizing of the embedded
default data only when no dataset is named. Both parse the command line or one JSON file with ``HfArgumentParser``,
as transformers' examples do, and fill in a default only for the flags that were not given.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser

__all__ = ["given_flag_names", "defaults_for", "parse_with_defaults"]


def given_flag_names(argv: Sequence[str]) -> set[str]:
    """The field names of the flags in argv (``--do-train=true`` -> ``do_train``, ``--no_x`` -> ``x``)."""
    names = set()
    for arg in argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].replace("-", "_")
            names.add(name[3:] if name.startswith("no_") else name)
    return names


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

    The embedded data sizing applies only when none of ``data_source_flags`` (fields of ``data_args_type``) is set.
    """
    parser = HfArgumentParser(dataclass_types)
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
