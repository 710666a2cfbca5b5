"""hf_gpa: Generalized Primal Averaging for PyTorch, the transformers Trainer and accelerate.

The optimizers (``GPAAdamW``, ``GPA``, ``DiLoCo``, ``GPADiLoCo``, ``MuonWithAuxAdam``) need only torch. The
transformers-side names (``GPATrainingArguments``, ``GPATrainer``) and the TRL classes (``GPASFTTrainer``,
``GPADPOTrainer``, ... from ``hf_gpa.trl``) are imported on first access, so ``import hf_gpa`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from .extras import EXTRA_OF_MODULE
from .optim import (
    GPA,
    DiLoCo,
    GPAAdamW,
    GPADiLoCo,
    MuonWithAuxAdam,
    ReferenceGPA,
    inner_steps_from_mu_x,
    mu_x_from_inner_steps,
    muon_param_groups,
    step_in_backward,
)

__version__ = "0.1.0"

_LAZY = {
    "GPATrainingArguments": "hf_gpa.training_args",
    "GPATrainer": "hf_gpa.trainer",
    # TRL (the `trl` extra): importing one of these imports trl.
    "GPASFTConfig": "hf_gpa.trl",
    "GPASFTTrainer": "hf_gpa.trl",
    "GPADPOConfig": "hf_gpa.trl",
    "GPADPOTrainer": "hf_gpa.trl",
    "GPARewardConfig": "hf_gpa.trl",
    "GPARewardTrainer": "hf_gpa.trl",
}

__all__ = [
    "GPA",
    "GPAAdamW",
    "DiLoCo",
    "GPADiLoCo",
    "ReferenceGPA",
    "MuonWithAuxAdam",
    "muon_param_groups",
    "mu_x_from_inner_steps",
    "inner_steps_from_mu_x",
    "step_in_backward",
    *_LAZY,
]


#: The modules of the `hf` extra: a missing one makes a transformers-side name unavailable.
_HF_EXTRA = frozenset(module for module, extra in EXTRA_OF_MODULE.items() if extra == "hf")


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hf_gpa' has no attribute {name!r}")
    try:
        module = importlib.import_module(_LAZY[name])
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing not in _HF_EXTRA:
            raise
        raise ImportError(
            f"hf_gpa.{name} needs {missing}, which is not installed: pip install \"hf_gpa[hf]\" (the optimizers in "
            "hf_gpa.optim need only torch)"
        ) from error
    return getattr(module, name)
