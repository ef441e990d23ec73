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
    "own_targets",
    "scaled_for_domain",
    "shortfall",
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
    validation tasks beyond noise (plan.own_domain_gate_alpha) and gaining at least
    plan.own_domain_min_gain there (`Evaluator.own_domain_gate`)."""
    if not plan.own_domain_gate:
        return list(experts), []
    gate = evaluator.own_domain_gate(
        base_id,
        base_dir,
        experts,
        work,
        alpha=plan.own_domain_gate_alpha,
        keep_base=plan.kept_for,
        min_gain=plan.own_domain_min_gain,
    )
    below = [e["label"] for e in gate if not e["kept"] and not e.get("short_of_min_gain")]
    short = [e["label"] for e in gate if e.get("short_of_min_gain")]
    if below:
        log.info("below the base on their own domain, left out of the merge: %s", below)
    if short:
        log.info(
            "gaining less than %g on their own domain, left out: %s",
            plan.own_domain_min_gain,
            short,
        )
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
    gate: Sequence[Mapping[str, Any]] = (),
) -> Verdict:
    """Merge `merging` by the plan's specs and its per-domain weights, take the outer step and
    put the candidate's validation scores to `decide` (the publication rule). When it holds and
    the plan says `subsets_on_hold`, merge again without each delta in turn (the chosen spec),
    score each subset on the validation tasks and put it to the same rule: the best-scoring
    subset that passes is the verdict; if none passes, the same from the best-scoring subset,
    until one delta is left. With no subset passing, the verdict is the full merge's hold.

    With plan.choose_by "shortfall" the subsets without one delta are tried whether or not the
    merge of all passes, and "best" ranks by the largest shortfall of a domain below what its
    deltas reached alone (own_targets of the own-domain `gate`'s records), smallest first, then
    by mean reward; the merge of all is among the first tries."""
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
    validation = candidate_validation(merged, candidate_dir, evaluator)
    decision = decide(validation)
    held = Verdict(experts, merged, candidate_dir, decision, [])
    by_shortfall = plan.choose_by == "shortfall" and len(experts) > 1
    targets = own_targets(gate, experts) if by_shortfall else None

    def rank(tried: _SubsetTry) -> tuple[bool, float, float]:
        worst = 0.0 if targets is None else shortfall(tried.scores, targets)
        return (tried.decision.publish, -worst, tried.score)

    if not by_shortfall and (decision.publish or not plan.subsets_on_hold):
        return held
    whole = _SubsetTry(experts, None, merged.folder, candidate_dir, validation, decision)
    if by_shortfall:
        held.subsets.append(_subset_record(whole, targets))
    current = experts
    while len(current) > 1:
        # The best try so far (one that passes before any that does not, then the smaller
        # shortfall or the higher mean reward, ties to the earlier); every other try's
        # checkpoints are deleted at once, so a large model's disk holds at most two subsets at
        # a time. With choose_by "shortfall" a merge of all that passes is the first pass's
        # first try.
        first = by_shortfall and current is experts and decision.publish
        best: _SubsetTry | None = whole if first else None
        for index in range(len(current)):
            subset = current[:index] + current[index + 1 :]
            folder = work / f"subset-{len(held.subsets)}"
            merged_dir = merge_checkpoint(
                base_dir, [vector_of(e) for e in subset], folder / "candidate", merged.spec
            )
            stepped = outer.step(base_id, base_dir, merged_dir, folder / "stepped", number)
            scores = evaluator.validation_scores(stepped)
            tried = _SubsetTry(subset, folder, merged_dir, stepped, scores, decide(scores))
            held.subsets.append(_subset_record(tried, targets))
            if best is None or rank(tried) > rank(best):
                if best is not None and best.folder is not None:
                    shutil.rmtree(best.folder, ignore_errors=True)
                best = tried
            else:
                shutil.rmtree(folder, ignore_errors=True)
        assert best is not None  # current holds at least two deltas
        if best is whole:
            if not outer.keeps_state:
                return held
            # The tries after it stepped the outer optimizer too: its pending state must be
            # the merge of all's again.
            stepped = outer.step(base_id, base_dir, merged.folder, work / "chosen", number)
            return Verdict(experts, merged, stepped, decision, held.subsets)
        assert best.folder is not None
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
    folder: Path | None  # None: the merge of every delta, whose folders the round keeps
    merged_dir: Path
    stepped: Path
    scores: dict[str, dict[str, Any]]
    decision: Decision

    @property
    def score(self) -> float:
        return mean_score(self.scores)


def _subset_record(tried: _SubsetTry, targets: Mapping[str, float] | None) -> dict[str, Any]:
    """A try as the round's decision lists it under `subsets` (with its shortfall when the
    round chooses by it)."""
    record = {
        "merged": [e.label for e in tried.subset],
        "score": tried.score,
        "publish": tried.decision.publish,
        "reason": tried.decision.reason,
    }
    if targets is not None:
        record["shortfall"] = shortfall(tried.scores, targets)
    return record


def own_targets(
    gate: Sequence[Mapping[str, Any]], merging: Sequence[ExpertInput]
) -> dict[str, float]:
    """domain → the validation mean reward the merged deltas of that domain reached alone on it
    (the best of them, and at least the base's), from the own-domain gate's records; a delta
    the gate did not score (its domain not evaluated) sets none."""
    labels = {e.label for e in merging}
    targets: dict[str, float] = {}
    for entry in gate:
        if entry["label"] in labels and None not in (entry.get("base"), entry.get("expert")):
            reach = max(float(entry["base"]), float(entry["expert"]))
            targets[entry["domain"]] = max(targets.get(entry["domain"], reach), reach)
    return targets


def shortfall(scores: Mapping[str, Mapping[str, Any]], targets: Mapping[str, float]) -> float:
    """The largest amount by which a candidate's validation mean reward falls short of a
    domain's target (0 when it reaches every one)."""
    gaps = [targets[d] - mean_reward(row) for d, row in scores.items() if d in targets]
    return max([0.0, *gaps])


def mean_score(scores: Mapping[str, Mapping[str, Any]]) -> float:
    """A candidate's validation score: its mean reward averaged over the domains."""
    return sum(mean_reward(row) for row in scores.values()) / len(scores)


def _without_outcomes(scores: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Validation rows without their per-task lists (kept only for the reported table)."""
    drop = {"rewards", "successes", "task_ids"}
    return {d: {k: v for k, v in row.items() if k not in drop} for d, row in scores.items()}
