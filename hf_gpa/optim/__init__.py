"""hf_gpa.optim: the GPA optimizers in pure PyTorch (imports nothing but torch)."""

from .averaging import inner_steps_from_mu_x, mu_x_from_inner_steps
from .diloco import DiLoCo
from .gpa import GPA
from .gpa_adamw import GPAAdamW
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
]
