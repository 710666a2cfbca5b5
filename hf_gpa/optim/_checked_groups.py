"""The base class of every hf_gpa optimizer: param groups checked when they are added, and torch's habits shared.

torch's constructor adds its groups through ``add_param_group``, so `CheckedGroups` checks the constructor's groups
with the same code as those added later (the range checks themselves are ``_checks``'s), and a bad group raises and
is not added. `defaults_from_arguments` turns a constructor's signature into torch's ``defaults``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._checks import check_common

__all__ = ["CheckedGroups", "defaults_from_arguments"]


def defaults_from_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """A constructor's arguments (its ``locals()`` on entry) as torch.optim ``defaults``, in the signature's order: the
    signature is the one list of an optimizer's hyper-parameter names. ``self``, ``params`` and ``__class__`` are left
    out; a list becomes a tuple (``betas=[0.9, 0.99]``), so the defaults compare and pickle like torch's."""
    return {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in arguments.items()
        if name not in ("self", "params", "__class__")
    }


class CheckedGroups(torch.optim.Optimizer):
    """``add_param_group`` runs ``_check_group`` on the group with its defaults filled in; a bad group raises and is
    not added. torch's constructor adds its groups through ``add_param_group``, so the constructor's groups are
    checked by the same code as those added later."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict[str, Any]) -> None:
        """Per-group argument checks; subclasses extend it (and call ``super()._check_group``)."""
        check_common(group)

    def _closure_loss(self, closure: Callable[[], Any] | None) -> Any:
        """What ``step()`` does first, as torch's optimizers: the closure's loss, computed with gradients enabled."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()
