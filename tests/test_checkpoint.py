"""Checkpoint manifests: content addressing, canonical bytes, folder verification, safe names."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgpack
import pytest
from skillswarm.protocol.checkpoint import (
    MANIFEST_FILE_NAME,
    MAX_MANIFEST_BYTES,
    CheckpointError,
    CheckpointFile,
    CheckpointManifest,
    CheckpointMismatch,
    UnsafeCheckpointPath,
    build_manifest,
    read_manifest,
    validate_relative_path,
    verify_folder,
    write_manifest,
)

PARENT = "cd" * 32
CREATED = "2025-01-02T03:04:05.000006+00:00"


def _folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "qwen2"}')
    (root / "model.safetensors").write_bytes(os.urandom(3000))
    (root / "sub" / "tokenizer.json").write_text('{"version": "1.0"}')
    return root


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "ckpt")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "download.lock").write_text("not part of a checkpoint")
    manifest = build_manifest(folder, round=3, parent=PARENT, method="ties", created_at=CREATED)

    assert [f.path for f in manifest.files] == [
        "config.json",
        "model.safetensors",
        "sub/tokenizer.json",
    ]
    weights = (folder / "model.safetensors").read_bytes()
    entry = manifest.file("model.safetensors")
    assert entry == CheckpointFile(
        path="model.safetensors", size=3000, sha256=hashlib.sha256(weights).hexdigest()
    )
    assert manifest.total_size == sum(f.size for f in manifest.files)
    assert (manifest.round, manifest.parent, manifest.method) == (3, PARENT, "ties")


def test_checkpoint_id_is_sha256_of_canonical_bytes_and_revision_its_prefix(
    tmp_path: Path,
) -> None:
    folder = _folder(tmp_path / "ckpt")
    first = build_manifest(
        folder, round=1, created_at=CREATED, extra={"b": 1, "a": {"y": 2, "x": 3}}
    )
    again = build_manifest(
        folder, round=1, created_at=CREATED, extra={"a": {"x": 3, "y": 2}, "b": 1}
    )

    assert first.encode() == again.encode()
    assert first.checkpoint_id == hashlib.sha256(first.encode()).hexdigest()
    assert len(first.checkpoint_id) == 64
    assert first.revision == first.checkpoint_id[:40]
    decoded = msgpack.unpackb(first.encode())
    assert list(decoded) == sorted(decoded)
    assert list(decoded["extra"]["a"]) == ["x", "y"]
    other_round = build_manifest(folder, round=2, created_at=CREATED, extra={"b": 1})
    assert other_round.checkpoint_id != first.checkpoint_id


def test_manifest_round_trips_through_bytes_and_file(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "ckpt")
    manifest = build_manifest(folder, round=2, parent=PARENT, extra={"scores": [0.5, 1.0]})

    assert CheckpointManifest.decode(manifest.encode()) == manifest
    path = write_manifest(folder, manifest)
    assert path == folder / MANIFEST_FILE_NAME
    assert read_manifest(folder).checkpoint_id == manifest.checkpoint_id
    rebuilt = build_manifest(
        folder, round=2, parent=PARENT, created_at=manifest.created_at, extra={"scores": [0.5, 1.0]}
    )
    assert MANIFEST_FILE_NAME not in [f.path for f in rebuilt.files]
    assert rebuilt.checkpoint_id == manifest.checkpoint_id


def test_verify_folder_names_the_first_bad_file(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "ckpt")
    manifest = build_manifest(folder)
    verify_folder(folder, manifest)

    weights = bytearray((folder / "model.safetensors").read_bytes())
    weights[1234] ^= 0x01
    (folder / "model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(CheckpointMismatch, match="model.safetensors") as caught:
        verify_folder(folder, manifest)
    assert caught.value.relative_path == "model.safetensors"
    assert "sha256" in caught.value.reason

    (folder / "sub" / "tokenizer.json").unlink()
    (folder / "config.json").write_text("{}")
    with pytest.raises(CheckpointMismatch, match="config.json"):
        verify_folder(folder, manifest)


def test_verify_folder_refuses_unlisted_files_unless_allowed(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "ckpt")
    manifest = build_manifest(folder)
    (folder / "surprise.bin").write_bytes(b"x")

    with pytest.raises(CheckpointMismatch, match="surprise.bin"):
        verify_folder(folder, manifest)
    verify_folder(folder, manifest, allow_extra_files=True)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "/etc/passwd",
        "../x",
        "a/../b",
        "a/./b",
        "a//b",
        "a\\b",
        ".hidden",
        "a/.git/x",
        "C:/x",
        "x\x00y",
        "a/",
        MANIFEST_FILE_NAME,
    ],
)
def test_unsafe_names_are_refused(name: str) -> None:
    with pytest.raises(UnsafeCheckpointPath):
        validate_relative_path(name)


def test_decode_refuses_unsafe_paths_duplicates_and_oversize() -> None:
    entry = {"path": "../escape", "size": 1, "sha256": "0" * 64}
    raw = msgpack.packb(
        {"schema": "skillswarm.checkpoint/1", "files": [entry], "created_at": CREATED}
    )
    with pytest.raises(CheckpointError, match="escape"):
        CheckpointManifest.decode(raw)

    same = {"path": "a", "size": 1, "sha256": "0" * 64}
    raw = msgpack.packb({"files": [same, same], "created_at": CREATED})
    with pytest.raises(CheckpointError, match="listed twice"):
        CheckpointManifest.decode(raw)

    with pytest.raises(CheckpointError, match="limit"):
        CheckpointManifest.decode(b"\x00" * (MAX_MANIFEST_BYTES + 1))


def test_file_symlinks_are_followed_directory_symlinks_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "blob").write_bytes(b"weights")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").symlink_to(outside / "blob")

    manifest = build_manifest(folder)
    assert manifest.file("model.safetensors") == CheckpointFile(
        path="model.safetensors", size=7, sha256=hashlib.sha256(b"weights").hexdigest()
    )

    (folder / "linked_dir").symlink_to(outside)
    with pytest.raises(CheckpointError, match="symlinked directory"):
        build_manifest(folder)


def test_empty_or_missing_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        build_manifest(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no files"):
        build_manifest(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no skillswarm_manifest"):
        read_manifest(tmp_path / "empty")
