"""Paired comparisons over seeds: Student-t intervals of a mean, paired differences, Holm's step-down over several
comparisons at once, steps-to-target of one curve, and the steps one method's seed-mean curve saves to reach
another's final loss, with a bootstrap interval over seeds that counts the resamples in which it never reaches it.

Why this file exists: a claim such as "GPA ends lower than DiLoCo" or "GPA needs fewer steps than AdamW" is decided
only when the interval of the paired difference excludes zero; with a handful of seeds it usually does not. Steps to
a target are censored: a run that never reaches it within the budget has no step count, only "more than the budget",
so neither a mean over the seeds that reached it nor a Student-t interval over values set to the budget is an
interval of anything. The saving is taken instead as the paper takes it, on the seed-mean curves, and its interval
from resampling the seeds (`steps_saved_bootstrap`), where a never-reaching resample is a saving below zero of
unknown size: it ranks below every reaching one and is never given a number. The benchmarks that compare optimizers
over seeds (`benchmarks.powered_table`) take their intervals from here. No scipy: the t quantile for an integer number
of degrees of freedom has a closed-form distribution function (Abramowitz & Stegun 26.7.3-4), inverted by bisection.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


def t_two_sided_cdf(t: float, df: int) -> float:
    """P(|T| <= t) for Student's T with ``df`` (>= 1, integer) degrees of freedom, ``t`` >= 0: the finite series in
    theta = atan(t / sqrt(df)) (odd df: an arc term plus a sine-cosine series; even df: a sine-cosine series)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"Invalid degrees of freedom: {df} (an integer >= 1)")
    if t < 0:
        raise ValueError(f"Invalid t: {t} (>= 0)")
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 1:
        total, term = 0.0, math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):  # cos, (2/3) cos^3, (2*4)/(3*5) cos^5, ... up to cos^(df-2)
            total += term
            term *= cos2 * (2 * k) / (2 * k + 1)
        return 2.0 / math.pi * (theta + sin * total)
    total, term = 0.0, 1.0
    for k in range(1, df // 2 + 1):  # 1, (1/2) cos^2, (1*3)/(2*4) cos^4, ... up to cos^(df-2)
        total += term
        term *= cos2 * (2 * k - 1) / (2 * k)
    return sin * total


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's T with ``df`` degrees of freedom, to about 1e-12."""
    if not 0.5 < p < 1.0:
        raise ValueError(f"Invalid p: {p} (0.5 < p < 1)")
    target = 2.0 * p - 1.0
    low, high = 0.0, 1.0
    while t_two_sided_cdf(high, df) < target:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_two_sided_cdf(mid, df) < target:
            low = mid
        else:
            high = mid
        if high - low < 1e-13 * max(1.0, high):
            break
    return 0.5 * (low + high)


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` samples with its two-sided ``level`` Student-t interval [low, high]."""

    mean: float
    low: float
    high: float
    n: int
    level: float = 0.95

    @property
    def decided(self) -> bool:
        """Whether the interval excludes zero (the sign of the mean is decided at this level)."""
        return self.low > 0.0 or self.high < 0.0

    @property
    def p_value(self) -> float:
        """The two-sided p of the one-sample t test of a zero mean that this interval inverts (p < 1 - level exactly
        where the interval is `decided`)."""
        half = self.high - self.mean
        if half <= 0.0:  # every sample alike: no spread
            return 1.0 if self.mean == 0.0 else 0.0
        standard_error = half / t_quantile((1.0 + self.level) / 2.0, self.n - 1)
        return 1.0 - t_two_sided_cdf(abs(self.mean) / standard_error, self.n - 1)

    def text(self, digits: int = 4, scale: float = 1.0, signed: bool = True) -> str:
        """``mean [low, high]`` times ``scale``, with ``digits`` decimals (and signs where ``signed``)."""
        f = f"{'+' if signed else ''}.{digits}f"
        return f"{self.mean * scale:{f}} [{self.low * scale:{f}}, {self.high * scale:{f}}]"


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The mean of ``values`` (at least 2, finite) and its Student-t interval: mean +- t_{(1+level)/2,n-1} s/√n."""
    n = len(values)
    if n < 2:
        raise ValueError(f"An interval needs at least 2 samples, got {n}")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"Every sample must be finite, got {list(values)}")
    mean = statistics.fmean(values)
    half = t_quantile((1.0 + level) / 2.0, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, level)


def holm(p_values: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Which of several comparisons are decided together, with a family-wise error of at most ``alpha`` (Holm's
    step-down): the k-th smallest p (k from 0) is decided while it and every smaller one lie below alpha / (m - k)."""
    decided = [False] * len(p_values)
    for rank, i in enumerate(sorted(range(len(p_values)), key=lambda j: p_values[j])):
        if p_values[i] >= alpha / (len(p_values) - rank):
            break
        decided[i] = True
    return decided


def decided_together(intervals: Sequence[Interval | None], alpha: float = 0.05) -> list[bool]:
    """For each interval, whether it is decided with all the others read together (`holm` over their `p_value`s);
    a comparison with no interval (a diverged run) is left out of the family and is not decided."""
    tested = [i for i, interval in enumerate(intervals) if interval is not None]
    together = [False] * len(intervals)
    for i, verdict in zip(tested, holm([intervals[i].p_value for i in tested], alpha)):
        together[i] = verdict
    return together


def paired_differences(a: Mapping[int, float], b: Mapping[int, float]) -> dict[int, float]:
    """a[seed] - b[seed] for every seed (both must hold the same seeds; the ones only one holds are named)."""
    if set(a) != set(b):
        raise ValueError(f"Paired samples need the same seeds: {sorted(set(a) ^ set(b))} in one only")
    return {seed: a[seed] - b[seed] for seed in sorted(a)}


@dataclass(frozen=True)
class StepsToTarget:
    """Steps a run needed to reach a target loss, or the budget with ``censored`` when it never reached it."""

    steps: float
    censored: bool


def steps_to_target(
    steps: Sequence[float], losses: Sequence[float | None], target: float, budget: float
) -> StepsToTarget:
    """The first step at which the curve reaches ``target`` (linear interpolation between evaluation points; the
    curve starts at its first point), or ``budget`` censored when it never does (a diverged run, a NaN, included)."""
    for i, (step, loss) in enumerate(zip(steps, losses)):
        if loss is None or not math.isfinite(loss):
            break
        if loss <= target:
            if i == 0:
                return StepsToTarget(float(step), False)
            prev_step, prev_loss = steps[i - 1], losses[i - 1]
            assert prev_loss is not None
            return StepsToTarget(prev_step + (prev_loss - target) / (prev_loss - loss) * (step - prev_step), False)
    return StepsToTarget(float(budget), True)


@dataclass(frozen=True)
class CurveSaving:
    """The share of the budget one method's seed-mean curve saves to reach a target (another method's seed-mean final
    loss), with its bootstrap percentile interval over seeds.

    ``None`` stands for "never reached within the budget" (a saving below zero, of unknown size): as the estimate,
    the mean curve of the seeds never reaches the target; as ``low`` (``high``), more than (1 - level) / 2 of the
    resamples (than (1 + level) / 2) never reach it, so the bound lies below zero at a place the data cannot say.
    ``never`` is the share of the resamples that never reach it.
    """

    estimate: float | None
    low: float | None
    high: float | None
    never: float
    n: int
    resamples: int
    level: float = 0.95

    @property
    def decided(self) -> bool:
        """Whether a saving is decided: the interval's lower bound is above zero (so every bound is a reached one)."""
        return self.low is not None and self.low > 0.0

    def text(self) -> str:
        """``+7.2% [never, +13.9%]`` (percent of the budget; ``never``: not reached within it)."""

        def pct(value: float | None) -> str:
            return "never" if value is None else f"{100 * value:+.1f}%"

        return f"{pct(self.estimate)} [{pct(self.low)}, {pct(self.high)}]"


def _mean_curve_savings(
    a: torch.Tensor, b: torch.Tensor, picks: torch.Tensor, steps: torch.Tensor, budget: float
) -> torch.Tensor:
    """For each row of ``picks`` (seed indices, with repeats), 1 - steps / budget at which the mean of ``a``'s curves
    over those seeds first reaches the final point of the mean of ``b``'s (linear between evaluations, the curve
    starting at its first point, as `steps_to_target`); -inf where it never does."""
    mean_a, target = a[picks].mean(1), b[picks].mean(1)[:, -1:]  # (resamples, points), (resamples, 1)
    below = mean_a <= target
    reached = below.any(1)
    first = below.to(torch.int8).argmax(1)  # the first point at or below the target (0 where none is)
    prev = (first - 1).clamp(min=0)
    loss_prev, loss_first = mean_a.gather(1, prev[:, None])[:, 0], mean_a.gather(1, first[:, None])[:, 0]
    fraction = (loss_prev - target[:, 0]) / (loss_prev - loss_first)  # 0 / 0 where first == 0, not taken
    fraction = torch.where(first > 0, fraction, torch.zeros_like(fraction))
    at = steps[prev] + fraction * (steps[first] - steps[prev])
    return torch.where(reached, 1.0 - at / budget, torch.full_like(at, -math.inf))


def steps_saved_bootstrap(
    curves: Sequence[Sequence[float]],
    target_curves: Sequence[Sequence[float]],
    steps: Sequence[float],
    budget: float,
    *,
    resamples: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
) -> CurveSaving:
    """The share of ``budget`` saved by the seed-mean of ``curves`` reaching the seed-mean final loss of
    ``target_curves`` (the paper's measure: AdamW's final loss, read off mean curves), with a paired bootstrap over
    the seeds: ``resamples`` draws of the seeds with replacement (the same draw for both methods: a seed gives both
    the same weights and batches), each recomputing both mean curves and the crossing; the ``level`` interval is the
    percentile one (lower bound at the (1 - level) / 2 quantile rounded down, upper at the (1 + level) / 2 rounded
    up). A resample whose mean curve never reaches the target within the budget saves less than nothing by an unknown
    amount: it ranks below every resample that reaches it, and a bound that falls among those is ``None``.

    ``curves[i]``, ``target_curves[i]``: seed i's validation losses at ``steps`` (every seed at the same steps, all
    finite: leave out a diverged seed and name it). ``seed`` fixes the draws, so the interval is reproducible.
    """
    n = len(curves)
    if n < 2 or len(target_curves) != n:
        raise ValueError(f"A bootstrap over seeds needs at least 2 paired seeds, got {n} and {len(target_curves)}")
    if not 0.0 < level < 1.0 or resamples < 1:
        raise ValueError(f"Invalid level {level} or resamples {resamples}")
    a = torch.tensor([list(c) for c in curves], dtype=torch.float64)
    b = torch.tensor([list(c) for c in target_curves], dtype=torch.float64)
    at = torch.tensor(list(steps), dtype=torch.float64)
    if a.shape != b.shape or a.shape[1] != at.numel() or not (a.isfinite().all() and b.isfinite().all()):
        raise ValueError("Every curve must hold one finite loss per evaluation step")
    estimate = _mean_curve_savings(a, b, torch.arange(n)[None], at, budget)[0].item()
    generator = torch.Generator().manual_seed(seed)
    draws = _mean_curve_savings(a, b, torch.randint(0, n, (resamples, n), generator=generator), at, budget)
    ordered = draws.sort().values
    low = ordered[math.floor((1.0 - level) / 2.0 * (resamples - 1))].item()
    high = ordered[math.ceil((1.0 + level) / 2.0 * (resamples - 1))].item()

    def reached(value: float) -> float | None:
        return value if math.isfinite(value) else None

    never = (~draws.isfinite()).double().mean().item()
    return CurveSaving(reached(estimate), reached(low), reached(high), never, n, resamples, level)
