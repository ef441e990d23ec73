"""Content-addressed blob store on disk: blobs named by sha256, sharded as root/ab/abcdef….

Every write is atomic (temp file, fsync, rename); downloads grow a `.partial` file that is
verified against its sha256 before it is renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from skillswarm.protocol.durable import fsync_directory

__all__ = [
    "BlobCorrupted",
    "BlobNotFound",
    "BlobStore",
    "BlobStoreError",
    "InvalidBlobId",
    "validate_blob_id",
]

COPY_CHUNK_BYTES = 1 << 20
STALE_TEMP_SECONDS = 3600.0
_BLOB_ID = re.compile(r"[0-9a-f]{64}")
_TEMP_DIR = ".tmp"
_PARTIAL_DIR = ".partial"
_PARTIAL_SUFFIX = ".partial"


class BlobStoreError(Exception):
    """Base class of blob store errors."""


class InvalidBlobId(BlobStoreError, ValueError):
    """A blob id is not 64 lowercase hex digits."""


class BlobNotFound(BlobStoreError, FileNotFoundError):
    """The blob is not in the store."""


class BlobCorrupted(BlobStoreError):
    """Downloaded bytes do not hash to the blob id they were fetched as."""


def validate_blob_id(sha256: str) -> str:
    """Return `sha256` unchanged if it is 64 lowercase hex digits, else raise InvalidBlobId."""
    if not isinstance(sha256, str) or _BLOB_ID.fullmatch(sha256) is None:
        shown = repr(sha256)[:80]
        raise InvalidBlobId(f"blob id {shown} is not a sha256 of 64 lowercase hex digits")
    return sha256


class BlobStore:
    """Blobs on disk under `root`, addressed by the sha256 of their bytes."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._temp_dir = self.root / _TEMP_DIR
        self._partial_dir = self.root / _PARTIAL_DIR
        self._temp_dir.mkdir(exist_ok=True)
        self._partial_dir.mkdir(exist_ok=True)

    # Naming

    def path(self, sha256: str) -> Path:
        """Where the blob lives (whether or not it exists); validates the id first."""
        validate_blob_id(sha256)
        return self.root / sha256[:2] / sha256

    def partial_path(self, sha256: str) -> Path:
        """Where an unfinished download of the blob accumulates."""
        validate_blob_id(sha256)
        return self._partial_dir / f"{sha256}{_PARTIAL_SUFFIX}"

    # Queries

    def has(self, sha256: str) -> bool:
        """True if the complete blob is in the store."""
        return self.path(sha256).is_file()

    def size(self, sha256: str) -> int:
        """Size in bytes of a stored blob."""
        try:
            return self.path(sha256).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(f"blob {sha256} is not in the store at {self.root}") from None

    def blob_ids(self) -> Iterator[str]:
        """Ids of all complete blobs in the store."""
        for shard in sorted(self.root.iterdir()):
            if not shard.is_dir() or len(shard.name) != 2 or shard.name.startswith("."):
                continue
            for entry in sorted(shard.iterdir()):
                if _BLOB_ID.fullmatch(entry.name) and entry.name[:2] == shard.name:
                    yield entry.name

    # Writes

    def put_bytes(self, data: bytes) -> str:
        """Store `data`; returns its sha256 hex id."""
        sha256 = hashlib.sha256(data).hexdigest()
        if self.has(sha256):
            return sha256
        fd, temp_name = self._new_temp_file()
        try:
            with os.fdopen(fd, "wb") as temp_file:
                temp_file.write(data)
                temp_file.flush()
                os.fsync(temp_file.fileno())
            self._install(Path(temp_name), sha256)
        finally:
            _remove_if_present(Path(temp_name))
        return sha256

    def put_file(self, src: Path) -> str:
        """Copy the file at `src` into the store, streaming; returns its sha256 hex id."""
        digest = hashlib.sha256()
        fd, temp_name = self._new_temp_file()
        try:
            with open(src, "rb") as source, os.fdopen(fd, "wb") as temp_file:
                while chunk := source.read(COPY_CHUNK_BYTES):
                    digest.update(chunk)
                    temp_file.write(chunk)
                temp_file.flush()
                os.fsync(temp_file.fileno())
            sha256 = digest.hexdigest()
            if not self.has(sha256):
                self._install(Path(temp_name), sha256)
        finally:
            _remove_if_present(Path(temp_name))
        return sha256

    def delete(self, sha256: str) -> bool:
        """Remove the blob and any partial download of it; True if a complete blob was removed."""
        _remove_if_present(self.partial_path(sha256))
        return _remove_if_present(self.path(sha256))

    def gc(self, keep: set[str]) -> int:
        """Remove every blob (and partial download) not in `keep`; returns blobs removed.

        Temp files left by crashed writes are removed once they are an hour old.
        """
        removed = 0
        for sha256 in list(self.blob_ids()):
            if sha256 not in keep and _remove_if_present(self.path(sha256)):
                removed += 1
        for partial in self._partial_dir.iterdir():
            sha256 = partial.name.removesuffix(_PARTIAL_SUFFIX)
            if sha256 not in keep:
                _remove_if_present(partial)
        cutoff = time.time() - STALE_TEMP_SECONDS
        for temp in self._temp_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if temp.stat().st_mtime < cutoff:
                    temp.unlink()
        return removed

    # Resumable downloads

    def open_partial(self, sha256: str) -> tuple[Path, int]:
        """The partial-download file of a blob (created empty if absent) and its current length.

        Append the following bytes to it, then call `commit_partial`.
        """
        partial = self.partial_path(sha256)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            length = os.fstat(fd).st_size
        finally:
            os.close(fd)
        return partial, length

    def resume_partial(self, sha256: str) -> tuple[Path, int, hashlib._Hash]:
        """Like `open_partial`, plus a sha256 fed the partial's bytes so far.

        Feed the digest every byte appended to the partial, then pass it to `commit_partial`,
        which then need not read the whole file back: a download hashes as it goes.
        """
        partial, _ = self.open_partial(sha256)
        digest = hashlib.sha256()
        length = 0
        with open(partial, "rb") as partial_file:
            while chunk := partial_file.read(COPY_CHUNK_BYTES):
                digest.update(chunk)
                length += len(chunk)
        return partial, length, digest

    def discard_partial(self, sha256: str) -> None:
        """Delete the partial download of a blob, if any."""
        _remove_if_present(self.partial_path(sha256))

    def discard_partial_if_empty(self, sha256: str) -> None:
        """Delete the partial download of a blob if it holds no byte (a fetch refused or cut
        before its first byte): there is nothing in it to resume from."""
        partial = self.partial_path(sha256)
        try:
            empty = partial.stat().st_size == 0
        except FileNotFoundError:
            return
        if empty:
            _remove_if_present(partial)

    def commit_partial(self, sha256: str, digest: hashlib._Hash | None = None) -> Path:
        """Verify the partial download hashes to `sha256` and move it into place.

        `digest`, from `resume_partial` and fed every byte appended since, spares reading the
        file back; without it the file is read and hashed. On a mismatch the partial is deleted
        and BlobCorrupted is raised.
        """
        partial = self.partial_path(sha256)
        try:
            with open(partial, "rb+") as partial_file:
                if digest is None:
                    digest = hashlib.sha256()
                    while chunk := partial_file.read(COPY_CHUNK_BYTES):
                        digest.update(chunk)
                os.fsync(partial_file.fileno())
        except FileNotFoundError:
            raise BlobNotFound(f"no partial download of blob {sha256} to commit") from None
        actual = digest.hexdigest()
        if actual != sha256:
            _remove_if_present(partial)
            raise BlobCorrupted(
                f"downloaded bytes of blob {sha256} hash to {actual}; partial download deleted, "
                "fetch it again"
            )
        self._install(partial, sha256)
        return self.path(sha256)

    # Internals

    def _new_temp_file(self) -> tuple[int, str]:
        return tempfile.mkstemp(dir=self._temp_dir, prefix="blob-", suffix=".tmp")

    def _install(self, source: Path, sha256: str) -> None:
        """Atomically rename a fully written, fsynced file to the blob's path."""
        target = self.path(sha256)
        target.parent.mkdir(exist_ok=True)
        os.chmod(source, 0o644)
        os.replace(source, target)
        fsync_directory(target.parent)


def _remove_if_present(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
