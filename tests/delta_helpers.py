"""Signed deltas for coordinator tests: noise on a base, signed by a node's key, handed in as a
gossip announcement whose blobs are already where a fetch would have put them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from skillswarm.coordinator.candidates import merge_and_decide
from skillswarm.coordinator.config import EvalConfig, MergePlan
from skillswarm.coordinator.evaluation import Evaluator, ExpertInput
from skillswarm.coordinator.publication import Decision
from skillswarm.coordinator.service import Coordinator
from skillswarm.coordinator.store import DeltaRecord
from skillswarm.merge.outer import OuterOptimizer, OuterOptimizerConfig
from skillswarm.merge.streaming import TaskVector
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import DeltaReader, pack_delta
from skillswarm.protocol.identity import KeyPair, peer_id_of, public_key_bytes
from skillswarm.protocol.manifest import sign_manifest
from skillswarm.protocol.messages import DeltaAnnounced


def expert_inputs(
    base: Mapping[str, torch.Tensor],
    tuned: Mapping[str, Mapping[str, torch.Tensor]],
    blobs: BlobStore,
    key: KeyPair,
) -> list[ExpertInput]:
    """One round-1 delta per domain of `tuned` (domain → its weights) from `base`, packed into
    `blobs` and signed by `key`, as the merge functions take them (labels `expert:DOMAIN`)."""
    experts = []
    for domain, weights in tuned.items():
        manifest = pack_delta(
            base,
            weights,
            blobs,
            peer_id=peer_id_of(key),
            public_key=public_key_bytes(key),
            domain=domain,
            base_id="b" * 64,
            round=1,
            steps=1,
        )
        experts.append(ExpertInput(f"expert:{domain}", domain, DeltaReader(manifest, blobs)))
    return experts


def merged_by(
    plan: MergePlan, base_dir: Path, experts: list[ExpertInput], work: Path
) -> dict[str, torch.Tensor]:
    """The tensors of the round-1 checkpoint `plan` merges `experts` into on `base_dir`: math
    scored on 2 validation tasks, an identity outer step, and a rule that publishes anything."""
    verdict = merge_and_decide(
        plan,
        Evaluator(EvalConfig(domains=["math"], n_tasks=2)),
        OuterOptimizer(work / "outer", OuterOptimizerConfig()),
        "b" * 64,
        base_dir,
        experts,
        work / "merge",
        1,
        lambda scores: Decision(True, "published"),
        lambda e: TaskVector(name=e.domain, expert=e.reader.expert),
    )
    return load_file(verdict.candidate_dir / "model.safetensors")


def current_base_tensors(c: Coordinator) -> dict[str, torch.Tensor]:
    """The tensors of the coordinator's current base checkpoint."""
    return dict(iter_base_tensors(c.registry.checkpoint_dir(c.current_base())))


def noisy(base: Mapping[str, torch.Tensor], seed: int, scale: float = 1e-3) -> dict:
    """`base` plus Gaussian noise of standard deviation `scale`, seeded."""
    generator = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=generator) for n, t in base.items()}


def signed_announcement(
    base: Mapping[str, torch.Tensor],
    tuned: Mapping[str, torch.Tensor],
    store: BlobStore,
    key: KeyPair,
    *,
    base_id: str,
    round_number: int,
    domain: str = "math",
    steps: int = 4,
    metrics: dict[str, float] | None = None,
) -> DeltaAnnounced:
    """The announcement of the delta tuned - base, its blobs written into `store`."""
    manifest = pack_delta(
        dict(base),
        dict(tuned),
        store,
        peer_id=peer_id_of(key),
        public_key=public_key_bytes(key),
        domain=domain,
        base_id=base_id,
        round=round_number,
        steps=steps,
        metrics=metrics,
    )
    signed = sign_manifest(manifest, key)
    return DeltaAnnounced(manifest_bytes=signed.manifest_bytes, signature=signed.signature)


def hand_in_delta(
    c: Coordinator,
    key: KeyPair,
    tuned: Mapping[str, torch.Tensor],
    *,
    base: Mapping[str, torch.Tensor] | None = None,
    domain: str = "math",
    steps: int = 4,
    metrics: dict[str, float] | None = None,
) -> DeltaRecord:
    """Sign a delta of `tuned` against the current base (its tensors `base`, loaded when not
    given), put its blobs in the coordinator's store as a fetch would, and hand it in."""
    info = c.current_base()
    body = signed_announcement(
        current_base_tensors(c) if base is None else base,
        tuned,
        c.blobs,
        key,
        base_id=info.id,
        round_number=c.current_round().number,
        domain=domain,
        steps=steps,
        metrics=metrics,
    )
    return c.handle_announcement(peer_id_of(key), body)
