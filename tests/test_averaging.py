"""mu_x <-> DiLoCo inner steps (paper, Table 4) and the averaging weights."""

from __future__ import annotations

import pytest

from hf_gpa import inner_steps_from_mu_x, mu_x_from_inner_steps
from hf_gpa.optim.averaging import averaging_mu_x

# Table 4 of the paper: H -> mu_x for mu = 0.9, to the four decimals printed there.
TABLE_4 = {1: 0.9, 4: 0.9740, 8: 0.9869, 16: 0.9934, 32: 0.9967, 64: 0.9984, 128: 0.9992}


@pytest.mark.parametrize(("h", "mu_x"), list(TABLE_4.items()))
def test_table_4(h: int, mu_x: float) -> None:
    """mu_x_from_inner_steps reproduces the paper's Table 4, and inner_steps_from_mu_x inverts it."""
    assert round(mu_x_from_inner_steps(h), 4) == mu_x
    assert inner_steps_from_mu_x(mu_x_from_inner_steps(h)) == pytest.approx(h, rel=1e-12)


def test_matching_rule() -> None:
    """After H steps the weight on the old average is mu: mu_x ** H == mu."""
    assert mu_x_from_inner_steps(20, mu=0.75) ** 20 == pytest.approx(0.75, rel=1e-12)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0,), "inner_steps"),
        ((float("inf"),), r"Invalid inner_steps: inf \(must be finite"),
        ((float("nan"),), "inner_steps"),
        ((4, 1.0), "mu"),
        ((4, 0.0), "mu"),
    ],
)
def test_bad_inner_steps(args: tuple, match: str) -> None:
    """Bad H or mu raise ValueError naming them."""
    with pytest.raises(ValueError, match=match):
        mu_x_from_inner_steps(*args)


def test_bad_mu_x() -> None:
    """mu_x outside (0, 1) has no effective number of inner steps."""
    with pytest.raises(ValueError, match="mu_x"):
        inner_steps_from_mu_x(1.0)


def test_schedule_free_weights_are_lr_squared() -> None:
    """Schedule-Free averaging: c_t = lr_t^2 / sum lr_i^2, i.e. a uniform average for a constant lr (eq. 5)."""
    weight_sum = 0.0
    for t in range(1, 6):
        mu_x, weight_sum = averaging_mu_x("schedule_free", 0.5, 0.1, weight_sum)
        assert mu_x == pytest.approx(1 - 1 / t)  # t/(t+1) in the paper's 0-based indexing
    mu_x, weight_sum = averaging_mu_x("schedule_free", 0.5, 0.2, 0.0)
    mu_x, _ = averaging_mu_x("schedule_free", 0.5, 0.1, weight_sum)
    assert mu_x == pytest.approx(1 - 0.01 / 0.05)
    assert averaging_mu_x("gpa", 0.99, 0.1, 3.0) == (0.99, 3.0)
