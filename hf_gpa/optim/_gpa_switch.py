"""What GPAAdamW and the GPA wrapper share: eval() writes x = (y - (1 - mu_y) z) / mu_y, train() restores y bitwise.

Both optimizers store the memory-efficient form of the paper (Algorithm 3): the parameters hold the gradient point y,
the optimizer state holds z, and x is recovered only when ``eval()`` is called.

bf16/fp16 parameters carry y in float32 (``state["y_fp32"]``, the parameter holds it rounded). The parameter stays
authoritative, as in ``step()``: where it no longer equals that copy rounded (a ``load_state_dict``, a re-initialized
head, clipped weights), ``eval()`` takes x from the written value; likewise, where x in the parameter was written
while in eval mode, ``train()`` takes y from the written x, as fp32 parameters do.
"""

from __future__ import annotations

from typing import Any

import torch

from ._residual import decode_residual, encode_residual
from ._tensors import authoritative_y, is_dtensor, local_tensor, real_view, shard_like
from ._train_eval import TrainEvalOptimizer
from ._types import MU_Y, Y_FP32, Y_RESIDUAL, Y_RESIDUAL_OVERFLOW, Z

__all__ = ["GPASwitch"]


def _x_from_y(y: torch.Tensor, z: torch.Tensor, mu_y: float) -> torch.Tensor:
    """x = (y - (1 - mu_y) z) / mu_y, computed in z's dtype, returned in y's dtype."""
    return torch.sub(y.to(z.dtype), z, alpha=1.0 - mu_y).div_(mu_y).to(y.dtype)


def _y_from_x(x: torch.Tensor, z: torch.Tensor, mu_y: float) -> torch.Tensor:
    """y = mu_y x + (1 - mu_y) z, computed in z's dtype, returned in x's dtype."""
    return torch.lerp(z, x.to(z.dtype), mu_y).to(x.dtype)


class GPASwitch(TrainEvalOptimizer):
    """eval(): parameters y -> x; train(): x -> y, exact through the bit-pattern residual (see ``_residual``)."""

    def _params_to_eval(self, group: dict[str, Any]) -> None:
        mu_y = group[MU_Y]
        for p in group["params"]:
            state = self.state.get(p)
            if not state or Z not in state or mu_y == 1.0:
                continue  # never stepped (x = y = z), or mu_y = 1 (x = y)
            y, z = real_view(local_tensor(p)), real_view(local_tensor(state[Z]))
            if Y_FP32 in state:  # bf16/fp16: x from the float32 y; train() restores y from it, no residual
                y32 = real_view(local_tensor(state[Y_FP32]))
                y32.copy_(authoritative_y(y, y32, y32.dtype))
                y.copy_(_x_from_y(y32, z, mu_y))
                continue
            x = _x_from_y(y, z, mu_y)
            residual, overflow = encode_residual(y, _y_from_x(x, z, mu_y), narrow=not is_dtensor(p))
            state[Y_RESIDUAL] = shard_like(residual, p)
            if not is_dtensor(p):  # a DTensor's shards keep a full-width residual and no list (see _residual)
                state[Y_RESIDUAL_OVERFLOW] = overflow
            y.copy_(x)

    def _params_to_train(self, group: dict[str, Any]) -> None:
        mu_y = group[MU_Y]
        for p in group["params"]:
            state = self.state.get(p)
            if not state or Z not in state or mu_y == 1.0:
                continue
            x, z = real_view(local_tensor(p)), real_view(local_tensor(state[Z]))
            if Y_FP32 in state:
                y32 = real_view(local_tensor(state[Y_FP32]))
                written = x != _x_from_y(y32, z, mu_y).to(x.dtype)  # what eval() put there, recomputed bitwise
                if bool(written.any()):
                    y32.copy_(torch.where(written, _y_from_x(x.to(y32.dtype), z, mu_y), y32))
                x.copy_(y32)
                continue
            y = _y_from_x(x, z, mu_y)
            if Y_RESIDUAL in state:
                y = decode_residual(y, local_tensor(state.pop(Y_RESIDUAL)), state.pop(Y_RESIDUAL_OVERFLOW, None))
            # else: a loader dropped the residual (see _residual); y is rebuilt by rounding, not bitwise.
            x.copy_(y)
