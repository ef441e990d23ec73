"""Path safety of the Hugging Face routes: traversal in any spelling, absolute paths and symlinks
planted in the registry get 404, and no file outside the registry is ever opened or served."""

from __future__ import annotations

import http.client
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from skillswarm.coordinator.registry import CheckpointInfo, Registry
from skillswarm.protocol.checkpoint import MANIFEST_FILE_NAME
from test_registry_hub import ServedApp, hub_app, serve_app

REPO_ID = "skillswarm/agent"

_recording: list[str] | None = None
_hook_installed = False


def _note_open(event: str, args: tuple) -> None:
    recording = _recording
    if recording is not None and event == "open" and isinstance(args[0], str | bytes):
        recording.append(os.fsdecode(args[0]))


@contextmanager
def files_opened() -> Iterator[list[str]]:
    """Every path this process (any thread) opens inside the block, seen through an audit hook."""
    global _recording, _hook_installed
    if not _hook_installed:
        sys.addaudithook(_note_open)  # stays for the process; it is a no-op when not recording
        _hook_installed = True
    _recording = opened = []
    try:
        yield opened
    finally:
        _recording = None


@dataclass
class Planted:
    """A served registry with one checkpoint, and a folder outside it holding the sentinel."""

    served: ServedApp
    registry: Registry
    info: CheckpointInfo
    outside: Path
    sentinel: bytes

    @property
    def checkpoint_dir(self) -> Path:
        return self.registry.checkpoint_dir(self.info)

    def request(self, method: str, raw_path: str) -> tuple[int, dict[str, str], bytes]:
        """Send `raw_path` exactly as written (no client-side normalisation or encoding)."""
        host, port = self.served.url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            connection.request(method, raw_path)
            response = connection.getresponse()
            headers = {name.lower(): value for name, value in response.getheaders()}
            return response.status, headers, response.read()
        finally:
            connection.close()

    def assert_nothing_outside_was_opened(self, opened: list[str]) -> None:
        outside = self.outside.resolve()
        leaked = [p for p in opened if Path(os.path.realpath(p)).is_relative_to(outside)]
        assert leaked == [], f"files outside the registry were opened: {leaked}"


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[Planted]:
    sentinel = b"sentinel-" + os.urandom(12).hex().encode()
    outside = tmp_path / "outside"
    (outside / "tokenizer").mkdir(parents=True)
    for name in ["secret.txt", "config.json", "tokenizer/vocab.json", MANIFEST_FILE_NAME]:
        (outside / name).write_bytes(sentinel)
    source = tmp_path / "source"
    (source / "tokenizer").mkdir(parents=True)
    (source / "config.json").write_text('{"model_type": "qwen2"}')
    (source / "model.safetensors").write_bytes(os.urandom(4096))
    (source / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    registry = Registry(tmp_path / "registry")
    info = registry.publish(source, round=0)
    with serve_app(hub_app(registry)) as served:
        yield Planted(served, registry, info, outside, sentinel)


def _replace_with_symlink(path: Path, target: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    path.symlink_to(target, target_is_directory=target.is_dir())


def test_traversal_and_absolute_paths_in_every_spelling_get_404(planted: Planted) -> None:
    secret = planted.outside / "secret.txt"
    up = os.path.relpath(secret, planted.checkpoint_dir)  # ../../outside/secret.txt
    assert up.startswith("..")
    encoded_up = up.replace(".", "%2e").replace("/", "%2F")
    resolve = f"/{REPO_ID}/resolve"
    tree = f"/api/models/{REPO_ID}/tree"
    raw_paths = [
        f"{resolve}/main/{up}",
        f"{resolve}/main/{up.replace('..', '%2e%2e')}",
        f"{resolve}/main/{encoded_up}",
        f"{resolve}/main/{up.replace('..', '%252e%252e')}",
        f"{resolve}/main/{up.replace('/', '%5C')}",
        f"{resolve}/main/tokenizer/../../{up}",
        f"{resolve}/main/tokenizer/%2e%2e/%2e%2e/{up}",
        f"{resolve}/main/{secret}",
        f"{resolve}/main/{str(secret).replace('/', '%2F')}",
        f"{resolve}/main/config.json%00/../../{up}",
        f"{resolve}/{planted.info.revision}/{up}",
        f"{resolve}/{up.replace('/', '%2F')}/config.json",
        f"{resolve}/..%2F..%2F..%2Foutside/secret.txt",
        "/..%2F..%2Foutside/secret.txt/resolve/main/config.json",
        f"{tree}/main/{encoded_up}",
        f"{tree}/main/..%2F..%2F..",
        f"{tree}/{up.replace('/', '%2F')}",
        f"/api/models/{REPO_ID}/revision/..%2F..%2Frefs.json",
        f"/api/models/{REPO_ID}/revision/{encoded_up}",
        "/v1/checkpoints/..%2F..%2Frefs.json/manifest",
        f"/v1/checkpoints/{encoded_up}/manifest",
    ]
    with files_opened() as opened:
        for raw_path in raw_paths:
            methods = ["GET", "HEAD"] if raw_path.startswith(resolve) else ["GET"]
            for method in methods:
                status, _, body = planted.request(method, raw_path)
                assert status == 404, (method, raw_path, status)
                assert planted.sentinel not in body, raw_path
        status, headers, body = planted.request("GET", f"{resolve}/main/model.safetensors")
    assert status == 200
    assert body == (planted.checkpoint_dir / "model.safetensors").read_bytes()
    assert str(planted.checkpoint_dir / "model.safetensors") in opened  # the hook sees the server
    planted.assert_nothing_outside_was_opened(opened)
    assert any("%2e%2e" in path or "/../" in path for _, path, _ in planted.served.requests)


def test_a_symlinked_file_inside_a_checkpoint_is_not_followed(planted: Planted) -> None:
    _replace_with_symlink(planted.checkpoint_dir / "config.json", planted.outside / "secret.txt")
    with files_opened() as opened:
        for method in ["GET", "HEAD"]:
            status, _, body = planted.request(method, f"/{REPO_ID}/resolve/main/config.json")
            assert planted.sentinel not in body
            assert status == 404, (method, status, body[:200])
    planted.assert_nothing_outside_was_opened(opened)


def test_a_symlinked_folder_inside_a_checkpoint_is_not_followed(planted: Planted) -> None:
    _replace_with_symlink(planted.checkpoint_dir / "tokenizer", planted.outside / "tokenizer")
    with files_opened() as opened:
        for method in ["GET", "HEAD"]:
            status, _, body = planted.request(
                method, f"/{REPO_ID}/resolve/main/tokenizer/vocab.json"
            )
            assert planted.sentinel not in body
            assert status == 404, (method, status, body[:200])
        ok_status, _, ok_body = planted.request("GET", f"/{REPO_ID}/resolve/main/config.json")
    assert (ok_status, ok_body) == (200, b'{"model_type": "qwen2"}')
    planted.assert_nothing_outside_was_opened(opened)


def test_a_symlinked_manifest_is_not_served(planted: Planted) -> None:
    """A manifest swapped on disk for a symlink is never read: the route serves the manifest the
    registry verified against the checkpoint id when it first loaded it."""
    verified = planted.registry.manifest(planted.info).encode()
    _replace_with_symlink(
        planted.registry.manifest_path(planted.info), planted.outside / MANIFEST_FILE_NAME
    )
    with files_opened() as opened:
        for revision in ["main", planted.info.revision]:
            status, _, body = planted.request("GET", f"/v1/checkpoints/{revision}/manifest")
            assert planted.sentinel not in body, revision
            assert (status, body) == (200, verified), (revision, status)
    planted.assert_nothing_outside_was_opened(opened)


def test_a_symlinked_manifest_is_not_read_when_the_registry_reopens(planted: Planted) -> None:
    _replace_with_symlink(
        planted.registry.manifest_path(planted.info), planted.outside / MANIFEST_FILE_NAME
    )
    reopened = Registry(planted.registry.root)
    raw_paths = [
        f"/{REPO_ID}/resolve/main/config.json",
        f"/api/models/{REPO_ID}/revision/main",
        f"/v1/checkpoints/{planted.info.revision}/manifest",
    ]
    with files_opened() as opened, serve_app(hub_app(reopened)) as served:
        fresh = Planted(served, reopened, planted.info, planted.outside, planted.sentinel)
        answers = {raw_path: fresh.request("GET", raw_path) for raw_path in raw_paths}
    fresh.assert_nothing_outside_was_opened(opened)
    for raw_path, (status, _, body) in answers.items():
        assert fresh.sentinel not in body, raw_path
        assert status == 404, (raw_path, status)


def test_symlinks_planted_beside_the_manifest_files_are_unreachable(planted: Planted) -> None:
    """Names the manifest does not list never resolve, whatever they point at."""
    (planted.checkpoint_dir / "leak.txt").symlink_to(planted.outside / "secret.txt")
    (planted.checkpoint_dir / "outside").symlink_to(planted.outside, target_is_directory=True)
    (planted.registry.root / "leak.txt").symlink_to(planted.outside / "secret.txt")
    with files_opened() as opened:
        for raw_path in [
            f"/{REPO_ID}/resolve/main/leak.txt",
            f"/{REPO_ID}/resolve/main/outside/secret.txt",
            f"/{REPO_ID}/resolve/main/../../leak.txt",
            f"/api/models/{REPO_ID}/tree/main/outside",
        ]:
            status, headers, body = planted.request("GET", raw_path)
            assert (status, headers.get("x-error-code")) == (404, "EntryNotFound"), raw_path
            assert planted.sentinel not in body
    planted.assert_nothing_outside_was_opened(opened)
