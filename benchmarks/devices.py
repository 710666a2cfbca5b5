"""The ``--device`` argument shared by the benchmarks: checked when the command line is parsed, before any work.

A benchmark on a device that cannot run fails at once with argparse's usual message (``argument --device: ...``),
instead of after minutes of set-up or, worse, silently on another device.
"""

from __future__ import annotations

import argparse

import torch


def device_arg(value: str) -> str:
    """An argparse ``type=``: ``cpu``, or ``cuda`` / ``cuda:N`` when that CUDA device exists.

    A CUDA device comes back with its index (``cuda`` is the current device, ``cuda:0`` unless set otherwise), so
    that every use of it (``torch.cuda.set_device``, ``torch.cuda.get_device_name``, ``.to``) names one device.
    """
    try:
        device = torch.device(value)
    except RuntimeError as error:
        raise argparse.ArgumentTypeError(f"{value!r} is not a device torch knows: {error}") from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{value!r}: the benchmarks run on cpu or cuda[:N]")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{value!r}: this torch ({torch.__version__}) sees no CUDA device")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{value!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return f"cuda:{index}"
