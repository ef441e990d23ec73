"""Validation gates a delta passes before it may join a merge: layout, finiteness, norm, evaluation.
Each refusal is a `DeltaRejected`: its message is the reason on record, its `kind` the class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from skillswarm.coordinator.config import GateConfig, matches_any
from skillswarm.merge.streaming import write_checkpoint
from skillswarm.merge.tensors import CheckpointTensors
from skillswarm.protocol.delta import DTYPE_NAMES, DeltaReader
from skillswarm.protocol.manifest import DeltaManifest

REJECTION_KINDS = (
    "signature",  # manifest unreadable, or not signed by the peer that announced it
    "denied",  # peer denied by the operator, or not on the allow-list
    "stale",  # wrong base, wrong round, or the round is not open
    "size",  # blobs larger than the coordinator takes
    "lossy",  # int8 deltas refused by configuration
    "layout",  # tensor names, shapes or dtypes that do not match the base
    "fetch",  # blobs could not be fetched or failed their sha256
    "corrupt",  # a payload does not decode against its manifest
    "nonfinite",  # NaN or Inf in the tuned weights
    "norm",  # a tensor moved further than the relative norm bound
    "eval",  # the delta alone harms another domain's held-out score
    "retired",  # the round's base was retired before the round merged
)


class DeltaRejected(Exception):
    """A delta failed a check; the message is the reason kept on record."""

    def __init__(self, reason: str, kind: str) -> None:
        if kind not in REJECTION_KINDS:
            raise ValueError(f"unknown rejection kind {kind!r}; known: {REJECTION_KINDS}")
        super().__init__(reason)
        self.kind = kind


@dataclass(frozen=True)
class NormReport:
    """The largest per-tensor relative norm of a delta and where it was."""

    max_relative_norm: float
    tensor: str | None
    tensors_changed: int

    def to_dict(self) -> dict[str, float | str | int | None]:
        return {
            "max_relative_norm": self.max_relative_norm,
            "max_relative_norm_tensor": self.tensor,
            "tensors_changed": self.tensors_changed,
        }


def check_layout(
    manifest: DeltaManifest, base_meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
) -> None:
    """Every tensor the delta names exists in the base with the same shape and dtype."""
    for name, entry in manifest.tensors.items():
        if name not in base_meta:
            raise DeltaRejected(f"tensor {name} is not in the base", "layout")
        dtype, shape = base_meta[name]
        if entry.shape != shape:
            raise DeltaRejected(f"{name}: shape {entry.shape} != base {shape}", "layout")
        if DTYPE_NAMES.get(dtype) != entry.dtype:
            raise DeltaRejected(f"{name}: dtype {entry.dtype} != base {dtype}", "layout")


NORM_CHUNK_ELEMENTS = 1 << 22  # float64 working set of a norm: 2 x 32 MiB, whatever the tensor


def relative_norm(tuned: torch.Tensor, base: torch.Tensor, floor_rms: float) -> float:
    """||tuned − base|| / max(||base||, floor_rms · sqrt(numel)), summed in float64 chunk by
    chunk so that a large tensor never has a full-size float64 copy."""
    tuned_flat, base_flat = tuned.detach().reshape(-1), base.detach().reshape(-1)
    delta_squares = base_squares = 0.0
    for start in range(0, base_flat.numel(), NORM_CHUNK_ELEMENTS):
        stop = start + NORM_CHUNK_ELEMENTS
        base_chunk = base_flat[start:stop].to(torch.float64)
        delta_chunk = tuned_flat[start:stop].to(torch.float64) - base_chunk
        delta_squares += float(delta_chunk.square().sum())
        base_squares += float(base_chunk.square().sum())
    delta_norm = math.sqrt(delta_squares)
    base_norm = max(math.sqrt(base_squares), floor_rms * math.sqrt(base.numel()))
    if base_norm == 0.0:
        return 0.0 if delta_norm == 0.0 else math.inf
    return delta_norm / base_norm


def check_values(reader: DeltaReader, base: CheckpointTensors, gates: GateConfig) -> NormReport:
    """Rebuild each changed tensor: refuse NaN/Inf, then refuse the delta if any tensor's relative
    norm exceeds the bound, naming the worst tensor and its ratio."""
    worst, worst_name, over = 0.0, None, 0
    names = reader.names()
    for name in names:
        base_tensor = base.get(name)
        tuned = reader.expert(name, base_tensor)
        if tuned is None:
            continue
        if not bool(tuned.isfinite().all()):
            raise DeltaRejected(f"{name}: delta holds NaN or Inf", "nonfinite")
        ratio = relative_norm(tuned, base_tensor, gates.relative_norm_floor)
        over += ratio > gates.max_relative_norm
        if ratio > worst or worst_name is None:
            worst, worst_name = ratio, name
    if over:
        others = f" (and {over - 1} more tensors)" if over > 1 else ""
        raise DeltaRejected(
            f"{worst_name}: relative norm ||Δ||/||θ_base|| = {worst:.4g} exceeds the bound "
            f"{gates.max_relative_norm:g}{others}",
            "norm",
        )
    return NormReport(max_relative_norm=worst, tensor=worst_name, tensors_changed=len(names))


def write_expert_checkpoint(
    base_dir: Path, reader: DeltaReader, out_dir: Path, keep_base: Sequence[str] = ()
) -> Path:
    """Write base + Δ (the node's weights, bit-exact) as a Hugging Face folder at `out_dir`;
    the tensors whose names match a `keep_base` glob pattern stay the base's, as a merge with
    that plan's keep_base_tensors leaves them."""

    def expert(name: str, base_tensor: torch.Tensor) -> torch.Tensor | None:
        if not base_tensor.is_floating_point() or matches_any(name, keep_base):
            return None
        return reader.expert(name, base_tensor)

    return write_checkpoint(base_dir, out_dir, expert)


def check_domain_scores(
    delta_domain: str,
    expert_scores: Mapping[str, float],
    base_scores: Mapping[str, float],
    gates: GateConfig,
) -> None:
    """Refuse a delta whose expert (base + Δ alone) pushes a domain other than its own below
    the minimum score (where the base was at or above it), or more than the allowed drop below
    the base. Scores are held-out mean rewards."""
    for domain, score in sorted(expert_scores.items()):
        if domain == delta_domain:
            continue
        base_score = base_scores[domain]
        floor = gates.min_other_domain_score
        if floor is not None and score < floor <= base_score:
            raise DeltaRejected(
                f"applied alone, this {delta_domain} delta scores {score:.3f} on {domain} "
                f"(base {base_score:.3f}), below the minimum {floor:g}",
                "eval",
            )
        drop = base_score - score
        if gates.max_other_domain_drop is not None and drop > gates.max_other_domain_drop:
            raise DeltaRejected(
                f"applied alone, this {delta_domain} delta drops {domain} from {base_score:.3f} "
                f"to {score:.3f}, more than the allowed {gates.max_other_domain_drop:g}",
                "eval",
            )
