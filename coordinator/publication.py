"""Whether a round's merged candidate may be published: the no-regression rule, applied domain by
domain to the candidate's and the base's outcomes on the same held-out tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skillswarm.agent.stats import not_worse, paired_difference
from skillswarm.coordinator.config import PublishPolicy

__all__ = ["Decision", "check_same_tasks", "compare_rows", "outcomes_of", "publication_decision"]


@dataclass(frozen=True)
class Decision:
    """The rule's verdict: publish or hold, why, and the paired comparison on each domain."""

    publish: bool
    reason: str
    comparisons: dict[str, dict[str, Any]] = field(default_factory=dict)
    origin_comparisons: dict[str, dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        verdict = {"publish": self.publish, "reason": self.reason, "comparisons": self.comparisons}
        if self.origin_comparisons is not None:
            verdict["origin_comparisons"] = self.origin_comparisons
        return verdict


def outcomes_of(row: Mapping[str, Any], metric: str) -> list[float]:
    """A scores row's per-task outcomes for `metric` ("success" or "reward"), in task order."""
    key = "successes" if metric == "success" else "rewards"
    values = row.get(key)
    if not isinstance(values, list | tuple) or not values:
        raise ValueError(f"the scores row has no per-task {key}; it cannot be compared pairwise")
    return [float(v) for v in values]


def check_same_tasks(base: Mapping[str, Any], candidate: Mapping[str, Any]) -> None:
    """Raise ValueError when the two scores rows name different tasks: they cannot be paired."""
    if (
        base.get("task_ids")
        and candidate.get("task_ids")
        and (list(base["task_ids"]) != list(candidate["task_ids"]))
    ):
        raise ValueError("the two rows were scored on different tasks; they cannot be paired")


def compare_rows(
    base: Mapping[str, Any],
    candidate: Mapping[str, Any],
    metric: str = "success",
    level: float = 0.95,
) -> dict[str, Any]:
    """The paired difference candidate − base of one domain's rows (same tasks, same order):
    mean, its interval at `level`, and the one-sided p-values."""
    check_same_tasks(base, candidate)
    difference = paired_difference(
        outcomes_of(base, metric), outcomes_of(candidate, metric), level=level
    )
    return {"metric": metric, "level": level, **difference.to_dict()}


def _worse_domains(
    reference: Mapping[str, Mapping[str, Any]],
    candidate: Mapping[str, Mapping[str, Any]],
    policy: PublishPolicy,
    level: float,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each domain's paired comparison candidate − reference, and the domains where the candidate
    is worse beyond noise (a one-sided test at policy.alpha, past policy.margin), described."""
    comparisons: dict[str, dict[str, Any]] = {}
    worse: list[str] = []
    for domain in sorted(reference):
        if domain not in candidate:
            raise ValueError(f"the candidate was not scored on {domain}")
        reference_outcomes: Sequence[float] = outcomes_of(reference[domain], policy.metric)
        candidate_outcomes = outcomes_of(candidate[domain], policy.metric)
        comparisons[domain] = compare_rows(
            reference[domain], candidate[domain], policy.metric, level
        )
        holds, difference = not_worse(
            reference_outcomes, candidate_outcomes, alpha=policy.alpha, margin=policy.margin
        )
        if not holds:
            worse.append(
                f"{domain} {100 * difference.mean:+.1f} points "
                f"(one-sided p = {difference.p_worse:.3g} < {policy.alpha})"
            )
    return comparisons, worse


def publication_decision(
    base_scores: Mapping[str, Mapping[str, Any]],
    candidate_scores: Mapping[str, Mapping[str, Any]],
    policy: PublishPolicy,
    level: float = 0.95,
    origin_scores: Mapping[str, Mapping[str, Any]] | None = None,
) -> Decision:
    """Publish unless, on some domain, the candidate is worse than the base beyond noise (see
    `PublishPolicy`), or, given `origin_scores` (the round-0 checkpoint's, on the same tasks) and
    with policy.against_origin, worse than the origin beyond noise. Every domain's paired
    comparison with the base (and with the origin) is returned either way."""
    comparisons, worse = _worse_domains(base_scores, candidate_scores, policy, level)
    origin_comparisons: dict[str, dict[str, Any]] | None = None
    worse_than_origin: list[str] = []
    if origin_scores is not None and policy.against_origin:
        origin_comparisons, worse_than_origin = _worse_domains(
            origin_scores, candidate_scores, policy, level
        )
    if not policy.no_regression:
        return Decision(True, "the no-regression rule is off", comparisons, origin_comparisons)
    reasons = []
    if worse:
        reasons.append("worse than the current base beyond noise on " + "; ".join(worse))
    if worse_than_origin:
        reasons.append(
            "worse than the round-0 checkpoint beyond noise on " + "; ".join(worse_than_origin)
        )
    if reasons:
        return Decision(False, "; ".join(reasons), comparisons, origin_comparisons)
    against = "the current base" if origin_comparisons is None else "the current base or round 0"
    return Decision(
        True, f"not worse than {against} on any domain", comparisons, origin_comparisons
    )


def publication_rule(
    base_scores: Mapping[str, Mapping[str, Any]],
    policy: PublishPolicy,
    level: float = 0.95,
    origin_scores: Mapping[str, Mapping[str, Any]] | None = None,
) -> Callable[[Mapping[str, Mapping[str, Any]]], Decision]:
    """`publication_decision` against these base (and origin) scores, as a function of a
    candidate's scores: the rule a round puts each of its candidates to."""

    def decide(candidate_scores: Mapping[str, Mapping[str, Any]]) -> Decision:
        return publication_decision(
            base_scores, candidate_scores, policy, level, origin_scores=origin_scores
        )

    return decide
