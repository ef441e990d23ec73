"""Weight deltas: what a node changed against its base, packed into one blob, rebuilt bit-exactly.

Per tensor, the tuned weights are cast to the base's dtype and compared bit for bit. Unchanged
tensors are left out. A changed tensor is stored `sparse` (the gaps between changed indices, then
the XOR of new and old bit patterns there, each byte-shuffled and deflated) or `dense` (all new
bit patterns), whichever is smaller; both rebuild the tuned tensor exactly. `int8` (a scaled,
rounded difference) is lossy, off by default, and marks the whole manifest lossy.
"""

from __future__ import annotations

import datetime as dt
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.manifest import DeltaManifest, TensorEntry

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MAX_SPARSE_NUMEL = 2**32 - 1  # gaps are stored as uint32


class DeltaError(ValueError):
    """A delta does not fit its manifest or its base."""


@dataclass(frozen=True)
class EncodedTensor:
    encoding: str
    payload: bytes
    nnz: int = 0
    index_bytes: int = 0
    scale: float | None = None


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(_BITS[tensor.element_size()]).reshape(-1)


def _pack(array: np.ndarray) -> bytes:
    """Byte-shuffle (all first bytes, then all second bytes…) and deflate."""
    planes = array.view(np.uint8).reshape(-1, array.itemsize).T
    return zlib.compress(np.ascontiguousarray(planes).tobytes(), 6)


def _unpack(data: bytes, count: int, dtype: np.dtype, what: str) -> np.ndarray:
    """Inverse of _pack, refusing anything that does not inflate to exactly `count` items."""
    expected = count * dtype.itemsize
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, expected)
    except zlib.error as exc:
        raise DeltaError(f"sparse {what} does not inflate: {exc}") from exc
    if len(raw) != expected or not inflater.eof or inflater.unconsumed_tail:
        raise DeltaError(f"sparse {what} inflates to the wrong size")
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(dtype.itemsize, count)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(-1)


def encode_tensor(
    base: torch.Tensor, tuned: torch.Tensor, lossy_int8: bool = False
) -> EncodedTensor | None:
    """Encode how `tuned` differs from `base`; None when they are bit-identical."""
    if base.dtype not in DTYPE_NAMES:
        raise DeltaError(f"cannot encode a delta of dtype {base.dtype}")
    if tuned.shape != base.shape:
        raise DeltaError(f"tuned shape {tuple(tuned.shape)} != base {tuple(base.shape)}")
    # On the base's device (the CPU, where checkpoints are read), whatever device trained it.
    tuned = tuned.detach().to(device=base.device, dtype=base.dtype)
    base_bits, tuned_bits = _bits(base.detach()), _bits(tuned)
    changed = (base_bits != tuned_bits).nonzero().squeeze(1)
    if changed.numel() == 0:
        return None
    if lossy_int8:
        diff = tuned.float() - base.float()
        scale = float(diff.abs().max()) / 127.0 or 1.0
        if not math.isfinite(scale):
            raise DeltaError("cannot quantise a change that is not finite to int8")
        q = torch.round(diff / scale).clamp(-127, 127).to(torch.int8)
        return EncodedTensor("int8", q.numpy().tobytes(), scale=scale)
    dense = tuned_bits.numpy().tobytes()
    if base.numel() <= MAX_SPARSE_NUMEL:
        idx = changed.numpy()
        index = _pack(np.diff(idx, prepend=-1).astype(np.uint32))
        values = _pack((tuned_bits[changed] ^ base_bits[changed]).numpy())
        if len(index) + len(values) < len(dense):
            return EncodedTensor(
                "sparse", index + values, nnz=int(idx.size), index_bytes=len(index)
            )
    return EncodedTensor("dense", dense)


def decode_tensor(entry: TensorEntry, payload: bytes, base: torch.Tensor) -> torch.Tensor:
    """Rebuild the tuned tensor from the base and one entry's payload; checks every length."""
    dtype = _BY_NAME.get(entry.dtype)
    if dtype is None or dtype != base.dtype:
        raise DeltaError(f"entry dtype {entry.dtype} does not match base dtype {base.dtype}")
    if tuple(base.shape) != entry.shape:
        raise DeltaError(f"entry shape {entry.shape} does not match base {tuple(base.shape)}")
    if len(payload) != entry.length:
        raise DeltaError(f"payload is {len(payload)} bytes, manifest says {entry.length}")
    numel, size = base.numel(), base.element_size()
    bits_dtype = _BITS[size]
    if entry.encoding == "dense":
        if entry.length != numel * size:
            raise DeltaError(f"dense payload of {entry.length} bytes for {numel} elements")
        bits = torch.frombuffer(bytearray(payload), dtype=bits_dtype)
        return bits.view(dtype).reshape(base.shape)
    if entry.encoding == "int8":
        if entry.length != numel or entry.scale is None:
            raise DeltaError("int8 payload length or scale is wrong")
        q = torch.frombuffer(bytearray(payload), dtype=torch.int8).reshape(base.shape)
        return (base.float() + q.float() * entry.scale).to(dtype)
    # sparse
    nnz, index_bytes = entry.nnz, entry.index_bytes
    if not 0 < nnz <= numel or not 0 < index_bytes < entry.length:
        raise DeltaError(f"sparse entry with nnz={nnz} does not fit {entry.length} bytes")
    gaps = _unpack(payload[:index_bytes], nnz, np.dtype(np.uint32), "index").astype(np.int64)
    if gaps.min() < 1:
        raise DeltaError("sparse index is not strictly increasing")
    idx = np.cumsum(gaps) - 1
    if idx[-1] >= numel:
        raise DeltaError(f"sparse index {idx[-1]} out of range for {numel} elements")
    values = _unpack(payload[index_bytes:], nnz, np.dtype(f"<i{size}"), "values")
    bits = _bits(base.detach()).clone()
    where = torch.from_numpy(idx)
    bits[where] = bits[where] ^ torch.from_numpy(values.copy())
    return bits.view(dtype).reshape(base.shape)


def pack_delta(
    base: Mapping[str, torch.Tensor],
    tuned: Mapping[str, torch.Tensor],
    store: BlobStore,
    *,
    peer_id: str,
    public_key: bytes,
    domain: str,
    base_id: str,
    round: int,
    steps: int,
    metrics: Mapping[str, float] | None = None,
    lossy_int8: bool = False,
) -> DeltaManifest:
    """Encode tuned − base into one blob in `store`; return the unsigned manifest describing it."""
    if set(base) != set(tuned):
        missing = sorted(set(base) ^ set(tuned))[:5]
        raise DeltaError(f"base and tuned weights name different tensors, e.g. {missing}")
    parts: list[bytes] = []
    offset = 0
    index: dict[str, dict] = {}
    for name in sorted(base):
        if not base[name].is_floating_point():
            if not torch.equal(base[name], tuned[name].to(base[name].device)):
                raise DeltaError(
                    f"tensor {name} of dtype {base[name].dtype} changed; deltas carry "
                    "floating-point tensors only"
                )
            continue
        encoded = encode_tensor(base[name], tuned[name], lossy_int8)
        if encoded is None:
            continue
        index[name] = {
            "offset": offset,
            "length": len(encoded.payload),
            "encoding": encoded.encoding,
            "dtype": DTYPE_NAMES[base[name].dtype],
            "shape": tuple(base[name].shape),
            "nnz": encoded.nnz,
            "index_bytes": encoded.index_bytes,
            "scale": encoded.scale,
        }
        parts.append(encoded.payload)
        offset += len(encoded.payload)
    blob = b"".join(parts)
    sha = store.put_bytes(blob)
    return DeltaManifest(
        peer_id=peer_id,
        public_key=public_key,
        domain=domain,
        base_id=base_id,
        round=round,
        steps=steps,
        created_at=dt.datetime.now(dt.UTC).isoformat(),
        metrics=dict(metrics or {}),
        lossy=lossy_int8,
        blobs={sha: len(blob)},
        tensors={name: TensorEntry(blob=sha, **entry) for name, entry in index.items()},
    )


class DeltaReader:
    """Rebuilds an expert's tensors from a fetched delta and its base, checked on every read."""

    def __init__(self, manifest: DeltaManifest, store: BlobStore) -> None:
        self.manifest = manifest
        self._paths: dict[str, Path] = {}
        for sha, size in manifest.blobs.items():
            if not store.has(sha):
                raise DeltaError(f"blob {sha[:12]} of the delta is not in the store")
            if store.size(sha) != size:
                raise DeltaError(
                    f"blob {sha[:12]} is {store.size(sha)} bytes, manifest says {size}"
                )
            self._paths[sha] = store.path(sha)

    def names(self) -> list[str]:
        """Tensors this delta changes; every other tensor equals the base."""
        return sorted(self.manifest.tensors)

    def payload(self, name: str) -> bytes:
        entry = self.manifest.tensors[name]
        with open(self._paths[entry.blob], "rb") as f:
            f.seek(entry.offset)
            return f.read(entry.length)

    def expert(self, name: str, base: torch.Tensor) -> torch.Tensor | None:
        """The node's tuned tensor (bit-exact unless the manifest is lossy); None if unchanged."""
        entry = self.manifest.tensors.get(name)
        if entry is None:
            return None
        return decode_tensor(entry, self.payload(name), base)

    def delta(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """θ − base for one tensor in float32 (zeros when the tensor is unchanged)."""
        tuned = self.expert(name, base)
        if tuned is None:
            return torch.zeros(base.shape, dtype=torch.float32)
        return tuned.float() - base.float()
