"""GPA inside TRL: ready-made configs and trainers for SFT, DPO and reward modelling.

Each class is the two-line recipe that works for any `Trainer` subclass: the GPA class first, so that its
cooperative overrides (evaluation and saving at x, exact resume, the optimizer names) wrap TRL's, and TRL's
signatures and behaviour stay as they are::

    @dataclass
    class GPASFTConfig(GPATrainingArguments, SFTConfig): ...

    class GPASFTTrainer(GPATrainer, SFTTrainer): ...

TRL is an optional dependency (``pip install "hf_gpa[trl]"``); ``import hf_gpa`` does not import it, and the names
below are resolved on first access (``hf_gpa.GPASFTTrainer``) or by importing this module.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
except ImportError as error:  # pragma: no cover - exercised by a test that hides trl
    raise ImportError(
        'hf_gpa.trl needs TRL, which is not installed: pip install "hf_gpa[trl]"'
    ) from error

from hf_gpa.trainer import GPATrainer
from hf_gpa.training_args import GPATrainingArguments

__all__ = [
    "GPADPOConfig",
    "GPADPOTrainer",
    "GPARewardConfig",
    "GPARewardTrainer",
    "GPASFTConfig",
    "GPASFTTrainer",
]


@dataclass
class GPASFTConfig(GPATrainingArguments, SFTConfig):
    """TRL's `SFTConfig` with the GPA flags (`--optim gpa_adamw`, `--gpa_mu_x`, ...); TRL's defaults are kept."""


class GPASFTTrainer(GPATrainer, SFTTrainer):
    """TRL's `SFTTrainer` that builds the hf_gpa optimizers and evaluates and saves at x."""


@dataclass
class GPADPOConfig(GPATrainingArguments, DPOConfig):
    """TRL's `DPOConfig` with the GPA flags; TRL's defaults are kept."""


class GPADPOTrainer(GPATrainer, DPOTrainer):
    """TRL's `DPOTrainer` with GPA: the policy is trained by the hf_gpa optimizer and evaluated and saved at x.

    The reference model is never given to the optimizer, so its weights are the same at x and at y.
    """


@dataclass
class GPARewardConfig(GPATrainingArguments, RewardConfig):
    """TRL's `RewardConfig` with the GPA flags; TRL's defaults are kept."""


class GPARewardTrainer(GPATrainer, RewardTrainer):
    """TRL's `RewardTrainer` that builds the hf_gpa optimizers and evaluates and saves at x."""
