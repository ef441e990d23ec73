"""The gates a delta passes before it may join a merge: layout, finiteness, relative norm and the
evaluation gate. Each refusal is recorded with its reason and kind, and the delta is never merged.

Deltas are signed by real identities and handed to a real Coordinator (store, registry, blob
store, mergekit, rollout evaluation) the way its intake does once the blobs are fetched; the
libp2p path in front of it is covered by test_coordinator_intake.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from delta_helpers import hand_in_delta
from pydantic import ValidationError
from skillswarm.coordinator.config import (
    CoordinatorConfig,
    EvalConfig,
    GateConfig,
    MergePlan,
    RoundPolicy,
    matches_any,
)
from skillswarm.coordinator.evaluation import ExpertInput, expert_folder
from skillswarm.coordinator.gates import (
    DeltaRejected,
    check_domain_scores,
    relative_norm,
    write_expert_checkpoint,
)
from skillswarm.coordinator.service import Coordinator
from skillswarm.coordinator.store import DeltaRecord
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import DeltaReader, pack_delta
from skillswarm.protocol.identity import (
    KeyPair,
    load_or_create_identity,
    peer_id_of,
    public_key_bytes,
)

GROWN_TENSOR = "model.layers.0.mlp.down_proj.weight"
# eval.validation_seed whose 8 held-out math tasks the embedded base solves well (5 of 8 when
# measured), so a fall is visible; the reported table uses eval.seed.
GATE_VALIDATION_SEED = 8


def _coordinator(tmp_path: Path, base: Path, **fields) -> Coordinator:
    defaults = {
        "work_dir": tmp_path / "coord",
        "p2p_port": 0,
        "base_checkpoint": base,
        "eval": EvalConfig(n_tasks=1),
        "round": RoundPolicy(min_deltas=10),  # merges only when the test asks
    }
    c = Coordinator(CoordinatorConfig(**(defaults | fields)))
    c.prepare()
    return c


def _noisy(tensors: dict[str, torch.Tensor], ratio: float, seed: int) -> dict[str, torch.Tensor]:
    """Each tensor moved by Gaussian noise of `ratio` times its RMS (floored like the gate)."""
    generator = torch.Generator().manual_seed(seed)
    tuned = {}
    for name, tensor in tensors.items():
        rms = max(float(tensor.pow(2).mean().sqrt()), GateConfig().relative_norm_floor)
        tuned[name] = tensor + ratio * rms * torch.randn(tensor.shape, generator=generator)
    return tuned


def _hand_in(
    c: Coordinator,
    key: KeyPair,
    tuned: dict[str, torch.Tensor],
    domain: str = "math",
    base: dict[str, torch.Tensor] | None = None,
) -> DeltaRecord:
    """Sign a delta of `tuned` against the current base (or `base`), put its blobs in the
    coordinator's store as a fetch would, and hand in the announcement."""
    return hand_in_delta(c, key, tuned, base=base, domain=domain, steps=8)


# -- the gate functions --------------------------------------------------------------------------


def test_relative_norm_is_per_tensor_and_floors_tiny_base_tensors():
    base = torch.full((100,), 0.5)
    assert relative_norm(base * 1.1, base, floor_rms=0.01) == pytest.approx(0.1)
    zeros = torch.zeros(100)
    # A tensor that starts at zero is measured against the floor RMS, not refused outright.
    assert relative_norm(zeros + 0.001, zeros, floor_rms=0.01) == pytest.approx(0.1)
    assert relative_norm(zeros + 0.001, zeros, floor_rms=0.0) == math.inf
    assert relative_norm(zeros, zeros, floor_rms=0.0) == 0.0
    big = torch.full((4,), 3e38)  # float32 overflow is avoided by computing in float64
    assert relative_norm(big, big * 0.5, floor_rms=0.0) == pytest.approx(1.0)


def test_domain_score_rules_spare_the_own_domain_and_a_base_already_below_the_minimum():
    gates = GateConfig(eval_gate=True, min_other_domain_score=0.1, max_other_domain_drop=0.3)
    base = {"math": 0.6, "code": 0.05, "search": 0.5}
    check_domain_scores("math", {"math": 0.0, "code": 0.0, "search": 0.4}, base, gates)
    with pytest.raises(DeltaRejected, match="drops search from 0.500 to 0.150") as drop:
        check_domain_scores("math", {"math": 0.9, "code": 0.05, "search": 0.15}, base, gates)
    assert drop.value.kind == "eval"
    with pytest.raises(DeltaRejected, match="scores 0.050 on search") as floor:
        check_domain_scores("code", {"code": 0.9, "math": 0.6, "search": 0.05}, base, gates)
    assert "below the minimum 0.1" in str(floor.value)


def test_gate_and_eval_config_refuse_settings_that_cannot_work():
    with pytest.raises(ValidationError, match="min_other_domain_score or"):
        GateConfig(eval_gate=True)
    with pytest.raises(ValidationError, match="validation_seed"):
        EvalConfig(seed=3, validation_seed=3)
    assert EvalConfig(seed=3).validation_tasks_seed() == 4
    assert EvalConfig(n_tasks=64).validation_task_count() == 64
    assert EvalConfig(n_tasks=64, validation_tasks=512).validation_task_count() == 512
    with pytest.raises(ValidationError, match="validation_tasks"):
        EvalConfig(validation_tasks=0)


def test_expert_checkpoint_is_base_plus_delta_bit_for_bit(tmp_path: Path, tiny_base: Path):
    key = load_or_create_identity(tmp_path / "k.key")
    store = BlobStore(tmp_path / "blobs")
    base = dict(iter_base_tensors(tiny_base))
    tuned = _noisy(base, 0.05, seed=3)
    tuned["model.norm.weight"] = base["model.norm.weight"]  # one tensor left unchanged
    manifest = pack_delta(
        base,
        tuned,
        store,
        peer_id=peer_id_of(key),
        public_key=public_key_bytes(key),
        domain="math",
        base_id="ab" * 32,
        round=1,
        steps=1,
    )
    out = write_expert_checkpoint(tiny_base, DeltaReader(manifest, store), tmp_path / "expert")
    written = dict(iter_base_tensors(out))
    assert set(written) == set(base)
    for name, tensor in written.items():
        assert torch.equal(tensor, tuned[name].to(base[name].dtype)), name
    assert (out / "config.json").read_bytes() == (tiny_base / "config.json").read_bytes()
    assert (out / "tokenizer.json").is_file()

    # Within a round the gate and the evaluation table share one written copy of each expert.
    expert = ExpertInput("expert:math:abc", "math", DeltaReader(manifest, store))
    work = tmp_path / "round-work"
    folder = expert_folder(tiny_base, expert, work)
    weights = next(folder.glob("*.safetensors"))
    written_at = weights.stat().st_mtime_ns
    assert expert_folder(tiny_base, expert, work) == folder
    assert weights.stat().st_mtime_ns == written_at
    assert not list((work / "experts").glob("*.partial"))
    assert dict(iter_base_tensors(folder)).keys() == written.keys()
    for name, tensor in iter_base_tensors(folder):
        assert torch.equal(tensor, written[name]), name
    other = ExpertInput("expert:math:def", "math", DeltaReader(manifest, store))
    assert expert_folder(tiny_base, other, work) != folder

    # With tensors kept at the base, the expert is scored as the merge would apply it: those
    # tensors are the base's, every other one the node's, in a folder of its own.
    kept = ["*embed_tokens.weight", "model.norm.weight"]
    partly = expert_folder(tiny_base, expert, work, kept)
    assert partly != folder
    changed = 0
    for name, tensor in iter_base_tensors(partly):
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            assert torch.equal(tensor, base[name]), name
        else:
            assert torch.equal(tensor, written[name]), name
            changed += not torch.equal(tensor, base[name])
    assert changed > 0
    assert not torch.equal(written["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


# -- the gates in the coordinator ----------------------------------------------------------------


def test_nan_wrong_shape_and_oversized_deltas_are_refused_and_never_merged(
    tmp_path: Path, tiny_base: Path
):
    c = _coordinator(tmp_path, tiny_base)
    try:
        base = dict(iter_base_tensors(c.registry.checkpoint_dir(c.current_base())))
        bound = c.config.gates.max_relative_norm

        nan = _noisy(base, 0.01, seed=1)
        nan[GROWN_TENSOR].view(-1)[7] = float("nan")
        refused_nan = _hand_in(c, load_or_create_identity(tmp_path / "a.key"), nan)

        # A delta laid out for another architecture: the tensor's shape differs from the base's.
        other = {GROWN_TENSOR: torch.zeros(3, 5)}
        refused_shape = _hand_in(
            c,
            load_or_create_identity(tmp_path / "b.key"),
            {GROWN_TENSOR: torch.ones(3, 5)},
            base=other,
        )

        # One tensor moved 100x the bound: Δ = 100·bound·θ_base.
        grown = dict(base)
        grown[GROWN_TENSOR] = base[GROWN_TENSOR] * (1 + 100 * bound)
        refused_norm = _hand_in(c, load_or_create_identity(tmp_path / "c.key"), grown)

        honest_tuned = _noisy(base, 0.02, seed=2)
        honest = _hand_in(c, load_or_create_identity(tmp_path / "d.key"), honest_tuned)

        assert (refused_nan.status, refused_nan.rejection_kind) == ("rejected", "nonfinite")
        assert refused_nan.reason == f"{GROWN_TENSOR}: delta holds NaN or Inf"
        assert (refused_shape.status, refused_shape.rejection_kind) == ("rejected", "layout")
        assert refused_shape.reason == f"{GROWN_TENSOR}: shape (3, 5) != base (128, 512)"
        assert (refused_norm.status, refused_norm.rejection_kind) == ("rejected", "norm")
        assert refused_norm.reason is not None and refused_norm.reason.startswith(GROWN_TENSOR)
        ratio = float(re.search(r"= ([0-9.e+]+) exceeds", refused_norm.reason).group(1))
        assert ratio == pytest.approx(100 * bound, rel=1e-3)
        assert f"the bound {bound:g}" in refused_norm.reason

        assert honest.status == "accepted", honest.reason
        assert 0 < honest.checks["max_relative_norm"] < bound
        assert honest.checks["tensors_changed"] == len(base)

        published = c.request_round()
        assert (published["status"], published["inputs"]) == ("published", [honest.id])
        merged = dict(iter_base_tensors(c.registry.checkpoint_dir(c.current_base())))
        # The default plan merges a math delta at half its size ([merge] domain_scale).
        halfway = base[GROWN_TENSOR] + 0.5 * (honest_tuned[GROWN_TENSOR] - base[GROWN_TENSOR])
        assert torch.allclose(merged[GROWN_TENSOR], halfway, atol=1e-6)
        with c.store.session() as s:
            statuses = {r.id: r.status for r in s.query(DeltaRecord)}
        assert statuses == {
            refused_nan.id: "rejected",
            refused_shape.id: "rejected",
            refused_norm.id: "rejected",
            honest.id: "merged",
        }
        metrics = c.metrics()
        assert (metrics["deltas_received_total"], metrics["deltas_rejected_total"]) == (4, 3)
        assert metrics["deltas_accepted_total"] == 1
        for kind in ("nonfinite", "layout", "norm"):
            assert metrics[f"deltas_rejected_{kind}_total"] == 1
        assert metrics["deltas_rejected_eval_total"] == 0
        assert (metrics["rounds_completed_total"], metrics["current_round"]) == (1, 2)
        assert metrics["checkpoints_published_total"] == 2
        assert metrics["merge_seconds_last"] > 0
    finally:
        c.store.close()


def test_eval_gate_refuses_a_delta_that_wrecks_another_domain(tmp_path: Path, tiny_base: Path):
    gates = GateConfig(eval_gate=True, domains=["math"], n_tasks=8, max_other_domain_drop=0.2)
    eval_config = EvalConfig(n_tasks=1, validation_seed=GATE_VALIDATION_SEED)
    c = _coordinator(tmp_path, tiny_base, gates=gates, eval=eval_config)
    try:
        base = dict(iter_base_tensors(c.registry.checkpoint_dir(c.current_base())))
        honest_tuned = _noisy(base, 0.02, seed=4)  # the size of a real RL delta (see GateConfig)
        honest = _hand_in(c, load_or_create_identity(tmp_path / "math.key"), honest_tuned)
        assert honest.status == "accepted", honest.reason
        scores = honest.checks["scores"]
        assert scores["seed"] == GATE_VALIDATION_SEED
        base_math = scores["base"]["math"]["mean_reward"]
        assert base_math > gates.max_other_domain_drop, "the base must solve some math to lose it"
        # Its own domain's single-expert score is on record.
        assert scores["expert"]["math"]["n"] == 8
        assert scores["expert"]["math"]["mean_reward"] >= base_math - gates.max_other_domain_drop

        # Announced as a code expert: the honest delta plus a random perturbation. It is small
        # enough to pass the norm gate at its default bound, so only the evaluation can tell.
        poisoned_tuned = _noisy(honest_tuned, 0.3, seed=5)
        largest = max(
            relative_norm(poisoned_tuned[n], base[n], gates.relative_norm_floor) for n in base
        )
        assert largest < GateConfig().max_relative_norm
        poisoned = _hand_in(
            c, load_or_create_identity(tmp_path / "code.key"), poisoned_tuned, domain="code"
        )
        assert (poisoned.status, poisoned.rejection_kind) == ("rejected", "eval")
        assert poisoned.reason.startswith(
            f"applied alone, this code delta drops math from {base_math:.3f} to "
        )

        published = c.request_round()
        assert (published["status"], published["inputs"]) == ("published", [honest.id])
        assert c.metrics()["deltas_rejected_eval_total"] == 1
    finally:
        c.store.close()


@pytest.mark.parametrize("kept", [False, True])
def test_eval_gate_scores_a_delta_as_the_merge_plan_applies_it(
    tmp_path: Path, tiny_base: Path, kept: bool
):
    # A code delta that moves only the decoder layers, far enough to wreck math: the gate refuses
    # it, unless the plan keeps those layers at the base, where the merge would not apply it.
    layers = "model.layers.*"
    gates = GateConfig(eval_gate=True, domains=["math"], n_tasks=8, max_other_domain_drop=0.2)
    eval_config = EvalConfig(n_tasks=1, validation_seed=GATE_VALIDATION_SEED)
    plan = MergePlan(keep_base_tensors=[layers] if kept else [])
    c = _coordinator(tmp_path, tiny_base, gates=gates, eval=eval_config, merge=plan)
    try:
        base = dict(iter_base_tensors(c.registry.checkpoint_dir(c.current_base())))
        noisy = _noisy(base, 0.5, seed=5)
        tuned = {n: noisy[n] if matches_any(n, [layers]) else t for n, t in base.items()}
        assert any(not torch.equal(tuned[n], base[n]) for n in base)
        delta = _hand_in(c, load_or_create_identity(tmp_path / "code.key"), tuned, domain="code")
        if kept:
            assert delta.status == "accepted", delta.reason
            scores = delta.checks["scores"]
            assert scores["expert"]["math"] == scores["base"]["math"]
        else:
            assert (delta.status, delta.rejection_kind) == ("rejected", "eval")
    finally:
        c.store.close()
