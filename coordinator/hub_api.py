"""The download half of the Hugging Face Hub API, served from the checkpoint registry.

With `HF_ENDPOINT` pointing here, `huggingface_hub`, `transformers` and vLLM download published
checkpoints: model info, file trees, and files by revision with ETag and Range. No auth: public.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal
from urllib.parse import unquote

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from skillswarm.coordinator.registry import (
    CheckpointInfo,
    EntryNotFound,
    Registry,
    RegistryError,
    RevisionNotFound,
)

log = logging.getLogger(__name__)

STREAM_CHUNK_BYTES = 1024 * 1024
MANIFEST_MEDIA_TYPE = "application/msgpack"


class HubError(BaseModel):
    """Body of an error response; the `X-Error-Code` header carries the machine-readable kind."""

    error: str


class RepoSibling(BaseModel):
    """One file of a model repo, as listed in model info."""

    rfilename: str
    size: int


class CheckpointLineage(BaseModel):
    """Registry facts about the revision that stock clients ignore and people may want."""

    checkpoint_id: str
    round: int
    parent: str | None
    method: str | None


class ModelInfoResponse(BaseModel):
    """What `HfApi.model_info` / `repo_info` reads: at least `id` and the commit `sha`."""

    id: str
    modelId: str
    author: str
    sha: str = Field(description="40-hex revision of the checkpoint")
    lastModified: str
    createdAt: str
    private: bool = False
    disabled: bool = False
    gated: bool = False
    downloads: int = 0
    likes: int = 0
    tags: list[str] = Field(default_factory=lambda: ["transformers", "skillswarm"])
    library_name: str = "transformers"
    siblings: list[RepoSibling]
    skillswarm: CheckpointLineage


class TreeEntry(BaseModel):
    """One file or folder in a tree listing; a file's `oid` is its sha256."""

    type: Literal["file", "directory"]
    path: str
    size: int
    oid: str


class HubHTTPError(Exception):
    """An error answered as a Hub-style 404 with an `X-Error-Code` header."""

    def __init__(self, code: str, message: str, repo_commit: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.repo_commit = repo_commit

    def response(self) -> JSONResponse:
        headers = {
            "X-Error-Code": self.code,
            "X-Error-Message": header_safe(self.message),
        }
        if self.repo_commit is not None:
            headers["X-Repo-Commit"] = self.repo_commit
        return JSONResponse({"error": self.message}, status_code=404, headers=headers)


class _UnsatisfiableRange(Exception):
    """A Range header this server cannot honour (malformed, multi-range or past the end)."""


_NOT_FOUND = {404: {"model": HubError, "description": "repo, revision or file not found"}}
# At most 20 digits a bound (a 64-bit size has 20): a longer number is refused before int() reads
# it, whatever its length.
_BYTE_RANGE = re.compile(r"\s*bytes\s*=\s*(\d{0,20})\s*-\s*(\d{0,20})\s*")
_HEADER_UNSAFE = re.compile(r"[^\x21-\x7e]+")


def header_safe(text: str, limit: int = 256) -> str:
    """`text` as a valid HTTP header value: printable ASCII only (each run of anything else, the
    request's own whitespace and control characters included, becomes one space), trimmed."""
    return _HEADER_UNSAFE.sub(" ", text).strip()[:limit]


def hub_router(registry: Registry) -> APIRouter:
    """Routes of the Hub download API for `registry.repo_id` (the only repo that exists here)."""
    router = APIRouter(tags=["hub"])

    def checkpoint_at(namespace: str, name: str, revision: str) -> CheckpointInfo:
        if f"{namespace}/{name}" != registry.repo_id:
            raise HubHTTPError("RepoNotFound", f"Repository {namespace}/{name} not found")
        try:
            info = registry.get(revision)
        except RevisionNotFound as exc:
            raise HubHTTPError("RevisionNotFound", f"Invalid rev id: {revision}") from exc
        except RegistryError as exc:  # damaged on disk: logged, never served
            log.error("revision %s of %s is unreadable: %s", revision, registry.repo_id, exc)
            raise HubHTTPError("RevisionNotFound", f"Revision {revision} is unreadable") from exc
        if info.retired:
            raise HubHTTPError("RevisionNotFound", f"Revision {revision} was retired")
        return info

    def model_info(namespace: str, name: str, revision: str) -> ModelInfoResponse | JSONResponse:
        try:
            info = checkpoint_at(namespace, name, revision)
        except HubHTTPError as error:
            return error.response()
        timestamp = _hub_timestamp(info.created_at)
        return ModelInfoResponse(
            id=registry.repo_id,
            modelId=registry.repo_id,
            author=namespace,
            sha=info.revision,
            lastModified=timestamp,
            createdAt=timestamp,
            siblings=[RepoSibling(rfilename=f.path, size=f.size) for f in info.files],
            skillswarm=CheckpointLineage(
                checkpoint_id=info.id, round=info.round, parent=info.parent, method=info.method
            ),
        )

    @router.get(
        "/api/models/{namespace}/{name}",
        response_model=ModelInfoResponse,
        responses=_NOT_FOUND,
        summary="Model info at main",
    )
    def get_model_info(namespace: str, name: str) -> ModelInfoResponse | JSONResponse:
        return model_info(namespace, name, "main")

    @router.get(
        "/api/models/{namespace}/{name}/revision/{revision:path}",
        response_model=ModelInfoResponse,
        responses=_NOT_FOUND,
        summary="Model info at a revision (main, a 40-hex revision or a checkpoint id)",
    )
    def get_model_info_at_revision(
        namespace: str, name: str, revision: str
    ) -> ModelInfoResponse | JSONResponse:
        return model_info(namespace, name, revision)

    @router.get(
        "/api/models/{namespace}/{name}/tree/{revision_and_path:path}",
        response_model=list[TreeEntry],
        responses=_NOT_FOUND,
        summary="List files and folders at a revision, under an optional folder",
    )
    def list_tree(
        request: Request,
        namespace: str,
        name: str,
        revision_and_path: str,
        recursive: bool = False,
    ) -> list[TreeEntry] | JSONResponse:
        try:
            revision, folder = _revision_and_path(
                request, ["api", "models", namespace, name, "tree"]
            )
            info = checkpoint_at(namespace, name, revision)
            return _tree_entries(info, folder.strip("/"), recursive)
        except HubHTTPError as error:
            return error.response()

    def resolve_file(
        request: Request, namespace: str, name: str, revision_and_path: str
    ) -> Response:
        try:
            revision, relative_path = _revision_and_path(request, [namespace, name, "resolve"])
            info = checkpoint_at(namespace, name, revision)
            try:
                path = registry.file_path(info, relative_path)
            except EntryNotFound as exc:
                raise HubHTTPError("EntryNotFound", str(exc), repo_commit=info.revision) from exc
            except RegistryError as exc:  # damaged on disk (e.g. a symlink): never followed
                log.error("refusing to serve %s at %s: %s", relative_path, info.revision, exc)
                raise HubHTTPError(
                    "EntryNotFound",
                    f"{registry.repo_id}@{info.revision} cannot serve {relative_path!r}",
                    repo_commit=info.revision,
                ) from exc
        except HubHTTPError as error:
            return error.response()
        entry = registry.manifest(info).file(relative_path)
        assert entry is not None  # file_path found it in the same immutable manifest
        headers = {
            "ETag": f'"{entry.sha256}"',
            "X-Repo-Commit": info.revision,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        start, length, status = 0, entry.size, 200
        range_header = request.headers.get("range")
        if range_header is not None:
            try:
                start, end = _parse_byte_range(range_header, entry.size)
            except _UnsatisfiableRange:
                headers["Content-Range"] = f"bytes */{entry.size}"
                headers["Content-Length"] = "0"
                return Response(status_code=416, headers=headers)
            length, status = end - start + 1, 206
            headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
        headers["Content-Length"] = str(length)
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers)
        return StreamingResponse(_read_chunks(path, start, length), status, headers=headers)

    resolve_path = "/{namespace}/{name}/resolve/{revision_and_path:path}"
    resolve_responses: dict[int | str, dict[str, object]] = {
        200: {"content": {"application/octet-stream": {}}, "description": "the file"},
        206: {"content": {"application/octet-stream": {}}, "description": "a byte range"},
        416: {"description": "the Range cannot be satisfied"},
        **_NOT_FOUND,
    }
    for method in ("GET", "HEAD"):
        router.add_api_route(
            resolve_path,
            resolve_file,
            methods=[method],
            response_class=StreamingResponse,
            responses=resolve_responses,
            operation_id=f"resolve_file_{method.lower()}",
            summary="Download a file at a revision (supports Range)"
            if method == "GET"
            else "Size, ETag and commit of a file at a revision",
        )

    @router.get(
        "/v1/checkpoints/{revision}/manifest",
        response_class=Response,
        responses={
            200: {"content": {MANIFEST_MEDIA_TYPE: {}}, "description": "the manifest bytes"},
            **_NOT_FOUND,
        },
        summary="The checkpoint manifest (canonical msgpack) whose sha256 is the checkpoint id",
    )
    def get_manifest(revision: str) -> Response:
        namespace, name = registry.repo_id.split("/")
        try:
            info = checkpoint_at(namespace, name, revision)
        except HubHTTPError as error:
            return error.response()
        try:
            # The manifest as verified in memory (its sha256 is the id), never re-read from disk.
            raw = registry.manifest(info).encode()
        except RegistryError as exc:
            log.error("refusing to serve the manifest of %s: %s", info.revision, exc)
            return HubHTTPError(
                "RevisionNotFound", f"checkpoint {info.revision} is unreadable"
            ).response()
        headers = {"X-Repo-Commit": info.revision, "X-Checkpoint-Id": info.id}
        return Response(content=raw, media_type=MANIFEST_MEDIA_TYPE, headers=headers)

    return router


def _revision_and_path(request: Request, prefix: list[str]) -> tuple[str, str]:
    """Split the raw URL path after `prefix` into (revision, file path), decoding each part.

    The raw path keeps an encoded "/" inside a revision (refs%2Fpr%2F1) in one segment, which the
    decoded path would split.
    """
    raw_path = request.scope.get("raw_path")
    path = raw_path.decode("latin-1") if raw_path else request.url.path
    segments = path.split("?", 1)[0].split("/")
    for index in range(len(segments) - len(prefix)):
        window = segments[index : index + len(prefix)]
        if [unquote(part) for part in window] == prefix:
            rest = segments[index + len(prefix) :]
            if not rest or not rest[0]:
                break
            return unquote(rest[0]), "/".join(unquote(part) for part in rest[1:])
    raise HubHTTPError("RevisionNotFound", f"no revision in {path!r}")


def _tree_entries(info: CheckpointInfo, folder: str, recursive: bool) -> list[TreeEntry]:
    base = f"{folder}/" if folder else ""
    if folder and not any(f.path.startswith(base) for f in info.files):
        raise HubHTTPError(
            "EntryNotFound", f"no folder {folder!r} at {info.revision}", repo_commit=info.revision
        )
    files: dict[str, TreeEntry] = {}
    folders: dict[str, TreeEntry] = {}
    for entry in info.files:
        if not entry.path.startswith(base):
            continue
        parts = entry.path[len(base) :].split("/")
        for depth in range(1, len(parts)):
            if not recursive and depth > 1:
                break
            folder_path = base + "/".join(parts[:depth])
            folders[folder_path] = TreeEntry(
                type="directory", path=folder_path, size=0, oid=_folder_oid(info.id, folder_path)
            )
        if recursive or len(parts) == 1:
            files[entry.path] = TreeEntry(
                type="file", path=entry.path, size=entry.size, oid=entry.sha256
            )
    return sorted([*folders.values(), *files.values()], key=lambda item: item.path)


def _folder_oid(checkpoint_id: str, folder_path: str) -> str:
    return hashlib.sha1(f"{checkpoint_id}:{folder_path}".encode()).hexdigest()


def _parse_byte_range(header: str, size: int) -> tuple[int, int]:
    """Parse a single `bytes=` range into inclusive (start, end), clamped to the file's size."""
    match = _BYTE_RANGE.fullmatch(header)
    if match is None or (not match[1] and not match[2]):
        raise _UnsatisfiableRange(header)
    if not match[1]:
        suffix = int(match[2])
        if suffix == 0 or size == 0:
            raise _UnsatisfiableRange(header)
        return max(0, size - suffix), size - 1
    start = int(match[1])
    end = int(match[2]) if match[2] else size - 1
    if start >= size or end < start:
        raise _UnsatisfiableRange(header)
    return start, min(end, size - 1)


def _read_chunks(path: Path, start: int, length: int) -> Iterator[bytes]:
    # O_NOFOLLOW: a file swapped for a symlink after file_path checked it is still refused.
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "rb") as handle:
        handle.seek(start)
        remaining = length
        while remaining > 0:
            chunk = handle.read(min(STREAM_CHUNK_BYTES, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
            yield chunk


def _hub_timestamp(iso_timestamp: str) -> str:
    """The Hub's timestamp format, e.g. 2024-05-01T12:00:00.000Z (what clients parse)."""
    moment = datetime.fromisoformat(iso_timestamp)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
