"""Which extra of ``pyproject.toml`` brings a missing module, and the ImportError that names the pip command.

Why this file exists: a script or module that needs an extra should stop at its imports with the command that fixes
it (``pip install "hf_gpa[examples]"``), not with a bare ``ModuleNotFoundError: datasets``. It imports nothing beyond
the standard library, so it works exactly where the extras are missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["EXTRA_OF_MODULE", "missing_extra", "requires_extra"]

#: The top-level module (as imported: sklearn, PIL) -> the extra of pyproject.toml that installs it.
EXTRA_OF_MODULE: dict[str, str] = {
    **dict.fromkeys(("transformers", "accelerate", "safetensors", "huggingface_hub"), "hf"),
    **dict.fromkeys(("datasets", "tokenizers", "evaluate", "sklearn", "PIL"), "examples"),
    "trl": "trl",
    "peft": "peft",
    **dict.fromkeys(("matplotlib", "schedulefree"), "bench"),
    "torchao": "lowbit",
    "torchft": "torchft",
}
#: The extras each extra includes (``examples = ["hf_gpa[hf]", ...]``).
_INCLUDED: dict[str, tuple[str, ...]] = {
    "examples": ("hf",),
    "trl": ("hf",),
    "peft": ("hf",),
    "bench": ("examples", "hf"),
    "test": ("bench", "examples", "hf", "trl", "peft", "lowbit"),
}


def missing_extra(user: str, extra: str, error: ModuleNotFoundError) -> ImportError:
    """The error to raise when ``user`` (a script or module that needs ``extra``) met ``error`` at its imports.

    An ImportError naming the missing module and ``pip install "hf_gpa[extra]"`` when ``extra`` installs that module;
    otherwise ``error`` itself, unchanged (a module no extra brings is not ours to explain).
    """
    module = (error.name or "").split(".")[0]
    if EXTRA_OF_MODULE.get(module) not in (extra, *_INCLUDED.get(extra, ())):
        return error
    return ImportError(f'{user} needs {module}, which is not installed: pip install "hf_gpa[{extra}]"')


@contextlib.contextmanager
def requires_extra(user: str, extra: str) -> Iterator[None]:
    """Around the imports of ``user`` (a script or module that needs ``extra``): a module missing there stops it with
    the error of `missing_extra`, which names the pip command that installs it."""
    try:
        yield
    except ModuleNotFoundError as error:
        raise missing_extra(user, extra, error) from error
