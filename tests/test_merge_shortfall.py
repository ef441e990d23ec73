"""choose_by = "shortfall": the round also merges without each delta, and publishes the passing
merge whose worst domain falls least short of what its delta reached alone. Real deltas packed
and merged by mergekit on the embedded base; the validation scores are scripted from which
deltas a merged checkpoint holds (read off its weights), so the choice is known."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from delta_helpers import expert_inputs, noisy
from pydantic import ValidationError
from safetensors.torch import load_file
from skillswarm.coordinator.candidates import merge_and_decide, own_targets, shortfall
from skillswarm.coordinator.config import EvalConfig, MergePlan
from skillswarm.coordinator.evaluation import Evaluator
from skillswarm.coordinator.publication import Decision
from skillswarm.merge.outer import (
    OuterOptimizer,
    OuterOptimizerConfig,
    commit_pending,
    load_state,
)
from skillswarm.merge.streaming import TaskVector
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.identity import load_or_create_identity

DOMAINS = ("math", "code", "search")


def _rows(math: float, code: float, search: float) -> dict[str, dict[str, float]]:
    scores = {"math": math, "code": code, "search": search}
    return {d: {"mean_reward": value} for d, value in scores.items()}


def test_shortfall_and_targets_on_known_numbers():
    gate = [
        {"label": "expert:math", "domain": "math", "base": 0.4, "expert": 0.7, "kept": True},
        {"label": "expert:code", "domain": "code", "base": 0.5, "expert": 0.45, "kept": True},
        {"label": "other:code", "domain": "code", "base": 0.5, "expert": 0.6, "kept": True},
        {"label": "expert:search", "domain": "search", "base": 0.5, "expert": 0.9, "kept": False},
        {"label": "expert:x", "domain": "x", "base": None, "expert": None, "kept": True},
    ]

    class Input:
        def __init__(self, label: str) -> None:
            self.label = label

    merging = [Input("expert:math"), Input("expert:code"), Input("other:code"), Input("expert:x")]
    # The best delta of a domain, at least the base; a delta left out by the gate, or of a
    # domain not evaluated, sets none.
    assert own_targets(gate, merging) == {"math": 0.7, "code": 0.6}
    targets = {"math": 0.7, "code": 0.6}
    assert shortfall(_rows(0.6, 0.55, 0.1), targets) == pytest.approx(0.1)
    assert shortfall(_rows(0.75, 0.3, 0.1), targets) == pytest.approx(0.3)
    assert shortfall(_rows(0.8, 0.7, 0.0), targets) == 0.0  # above every target


def test_shortfall_needs_the_own_domain_gate_and_whole_deltas():
    with pytest.raises(ValidationError, match="own_domain_gate"):
        MergePlan(choose_by="shortfall", own_domain_gate=False, domain_scale={})
    with pytest.raises(ValidationError, match="domain_scale"):
        MergePlan(choose_by="shortfall")  # the default halves math's deltas
    assert MergePlan(choose_by="shortfall", domain_scale={"code": 1.0}).choose_by == "shortfall"
    assert MergePlan().choose_by == "mean"


class _Scripted(Evaluator):
    """Validation scores by which deltas a checkpoint holds: each delta's share of one tensor's
    change from the base, projected on that delta (about 1 when merged, 0 when not)."""

    def __init__(self, base: dict, tuned: dict, script: dict[frozenset, dict]) -> None:
        super().__init__(EvalConfig(domains=list(DOMAINS), n_tasks=4))
        self.name = next(n for n, t in base.items() if t.ndim == 2 and "embed" not in n)
        self.base = base[self.name].float()
        self.deltas = {d: w[self.name].float() - self.base for d, w in tuned.items()}
        self.script = script
        self.seen: list[frozenset] = []

    def validation_scores(self, folder: Path, cache_as: str | None = None):
        (shard,) = sorted(Path(folder).glob("*.safetensors"))
        change = load_file(shard)[self.name].float() - self.base
        held = frozenset(
            d
            for d, delta in self.deltas.items()
            if torch.dot(change.flatten(), delta.flatten()) / delta.norm() ** 2 > 0.5
        )
        self.seen.append(held)
        return self.script[held]


def _run(
    tmp_path: Path,
    tiny_base: Path,
    plan: MergePlan,
    script: dict,
    targets: dict,
    outer: OuterOptimizerConfig | None = None,
):
    key = load_or_create_identity(tmp_path / "node.key")
    base = dict(iter_base_tensors(tiny_base))
    tuned = {d: noisy(base, seed=i, scale=1e-3) for i, d in enumerate(DOMAINS)}
    experts = expert_inputs(base, tuned, BlobStore(tmp_path / "blobs"), key)
    evaluator = _Scripted(base, tuned, script)
    work = tmp_path / "work"
    work.mkdir()
    verdict = merge_and_decide(
        plan,
        evaluator,
        OuterOptimizer(tmp_path / "outer", outer or OuterOptimizerConfig()),
        "b" * 64,
        tiny_base,
        experts,
        work,
        1,
        lambda scores: Decision(True, "passes"),
        lambda e: TaskVector(name=e.domain, expert=e.reader.expert),
        # The own-domain gate's records: each delta alone reached its domain's target.
        [
            {"label": f"expert:{d}", "domain": d, "base": 0.0, "expert": t, "kept": True}
            for d, t in targets.items()
        ],
    )
    return verdict, evaluator, work, base, tuned


ALL = frozenset(DOMAINS)
SCRIPT = {
    # The merge of all has the best mean, but code keeps none of its delta's gain (0.6 alone).
    ALL: _rows(0.80, 0.40, 0.60),
    frozenset({"code", "search"}): _rows(0.55, 0.58, 0.60),  # without math: math 0.2 short
    frozenset({"math", "search"}): _rows(0.80, 0.35, 0.60),
    frozenset({"math", "code"}): _rows(0.78, 0.55, 0.45),  # without search: search 0.15 short
}
TARGETS = {"math": 0.75, "code": 0.60, "search": 0.60}


def test_the_passing_merge_with_the_smallest_shortfall_is_published(tmp_path, tiny_base):
    plan = MergePlan(choose_by="shortfall", domain_scale={})
    verdict, evaluator, work, _, _ = _run(tmp_path, tiny_base, plan, SCRIPT, TARGETS)
    assert evaluator.seen == [ALL, *(ALL - {d} for d in DOMAINS)]  # every delta held or left out
    assert verdict.decision.publish
    assert [e.domain for e in verdict.merging] == ["math", "code"]
    records = {frozenset(r["merged"]): r["shortfall"] for r in verdict.subsets}
    assert records[frozenset(f"expert:{d}" for d in DOMAINS)] == pytest.approx(0.20)
    assert records[frozenset({"expert:math", "expert:code"})] == pytest.approx(0.15)
    # Only the chosen subset's checkpoint is left of the tries without one delta.
    assert sorted(p.name for p in work.glob("subset-*")) == ["subset-3"]
    assert verdict.candidate_dir.is_relative_to(work / "subset-3")

    # By mean validation reward (the default), the merge of all passes and goes out as it is.
    plan = MergePlan(domain_scale={})
    default, evaluator, *_ = _run(tmp_path / "mean", tiny_base, plan, SCRIPT, TARGETS)
    assert evaluator.seen == [ALL] and default.subsets == []
    assert len(default.merging) == 3 and default.decision.publish


def test_the_merge_of_all_stays_when_it_falls_least_short(tmp_path, tiny_base):
    script = SCRIPT | {ALL: _rows(0.80, 0.55, 0.60)}  # code 0.05 short, the least of the four
    plan = MergePlan(choose_by="shortfall", domain_scale={})
    verdict, evaluator, work, _, _ = _run(tmp_path, tiny_base, plan, script, TARGETS)
    assert len(evaluator.seen) == 4
    assert len(verdict.merging) == 3 and verdict.decision.publish
    assert verdict.candidate_dir == verdict.merged.folder  # the merge of all, an identity step
    assert list(work.glob("subset-*")) == []  # every try without one delta deleted

    # With outer momentum every try steps the optimizer; the state left pending is the merge
    # of all's (momentum g, the sum of the three deltas, on the first round), not the last try's.
    momentum = OuterOptimizerConfig(momentum=0.5)
    verdict, _, _, base, tuned = _run(tmp_path / "m", tiny_base, plan, script, TARGETS, momentum)
    assert len(verdict.merging) == 3
    state = tmp_path / "m" / "outer"
    commit_pending(state, "c" * 64)
    buffers = load_state(state, "c" * 64)
    assert buffers is not None
    name = next(n for n, t in base.items() if t.ndim == 2 and "embed" not in n)
    g = sum(tuned[d][name] - base[name] for d in DOMAINS)
    assert torch.allclose(buffers[name], g, atol=1e-5)
    published = load_file(next(verdict.candidate_dir.glob("*.safetensors")))[name]
    assert torch.allclose(published, base[name] + 1.5 * g, atol=1e-5)
