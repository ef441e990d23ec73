"""Delta manifests: the msgpack description of a node's weight delta, signed with its Ed25519 key.

The signature covers the exact manifest bytes that travel, so verification never depends on
re-encoding; a manifest's id is the sha256 of those bytes.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgpack
from libp2p.crypto.keys import KeyPair
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol import identity

MANIFEST_SCHEMA = "skillswarm.delta/1"
MAX_MANIFEST_BYTES = 512 * 1024
MAX_TENSORS = 100_000


class ManifestError(ValueError):
    """A delta manifest is malformed, oversized or not signed by whom it claims."""


class TensorEntry(BaseModel):
    """Where one tensor's change lives (a byte range of a blob) and how it is encoded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    blob: str = Field(pattern=r"^[0-9a-f]{64}$")
    offset: int = Field(ge=0)
    length: int = Field(ge=0)
    encoding: Literal["dense", "sparse", "int8"]
    dtype: Literal["F32", "BF16", "F16"]
    shape: tuple[int, ...] = Field(max_length=8)
    nnz: int = Field(default=0, ge=0, description="changed elements (sparse)")
    index_bytes: int = Field(default=0, ge=0, description="compressed index length (sparse)")
    scale: float | None = Field(default=None, description="quantisation step (int8, lossy)")


class DeltaManifest(BaseModel):
    """What a node trained, from which base, and where the delta's bytes are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal["skillswarm.delta/1"] = Field(default=MANIFEST_SCHEMA, alias="schema")
    peer_id: str = Field(max_length=128)
    public_key: bytes = Field(max_length=256)
    domain: str = Field(max_length=64)
    base_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    round: int = Field(ge=0)
    steps: int = Field(ge=0)
    created_at: str = Field(max_length=64)
    metrics: dict[str, float] = Field(default_factory=dict)
    lossy: bool = Field(default=False, description="true if any tensor is not rebuilt exactly")
    blobs: dict[str, int] = Field(description="blob sha256 -> size in bytes")
    tensors: dict[str, TensorEntry]

    def encode(self) -> bytes:
        """Canonical msgpack bytes (sorted keys) of this manifest."""
        data = self.model_dump(by_alias=True, mode="python")
        return msgpack.packb(_sorted(data), use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> DeltaManifest:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is {len(raw)} bytes; the limit is {MAX_MANIFEST_BYTES}")
        try:
            data = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_map_len=MAX_TENSORS)
            manifest = cls.model_validate(data)
        except (ValueError, ValidationError, msgpack.ExtraData, TypeError) as exc:
            raise ManifestError(f"malformed delta manifest: {exc}") from exc
        for name, entry in manifest.tensors.items():
            if entry.blob not in manifest.blobs:
                raise ManifestError(f"tensor {name} points at blob {entry.blob[:12]} not listed")
            if entry.offset + entry.length > manifest.blobs[entry.blob]:
                raise ManifestError(f"tensor {name} lies outside blob {entry.blob[:12]}")
            if entry.encoding == "int8" and not manifest.lossy:
                raise ManifestError(f"tensor {name} is int8-encoded but the manifest is not lossy")
        return manifest


def _sorted(value: object) -> object:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_sorted(v) for v in value]
    return value


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
        try:
            key_peer = identity.peer_id_from_public_key_bytes(manifest.public_key)
        except identity.IdentityError as exc:
            raise ManifestError(f"manifest carries an unusable public key: {exc}") from exc
        if key_peer != manifest.peer_id:
            raise ManifestError(
                f"manifest claims peer {manifest.peer_id} but its key belongs to {key_peer}"
            )
        if not identity.verify(manifest.public_key, self.manifest_bytes, self.signature):
            raise ManifestError(f"bad signature on manifest {self.manifest_id[:12]}")
        if announcing_peer is not None and announcing_peer != manifest.peer_id:
            raise ManifestError(
                f"manifest signed by {manifest.peer_id} was announced by {announcing_peer}"
            )
        return manifest


def sign_manifest(manifest: DeltaManifest, key_pair: KeyPair) -> SignedManifest:
    """Sign a manifest with the node's key; the manifest must name that key's peer."""
    if manifest.peer_id != identity.peer_id_of(key_pair):
        raise ManifestError("manifest peer_id does not match the signing key")
    raw = manifest.encode()
    return SignedManifest(manifest_bytes=raw, signature=identity.sign(key_pair, raw))
