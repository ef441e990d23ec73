"""`pull`: resumable, sha256-verified downloads whose manifest must hash to the revision asked."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from skillswarm.coordinator.registry import CheckpointInfo, Registry
from skillswarm.protocol.checkpoint import (
    MANIFEST_FILE_NAME,
    CheckpointManifest,
    read_manifest,
    verify_folder,
)
from skillswarm.protocol.pull import PullError, PullVerificationError, pull
from test_registry_hub import ServedApp, build_tiny_checkpoint, hub_app, serve_app

REPO_ID = "skillswarm/agent"


@pytest.fixture(scope="module")
def registry_pull_sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pull-sources")
    return build_tiny_checkpoint(root / "first", 0), build_tiny_checkpoint(root / "second", 1)


@pytest.fixture
def registry_pull_server(
    tmp_path: Path, registry_pull_sources: tuple[Path, Path]
) -> Iterator[tuple[ServedApp, Registry, list[CheckpointInfo]]]:
    registry = Registry(tmp_path / "registry")
    infos = [
        registry.publish(registry_pull_sources[0], round=0),
        registry.publish(registry_pull_sources[1], round=1, method="linear"),
    ]
    with serve_app(hub_app(registry)) as served:
        yield served, registry, infos


def _largest_file(info: CheckpointInfo) -> str:
    return max(info.files, key=lambda entry: entry.size).path


def _resolve_requests(served: ServedApp) -> list[tuple[str, str | None]]:
    return [
        (path.split("/resolve/", 1)[1].split("/", 1)[1], range_header)
        for method, path, range_header in served.requests
        if method == "GET" and "/resolve/" in path
    ]


def test_pull_latest_brings_every_file_and_the_manifest(
    registry_pull_server: tuple[ServedApp, Registry, list[CheckpointInfo]],
    registry_pull_sources: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    served, _, (_, second) = registry_pull_server

    out = pull(served.url, "latest", tmp_path / "out", progress=True)

    manifest = read_manifest(out)
    assert manifest.checkpoint_id == second.id
    verify_folder(out, manifest)
    for entry in second.files:
        assert (out / entry.path).read_bytes() == (
            registry_pull_sources[1] / entry.path
        ).read_bytes()
    assert not (out / ".partial").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [entry.path for entry in second.files] + [MANIFEST_FILE_NAME]
    )


def test_pull_by_revision_or_id_and_unknown_revisions(
    registry_pull_server: tuple[ServedApp, Registry, list[CheckpointInfo]], tmp_path: Path
) -> None:
    served, _, (first, _) = registry_pull_server

    by_revision = pull(served.url, first.revision, tmp_path / "a", progress=False)
    assert read_manifest(by_revision).checkpoint_id == first.id
    by_id = pull(served.url, first.id, tmp_path / "b", progress=False)
    assert read_manifest(by_id).checkpoint_id == first.id

    with pytest.raises(PullError, match="RevisionNotFound"):
        pull(served.url, "0" * 40, tmp_path / "c", progress=False)
    with pytest.raises(PullError, match="RevisionNotFound"):
        pull(served.url, "v7", tmp_path / "c", progress=False)
    with pytest.raises(PullError, match="RepoNotFound"):
        pull(served.url, "main", tmp_path / "c", repo_id="someone/else", progress=False)
    wrong_id = first.revision + "0" * 24
    with pytest.raises(PullVerificationError, match="hashes to"):
        pull(served.url, wrong_id, tmp_path / "d", progress=False)


def test_a_partial_file_left_by_an_earlier_run_is_resumed_with_range(
    registry_pull_server: tuple[ServedApp, Registry, list[CheckpointInfo]],
    registry_pull_sources: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    served, _, (_, second) = registry_pull_server
    name = _largest_file(second)
    data = (registry_pull_sources[1] / name).read_bytes()
    entry = next(f for f in second.files if f.path == name)
    out = tmp_path / "out"
    (out / ".partial").mkdir(parents=True)
    half = len(data) // 2
    (out / ".partial" / entry.sha256).write_bytes(data[:half])

    pull(served.url, "main", out, progress=False)

    assert (out / name).read_bytes() == data
    requests = dict(_resolve_requests(served))
    assert requests[name] == f"bytes={half}-"
    assert all(header is None for path, header in requests.items() if path != name)
    assert set(requests) == {f.path for f in second.files}


def test_a_second_pull_downloads_nothing(
    registry_pull_server: tuple[ServedApp, Registry, list[CheckpointInfo]], tmp_path: Path
) -> None:
    served, _, _ = registry_pull_server
    pull(served.url, "main", tmp_path / "out", progress=False)
    served.requests.clear()

    pull(served.url, "main", tmp_path / "out", progress=False)

    assert _resolve_requests(served) == []


def test_a_download_cut_midway_resumes_on_the_next_run(
    registry_pull_server: tuple[ServedApp, Registry, list[CheckpointInfo]],
    registry_pull_sources: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    served, registry, (_, second) = registry_pull_server
    name = _largest_file(second)
    data = (registry_pull_sources[1] / name).read_bytes()
    cut_at = 10_000
    inner = hub_app(registry)

    async def cutting_app(scope: dict, receive: object, send: object) -> None:
        """Serves the hub, but drops the connection after `cut_at` body bytes of `name`."""
        if scope["type"] != "http" or not scope["path"].endswith(name):
            await inner(scope, receive, send)  # type: ignore[arg-type]
            return
        sent = 0

        async def cutting_send(message: dict) -> None:
            nonlocal sent
            if message["type"] == "http.response.body" and message.get("body"):
                body = message["body"][: max(0, cut_at - sent)]
                sent += len(body)
                await send({**message, "body": body})  # type: ignore[operator]
                if sent >= cut_at:
                    raise ConnectionAbortedError("connection cut for the test")
                return
            await send(message)  # type: ignore[operator]

        await inner(scope, receive, cutting_send)  # type: ignore[arg-type]

    out = tmp_path / "out"
    with serve_app(cutting_app) as cutting:  # type: ignore[arg-type]
        with pytest.raises(PullError, match="run pull again to resume"):
            pull(cutting.url, "main", out, progress=False)
    entry = next(f for f in second.files if f.path == name)
    assert (out / ".partial" / entry.sha256).read_bytes() == data[:cut_at]
    assert not (out / name).exists()

    pull(served.url, "main", out, progress=False)

    assert (out / name).read_bytes() == data
    assert dict(_resolve_requests(served))[name] == f"bytes={cut_at}-"


def test_tampered_file_content_is_detected_and_not_kept(
    registry_pull_server: tuple[ServedApp, Registry, list[CheckpointInfo]], tmp_path: Path
) -> None:
    served, registry, (_, second) = registry_pull_server
    name = _largest_file(second)
    stored = registry.file_path(second, name)
    tampered = bytearray(stored.read_bytes())
    tampered[len(tampered) // 3] ^= 0xFF
    stored.write_bytes(bytes(tampered))

    out = tmp_path / "out"
    with pytest.raises(PullVerificationError, match=name):
        pull(served.url, "main", out, progress=False)

    assert not (out / name).exists()
    assert list((out / ".partial").iterdir()) == []
    assert not (out / MANIFEST_FILE_NAME).exists()


def test_a_tampered_manifest_does_not_hash_to_the_revision(
    registry_pull_server: tuple[ServedApp, Registry, list[CheckpointInfo]], tmp_path: Path
) -> None:
    """A server that answers a revision with a manifest that is not the one the revision names
    (our registry serves only the manifest it verified, so a hostile server stands in)."""
    _, registry, (_, second) = registry_pull_server
    manifest = CheckpointManifest.decode(registry.manifest_path(second).read_bytes())
    tampered = manifest.model_copy(update={"method": "ties"}).encode()
    tree = [{"type": "file", "path": f.path, "size": f.size, "oid": f.sha256} for f in second.files]
    with serve_app(_hostile_app(tampered, tree, second.revision)) as hostile:
        with pytest.raises(PullVerificationError, match=second.revision):
            pull(hostile.url, second.revision, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def _hostile_app(manifest_bytes: bytes, tree: list[dict], revision: str) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/checkpoints/{rev}/manifest")
    def manifest(rev: str) -> Response:
        return Response(manifest_bytes, media_type="application/msgpack")

    @app.get("/api/models/{ns}/{name}/tree/{rest:path}")
    def listing(ns: str, name: str, rest: str) -> JSONResponse:
        return JSONResponse(tree)

    @app.get("/api/models/{ns}/{name}/revision/{rest:path}")
    def info(ns: str, name: str, rest: str) -> JSONResponse:
        return JSONResponse({"id": f"{ns}/{name}", "sha": revision})

    return app


def test_unsafe_names_from_a_server_never_become_paths(tmp_path: Path) -> None:
    payload = b"escaped"
    digest = hashlib.sha256(payload).hexdigest()
    evil_entry = {"path": "../escaped.txt", "size": len(payload), "sha256": digest}
    evil_manifest = msgpack.packb(
        {"schema": "skillswarm.checkpoint/1", "files": [evil_entry], "created_at": "2025-01-01"}
    )
    evil_revision = hashlib.sha256(evil_manifest).hexdigest()[:40]
    tree = [{"type": "file", "path": "../escaped.txt", "size": len(payload), "oid": digest}]
    out = tmp_path / "deep" / "out"
    with serve_app(_hostile_app(evil_manifest, tree, evil_revision)) as hostile:
        with pytest.raises(PullVerificationError, match="escaped"):
            pull(hostile.url, "main", out, progress=False)

    honest = CheckpointManifest.model_validate(
        {"files": [{"path": "config.json", "size": len(payload), "sha256": digest}]}
    )
    for bad_name in ["/etc/passwd", "a\\..\\b", "../escaped.txt"]:
        tree = [{"type": "file", "path": bad_name, "size": len(payload), "oid": digest}]
        app = _hostile_app(honest.encode(), tree, honest.revision)
        with serve_app(app) as hostile:
            with pytest.raises(PullVerificationError, match="unsafe file name"):
                pull(hostile.url, honest.revision, out, progress=False)
    assert not (tmp_path / "deep" / "escaped.txt").exists()
    assert not out.exists()


def test_a_listing_that_disagrees_with_the_manifest_is_refused(
    registry_pull_server: tuple[ServedApp, Registry, list[CheckpointInfo]], tmp_path: Path
) -> None:
    served, registry, (_, second) = registry_pull_server
    manifest_bytes = registry.manifest_path(second).read_bytes()
    tree = [
        {"type": "file", "path": f.path, "size": f.size, "oid": f.sha256}
        for f in second.files
        if f.path != "config.json"
    ]
    with serve_app(_hostile_app(manifest_bytes, tree, second.revision)) as partial_lister:
        with pytest.raises(PullVerificationError, match="config.json"):
            pull(partial_lister.url, "main", tmp_path / "out", progress=False)
