"""DiLoCo and GPA across workers: the optimizer side, in one place (pure PyTorch).

A newcomer's map of this folder:

* ``diloco.py``, ``gpa_diloco.py``: the two outer algorithms, `DiLoCo` (Nesterov) and `GPADiLoCo` (primal
  averaging), their outer step and their state alone;
* ``outer.py``: what they share: the base optimizer's inner steps, the outer state, the train/eval switch, casts;
* ``sync.py``: **what crosses the wire** (`OuterSync`: blocking or overlapped, float32 or compressed, one worker or
  many), with ``compression.py`` for the bf16/int8 payloads; ``torchft_sync.py``: one more kind of it,
  `TorchftSync`, replica groups on torchft that go on when one is lost and heal one that (re)joins (``sync=``);
* ``layout.py``: which process is which worker (islands, process groups, broadcasts, the DDP hook);
* ``fragments.py``: streaming DiLoCo's fragments and when each is due;
* ``rules.py``: **which settings combine**, every refusal written once (the Trainer's flags call the same rules);
* ``checkpoint.py``: **what a worker's checkpoint holds** (its state dict, its file) and the refusals between layouts.

DiLoCo's defaults and the checks of its hyper-parameters are ``_types``' and ``_checks``' (re-exported here), GPA
across workers' ``gpa_diloco.py``'s. The Trainer side (the
flags, the model's wrapping, the checkpoint files, the end of training) is ``hf_gpa.workers``.
"""

from .._checks import check_inner_steps, check_outer_lr, check_outer_momentum
from .._types import (
    DEFAULT_INNER_STEPS,
    DEFAULT_NUM_FRAGMENTS,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_LR_ACROSS_WORKERS,
    DEFAULT_OUTER_MOMENTUM,
)
from . import checkpoint, compression, fragments, rules, torchft_sync
from .checkpoint import OPTIMIZER_RANK_NAME, saved_layout, worker_optimizer_file
from .compression import OUTER_DTYPES
from .diloco import DiLoCo
from .gpa_diloco import (
    DEFAULT_GPA_DILOCO_MU,
    GPADiLoCo,
    check_outer_mu_y,
    default_gpa_outer_lr,
    outer_lr_like_diloco,
)
from .layout import WorkerLayout, broadcast_, island_allreduce_hook
from .outer import OuterOptimizer
from .sync import OuterSync, OuterTraffic
from .torchft_sync import TorchftSync

__all__ = [
    "DEFAULT_INNER_STEPS",
    "DEFAULT_NUM_FRAGMENTS",
    "DEFAULT_OUTER_LR",
    "DEFAULT_OUTER_LR_ACROSS_WORKERS",
    "DEFAULT_OUTER_MOMENTUM",
    "DEFAULT_GPA_DILOCO_MU",
    "OPTIMIZER_RANK_NAME",
    "OUTER_DTYPES",
    "DiLoCo",
    "GPADiLoCo",
    "OuterOptimizer",
    "OuterSync",
    "OuterTraffic",
    "TorchftSync",
    "WorkerLayout",
    "broadcast_",
    "check_inner_steps",
    "check_outer_lr",
    "check_outer_momentum",
    "check_outer_mu_y",
    "checkpoint",
    "compression",
    "fragments",
    "island_allreduce_hook",
    "default_gpa_outer_lr",
    "outer_lr_like_diloco",
    "rules",
    "saved_layout",
    "torchft_sync",
    "worker_optimizer_file",
]
