"""Ed25519 libp2p identity of a peer: the key file (mode 0600), its PeerID, and signatures.

The PeerID is the identity: manifests are signed with the key and verified against the PeerID.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from libp2p.crypto.ed25519 import create_new_key_pair as create_ed25519_key_pair
from libp2p.crypto.keys import KeyPair, KeyType, PrivateKey, PublicKey
from libp2p.peer.id import ID
from skillswarm.protocol.durable import fsync_directory

__all__ = [
    "IdentityError",
    "KeyPair",
    "load_or_create_identity",
    "peer_id_from_public_key_bytes",
    "peer_id_of",
    "public_key_bytes",
    "public_key_bytes_from_peer_id",
    "sign",
    "verify",
]

ED25519_KEY_BYTES = 32
# A serialized Ed25519 private key is 36 bytes; anything far larger is not a key file.
MAX_IDENTITY_FILE_BYTES = 4096


class IdentityError(Exception):
    """An identity file or public key cannot be used (bad permissions, corrupt, wrong type)."""


def load_or_create_identity(path: Path) -> KeyPair:
    """Load the Ed25519 key pair stored at `path`, creating it (mode 0600) if the file is absent."""
    path = Path(path)
    try:
        return _load_identity(path)
    except FileNotFoundError:
        pass
    key_pair = create_ed25519_key_pair()
    if _write_new_identity(path, key_pair.private_key.serialize()):
        return key_pair
    # Another process created the file between our check and our write: use theirs.
    return _load_identity(path)


def peer_id_of(key_pair: KeyPair) -> str:
    """The base58 PeerID of a key pair."""
    return ID.from_pubkey(key_pair.public_key).to_base58()


def public_key_bytes(key_pair: KeyPair) -> bytes:
    """The libp2p protobuf serialization of the public key, from which the PeerID derives."""
    return key_pair.public_key.serialize()


def peer_id_from_public_key_bytes(data: bytes) -> str:
    """The base58 PeerID of a serialized Ed25519 public key; IdentityError for anything else."""
    return ID.from_pubkey(_deserialize_ed25519_public_key(data)).to_base58()


def public_key_bytes_from_peer_id(peer_id: str) -> bytes:
    """The serialized public key embedded in an Ed25519 PeerID (identity multihash)."""
    try:
        key = ID.from_base58(peer_id).extract_public_key()
    except Exception as error:
        raise IdentityError(f"{peer_id!r} is not a base58 PeerID: {error}") from error
    if key is None or key.get_type() != KeyType.Ed25519:
        raise IdentityError(f"PeerID {peer_id!r} does not embed an Ed25519 public key")
    return key.serialize()


def sign(key_pair: KeyPair, data: bytes) -> bytes:
    """Ed25519 signature of `data` with the key pair's private key."""
    return key_pair.private_key.sign(data)


def verify(public_key_bytes: bytes, data: bytes, signature: bytes) -> bool:
    """True if `signature` is a valid Ed25519 signature of `data`; False on any bad input."""
    try:
        key = _deserialize_ed25519_public_key(public_key_bytes)
        return bool(key.verify(data, signature))
    except Exception:
        return False


def _deserialize_ed25519_public_key(data: bytes) -> PublicKey:
    try:
        proto = PublicKey.deserialize_from_protobuf(bytes(data))
    except Exception as error:
        raise IdentityError(f"not a serialized libp2p public key: {error}") from error
    if proto.key_type != KeyType.Ed25519.value:
        raise IdentityError(f"public key type {proto.key_type} is not Ed25519")
    if len(proto.data) != ED25519_KEY_BYTES:
        raise IdentityError(f"Ed25519 public key has {len(proto.data)} bytes, expected 32")
    try:
        key = Ed25519PublicKey.from_bytes(proto.data)
    except Exception as error:
        raise IdentityError(f"invalid Ed25519 public key: {error}") from error
    if key.serialize() != bytes(data):
        raise IdentityError("public key bytes are not in canonical libp2p encoding")
    return key


def _load_identity(path: Path) -> KeyPair:
    fd = os.open(path, os.O_RDONLY)
    try:
        file_stat = os.fstat(fd)
        if not stat.S_ISREG(file_stat.st_mode):
            raise IdentityError(f"identity path {path} is not a regular file")
        mode = stat.S_IMODE(file_stat.st_mode)
        if mode & 0o077:
            raise IdentityError(
                f"identity file {path} is accessible by group or others (mode {mode:04o}); "
                f"run `chmod 600 {path}`"
            )
        data = os.read(fd, MAX_IDENTITY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_IDENTITY_FILE_BYTES:
        raise IdentityError(f"identity file {path} is too large to be a key; is it the right file?")
    private_key = _deserialize_ed25519_private_key(data, path)
    return KeyPair(private_key, private_key.get_public_key())


def _deserialize_ed25519_private_key(data: bytes, path: Path) -> PrivateKey:
    corrupt = f"identity file {path} is corrupt; restore it from a backup or delete it"
    try:
        proto = PrivateKey.deserialize_from_protobuf(data)
    except Exception as error:
        raise IdentityError(f"{corrupt} ({error})") from error
    if proto.key_type != KeyType.Ed25519.value:
        raise IdentityError(f"identity file {path} holds a non-Ed25519 key (type {proto.key_type})")
    if len(proto.data) != ED25519_KEY_BYTES:
        raise IdentityError(f"{corrupt} (key has {len(proto.data)} bytes, expected 32)")
    return Ed25519PrivateKey.from_bytes(proto.data)


def _write_new_identity(path: Path, serialized_private_key: bytes) -> bool:
    """Atomically create `path` (mode 0600 from the first byte). False if it already exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # mkstemp creates the file with mode 0600 regardless of umask.
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.write(fd, serialized_private_key)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            # link() never replaces an existing file, unlike rename().
            os.link(temp_name, path)
        except FileExistsError:
            return False
        except OSError as error:
            if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            if path.exists():
                return False
            os.replace(temp_name, path)
        fsync_directory(path.parent)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
