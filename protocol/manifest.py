"""Delta manifests: the msgpack description of a node's weight delta, signed with its Ed25519 key.

The signature covers the exact manifest bytes that travel, so verification never depends on
re-encoding; a manifest's id is the sha256 of those bytes.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from typing import Annotated, Literal, TypeVar

import msgpack
from libp2p.crypto.keys import KeyPair
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from skillswarm.protocol import identity
from skillswarm.protocol.canonical import WireCount, canonical_packb

MANIFEST_SCHEMA = "skillswarm.delta/1"
MAX_MANIFEST_BYTES = 512 * 1024
MAX_TENSORS = 100_000
ELEMENT_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
# The blob of a delta in which no tensor changed (pack_delta still writes and lists it).
EMPTY_BLOB = hashlib.sha256(b"").hexdigest()


_Model = TypeVar("_Model", bound=BaseModel)


class ManifestError(ValueError):
    """A delta manifest is malformed, oversized or not signed by whom it claims."""


def decode_bounded(
    model: type[_Model], raw: bytes, what: str, limit: int, max_map_len: int
) -> _Model:
    """Decode msgpack `raw`, at most `limit` bytes, into `model`: every failure, whether of size,
    msgpack or validation, is a `ManifestError` naming `what` and the first few fields at fault."""
    if len(raw) > limit:
        raise ManifestError(f"{what} is {len(raw)} bytes; the limit is {limit}")
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_map_len=max_map_len)
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc'])) or what}: "
            f"{error['msg'].removeprefix('Value error, ')}"
            for error in exc.errors()[:5]
        )
        raise ManifestError(f"malformed {what}: {problems}") from exc
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ManifestError(f"malformed {what}: {exc}") from exc


class TensorEntry(BaseModel):
    """Where one tensor's change lives (a byte range of a blob) and how it is encoded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    blob: str = Field(pattern=r"^[0-9a-f]{64}$")
    offset: WireCount
    length: WireCount
    encoding: Literal["dense", "sparse", "int8"]
    dtype: Literal["F32", "BF16", "F16"]
    shape: tuple[WireCount, ...] = Field(max_length=8)
    nnz: WireCount = Field(default=0, description="changed elements (sparse)")
    index_bytes: WireCount = Field(default=0, description="compressed index length (sparse)")
    scale: float | None = Field(default=None, description="quantisation step (int8, lossy)")

    @model_validator(mode="after")
    def _length_fits_the_tensor(self) -> TensorEntry:
        """The payload's length is what the encoding takes for this shape and dtype (at most
        the dense size), so that no entry makes a reader fetch or read more than its tensor."""
        numel = math.prod(self.shape)
        dense = numel * ELEMENT_BYTES[self.dtype]
        if self.encoding == "dense" and self.length != dense:
            raise ValueError(
                f"a dense entry of shape {self.shape} is {dense} bytes, not {self.length}"
            )
        if self.encoding == "int8" and (
            self.length != numel or self.scale is None or not math.isfinite(self.scale)
        ):
            raise ValueError("an int8 entry takes one byte per element and a finite scale")
        if self.encoding == "sparse" and not (
            0 < self.nnz <= numel and 0 < self.index_bytes < self.length <= dense
        ):
            raise ValueError(
                f"a sparse entry of {self.nnz} changes in {self.length} bytes does not fit "
                f"shape {self.shape} ({dense} bytes dense)"
            )
        return self


class DeltaManifest(BaseModel):
    """What a node trained, from which base, and where the delta's bytes are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal["skillswarm.delta/1"] = Field(default=MANIFEST_SCHEMA, alias="schema")
    peer_id: str = Field(max_length=128)
    public_key: bytes = Field(max_length=256)
    domain: str = Field(max_length=64)
    base_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    round: WireCount
    steps: WireCount
    created_at: str = Field(max_length=64)
    metrics: dict[str, float] = Field(default_factory=dict)
    lossy: bool = Field(default=False, description="true if any tensor is not rebuilt exactly")
    blobs: dict[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")], WireCount] = Field(
        description="blob sha256 -> size in bytes"
    )
    tensors: dict[str, TensorEntry]

    @model_validator(mode="after")
    def _tensors_tile_the_blobs(self) -> DeltaManifest:
        """Each blob is exactly its tensors' payloads, back to back from offset 0 (as pack_delta
        writes it): no listed blob, and no byte of one, is left for a peer to fill with anything
        else, so a delta's download is bounded by the tensors it changes."""
        ranges: list[tuple[str, int, int, str]] = []
        for name, entry in self.tensors.items():
            if entry.encoding == "int8" and not self.lossy:
                raise ValueError(f"tensor {name} is int8-encoded but the manifest is not lossy")
            ranges.append((entry.blob, entry.offset, entry.length, f"tensor {name}"))
        check_ranges_tile(self.blobs, ranges)
        return self

    def encode(self) -> bytes:
        """Canonical msgpack bytes (sorted keys) of this manifest."""
        data = self.model_dump(by_alias=True, mode="python")
        return canonical_packb(data)

    @classmethod
    def decode(cls, raw: bytes) -> DeltaManifest:
        return decode_bounded(cls, raw, "delta manifest", MAX_MANIFEST_BYTES, MAX_TENSORS)


class SignedManifest(BaseModel):
    """Manifest bytes plus the signature over exactly those bytes."""

    model_config = ConfigDict(frozen=True)

    manifest_bytes: bytes = Field(max_length=MAX_MANIFEST_BYTES)
    signature: bytes = Field(max_length=256)

    @property
    def manifest_id(self) -> str:
        return hashlib.sha256(self.manifest_bytes).hexdigest()

    def verify(self, announcing_peer: str | None = None) -> DeltaManifest:
        """Decode and check the signature, the key's PeerID and (if given) the announcing peer.

        Raises ManifestError naming what failed; returns the manifest only when all hold.
        """
        manifest = DeltaManifest.decode(self.manifest_bytes)
        check_signature(manifest.peer_id, manifest.public_key, self.manifest_bytes, self.signature)
        if announcing_peer is not None and announcing_peer != manifest.peer_id:
            raise ManifestError(
                f"manifest signed by {manifest.peer_id} was announced by {announcing_peer}"
            )
        return manifest


def check_ranges_tile(blobs: dict[str, int], ranges: list[tuple[str, int, int, str]]) -> None:
    """Each blob is exactly its ranges (blob, offset, length, what), back to back from offset 0:
    no listed blob, and no byte of one, is left for a peer to fill with anything else. Only the
    empty blob may be listed without a range. ValueError naming the first misfit."""
    by_blob: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for blob, offset, length, what in ranges:
        if blob not in blobs:
            raise ValueError(f"{what} points at blob {blob[:12]}, not listed")
        by_blob[blob].append((offset, length, what))
    for sha, size in blobs.items():
        end = 0
        for offset, length, what in sorted(by_blob.get(sha, [])):
            if offset != end:
                raise ValueError(f"{what} starts at byte {offset} of blob {sha[:12]}, not at {end}")
            end += length
        if size != end:
            raise ValueError(
                f"blob {sha[:12]} is listed as {size} bytes but its contents take {end}"
            )
        if sha not in by_blob and sha != EMPTY_BLOB:
            raise ValueError(f"blob {sha[:12]} is listed but nothing is in it")


def check_signature(peer_id: str, public_key: bytes, raw: bytes, signature: bytes) -> None:
    """Check that `public_key` belongs to `peer_id` and signed exactly `raw`; ManifestError
    naming what failed otherwise."""
    try:
        key_peer = identity.peer_id_from_public_key_bytes(public_key)
    except identity.IdentityError as exc:
        raise ManifestError(f"manifest carries an unusable public key: {exc}") from exc
    if key_peer != peer_id:
        raise ManifestError(f"manifest claims peer {peer_id} but its key belongs to {key_peer}")
    if not identity.verify(public_key, raw, signature):
        raise ManifestError(f"bad signature on manifest {hashlib.sha256(raw).hexdigest()[:12]}")


def sign_manifest(manifest: DeltaManifest, key_pair: KeyPair) -> SignedManifest:
    """Sign a manifest with the node's key; the manifest must name that key's peer."""
    if manifest.peer_id != identity.peer_id_of(key_pair):
        raise ManifestError("manifest peer_id does not match the signing key")
    raw = manifest.encode()
    return SignedManifest(manifest_bytes=raw, signature=identity.sign(key_pair, raw))
