"""Tensors the merge keeps at the base (`MergePlan.keep_base_tensors`): left out of every task
vector, so the published merge holds the base's weights there and the deltas' sum elsewhere."""

from __future__ import annotations

import pytest
import torch
from delta_helpers import expert_inputs, merged_by, noisy
from pydantic import ValidationError
from safetensors.torch import load_file
from skillswarm.coordinator.candidates import gate_by_own_domain
from skillswarm.coordinator.config import VOCABULARY_TENSORS, EvalConfig, MergePlan
from skillswarm.coordinator.evaluation import Evaluator, expert_folder
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.identity import load_or_create_identity

EMBEDDING = "model.embed_tokens.weight"
VOCABULARY = VOCABULARY_TENSORS


def test_patterns_name_the_tensors_kept_and_are_bounded():
    plan = MergePlan(keep_base_tensors=list(VOCABULARY))
    assert plan.keeps_base(EMBEDDING) and plan.keeps_base("lm_head.weight")
    assert not plan.keeps_base("model.layers.0.mlp.up_proj.weight")
    assert not plan.keeps_base("model.norm.weight")
    # The default keeps the embedding and the head; [] merges every tensor; a plan naming its
    # own method keeps only what it lists.
    assert MergePlan().keep_base_tensors == list(VOCABULARY) and MergePlan().keeps_base(EMBEDDING)
    assert not MergePlan(keep_base_tensors=[]).keeps_base(EMBEDDING)
    assert not MergePlan(method="linear").keeps_base(EMBEDDING)
    assert MergePlan(method="linear", keep_base_tensors=list(VOCABULARY)).keeps_base(EMBEDDING)
    assert MergePlan(keep_base_tensors=["*.norm.weight"]).keeps_base("model.norm.weight")
    with pytest.raises(ValidationError, match="keep_base_tensors"):
        MergePlan(keep_base_tensors=[""])
    with pytest.raises(ValidationError, match="keep_base_tensors"):
        MergePlan(keep_base_tensors=["x" * 201])
    with pytest.raises(ValidationError):
        MergePlan(keep_base_tensors=["a"] * 17)


def test_a_domain_qualified_pattern_keeps_only_that_domains_tensors():
    plan = MergePlan(keep_base_tensors=["search:*embed_tokens.weight", "*.norm.weight"])
    assert plan.kept_for("search") == ["*embed_tokens.weight", "*.norm.weight"]
    assert plan.kept_for("math") == ["*.norm.weight"] and plan.kept_for(None) == ["*.norm.weight"]
    assert plan.keeps_base(EMBEDDING, "search") and not plan.keeps_base(EMBEDDING, "math")
    assert not plan.keeps_base(EMBEDDING) and plan.keeps_base("model.norm.weight", "code")
    for bad in [":x", "search:", "a:b:c", "d" * 65 + ":x"]:
        with pytest.raises(ValidationError, match="DOMAIN:GLOB"):
            MergePlan(keep_base_tensors=[bad])


def test_a_merge_keeps_a_tensor_at_the_base_only_in_the_domain_named(tmp_path, tiny_base):
    """search's embedding is left out of its task vector, math's is summed: the merged
    embedding is the base plus math's delta alone, every other tensor the base plus both."""
    key = load_or_create_identity(tmp_path / "node.key")
    base = dict(iter_base_tensors(tiny_base))
    blobs = BlobStore(tmp_path / "blobs")
    tuned = {d: noisy(base, seed=i, scale=1e-3) for i, d in enumerate(("math", "search"))}
    experts = expert_inputs(base, tuned, blobs, key)
    plan = MergePlan(
        method="task_arithmetic",
        parameters={"weight": 1.0},
        keep_base_tensors=["search:*embed_tokens.weight"],
    )
    merged = merged_by(plan, tiny_base, experts, tmp_path / "work")
    for name, tensor in base.items():
        domains = ["math"] if name == EMBEDDING else ["math", "search"]
        summed = tensor + sum(tuned[d][name] - tensor for d in domains)
        assert torch.allclose(merged[name], summed, atol=1e-6), name
    assert not torch.allclose(
        merged[EMBEDDING],
        base[EMBEDDING] + sum(tuned[d][EMBEDDING] - base[EMBEDDING] for d in tuned),
    )


@pytest.mark.parametrize("keep", [list(VOCABULARY), []])
def test_a_merge_leaves_the_kept_tensors_at_the_base_and_sums_the_rest(tmp_path, tiny_base, keep):
    """Two deltas merged by task arithmetic at λ 1 (one spec, published): every tensor is the
    base plus both deltas, except those the plan keeps, which are the base's bit for bit."""
    key = load_or_create_identity(tmp_path / "node.key")
    base = dict(iter_base_tensors(tiny_base))
    assert EMBEDDING in base
    blobs = BlobStore(tmp_path / "blobs")
    tuned = {domain: noisy(base, seed=i, scale=1e-3) for i, domain in enumerate(("math", "code"))}
    experts = expert_inputs(base, tuned, blobs, key)
    plan = MergePlan(method="task_arithmetic", parameters={"weight": 1.0}, keep_base_tensors=keep)
    merged = merged_by(plan, tiny_base, experts, tmp_path / "work")
    kept = [name for name in base if plan.keeps_base(name)]
    assert kept == ([] if keep == [] else [EMBEDDING])
    for name, tensor in base.items():
        if name in kept:
            assert torch.equal(merged[name], tensor), name
        else:
            summed = tensor + (tuned["math"][name] - tensor) + (tuned["code"][name] - tensor)
            assert torch.allclose(merged[name], summed, atol=1e-6), name
            assert not torch.equal(merged[name], tensor), name


def test_the_own_domain_gate_scores_a_delta_as_the_merge_applies_it(tmp_path, tiny_base):
    """The gate judges what the merge would add: the expert it scores holds the base's
    embedding where the plan keeps it, and the node's weights everywhere else."""
    key = load_or_create_identity(tmp_path / "node.key")
    base = dict(iter_base_tensors(tiny_base))
    blobs = BlobStore(tmp_path / "blobs")
    tuned = {"math": noisy(base, seed=5, scale=1e-3)}
    experts = expert_inputs(base, tuned, blobs, key)
    work = tmp_path / "work"
    plan = MergePlan(keep_base_tensors=list(VOCABULARY))
    evaluator = Evaluator(EvalConfig(domains=["math"], n_tasks=2))
    merging, gate = gate_by_own_domain(plan, evaluator, "b" * 64, tiny_base, experts, work)
    assert [entry["domain"] for entry in gate] == ["math"]
    assert gate[0]["expert"] is not None and gate[0]["base"] is not None
    assert merging == experts[: len(merging)]
    scored = list((work / "experts").iterdir())
    assert scored == [expert_folder(tiny_base, experts[0], work, plan.kept_for("math"))]
    weights = load_file(scored[0] / "model.safetensors")
    assert torch.equal(weights[EMBEDDING], base[EMBEDDING])
    moved = [name for name in base if not torch.equal(weights[name], base[name])]
    assert moved and EMBEDDING not in moved
