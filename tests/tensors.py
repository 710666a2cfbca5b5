"""Helpers the test files share that need torch alone (seeded random parameters, a random token dataset).

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


class TokenDataset(torch.utils.data.Dataset):
    """``n`` fixed-length random token sequences from ``seed``: every rank's mean loss has the same token count, so
    DDP's gradient average is the global batch's."""

    def __init__(self, n: int, seed: int, length: int = 16) -> None:
        self.ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
