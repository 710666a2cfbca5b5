"""Paired comparisons over seeds: Student-t intervals of a mean, paired differences, and steps-to-target with the
seeds that never reach the target kept (censored at the budget) rather than dropped.

Why this file exists: a claim such as "GPA ends lower than DiLoCo" or "GPA needs fewer steps than AdamW" is decided
only when the interval of the paired difference excludes zero; with a handful of seeds it usually does not, and a
mean over the seeds that happened to reach a target is biased towards the method. The benchmarks that compare
optimizers over seeds (`benchmarks.powered_table`) take their intervals from here. No scipy: the t quantile for an
integer number of degrees of freedom has a closed-form distribution function (Abramowitz & Stegun 26.7.3-4), inverted
by bisection.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


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


def steps_saved_interval(reached: Sequence[StepsToTarget], budget: float, level: float = 0.95) -> Interval:
    """The fraction of ``budget`` saved, 1 - steps / budget, over the seeds, each censored seed counted as saving
    nothing (it reached the target at the budget at best): the mean and its interval are upper bounds when any seed
    is censored."""
    return mean_interval([1.0 - r.steps / budget for r in reached], level)
