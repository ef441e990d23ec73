"""The checkpoint registry on disk: content-addressed checkpoint folders plus a `main` ref.

Layout under the root: `checkpoints/<id>/` (the files and their manifest), `refs.json` (the
publication order, the retired set and `main`), `incoming/` (temp copies while publishing) and
`.lock`. Every change is copy-to-temp, fsync, rename, so a crash leaves the old or the new state.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from skillswarm.protocol.checkpoint import (
    CHECKPOINT_ID_PATTERN,
    HASH_CHUNK_BYTES,
    MANIFEST_FILE_NAME,
    REVISION_PATTERN,
    CheckpointError,
    CheckpointFile,
    CheckpointManifest,
    iter_checkpoint_files,
    read_manifest,
    write_manifest,
)
from skillswarm.protocol.durable import fsync_directory, write_bytes_atomically

DEFAULT_REPO_ID = "skillswarm/agent"
MAIN_REF = "main"
REFS_FILE_NAME = "refs.json"
REQUIRED_CHECKPOINT_FILE = "config.json"


class RegistryError(Exception):
    """Base class of registry failures."""


class RevisionNotFound(RegistryError, LookupError):
    """No published checkpoint answers to this revision, id or ref."""


class EntryNotFound(RegistryError, LookupError):
    """The checkpoint has no file of that name."""


class RevisionCollision(RegistryError):
    """Two different checkpoint ids share their 40-hex revision prefix."""


class CheckpointRetired(RegistryError):
    """The checkpoint was retired and is no longer published."""


class RegistryCorrupted(RegistryError):
    """What is on disk contradicts the registry's own records."""


class CheckpointInfo(BaseModel):
    """A published checkpoint as the registry reports it."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="sha256 of the canonical manifest bytes")
    revision: str = Field(description="first 40 hex digits of the id; the commit clients see")
    round: int
    parent: str | None
    method: str | None
    created_at: str
    extra: dict[str, Any]
    files: tuple[CheckpointFile, ...]
    total_size: int
    retired: bool


class _RefsState(BaseModel):
    """The content of refs.json: the only mutable record of the registry."""

    model_config = ConfigDict(extra="forbid")

    format: int = 1
    main: str | None = None
    published: list[str] = Field(default_factory=list)
    retired: list[str] = Field(default_factory=list)

    def latest_unretired(self) -> str | None:
        retired = set(self.retired)
        for checkpoint_id in reversed(self.published):
            if checkpoint_id not in retired:
                return checkpoint_id
        return None


class Registry:
    """Checkpoints published under one repo id, stored under `root`."""

    def __init__(self, root: Path, repo_id: str = DEFAULT_REPO_ID) -> None:
        if repo_id.count("/") != 1 or not all(repo_id.split("/")):
            raise ValueError(f"repo id {repo_id!r} must look like 'namespace/name'")
        self.root = Path(root)
        self.repo_id = repo_id
        self.checkpoints_dir = self.root / "checkpoints"
        self.incoming_dir = self.root / "incoming"
        self.refs_path = self.root / REFS_FILE_NAME
        self._lock_path = self.root / ".lock"
        self._manifests: dict[str, CheckpointManifest] = {}
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        self.incoming_dir.mkdir(parents=True, exist_ok=True)
        self._clean_leftovers()

    # -- reading ------------------------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint ever published here, retired ones included, oldest first."""
        state = self._read_refs()
        retired = set(state.retired)
        return [self._info(cid, cid in retired) for cid in state.published]

    def get(self, ref: str) -> CheckpointInfo:
        """Look up "main", a 40-hex revision or a 64-hex id; raises RevisionNotFound."""
        state = self._read_refs()
        if ref == MAIN_REF:
            if state.main is None:
                raise RevisionNotFound(f"{self.repo_id} has no published checkpoint yet")
            checkpoint_id = state.main
        elif CHECKPOINT_ID_PATTERN.fullmatch(ref) and ref in state.published:
            checkpoint_id = ref
        elif REVISION_PATTERN.fullmatch(ref):
            matches = [cid for cid in state.published if cid.startswith(ref)]
            if not matches:
                raise RevisionNotFound(f"{self.repo_id} has no checkpoint at revision {ref}")
            checkpoint_id = matches[0]
        else:
            raise RevisionNotFound(
                f"{self.repo_id} has no revision {ref!r}; use 'main', a 40-hex revision or an id"
            )
        return self._info(checkpoint_id, checkpoint_id in set(state.retired))

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint `main` points at, or None before the first publication."""
        try:
            return self.get(MAIN_REF)
        except RevisionNotFound:
            return None

    def manifest(self, info: CheckpointInfo) -> CheckpointManifest:
        """The full manifest of a published checkpoint."""
        return self._load_manifest(info.id)

    def manifest_path(self, info: CheckpointInfo) -> Path:
        """Where the checkpoint's manifest bytes are stored."""
        return self.checkpoints_dir / info.id / MANIFEST_FILE_NAME

    def checkpoint_dir(self, info: CheckpointInfo) -> Path:
        """The folder holding the checkpoint's files (read it; never write into it)."""
        return self.checkpoints_dir / info.id

    def file_path(self, info: CheckpointInfo, relative_path: str) -> Path:
        """Path on disk of a file the manifest lists; anything else raises EntryNotFound.

        Only exact names from the manifest resolve, so "..", absolute paths or other tricks never
        reach outside the checkpoint folder.
        """
        entry = self._load_manifest(info.id).file(relative_path)
        if entry is None:
            raise EntryNotFound(f"{self.repo_id}@{info.revision} has no file {relative_path!r}")
        folder = (self.checkpoints_dir / info.id).resolve()
        path = folder / entry.path
        if path.is_symlink() or not path.is_file() or not path.resolve().is_relative_to(folder):
            raise RegistryCorrupted(
                f"{entry.path} of checkpoint {info.id} is missing or not a regular file on disk"
            )
        return path

    # -- writing ------------------------------------------------------------------------------

    def publish(self, folder: Path, **metadata: Any) -> CheckpointInfo:
        """Copy `folder` into the registry as a new checkpoint and point `main` at it.

        Metadata: round, parent, method, created_at, extra (see CheckpointManifest). Publishing
        the same files with the same metadata again returns the existing checkpoint; when
        `created_at` is not given it does not count towards "the same".
        """
        folder = Path(folder)
        if not (folder / REQUIRED_CHECKPOINT_FILE).is_file():
            raise CheckpointError(
                f"{folder} is not a Hugging Face checkpoint folder: it has no config.json"
            )
        with self._exclusive_lock():
            staging = self.incoming_dir / uuid.uuid4().hex
            staging.mkdir()
            try:
                files = _copy_checkpoint_files(folder, staging)
                try:
                    manifest = CheckpointManifest(files=tuple(files), **metadata)
                except ValidationError as exc:
                    raise CheckpointError(f"bad checkpoint metadata: {exc}") from exc
                state = self._read_refs()
                existing = self._existing_equivalent(
                    manifest, state, created_at_given="created_at" in metadata
                )
                if existing is not None:
                    if existing in state.retired:
                        raise CheckpointRetired(
                            f"checkpoint {existing} was retired; it cannot be published again"
                        )
                    return self._info(existing, retired=False)
                checkpoint_id = manifest.checkpoint_id
                for other in state.published:
                    if other[:40] == checkpoint_id[:40]:
                        raise RevisionCollision(
                            f"checkpoint {checkpoint_id} shares revision {checkpoint_id[:40]} "
                            f"with {other}; publish it with different metadata"
                        )
                write_manifest(staging, manifest)
                fsync_directory(staging)
                target = self.checkpoints_dir / checkpoint_id
                if target.exists():
                    shutil.rmtree(target)
                os.rename(staging, target)
                fsync_directory(self.checkpoints_dir)
                state.published.append(checkpoint_id)
                state.main = state.latest_unretired()
                self._write_refs(state)
                self._manifests[checkpoint_id] = manifest
                return self._info(checkpoint_id, retired=False)
            finally:
                if staging.exists():
                    shutil.rmtree(staging, ignore_errors=True)

    def retire(self, revision: str) -> CheckpointInfo:
        """Take a checkpoint out of service: never `main` again, not served, still on record."""
        with self._exclusive_lock():
            info = self.get(revision)
            state = self._read_refs()
            if info.id not in state.retired:
                state.retired.append(info.id)
                state.main = state.latest_unretired()
                self._write_refs(state)
            return self._info(info.id, retired=True)

    # -- internals ----------------------------------------------------------------------------

    def _existing_equivalent(
        self, manifest: CheckpointManifest, state: _RefsState, *, created_at_given: bool
    ) -> str | None:
        if manifest.checkpoint_id in state.published:
            return manifest.checkpoint_id
        if created_at_given:
            return None
        ignored = {"created_at"}
        wanted = manifest.model_dump(exclude=ignored)
        for checkpoint_id in reversed(state.published):
            if self._load_manifest(checkpoint_id).model_dump(exclude=ignored) == wanted:
                return checkpoint_id
        return None

    def _info(self, checkpoint_id: str, retired: bool) -> CheckpointInfo:
        manifest = self._load_manifest(checkpoint_id)
        return CheckpointInfo(
            id=checkpoint_id,
            revision=checkpoint_id[:40],
            round=manifest.round,
            parent=manifest.parent,
            method=manifest.method,
            created_at=manifest.created_at,
            extra=manifest.extra,
            files=manifest.files,
            total_size=manifest.total_size,
            retired=retired,
        )

    def _load_manifest(self, checkpoint_id: str) -> CheckpointManifest:
        cached = self._manifests.get(checkpoint_id)
        if cached is not None:
            return cached
        try:
            manifest = read_manifest(self.checkpoints_dir / checkpoint_id)
        except CheckpointError as exc:
            raise RegistryCorrupted(f"checkpoint {checkpoint_id} is unreadable: {exc}") from exc
        if manifest.checkpoint_id != checkpoint_id:
            raise RegistryCorrupted(
                f"the manifest stored for checkpoint {checkpoint_id} hashes to "
                f"{manifest.checkpoint_id}: it was modified on disk"
            )
        self._manifests[checkpoint_id] = manifest
        return manifest

    def _read_refs(self) -> _RefsState:
        try:
            raw = self.refs_path.read_bytes()
        except FileNotFoundError:
            return _RefsState()
        try:
            return _RefsState.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as exc:
            raise RegistryCorrupted(f"{self.refs_path} is unreadable: {exc}") from exc

    def _write_refs(self, state: _RefsState) -> None:
        encoded = json.dumps(state.model_dump(), indent=1, sort_keys=True).encode()
        write_bytes_atomically(self.refs_path, encoded)

    @contextmanager
    def _exclusive_lock(self, blocking: bool = True) -> Iterator[bool]:
        """Hold the registry's write lock (across threads and processes); yields whether held."""
        with open(self._lock_path, "a+b") as handle:
            flags = fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB
            try:
                fcntl.flock(handle.fileno(), flags)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _clean_leftovers(self) -> None:
        """Remove what an interrupted publication left behind, unless a writer is active now."""
        with self._exclusive_lock(blocking=False) as held:
            if not held:
                return
            for leftover in self.incoming_dir.iterdir():
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink(missing_ok=True)
            published = set(self._read_refs().published)
            for entry in self.checkpoints_dir.iterdir():
                if entry.name not in published:
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
            for stray in self.root.glob(f".{REFS_FILE_NAME}.*.tmp"):
                stray.unlink(missing_ok=True)


def _copy_checkpoint_files(source: Path, destination: Path) -> list[CheckpointFile]:
    """Copy every checkpoint file of `source` under `destination`, hashing what is written."""
    files: list[CheckpointFile] = []
    for relative, absolute in iter_checkpoint_files(source):
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0
        with open(absolute, "rb") as reader, open(target, "xb") as writer:
            while chunk := reader.read(HASH_CHUNK_BYTES):
                writer.write(chunk)
                digest.update(chunk)
                size += len(chunk)
            writer.flush()
            os.fsync(writer.fileno())
        files.append(CheckpointFile(path=relative, size=size, sha256=digest.hexdigest()))
    if not files:
        raise CheckpointError(f"checkpoint folder {source} holds no files")
    for directory in sorted({destination / Path(f.path).parent for f in files}, reverse=True):
        fsync_directory(directory)
    return files


__all__ = [
    "CheckpointInfo",
    "CheckpointRetired",
    "EntryNotFound",
    "Registry",
    "RegistryCorrupted",
    "RegistryError",
    "RevisionCollision",
    "RevisionNotFound",
]
