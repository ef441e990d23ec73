"""`skillswarm pull`: download a checkpoint from a registry over its Hub-compatible HTTP API.

Unlike stock Hub clients it resumes across runs (partial files keyed by sha256), checks every
file's sha256, and recomputes the checkpoint id from the manifest to match the revision asked for.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import httpx
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from skillswarm.protocol.checkpoint import (
    CHECKPOINT_ID_PATTERN,
    HASH_CHUNK_BYTES,
    MANIFEST_FILE_NAME,
    MAX_MANIFEST_BYTES,
    REVISION_PATTERN,
    CheckpointError,
    CheckpointFile,
    CheckpointManifest,
    sha256_of_file,
    validate_relative_path,
    write_manifest,
)
from skillswarm.protocol.durable import fsync_directory

DEFAULT_REPO_ID = "skillswarm/agent"
PARTIAL_DIR_NAME = ".partial"
MAX_LISTING_BYTES = 64 * 1024 * 1024
LATEST_ALIASES = {"latest": "main"}


class PullError(RuntimeError):
    """The checkpoint could not be pulled (network, server answer, or local files)."""


class PullVerificationError(PullError):
    """Downloaded bytes or listings do not match what the revision's content address promises."""


class _Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


class _ByteCounter(Protocol):
    def describe(self, text: str) -> None: ...

    def advance(self, count: int) -> None: ...


class _SilentCounter:
    def describe(self, text: str) -> None:
        pass

    def advance(self, count: int) -> None:
        pass


class _RichCounter:
    def __init__(self, progress: Progress, total: int) -> None:
        self._progress = progress
        self._task = progress.add_task("pull", total=total)

    def describe(self, text: str) -> None:
        self._progress.update(self._task, description=text)

    def advance(self, count: int) -> None:
        self._progress.advance(self._task, count)


@contextlib.contextmanager
def _byte_counter(enabled: bool, total: int) -> Iterator[_ByteCounter]:
    if not enabled:
        yield _SilentCounter()
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns) as progress:
        yield _RichCounter(progress, total)


def pull(
    url: str,
    revision: str,
    out_dir: Path,
    repo_id: str = DEFAULT_REPO_ID,
    progress: bool = True,
    *,
    timeout_s: float = 60.0,
) -> Path:
    """Download `repo_id` at `revision` ("latest"/"main", a 40-hex revision or a 64-hex id).

    Files land in `out_dir` with the checkpoint manifest beside them; partial downloads wait in
    `out_dir/.partial/` and resume on the next run. Raises PullVerificationError when any byte or
    listing disagrees with the content address, PullError for everything else.
    """
    out_dir = Path(out_dir)
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise PullError(f"repo id {repo_id!r} must look like 'namespace/name'")
    wanted = LATEST_ALIASES.get(revision, revision)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
    headers = {"Accept-Encoding": "identity", "User-Agent": "skillswarm-pull/1"}
    with httpx.Client(
        base_url=url.rstrip("/"), timeout=timeout, headers=headers, follow_redirects=True
    ) as client:
        commit, expected_id = _resolve_commit(client, repo_id, wanted)
        manifest = _fetch_manifest(client, commit)
        if manifest.revision != commit or (expected_id and manifest.checkpoint_id != expected_id):
            raise PullVerificationError(
                f"the manifest served for revision {expected_id or commit} hashes to "
                f"{manifest.checkpoint_id}: the server's checkpoint is not the one asked for"
            )
        listed = _list_files(client, repo_id, commit)
        _check_listing_matches(listed, manifest)
        out_dir.mkdir(parents=True, exist_ok=True)
        # The manifest is written last: while files change, the folder claims no checkpoint.
        (out_dir / MANIFEST_FILE_NAME).unlink(missing_ok=True)
        with _byte_counter(progress, manifest.total_size) as counter:
            for entry in manifest.files:
                counter.describe(entry.path)
                _download_file(client, repo_id, commit, entry, out_dir, counter)
        write_manifest(out_dir, manifest)
    with contextlib.suppress(OSError):
        (out_dir / PARTIAL_DIR_NAME).rmdir()
    return out_dir


def _resolve_commit(client: httpx.Client, repo_id: str, wanted: str) -> tuple[str, str | None]:
    """(40-hex commit, full id if given); refs such as main are resolved by the server."""
    if CHECKPOINT_ID_PATTERN.fullmatch(wanted):
        return wanted[:40], wanted
    if REVISION_PATTERN.fullmatch(wanted):
        return wanted, None
    body = _get_small(client, f"/api/models/{repo_id}/revision/{quote(wanted, safe='')}")
    try:
        sha = body.json()["sha"]
    except (ValueError, KeyError, TypeError) as exc:
        raise PullError(f"{client.base_url} answered model info without a commit sha") from exc
    if not isinstance(sha, str) or not REVISION_PATTERN.fullmatch(sha):
        raise PullError(f"{client.base_url} resolved {wanted!r} to {sha!r}, not a 40-hex commit")
    return sha, None


def _fetch_manifest(client: httpx.Client, commit: str) -> CheckpointManifest:
    response = _get_small(client, f"/v1/checkpoints/{commit}/manifest", MAX_MANIFEST_BYTES)
    try:
        return CheckpointManifest.decode(response.content)
    except CheckpointError as exc:
        raise PullVerificationError(f"manifest of revision {commit} is unusable: {exc}") from exc


def _list_files(client: httpx.Client, repo_id: str, commit: str) -> dict[str, tuple[int, str]]:
    """{path: (size, oid)} of every file in the tree at `commit`, names checked for safety."""
    response = _get_small(
        client, f"/api/models/{repo_id}/tree/{commit}", params={"recursive": "true"}
    )
    try:
        entries: Any = response.json()
    except ValueError as exc:
        raise PullError(f"tree listing of {commit} is not JSON") from exc
    if not isinstance(entries, list):
        raise PullError(f"tree listing of {commit} is not a list")
    files: dict[str, tuple[int, str]] = {}
    for item in entries:
        if not isinstance(item, dict) or item.get("type") != "file":
            continue
        path, size, oid = item.get("path"), item.get("size"), item.get("oid")
        if not isinstance(path, str) or not isinstance(size, int) or not isinstance(oid, str):
            raise PullError(f"tree listing of {commit} has a malformed entry: {item!r:.200}")
        try:
            validate_relative_path(path)
        except CheckpointError as exc:
            raise PullVerificationError(f"server listed an unsafe file name: {exc}") from exc
        files[path] = (size, oid)
    return files


def _check_listing_matches(
    listed: dict[str, tuple[int, str]], manifest: CheckpointManifest
) -> None:
    expected = {entry.path: (entry.size, entry.sha256) for entry in manifest.files}
    for path in sorted(set(listed) | set(expected)):
        if listed.get(path) != expected.get(path):
            raise PullVerificationError(
                f"the server's file list disagrees with the manifest of {manifest.revision} "
                f"about {path!r}: listed {listed.get(path)}, manifest {expected.get(path)}"
            )


def _get_small(
    client: httpx.Client, path: str, limit: int = MAX_LISTING_BYTES, params: dict | None = None
) -> httpx.Response:
    """GET a bounded-size answer; 404s become PullError naming the Hub error code."""
    try:
        with client.stream("GET", path, params=params) as response:
            body = bytearray()
            for chunk in response.iter_bytes():
                body.extend(chunk)
                if len(body) > limit:
                    raise PullError(f"{path} answered more than {limit} bytes")
            content = bytes(body)
    except httpx.HTTPError as exc:
        raise PullError(f"request to {client.base_url}{path} failed: {exc}") from exc
    if response.status_code == 404:
        code = response.headers.get("X-Error-Code", "NotFound")
        message = response.headers.get("X-Error-Message", "")
        raise PullError(f"{client.base_url}{path}: {code} {message}".rstrip())
    if response.status_code != 200:
        raise PullError(f"{client.base_url}{path} answered HTTP {response.status_code}")
    return httpx.Response(200, headers=response.headers, content=content)


def _target_inside(out_dir: Path, relative_path: str) -> Path:
    """`out_dir`/`relative_path`, refusing anything that would resolve outside `out_dir`."""
    validate_relative_path(relative_path)
    target = out_dir.joinpath(*relative_path.split("/"))
    if not target.resolve().is_relative_to(out_dir.resolve()):
        raise PullError(f"{target} resolves outside {out_dir} (a symlinked folder?)")
    return target


def _download_file(
    client: httpx.Client,
    repo_id: str,
    commit: str,
    entry: CheckpointFile,
    out_dir: Path,
    counter: _ByteCounter,
) -> None:
    """Bring one file into place: skip it if right, else resume its partial, verify, move."""
    target = _target_inside(out_dir, entry.path)
    if target.is_file() and target.stat().st_size == entry.size:
        if sha256_of_file(target) == entry.sha256:
            counter.advance(entry.size)
            return
    partial_dir = out_dir / PARTIAL_DIR_NAME
    partial_dir.mkdir(exist_ok=True)
    partial = partial_dir / entry.sha256
    digest: _Hasher = hashlib.sha256()
    have = partial.stat().st_size if partial.is_file() else 0
    if have > entry.size:
        partial.unlink()
        have = 0
    if have:
        digest = _sha256_state_of(partial)
        counter.advance(have)
    if have < entry.size or not partial.exists():
        have, digest = _fetch_rest(client, repo_id, commit, entry, partial, have, digest, counter)
    if have != entry.size:
        raise PullError(
            f"download of {entry.path} stopped at {have} of {entry.size} bytes; "
            "run pull again to resume"
        )
    if digest.hexdigest() != entry.sha256:
        partial.unlink(missing_ok=True)
        raise PullVerificationError(
            f"{entry.path} downloaded with sha256 {digest.hexdigest()}, expected {entry.sha256}; "
            "the server's copy is corrupted or was tampered with"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, target)
    fsync_directory(target.parent)


def _fetch_rest(
    client: httpx.Client,
    repo_id: str,
    commit: str,
    entry: CheckpointFile,
    partial: Path,
    have: int,
    digest: _Hasher,
    counter: _ByteCounter,
) -> tuple[int, _Hasher]:
    """Append the missing bytes of `entry` to `partial` (Range from `have`); return new state."""
    url = f"/{repo_id}/resolve/{commit}/{quote(entry.path)}"
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        with client.stream("GET", url, headers=headers) as response:
            if response.status_code == 416 and have:
                partial.unlink()
                counter.advance(-have)
                return _fetch_rest(
                    client, repo_id, commit, entry, partial, 0, hashlib.sha256(), counter
                )
            if response.status_code == 404:
                raise PullError(f"{entry.path} is missing on the server at {commit}")
            if response.status_code == 200:
                if have:
                    counter.advance(-have)
                have, digest, mode = 0, hashlib.sha256(), "wb"
            elif response.status_code == 206 and have:
                content_range = response.headers.get("Content-Range", "")
                if not content_range.startswith(f"bytes {have}-"):
                    raise PullError(f"server answered Range {have}- with {content_range!r}")
                mode = "ab"
            else:
                raise PullError(f"{entry.path}: server answered HTTP {response.status_code}")
            etag = response.headers.get("ETag", "").removeprefix("W/").strip('"')
            if etag and etag != entry.sha256:
                raise PullVerificationError(
                    f"{entry.path}: server's ETag {etag} is not the manifest's sha256 "
                    f"{entry.sha256}"
                )
            with open(partial, mode) as handle:
                try:
                    for chunk in response.iter_bytes():
                        if have + len(chunk) > entry.size:
                            raise PullVerificationError(
                                f"{entry.path}: server sent more than its {entry.size} bytes"
                            )
                        handle.write(chunk)
                        digest.update(chunk)
                        have += len(chunk)
                        counter.advance(len(chunk))
                finally:
                    handle.flush()
                    os.fsync(handle.fileno())
    except PullVerificationError:
        partial.unlink(missing_ok=True)
        raise
    except httpx.HTTPError as exc:
        raise PullError(
            f"download of {entry.path} interrupted at {have} bytes ({exc}); "
            "run pull again to resume"
        ) from exc
    return have, digest


def _sha256_state_of(path: Path) -> _Hasher:
    """A sha256 hasher fed with the bytes already in `path`, ready to continue."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest
