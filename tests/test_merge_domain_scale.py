"""A fixed factor per domain on the round's deltas (`MergePlan.domain_scale`): every merge of the
round takes base + s·Δ for a scaled domain's delta, and the delta itself for the others."""

from __future__ import annotations

import pytest
import torch
from delta_helpers import expert_inputs, merged_by, noisy
from pydantic import ValidationError
from skillswarm.coordinator.candidates import scaled_for_domain
from skillswarm.coordinator.config import MergePlan
from skillswarm.merge.streaming import TaskVector
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.identity import load_or_create_identity


def test_scales_are_bounded_and_halve_math_by_default():
    assert MergePlan().domain_scale == {"math": 0.5}
    # A plan naming its own method scales no domain unless it says so.
    assert MergePlan(method="linear").domain_scale == {}
    assert MergePlan(method="linear", domain_scale={"code": 2.0}).domain_scale == {"code": 2.0}
    assert MergePlan(domain_scale={}).domain_scale == {}
    assert MergePlan(domain_scale={"math": 0.5}).domain_scale == {"math": 0.5}
    for bad in ({"math": 0.0}, {"math": -1.0}, {"math": 2.5}, {"": 0.5}, {"m" * 65: 0.5}):
        with pytest.raises(ValidationError, match="domain_scale"):
            MergePlan(domain_scale=bad)
    with pytest.raises(ValidationError):
        MergePlan(domain_scale={f"d{i}": 0.5 for i in range(6)})


def test_an_unscaled_domain_keeps_its_vector_and_a_scaled_one_moves_part_way():
    plan = MergePlan(domain_scale={"math": 0.25})
    base = torch.tensor([1.0, -2.0, 0.5])
    tuned = torch.tensor([3.0, -2.0, 0.0])
    vector = TaskVector(name="a", expert=lambda name, b: tuned if name == "w" else None)
    assert scaled_for_domain(plan, "code", vector) is vector
    scaled = scaled_for_domain(plan, "math", vector)
    assert scaled.name == "a"
    assert torch.equal(scaled.expert("w", base), torch.tensor([1.5, -2.0, 0.375]))
    assert scaled.expert("other", base) is None  # a tensor the expert left alone stays so
    half = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    moved = TaskVector(name="b", expert=lambda name, b: b + 1)
    assert scaled_for_domain(plan, "math", moved).expert("w", half).dtype == torch.bfloat16


def test_a_merge_takes_each_domain_s_delta_at_its_scale(tmp_path, tiny_base):
    """Two deltas merged by task arithmetic at λ 1 with math's at 0.5: every tensor is the base
    plus half math's delta plus all of code's."""
    key = load_or_create_identity(tmp_path / "node.key")
    base = dict(iter_base_tensors(tiny_base))
    blobs = BlobStore(tmp_path / "blobs")
    tuned = {domain: noisy(base, seed=i, scale=1e-3) for i, domain in enumerate(("math", "code"))}
    experts = expert_inputs(base, tuned, blobs, key)
    plan = MergePlan(
        method="task_arithmetic", parameters={"weight": 1.0}, domain_scale={"math": 0.5}
    )
    merged = merged_by(plan, tiny_base, experts, tmp_path / "work")
    for name, tensor in base.items():
        expected = tensor + 0.5 * (tuned["math"][name] - tensor) + (tuned["code"][name] - tensor)
        assert torch.allclose(merged[name], expected, atol=1e-6), name
        whole = tensor + (tuned["math"][name] - tensor) + (tuned["code"][name] - tensor)
        if not torch.allclose(tuned["math"][name], tensor, atol=1e-5):
            assert not torch.allclose(merged[name], whole, atol=1e-6), name
