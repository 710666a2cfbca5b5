"""`GPATrainingArguments`: transformers' `TrainingArguments` plus the GPA flags and three more `--optim` names.

Why a subclass and not a new field on the side: a user's script switches to GPA by changing two names
(`TrainingArguments` -> `GPATrainingArguments`, `Trainer` -> `GPATrainer`) and nothing else. Two things in
transformers stand in the way of a new `--optim` value, and both are handled here without patching transformers:

* `HfArgumentParser` turns the stock `optim: OptimizerNames | str` field into argparse choices taken from the
  `OptimizerNames` enum, so `--optim gpa_adamw` would be rejected before any of our code runs. The field is
  redeclared here as a `str` whose choices are every stock name plus ours.
* `TrainingArguments.__post_init__` converts `optim` with `OptimizerNames(...)`. `__post_init__` below hands the
  stock code a stock name and puts the GPA name (a `GPAOptimizerNames` member) back afterwards; stock names go
  through unchanged and stay `OptimizerNames` members.

Every check runs in `__post_init__`, so a bad flag fails with a `ValueError` naming it before any model or data is
loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments
from transformers.training_args import OptimizerNames
from transformers.utils.generic import strtobool

from hf_gpa.batchnorm import DEFAULT_RECALIBRATION_BATCHES, check_recalibration_batches

# The defaults, ranges and checks are the optimizers' own: one source of truth, called here with the flag's name.
from hf_gpa.optim import (
    AVERAGING_MODES,
    DEFAULT_AVERAGING,
    DEFAULT_MU_X,
    DEFAULT_MU_Y,
    check_averaging,
    check_betas,
    check_eps,
    check_lr,
    check_mu_x,
    check_mu_y,
    check_weight_decay,
    default_outer_lr,
    inner_steps_from_mu_x,
    mu_x_from_inner_steps,
)
from hf_gpa.optim.diloco import (
    DEFAULT_GPA_DILOCO_MU,
    DEFAULT_INNER_STEPS,
    DEFAULT_NUM_FRAGMENTS,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_LR_ACROSS_WORKERS,
    DEFAULT_OUTER_MOMENTUM,
    OUTER_DTYPES,
    check_inner_steps,
    check_outer_lr,
    check_outer_momentum,
    check_outer_mu_y,
    default_gpa_outer_lr,
)
from hf_gpa.optim_table import (
    FLAG_READERS,
    GPA_OPTIM_NAMES,
    HF_GPA_OPTIMIZERS,
    STOCK_OPTIM_NAMES,
    GPAOptimizerNames,
    check_base_optim,
    optim_help,
    optim_value,
    reads_adam_flags,
    unused_flags,
)
from hf_gpa.workers import check_workers_flags

__all__ = [
    "DEFAULT_MU_X",
    "DEFAULT_MU_Y",
    "GPATrainingArguments",
]

DEEPSPEED_REFUSAL = (
    "DeepSpeed wraps the optimizer and steps its own float32 master copies of the parameters, so GPA's switch "
    "between y (training) and x (evaluation) would not reach the weights the model runs with: evaluation and every "
    "checkpoint would silently be y. Shard with FSDP2 instead (accelerate launch --config_file "
    "configs/accelerate_fsdp2.yaml), or use DDP."
)


def deepspeed_refusal(subject: str, route: str) -> ValueError:
    """The one rule for DeepSpeed: an optimizer with evaluation weights x does not run under it (`DEEPSPEED_REFUSAL`).

    Checked where each fact becomes known, before any step: the flags (`GPATrainingArguments`), DeepSpeed enabled at
    the Trainer's construction with a GPA optimizer known then, and DeepSpeed's wrapper around an optimizer found only
    once it is prepared (`GPATrainer`). ``--diloco_distributed`` and ``--gpa_step_in_backward`` refuse DeepSpeed
    among their own refusals, each with the alternative that holds for it."""
    return ValueError(f"{subject} cannot run under {route}: {DEEPSPEED_REFUSAL}")


@dataclass
class GPATrainingArguments(TrainingArguments):
    """`TrainingArguments` with the GPA optimizer flags.

    `--optim gpa_adamw` is GPA around AdamW and takes `--learning_rate`, `--adam_beta1`, `--adam_beta2`,
    `--adam_epsilon` and `--weight_decay` exactly as `--optim adamw_torch` does. `--optim gpa --gpa_base_optim NAME`
    wraps whatever the stock Trainer builds for `--optim NAME`. `--optim diloco_adamw` is the single-worker DiLoCo
    baseline. Every stock `--optim` value keeps working unchanged. Across the processes of a launch,
    `--optim diloco_adamw --diloco_distributed true` is DiLoCo and `--optim gpa_adamw --gpa_distributed true` GPA
    (`GPADiLoCo`: --gpa_sync_steps, --gpa_outer_lr, --gpa_mu_x and --gpa_mu_y per outer step), both in
    --diloco_workers islands and --diloco_fragments fragments.

    The averaging constant is `--gpa_mu_x` or, equivalently, `--gpa_inner_steps H` with mu_x = 0.9 ** (1 / H)
    (paper, Table 4). Both may be given only when they agree (as they do in a saved configuration). With
    `--gpa_averaging schedule_free` there is no averaging constant: giving either flag is an error, and both stay
    None.

    A flag that the chosen `--optim` does not read (`--gpa_*` without a GPA optimizer, `--diloco_*` without
    `diloco_adamw`) is an error when it differs from its default, naming the `--optim` values that read it.
    """

    optim: str = field(
        default=TrainingArguments.default_optim,
        metadata={"help": optim_help(), "choices": GPA_OPTIM_NAMES + STOCK_OPTIM_NAMES},
    )
    gpa_base_optim: str | None = field(
        default=None,
        metadata={
            "help": (
                "With --optim gpa: the stock --optim name of the base optimizer GPA wraps (e.g. adamw_torch_fused, "
                "sgd, adafactor, lion_32bit). Required with --optim gpa and only valid with it."
            ),
        },
    )
    gpa_mu_x: float | None = field(
        default=None,
        metadata={
            "help": (
                "GPA's averaging constant mu_x in [0, 1) for the evaluation sequence x; mu_x = 0 recovers the base "
                "optimizer. Unset: derived from --gpa_inner_steps when that is set, else "
                f"{DEFAULT_MU_X} (0.9 ** (1 / H) for H = {DEFAULT_INNER_STEPS}). With --gpa_distributed: once per "
                f"outer step, unset {DEFAULT_GPA_DILOCO_MU}."
            )
        },
    )
    gpa_mu_y: float = field(
        default=DEFAULT_MU_Y,
        metadata={
            "help": (
                "GPA's interpolation constant mu_y in (0, 1] for the gradient point y; with --gpa_distributed, in "
                "[0, 1], once per outer step."
            )
        },
    )
    gpa_inner_steps: int | None = field(
        default=None,
        metadata={
            "help": (
                f"Set mu_x from an equivalent number H >= 1 of DiLoCo inner steps: mu_x = {DEFAULT_OUTER_MOMENTUM} ** "
                "(1 / H) (paper, Table 4). Conflicts with a different --gpa_mu_x."
            )
        },
    )
    gpa_averaging: str = field(
        default=DEFAULT_AVERAGING,
        metadata={
            "help": (
                "How x averages z: gpa (an exponential moving average with constant mu_x, needs an lr schedule) or "
                "schedule_free (Schedule-Free's lr**2-weighted uniform average; takes no --gpa_mu_x)."
            ),
            "choices": AVERAGING_MODES,
        },
    )
    diloco_inner_steps: int = field(
        default=DEFAULT_INNER_STEPS,
        metadata={"help": "With --optim diloco_adamw or diloco_muon: the inner steps H between outer steps (>= 1)."},
    )
    diloco_outer_lr: float | None = field(
        default=None,
        metadata={
            "help": (
                "With --optim diloco_adamw or diloco_muon: the outer (Nesterov) learning rate (finite, > 0). Unset: "
                f"{DEFAULT_OUTER_LR}, or {DEFAULT_OUTER_LR_ACROSS_WORKERS} with --diloco_distributed across more than "
                "one worker (the DiLoCo scaling-law study's value at M = 4 workers)."
            )
        },
    )
    diloco_outer_momentum: float = field(
        default=DEFAULT_OUTER_MOMENTUM,
        metadata={"help": "With --optim diloco_adamw or diloco_muon: the outer Nesterov momentum in [0, 1)."},
    )
    diloco_distributed: bool = field(
        default=False,
        metadata={
            "help": (
                "With --optim diloco_adamw or diloco_muon under accelerate launch or torchrun: DiLoCo across the "
                "processes. Each of --diloco_workers workers (an island of processes that average their gradients "
                "every step) takes H inner steps on its own data; then one all-reduce averages the pseudo-gradients "
                "across the workers for the outer step. The loss's token count is taken within each worker's island "
                "(--average_tokens_across_devices is turned off). Needs more than one process; not with FSDP, "
                "DeepSpeed or --fp16."
            )
        },
    )
    diloco_workers: int | None = field(
        default=None,
        metadata={
            "help": (
                "With --diloco_distributed or --gpa_distributed: the number of workers M, which divides the number "
                "of processes W; each "
                "worker is an island of W / M processes with consecutive ranks. Unset: every process is a worker "
                "(M = W); 1: plain data parallelism around single-worker DiLoCo."
            )
        },
    )
    diloco_fragments: int = field(
        default=DEFAULT_NUM_FRAGMENTS,
        metadata={
            "help": (
                "With --diloco_distributed or --gpa_distributed: streaming DiLoCo's P fragments of the parameters, "
                "each synchronised at its own inner step of the period (at most H, --diloco_inner_steps or "
                "--gpa_sync_steps, and at most the number of parameter tensors), so that one outer all-reduce "
                "carries about 1/P of the model."
            )
        },
    )
    gpa_distributed: bool = field(
        default=False,
        metadata={
            "help": (
                "With --optim gpa_adamw under accelerate launch or torchrun: GPA across the processes (GPADiLoCo). "
                "Each of --diloco_workers workers takes --gpa_sync_steps H AdamW steps on its own data; then one "
                "all-reduce averages the pseudo-gradients across the workers and the outer state takes one GPA "
                "step: z moves by --gpa_outer_lr, x averages z with --gpa_mu_x and the workers restart from "
                "y = --gpa_mu_y x + (1 - --gpa_mu_y) z. --gpa_mu_x and --gpa_mu_y are then per outer step (unset "
                f"--gpa_mu_x: {DEFAULT_GPA_DILOCO_MU}). Needs more than one process; not with FSDP, DeepSpeed, "
                "--fp16 or --diloco_distributed."
            )
        },
    )
    gpa_sync_steps: int = field(
        default=DEFAULT_INNER_STEPS,
        metadata={"help": "With --gpa_distributed: H >= 1, the inner steps between the workers' synchronisations."},
    )
    gpa_outer_lr: float | None = field(
        default=None,
        metadata={
            "help": (
                "With --gpa_distributed: the rate of z's outer SGD step (finite, > 0). Unset: the rate whose first "
                "outer step moves y as far as DiLoCo's defaults across workers (outer lr "
                f"{DEFAULT_OUTER_LR_ACROSS_WORKERS}, momentum {DEFAULT_OUTER_MOMENTUM}) move its outer weights, "
                f"{DEFAULT_OUTER_LR_ACROSS_WORKERS} (1 + {DEFAULT_OUTER_MOMENTUM}) / (1 - mu_x mu_y); with "
                f"--diloco_workers 1, DiLoCo's single-worker {DEFAULT_OUTER_LR} in its place."
            )
        },
    )
    diloco_outer_dtype: str = field(
        default="float32",
        metadata={
            "help": (
                "With --diloco_distributed or --gpa_distributed and more than one worker: the dtype the "
                "pseudo-gradients cross the workers "
                "in at each outer step: float32 (as they are), bfloat16 (half the bytes) or int8 (a float32 scale per "
                "block of 256 elements: about a quarter), the compressed ones with error feedback (each worker keeps "
                "what compression lost and adds it to its next pseudo-gradient). Each fragment needs at least 256 "
                "elements for int8."
            ),
            "choices": OUTER_DTYPES,
        },
    )
    diloco_overlap_steps: int = field(
        default=0,
        metadata={
            "help": (
                "With --diloco_distributed or --gpa_distributed, more than one worker and --diloco_fragments P > 1: "
                "tau, the inner steps a fragment's outer all-reduce runs in the background (streaming DiLoCo's "
                "overlap): its outer update is applied tau inner steps after it is due. 0 (default): each outer sync "
                "blocks the step that takes it. Must be below H // P (--diloco_inner_steps or --gpa_sync_steps, "
                "// --diloco_fragments); float32 --diloco_outer_dtype only."
            )
        },
    )
    diloco_overlap_alpha: float = field(
        default=0.0,
        metadata={
            "help": (
                "With --diloco_overlap_steps > 0: alpha in [0, 1], the weight of the inner weights that moved on "
                "during an overlapped sync when the new restart point (DiLoCo's outer weights, GPA's y) is mixed in "
                "(inner <- alpha inner + (1 - alpha) outer). 0 (default): replaced by it."
            )
        },
    )
    gpa_bn_recalibration_batches: int = field(
        default=DEFAULT_RECALIBRATION_BATCHES,
        metadata={
            "help": (
                "Training batches forwarded at x (no gradients) to recompute the running statistics of BatchNorm "
                "and other norm layers that keep them, wherever GPATrainer evaluates or saves at x (the statistics "
                "of y are restored for training). Models without such layers pay nothing. 0 turns it off."
            )
        },
    )

    gpa_step_in_backward: bool = field(
        default=False,
        metadata={
            "help": (
                "Step each parameter inside backward as soon as its gradient is complete, and free the gradient "
                "(hf_gpa.optim.step_in_backward): no full set of gradients is held, so GPA-AdamW needs AdamW's "
                "memory. Same numbers as the ordinary step. With --optim gpa_adamw only, on one process, with "
                "--gradient_accumulation_steps 1 and --max_grad_norm 0; not with --fp16 or DeepSpeed."
            )
        },
    )

    def __post_init__(self) -> None:
        # Validate our flags first: a wrong flag should fail before anything else happens.
        self.gpa_bn_recalibration_batches = check_recalibration_batches(self.gpa_bn_recalibration_batches)
        optim = optim_value(self.optim)
        if optim not in GPA_OPTIM_NAMES and optim not in STOCK_OPTIM_NAMES:
            raise ValueError(
                f"--optim {optim!r} is not a known optimizer: use one of {', '.join(GPA_OPTIM_NAMES)} or a stock "
                f"transformers name ({', '.join(STOCK_OPTIM_NAMES)})"
            )
        self._check_step_in_backward(optim)
        self._check_gpa_flags(optim)
        self._refuse_deepspeed(optim)
        if self.across_workers:
            self._refuse_dispatched_batches()
        # transformers sets up the device here, and under a launch (and, with accelerate 1.10, for WORLD_SIZE > 1
        # alone) the process group: every refusal above comes before it.
        with self._stock_name_inside(optim):
            super().__post_init__()
        if self.across_workers:
            self.accelerator_config.dispatch_batches = False
            # The loss's token count is taken over the worker's island (GPATrainer), not all-gathered over every
            # process at every step, which would hold every worker to the slowest one between outer steps.
            self.average_tokens_across_devices = False
        self._warn_constant_schedule(optim)

    @property
    def across_workers(self) -> str | None:
        """The flag that runs the optimizer across the processes as workers (``--diloco_distributed`` for DiLoCo,
        ``--gpa_distributed`` for GPA), None when neither is set."""
        if self.diloco_distributed is True:
            return "--diloco_distributed"
        if self.gpa_distributed is True:
            return "--gpa_distributed"
        return None

    def _refuse_dispatched_batches(self) -> None:
        """With DiLoCo across the processes, every process reads its own batches: accelerate's default for an
        iterable dataset, one process reading and sending every batch to the others, would cross the workers at
        every step, which is what DiLoCo exists to avoid. Read from --accelerator_config as given (an
        ``AcceleratorConfig``, a dict, a JSON string or a JSON file), before transformers parses it."""
        config = self.accelerator_config
        if isinstance(config, str):
            text = config.strip()
            if not text.startswith("{"):
                with open(config, encoding="utf-8") as file:
                    text = file.read()
            config = json.loads(text)
        dispatch = (
            config.get("dispatch_batches") if isinstance(config, dict) else getattr(config, "dispatch_batches", None)
        )
        if dispatch:
            raise ValueError(
                f"{self.across_workers} true cannot run with --accelerator_config dispatch_batches=true: the first "
                "process would send every batch to all the others at every step, across the workers; leave "
                "dispatch_batches unset (each process then reads its own batches)"
            )

    def _warn_constant_schedule(self, optim: str) -> None:
        """GPA's exponential average needs a decaying lr: with a constant one x lags y to the end (warned, not refused:
        a short constant-lr probe is legitimate). Schedule-Free averaging is made for a constant lr: with a decaying
        one its weights lr_t^2 / sum lr_i^2 freeze x as the lr falls (warned too)."""
        import warnings  # here, not at the top: the one user in this file

        schedule = str(getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type))  # a SchedulerType member
        averages = optim in FLAG_READERS["gpa_averaging"] and self.gpa_averaging == "gpa"
        if averages and schedule in ("constant", "constant_with_warmup"):  # the lr never decays
            warnings.warn(
                f"--optim {optim} with --lr_scheduler_type {schedule}: GPA's evaluation weights x average the last "
                "~1 / (1 - mu_x) steps and only reach the training weights' quality when the lr decays; use "
                "--lr_scheduler_type cosine (the paper's recipe, with --warmup_steps 0.1), or --gpa_averaging "
                "schedule_free for a constant lr",
                UserWarning,
                stacklevel=2,
            )
        free = optim in FLAG_READERS["gpa_averaging"] and self.gpa_averaging == "schedule_free"
        if free and schedule not in ("constant", "constant_with_warmup"):  # the lr decays
            warnings.warn(
                f"--optim {optim} --gpa_averaging schedule_free with --lr_scheduler_type {schedule}: Schedule-Free "
                "is made for a constant lr (it replaces the schedule), and its average weighs each step by lr_t^2, so "
                "as this schedule decays the lr, x stops following z (schedulefree's package keeps the peak lr's "
                "weight instead); use --lr_scheduler_type constant_with_warmup (with --warmup_steps), or "
                "--gpa_averaging gpa for a decaying schedule",
                UserWarning,
                stacklevel=2,
            )

    @contextlib.contextmanager
    def _stock_name_inside(self, optim: str) -> Iterator[str | OptimizerNames]:
        """Inside, ``self.optim`` is a stock name, the one yielded; on exit (also by an exception) it is ``optim``'s
        enum member.

        The one place where hf_gpa's names meet transformers' code that converts ``optim`` with
        ``OptimizerNames(...)`` (`__post_init__`, `set_optimizer`): it is handed a stock name, and the object never
        keeps a name the user did not give.
        """
        if optim not in HF_GPA_OPTIMIZERS:
            yield optim
            return
        self.optim = OptimizerNames.ADAMW_TORCH
        try:
            yield self.optim
        finally:
            self.optim = GPAOptimizerNames(optim)

    # ---- composing with other TrainingArguments subclasses (TRL's configs, Seq2SeqTrainingArguments) ----

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Let ``class C(GPATrainingArguments, SFTConfig)`` keep the defaults SFTConfig redeclares.

        `dataclasses` collects fields base by base in reverse MRO order, and every dataclass carries all fields it
        inherited: the stock `TrainingArguments` fields that GPATrainingArguments inherits would be collected after
        SFTConfig's and reset, e.g., its learning rate to the stock default. Each field is therefore declared
        again on the new class, taken from the class that comes first in the MRO, as Python's attribute lookup
        would do; the class's own declarations still win, and the field order is unchanged.
        """
        super().__init_subclass__(**kwargs)
        own = inspect.get_annotations(cls)
        collected: dict[str, dataclasses.Field] = {}
        for base in reversed(cls.__mro__[1:]):
            collected.update(getattr(base, "__dataclass_fields__", {}))
        redeclared: dict[str, dataclasses.Field] = {}
        for name, collected_field in collected.items():
            if name in own:
                continue
            declarer = next((b for b in cls.__mro__[1:] if name in inspect.get_annotations(b)), None)
            first = getattr(declarer, "__dataclass_fields__", {}).get(name)
            if first is not None and first is not collected_field:
                redeclared[name] = first
        if not redeclared:
            return
        annotations = dict(own)
        for name, first in redeclared.items():
            annotations[name] = first.type
            setattr(cls, name, _copy_field(first))
        cls.__annotations__ = annotations

    # ---- DeepSpeed: refused before any work starts ----

    @property
    def _deepspeed_route(self) -> str | None:
        """How DeepSpeed was asked for (``--deepspeed`` or accelerate's plugin), None where it was not; the one
        reading of ``ACCELERATE_USE_DEEPSPEED``."""
        if self.deepspeed:
            return f"--deepspeed {self.deepspeed!r}" if isinstance(self.deepspeed, str) else "--deepspeed (a dict)"
        if strtobool(os.environ.get("ACCELERATE_USE_DEEPSPEED", "false")):
            return "ACCELERATE_USE_DEEPSPEED=true (accelerate's DeepSpeed plugin)"
        return None

    @property
    def _uses_fsdp(self) -> bool:
        """FSDP asked for by ``--fsdp`` or accelerate's plugin (``ACCELERATE_USE_FSDP``)."""
        return bool(self.fsdp) or strtobool(os.environ.get("ACCELERATE_USE_FSDP", "false"))

    def _refuse_deepspeed(self, optim: str) -> None:
        """DeepSpeed hides the parameters from a GPA optimizer: refuse the combination, without importing it."""
        if optim not in GPA_OPTIM_NAMES or not HF_GPA_OPTIMIZERS[optim].evaluation_weights:
            return
        route = self._deepspeed_route
        if route is not None:
            raise deepspeed_refusal(f"--optim {optim}", route)

    def _check_step_in_backward(self, optim: str) -> None:
        """--gpa_step_in_backward: refuse, by name and with the reason, every setting it cannot honour."""
        if not isinstance(self.gpa_step_in_backward, bool):
            raise ValueError(f"Invalid --gpa_step_in_backward: {self.gpa_step_in_backward!r} (true or false)")
        if not self.gpa_step_in_backward:
            return
        refusals = []
        readers = FLAG_READERS["gpa_step_in_backward"]  # the table's --optim names with a per-parameter step
        if optim not in readers:
            refusals.append(
                f"--optim {optim}: only --optim {' or '.join(readers)} steps one parameter at a time (GPA around a "
                "base optimizer, DiLoCo and the stock optimizers step all their tensors at once)"
            )
        if self.gradient_accumulation_steps != 1:
            refusals.append(
                f"--gradient_accumulation_steps {self.gradient_accumulation_steps}: every backward is a step, so "
                "gradients cannot be accumulated; use --gradient_accumulation_steps 1 with a larger batch"
            )
        if self.max_grad_norm and self.max_grad_norm > 0:
            refusals.append(
                f"--max_grad_norm {self.max_grad_norm} (the Trainer's default is 1.0): the global gradient norm is "
                "known only after the last gradient, when every other parameter has already stepped; pass "
                "--max_grad_norm 0 (the norm is still logged)"
            )
        if self.fp16:
            refusals.append(
                "--fp16: its loss scaling skips a step whose gradients overflow, which is known only after every "
                "parameter has stepped; use --bf16"
            )
        if self._deepspeed_route is not None:
            refusals.append("DeepSpeed: it owns the gradients and the optimizer step")
        if self._uses_fsdp:
            refusals.append("FSDP: it reduces the gradients after the hooks that would step them have run")
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size > 1:
            refusals.append(
                f"{world_size} processes (WORLD_SIZE): DDP all-reduces the gradients after the hooks that would step "
                "them have run, and keeps its own gradient buckets, a full set of gradients, whatever the step does "
                "(so there would be no memory to save); run on one process"
            )
        kwargs = self.gradient_checkpointing_kwargs or {}
        if isinstance(kwargs, str):  # a JSON string from the command line (the stock __post_init__ parses it later)
            with contextlib.suppress(ValueError):
                kwargs = json.loads(kwargs)
        if self.gradient_checkpointing and isinstance(kwargs, dict) and kwargs.get("use_reentrant"):
            refusals.append(
                "--gradient_checkpointing with use_reentrant=True: its nested backward passes would split one "
                "training step; use the default use_reentrant=False"
            )
        if refusals:
            raise ValueError("--gpa_step_in_backward cannot run with " + "; ".join(refusals) + ".")

    def _check_gpa_flags(self, optim: str) -> None:
        given = {flag: getattr(self, flag) for flag in FLAG_READERS}
        # The stock flags every optimizer reads, checked here too: a bad one fails now, not after data loading.
        check_lr(self.learning_rate, "--learning_rate")
        check_weight_decay(self.weight_decay, "--weight_decay")
        if optim == "gpa":
            if self.gpa_base_optim is None:
                raise ValueError(
                    "--optim gpa needs --gpa_base_optim NAME (a stock --optim name such as adamw_torch or sgd)"
                )
            self.gpa_base_optim = check_base_optim(optim_value(self.gpa_base_optim))
        if reads_adam_flags(optim, self.gpa_base_optim):
            self._check_adam_flags()

        self.gpa_averaging = check_averaging(self.gpa_averaging, "--gpa_averaging")
        if not isinstance(self.gpa_distributed, bool):
            raise ValueError(f"Invalid --gpa_distributed: {self.gpa_distributed!r} (true or false)")
        if self.gpa_distributed and optim == "gpa_adamw":
            self._check_gpa_across_workers()
        elif self.gpa_averaging == "schedule_free":
            # Schedule-Free's average has no constant: a given mu_x or H would be silently ignored.
            for flag in ("gpa_mu_x", "gpa_inner_steps"):
                if getattr(self, flag) is not None:
                    raise ValueError(
                        f"--{flag} {getattr(self, flag)} does not apply with --gpa_averaging schedule_free (its "
                        "average weights each step by lr**2 and has no averaging constant); leave it out"
                    )
        elif self.gpa_inner_steps is not None:
            self.gpa_inner_steps = check_inner_steps(self.gpa_inner_steps, "--gpa_inner_steps")
            mu_x = mu_x_from_inner_steps(self.gpa_inner_steps, DEFAULT_OUTER_MOMENTUM)
            if not mu_x < 1.0:
                # In floating point 0.9 ** (1 / H) is 1.0 for H beyond about 10**15: x would never move.
                raise ValueError(
                    f"Invalid --gpa_inner_steps: {self.gpa_inner_steps} (mu_x = {DEFAULT_OUTER_MOMENTUM} ** (1 / H) "
                    f"rounds to {mu_x!r}, outside [0, 1) where x never moves; use a smaller H)"
                )
            # Both flags are fine when they agree: a saved configuration carries both.
            if self.gpa_mu_x is not None:
                given_mu_x = check_mu_x(self.gpa_mu_x, "--gpa_mu_x")
                if not math.isclose(given_mu_x, mu_x, rel_tol=0.0, abs_tol=1e-12):
                    raise ValueError(
                        f"--gpa_inner_steps {self.gpa_inner_steps} sets mu_x = {DEFAULT_OUTER_MOMENTUM} ** "
                        f"(1 / {self.gpa_inner_steps}) = {mu_x!r}, which conflicts with --gpa_mu_x {self.gpa_mu_x}; "
                        "give only one of the two"
                    )
            self.gpa_mu_x = mu_x
        else:
            self.gpa_mu_x = check_mu_x(DEFAULT_MU_X if self.gpa_mu_x is None else self.gpa_mu_x, "--gpa_mu_x")
        if not (self.gpa_distributed and optim == "gpa_adamw"):
            self.gpa_mu_y = check_mu_y(self.gpa_mu_y, "--gpa_mu_y")

        self.diloco_inner_steps = check_inner_steps(self.diloco_inner_steps, "--diloco_inner_steps")
        if self.diloco_outer_lr is None:
            across = self.diloco_distributed is True and optim in FLAG_READERS["diloco_distributed"]
            self.diloco_outer_lr = default_outer_lr(self.diloco_workers if across else 1)
        self.diloco_outer_lr = check_outer_lr(self.diloco_outer_lr, "--diloco_outer_lr")
        self.diloco_outer_momentum = check_outer_momentum(self.diloco_outer_momentum, "--diloco_outer_momentum")
        self._refuse_unused_flags(optim, given)
        check_workers_flags(self)

    def _check_gpa_across_workers(self) -> None:
        """--optim gpa_adamw --gpa_distributed: GPA's flags as the outer step of `GPADiLoCo` reads them (mu_x and mu_y
        per outer step, H from --gpa_sync_steps, the outer lr), each checked against its range by name."""
        if self.diloco_distributed is True:
            raise ValueError(
                "--gpa_distributed true cannot run with --diloco_distributed true: each runs the optimizer across "
                "the processes, GPA's outer step (--optim gpa_adamw --gpa_distributed) or DiLoCo's Nesterov step "
                "(--optim diloco_adamw --diloco_distributed); give one of the two"
            )
        refused = [
            f"--{flag} {getattr(self, flag)} ({why})"
            for flag, why in (
                ("gpa_averaging", "x is averaged once per outer step with --gpa_mu_x; leave it at gpa"),
                ("gpa_inner_steps", "it sets a per-step mu_x; H between synchronisations is --gpa_sync_steps"),
            )
            if getattr(self, flag) not in (None, DEFAULT_AVERAGING)
        ]
        if refused:
            raise ValueError("--gpa_distributed true cannot run with " + "; ".join(refused) + ".")
        self.gpa_mu_x = check_mu_x(DEFAULT_GPA_DILOCO_MU if self.gpa_mu_x is None else self.gpa_mu_x, "--gpa_mu_x")
        self.gpa_mu_y = check_outer_mu_y(self.gpa_mu_y, "--gpa_mu_y")
        self.gpa_sync_steps = check_inner_steps(self.gpa_sync_steps, "--gpa_sync_steps")
        if self.gpa_outer_lr is None:
            self.gpa_outer_lr = default_gpa_outer_lr(self.diloco_workers, self.gpa_mu_x, self.gpa_mu_y)
        self.gpa_outer_lr = check_outer_lr(self.gpa_outer_lr, "--gpa_outer_lr")

    @property
    def diloco_island_shards(self) -> bool:
        """True when each DiLoCo worker's island is sharded by FSDP2 (``--diloco_distributed true`` under FSDP: a
        (M, W / M) ("worker", "shard") mesh, the model sharded over "shard"); the arguments were checked for it."""
        return self.diloco_distributed is True and self._uses_fsdp

    def _check_adam_flags(self) -> None:
        """AdamW's flags, checked as the optimizer checks them, where the chosen --optim reads them (an optimizer
        that ignores them, as the stock Trainer's Adafactor or SGD, leaves them unchecked)."""
        try:
            check_betas((self.adam_beta1, self.adam_beta2), "--adam_beta1/--adam_beta2")
        except ValueError as error:
            raise ValueError(f"--adam_beta1 {self.adam_beta1} / --adam_beta2 {self.adam_beta2}: {error}") from None
        check_eps(self.adam_epsilon, "--adam_epsilon")

    def _refuse_unused_flags(self, optim: str, given: dict[str, Any]) -> None:
        """A flag set away from its default that ``--optim optim`` does not read is an error, not silently ignored."""
        defaults = {name: f.default for name, f in self.__dataclass_fields__.items() if name in FLAG_READERS}
        # The values an unset --gpa_mu_x or --diloco_outer_lr takes (a saved configuration has them).
        defaults_too = {
            "gpa_mu_x": (DEFAULT_MU_X,),
            "diloco_outer_lr": (DEFAULT_OUTER_LR, DEFAULT_OUTER_LR_ACROSS_WORKERS),
        }
        for flag in unused_flags(optim):
            value = optim_value(given[flag])
            if value == defaults[flag] or value in defaults_too.get(flag, ()):
                continue
            readers = FLAG_READERS[flag]
            raise ValueError(
                f"--{flag} {value} only applies to --optim {' or '.join(readers)} (got --optim {optim}), which "
                f"{'reads' if len(readers) == 1 else 'read'} it; --optim {optim} would ignore it. Leave it out, or "
                f"choose --optim {readers[0] if len(readers) == 1 else 'one of ' + ', '.join(readers)}."
            )

    def set_optimizer(
        self,
        name: str | OptimizerNames | GPAOptimizerNames = "adamw_torch",
        learning_rate: float = 5e-5,
        weight_decay: float = 0,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        args: str | None = None,
    ) -> GPATrainingArguments:
        """`TrainingArguments.set_optimizer` that also takes gpa_adamw, gpa and diloco_adamw, and checks the flags.

        A name or flag it rejects leaves the arguments exactly as they were.
        """
        value = optim_value(name)
        before = dict(self.__dict__)
        try:
            with self._stock_name_inside(value) as stock_name:
                super().set_optimizer(stock_name, learning_rate, weight_decay, beta1, beta2, epsilon, args)
            self._check_gpa_flags(value)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise
        return self

    @property
    def uses_gpa(self) -> bool:
        """True when `--optim` is one of hf_gpa's optimizers with evaluation weights x (all but muon)."""
        return isinstance(self.optim, GPAOptimizerNames) and HF_GPA_OPTIMIZERS[self.optim.value].evaluation_weights

    @property
    def gpa_effective_inner_steps(self) -> float | None:
        """H with mu_x = 0.9 ** (1 / H): the DiLoCo inner steps GPA's averaging matches (None when mu_x = 0, with
        schedule_free averaging, and with --gpa_distributed, whose mu_x acts once per outer step)."""
        if self.gpa_distributed is True:
            return None
        if self.gpa_inner_steps is not None:
            return float(self.gpa_inner_steps)
        if self.gpa_mu_x is None or not 0.0 < self.gpa_mu_x < 1.0:  # None: schedule_free, which has no mu_x
            return None
        return inner_steps_from_mu_x(self.gpa_mu_x, DEFAULT_OUTER_MOMENTUM)


def _copy_field(original: dataclasses.Field) -> Any:
    """A new `dataclasses.field` with the same default and settings (a Field may belong to one class only)."""
    return field(
        default=original.default,
        default_factory=original.default_factory,
        init=original.init,
        repr=original.repr,
        hash=original.hash,
        compare=original.compare,
        metadata=original.metadata,
        kw_only=original.kw_only,
    )
