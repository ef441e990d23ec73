"""Delta manifests and gossip messages: signatures bind the bytes, the key and the announcer."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import torch
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import DeltaError, DeltaReader, pack_delta
from skillswarm.protocol.identity import load_or_create_identity, peer_id_of, public_key_bytes
from skillswarm.protocol.manifest import DeltaManifest, ManifestError, SignedManifest, sign_manifest
from skillswarm.protocol.messages import (
    MAX_GOSSIP_BYTES,
    CheckpointPublished,
    DeltaAnnounced,
    MessageError,
    UnknownMessage,
    decode_message,
    encode_message,
)

BASE_ID = "ab" * 32


@pytest.fixture
def keys(tmp_path: Path):
    return load_or_create_identity(tmp_path / "a.key"), load_or_create_identity(tmp_path / "b.key")


def _delta(tmp_path: Path, key_pair, round: int = 1) -> tuple[DeltaManifest, BlobStore, dict]:
    torch.manual_seed(0)
    base = {"w": torch.randn(4, 3), "b": torch.randn(64), "same": torch.randn(5)}
    tuned = {"w": base["w"] + 0.5, "b": base["b"].clone(), "same": base["same"].clone()}
    tuned["b"][1] += 1.0
    store = BlobStore(tmp_path / "blobs")
    manifest = pack_delta(
        base,
        tuned,
        store,
        peer_id=peer_id_of(key_pair),
        public_key=public_key_bytes(key_pair),
        domain="math",
        base_id=BASE_ID,
        round=round,
        steps=3,
        metrics={"reward_mean": 0.25},
    )
    return manifest, store, {"base": base, "tuned": tuned}


def test_delta_roundtrip_and_signature(tmp_path, keys):
    a, _ = keys
    manifest, store, weights = _delta(tmp_path, a)
    signed = sign_manifest(manifest, a)
    verified = signed.verify(announcing_peer=peer_id_of(a))
    assert verified == manifest
    assert DeltaManifest.decode(manifest.encode()).encode() == manifest.encode()
    reader = DeltaReader(verified, store)
    assert reader.names() == ["b", "w"]  # the unchanged tensor is left out
    assert manifest.tensors["w"].encoding == "dense"  # every element changed
    assert manifest.tensors["b"].encoding == "sparse" and manifest.tensors["b"].nnz == 1
    for name, base in weights["base"].items():
        rebuilt = reader.expert(name, base)
        if name == "same":
            assert rebuilt is None
        else:
            assert torch.equal(rebuilt, weights["tuned"][name])
    assert torch.allclose(reader.delta("w", weights["base"]["w"]), torch.full((4, 3), 0.5))


def test_tampered_manifest_fails(tmp_path, keys):
    a, _ = keys
    manifest, _, _ = _delta(tmp_path, a)
    signed = sign_manifest(manifest, a)
    tampered = manifest.model_copy(update={"round": 7}).encode()
    with pytest.raises(ManifestError, match="bad signature"):
        SignedManifest(manifest_bytes=tampered, signature=signed.signature).verify()


def test_manifest_signed_by_other_key_or_announced_by_other_peer_fails(tmp_path, keys):
    a, b = keys
    manifest, _, _ = _delta(tmp_path, a)
    # b signs a manifest that names a as its peer: the key check refuses it.
    forged = SignedManifest(manifest_bytes=manifest.encode(), signature=b"x" * 64)
    with pytest.raises(ManifestError, match="bad signature"):
        forged.verify()
    with pytest.raises(ManifestError, match="does not match the signing key"):
        sign_manifest(manifest, b)
    claims_a_with_b_key = manifest.model_copy(update={"public_key": public_key_bytes(b)})
    with pytest.raises(ManifestError, match="its key belongs to"):
        SignedManifest(manifest_bytes=claims_a_with_b_key.encode(), signature=b"x").verify()
    # A valid manifest of a, relayed by b as if it were b's announcement.
    with pytest.raises(ManifestError, match="announced by"):
        sign_manifest(manifest, a).verify(announcing_peer=peer_id_of(b))


def test_manifest_bounds(tmp_path, keys):
    a, _ = keys
    manifest, _, _ = _delta(tmp_path, a)
    with pytest.raises(ManifestError, match="limit"):
        DeltaManifest.decode(b"\x00" * (600 * 1024))
    with pytest.raises(ManifestError, match="malformed"):
        DeltaManifest.decode(msgpack.packb({"schema": "skillswarm.delta/99"}))
    entry = manifest.tensors["w"]
    bad = manifest.model_copy(update={"tensors": {"w": entry.model_copy(update={"offset": 10**9})}})
    with pytest.raises(ManifestError, match="starts at byte 1000000000 of blob"):
        DeltaManifest.decode(bad.encode())


def test_manifest_bounds_every_byte_a_peer_would_be_asked_for(tmp_path, keys):
    """A blob is exactly its tensors' payloads and a payload at most its tensor's dense size, so
    a manifest cannot make the coordinator download or read bytes no tensor needs."""
    a, _ = keys
    manifest, _, _ = _delta(tmp_path, a)
    (sha, size), entry = next(iter(manifest.blobs.items())), manifest.tensors["b"]

    def refused(match: str, **changes: object) -> None:
        with pytest.raises(ManifestError, match=match):
            DeltaManifest.decode(manifest.model_copy(update=changes).encode())

    refused("greater than or equal to 0", blobs={sha: -5})
    refused(f"listed as {size + 1} bytes", blobs={sha: size + 1})
    refused("listed as 10 bytes but its contents take 0", blobs={sha: size, "cd" * 32: 10})
    refused("listed but nothing is in it", blobs={sha: size, "cd" * 32: 0})
    refused("String should match pattern", blobs={sha: size, "../x": 0})
    refused("not listed", blobs={"cd" * 32: size})
    refused(
        "a dense entry of shape \\(64,\\) is 256 bytes",
        tensors={**manifest.tensors, "b": entry.model_copy(update={"encoding": "dense"})},
    )
    refused(
        "does not fit shape",
        tensors={**manifest.tensors, "b": entry.model_copy(update={"nnz": 65})},
    )
    refused(
        "greater than or equal to 0",
        tensors={**manifest.tensors, "b": entry.model_copy(update={"shape": (-64,)})},
    )
    assert DeltaManifest.decode(manifest.encode()) == manifest


def test_a_delta_that_changes_nothing_decodes_and_a_non_finite_int8_one_is_refused(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    base = {"w": torch.randn(4, 3)}
    fields = {"peer_id": "p", "public_key": b"", "domain": "math", "base_id": BASE_ID}
    same = pack_delta(base, {"w": base["w"].clone()}, store, round=1, steps=1, **fields)
    assert same.tensors == {} and list(same.blobs.values()) == [0]
    assert DeltaManifest.decode(same.encode()) == same
    broken = {"w": base["w"].clone()}
    broken["w"][0, 0] = float("inf")
    before = set(store.blob_ids())
    with pytest.raises(DeltaError, match="not finite"):
        pack_delta(base, broken, store, round=1, steps=1, lossy_int8=True, **fields)
    assert set(store.blob_ids()) == before  # refused before anything was written


def test_reader_refuses_mismatched_shape(tmp_path, keys):
    a, _ = keys
    manifest, store, weights = _delta(tmp_path, a)
    with pytest.raises(DeltaError, match="does not match base"):
        DeltaReader(manifest, store).expert("w", torch.zeros(3, 4))
    with pytest.raises(DeltaError, match="different tensors"):
        pack_delta(
            {"x": torch.zeros(1)},
            {"y": torch.zeros(1)},
            store,
            peer_id="p",
            public_key=b"",
            domain="math",
            base_id=BASE_ID,
            round=1,
            steps=1,
        )


def test_gossip_messages(tmp_path, keys):
    a, _ = keys
    manifest, _, _ = _delta(tmp_path, a)
    signed = sign_manifest(manifest, a)
    raw = encode_message(
        DeltaAnnounced(manifest_bytes=signed.manifest_bytes, signature=signed.signature)
    )
    decoded = decode_message(raw)
    assert isinstance(decoded, DeltaAnnounced)
    assert decoded.signed.verify() == manifest
    published = CheckpointPublished(checkpoint_id="cd" * 32, round=1, parent=BASE_ID)
    assert decode_message(encode_message(published)) == published
    with pytest.raises(UnknownMessage):
        decode_message(msgpack.packb({"v": 1, "body": {"type": "please_merge_me"}}))
    with pytest.raises(UnknownMessage):
        decode_message(msgpack.packb({"v": 2, "body": {"type": "delta_announced"}}))
    with pytest.raises(MessageError, match="exceeds"):
        decode_message(b"\x00" * (MAX_GOSSIP_BYTES + 1))
    with pytest.raises(MessageError, match="not msgpack|envelope"):
        decode_message(b"\xc1garbage")
    with pytest.raises(MessageError, match="invalid"):
        decode_message(msgpack.packb({"v": 1, "body": {"type": "checkpoint_published"}}))
