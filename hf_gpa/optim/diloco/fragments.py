"""Streaming DiLoCo's fragments (Douillard et al. 2025): which parameters synchronise at which inner step.

The parameters, in the order of the param groups, are split into P contiguous runs of about equal size (each at least
one tensor), and fragment k has its outer step at the inner steps t with (t - k H // P) % H == 0, so that one outer
sync carries about 1/P of the model. P = 1 is plain DiLoCo: every parameter every H inner steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._types import INNER_STEP, INNER_STEPS, OUTER, SYNCED_AT

__all__ = ["FragmentSchedule", "fragment_due", "fragment_of_each", "steps_since_sync"]


def fragment_of_each(numels: Sequence[int], num_fragments: int) -> list[int]:
    """The fragment (0 .. P - 1) of each tensor: P contiguous runs in the given order, each at least one tensor, a
    tensor going to the fragment in whose share (k/P to (k+1)/P of the total size) its middle lies."""
    total, n = sum(numels), len(numels)
    fragments, before, previous = [], 0, -1
    for i, size in enumerate(numels):
        # middle of the tensor, in fragments (integers: every process computes the same split)
        share = (2 * before + size) * num_fragments // (2 * total) if total else i * num_fragments // max(n, 1)
        fragment = min(max(share, previous, num_fragments - (n - i)), previous + 1, num_fragments - 1)
        fragments.append(fragment)
        before, previous = before + size, fragment
    return fragments


def fragment_due(fragment: int, inner_step: int, inner_steps: int, num_fragments: int) -> bool:
    """Whether fragment ``fragment`` takes its outer step after inner step ``inner_step`` (1, 2, ...): at the steps t
    with (t - offset) % H == 0, the offsets k H // P spread evenly over the period (fragment 0: t % H == 0)."""
    return (inner_step - fragment * inner_steps // num_fragments) % inner_steps == 0


def steps_since_sync(fragment: int, inner_step: int, inner_steps: int, num_fragments: int) -> int:
    """The inner steps fragment ``fragment`` took since its last outer step (all of them before its first)."""
    offset = fragment * inner_steps // num_fragments
    return inner_step if inner_step < offset else (inner_step - offset) % inner_steps


class FragmentSchedule:
    """The P fragments of an optimizer's parameters (`fragment_of_each`, computed again once a group is added) and
    which parameters are due for an outer sync."""

    def __init__(self, num_fragments: int) -> None:
        self.num_fragments = num_fragments
        self._sizes: list[int] = []
        self._fragments: list[int] = []

    def of_each(self, params: Sequence[torch.Tensor]) -> list[int]:
        """The fragment of each of ``params`` (all of an optimizer's parameters, in the order of its groups)."""
        sizes = [p.numel() for p in params]
        if sizes != self._sizes:
            self._sizes, self._fragments = sizes, fragment_of_each(sizes, self.num_fragments)
        return self._fragments

    def numels(self, params: Sequence[torch.Tensor], local: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
        """The elements of each fragment (of this process's ``local`` tensors: its shards under FSDP2)."""
        numels = [0] * self.num_fragments
        for p, fragment in zip(params, self.of_each(params)):
            numels[fragment] += local(p).numel()
        return numels

    def due(
        self, param_groups: Sequence[dict[str, Any]], states: Mapping[torch.Tensor, Any], partial: bool = False
    ) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """(group, parameter) of the parameters with outer state (in ``states``) whose fragment takes its outer step
        after the groups' inner step, in the order of the groups: the same list on every process. ``partial``:
        instead, those whose fragment took inner steps since its last outer step (the end of training), none of a
        group already synchronised at its current step."""
        params = [p for group in param_groups for p in group["params"]]
        fragments, due, position = self.of_each(params), [], 0
        for group in param_groups:
            step, period = group[INNER_STEP], group[INNER_STEPS]
            for p in group["params"]:
                fragment = fragments[position]
                position += 1
                if partial:
                    wanted = (
                        group.get(SYNCED_AT) != step
                        and steps_since_sync(fragment, step, period, self.num_fragments) > 0
                    )
                else:
                    wanted = fragment_due(fragment, step, period, self.num_fragments)
                if wanted and OUTER in states.get(p, ()):
                    due.append((group, p))
        return due
