"""hf_gpa.optim: the GPA optimizers in pure PyTorch (imports nothing but torch).

Besides the optimizers, the public names here are what the transformers side (`hf_gpa.training_args`,
`hf_gpa.trainer`, `hf_gpa.checkpoint`) takes from this package: the defaults and range checks of the
hyper-parameters (one source of truth, called there with the flag's name), the base class of every optimizer with
train/eval modes, the name a state dict records of the optimizer that saved it, and what a distributed DiLoCo needs
around it (its worker layout, the layout a state dict records, the DDP hook that keeps gradients in an island; the
rest of DiLoCo and GPA across workers is the public subpackage ``hf_gpa.optim.diloco``), the param-group keys that a
state dict records, and the DTensor helpers of FSDP2 shards.
"""

import warnings

with warnings.catch_warnings():
    # torch >= 2.x says "Failed to initialize NumPy" when it is imported without numpy installed; hf_gpa needs no
    # numpy, so `import hf_gpa` in a torch-only environment stays silent (a torch imported earlier said it already).
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from ._base import TrainEvalOptimizer, saved_optimizer_name
from ._checks import (
    check_averaging,
    check_betas,
    check_eps,
    check_inner_steps,
    check_lr,
    check_mu_x,
    check_mu_y,
    check_num_fragments,
    check_num_workers,
    check_outer_lr,
    check_outer_momentum,
    check_weight_decay,
)
from ._tensors import is_dtensor, local_tensor
from ._types import (
    AVERAGING,
    AVERAGING_MODES,
    DEFAULT_AVERAGING,
    DEFAULT_INNER_STEPS,
    DEFAULT_MU_X,
    DEFAULT_MU_Y,
    DEFAULT_NUM_FRAGMENTS,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_LR_ACROSS_WORKERS,
    DEFAULT_OUTER_MOMENTUM,
    INNER_STEPS,
    MU_X,
    MU_Y,
    OUTER_LR,
    OUTER_MOMENTUM,
    default_outer_lr,
)
from .averaging import inner_steps_from_mu_x, mu_x_from_inner_steps
from .diloco import (
    DiLoCo,
    GPADiLoCo,
    WorkerLayout,
    default_gpa_outer_lr,
    island_allreduce_hook,
    outer_lr_like_diloco,
)
from .diloco import saved_layout as saved_diloco_layout
from .gpa import GPA
from .gpa_adamw import GPAAdamW
from .in_backward import StepInBackward, step_in_backward
from .muon import MuonWithAuxAdam, muon_param_groups
from .reference import ReferenceGPA

__all__ = [
    "GPA",
    "GPAAdamW",
    "DiLoCo",
    "GPADiLoCo",
    "default_gpa_outer_lr",
    "outer_lr_like_diloco",
    "WorkerLayout",
    "island_allreduce_hook",
    "saved_diloco_layout",
    "ReferenceGPA",
    "MuonWithAuxAdam",
    "muon_param_groups",
    "mu_x_from_inner_steps",
    "inner_steps_from_mu_x",
    "TrainEvalOptimizer",
    "saved_optimizer_name",
    "AVERAGING_MODES",
    "DEFAULT_AVERAGING",
    "DEFAULT_INNER_STEPS",
    "DEFAULT_MU_X",
    "DEFAULT_MU_Y",
    "DEFAULT_NUM_FRAGMENTS",
    "DEFAULT_OUTER_LR",
    "DEFAULT_OUTER_LR_ACROSS_WORKERS",
    "DEFAULT_OUTER_MOMENTUM",
    "default_outer_lr",
    "check_averaging",
    "check_betas",
    "check_eps",
    "check_inner_steps",
    "check_lr",
    "check_mu_x",
    "check_mu_y",
    "check_num_fragments",
    "check_num_workers",
    "check_outer_lr",
    "check_outer_momentum",
    "check_weight_decay",
    "step_in_backward",
    "StepInBackward",
    "is_dtensor",
    "local_tensor",
    "AVERAGING",
    "INNER_STEPS",
    "MU_X",
    "MU_Y",
    "OUTER_LR",
    "OUTER_MOMENTUM",
]
