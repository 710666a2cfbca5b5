"""hf_gpa.optim: the GPA optimizers in pure PyTorch (imports nothing but torch)."""

import warnings

with warnings.catch_warnings():
    # torch >= 2.x says "Failed to initialize NumPy" when it is imported without numpy installed; hf_gpa needs no
    # numpy, so `import hf_gpa` in a torch-only environment stays silent (a torch imported earlier said it already).
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from .averaging import inner_steps_from_mu_x, mu_x_from_inner_steps
from .diloco import DiLoCo
from .gpa import GPA
from .gpa_adamw import GPAAdamW
from .in_backward import StepInBackward, step_in_backward
from .muon import MuonWithAuxAdam, muon_param_groups
from .reference import ReferenceGPA

__all__ = [
    "GPA",
    "GPAAdamW",
    "DiLoCo",
    "ReferenceGPA",
    "MuonWithAuxAdam",
    "muon_param_groups",
    "mu_x_from_inner_steps",
    "inner_steps_from_mu_x",
    "step_in_backward",
    "StepInBackward",
]
