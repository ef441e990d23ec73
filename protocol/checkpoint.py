"""Checkpoint manifests: the content-addressed description of a Hugging Face checkpoint folder.

A checkpoint's id is the sha256 of its manifest's canonical msgpack bytes; its revision (what
Hugging Face clients treat as a commit) is the first 40 hex digits of that id.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from skillswarm.protocol.canonical import CanonicalEncodingError, canonical_packb
from skillswarm.protocol.durable import write_bytes_atomically

MANIFEST_FILE_NAME = "skillswarm_manifest.msgpack"
MANIFEST_SCHEMA = "skillswarm.checkpoint/1"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_FILES = 100_000
MAX_PATH_CHARS = 1024
HASH_CHUNK_BYTES = 1024 * 1024

CHECKPOINT_ID_PATTERN = re.compile(r"^[0-9a-f]{64}$")
REVISION_PATTERN = re.compile(r"^[0-9a-f]{40}$")


class CheckpointError(ValueError):
    """A checkpoint folder or manifest cannot be used as it is."""


class UnsafeCheckpointPath(CheckpointError):
    """A file name that could escape its folder or is not a plain relative posix path."""


class CheckpointMismatch(CheckpointError):
    """A folder's files differ from the manifest that describes them."""

    def __init__(self, relative_path: str, reason: str) -> None:
        super().__init__(f"checkpoint file {relative_path!r} {reason}")
        self.relative_path = relative_path
        self.reason = reason


def validate_relative_path(path: str) -> str:
    """Return `path` if it is a safe relative posix file name inside a checkpoint, else raise.

    Refused: empty names, absolute paths, backslashes, NUL and control characters, empty
    components, and any component starting with "." (covers "." and ".." and hidden files, which
    are never part of a checkpoint). The manifest's own file name is refused too.
    """
    if not path or len(path) > MAX_PATH_CHARS:
        raise UnsafeCheckpointPath(f"file name of length {len(path)} is not allowed")
    if path.startswith("/") or "\\" in path or any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise UnsafeCheckpointPath(f"file name {path!r} is not a plain relative posix path")
    if re.match(r"^[A-Za-z]:", path):
        raise UnsafeCheckpointPath(f"file name {path!r} looks like a drive path")
    for part in path.split("/"):
        if not part or part.startswith("."):
            raise UnsafeCheckpointPath(f"file name {path!r} has an empty, dot or hidden component")
    if path == MANIFEST_FILE_NAME:
        raise UnsafeCheckpointPath(f"{MANIFEST_FILE_NAME} describes a checkpoint, not part of it")
    return path


class CheckpointFile(BaseModel):
    """One file of a checkpoint: where it sits in the folder, how big it is and its sha256."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(max_length=MAX_PATH_CHARS, description="relative posix path in the folder")
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _path_is_safe(cls, value: str) -> str:
        return validate_relative_path(value)


def _utc_now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class CheckpointManifest(BaseModel):
    """Every file of a checkpoint plus its lineage; its canonical bytes name the checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal["skillswarm.checkpoint/1"] = Field(default=MANIFEST_SCHEMA, alias="schema")
    files: tuple[CheckpointFile, ...] = Field(max_length=MAX_FILES)
    round: int = Field(default=0, ge=0)
    parent: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    method: str | None = Field(default=None, max_length=128)
    created_at: str = Field(default_factory=_utc_now_iso, max_length=64)
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("files")
    @classmethod
    def _files_sorted_and_unique(
        cls, files: tuple[CheckpointFile, ...]
    ) -> tuple[CheckpointFile, ...]:
        ordered = tuple(sorted(files, key=lambda entry: entry.path))
        for previous, current in zip(ordered, ordered[1:], strict=False):
            if previous.path == current.path:
                raise ValueError(f"file {current.path!r} is listed twice")
        paths = {entry.path for entry in ordered}
        for entry in ordered:
            parts = entry.path.split("/")
            for depth in range(1, len(parts)):
                if "/".join(parts[:depth]) in paths:
                    raise ValueError(f"{entry.path!r} lies under a listed file")
        return ordered

    @field_validator("created_at")
    @classmethod
    def _created_at_is_iso(cls, value: str) -> str:
        try:
            datetime.fromisoformat(value)
        except ValueError as exc:
            raise ValueError(f"created_at {value!r} is not an ISO 8601 timestamp") from exc
        return value

    def encode(self) -> bytes:
        """Canonical msgpack bytes: maps with sorted keys, files sorted by path."""
        data = self.model_dump(by_alias=True, mode="python")
        data["files"] = [dict(entry) for entry in data["files"]]
        try:
            return canonical_packb(data)
        except CanonicalEncodingError as exc:
            raise CheckpointError(
                f"manifest extra metadata has no canonical encoding: {exc}"
            ) from exc

    @classmethod
    def decode(cls, raw: bytes) -> CheckpointManifest:
        """Parse manifest bytes, bounded in size; raises CheckpointError when malformed."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CheckpointError(
                f"checkpoint manifest is {len(raw)} bytes; the limit is {MAX_MANIFEST_BYTES}"
            )
        try:
            data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
            return cls.model_validate(data)
        except (ValueError, ValidationError, TypeError, msgpack.ExtraData) as exc:
            raise CheckpointError(f"malformed checkpoint manifest: {exc}") from exc

    @cached_property
    def checkpoint_id(self) -> str:
        """sha256 hex of the canonical manifest bytes (64 characters)."""
        return hashlib.sha256(self.encode()).hexdigest()

    @property
    def revision(self) -> str:
        """The 40-hex prefix of the id, the commit id Hugging Face clients see."""
        return self.checkpoint_id[:40]

    @property
    def total_size(self) -> int:
        return sum(entry.size for entry in self.files)

    @cached_property
    def _files_by_path(self) -> dict[str, CheckpointFile]:
        return {entry.path: entry for entry in self.files}

    def file(self, relative_path: str) -> CheckpointFile | None:
        """The entry for exactly this relative path, or None if the checkpoint has no such file."""
        return self._files_by_path.get(relative_path)


def sha256_of_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def iter_checkpoint_files(folder: Path) -> Iterator[tuple[str, Path]]:
    """Yield (relative posix path, absolute path) of every checkpoint file in `folder`, sorted.

    Hidden files and folders (a leading "." anywhere, such as `.cache/` or `.partial/`) and the
    manifest file are not part of a checkpoint. File symlinks are followed; directory symlinks
    are refused, so a checkpoint is always a plain tree.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist or is not a directory")
    found: list[tuple[str, Path]] = []
    for current, dir_names, file_names in os.walk(folder, followlinks=False):
        current_path = Path(current)
        for name in list(dir_names):
            if name.startswith("."):
                dir_names.remove(name)
            elif (current_path / name).is_symlink():
                raise CheckpointError(
                    f"{current_path / name} is a symlinked directory; copy it into the folder"
                )
        for name in file_names:
            if name.startswith("."):
                continue
            absolute = current_path / name
            relative = absolute.relative_to(folder).as_posix()
            if relative == MANIFEST_FILE_NAME:
                continue
            if not absolute.is_file():
                raise CheckpointError(f"{absolute} is not a regular file (a dangling link?)")
            found.append((validate_relative_path(relative), absolute))
    found.sort()
    return iter(found)


def build_manifest(folder: Path, **metadata: Any) -> CheckpointManifest:
    """Hash every file of `folder` and describe it.

    Metadata keywords: round, parent, method, created_at, extra.
    """
    files = [
        CheckpointFile(path=relative, size=absolute.stat().st_size, sha256=sha256_of_file(absolute))
        for relative, absolute in iter_checkpoint_files(folder)
    ]
    if not files:
        raise CheckpointError(f"checkpoint folder {folder} holds no files")
    try:
        return CheckpointManifest(files=tuple(files), **metadata)
    except ValidationError as exc:
        raise CheckpointError(f"bad checkpoint metadata: {exc}") from exc


def verify_folder(
    folder: Path, manifest: CheckpointManifest, *, allow_extra_files: bool = False
) -> None:
    """Check every listed file's size and sha256; raise CheckpointMismatch naming the first bad one.

    Files present in the folder but not listed are an error unless `allow_extra_files`.
    """
    folder = Path(folder)
    for entry in manifest.files:
        path = folder / entry.path
        if path.is_symlink() or not path.is_file():
            raise CheckpointMismatch(entry.path, "is missing or not a regular file")
        size = path.stat().st_size
        if size != entry.size:
            raise CheckpointMismatch(
                entry.path, f"has {size} bytes; the manifest says {entry.size}"
            )
        digest = sha256_of_file(path)
        if digest != entry.sha256:
            raise CheckpointMismatch(
                entry.path, f"has sha256 {digest[:12]}…; the manifest says {entry.sha256[:12]}…"
            )
    if not allow_extra_files:
        listed = {entry.path for entry in manifest.files}
        for relative, _ in iter_checkpoint_files(folder):
            if relative not in listed:
                raise CheckpointMismatch(relative, "is in the folder but not in the manifest")


def write_manifest(folder: Path, manifest: CheckpointManifest) -> Path:
    """Write the manifest into `folder` as skillswarm_manifest.msgpack (temp, fsync, rename)."""
    target = Path(folder) / MANIFEST_FILE_NAME
    write_bytes_atomically(target, manifest.encode())
    return target


def read_manifest(folder: Path) -> CheckpointManifest:
    """Read `folder`/skillswarm_manifest.msgpack; raises CheckpointError if absent or bad."""
    path = Path(folder) / MANIFEST_FILE_NAME
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symlink, not the manifest file")
    try:
        # O_NOFOLLOW: a manifest replaced by a symlink is refused, never read through.
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(descriptor, "rb") as handle:
            raw = handle.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{folder} has no {MANIFEST_FILE_NAME}") from exc
    except OSError as exc:  # ELOOP: a symlink
        raise CheckpointError(f"{path} is not a regular file: {exc.strerror}") from exc
    return CheckpointManifest.decode(raw)
