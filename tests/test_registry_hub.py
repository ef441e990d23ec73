"""The registry on disk and its Hub-compatible HTTP API, exercised by stock Hugging Face clients."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from serving import serve
from skillswarm.coordinator.hub_api import hub_router
from skillswarm.coordinator.registry import (
    CheckpointRetired,
    EntryNotFound,
    Registry,
    RegistryCorrupted,
    RevisionCollision,
    RevisionNotFound,
)
from skillswarm.protocol.checkpoint import MANIFEST_FILE_NAME, CheckpointError, CheckpointManifest

REPO_ID = "skillswarm/agent"


# -- shared helpers (also used by test_pull.py) ----------------------------------------------------


def build_tiny_checkpoint(folder: Path, seed: int) -> Path:
    """A loadable Qwen2 (hidden 32, 2 layers) saved in three shards, with a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    words = ["<pad>", "<unk>", "<eos>", *[str(d) for d in range(10)], "+", "-", "=", "calc", "x"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    config = Qwen2Config(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=0)
    model.save_pretrained(folder, max_shard_size="40KB")
    tokenizer.save_pretrained(folder)
    return folder


@dataclass
class ServedApp:
    """A running uvicorn server: base URL and every request seen as (method, raw path, Range)."""

    url: str = ""
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)


@contextmanager
def serve_app(app: FastAPI) -> Iterator[ServedApp]:
    """Run `app` under a real uvicorn on a free 127.0.0.1 port for the duration of the block."""
    served = ServedApp()

    async def recording_app(scope: dict, receive: object, send: object) -> None:
        if scope["type"] == "http":
            range_header = dict(scope["headers"]).get(b"range")
            raw_path = scope.get("raw_path") or scope["path"].encode()
            served.requests.append(
                (
                    scope["method"],
                    raw_path.decode("latin-1"),
                    range_header.decode("latin-1") if range_header else None,
                )
            )
        await app(scope, receive, send)  # type: ignore[arg-type]

    with serve(recording_app, lifespan="off", timeout=10) as url:
        served.url = url
        yield served


def hub_app(registry: Registry) -> FastAPI:
    app = FastAPI()
    app.include_router(hub_router(registry))
    return app


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry_tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny checkpoint folders with different weights; treat them as read-only."""
    root = tmp_path_factory.mktemp("tiny")
    return build_tiny_checkpoint(root / "first", 0), build_tiny_checkpoint(root / "second", 1)


@pytest.fixture
def registry_two_published(
    tmp_path: Path, registry_tiny_checkpoints: tuple[Path, Path]
) -> tuple[Registry, list]:
    registry = Registry(tmp_path / "registry")
    first, second = registry_tiny_checkpoints
    infos = [
        registry.publish(first, round=0),
        registry.publish(second, round=1, method="ties", extra={"note": "merged"}),
    ]
    infos[1] = registry.get(infos[1].id)
    return registry, infos


@pytest.fixture
def registry_served(
    registry_two_published: tuple[Registry, list],
) -> Iterator[tuple[ServedApp, Registry, list]]:
    registry, infos = registry_two_published
    with serve_app(hub_app(registry)) as served:
        yield served, registry, infos


# -- the registry on disk ----------------------------------------------------------------------


def test_publish_copies_files_and_main_points_at_latest(
    registry_two_published: tuple[Registry, list], registry_tiny_checkpoints: tuple[Path, Path]
) -> None:
    registry, (first, second) = registry_two_published
    source = registry_tiny_checkpoints[1]

    assert [i.id for i in registry.list()] == [first.id, second.id]
    assert registry.get("main").id == second.id == registry.latest().id
    assert registry.get(second.revision) == registry.get(second.id) == second
    assert (second.round, second.method, second.parent, second.retired) == (1, "ties", None, False)
    for entry in second.files:
        copied = registry.file_path(second, entry.path)
        assert copied.read_bytes() == (source / entry.path).read_bytes()
        assert copied.is_relative_to(registry.root)
    manifest = CheckpointManifest.decode(registry.manifest_path(second).read_bytes())
    assert hashlib.sha256(registry.manifest_path(second).read_bytes()).hexdigest() == second.id
    assert manifest.checkpoint_id == second.id
    assert second.total_size == sum(f.size for f in second.files)


def test_publishing_the_same_content_again_is_idempotent(
    registry_two_published: tuple[Registry, list], registry_tiny_checkpoints: tuple[Path, Path]
) -> None:
    registry, (first, second) = registry_two_published

    again = registry.publish(registry_tiny_checkpoints[0], round=0)
    assert again.id == first.id
    assert [i.id for i in registry.list()] == [first.id, second.id]
    assert registry.get("main").id == second.id
    assert sorted(p.name for p in registry.checkpoints_dir.iterdir()) == sorted(
        [first.id, second.id]
    )
    different_metadata = registry.publish(registry_tiny_checkpoints[0], round=5)
    assert different_metadata.id not in (first.id, second.id)
    assert registry.get("main").id == different_metadata.id


def test_unknown_revisions_and_files_are_refused(
    registry_two_published: tuple[Registry, list],
) -> None:
    registry, (_, second) = registry_two_published

    for ref in ["0" * 40, "f" * 64, "refs/pr/1", "v1", second.revision.upper(), ""]:
        with pytest.raises(RevisionNotFound):
            registry.get(ref)
    for name in [
        "../refs.json",
        "/etc/passwd",
        "missing.bin",
        MANIFEST_FILE_NAME,
        "",
        "./config.json",
    ]:
        with pytest.raises(EntryNotFound):
            registry.file_path(second, name)
    assert registry.file_path(second, "config.json").name == "config.json"


def test_retire_takes_a_checkpoint_out_of_main_but_keeps_the_record(
    registry_two_published: tuple[Registry, list], registry_tiny_checkpoints: tuple[Path, Path]
) -> None:
    registry, (first, second) = registry_two_published

    retired = registry.retire("main")
    assert retired.id == second.id and retired.retired
    assert registry.get("main").id == first.id
    assert [(i.id, i.retired) for i in registry.list()] == [(first.id, False), (second.id, True)]
    with pytest.raises(CheckpointRetired):
        registry.publish(
            registry_tiny_checkpoints[1], round=1, method="ties", extra={"note": "merged"}
        )
    registry.retire(first.revision)
    assert registry.latest() is None
    with pytest.raises(RevisionNotFound):
        registry.get("main")
    reopened = Registry(registry.root)
    assert [(i.id, i.retired) for i in reopened.list()] == [(first.id, True), (second.id, True)]


def test_leftovers_of_an_interrupted_publish_are_ignored_and_cleaned(
    registry_two_published: tuple[Registry, list],
) -> None:
    registry, (first, second) = registry_two_published
    half_copied = registry.incoming_dir / "deadbeef"
    half_copied.mkdir()
    (half_copied / "config.json").write_text("{")
    orphan = registry.checkpoints_dir / ("ab" * 32)
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"half")
    stray_refs = registry.root / ".refs.json.123.cafe.tmp"
    stray_refs.write_text("{")

    assert [i.id for i in registry.list()] == [first.id, second.id]
    reopened = Registry(registry.root)
    assert not half_copied.exists() and not orphan.exists() and not stray_refs.exists()
    assert [i.id for i in reopened.list()] == [first.id, second.id]
    assert reopened.get("main").id == second.id


def test_a_crash_before_the_ref_update_leaves_the_old_state(
    tmp_path: Path,
    registry_tiny_checkpoints: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = Registry(tmp_path / "registry")
    first = registry.publish(registry_tiny_checkpoints[0], round=0)

    def crash(self: Registry, state: object) -> None:
        raise OSError("power cut")

    with monkeypatch.context() as patch:
        patch.setattr(Registry, "_write_refs", crash)
        with pytest.raises(OSError, match="power cut"):
            registry.publish(registry_tiny_checkpoints[1], round=1)

    assert [i.id for i in registry.list()] == [first.id]
    assert registry.get("main").id == first.id
    reopened = Registry(registry.root)
    assert [p.name for p in reopened.checkpoints_dir.iterdir()] == [first.id]
    assert list(reopened.incoming_dir.iterdir()) == []
    second = reopened.publish(registry_tiny_checkpoints[1], round=1)
    assert reopened.get("main").id == second.id


def test_revision_collision_is_refused_with_a_forced_hash(
    tmp_path: Path,
    registry_tiny_checkpoints: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = Registry(tmp_path / "registry")
    first = registry.publish(registry_tiny_checkpoints[0], round=0)
    colliding = first.revision + "0" * 24
    assert colliding != first.id
    # A real sha256 prefix collision cannot be produced; force the id of the next manifest.
    monkeypatch.setattr(CheckpointManifest, "checkpoint_id", property(lambda self: colliding))

    with pytest.raises(RevisionCollision, match=first.revision):
        registry.publish(registry_tiny_checkpoints[1], round=1, created_at="2030-01-01T00:00:00")
    assert [p.name for p in registry.checkpoints_dir.iterdir()] == [first.id]
    assert list(registry.incoming_dir.iterdir()) == []


def test_a_folder_without_config_json_is_not_a_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="config.json"):
        Registry(tmp_path / "registry").publish(folder)


def test_a_manifest_modified_on_disk_is_detected(
    registry_two_published: tuple[Registry, list],
) -> None:
    registry, (first, _) = registry_two_published
    path = registry.manifest_path(first)
    manifest = CheckpointManifest.decode(path.read_bytes())
    path.write_bytes(manifest.model_copy(update={"round": 9}).encode())

    with pytest.raises(RegistryCorrupted, match="modified"):
        Registry(registry.root).get(first.id)


# -- the Hub HTTP API ----------------------------------------------------------------------------


def test_head_reports_real_size_etag_and_commit(
    registry_served: tuple[ServedApp, Registry, list],
) -> None:
    served, registry, (_, second) = registry_served
    entry = next(f for f in second.files if f.path.endswith(".safetensors"))

    response = httpx.head(f"{served.url}/{REPO_ID}/resolve/main/{entry.path}")
    assert response.status_code == 200
    assert response.headers["content-length"] == str(entry.size)
    assert response.headers["etag"] == f'"{entry.sha256}"'
    assert response.headers["x-repo-commit"] == second.revision
    assert response.headers["accept-ranges"] == "bytes"
    assert not any("xet" in name.lower() for name in response.headers)

    body = httpx.get(f"{served.url}/{REPO_ID}/resolve/{second.revision}/{entry.path}")
    assert body.status_code == 200
    assert body.content == registry.file_path(second, entry.path).read_bytes()


def test_range_requests_return_206_with_the_right_bytes(
    registry_served: tuple[ServedApp, Registry, list],
) -> None:
    served, registry, (_, second) = registry_served
    entry = next(f for f in second.files if f.path.endswith(".safetensors"))
    data = registry.file_path(second, entry.path).read_bytes()
    url = f"{served.url}/{REPO_ID}/resolve/main/{entry.path}"

    cases = {
        "bytes=1000-": (1000, len(data) - 1),
        "bytes=10-19": (10, 19),
        "bytes=-16": (len(data) - 16, len(data) - 1),
        f"bytes=5-{len(data) + 100}": (5, len(data) - 1),
    }
    for header, (start, end) in cases.items():
        response = httpx.get(url, headers={"Range": header})
        assert response.status_code == 206, header
        assert response.content == data[start : end + 1], header
        assert response.headers["content-range"] == f"bytes {start}-{end}/{len(data)}"
        assert response.headers["content-length"] == str(end - start + 1)
    for bad in [f"bytes={len(data)}-", "bytes=20-10", "bytes=abc", "bytes=0-1,5-6", "items=0-1"]:
        response = httpx.get(url, headers={"Range": bad})
        assert response.status_code == 416, bad
        assert response.headers["content-range"] == f"bytes */{len(data)}"


def test_missing_repo_revision_and_file_get_hub_error_codes(
    registry_served: tuple[ServedApp, Registry, list],
) -> None:
    served, _, (_, second) = registry_served

    def get(path: str) -> httpx.Response:
        return httpx.get(f"{served.url}{path}")

    assert get("/other/model/resolve/main/config.json").headers["x-error-code"] == "RepoNotFound"
    assert get("/api/models/other/model").headers["x-error-code"] == "RepoNotFound"
    missing_rev = get(f"/{REPO_ID}/resolve/{'0' * 40}/config.json")
    assert (missing_rev.status_code, missing_rev.headers["x-error-code"]) == (
        404,
        "RevisionNotFound",
    )
    encoded_ref = get(f"/{REPO_ID}/resolve/refs%2Fpr%2F1/config.json")
    assert encoded_ref.headers["x-error-code"] == "RevisionNotFound"
    assert "refs/pr/1" in encoded_ref.json()["error"]
    missing_file = get(f"/{REPO_ID}/resolve/main/nope.bin")
    assert (missing_file.status_code, missing_file.headers["x-error-code"]) == (
        404,
        "EntryNotFound",
    )
    assert missing_file.headers["x-repo-commit"] == second.revision


def test_traversal_and_absolute_paths_get_404_and_read_nothing_outside(
    registry_served: tuple[ServedApp, Registry, list], tmp_path: Path
) -> None:
    served, registry, _ = registry_served
    secret = "top-secret-" + os.urandom(8).hex()
    (tmp_path / "secret.txt").write_text(secret)
    (registry.root / "planted.txt").write_text(secret)
    relative_secret = os.path.relpath(tmp_path / "secret.txt", registry.checkpoints_dir / "x")
    host, port = served.url.removeprefix("http://").split(":")
    raw_paths = [
        f"/{REPO_ID}/resolve/main/../../planted.txt",
        f"/{REPO_ID}/resolve/main/../../../../../{relative_secret}",
        f"/{REPO_ID}/resolve/main/%2e%2e/%2e%2e/planted.txt",
        f"/{REPO_ID}/resolve/main/%2E%2E%2F%2E%2E%2Fplanted.txt",
        f"/{REPO_ID}/resolve/main/{tmp_path / 'secret.txt'}",
        f"/{REPO_ID}/resolve/main//{tmp_path / 'secret.txt'}",
        f"/{REPO_ID}/resolve/main/%2F{str(tmp_path / 'secret.txt').lstrip('/')}",
        f"/{REPO_ID}/resolve/main/{MANIFEST_FILE_NAME}",
        f"/api/models/{REPO_ID}/tree/main/..%2F..",
    ]
    for raw_path in raw_paths:
        for method in ["GET", "HEAD"] if "/resolve/" in raw_path else ["GET"]:
            connection = http.client.HTTPConnection(host, int(port), timeout=10)
            connection.request(method, raw_path)  # http.client sends the path as written
            response = connection.getresponse()
            body = response.read()
            connection.close()
            assert response.status == 404, (method, raw_path)
            assert response.getheader("X-Error-Code") == "EntryNotFound", raw_path
            assert secret.encode() not in body
    assert any(".." in path for _, path, _ in served.requests)


def test_model_info_and_tree_listing(
    registry_served: tuple[ServedApp, Registry, list],
) -> None:
    served, _, (first, second) = registry_served

    info = httpx.get(f"{served.url}/api/models/{REPO_ID}/revision/main").json()
    assert (info["id"], info["sha"]) == (REPO_ID, second.revision)
    assert {(s["rfilename"], s["size"]) for s in info["siblings"]} == {
        (f.path, f.size) for f in second.files
    }
    assert info["skillswarm"]["checkpoint_id"] == second.id
    assert httpx.get(f"{served.url}/api/models/{REPO_ID}").json()["sha"] == second.revision
    by_id = httpx.get(f"{served.url}/api/models/{REPO_ID}/revision/{first.id}").json()
    assert by_id["sha"] == first.revision

    tree = httpx.get(
        f"{served.url}/api/models/{REPO_ID}/tree/{first.revision}", params={"recursive": "true"}
    ).json()
    assert [(e["type"], e["path"], e["size"], e["oid"]) for e in tree] == [
        ("file", f.path, f.size, f.sha256) for f in first.files
    ]
    assert all("xetHash" not in entry for entry in tree)

    manifest = httpx.get(f"{served.url}/v1/checkpoints/{first.revision}/manifest")
    assert hashlib.sha256(manifest.content).hexdigest() == first.id
    assert manifest.headers["x-repo-commit"] == first.revision


def test_tree_lists_folders_and_subpaths(tmp_path: Path) -> None:
    folder = tmp_path / "nested"
    (folder / "tokenizer" / "extra").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer" / "vocab.json").write_text("{}")
    (folder / "tokenizer" / "extra" / "merges.txt").write_text("a b")
    registry = Registry(tmp_path / "registry")
    info = registry.publish(folder)
    with serve_app(hub_app(registry)) as served:
        base = f"{served.url}/api/models/{REPO_ID}/tree/main"
        top = [(e["type"], e["path"]) for e in httpx.get(base).json()]
        assert top == [("file", "config.json"), ("directory", "tokenizer")]
        sub = [(e["type"], e["path"]) for e in httpx.get(f"{base}/tokenizer").json()]
        assert sub == [("directory", "tokenizer/extra"), ("file", "tokenizer/vocab.json")]
        deep = httpx.get(f"{base}/tokenizer", params={"recursive": "true"}).json()
        assert [e["path"] for e in deep if e["type"] == "file"] == [
            "tokenizer/extra/merges.txt",
            "tokenizer/vocab.json",
        ]
        missing = httpx.get(f"{base}/nowhere")
        assert (missing.status_code, missing.headers["x-error-code"]) == (404, "EntryNotFound")
        resolved = httpx.get(f"{served.url}/{REPO_ID}/resolve/main/tokenizer/extra/merges.txt")
        assert resolved.content == b"a b"
        assert resolved.headers["x-repo-commit"] == info.revision


def test_retired_revisions_are_not_served(
    registry_served: tuple[ServedApp, Registry, list],
) -> None:
    served, registry, (first, second) = registry_served
    registry.retire(second.revision)

    info = httpx.get(f"{served.url}/api/models/{REPO_ID}/revision/main").json()
    assert info["sha"] == first.revision
    gone = httpx.get(f"{served.url}/{REPO_ID}/resolve/{second.revision}/config.json")
    assert (gone.status_code, gone.headers["x-error-code"]) == (404, "RevisionNotFound")
    head = httpx.head(f"{served.url}/{REPO_ID}/resolve/main/config.json")
    assert head.headers["x-repo-commit"] == first.revision


def test_openapi_schema_builds(tmp_path: Path) -> None:
    app = hub_app(Registry(tmp_path / "registry"))
    paths = app.openapi()["paths"]
    assert "/{namespace}/{name}/resolve/{revision_and_path}" in paths
    assert "/api/models/{namespace}/{name}/tree/{revision_and_path}" in paths


HF_CLIENT_SCRIPT = r"""
import json, sys
import torch
from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError
from transformers import AutoModelForCausalLM, AutoTokenizer
from safetensors.torch import load_file

repo, first_revision, cache = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
main_path = snapshot_download(repo, revision="main", cache_dir=cache)
out["main_path"] = main_path
first_path = snapshot_download(repo, revision=first_revision, cache_dir=cache)
out["first_path"] = first_path
model = AutoModelForCausalLM.from_pretrained(repo, revision="main", cache_dir=cache)
tokenizer = AutoTokenizer.from_pretrained(repo, revision="main", cache_dir=cache)
ids = tokenizer("1 + 2 =", return_tensors="pt").input_ids
out["ids"] = ids[0].tolist()
with torch.no_grad():
    out["logits_sum"] = float(model(ids).logits.double().sum())
try:
    hf_hub_download(repo, "missing.bin", revision="main", cache_dir=cache)
except EntryNotFoundError:
    out["missing_file"] = "EntryNotFoundError"
try:
    snapshot_download(repo, revision="0" * 40, cache_dir=cache)
except RevisionNotFoundError:
    out["missing_revision"] = "RevisionNotFoundError"
print("RESULT" + json.dumps(out))
"""


def test_stock_hugging_face_clients_download_and_load_the_checkpoint(
    registry_served: tuple[ServedApp, Registry, list],
    registry_tiny_checkpoints: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    served, _, (first, second) = registry_served
    env = {
        **os.environ,
        "HF_ENDPOINT": served.url,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "HF_HUB_ETAG_TIMEOUT": "30",
    }
    env.pop("HF_TOKEN", None)
    command = [sys.executable, "-c", HF_CLIENT_SCRIPT, REPO_ID, first.revision, str(tmp_path / "c")]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(completed.stdout.split("RESULT", 1)[1])

    assert Path(result["main_path"]).name == second.revision
    assert Path(result["first_path"]).name == first.revision
    for info, source in [
        (second, registry_tiny_checkpoints[1]),
        (first, registry_tiny_checkpoints[0]),
    ]:
        snapshot = Path(result["main_path"] if info is second else result["first_path"])
        downloaded = sorted(
            p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()
        )
        assert downloaded == [f.path for f in info.files]
        for entry in info.files:
            assert (snapshot / entry.path).read_bytes() == (source / entry.path).read_bytes()
    assert result["missing_file"] == "EntryNotFoundError"
    assert result["missing_revision"] == "RevisionNotFoundError"

    expected = AutoModelForCausalLM.from_pretrained(registry_tiny_checkpoints[1])
    with torch.no_grad():
        logits = expected(torch.tensor([result["ids"]])).logits.double().sum()
    assert result["ids"] == [4, 13, 5, 15]
    assert float(logits) == pytest.approx(result["logits_sum"], rel=1e-9, abs=1e-9)
    resolves = [path for method, path, _ in served.requests if "/resolve/" in path]
    assert resolves, "the client downloaded through /resolve/"
