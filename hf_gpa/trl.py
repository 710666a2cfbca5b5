"""GPA inside TRL: ready-made configs and trainers for SFT, DPO and reward modelling.

Each class is the two-line recipe that works for any `Trainer` subclass: the GPA class first, so that its
cooperative overrides (evaluation and saving at x, exact resume, the optimizer names) wrap TRL's, and TRL's
signatures and behaviour stay as they are::

    @dataclass
    class GPASFTConfig(GPATrainingArguments, SFTConfig): ...

    class GPASFTTrainer(GPATrainer, SFTTrainer): ...

In a TRL script, swap the config in `TrlParser`'s dataclass list too (``TrlParser((ScriptArguments, GPASFTConfig,
ModelConfig))``), so that the GPA flags parse.

DPO's ``sync_ref_model=True`` copies the policy into the reference model every ``ref_model_sync_steps`` steps; TRL's
callback reads the live parameters, which are y while training. `GPADPOTrainer` gives the reference model x instead,
the policy GPA evaluates and ships (`SyncRefModelAtX`).

TRL is an optional dependency (``pip install "hf_gpa[trl]"``); ``import hf_gpa`` does not import it, and the names
below are resolved on first access (``hf_gpa.GPASFTTrainer``) or by importing this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

try:
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer, SyncRefModelCallback
except ImportError as error:  # pragma: no cover - exercised by a test that hides trl
    raise ImportError(
        'hf_gpa.trl needs TRL, which is not installed: pip install "hf_gpa[trl]"'
    ) from error

from hf_gpa.checkpoint import evaluation_weights
from hf_gpa.trainer import GPATrainer
from hf_gpa.training_args import GPATrainingArguments

__all__ = [
    "GPADPOConfig",
    "GPADPOTrainer",
    "GPARewardConfig",
    "GPARewardTrainer",
    "GPASFTConfig",
    "GPASFTTrainer",
    "SyncRefModelAtX",
]


@dataclass
class GPASFTConfig(GPATrainingArguments, SFTConfig):
    """TRL's `SFTConfig` with the GPA flags (`--optim gpa_adamw`, `--gpa_mu_x`, ...); TRL's defaults are kept."""


class GPASFTTrainer(GPATrainer, SFTTrainer):
    """TRL's `SFTTrainer` that builds the hf_gpa optimizers and evaluates and saves at x."""


@dataclass
class GPADPOConfig(GPATrainingArguments, DPOConfig):
    """TRL's `DPOConfig` with the GPA flags; TRL's defaults are kept."""


class SyncRefModelAtX(SyncRefModelCallback):
    """TRL's `SyncRefModelCallback` with GPA's x in the parameters while it copies them into the reference model.

    TRL mixes the policy's live parameters into the reference model at the end of a step; during GPA training they
    hold y. Inside `evaluation_weights` they hold x, the policy GPA evaluates and saves, and y is back bitwise
    afterwards. With a stock optimizer this is TRL's callback.
    """

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        with evaluation_weights(kwargs.get("optimizer")):
            return super().on_step_end(args, state, control, **kwargs)


class GPADPOTrainer(GPATrainer, DPOTrainer):
    """TRL's `DPOTrainer` with GPA: the policy is trained by the hf_gpa optimizer and evaluated and saved at x.

    The reference model is never given to the optimizer. With ``sync_ref_model=True`` it receives x, not y: the
    `SyncRefModelCallback` that `DPOTrainer` adds is replaced by `SyncRefModelAtX`.
    """

    def add_callback(self, callback: Any, *args: Any, **kwargs: Any) -> None:
        """The next class's `add_callback`; TRL's `SyncRefModelCallback` is added as `SyncRefModelAtX`."""
        if type(callback) is SyncRefModelCallback:
            callback = SyncRefModelAtX(ref_model=callback.ref_model, accelerator=callback.accelerator)
        super().add_callback(callback, *args, **kwargs)


@dataclass
class GPARewardConfig(GPATrainingArguments, RewardConfig):
    """TRL's `RewardConfig` with the GPA flags; TRL's defaults are kept."""


class GPARewardTrainer(GPATrainer, RewardTrainer):
    """TRL's `RewardTrainer` that builds the hf_gpa optimizers and evaluates and saves at x."""
