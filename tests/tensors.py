"""Helpers the optimizer-side test files share (seeded random parameters), torch only.

A plain module beside the tests, imported as ``from tensors import ...``: test modules do not import each other, and
fixtures live in ``conftest.py``. The trainer-side helpers, which import transformers, are in ``helpers.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def random_params(
    shapes: Iterable[tuple[int, ...]],
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    draw_dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> list[torch.nn.Parameter]:
    """One parameter per shape, in order, of standard normal values from one CPU ``torch.Generator`` seeded with
    ``seed``: drawn in ``draw_dtype`` (``dtype`` if not given), then cast to ``dtype`` on ``device``.

    The values depend on ``draw_dtype`` as well as on ``seed``: float64 draws rounded to float32 are not float32
    draws. Each test passes the draw its tolerances and bitwise comparisons were set with.
    """
    gen = torch.Generator().manual_seed(seed)
    draw_dtype = dtype if draw_dtype is None else draw_dtype
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=draw_dtype).to(device=device, dtype=dtype))
        for s in shapes
    ]
