"""Tests of the content-addressed blob store: naming, atomic writes, partial downloads, gc."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from skillswarm.protocol.blobstore import BlobCorrupted, BlobNotFound, BlobStore, InvalidBlobId

pytestmark = pytest.mark.timeout(30)


def stray_files(store: BlobStore) -> list[Path]:
    """Temp files left in the store's temp directory."""
    return list((store.root / ".tmp").iterdir())


def test_put_bytes_is_content_addressed_and_sharded(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = b"some tensor bytes"
    sha256 = store.put_bytes(data)

    assert sha256 == hashlib.sha256(data).hexdigest()
    assert store.path(sha256) == tmp_path / "blobs" / sha256[:2] / sha256
    assert store.path(sha256).read_bytes() == data
    assert store.has(sha256)
    assert store.size(sha256) == len(data)
    assert store.put_bytes(data) == sha256  # idempotent
    assert list(store.blob_ids()) == [sha256]
    assert stray_files(store) == []


def test_put_file_streams_a_large_file_to_the_same_id(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(3 * (1 << 20) + 12345)  # spans several copy chunks
    source = tmp_path / "model.safetensors"
    source.write_bytes(data)

    sha256 = store.put_file(source)

    assert sha256 == hashlib.sha256(data).hexdigest()
    assert store.path(sha256).read_bytes() == data
    assert stray_files(store) == []


@pytest.mark.parametrize(
    "bad_id",
    [
        "",
        "abc",
        "A" * 64,
        "g" * 64,
        "0" * 63,
        "0" * 65,
        "../" + "0" * 61,
        "0" * 62 + "/x",
        "0" * 64 + "\n",
        None,
    ],
)
def test_ids_that_are_not_64_lowercase_hex_are_refused(tmp_path: Path, bad_id: object) -> None:
    store = BlobStore(tmp_path / "blobs")
    for operation in (store.path, store.has, store.partial_path, store.open_partial, store.delete):
        with pytest.raises(InvalidBlobId):
            operation(bad_id)  # type: ignore[arg-type]


def test_missing_blob_size_raises_blob_not_found(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    with pytest.raises(BlobNotFound):
        store.size("0" * 64)


def test_failed_write_leaves_neither_blob_nor_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = b"never lands"

    def failing_fsync(fd: int) -> None:
        raise OSError("disk failed")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk failed"):
        store.put_bytes(data)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    with pytest.raises(OSError, match="disk failed"):
        store.put_file(source)
    monkeypatch.undo()

    assert not store.has(hashlib.sha256(data).hexdigest())
    assert list(store.blob_ids()) == []
    assert stray_files(store) == []


def test_put_file_of_missing_source_leaves_nothing(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    with pytest.raises(FileNotFoundError):
        store.put_file(tmp_path / "absent")
    assert stray_files(store) == []


def test_partial_download_commits_when_the_hash_matches(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(100_000)
    sha256 = hashlib.sha256(data).hexdigest()

    partial, length = store.open_partial(sha256)
    assert length == 0
    partial.write_bytes(data[:40_000])
    assert store.open_partial(sha256) == (partial, 40_000)  # resumes from its length
    with open(partial, "ab") as partial_file:
        partial_file.write(data[40_000:])

    final = store.commit_partial(sha256)

    assert final == store.path(sha256)
    assert final.read_bytes() == data
    assert not partial.exists()


def test_only_an_empty_partial_is_discarded_as_empty(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    empty, started = "a" * 64, "b" * 64
    empty_partial, _ = store.open_partial(empty)
    started_partial, _ = store.open_partial(started)
    started_partial.write_bytes(b"x")

    for sha256 in (empty, started, "c" * 64):  # the last has no partial at all
        store.discard_partial_if_empty(sha256)

    assert not empty_partial.exists()
    assert started_partial.read_bytes() == b"x"


def test_corrupted_partial_is_deleted_and_reported(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(50_000)
    sha256 = hashlib.sha256(data).hexdigest()
    partial, _ = store.open_partial(sha256)
    partial.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))

    with pytest.raises(BlobCorrupted, match=sha256):
        store.commit_partial(sha256)

    assert not partial.exists()
    assert not store.has(sha256)


def test_a_download_hashed_as_it_arrives_commits_with_its_digest(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(100_000)
    sha256 = hashlib.sha256(data).hexdigest()
    partial, _ = store.open_partial(sha256)
    partial.write_bytes(data[:40_000])

    partial, length, digest = store.resume_partial(sha256)  # hashes the bytes already there
    assert length == 40_000
    with open(partial, "ab") as partial_file:
        partial_file.write(data[40_000:])
    digest.update(data[40_000:])

    assert store.commit_partial(sha256, digest).read_bytes() == data
    assert not partial.exists()


def test_a_resumed_partial_with_bad_bytes_on_disk_fails_its_commit(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(100_000)
    sha256 = hashlib.sha256(data).hexdigest()
    partial, _ = store.open_partial(sha256)
    partial.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:40_000])

    _, _, digest = store.resume_partial(sha256)
    with open(partial, "ab") as partial_file:
        partial_file.write(data[40_000:])
    digest.update(data[40_000:])  # every byte received since was right

    with pytest.raises(BlobCorrupted, match=sha256):
        store.commit_partial(sha256, digest)
    assert not partial.exists()
    assert not store.has(sha256)


def test_commit_without_partial_raises_blob_not_found(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    with pytest.raises(BlobNotFound):
        store.commit_partial("0" * 64)


def test_delete_removes_blob_and_partial(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    sha256 = store.put_bytes(b"to delete")
    partial, _ = store.open_partial(sha256)

    assert store.delete(sha256) is True
    assert not store.has(sha256)
    assert not partial.exists()
    assert store.delete(sha256) is False


def test_gc_keeps_only_the_listed_blobs_and_partials(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    kept = store.put_bytes(b"kept")
    dropped = {store.put_bytes(f"dropped {i}".encode()) for i in range(3)}
    kept_partial, _ = store.open_partial("a" * 64)
    dropped_partial, _ = store.open_partial("b" * 64)
    stale_temp = store.root / ".tmp" / "blob-crashed.tmp"
    stale_temp.write_bytes(b"left by a crash")
    os.utime(stale_temp, (0, 0))
    fresh_temp = store.root / ".tmp" / "blob-in-flight.tmp"
    fresh_temp.write_bytes(b"being written now")

    removed = store.gc(keep={kept, "a" * 64})

    assert removed == 3
    assert list(store.blob_ids()) == [kept]
    assert all(not store.has(sha256) for sha256 in dropped)
    assert kept_partial.exists()
    assert not dropped_partial.exists()
    assert not stale_temp.exists()
    assert fresh_temp.exists()
    assert store.gc(keep={kept, "a" * 64}) == 0
