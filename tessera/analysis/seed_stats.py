"""Statistics over seeds: mean, sample standard deviation, Student's t quantile, Welch's and the paired interval.

Comparing two precision settings means asking whether their difference is larger than what changing the
seed does. With a few seeds per setting and no reason to assume equal spreads, the difference of the
means gets Welch's t interval, with the Welch-Satterthwaite degrees of freedom (fractional in general).
The t quantile needs the incomplete beta function, which neither torch nor numpy provide, and scipy is
no dependency: it is computed here (Lentz's continued fraction for the CDF, bisection for its
inverse), stdlib only, to about 1e-10 relative.

Runs of two settings started from the same seed share their initial weights and data order, so most of
what the seed does cancels in their difference. Where both settings ran the same seeds, the per-seed
differences are the samples: their mean gets the paired t interval, with n - 1 degrees of freedom for n
pairs, usually far narrower than Welch's, which treats the two groups as unrelated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import NamedTuple

__all__ = ["mean", "sample_std", "student_t_cdf", "student_t_quantile", "Welch", "welch_interval", "Paired",
           "paired_interval"]

_NORMAL_DF = 1e12  # beyond this many degrees of freedom t is the normal distribution to double precision


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of no values")
    return math.fsum(values) / len(values)


def sample_std(values: Sequence[float]) -> float:
    """Standard deviation with n - 1 in the denominator (the unbiased variance's root); 0 for one value."""
    if len(values) < 2:
        return 0.0
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1))


def _beta_continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), for x < (a + 1) / (a + b + 2) where it converges fast."""
    tiny, eps = 1e-300, 1e-16
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # the even term d_2m
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # the odd term d_2m+1
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta did not converge (x={x}, a={a}, b={b})")


def _regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(1.0 - x, b, a) / b  # I_x(a,b) = 1 - I_1-x(b,a)


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom (any real df; ``math.inf``: the normal)."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if df >= _NORMAL_DF:
        return NormalDist().cdf(t)
    tail = 0.5 * _regularized_beta(df / (df + t * t), df / 2.0, 0.5)  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p: t(0.975, 2) = 4.303, t(0.975, 4) = 2.776, t(0.975, inf) = 1.960."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"probability must be in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if df >= _NORMAL_DF:
        return NormalDist().inv_cdf(p)
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:  # bracket: the cdf rises to 1, so doubling ends
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class Welch(NamedTuple):
    """Difference of two means (a - b) with its interval; ``df`` is Welch-Satterthwaite's (inf when both
    spreads are 0: the difference is then known exactly and the interval is that one point)."""

    difference: float
    low: float
    high: float
    df: float
    standard_error: float

    def contains_zero(self) -> bool:
        return self.low <= 0.0 <= self.high


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Welch:
    """Welch's t interval for mean(a) - mean(b); each side needs 2 values at least (one has no spread)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"Welch's interval needs at least 2 values on each side, got {len(a)} and {len(b)}")
    va, vb = sample_std(a) ** 2 / len(a), sample_std(b) ** 2 / len(b)  # the squared standard errors
    se = math.sqrt(va + vb)
    diff = mean(a) - mean(b)
    if se == 0.0:
        return Welch(diff, diff, diff, math.inf, 0.0)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = student_t_quantile(0.5 + confidence / 2.0, df) * se
    return Welch(diff, diff - half, diff + half, df, se)


class Paired(NamedTuple):
    """Mean of the pairwise differences a_i - b_i with its paired t interval (``df`` = pairs - 1); every
    difference equal: no spread, the interval is that one point."""

    differences: tuple[float, ...]
    difference: float  # their mean
    low: float
    high: float
    df: float
    standard_error: float

    def contains_zero(self) -> bool:
        return self.low <= 0.0 <= self.high


def paired_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Paired:
    """The paired t interval for the mean of a_i - b_i, a_i and b_i from the same seed; 2 pairs at least."""
    if len(a) != len(b):
        raise ValueError(f"a paired interval needs as many values on each side, got {len(a)} and {len(b)}")
    if len(a) < 2:
        raise ValueError(f"a paired interval needs at least 2 pairs, got {len(a)}")
    differences = tuple(x - y for x, y in zip(a, b))
    diff, df = mean(differences), float(len(differences) - 1)
    se = sample_std(differences) / math.sqrt(len(differences))
    half = student_t_quantile(0.5 + confidence / 2.0, df) * se if se else 0.0
    return Paired(differences, diff, diff - half, diff + half, df, se)
