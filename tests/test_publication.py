"""The no-regression rule: the verdict on known outcomes, and a real Coordinator on the embedded
base that holds back a merge made worse by a degrading delta (the round is held, `main` stays,
the next round opens on the same base) and publishes one that is better."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from delta_helpers import current_base_tensors, expert_inputs, hand_in_delta, noisy
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file
from skillswarm.coordinator.app import create_app
from skillswarm.coordinator.candidates import merge_and_decide
from skillswarm.coordinator.config import (
    CoordinatorConfig,
    EvalConfig,
    MergePlan,
    PublishPolicy,
    RoundPolicy,
)
from skillswarm.coordinator.evaluation import Evaluator, gate_verdict
from skillswarm.coordinator.publication import Decision, compare_rows, publication_decision
from skillswarm.coordinator.service import Coordinator
from skillswarm.coordinator.store import DeltaRecord
from skillswarm.merge.outer import OuterOptimizer, OuterOptimizerConfig, load_state
from skillswarm.merge.streaming import TaskVector
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.identity import load_or_create_identity


def _row(successes: list[int]) -> dict:
    return {
        "successes": successes,
        "rewards": [float(s) for s in successes],
        "task_ids": [f"t{i}" for i in range(len(successes))],
    }


def test_a_candidate_worse_on_one_domain_is_held():
    base = {"math": _row([1] * 20 + [0] * 12), "code": _row([1] * 8 + [0] * 24)}
    candidate = {"math": _row([1] * 4 + [0] * 28), "code": _row([1] * 16 + [0] * 16)}
    decision = publication_decision(base, candidate, PublishPolicy())
    assert not decision.publish
    assert "math" in decision.reason and "code" not in decision.reason
    math = decision.comparisons["math"]
    assert math["mean"] == pytest.approx(-0.5) and math["p_worse"] == pytest.approx(0.5**16)
    assert math["high"] < 0 < decision.comparisons["code"]["low"]


def test_a_better_or_equal_candidate_is_published():
    base = {"math": _row([1] * 10 + [0] * 22), "code": _row([1, 0] * 16)}
    better = {"math": _row([1] * 20 + [0] * 12), "code": _row([1, 0] * 16)}
    decision = publication_decision(base, better, PublishPolicy())
    assert decision.publish, decision.reason
    assert decision.comparisons["math"]["mean"] == pytest.approx(10 / 32)
    assert decision.comparisons["code"]["mean"] == 0


def test_noise_does_not_hold_and_the_rule_can_be_turned_off():
    base = {"math": _row([1, 1, 1, 0] * 8)}
    noisy = {"math": _row([1, 1, 0, 1] * 7 + [1, 0, 0, 0])}  # two fewer, within noise
    assert publication_decision(base, noisy, PublishPolicy()).publish
    worse = {"math": _row([0] * 32)}
    assert not publication_decision(base, worse, PublishPolicy()).publish
    off = publication_decision(base, worse, PublishPolicy(no_regression=False))
    assert off.publish and off.comparisons["math"]["mean"] == pytest.approx(-0.75)
    margin = publication_decision(base, worse, PublishPolicy(margin=0.8))
    assert margin.publish


def test_small_losses_that_add_up_below_round_zero_are_held():
    # Round 0 solved 24 of 32; the current base, one small loss later, 20; the candidate 16.
    origin = {"math": _row([1] * 24 + [0] * 8)}
    base = {"math": _row([1] * 20 + [0] * 12)}
    candidate = {"math": _row([1] * 16 + [0] * 16)}
    assert publication_decision(base, candidate, PublishPolicy()).publish  # within noise of base
    decision = publication_decision(base, candidate, PublishPolicy(), origin_scores=origin)
    assert not decision.publish
    assert "round-0" in decision.reason and "current base" not in decision.reason
    assert decision.origin_comparisons["math"]["mean"] == pytest.approx(-0.25)
    assert decision.to_dict()["origin_comparisons"]["math"]["p_worse"] < 0.05
    assert decision.comparisons["math"]["mean"] == pytest.approx(-0.125)
    off = publication_decision(
        base, candidate, PublishPolicy(against_origin=False), origin_scores=origin
    )
    assert off.publish and off.origin_comparisons is None
    assert "origin_comparisons" not in off.to_dict()
    recovered = publication_decision(base, origin, PublishPolicy(), origin_scores=origin)
    assert recovered.publish and "round 0" in recovered.reason


def test_rows_of_different_tasks_are_not_compared():
    a, b = _row([1, 0]), _row([1, 0])
    b["task_ids"] = ["x", "y"]
    with pytest.raises(ValueError, match="different tasks"):
        compare_rows(a, b)
    with pytest.raises(ValueError, match="per-task"):
        compare_rows({"success_rate": 0.5}, a)


def _gate_row(successes: list[int]) -> dict:
    """A validation row as the own-domain gate reads it: per-task outcomes and the mean reward."""
    return _row(successes) | {"mean_reward": sum(successes) / len(successes)}


def test_the_gate_with_a_level_leaves_out_only_a_delta_below_the_base_beyond_noise():
    base = _gate_row([1] * 30 + [0] * 30)
    # Two tasks lost, none gained: below the base, within noise.
    slightly = _gate_row([1] * 28 + [0] * 32)
    # Fourteen tasks lost, none gained: beyond noise.
    clearly = _gate_row([1] * 16 + [0] * 44)
    assert gate_verdict(base, slightly, 0) == {"kept": False}
    assert gate_verdict(base, clearly, 0) == {"kept": False}
    assert gate_verdict(base, base, 0) == {"kept": True}
    within = gate_verdict(base, slightly, 0.05)
    assert within["kept"] and within["p_worse"] >= 0.05
    beyond = gate_verdict(base, clearly, 0.05)
    assert not beyond["kept"] and beyond["p_worse"] < 0.05
    # A looser level leaves out more: two losses out of two are p = 0.25 by the sign test.
    assert not gate_verdict(base, slightly, 0.3)["kept"]
    with pytest.raises(ValueError, match="per-task rewards"):
        gate_verdict({"mean_reward": 0.5}, slightly, 0.05)


def test_the_gate_with_a_minimum_gain_leaves_out_a_delta_that_gains_less():
    base = _gate_row([1] * 30 + [0] * 30)
    one_more = _gate_row([1] * 31 + [0] * 29)
    two_more = _gate_row([1] * 32 + [0] * 28)
    two_less = _gate_row([1] * 28 + [0] * 32)
    for alpha in (0.0, 0.05):
        # One task gained of the two asked for: left out, and the record says why.
        short = gate_verdict(base, one_more, alpha, min_gain=2 / 60)
        assert not short["kept"] and short["short_of_min_gain"]
        # Exactly the minimum, a mean of 32/60 against 30/60, is enough.
        reached = gate_verdict(base, two_more, alpha, min_gain=2 / 60)
        assert reached["kept"] and "short_of_min_gain" not in reached
        # Off by default: a delta that gains nothing is kept.
        assert gate_verdict(base, base, alpha)["kept"]
    # Below the base, within noise: kept by the level alone, left out by the minimum gain.
    assert gate_verdict(base, two_less, 0.05)["kept"]
    assert gate_verdict(base, two_less, 0.05, min_gain=1 / 60)["short_of_min_gain"]
    # Below the base at the level: left out for that, not for the gain.
    beyond = gate_verdict(base, two_less, 0.3, min_gain=1 / 60)
    assert not beyond["kept"] and "short_of_min_gain" not in beyond
    with pytest.raises(ValueError):
        MergePlan(own_domain_min_gain=-0.1)
    with pytest.raises(ValueError):
        MergePlan(own_domain_min_gain=1.5)


def _degraded(base_dir: Path, out: Path, scale: float = 0.5, seed: int = 0) -> Path:
    """A copy of `base_dir` with Gaussian noise of `scale` × each tensor's RMS on its weights."""
    shutil.copytree(base_dir, out)
    tensors = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.ndim == 2:
            rms = tensor.float().pow(2).mean().sqrt()
            noise = torch.randn(tensor.shape, generator=generator) * rms * scale
            tensors[name] = (tensor.float() + noise).to(tensor.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _coordinator(
    tmp_path: Path,
    base: Path,
    gate: bool = False,
    gate_alpha: float = MergePlan().own_domain_gate_alpha,
    min_gain: float = 0.0,
    quorum: int = 1,
    subsets: bool = True,
    outer: OuterOptimizerConfig | None = None,
) -> Coordinator:
    """A coordinator scoring math on 24 validation tasks; the own-domain gate off unless asked,
    so that the publication rule alone judges the merge, and math's deltas merged whole over
    every tensor (no domain_scale, no keep_base_tensors), so that a delta's merge moves the base
    by the delta."""
    config = CoordinatorConfig(
        work_dir=tmp_path / "coord",
        p2p_port=0,
        base_checkpoint=base,
        round=RoundPolicy(min_deltas=quorum),
        eval=EvalConfig(domains=["math"], n_tasks=24, experts="none"),
        merge=MergePlan(
            own_domain_gate=gate,
            own_domain_gate_alpha=gate_alpha,
            own_domain_min_gain=min_gain,
            subsets_on_hold=subsets,
            domain_scale={},
            keep_base_tensors=[],
        ),
        outer=outer or OuterOptimizerConfig(),
    )
    coordinator = Coordinator(config)
    coordinator.prepare()
    return coordinator


def test_a_degrading_delta_is_held_and_a_restoring_one_published(tmp_path, tiny_base):
    degraded = _degraded(tiny_base, tmp_path / "degraded")
    key = load_or_create_identity(tmp_path / "node.key")

    holding = _coordinator(tmp_path / "holding", tiny_base)
    try:
        base_id = holding.current_base().id
        record = hand_in_delta(holding, key, current_base_tensors_of(degraded))
        rounds = holding.rounds
        held = rounds.round_record(1)
        assert held["status"] == "held", held
        decision = held["decision"]
        assert not decision["publish"] and "math" in decision["reason"]
        comparison = decision["comparisons"]["math"]
        assert comparison["high"] < 0 and comparison["p_worse"] < 0.05
        assert holding.current_base().id == base_id  # nothing was published
        assert [i.round for i in holding.registry.list()] == [0]
        assert rounds.current_round().number == 2
        assert rounds.current_round().base_id == base_id
        with holding.store.session() as s:
            delta = s.get(DeltaRecord, record.id)
            assert (delta.status, delta.rejection_kind) == ("rejected", "held")
        listed = TestClient(create_app(holding)).get("/v1/rounds").json()
        assert listed[0]["status"] == "held" and listed[0]["decision"] == decision
    finally:
        holding.store.close()

    restoring = _coordinator(tmp_path / "restoring", degraded)
    try:
        degraded_id = restoring.current_base().id
        hand_in_delta(restoring, key, current_base_tensors_of(tiny_base))
        published = restoring.rounds.round_record(1)
        assert published["status"] == "published", published["error"]
        assert published["decision"]["publish"]
        assert published["decision"]["comparisons"]["math"]["mean"] > 0
        assert restoring.current_base().id != degraded_id
        assert restoring.current_base().id == published["checkpoint_id"]
    finally:
        restoring.store.close()


def current_base_tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_a_delta_that_lowers_its_own_domain_is_left_out_of_the_merge(tmp_path, tiny_base):
    degraded = _degraded(tiny_base, tmp_path / "degraded")
    harmless_key = load_or_create_identity(tmp_path / "harmless.key")
    harmful_key = load_or_create_identity(tmp_path / "harmful.key")

    both = _coordinator(tmp_path / "both", tiny_base, gate=True, quorum=2)
    try:
        harmless = hand_in_delta(both, harmless_key, noisy(current_base_tensors(both), seed=1))
        harmful = hand_in_delta(both, harmful_key, current_base_tensors_of(degraded))
        published = both.rounds.round_record(1)
        assert published["status"] == "published", published["error"]
        assert published["inputs"] == [harmless.id, harmful.id]  # both on record
        gate = {entry["label"].rsplit(":", 1)[1]: entry for entry in published["decision"]["gate"]}
        kept, left_out = gate[harmless.id[:12]], gate[harmful.id[:12]]
        assert kept["kept"] and kept["expert"] >= kept["base"]
        assert not left_out["kept"] and left_out["expert"] < left_out["base"]
        assert left_out["p_worse"] < 0.05 <= kept["p_worse"]
        # Merged, the harmful delta would have held the round (the first test); left out, the
        # merge keeps the base's math.
        assert published["decision"]["comparisons"]["math"]["mean"] >= 0
    finally:
        both.store.close()

    alone = _coordinator(tmp_path / "alone", tiny_base, gate=True, gate_alpha=0.0)
    try:
        base_id = alone.current_base().id
        hand_in_delta(alone, harmful_key, current_base_tensors_of(degraded))
        held = alone.rounds.round_record(1)
        assert held["status"] == "held"
        assert "below the base on its own domain" in held["decision"]["reason"]
        # With the gate's level at 0, any shortfall leaves the delta out, and no test is run.
        [entry] = held["decision"]["gate"]
        assert not entry["kept"] and "p_worse" not in entry
        assert alone.current_base().id == base_id
        assert alone.rounds.current_round().base_id == base_id
    finally:
        alone.store.close()


def test_a_delta_short_of_the_minimum_gain_on_its_own_domain_is_left_out(tmp_path, tiny_base):
    degraded = _degraded(tiny_base, tmp_path / "degraded")
    key = load_or_create_identity(tmp_path / "node.key")
    # A delta back to the undegraded weights gains on math, but not the whole of it.
    strict = _coordinator(tmp_path / "strict", degraded, gate=True, min_gain=1.0)
    try:
        base_id = strict.current_base().id
        hand_in_delta(strict, key, current_base_tensors_of(tiny_base))
        held = strict.rounds.round_record(1)
        assert held["status"] == "held"
        assert held["decision"]["reason"] == (
            "every delta scored below the base on its own domain or gained less than 1 there"
        )
        [entry] = held["decision"]["gate"]
        assert not entry["kept"] and entry["short_of_min_gain"]
        gain = entry["expert"] - entry["base"]
        assert 0 < gain < 1.0
        assert strict.current_base().id == base_id
    finally:
        strict.store.close()

    # The same delta against the minimum it reaches is merged and published.
    reached = _coordinator(tmp_path / "reached", degraded, gate=True, min_gain=gain)
    try:
        hand_in_delta(reached, key, current_base_tensors_of(tiny_base))
        published = reached.rounds.round_record(1)
        assert published["status"] == "published", published["error"]
        [entry] = published["decision"]["gate"]
        assert entry["kept"] and "short_of_min_gain" not in entry
        assert entry["expert"] - entry["base"] == pytest.approx(gain)
    finally:
        reached.store.close()


def test_from_round_two_a_candidate_is_also_compared_with_round_zero(tmp_path, tiny_base):
    degraded = _degraded(tiny_base, tmp_path / "degraded")
    key = load_or_create_identity(tmp_path / "node.key")
    coordinator = _coordinator(tmp_path / "coord", tiny_base)
    try:
        origin_id = coordinator.current_base().id
        rounds = coordinator.rounds
        # Round 1 publishes the degraded weights under a rule that allows any fall.
        strict = rounds.config.publish
        rounds.config = rounds.config.model_copy(update={"publish": PublishPolicy(margin=1.0)})
        hand_in_delta(coordinator, key, current_base_tensors_of(degraded))
        first = rounds.round_record(1)
        assert first["status"] == "published", first["error"]
        assert "origin_comparisons" not in first["decision"]  # round 0 was the base
        # Round 2's candidate equals its base, but round 0 was better: the default rule holds it.
        rounds.config = rounds.config.model_copy(update={"publish": strict})
        round_one_id = coordinator.current_base().id
        hand_in_delta(coordinator, key, current_base_tensors(coordinator))
        second = rounds.round_record(2)
        assert second["status"] == "held", second
        decision = second["decision"]
        assert "round-0 checkpoint" in decision["reason"], decision["reason"]
        assert "current base" not in decision["reason"]
        assert decision["comparisons"]["math"]["mean"] == 0
        assert decision["origin_comparisons"]["math"]["high"] < 0
        assert coordinator.current_base().id == round_one_id != origin_id
    finally:
        coordinator.store.close()


def test_a_held_merge_is_tried_again_without_each_delta_and_the_passing_subset_published(
    tmp_path, tiny_base
):
    """Two deltas, the gate off: one harmless, one that wrecks math. Their merge is held; merged
    again without each in turn, the harmless one alone passes and is published, its tensors the
    base plus the outer step on its delta at the chosen spec's weight. With subsets_on_hold off
    the round is held."""
    wrecked = _degraded(tiny_base, tmp_path / "wrecked", scale=0.9)
    harmless_key = load_or_create_identity(tmp_path / "harmless.key")
    harmful_key = load_or_create_identity(tmp_path / "harmful.key")

    # Nesterov momentum 0.5: the published step is 1.5 g, and the momentum kept is g, of the
    # subset that passed, not of the last merge tried.
    outer = OuterOptimizerConfig(momentum=0.5)
    coordinator = _coordinator(tmp_path / "subsets", tiny_base, quorum=2, outer=outer)
    try:
        base = current_base_tensors(coordinator)
        tuned = noisy(base, seed=1)
        # The harmful delta first: its subset is tried last, after the one that passes.
        harmful = hand_in_delta(coordinator, harmful_key, current_base_tensors_of(wrecked))
        harmless = hand_in_delta(coordinator, harmless_key, tuned, base=base)
        published = coordinator.rounds.round_record(1)
        assert published["status"] == "published", published
        decision = published["decision"]
        subsets = decision["subsets"]
        assert [len(s["merged"]) for s in subsets] == [1, 1]
        passing = [s for s in subsets if s["publish"]]
        assert len(passing) == 1 and passing[0]["merged"][0].endswith(harmless.id[:12])
        held = next(s for s in subsets if not s["publish"])
        assert held["merged"][0].endswith(harmful.id[:12]) and "math" in held["reason"]
        assert decision["publish"] and decision["comparisons"]["math"]["p_worse"] >= 0.05
        assert published["inputs"] == [harmful.id, harmless.id]  # both on record
        weight = published["method"]["parameters"]["weight"]
        merged = current_base_tensors(coordinator)
        momentum = load_state(coordinator.rounds.outer.state_dir, published["checkpoint_id"])
        assert momentum is not None
        for name, tensor in base.items():
            g = weight * (tuned[name] - tensor)
            assert torch.allclose(merged[name], tensor + 1.5 * g, atol=1e-6), name
            assert torch.allclose(momentum[name], g, atol=1e-6), name
    finally:
        coordinator.store.close()

    without = _coordinator(tmp_path / "no-subsets", tiny_base, quorum=2, subsets=False)
    try:
        base_id = without.current_base().id
        hand_in_delta(without, harmless_key, noisy(current_base_tensors(without), seed=1))
        hand_in_delta(without, harmful_key, current_base_tensors_of(wrecked))
        held_round = without.rounds.round_record(1)
        assert held_round["status"] == "held", held_round
        assert held_round["decision"]["subsets"] == []
        assert without.current_base().id == base_id
    finally:
        without.store.close()


def test_subsets_are_searched_down_to_one_delta_from_the_best_scoring_subset(tmp_path, tiny_base):
    """Three deltas; a scripted rule holds the full merge and every pair, and passes only the
    second single tried. The search goes on from the best-scoring pair, so the singles it tries
    are that pair's, and the verdict merges that single delta, the outer step its folder."""
    key = load_or_create_identity(tmp_path / "node.key")
    base = dict(iter_base_tensors(tiny_base))
    blobs = BlobStore(tmp_path / "blobs")
    tuned = {d: noisy(base, seed=i, scale=1e-4) for i, d in enumerate(("math", "code", "search"))}
    experts = expert_inputs(base, tuned, blobs, key)
    evaluator = Evaluator(EvalConfig(domains=["math"], n_tasks=4))
    calls: list[int] = []

    def decide(scores):
        calls.append(len(calls))
        publish = len(calls) == 6  # 1 full merge, 3 pairs, then the second single
        return Decision(publish, "passes" if publish else "held by the script")

    work = tmp_path / "work"
    work.mkdir()
    verdict = merge_and_decide(
        MergePlan(),
        evaluator,
        OuterOptimizer(tmp_path / "outer", OuterOptimizerConfig()),
        "b" * 64,
        tiny_base,
        experts,
        work,
        1,
        decide,
        lambda e: TaskVector(name=e.domain, expert=e.reader.expert),
    )
    subsets = verdict.subsets
    assert len(subsets) == 5 and len(calls) == 6
    pairs, singles = subsets[:3], subsets[3:]
    assert [s["merged"] for s in pairs] == [
        ["expert:code", "expert:search"],
        ["expert:math", "expert:search"],
        ["expert:math", "expert:code"],
    ]
    best_pair = max(pairs, key=lambda s: s["score"])["merged"]
    assert [s["merged"] for s in singles] == [best_pair[1:], best_pair[:1]]
    assert [s["publish"] for s in subsets] == [False] * 4 + [True]
    assert verdict.decision.publish and [e.label for e in verdict.merging] == best_pair[:1]
    assert verdict.candidate_dir == verdict.merged.folder  # an identity outer step
    # Each try that lost was deleted at once: only the chosen subset's checkpoint is left.
    assert sorted(p.name for p in work.glob("subset-*")) == ["subset-4"]
    assert verdict.merged.folder.is_relative_to(work / "subset-4")
    assert verdict.merged.spec in MergePlan().specs()

    calls.clear()
    plan = MergePlan(subsets_on_hold=False)
    held = merge_and_decide(
        plan, evaluator, OuterOptimizer(tmp_path / "outer2", OuterOptimizerConfig()), "b" * 64,
        tiny_base, experts, tmp_path / "work2", 1, decide,
        lambda e: TaskVector(name=e.domain, expert=e.reader.expert),
    )  # fmt: skip
    assert not held.decision.publish and held.subsets == [] and len(calls) == 1
    assert len(held.merging) == 3
