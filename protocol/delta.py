"""Weight deltas (task vectors): compute θ − base, pack them into a blob, read them back.

A delta blob is a safetensors file in the node's content-addressed store; the manifest's tensor
index points at each tensor inside it. Every read checks shape and dtype against the manifest.
"""

from __future__ import annotations

import datetime as dt
import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

from protocol.blobstore import BlobStore
from protocol.manifest import DeltaManifest, TensorEntry

DELTA_DTYPE = torch.float32
_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class DeltaError(ValueError):
    """A delta does not fit its manifest or its base."""


def compute_delta(
    base: Mapping[str, torch.Tensor], tuned: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Δ = tuned − base per tensor, in float32; both must hold the same names and shapes."""
    if set(base) != set(tuned):
        missing = sorted(set(base) ^ set(tuned))[:5]
        raise DeltaError(f"base and tuned weights name different tensors, e.g. {missing}")
    delta = {}
    for name, b in base.items():
        t = tuned[name]
        if t.shape != b.shape:
            raise DeltaError(f"{name}: tuned shape {tuple(t.shape)} != base {tuple(b.shape)}")
        delta[name] = t.detach().to(DELTA_DTYPE) - b.detach().to(DELTA_DTYPE)
    return delta


def _header_offsets(raw: bytes) -> dict[str, tuple[int, int]]:
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    start = 8 + header_len
    return {
        name: (start + info["data_offsets"][0], info["data_offsets"][1] - info["data_offsets"][0])
        for name, info in header.items()
        if name != "__metadata__"
    }


def pack_delta(
    delta: Mapping[str, torch.Tensor],
    store: BlobStore,
    *,
    peer_id: str,
    public_key: bytes,
    domain: str,
    base_id: str,
    round: int,
    steps: int,
    metrics: Mapping[str, float] | None = None,
) -> DeltaManifest:
    """Write the delta as one blob into `store` and return the (unsigned) manifest describing it."""
    tensors = {name: t.contiguous() for name, t in sorted(delta.items())}
    raw = safetensors_save(tensors, metadata={"format": "pt"})
    sha = store.put_bytes(raw)
    offsets = _header_offsets(raw)
    index = {
        name: TensorEntry(
            blob=sha,
            offset=offsets[name][0],
            length=offsets[name][1],
            dtype=_DTYPE_NAMES[t.dtype],
            shape=tuple(t.shape),
            key=name,
        )
        for name, t in tensors.items()
    }
    return DeltaManifest(
        peer_id=peer_id,
        public_key=public_key,
        domain=domain,
        base_id=base_id,
        round=round,
        steps=steps,
        created_at=dt.datetime.now(dt.UTC).isoformat(),
        metrics=dict(metrics or {}),
        blobs={sha: len(raw)},
        tensors=index,
    )


class DeltaReader:
    """Reads a fetched delta's tensors from the blob store, checked against the manifest."""

    def __init__(self, manifest: DeltaManifest, store: BlobStore) -> None:
        self.manifest = manifest
        self._paths: dict[str, Path] = {}
        for sha in manifest.blobs:
            if not store.has(sha):
                raise DeltaError(f"blob {sha[:12]} of the delta is not in the store")
            self._paths[sha] = store.path(sha)

    def names(self) -> list[str]:
        return sorted(self.manifest.tensors)

    def get(self, name: str) -> torch.Tensor:
        entry = self.manifest.tensors.get(name)
        if entry is None:
            raise DeltaError(f"the delta has no tensor {name}")
        with safe_open(self._paths[entry.blob], framework="pt") as f:
            if entry.key not in f.keys():
                raise DeltaError(f"blob {entry.blob[:12]} lacks tensor {entry.key}")
            tensor = f.get_tensor(entry.key)
        if tuple(tensor.shape) != entry.shape or _DTYPE_NAMES.get(tensor.dtype) != entry.dtype:
            raise DeltaError(
                f"{name}: blob holds {tensor.dtype} {tuple(tensor.shape)}, "
                f"manifest says {entry.dtype} {entry.shape}"
            )
        return tensor

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            yield name, self.get(name)
