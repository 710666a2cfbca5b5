"""`GPATrainer`: the transformers `Trainer` with GPA's two weight sequences handled where the Trainer touches weights.

GPA keeps the gradient point y in the parameters while training and computes the evaluation weights x on demand
(`optimizer.eval()`; `optimizer.train()` goes back to y bitwise). The stock Trainer already calls
`optimizer.train()` before every training step and `optimizer.eval()` in its evaluation loop (for Schedule-Free),
but it never switches back after evaluating, and it saves whatever the parameters hold: y, unless an evaluation
happened to run just before the save. This subclass fixes the places that read or write weights:

* `evaluate()` / `predict()` run at x and restore the mode they found, so training continues from the same y.
  They, and every save, also leave the global random generators as they found them (an evaluation's DataLoader
  draws a seed from torch's), so training draws the same dropout masks and shuffles with or without them.
* `_save_checkpoint()` and `save_model()` run at x: every `model.safetensors` holds x, and `optimizer.pt` is the
  eval-mode state, which carries the integer residual that restores y exactly. The switch sits in try/finally, so
  the live weights are y again even when the save raises half-way.
* `_load_optimizer_and_scheduler()` (resume) loads x weights and the eval-mode state, then calls `train()`: y is
  back bitwise and the resumed run matches the uninterrupted one.
* `_load_best_model()` loads the best checkpoint's x together with its optimizer state and scheduler (through the
  Trainer's own loader, as a resume does), so the two agree.
* When training ends, the model holds x (the weights to use) before any `on_train_end` callback runs, so that
  logging integrations that save or upload the model there (W&B with `WANDB_LOG_MODEL=end`, DVCLive with
  `log_model=True`) get x: with a GPA optimizer, `GPATrainer` puts its own callback right after the stock
  `DefaultFlowCallback` (which does nothing at the end of training), ahead of every other one. The next training
  step switches back to y.
* A model with BatchNorm (or another norm layer with running statistics) gets them recomputed at x from
  `--gpa_bn_recalibration_batches` training batches wherever it is at x (`hf_gpa.batchnorm`), so evaluations and
  every saved model use x's statistics (`hf_gpa.batchnorm.NormStatisticsAtX` holds y's); y's are put back with y,
  bitwise, and a checkpoint keeps them beside the optimizer state (`norm_statistics_y.safetensors`) for an exact
  resume.
* The model card names the optimizer and its constants (`hf_gpa.model_card`).
* DiLoCo and GPA across the processes (``--diloco_distributed``, ``--gpa_distributed``): `_wrap_model()` gives the
  model a DDP over its worker's island of processes only (under the FSDP2 config, the model is sharded by FSDP2 over
  the island instead, before the optimizer is built), every process saves and resumes its own worker's optimizer
  state, a checkpoint saved on another layout is refused before training, and the last step synchronises every step
  since the last outer step before the last evaluation and save: the hooks of `hf_gpa.workers.DiLoCoWorkersMixin`,
  which this class composes.

Only overrides; transformers and accelerate are not patched. With a stock `--optim` it behaves as `Trainer`, with
the same callbacks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import DefaultFlowCallback, Trainer, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME
from transformers.trainer_utils import HubStrategy
from transformers.training_args import TrainingArguments
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    is_datasets_available,
)

from hf_gpa.batchnorm import DEFAULT_RECALIBRATION_BATCHES, NormStatisticsAtX, count_over_processes, norm_layers
from hf_gpa.checkpoint import evaluation_weights, random_state_kept, unwrap_gpa_optimizer
from hf_gpa.model_card import (
    complete_model_card,
    evaluation_results,
    gpa_model_card_section,
    gpa_optimizer_args,
    gpa_run_summary,
    task_and_dataset,
    with_gpa_tags,
)
from hf_gpa.optim import (
    StepInBackward,
    TrainEvalOptimizer,
    saved_optimizer_name,
    step_in_backward,
)
from hf_gpa.optim_table import GPAOptimizerNames, optim_that_saved, optimizer_cls_and_kwargs
from hf_gpa.training_args import deepspeed_refusal
from hf_gpa.workers import DiLoCoWorkersMixin

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.trainer_utils import PredictionOutput, TrainOutput

__all__ = ["EvaluationWeightsAtTrainEnd", "GPATrainer", "NORM_STATISTICS_Y_NAME"]

logger = logging.getLogger(__name__)

#: In a checkpoint, beside optimizer.pt: the norm layers' running statistics of y (model.safetensors has x's).
NORM_STATISTICS_Y_NAME = "norm_statistics_y.safetensors"

#: The files the stock `_load_best_model` loads a checkpoint's weights from (without FSDP or DeepSpeed); where none
#: is on this node's disk it keeps the last weights and only warns.
_MODEL_WEIGHTS_NAMES = (
    WEIGHTS_NAME,
    SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    ADAPTER_SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
)


def _refuse_gpa_state_for_stock_optimizer(checkpoint: str, args: TrainingArguments) -> None:
    """Raise when a stock ``--optim`` is about to resume a checkpoint whose optimizer state an hf_gpa optimizer wrote.

    torch's optimizers would load it without a word, keeping GPA's z (and residual) as stale entries and its group
    hyper-parameters over the new ones; the weights in the checkpoint are GPA's x, not the y it trained at.
    """
    optimizer_file = os.path.join(checkpoint, OPTIMIZER_NAME)
    if not os.path.isfile(optimizer_file):
        return
    # mmap: only the param groups are read, not the (possibly large) state tensors.
    saved = saved_optimizer_name(torch.load(optimizer_file, map_location="cpu", weights_only=True, mmap=True))
    if saved is not None:
        optim = getattr(args.optim, "value", args.optim)
        raise ValueError(
            f"{optimizer_file} was written by hf_gpa's {saved}, which --optim {optim} cannot resume (its state holds "
            "GPA's z and the weights beside it are the averaged x). Resume with the hf_gpa optimizer that wrote it "
            f"(e.g. --optim {optim_that_saved(saved)}), or start a new run from the checkpoint's weights "
            "(--model_name_or_path / from_pretrained) without resume_from_checkpoint."
        )


class EvaluationWeightsAtTrainEnd(TrainerCallback):
    """Puts the trainer's model at x (with x's norm statistics) in ``on_train_end``; a DiLoCo or GPA-across-workers
    optimizer synchronises every step since its last outer step after the last step, before that step's evaluation
    and save (or at the end of a run stopped early: `DiLoCoWorkersMixin.synchronize_outer`). `GPATrainer` adds it,
    with a GPA optimizer only, right after `DefaultFlowCallback`, ahead of every other callback."""

    def __init__(self, trainer: GPATrainer) -> None:
        self._trainer = weakref.ref(trainer)  # no reference cycle: the trainer holds this callback

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer.synchronize_outer(end=False)

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None and state.global_step >= state.max_steps:
            trainer.synchronize_outer(end=True)

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer.synchronize_outer(end=True)
            trainer._hold_x()


class GPATrainer(DiLoCoWorkersMixin, Trainer):
    """`Trainer` that builds the hf_gpa optimizers from `GPATrainingArguments` and evaluates and saves at x.

    Use it in place of `Trainer` together with `GPATrainingArguments`; with a stock `--optim` (or plain
    `TrainingArguments`) it is the stock Trainer.

    It is also a cooperative mixin for any `Trainer` subclass: every override takes ``*args, **kwargs`` and passes
    them on to the next class in the MRO unchanged, so ``class MyTrainer(GPATrainer, SFTTrainer)`` (TRL's trainers,
    `Seq2SeqTrainer`, your own) keeps that class's signatures and behaviour and adds GPA's evaluation at x.
    """

    @classmethod
    def get_optimizer_cls_and_kwargs(
        cls, args: TrainingArguments, model: PreTrainedModel | nn.Module | None = None, *more: Any, **kwargs: Any
    ) -> tuple[Any, dict[str, Any]]:
        """The optimizer class and keyword arguments for ``args.optim`` (hf_gpa names first, then the next class's)."""
        if not isinstance(getattr(args, "optim", None), GPAOptimizerNames):
            return super().get_optimizer_cls_and_kwargs(args, model, *more, **kwargs)
        return optimizer_cls_and_kwargs(args, model)

    # ---- the weights x and their norm statistics ----

    @property
    def _norm_statistics(self) -> NormStatisticsAtX:
        """The holder of y's norm statistics while the model's buffers hold x's (one per model: a `model_init` run
        gets a new one)."""
        held = self.__dict__.get("_norm_statistics_of_model")
        if held is None or held.model is not self.model:
            held = self._norm_statistics_of_model = NormStatisticsAtX(self.model)
        return held

    @contextlib.contextmanager
    def _at_x(self) -> Iterator[None]:
        """Inside: parameters at x with x's norm statistics; on exit (also by an exception) y and y's statistics, and
        the global random generators as they were on entry.

        The switch of weights is `evaluation_weights`'s, a no-op when the optimizer has no x/y split or is already at
        x (after `train()`). Whatever runs inside (an evaluation's DataLoader seeds itself from torch's generator)
        leaves training's random draws (dropout masks, shuffles, augmentation) as they would be without it, with
        any optimizer.
        """
        with random_state_kept(self.args.device), evaluation_weights(self.optimizer) as switched:
            if not switched:
                yield
                return
            try:
                self._norm_statistics_to_x()
                yield
            finally:
                self._norm_statistics.to_y()

    def _hold_x(self) -> None:
        """Leave the model at x with x's norm statistics (until the next training step switches back to y)."""
        inner = unwrap_gpa_optimizer(self.optimizer)
        if inner is not None:
            inner.eval()
            self._norm_statistics_to_x()

    def _norm_statistics_to_x(self) -> None:
        # With the parameters at x: recompute the statistics, keeping y's to put back. Costs nothing without norm
        # layers that keep running statistics, with --gpa_bn_recalibration_batches 0 or without a train dataset.
        num_batches = getattr(self.args, "gpa_bn_recalibration_batches", DEFAULT_RECALIBRATION_BATCHES)
        if num_batches == 0 or self.train_dataset is None or not norm_layers(self.model):
            return  # the same on every rank
        # Whether x's statistics are still to be computed is a fact of this rank: after load_best_model_at_end it
        # depends on the files on this node's disk. Count it over the ranks first, so that the recalibration's
        # all_reduce runs on every rank or on none.
        distributed = self.args.world_size > 1
        needed = not self._norm_statistics.at_x
        ranks_needing = count_over_processes(needed, self.args.device) if distributed else int(needed)
        if not needed:
            return
        # Every rank forwards its own batches and the statistics are then averaged over the ranks (all_reduce): the
        # same values on every rank, estimated from world_size times as many batches. Where only some ranks need
        # them, the ranks hold different models (the best checkpoint was not on every node): each its own.
        all_reduce = distributed and ranks_needing == self.args.world_size
        if distributed and not all_reduce:
            logger.warning(
                "Only %d of %d processes hold no norm statistics at x (the best checkpoint's %s is missing on some "
                "nodes): this process recomputes them from its own batches only.",
                ranks_needing,
                self.args.world_size,
                NORM_STATISTICS_Y_NAME,
            )
        used = self._norm_statistics.to_x(
            _recalibration_dataloader(self),
            num_batches,
            forward=functools.partial(_recalibration_forward, self),
            all_reduce=all_reduce,
            seed=self.args.seed + self.args.process_index,
        )
        logger.info("Norm-layer running statistics recomputed at x from %d training batches", used)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The next class's `training_step`; y's norm statistics come back first if x's were left in place. With
        ``--gpa_step_in_backward`` the optimizer steps inside its backward (`_hook_step_in_backward`)."""
        self._norm_statistics.to_y()
        if getattr(self.args, "gpa_step_in_backward", False):
            self._hook_step_in_backward()
        return super().training_step(*args, **kwargs)

    # ---- --gpa_step_in_backward: the step inside backward, gradients freed as they are used ----

    #: The hooks that step the optimizer inside backward while training with --gpa_step_in_backward, else None.
    _step_in_backward: StepInBackward | None = None

    def _hook_step_in_backward(self) -> None:
        """Put the hooks on the optimizer the Trainer steps (once per `train()`): every parameter then steps in the
        backward of `training_step`, and the Trainer's own ``optimizer.step()``/``zero_grad()`` find no gradients
        left. The scheduler, logging, evaluation at x and checkpoints are the Trainer's, unchanged."""
        inner = unwrap_gpa_optimizer(self.optimizer)
        handle = self._step_in_backward
        if handle is not None and handle.active and handle.optimizer is inner:
            return
        if handle is not None:
            handle.remove()
        if self.args.n_gpu > 1 or self.args.world_size > 1:
            # The arguments refuse WORLD_SIZE > 1; this catches DataParallel over several GPUs of one process.
            raise ValueError(
                f"--gpa_step_in_backward runs on one process and one device (got {self.args.n_gpu} GPUs, world size "
                f"{self.args.world_size}): data-parallel wrappers reduce the gradients after the hooks that would "
                "step them have run"
            )
        if inner is None:
            raise ValueError(
                f"--gpa_step_in_backward needs an hf_gpa optimizer with a per-parameter step (--optim gpa_adamw), got "
                f"{type(self.optimizer).__name__}"
            )
        self._step_in_backward = step_in_backward(inner, track_grad_norm=True)

    def _get_grad_norm(self, *args: Any, **kwargs: Any) -> Any:
        # In backward the gradients are gone before the Trainer measures them: the hooks measured them on the way.
        handle = self._step_in_backward
        if handle is not None and handle.active:
            return handle.grad_norm
        return super()._get_grad_norm(*args, **kwargs)

    # ---- wrappers that hide the real parameters from the optimizer: refused before any step ----

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The arguments refuse --deepspeed and ACCELERATE_USE_DEEPSPEED; this catches DeepSpeed enabled any other
        # way (an accelerate plugin, stock TrainingArguments with a GPA optimizer passed in directly).
        if getattr(self, "is_deepspeed_enabled", False) and self._uses_gpa_optimizer():
            raise deepspeed_refusal("A GPA optimizer", "DeepSpeed")
        self._add_evaluation_weights_callback()

    #: The callback that puts x in place at the end of training, once added (with a GPA optimizer only).
    _evaluation_weights_callback: EvaluationWeightsAtTrainEnd | None = None

    def _add_evaluation_weights_callback(self) -> None:
        """With a GPA optimizer, add `EvaluationWeightsAtTrainEnd` once, right after the stock `DefaultFlowCallback`
        (``callbacks[0]``, which has no ``on_train_end``): the callback handler calls the list in order, so every
        other callback's ``on_train_end`` (integrations, the user's, those added later, which are appended) sees x.
        With a stock optimizer the list stays the stock Trainer's. Called when the optimizer may have become known:
        at construction (``--optim``, ``optimizers=``, ``optimizer_cls_and_kwargs=``) and once it is created."""
        handler = getattr(self, "callback_handler", None)
        if handler is None or self._evaluation_weights_callback is not None or not self._uses_gpa_optimizer():
            return
        callbacks = handler.callbacks
        position = 1 if callbacks and isinstance(callbacks[0], DefaultFlowCallback) else 0
        self._evaluation_weights_callback = EvaluationWeightsAtTrainEnd(self)
        callbacks.insert(position, self._evaluation_weights_callback)

    def _uses_gpa_optimizer(self) -> bool:
        given = getattr(self, "optimizer_cls_and_kwargs", None)
        return (
            getattr(self.args, "uses_gpa", False)
            or unwrap_gpa_optimizer(self.optimizer) is not None
            or (given is not None and isinstance(given[0], type) and issubclass(given[0], TrainEvalOptimizer))
        )

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = super().create_optimizer(*args, **kwargs)
        self._add_evaluation_weights_callback()
        return optimizer

    def create_scheduler(self, *args: Any, **kwargs: Any) -> Any:
        # The Trainer creates the scheduler once the optimizer is final (after accelerator.prepare and any
        # wrapping) and before the first step: the place to check what the GPA optimizer actually steps, and to
        # catch one that a subclass's create_optimizer built without the method above.
        self._refuse_hidden_parameters()
        self._add_evaluation_weights_callback()
        return super().create_scheduler(*args, **kwargs)

    def _refuse_hidden_parameters(self) -> None:
        inner = unwrap_gpa_optimizer(self.optimizer)
        if inner is None:
            return
        wrapper = self.optimizer
        while wrapper is not None and wrapper is not inner:
            if type(wrapper).__module__.split(".")[0] == "deepspeed":
                raise deepspeed_refusal("The GPA optimizer", f"DeepSpeed's {type(wrapper).__name__}, which wraps it")
            wrapper = getattr(wrapper, "optimizer", None)
        models = [self.model, getattr(self, "model_wrapped", None), *getattr(self.accelerator, "_models", [])]
        model_params = {id(p) for m in models if isinstance(m, nn.Module) for p in m.parameters()}
        hidden = sum(id(p) not in model_params for group in inner.param_groups for p in group["params"])
        if hidden:
            raise ValueError(
                f"The GPA optimizer steps {hidden} tensor(s) that are not parameters of the model (a wrapper's "
                "master copies, or an optimizer built on other tensors): its switch between y (training) and x "
                "(evaluation and saving) would not reach the weights the model runs with, so evaluation and every "
                "checkpoint would silently be y. Build the optimizer on model.parameters() (or let GPATrainer build "
                "it from --optim); to shard, use FSDP2 (configs/accelerate_fsdp2.yaml)."
            )

    # ---- the weights x: evaluation, prediction, saving ----

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """The next class's `evaluate` at x; the optimizer's mode (and so y) is restored afterwards."""
        with self._at_x():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> PredictionOutput:
        """The next class's `predict` at x; the optimizer's mode (and so y) is restored afterwards."""
        with self._at_x():
            return super().predict(*args, **kwargs)

    def save_model(self, *args: Any, **kwargs: Any) -> None:
        """The next class's `save_model` writing x; the live weights are y again afterwards, also if saving raises."""
        if self._uses_gpa_optimizer() and self.is_world_process_zero():
            output_dir = kwargs.get("output_dir", args[0] if args else None) or self.args.output_dir
            logger.info(
                "hf_gpa: saving the evaluation weights (GPA's x, DiLoCo's outer weights) to %s; training goes on "
                "from the training weights",
                output_dir,
            )
        with self._at_x():
            super().save_model(*args, **kwargs)

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        # Model (x) and optimizer state (eval mode, with the residual that restores y) are written together, so a
        # checkpoint is the same whether or not an evaluation ran just before it.
        with self._at_x():
            super()._save_checkpoint(*args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str, *args: Any, **kwargs: Any) -> None:
        super()._save_optimizer_and_scheduler(output_dir, *args, **kwargs)
        # The model file holds x's norm statistics; y's belong to the training state, beside the optimizer's.
        statistics_y = self._norm_statistics.statistics_y
        if statistics_y is not None and self.args.should_save:
            from safetensors.torch import save_file

            save_file(statistics_y, os.path.join(output_dir, NORM_STATISTICS_Y_NAME))

    # ---- resuming and best-model loading: weights on disk are x ----

    def _load_optimizer_and_scheduler(self, checkpoint: str | None, *args: Any, **kwargs: Any) -> None:
        inner = unwrap_gpa_optimizer(self.optimizer)
        if checkpoint is not None and inner is None:
            _refuse_gpa_state_for_stock_optimizer(checkpoint, self.args)
        self._load_eval_mode_state(checkpoint, *args, **kwargs)
        if checkpoint is None or inner is None:
            return
        # The model holds the checkpoint's weights and norm statistics (x's, when recomputed): any statistics held
        # from before are stale, and y's, when the checkpoint has them, are the ones training continues with.
        self._norm_statistics.hold(_load_norm_statistics_y(checkpoint))
        self._norm_statistics.to_y()
        if inner.train_mode:
            # No optimizer state there (save_only_model), or one saved in train mode by another trainer: the
            # weights file is then the only starting point there is, and training resumes from it as y.
            logger.warning(
                "No eval-mode optimizer state in %s: resuming from its weights as the training point y.", checkpoint
            )
            return
        # The model holds the checkpoint's x and the optimizer its eval-mode state: train() restores y bitwise.
        inner.train()

    def _load_eval_mode_state(self, checkpoint: str | None, *args: Any, **kwargs: Any) -> bool:
        """The next class's `_load_optimizer_and_scheduler` (FSDP, devices, SageMaker: the Trainer's own loader);
        True when it loaded an optimizer state."""
        inner = unwrap_gpa_optimizer(self.optimizer)
        if inner is None:
            super()._load_optimizer_and_scheduler(checkpoint, *args, **kwargs)
            return False
        if checkpoint is not None and self.is_fsdp_enabled:
            # Under FSDP, accelerate loads into a template taken from this optimizer and keeps only the keys it
            # has; our checkpoints are eval-mode states, whose residual key exists only in eval mode.
            inner.init_state(eval_mode=True)
        loaded: list[bool] = []
        handle = inner.register_load_state_dict_post_hook(lambda optimizer: loaded.append(True))
        try:
            super()._load_optimizer_and_scheduler(checkpoint, *args, **kwargs)
        finally:
            handle.remove()
        return bool(loaded)

    def _load_best_model(self, *args: Any, **kwargs: Any) -> None:
        inner = unwrap_gpa_optimizer(self.optimizer)
        if inner is None:
            super()._load_best_model(*args, **kwargs)
            return
        # Parameters at x before they are overwritten with the best checkpoint's x, so that no stale y remains.
        inner.eval()
        checkpoint = self.state.best_model_checkpoint
        found = (
            self.is_fsdp_enabled
            or self.is_deepspeed_enabled
            or any(os.path.exists(os.path.join(checkpoint, name)) for name in _MODEL_WEIGHTS_NAMES)
        )
        super()._load_best_model(*args, **kwargs)
        if not found:
            # The stock method warned and kept the weights: the model holds the last step's x (and statistics).
            logger.warning(
                "%s has no model weights on this node (nodes without shared storage need --save_on_each_node): the "
                "model holds the last step's x, not the best checkpoint's.",
                checkpoint,
            )
            return
        # The model holds the best checkpoint's x and its norm statistics; y's (if kept) come back with y.
        self._norm_statistics.hold(_load_norm_statistics_y(self.state.best_model_checkpoint))
        # The best checkpoint's eval-mode state (and its scheduler) matches the x just loaded: optimizer.train()
        # would give its y. Loaded as a resume loads it, so FSDP's sharded states and devices are handled alike.
        if not self._load_eval_mode_state(self.state.best_model_checkpoint):
            logger.warning(
                "%s has no %s (save_only_model?): the model holds the best x, but the optimizer state is the last "
                "step's; do not continue training from it.",
                self.state.best_model_checkpoint,
                OPTIMIZER_NAME,
            )

    def train(self, *args: Any, **kwargs: Any) -> TrainOutput:
        """The next class's `train`; afterwards the model holds x (the next training step switches back to y). A
        checkpoint of DiLoCo across processes saved on another layout, or a DiLoCo or GPA state saved with other
        constants (H, outer lr, outer momentum, mu_x, mu_y), is refused first, before anything is loaded."""
        self.refuse_other_checkpoint(*args, **kwargs)
        self._log_run_summary()
        try:
            output = super().train(*args, **kwargs)
        finally:
            if self._step_in_backward is not None:  # no stepping in a backward outside training
                self._step_in_backward.remove()
                self._step_in_backward = None
        # Already x since on_train_end; also when a user removed that callback.
        self._hold_x()
        return output

    def _log_run_summary(self) -> None:
        """One INFO line (first process) naming the optimizer, its constants and that evaluation and saves use x."""
        if not self.is_world_process_zero():
            return
        summary = gpa_run_summary(self.args)
        if not summary and self._uses_gpa_optimizer():  # a GPA optimizer passed in with a stock --optim
            summary = (
                "hf_gpa: a GPA optimizer passed in. Evaluation, prediction and every save use its evaluation weights "
                "(x); training steps at its training weights, restored after each of them."
            )
        if summary:
            logger.info(summary)

    # ---- the Hub: the model card names the optimizer ----

    def create_model_card(self, *args: Any, results: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        """The next class's `create_model_card` plus a section naming the GPA optimizer, mu_x, mu_y and H, the
        optimizer's arguments and the final evaluation's results (`hf_gpa.model_card`).

        The next class decides the signature (`Trainer` takes ``language, license, tags, ...``, TRL's trainers
        ``model_name, dataset_name, tags``); the hf_gpa tags are added to ``tags`` wherever it takes them.
        ``results``: the metrics a script computed beyond the evaluation's own (``perplexity``); without them the
        last evaluation of the log history is the card's result.
        """
        section = gpa_model_card_section(self.args, getattr(self, "model", None))
        if section:
            args, kwargs = with_gpa_tags(super().create_model_card, args, kwargs, ("hf_gpa", self.args.optim.value))
        task, dataset = task_and_dataset(super().create_model_card, args, kwargs)
        super().create_model_card(*args, **kwargs)
        path = os.path.join(self.args.output_dir, "README.md")
        if self.is_world_process_zero() and os.path.isfile(path):
            log_history = getattr(getattr(self, "state", None), "log_history", [])
            evaluated = evaluation_results(results, log_history)
            complete_model_card(
                path,
                section,
                optimizer_args=gpa_optimizer_args(self.args),
                results=evaluated,
                task=task,
                dataset=dataset,
            )

    def _push_from_checkpoint(self, checkpoint_folder: str, *args: Any, **kwargs: Any) -> None:
        # The stock checkpoint push uploads output_dir without a model card: write one, so that a repo pushed only
        # during training (--push_to_hub --hub_strategy checkpoint) still says how its weights were made.
        if (
            gpa_model_card_section(self.args)
            and self.is_world_process_zero()
            and self.args.hub_strategy != HubStrategy.END
        ):
            self.create_model_card(model_name=_hub_model_name(self.args))
        super()._push_from_checkpoint(checkpoint_folder, *args, **kwargs)


def _recalibration_dataloader(trainer: GPATrainer) -> DataLoader:
    """A fresh loader over the train dataset with its own seeded shuffling: training's loader and sampler, and
    the global random state, are left alone (so a resumed run stays bitwise). No worker processes."""
    dataset, collator = trainer.train_dataset, trainer.data_collator
    description = "BatchNorm recalibration"
    if is_datasets_available():
        import datasets
    if is_datasets_available() and isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description=description)
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description=description)
    batch_size = trainer._train_batch_size
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=batch_size, collate_fn=collator)
    generator = torch.Generator().manual_seed(trainer.args.seed + trainer.args.process_index)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=generator,
        collate_fn=collator,
        drop_last=len(dataset) >= batch_size,  # no short last batch: BatchNorm needs > 1 value per channel
    )


def _recalibration_forward(trainer: GPATrainer, model: nn.Module, batch: dict[str, Any]) -> None:
    inputs = trainer._prepare_inputs(batch)
    with trainer.compute_loss_context_manager():
        model(**inputs)


def _load_norm_statistics_y(checkpoint: str) -> dict[str, torch.Tensor] | None:
    path = os.path.join(checkpoint, NORM_STATISTICS_Y_NAME)
    if not os.path.isfile(path):
        return None
    from safetensors.torch import load_file

    return load_file(path)


def _hub_model_name(args: TrainingArguments) -> str:
    if args.hub_model_id is None:
        return os.path.basename(os.path.normpath(args.output_dir))
    return args.hub_model_id.split("/")[-1]
