"""Which files of ``hf_gpa/optim`` run Python during one ``GPAAdamW.step()``, ``eval()`` and ``train()`` on CPU.

Why this file exists: an update that is read in a few files is one a reader can follow and a change can keep
correct. The count is taken by tracing (``sys.setprofile``: every Python frame entered, and the C++ kernel's
entries called), after a warm-up step, ``eval()`` and ``train()``, on the Trainer's two parameter groups (weight
decay on the weights, none on the norm weights) of fp32 and of bf16 parameters (the default ``state_dtype``,
"compact"). torch's AdamW is read in two files (``adam.py``, ``optimizer.py``).

    python -m benchmarks.files_touched

A benchmark that prints, not a timed test; ``tests/test_optim_layout.py`` holds the counts to their limits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hf_gpa.optim
from benchmarks import workloads
from hf_gpa.optim import GPAAdamW

OPTIM = Path(hf_gpa.optim.__file__).resolve().parent
SHAPES = [(64, 32), (32,), (32, 64), (64,), (16, 32)]  # weights (decayed) and norm weights (not), as a Llama's
CALLS = ("step", "eval", "train")


def _name(filename: str) -> str | None:
    """``hf_gpa/optim/kernels/cpu.py`` -> ``kernels/cpu``; None for a file outside ``hf_gpa/optim``."""
    try:
        relative = Path(filename).resolve().relative_to(OPTIM)
    except ValueError:
        return None
    return str(relative.with_suffix(""))


def traced(call: Callable[[], Any]) -> tuple[set[str], set[str]]:
    """(the files of ``hf_gpa/optim`` in which ``call()`` runs Python, the C++ kernel's entries it calls)."""
    files: set[str] = set()
    native: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = _name(frame.f_code.co_filename)
            if name is not None:
                files.add(name)
        elif event == "c_call" and (getattr(arg, "__module__", None) or "").startswith("hf_gpa_cpu_kernels"):
            native.add(arg.__name__)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return files, native


def optimizer(dtype: torch.dtype, seed: int = 0) -> GPAAdamW:
    """A GPAAdamW on the Trainer's two groups of small parameters of ``dtype``, with gradients, one step, eval()
    and train() taken (the state exists, the plans are cached)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=gen).to(dtype).requires_grad_() for shape in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
    opt = GPAAdamW(workloads.trainer_groups(params, weight_decay=0.1), lr=1e-3)
    opt.step()
    opt.eval()
    opt.train()
    return opt


def files_touched(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> dict[str, Any]:
    """For each of step / eval / train, the files of ``hf_gpa/optim`` it runs Python in (over ``dtypes``), their
    union, and the C++ kernel's entries called."""
    files: dict[str, set[str]] = {call: set() for call in CALLS}
    native: set[str] = set()
    for dtype in dtypes:
        opt = optimizer(dtype)
        for call in CALLS:
            touched, entries = traced(getattr(opt, call))
            files[call] |= touched
            native |= entries
    union = set().union(*files.values())
    return {**{call: sorted(files[call]) for call in CALLS}, "union": sorted(union), "native": sorted(native)}


def main() -> None:
    result = files_touched()
    print("Files of hf_gpa/optim that run Python, CPU, fp32 and bf16 (compact) parameters, the Trainer's 2 groups:")
    for key in (*CALLS, "union"):
        print(f"  {key:<6} {len(result[key]):>2}  {', '.join(result[key])}")
    print(f"  C++ kernel entries called: {', '.join(result['native']) or 'none (kernel unavailable)'}")


if __name__ == "__main__":
    main()
