"""Single-worker DiLoCo against an explicit transcription of the paper's Algorithm 2, and its argument checks."""

from __future__ import annotations

import pytest
import torch

from hf_gpa import DiLoCo


def _grad(y: torch.Tensor, t: int) -> torch.Tensor:
    return torch.sin(3 * y + t) + 0.3 * y


def test_matches_algorithm_2() -> None:
    """Inner AdamW steps, then every H steps the outer Nesterov step on the pseudo-gradient and the reset."""
    h, outer_lr, mu, steps = 4, 0.7, 0.9, 30
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(6, 5, generator=gen, dtype=torch.float64)

    # Algorithm 2, written out: inner weights x, slow weights x_tilde, outer buffer b.
    x = torch.nn.Parameter(init.clone())
    inner = torch.optim.AdamW([x], lr=1e-2, weight_decay=0.1, foreach=False)
    x_tilde, b = init.clone(), torch.zeros_like(init)
    for t in range(1, steps + 1):
        x.grad = _grad(x.detach(), t)
        inner.step()  # x^(t+1) = (1 - lr wd) x^(t) + lr d^(t)
        if t % h == 0:
            with torch.no_grad():
                p = x_tilde - x  # pseudo-gradient
                b = mu * b + p  # outer momentum
                x_tilde = x_tilde - outer_lr * (mu * b + p)  # Nesterov step (with the updated buffer)
                x.copy_(x_tilde)  # re-initialize the inner weights

    w = torch.nn.Parameter(init.clone())
    opt = DiLoCo([w], base=torch.optim.AdamW, inner_steps=h, outer_lr=outer_lr, outer_momentum=mu, lr=1e-2,
                 weight_decay=0.1, foreach=False)
    for t in range(1, steps + 1):
        w.grad = _grad(w.detach(), t)
        opt.step()
    torch.testing.assert_close(w.detach(), x.detach(), rtol=0, atol=1e-12)
    opt.eval()  # evaluation weights: the slow weights
    torch.testing.assert_close(w.detach(), x_tilde, rtol=0, atol=1e-12)


def test_outer_step_is_torch_nesterov_sgd_on_pseudo_gradients() -> None:
    """The outer update equals torch.optim.SGD(nesterov=True) fed the pseudo-gradients (an independent oracle)."""
    h, steps = 3, 12
    init = torch.randn(10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = torch.nn.Parameter(init.clone())
    opt = DiLoCo([w], base=torch.optim.SGD, inner_steps=h, outer_lr=0.5, outer_momentum=0.8, lr=0.05)
    slow = torch.nn.Parameter(init.clone())
    outer = torch.optim.SGD([slow], lr=0.5, momentum=0.8, nesterov=True)
    inner = init.clone()
    for t in range(1, steps + 1):
        g = _grad(w.detach(), t)
        w.grad = g
        opt.step()
        inner = inner - 0.05 * g
        if t % h == 0:
            slow.grad = slow.detach() - inner
            outer.step()
            inner = slow.detach().clone()
    torch.testing.assert_close(w.detach(), inner, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"inner_steps": 0}, "inner_steps"),
        ({"inner_steps": 2.5}, "inner_steps"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"base": "adamw"}, "base"),
        ({"lr": -1.0}, "learning rate"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    """Every out-of-range DiLoCo argument raises a ValueError naming it."""
    with pytest.raises(ValueError, match=match):
        DiLoCo([torch.nn.Parameter(torch.zeros(3))], **kwargs)
