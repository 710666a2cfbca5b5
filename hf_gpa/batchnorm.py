"""Running statistics of normalization layers recomputed at the evaluation weights x.

Why this file exists: BatchNorm's running mean and variance are buffers, not parameters. The optimizer never moves
them; the forward passes of training estimate them, and training runs at y. When GPA evaluates or saves at x, the
statistics still describe y, so the evaluated (and saved) model is one that no training pass ever saw. The fix is
the one Schedule-Free's README asks its users to do by hand: forward a few training batches at x, without
gradients, with the norm layers in train mode, and let them re-estimate their statistics.

How, and why so:

* Which layers: every `torch.nn.modules.batchnorm._NormBase` that tracks running statistics: the BatchNorm family
  (`_BatchNorm`: BatchNorm1d/2d/3d, their lazy forms, SyncBatchNorm) and InstanceNorm built with
  ``track_running_stats=True`` (it uses its running statistics at evaluation just as BatchNorm does). Layers without
  running statistics (LayerNorm, GroupNorm, RMSNorm, the default InstanceNorm) have nothing stale and are skipped;
  a model without any such layer costs nothing (no batch is drawn, no forward runs).
* Cumulative averaging: the buffers are reset, and before the k-th call of a layer its momentum is set to 1/k,
  which is exactly what torch computes for ``momentum=None`` (1 / num_batches_tracked). It is set per call rather
  than left to ``momentum=None`` because InstanceNorm treats ``momentum=None`` as 0 (no update at all). The result
  is the mean over the batches of the batch means and of the (unbiased) batch variances, independent of the old
  values. A layer that no batch reached keeps its old statistics.
* Mode: only the norm layers are put in train mode; the rest of the model stays in eval mode (dropout, stochastic
  depth and the like off). The statistics are used by the model in eval mode, where dropout is off, so they are
  estimated on the inputs the norm layers see at evaluation; and nothing draws random numbers but the data.
* Random state: Python's, NumPy's and torch's global generators (CPU and the model's accelerator) are saved, seeded
  with ``seed`` for the pass and restored afterwards. Drawing the batches (a shuffling DataLoader, random
  augmentation) then leaves training's data order and augmentation exactly as they were, and the statistics are a
  function of x and the data alone.
* Distributed: with ``all_reduce=True`` each process forwards its own batches and the per-layer averages are then
  averaged over the processes (weighted by their batch counts) with one ``all_reduce``: every rank ends with the
  same statistics, estimated from the batches of all ranks. All ranks must call it then (it is a collective), as
  they must anyway for a model with SyncBatchNorm.

Only torch is imported here (NumPy's generator is handled when NumPy is installed).
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

__all__ = [
    "DEFAULT_RECALIBRATION_BATCHES",
    "NormStatisticsAtX",
    "check_recalibration_batches",
    "count_over_processes",
    "default_forward",
    "load_norm_statistics",
    "norm_layers",
    "norm_statistics",
    "norm_statistics_buffers",
    "recalibrate_norm_statistics",
    "recalibrated_norm_statistics",
]

#: Training batches forwarded at x to re-estimate the statistics. Measured by benchmarks/bn_recalibration.py (the
#: small ResNet of run_vit_gpa.py on the digits, batches of 32): the running variances' error against a 2-epoch
#: reference falls like 1/sqrt(N), 7% (N = 1), 3.4% (4), 2.6% (8), 1.7% (16), 1.1% (32), where y's statistics are
#: 4-10% off; the accuracy at x is within noise of the reference from N = 4 on. 16 keeps the statistics' error well
#: below y's at the cost of 16 forward passes (about 5 training steps) per evaluation or save.
DEFAULT_RECALIBRATION_BATCHES = 16

_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def check_recalibration_batches(value: Any, flag: str = "--gpa_bn_recalibration_batches") -> int:
    """``value`` as an int >= 0, or a `ValueError` naming ``flag`` and the allowed range."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{flag} must be an integer >= 0 (0 turns the recalibration off), got {value!r}")
    return value


def norm_layers(model: nn.Module) -> list[tuple[str, _NormBase]]:
    """The (qualified name, module) of every norm layer in ``model`` that keeps running statistics."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, _NormBase) and module.track_running_stats and module.running_mean is not None
    ]


def norm_statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every running-statistics buffer (mean, variance, batch count) of ``model``'s norm layers."""
    return {key: tensor.detach().clone() for key, tensor in norm_statistics_buffers(model).items()}


@torch.no_grad()
def load_norm_statistics(model: nn.Module, stats: Mapping[str, torch.Tensor]) -> None:
    """Copy ``stats`` (as from `norm_statistics`) into ``model``'s buffers in place; the keys must match exactly."""
    current = norm_statistics_buffers(model)
    if set(current) != set(stats):
        missing, unexpected = sorted(set(current) - set(stats)), sorted(set(stats) - set(current))
        raise ValueError(f"norm statistics do not match the model: missing {missing}, unexpected {unexpected}")
    for key, tensor in current.items():
        tensor.copy_(stats[key])


def norm_statistics_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The live running-statistics buffers of ``model``'s norm layers (not copies), keyed as in `norm_statistics`."""
    buffers: dict[str, torch.Tensor] = {}
    for name, module in norm_layers(model):
        prefix = f"{name}." if name else ""
        for buffer in _STAT_BUFFERS:
            tensor = getattr(module, buffer, None)
            if tensor is not None:
                buffers[prefix + buffer] = tensor
    return buffers


def _model_device(model: nn.Module) -> torch.device:
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {key: _to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [_to_device(value, device) for value in batch]
    return batch


def default_forward(model: nn.Module, batch: Any) -> None:
    """Forward one batch as a training loop would: ``model(**batch)`` for a mapping (a transformers batch),
    ``model(batch[0])`` for a list or tuple (an ``(inputs, targets)`` pair), else ``model(batch)``; the batch is
    moved to the model's device first."""
    batch = _to_device(batch, _model_device(model))
    if isinstance(batch, Mapping):
        model(**batch)
    elif isinstance(batch, (list, tuple)):
        model(batch[0])
    else:
        model(batch)


@contextlib.contextmanager
def _isolated_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Inside: Python's, NumPy's and torch's global generators seeded with ``seed``; on exit, as they were."""
    try:
        import numpy as np
    except ImportError:  # NumPy is optional here
        np = None
    python_state = random.getstate()
    numpy_state = np.random.get_state() if np is not None else None
    accelerator = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=accelerator, device_type=device.type if accelerator else "cuda"):
        try:
            random.seed(seed)
            if np is not None:
                np.random.seed(seed % 2**32)
            torch.random.default_generator.manual_seed(seed)
            yield
        finally:
            random.setstate(python_state)
            if np is not None:
                np.random.set_state(numpy_state)


@torch.no_grad()
def recalibrate_norm_statistics(
    model: nn.Module,
    batches: Iterable[Any],
    num_batches: int = DEFAULT_RECALIBRATION_BATCHES,
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    all_reduce: bool = False,
    seed: int = 0,
) -> int:
    """Re-estimate the running statistics of ``model``'s norm layers from at most ``num_batches`` of ``batches``.

    The buffers are reset and accumulated with cumulative averaging (see the module docstring), with only the norm
    layers in train mode and no gradients; the modules' train/eval flags and momenta are restored afterwards, and so
    are the global random generators. ``forward(model, batch)`` runs one batch (default: `default_forward`).
    Returns the number of batches forwarded (0, and nothing drawn or run, when the model has no such layer or
    ``num_batches`` is 0). With ``all_reduce=True`` and an initialized process group of more than one process, the
    statistics are averaged over the processes, so that every rank holds the same values (a collective call).
    """
    num_batches = check_recalibration_batches(num_batches, "num_batches")
    layers = [module for _, module in norm_layers(model)]
    if not layers or num_batches == 0:
        return 0
    forward = default_forward if forward is None else forward
    old = [{b: getattr(m, b).clone() for b in _STAT_BUFFERS if getattr(m, b, None) is not None} for m in layers]
    momenta = [m.momentum for m in layers]
    training = {module: module.training for module in model.modules()}
    calls = [0] * len(layers)

    def count_call(index: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, inputs: Any) -> None:
            calls[index] += 1
            module.momentum = 1.0 / calls[index]  # torch's momentum=None average, also for InstanceNorm

        return hook

    hooks = [m.register_forward_pre_hook(count_call(i)) for i, m in enumerate(layers)]
    used = 0
    try:
        model.eval()
        for module in layers:
            module.reset_running_stats()
            module.train()
        with _isolated_rng(seed, _model_device(model)):
            for batch in itertools.islice(batches, num_batches):
                forward(model, batch)
                used += 1
    finally:
        for hook in hooks:
            hook.remove()
        for module, momentum in zip(layers, momenta):
            module.momentum = momentum
        for module, was_training in training.items():
            module.train(was_training)
    if all_reduce and torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            _average_over_processes(layers, calls)
    _keep_unreached(layers, calls, old)
    return used


def _keep_unreached(layers: list[_NormBase], calls: list[int], old: list[dict[str, torch.Tensor]]) -> None:
    """A layer no batch reached keeps the statistics it had (``old``) rather than the reset ones; the others count
    the batches they saw."""
    for module, count, saved in zip(layers, calls, old):
        if count == 0:
            for buffer, tensor in saved.items():
                getattr(module, buffer).copy_(tensor)
        elif module.num_batches_tracked is not None:
            module.num_batches_tracked.fill_(count)


def _average_over_processes(layers: list[_NormBase], calls: list[int]) -> None:
    """Replace each layer's mean and variance by their average over the processes, weighted by the calls each saw."""
    device = layers[0].running_mean.device
    pieces = []
    for module, count in zip(layers, calls):
        pieces += [module.running_mean.double().flatten() * count, module.running_var.double().flatten() * count]
    counts = torch.tensor(calls, dtype=torch.float64, device=device)
    flat = torch.cat([*(p.to(device) for p in pieces), counts])
    torch.distributed.all_reduce(flat)
    totals = flat[-len(layers) :].tolist()
    offset = 0
    for i, module in enumerate(layers):
        for buffer in (module.running_mean, module.running_var):
            n = buffer.numel()
            if totals[i] > 0:
                buffer.copy_((flat[offset : offset + n] / totals[i]).view_as(buffer))
            offset += n
        calls[i] = round(totals[i])


def count_over_processes(flag: bool, device: torch.device | str = "cpu") -> int:
    """How many processes have ``flag`` true: one ``all_reduce`` of one number when a process group of more than one
    process is initialized (a collective: every rank must call it), else ``int(flag)``.

    Whether to enter a collective must never rest on a fact of one process (a file on this node's disk, a mode): count
    it over the processes first and let every rank take the same branch. ``device`` is one the process group's backend
    reduces on (the CPU for gloo, this rank's GPU for NCCL).
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return int(flag)
    if torch.distributed.get_world_size() == 1:
        return int(flag)
    count = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(count)
    return int(count.item())


class NormStatisticsAtX:
    """The one holder of a model's norm statistics at x: while the buffers hold those recomputed at x, it keeps y's.

    `to_x` recomputes the running statistics at the weights the parameters hold (x) and keeps y's; `to_y` puts y's
    back, bitwise. Whatever puts x's statistics in place goes through one: `GPATrainer` keeps one for its model
    across evaluations, saves and the end of training (and writes `statistics_y` into each checkpoint), and
    `recalibrated_norm_statistics` (hence `hf_gpa.checkpoint.evaluation_weights(bn_batches=...)`) uses one for a
    block.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._statistics_y: dict[str, torch.Tensor] | None = None

    @property
    def statistics_y(self) -> dict[str, torch.Tensor] | None:
        """y's statistics while the buffers hold x's, else None."""
        return self._statistics_y

    @property
    def at_x(self) -> bool:
        """Whether the buffers hold x's statistics (and y's are kept here)."""
        return self._statistics_y is not None

    def to_x(
        self, batches: Iterable[Any] | None, num_batches: int = DEFAULT_RECALIBRATION_BATCHES, **kwargs: Any
    ) -> int:
        """Recompute the statistics at x from at most ``num_batches`` of ``batches`` (`recalibrate_norm_statistics`,
        which takes ``kwargs``: ``forward``, ``all_reduce``, ``seed``) and keep y's; returns the batches used.

        A no-op (0) when already at x, when ``batches`` is None or ``num_batches`` 0, or when the model has no norm
        layer with running statistics. When the recomputation raises, the buffers hold y's again.
        """
        num_batches = check_recalibration_batches(num_batches, "num_batches")
        if self.at_x or batches is None or num_batches == 0 or not norm_layers(self.model):
            return 0
        saved = norm_statistics(self.model)
        try:
            used = recalibrate_norm_statistics(self.model, batches, num_batches, **kwargs)
        except BaseException:
            load_norm_statistics(self.model, saved)
            raise
        self._statistics_y = saved
        return used

    def to_y(self) -> None:
        """Put y's statistics back (a no-op when the buffers hold y's)."""
        if self._statistics_y is not None:
            load_norm_statistics(self.model, self._statistics_y)
            self._statistics_y = None

    def hold(self, statistics_y: Mapping[str, torch.Tensor] | None) -> None:
        """The buffers hold x's statistics from elsewhere (a checkpoint's model file): keep ``statistics_y`` (y's,
        saved with it) to put back at `to_y`; None: nothing to put back, the buffers' statistics stay."""
        self._statistics_y = None if statistics_y is None else dict(statistics_y)


@contextlib.contextmanager
def recalibrated_norm_statistics(
    model: nn.Module,
    batches: Iterable[Any] | None,
    num_batches: int = DEFAULT_RECALIBRATION_BATCHES,
    **kwargs: Any,
) -> Iterator[int]:
    """Inside the block the norm layers hold statistics recomputed by `recalibrate_norm_statistics` (yields the
    number of batches used); on exit, also by an exception, the statistics found on entry are restored exactly.

    A no-op (yields 0) when ``batches`` is None, ``num_batches`` is 0 or the model has no such layer.
    """
    statistics = NormStatisticsAtX(model)
    try:
        yield statistics.to_x(batches, num_batches, **kwargs)
    finally:
        statistics.to_y()
