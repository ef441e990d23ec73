"""A round's candidates: the own-domain gate, the merge by each spec and the validation choice,
the outer step, and the publication rule put to the merge and, after a hold, to its subsets.
`coordinator.rounds` runs them for a round; bench/bench_swarm.py runs the same functions."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from skillswarm.coordinator.config import MergePlan, matches_any
from skillswarm.coordinator.evaluation import Evaluator, ExpertInput, mean_reward
from skillswarm.coordinator.publication import Decision
from skillswarm.merge.methods import MergeSpec
from skillswarm.merge.outer import OuterOptimizer
from skillswarm.merge.streaming import TaskVector, merge_checkpoint
from skillswarm.merge.tensors import MergeError

__all__ = [
    "Candidates",
    "Verdict",
    "candidate_validation",
    "gate_by_own_domain",
    "kept_at_base",
    "mean_score",
    "merge_and_decide",
    "merge_candidates",
    "scaled_for_domain",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidates:
    """The chosen merge: its spec and folder, every candidate's record (empty with a single
    spec), and the chosen one's validation scores when they were computed to choose it."""

    spec: MergeSpec
    folder: Path
    records: list[dict[str, Any]]
    validation: dict[str, dict[str, Any]] | None


def gate_by_own_domain(
    plan: MergePlan,
    evaluator: Evaluator,
    base_id: str,
    base_dir: Path,
    experts: Sequence[ExpertInput],
    work: Path,
) -> tuple[list[ExpertInput], list[dict[str, Any]]]:
    """The experts a round merges and the own-domain gate's record of each: with the gate off,
    all of them and no record; else those scoring at least the base on their own domain's
    validation tasks beyond noise (plan.own_domain_gate_alpha; `Evaluator.own_domain_gate`)."""
    if not plan.own_domain_gate:
        return list(experts), []
    gate = evaluator.own_domain_gate(
        base_id,
        base_dir,
        experts,
        work,
        alpha=plan.own_domain_gate_alpha,
        keep_base=plan.kept_for,
    )
    left_out = [entry["label"] for entry in gate if not entry["kept"]]
    if left_out:
        log.info("below the base on their own domain, left out of the merge: %s", left_out)
    return [e for e, entry in zip(experts, gate, strict=True) if entry["kept"]], gate


def merge_candidates(
    specs: Sequence[MergeSpec],
    base_dir: Path,
    experts: Sequence[TaskVector],
    work: Path,
    evaluator: Evaluator,
) -> Candidates:
    """Merge by each spec; with one spec that is the candidate, with several the best mean
    reward on the validation tasks wins (ties to the earlier)."""
    if len(specs) == 1:
        folder = merge_checkpoint(base_dir, experts, work / "candidate", specs[0])
        return Candidates(specs[0], folder, [], None)
    seed = evaluator.eval_config.validation_tasks_seed()
    records: list[dict[str, Any]] = []
    best: tuple[int, Path, float, dict[str, dict[str, Any]]] | None = None
    for index, spec in enumerate(specs):
        folder = work / f"candidate-{index}"
        record: dict[str, Any] = {"spec": spec.model_dump(), "seed": seed, "chosen": False}
        records.append(record)
        try:
            merge_checkpoint(base_dir, experts, folder, spec)
        except Exception as exc:  # one unusable candidate does not sink the round
            record |= {"error": f"{type(exc).__name__}: {exc}", "score": None}
            shutil.rmtree(folder, ignore_errors=True)
            continue
        scores = evaluator.validation_scores(folder)
        score = mean_score(scores)
        record |= {"validation": _without_outcomes(scores), "score": score}
        if best is None or score > best[2]:
            if best is not None:
                shutil.rmtree(best[1], ignore_errors=True)
            best = (index, folder, score, scores)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    if best is None:
        errors = "; ".join(f"{r['spec']['method']}: {r['error']}" for r in records)
        raise MergeError(f"every merge candidate failed: {errors}")
    records[best[0]]["chosen"] = True
    log.info(
        "merge candidates scored %s",
        [(r["spec"]["method"], r["spec"]["parameters"], r["score"]) for r in records],
    )
    return Candidates(specs[best[0]], best[1], records, best[3])


def candidate_validation(
    merged: Candidates, candidate_dir: Path, evaluator: Evaluator
) -> dict[str, dict[str, Any]]:
    """The validation scores of the checkpoint to publish: the chosen merge's own when the outer
    step left it as it was, else scored now."""
    if merged.validation is not None and candidate_dir == merged.folder:
        return merged.validation
    return evaluator.validation_scores(candidate_dir)


@dataclass
class Verdict:
    """What a round publishes or holds: the deltas in its candidate, the merge (spec, folder,
    candidates), the checkpoint to publish (after the outer step), the publication rule's
    decision on it, and the subsets tried after a hold (`merge_and_decide`)."""

    merging: list[ExpertInput]
    merged: Candidates
    candidate_dir: Path
    decision: Decision
    subsets: list[dict[str, Any]]


def merge_and_decide(
    plan: MergePlan,
    evaluator: Evaluator,
    outer: OuterOptimizer,
    base_id: str,
    base_dir: Path,
    merging: Sequence[ExpertInput],
    work: Path,
    number: int,
    decide: Callable[[Mapping[str, Mapping[str, Any]]], Decision],
    task_vector: Callable[[ExpertInput], TaskVector],
) -> Verdict:
    """Merge `merging` by the plan's specs and its per-domain weights, take the outer step and
    put the candidate's validation scores to `decide` (the publication rule). When it holds and
    the plan says `subsets_on_hold`, merge again without each delta in turn (the chosen spec),
    score each subset on the validation tasks and put it to the same rule: the best-scoring
    subset that passes is the verdict; if none passes, the same from the best-scoring subset,
    until one delta is left. With no subset passing, the verdict is the full merge's hold."""
    experts = list(merging)

    def vector_of(expert: ExpertInput) -> TaskVector:
        kept = kept_at_base(plan, expert.domain, task_vector(expert))
        return scaled_for_domain(plan, expert.domain, kept)

    vectors = [vector_of(e) for e in experts]
    specs = [
        *plan.specs(),
        *plan.domain_weight_specs(
            {v.name: e.domain for v, e in zip(vectors, experts, strict=True)}
        ),
    ]
    merged = merge_candidates(specs, base_dir, vectors, work, evaluator)
    candidate_dir = outer.step(base_id, base_dir, merged.folder, work / "stepped", number)
    decision = decide(candidate_validation(merged, candidate_dir, evaluator))
    held = Verdict(experts, merged, candidate_dir, decision, [])
    if decision.publish or not plan.subsets_on_hold:
        return held
    current = experts
    while len(current) > 1:
        # The best try so far (one that passes before any that does not, then the higher mean
        # reward, ties to the earlier); every other try's checkpoints are deleted at once, so a
        # large model's disk holds at most two subsets at a time.
        best: _SubsetTry | None = None
        for index in range(len(current)):
            subset = current[:index] + current[index + 1 :]
            folder = work / f"subset-{len(held.subsets)}"
            merged_dir = merge_checkpoint(
                base_dir, [vector_of(e) for e in subset], folder / "candidate", merged.spec
            )
            stepped = outer.step(base_id, base_dir, merged_dir, folder / "stepped", number)
            scores = evaluator.validation_scores(stepped)
            tried = _SubsetTry(subset, folder, merged_dir, stepped, scores, decide(scores))
            held.subsets.append(
                {
                    "merged": [e.label for e in subset],
                    "score": tried.score,
                    "publish": tried.decision.publish,
                    "reason": tried.decision.reason,
                }
            )
            if best is None or tried.rank > best.rank:
                if best is not None:
                    shutil.rmtree(best.folder, ignore_errors=True)
                best = tried
            else:
                shutil.rmtree(folder, ignore_errors=True)
        assert best is not None  # current holds at least two deltas
        if best.decision.publish:
            labels = [e.label for e in best.subset]
            log.info("round %d: the merge of %s passes the rule", number, labels)
            stepped = best.stepped
            if outer.keeps_state:  # its pending state must be this subset's, not the last tried
                stepped = outer.step(base_id, base_dir, best.merged_dir, work / "chosen", number)
            chosen = Candidates(merged.spec, best.merged_dir, merged.records, best.scores)
            return Verdict(best.subset, chosen, stepped, best.decision, held.subsets)
        shutil.rmtree(best.folder, ignore_errors=True)
        current = best.subset
    return held


def kept_at_base(plan: MergePlan, domain: str, vector: TaskVector) -> TaskVector:
    """`vector`, a `domain` delta, with the tensors plan.keep_base_tensors names for it left
    unchanged (its getter answers None there, which a merge takes as the base's tensor);
    `vector` itself when it names none."""
    patterns = plan.kept_for(domain)
    if not patterns:
        return vector

    def tensor(name: str, base: torch.Tensor) -> torch.Tensor | None:
        return None if matches_any(name, patterns) else vector.expert(name, base)

    return TaskVector(name=vector.name, expert=tensor)


def scaled_for_domain(plan: MergePlan, domain: str, vector: TaskVector) -> TaskVector:
    """`vector` with its task vector times plan.domain_scale[domain] (the expert's tensor becomes
    base + s·(expert − base)); `vector` itself when the plan does not scale that domain."""
    scale = plan.domain_scale.get(domain, 1.0)
    if scale == 1.0:
        return vector

    def tensor(name: str, base: torch.Tensor) -> torch.Tensor | None:
        expert = vector.expert(name, base)
        if expert is None:
            return None
        base32 = base.to(torch.float32)
        return (base32 + (expert.to(torch.float32) - base32) * scale).to(expert.dtype)

    return TaskVector(name=vector.name, expert=tensor)


@dataclass
class _SubsetTry:
    """One subset of a held merge, merged, stepped, scored and judged."""

    subset: list[ExpertInput]
    folder: Path
    merged_dir: Path
    stepped: Path
    scores: dict[str, dict[str, Any]]
    decision: Decision

    @property
    def score(self) -> float:
        return mean_score(self.scores)

    @property
    def rank(self) -> tuple[bool, float]:
        return (self.decision.publish, self.score)


def mean_score(scores: Mapping[str, Mapping[str, Any]]) -> float:
    """A candidate's validation score: its mean reward averaged over the domains."""
    return sum(mean_reward(row) for row in scores.values()) / len(scores)


def _without_outcomes(scores: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Validation rows without their per-task lists (kept only for the reported table)."""
    drop = {"rewards", "successes", "task_ids"}
    return {d: {k: v for k, v in row.items() if k not in drop} for d, row in scores.items()}
