"""Uncertainty of held-out scores: intervals for a success rate and a mean reward, and paired
tests that say whether one checkpoint is better or worse than another on the same tasks."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Literal

import numpy as np

DEFAULT_RESAMPLES = 10_000
# Bootstrap and permutation draws are made in blocks of at most this many numbers, so memory
# stays bounded whatever the number of tasks and resamples.
BLOCK_ELEMENTS = 1 << 22

PairedMethod = Literal["exact sign", "sign-flip permutation"]


@dataclass(frozen=True)
class PairedDifference:
    """How checkpoint b scores against checkpoint a on the same `n` tasks.

    `mean` is the mean of the per-task differences b - a; [`low`, `high`] is its paired percentile
    bootstrap interval. `p_worse` is the one-sided p-value of "b is worse than a" (small when b
    loses on many tasks), `p_better` the mirror one-sided p-value of "b is better than a".
    `method` names how the p-values were computed: the exact sign test on discordant pairs for
    0/1 outcomes, a sign-flip permutation test otherwise."""

    mean: float
    low: float
    high: float
    n: int
    p_worse: float
    p_better: float
    method: PairedMethod

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be between 0 and 1 (exclusive), got {level}")


def _check_resamples(resamples: int) -> None:
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")


def _as_scores(values: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of numbers")
    if array.size == 0:
        raise ValueError(f"{what} is empty; at least one task's score is needed")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{what} holds NaN or infinite scores; score every task with a number")
    return array


def _row_blocks(rows: int, width: int) -> Iterator[int]:
    """Sizes of the blocks `rows` draws of `width` numbers each are made in."""
    per_block = max(1, BLOCK_ELEMENTS // max(width, 1))
    for start in range(0, rows, per_block):
        yield min(per_block, rows - start)


def _bootstrap_interval(
    values: np.ndarray, level: float, resamples: int, rng: np.random.Generator
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (at least one value)."""
    if np.all(values == values[0]):
        return float(values[0]), float(values[0])
    n = values.size
    means = np.concatenate(
        [
            values[rng.integers(0, n, size=(rows, n))].mean(axis=1)
            for rows in _row_blocks(resamples, n)
        ]
    )
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def _sign_test(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Exact one-sided sign test (exact McNemar) on the discordant pairs of 0/1 outcomes:
    with k discordant pairs of which `better` favour b, p_worse = P(X <= better) and
    p_better = P(X >= better) for X ~ Binomial(k, 1/2)."""
    better = int(np.sum(b > a))
    worse = int(np.sum(b < a))
    discordant = better + worse
    total = 2**discordant

    def at_most(k: int) -> float:
        return sum(math.comb(discordant, i) for i in range(k + 1)) / total

    return at_most(better), at_most(worse)


def _sign_flip_test(
    differences: np.ndarray, resamples: int, rng: np.random.Generator
) -> tuple[float, float]:
    """One-sided paired permutation test: under "no difference" each task's difference is as
    likely negated, so the observed mean is compared with `resamples` means of randomly
    sign-flipped differences; p = (1 + #(flipped <= observed)) / (1 + resamples), and the mirror
    count for p_better."""
    n = differences.size
    observed = differences.mean()
    # Flipped means are sums in another order; a tolerance keeps ties with the observed mean ties.
    tolerance = 1e-12 * max(1.0, float(np.abs(differences).max()))
    at_or_below = at_or_above = 0
    for rows in _row_blocks(resamples, n):
        signs = rng.integers(0, 2, size=(rows, n), dtype=np.int8) * 2 - 1
        flipped = signs @ differences / n
        at_or_below += int(np.sum(flipped <= observed + tolerance))
        at_or_above += int(np.sum(flipped >= observed - tolerance))
    return (1 + at_or_below) / (1 + resamples), (1 + at_or_above) / (1 + resamples)


def wilson_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion `successes`/`n` at confidence `level`.

    With p = successes/n and z the normal quantile at (1 + level)/2:
    centre = (p + z²/2n) / (1 + z²/n), half-width = z·sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n).
    Unlike the normal interval it stays inside [0, 1] and is not empty at 0 or n successes.
    (E. B. Wilson, "Probable inference, the law of succession, and statistical inference",
    JASA 1927.)"""
    _check_level(level)
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be between 0 and n={n}, got {successes}")
    z = NormalDist().inv_cdf((1.0 + level) / 2.0)
    p = successes / n
    denominator = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half_width = z * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n)) / denominator
    low = 0.0 if successes == 0 else max(0.0, centre - half_width)
    high = 1.0 if successes == n else min(1.0, centre + half_width)
    return low, high


def mean_interval(
    values: Sequence[float],
    level: float = 0.95,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` at confidence `level`: the tasks
    are resampled with replacement `resamples` times (seeded, so the same inputs and seed give
    the same interval) and the interval is the middle `level` of the resampled means. Constant
    values give (v, v); no values raise ValueError."""
    _check_level(level)
    _check_resamples(resamples)
    array = _as_scores(values, "values")
    return _bootstrap_interval(array, level, resamples, np.random.default_rng(seed))


def paired_difference(
    a: Sequence[float],
    b: Sequence[float],
    level: float = 0.95,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> PairedDifference:
    """Compare checkpoint b with checkpoint a on the same tasks (`a[i]` and `b[i]` are task i's
    scores). The interval resamples task indices, keeping each task's pair together, so the
    variation that the two checkpoints share (easy and hard tasks) cancels.

    For 0/1 outcomes the p-values are the exact sign test on discordant pairs (exact McNemar);
    for other scores a sign-flip permutation test with `resamples` draws. All draws are seeded
    by `seed`. Raises ValueError when the sequences are empty or of different lengths."""
    _check_level(level)
    _check_resamples(resamples)
    first = _as_scores(a, "a")
    second = _as_scores(b, "b")
    if first.size != second.size:
        raise ValueError(
            f"a has {first.size} scores and b has {second.size}; a paired comparison needs both "
            "checkpoints scored on the same tasks"
        )
    differences = second - first
    bootstrap_seed, permutation_seed = np.random.SeedSequence(seed).spawn(2)
    low, high = _bootstrap_interval(
        differences, level, resamples, np.random.default_rng(bootstrap_seed)
    )
    binary = bool(np.all(np.isin(first, (0.0, 1.0))) and np.all(np.isin(second, (0.0, 1.0))))
    if binary:
        p_worse, p_better = _sign_test(first, second)
        method: PairedMethod = "exact sign"
    else:
        p_worse, p_better = _sign_flip_test(
            differences, resamples, np.random.default_rng(permutation_seed)
        )
        method = "sign-flip permutation"
    return PairedDifference(
        mean=float(differences.mean()),
        low=low,
        high=high,
        n=int(differences.size),
        p_worse=p_worse,
        p_better=p_better,
        method=method,
    )


def score_summary(
    values: Sequence[float], successes: Sequence[bool | int], level: float = 0.95
) -> dict[str, float | int]:
    """One checkpoint's score on one domain, as stored in JSON: mean reward, success rate, the
    number of tasks and the Wilson interval of the success rate at `level`."""
    rewards = _as_scores(values, "values")
    if len(successes) != rewards.size:
        raise ValueError(
            f"{rewards.size} rewards and {len(successes)} successes; give one of each per task"
        )
    if any(success not in (0, 1) for success in successes):
        raise ValueError("successes must be 0/1 or booleans, one per task")
    won = sum(int(success) for success in successes)
    n = int(rewards.size)
    low, high = wilson_interval(won, n, level)
    return {
        "mean_reward": float(rewards.mean()),
        "success_rate": won / n,
        "n": n,
        "success_low": low,
        "success_high": high,
    }


def not_worse(
    base: Sequence[float],
    candidate: Sequence[float],
    *,
    alpha: float = 0.05,
    margin: float = 0.0,
) -> tuple[bool, PairedDifference]:
    """Whether `candidate` holds up against `base` on the same tasks, and the comparison.

    The rule: the candidate is held back only when both
      1. the one-sided paired test says it is worse at level `alpha` (p_worse < alpha), and
      2. its mean score per task is lower than the base's by more than `margin`
         (mean difference < -margin).
    A drop within noise, or a significant drop no larger than `margin`, passes. The reported
    interval is the (1 - 2·alpha) paired bootstrap interval, the two-sided match of the
    one-sided test."""
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha must be between 0 and 0.5 (exclusive), got {alpha}")
    if margin < 0.0:
        raise ValueError(f"margin is a tolerated drop and must be at least 0, got {margin}")
    difference = paired_difference(base, candidate, level=1.0 - 2.0 * alpha)
    worse = difference.p_worse < alpha and difference.mean < -margin
    return not worse, difference
