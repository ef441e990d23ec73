"""Intervals and paired tests of held-out scores, checked against hand-computed values."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from skillswarm.agent.stats import (
    PairedDifference,
    mean_interval,
    not_worse,
    paired_difference,
    score_summary,
    wilson_interval,
)


def test_wilson_interval_matches_the_textbook_values() -> None:
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0
    assert wilson_interval(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(10, 10)[1] == 1.0
    narrow, wide = wilson_interval(8, 10, level=0.8), wilson_interval(8, 10, level=0.99)
    assert wide[0] < low < narrow[0] and narrow[1] < high < wide[1]


@pytest.mark.parametrize(
    ("successes", "n", "level"), [(1, 0, 0.95), (-1, 10, 0.95), (11, 10, 0.95), (5, 10, 1.0)]
)
def test_wilson_interval_refuses_impossible_counts(successes: int, n: int, level: float) -> None:
    with pytest.raises(ValueError):
        wilson_interval(successes, n, level)


def test_mean_interval_covers_the_mean_and_is_deterministic() -> None:
    values = np.random.default_rng(3).normal(0.6, 0.2, size=200).tolist()
    low, high = mean_interval(values, seed=5)
    assert low < float(np.mean(values)) < high
    # The bootstrap spread of a mean is about sd / sqrt(n).
    assert high - low == pytest.approx(2 * 1.96 * np.std(values) / math.sqrt(200), rel=0.15)
    assert mean_interval(values, seed=5) == (low, high)
    assert mean_interval([0.25] * 7) == (0.25, 0.25)
    with pytest.raises(ValueError, match="empty"):
        mean_interval([])
    with pytest.raises(ValueError, match="NaN"):
        mean_interval([0.5, float("nan")])


def test_exact_sign_test_on_discordant_pairs() -> None:
    # 10 discordant pairs, all favouring a; 5 concordant pairs change nothing.
    a = [1] * 10 + [1, 1, 0, 0, 0]
    b = [0] * 10 + [1, 1, 0, 0, 0]
    result = paired_difference(a, b)
    assert result.method == "exact sign"
    assert result.p_worse == pytest.approx(0.5**10)
    assert result.p_better == 1.0
    assert result.mean == pytest.approx(-10 / 15) and result.n == 15
    # 8 favour a, 2 favour b: P(X <= 2) = (1 + 10 + 45) / 1024, P(X >= 2) = 1 - 11 / 1024.
    mixed = paired_difference([1] * 8 + [0] * 2, [0] * 8 + [1] * 2)
    assert mixed.p_worse == pytest.approx(56 / 1024)
    assert mixed.p_better == pytest.approx(1013 / 1024)
    assert paired_difference([1, 0, 1], [1, 0, 1]).p_worse == 1.0


def test_sign_flip_permutation_test_matches_full_enumeration() -> None:
    a = [0.2, 0.5, 0.1, 0.7, 0.4, 0.3, 0.9, 0.6]
    b = [0.5, 0.6, 0.05, 0.9, 0.6, 0.35, 0.85, 0.9]
    differences = np.subtract(b, a)
    observed = differences.mean()
    flipped = [
        float(np.mean(differences * signs))
        for signs in itertools.product((-1, 1), repeat=len(differences))
    ]
    exact_worse = sum(m <= observed + 1e-12 for m in flipped) / len(flipped)
    exact_better = sum(m >= observed - 1e-12 for m in flipped) / len(flipped)
    result = paired_difference(a, b, resamples=40_000, seed=2)
    assert result.method == "sign-flip permutation"
    assert result.p_worse == pytest.approx(exact_worse, abs=0.01)
    assert result.p_better == pytest.approx(exact_better, abs=0.01)
    assert result.p_better < 0.05 < result.p_worse


def test_paired_interval_covers_the_true_difference_and_beats_the_unpaired_spread() -> None:
    rng = np.random.default_rng(11)
    difficulty = rng.uniform(0.0, 1.0, size=300)  # shared by both checkpoints
    a = difficulty + rng.normal(0.0, 0.05, size=300)
    b = difficulty + 0.1 + rng.normal(0.0, 0.05, size=300)
    result = paired_difference(a.tolist(), b.tolist(), seed=4)
    assert result.low < 0.1 < result.high
    assert result.low > 0.0 and result.p_better < 0.001 and result.p_worse > 0.99
    # The unpaired bootstrap resamples each checkpoint's tasks on their own, so the tasks'
    # difficulty does not cancel.
    draws = np.random.default_rng(4)
    unpaired = [
        b[draws.integers(0, 300, 300)].mean() - a[draws.integers(0, 300, 300)].mean()
        for _ in range(2000)
    ]
    unpaired_low, unpaired_high = np.quantile(unpaired, [0.025, 0.975])
    assert (result.high - result.low) * 3 < unpaired_high - unpaired_low


def test_paired_difference_is_deterministic_for_a_seed() -> None:
    a = np.random.default_rng(0).uniform(size=50).tolist()
    b = np.random.default_rng(1).uniform(size=50).tolist()
    first = paired_difference(a, b, seed=9, resamples=2000)
    assert paired_difference(a, b, seed=9, resamples=2000) == first
    assert paired_difference(a, b, seed=10, resamples=2000) != first
    assert first.to_dict() == {
        "mean": first.mean,
        "low": first.low,
        "high": first.high,
        "n": 50,
        "p_worse": first.p_worse,
        "p_better": first.p_better,
        "method": "sign-flip permutation",
    }


@pytest.mark.parametrize(
    ("a", "b", "match"),
    [([1.0, 0.0], [1.0], "same tasks"), ([], [], "empty"), ([0.5], [float("inf")], "NaN")],
)
def test_paired_difference_refuses_unpaired_input(
    a: list[float], b: list[float], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        paired_difference(a, b)


def test_score_summary_is_the_stored_record() -> None:
    summary = score_summary([1.0, 0.5, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0], [1] * 8 + [0] * 2)
    assert summary["mean_reward"] == pytest.approx(0.75)
    assert summary["success_rate"] == 0.8 and summary["n"] == 10
    assert summary["success_low"] == pytest.approx(0.4902, abs=1e-4)
    assert summary["success_high"] == pytest.approx(0.9433, abs=1e-4)
    with pytest.raises(ValueError, match="one of each"):
        score_summary([1.0, 0.0], [True])
    with pytest.raises(ValueError, match="0/1"):
        score_summary([1.0, 0.0], [1, 2])


def _outcomes(successes: set[int], n: int = 64) -> list[int]:
    return [int(task in successes) for task in range(n)]


def test_not_worse_holds_back_a_clearly_worse_candidate() -> None:
    base = _outcomes(set(range(40)))
    candidate = _outcomes(set(range(15, 40)))  # loses 15 of the base's 40 successes
    passed, difference = not_worse(base, candidate)
    assert not passed
    assert isinstance(difference, PairedDifference)
    assert difference.p_worse == pytest.approx(0.5**15)
    assert difference.mean == pytest.approx(-15 / 64) and difference.high < 0.0
    # A margin larger than the drop lets it through.
    assert not_worse(base, candidate, margin=0.25)[0]


def test_not_worse_passes_an_equal_better_or_noisy_candidate() -> None:
    base = _outcomes(set(range(40)))
    assert not_worse(base, base)[0]
    assert not_worse(base, _outcomes(set(range(50))))[0]
    # Two tasks lost and one gained is noise: P(X <= 1) for X ~ Binomial(3, 1/2) is 1/2.
    noisy, difference = not_worse(base, _outcomes(set(range(2, 41))))
    assert noisy and difference.p_worse == pytest.approx(0.5)
    # A continuous drop well beyond noise is held back too.
    rewards = np.random.default_rng(5).uniform(0.3, 1.0, size=64)
    assert not not_worse(rewards.tolist(), (rewards - 0.2).tolist())[0]


def test_not_worse_refuses_meaningless_settings() -> None:
    with pytest.raises(ValueError, match="alpha"):
        not_worse([1, 0], [1, 0], alpha=0.6)
    with pytest.raises(ValueError, match="margin"):
        not_worse([1, 0], [1, 0], margin=-0.1)
