"""Typed gossip messages of a swarm topic: msgpack envelopes with a type and a schema version.

Every message is size-bounded and validated before use; unknown types or versions are reported as
`UnknownMessage` so the receiver can log and ignore them.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from skillswarm.protocol.canonical import WireCount
from skillswarm.protocol.manifest import MAX_MANIFEST_BYTES, SignedManifest

MESSAGE_VERSION = 1
MAX_GOSSIP_BYTES = 1 << 20


class MessageError(ValueError):
    """A gossip message is malformed or too large."""


class UnknownMessage(MessageError):
    """A well-formed envelope of a type or version this peer does not speak."""


class DeltaAnnounced(BaseModel):
    """A node offers a signed delta; its blobs are fetched from the announcing peer."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["delta_announced"] = "delta_announced"
    manifest_bytes: bytes = Field(max_length=MAX_MANIFEST_BYTES)
    signature: bytes = Field(max_length=256)

    @property
    def signed(self) -> SignedManifest:
        return SignedManifest(manifest_bytes=self.manifest_bytes, signature=self.signature)


class CheckpointPublished(BaseModel):
    """The coordinator published a merged checkpoint: the base of the next round."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["checkpoint_published"] = "checkpoint_published"
    checkpoint_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    round: WireCount
    parent: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class NodeHeartbeat(BaseModel):
    """A node says it is alive, which domain it trains and how far it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["node_heartbeat"] = "node_heartbeat"
    domain: str = Field(max_length=64)
    round: WireCount
    step: WireCount
    reward: float | None = None


class CheckpointDeltaServed(BaseModel):
    """A node rebuilt a checkpoint from its fan-out delta and serves that delta's blobs, at
    these addresses, to peers that still hold the parent."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["checkpoint_delta_served"] = "checkpoint_delta_served"
    checkpoint_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    multiaddrs: list[Annotated[str, Field(max_length=256)]] = Field(max_length=8)


GossipBody = DeltaAnnounced | CheckpointPublished | NodeHeartbeat | CheckpointDeltaServed
_TYPES: dict[str, type[BaseModel]] = {
    "delta_announced": DeltaAnnounced,
    "checkpoint_published": CheckpointPublished,
    "node_heartbeat": NodeHeartbeat,
    "checkpoint_delta_served": CheckpointDeltaServed,
}


def encode_message(body: GossipBody) -> bytes:
    raw = msgpack.packb(
        {"v": MESSAGE_VERSION, "body": body.model_dump(mode="python")}, use_bin_type=True
    )
    if len(raw) > MAX_GOSSIP_BYTES:
        raise MessageError(f"gossip message of {len(raw)} bytes exceeds {MAX_GOSSIP_BYTES}")
    return raw


def decode_message(raw: bytes) -> GossipBody:
    """Decode and validate one gossip payload. Whatever the bytes, it returns a typed message or
    raises MessageError (UnknownMessage for a well-formed envelope of a type or version this peer
    does not speak), nothing else."""
    if len(raw) > MAX_GOSSIP_BYTES:
        raise MessageError(f"gossip message of {len(raw)} bytes exceeds {MAX_GOSSIP_BYTES}")
    try:
        envelope = msgpack.unpackb(raw, raw=False, max_map_len=64, max_array_len=1024)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MessageError(f"gossip payload is not msgpack: {exc}") from exc
    if not isinstance(envelope, dict) or not isinstance(envelope.get("body"), dict):
        raise MessageError("gossip payload is not an envelope with a body")
    version = envelope.get("v")
    kind = envelope["body"].get("type")
    if not isinstance(kind, str) or type(version) is not int:
        raise MessageError("gossip envelope's type or version is not a string and an integer")
    if version != MESSAGE_VERSION or kind not in _TYPES:
        raise UnknownMessage(f"unknown gossip message type={kind[:64]!r} version={version!r}")
    try:
        return _TYPES[kind].model_validate(envelope["body"])  # type: ignore[return-value]
    except ValidationError as exc:
        raise MessageError(f"invalid {kind} message: {_first_errors(exc)}") from exc


def _first_errors(exc: ValidationError) -> str:
    """The first few problems, each with its field: short enough for a log line."""
    return "; ".join(
        f"{'.'.join(map(str, error['loc'])) or 'body'}: {error['msg']}"
        for error in exc.errors()[:3]
    )
