"""Tests of the Ed25519 identity: key file handling, PeerIDs and signatures."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from libp2p.crypto.secp256k1 import create_new_key_pair as create_secp256k1_key_pair
from skillswarm.protocol.identity import (
    IdentityError,
    load_or_create_identity,
    peer_id_from_public_key_bytes,
    peer_id_of,
    public_key_bytes,
    public_key_bytes_from_peer_id,
    sign,
    verify,
)

pytestmark = pytest.mark.timeout(30)


def file_mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_created_identity_file_is_0600_and_loads_back_the_same_key(tmp_path: Path) -> None:
    key_file = tmp_path / "keys" / "node.key"
    previous_umask = os.umask(0)  # even a permissive umask must not widen the key file's mode
    try:
        created = load_or_create_identity(key_file)
    finally:
        os.umask(previous_umask)

    assert file_mode(key_file) == 0o600
    loaded = load_or_create_identity(key_file)
    assert peer_id_of(loaded) == peer_id_of(created)
    assert public_key_bytes(loaded) == public_key_bytes(created)
    assert sorted(p.name for p in key_file.parent.iterdir()) == ["node.key"]  # no temp left


def test_two_identity_files_give_two_peer_ids(tmp_path: Path) -> None:
    first = load_or_create_identity(tmp_path / "a.key")
    second = load_or_create_identity(tmp_path / "b.key")
    assert peer_id_of(first) != peer_id_of(second)
    assert peer_id_of(first).startswith("12D3KooW")  # Ed25519 PeerIDs embed the key


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_key_file_readable_by_others_is_refused_with_chmod_advice(
    tmp_path: Path, mode: int
) -> None:
    key_file = tmp_path / "node.key"
    load_or_create_identity(key_file)
    key_file.chmod(mode)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(key_file)


@pytest.mark.parametrize(
    "content",
    [b"", b"not a key at all", os.urandom(36), b"\x08\x01\x12\x05short", b"x" * 10_000],
    ids=["empty", "text", "random-36-bytes", "truncated-protobuf", "oversized"],
)
def test_corrupt_key_file_is_refused(tmp_path: Path, content: bytes) -> None:
    key_file = tmp_path / "node.key"
    key_file.write_bytes(content)
    key_file.chmod(0o600)
    with pytest.raises(IdentityError):
        load_or_create_identity(key_file)
    assert key_file.read_bytes() == content  # never overwritten


def test_identity_path_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="not a regular file"):
        load_or_create_identity(tmp_path)


def test_non_ed25519_key_file_is_refused(tmp_path: Path) -> None:
    key_file = tmp_path / "node.key"
    key_file.write_bytes(create_secp256k1_key_pair().private_key.serialize())
    key_file.chmod(0o600)
    with pytest.raises(IdentityError, match="non-Ed25519"):
        load_or_create_identity(key_file)


def test_peer_id_derives_from_public_key_bytes_both_ways(tmp_path: Path) -> None:
    key_pair = load_or_create_identity(tmp_path / "node.key")
    peer_id = peer_id_of(key_pair)
    assert peer_id_from_public_key_bytes(public_key_bytes(key_pair)) == peer_id
    assert public_key_bytes_from_peer_id(peer_id) == public_key_bytes(key_pair)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"garbage",
        create_secp256k1_key_pair().public_key.serialize(),
        b"\x08\x01\x12\x10" + b"\x01" * 16,  # Ed25519 type with a 16-byte key
    ],
    ids=["empty", "garbage", "secp256k1", "short-ed25519"],
)
def test_bad_public_key_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(IdentityError):
        peer_id_from_public_key_bytes(data)


def test_public_key_in_non_canonical_encoding_is_refused(tmp_path: Path) -> None:
    key_pair = load_or_create_identity(tmp_path / "node.key")
    repeated_type_field = b"\x08\x01"  # parses, but is not how libp2p encodes a key
    with pytest.raises(IdentityError, match="canonical"):
        peer_id_from_public_key_bytes(public_key_bytes(key_pair) + repeated_type_field)


def test_peer_id_without_embedded_ed25519_key_is_refused() -> None:
    with pytest.raises(IdentityError):
        public_key_bytes_from_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    with pytest.raises(IdentityError):
        public_key_bytes_from_peer_id("not-base58-0OIl")


def test_signature_verifies_only_for_the_signing_key_and_data(tmp_path: Path) -> None:
    signer = load_or_create_identity(tmp_path / "signer.key")
    other = load_or_create_identity(tmp_path / "other.key")
    data = b"delta manifest bytes"
    signature = sign(signer, data)

    assert verify(public_key_bytes(signer), data, signature)
    assert not verify(public_key_bytes(other), data, signature)
    assert not verify(public_key_bytes(signer), data + b"!", signature)
    tampered = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verify(public_key_bytes(signer), data, tampered)


@pytest.mark.parametrize(
    ("key", "signature"),
    [(b"", b"\x00" * 64), (b"garbage", b"\x00" * 64), (None, b"\x00" * 64), ("valid", b"short")],
)
def test_verify_returns_false_on_malformed_input(
    tmp_path: Path, key: bytes | str | None, signature: bytes
) -> None:
    key_pair = load_or_create_identity(tmp_path / "node.key")
    key_bytes = public_key_bytes(key_pair) if key == "valid" else key
    assert verify(key_bytes, b"data", signature) is False  # type: ignore[arg-type]
