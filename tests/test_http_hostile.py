"""A bad-input corpus against the coordinator's real HTTP server (the app under uvicorn with the
coordinator's protocol settings): every case gets a well-formed 4xx, never a 5xx or a dropped
connection; afterwards /v1/info still answers and the work dir is unchanged. Each class found
before is a named test."""

from __future__ import annotations

import re
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import serve
from skillswarm.coordinator.app import create_app
from skillswarm.coordinator.config import CoordinatorConfig, EvalConfig
from skillswarm.coordinator.http_server import server_config
from skillswarm.coordinator.operator_api import MAX_MERGE_BODY_BYTES
from skillswarm.coordinator.service import Coordinator

TOKEN = "operator-token-" + "5e1d2c" * 4
HEADER_TIMEOUT_S = 1.0
REPO = "skillswarm/agent"


class Served:
    def __init__(self, port: int, work_dir: Path) -> None:
        self.port = port
        self.work_dir = work_dir

    def request(self, raw: bytes, timeout: float = 10.0) -> tuple[int | None, bytes, bytes]:
        """Send raw bytes, read to the end; (status or None when no response came, head, body)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            sock.sendall(raw)
            received = bytearray()
            while chunk := sock.recv(65536):
                received += chunk
        head, _, body = bytes(received).partition(b"\r\n\r\n")
        match = re.match(rb"HTTP/1\.1 (\d{3}) ", head)
        return (int(match[1]) if match else None), head, body

    def get(self, target: str, *headers: str, method: str = "GET") -> tuple[int | None, bytes]:
        lines = [f"{method} {target} HTTP/1.1", "Host: coordinator", "Connection: close"]
        status, head, _ = self.request(("\r\n".join([*lines, *headers]) + "\r\n\r\n").encode())
        return status, head

    def body(self, method: str, target: str, body: bytes, content_type: str) -> int | None:
        head = (
            f"{method} {target} HTTP/1.1\r\nHost: coordinator\r\nConnection: close\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        if len(body) > MAX_MERGE_BODY_BYTES:  # refused on its declared length (413) unread
            body = body[:1024]
        return self.request(head + body)[0]


def _snapshot(folder: Path) -> dict[str, object]:
    """Every file's size and time, and the database's rows (its files change as SQLite runs)."""
    files: dict[str, object] = {
        str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.name.startswith("coordinator.db")
    }
    with sqlite3.connect(f"file:{folder / 'coordinator.db'}?mode=ro", uri=True) as db:
        files["coordinator.db rows"] = list(db.iterdump())
    return files


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch
) -> Iterator[Served]:
    from skillswarm.node.bootstrap import create_base_checkpoint

    root = tmp_path_factory.mktemp("hostile-http")
    base = create_base_checkpoint(root / "base", warm_start_steps=0)
    config = CoordinatorConfig(
        work_dir=root / "coord", p2p_port=0, base_checkpoint=base, eval=EvalConfig(n_tasks=1)
    )
    coordinator = Coordinator(config)
    coordinator.prepare()
    monkeypatch_module.setenv(config.operator_token_env, TOKEN)
    app = create_app(coordinator)
    http_config = server_config(
        app, "127.0.0.1", 0, header_timeout_s=HEADER_TIMEOUT_S, log_level="warning",
        lifespan="off",
    )  # fmt: skip
    with serve(app, config=http_config, timeout=30) as url:
        served = Served(int(url.rsplit(":", 1)[1]), config.work_dir)
        before = _snapshot(config.work_dir)
        yield served
        after = _snapshot(config.work_dir)
    coordinator.store.close()
    assert after == before, "a bad request changed the work dir"


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(autouse=True)
def still_answering(served: Served) -> Iterator[None]:
    yield
    status, _ = served.get("/v1/info")
    assert status == 200, "the server stopped answering after a bad request"


def _client_error(status: int | None) -> bool:
    return status is not None and 400 <= status < 500


# -- named regressions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        "round=9223372036854775808",  # one past SQLite's integer range
        "round=99999999999999999999999999",
        "round=-1",
        "round=1e3",
        "status=bogus",
        "status=" + quote("accepted\x00"),
    ],
)
def test_query_values_out_of_range_are_422(served: Served, query: str) -> None:
    assert served.get(f"/v1/deltas?{query}")[0] == 422
    assert served.get("/v1/deltas?round=9223372036854775807&status=accepted")[0] == 200


@pytest.mark.parametrize(
    "range_header",
    [
        "bytes=" + "9" * 5000 + "-",  # past Python's int-digit limit
        "bytes=0-" + "9" * 5000,
        "bytes=-" + "9" * 21,
        "bytes=" + "1" * 25 + "-" + "2" * 25,
    ],
)
def test_absurd_range_numbers_are_416(served: Served, range_header: str) -> None:
    status, head = served.get(f"/{REPO}/resolve/main/config.json", f"Range: {range_header}")
    assert status == 416, head
    assert served.get(f"/{REPO}/resolve/main/config.json", "Range: bytes=0-1")[0] == 206


@pytest.mark.parametrize("bad", [" ", "\t", "\x00", "\x1b", "\x7f", "\r\n", "x y", "\u2028"])
@pytest.mark.parametrize("where", ["namespace", "name", "revision"])
def test_whitespace_and_control_characters_in_hub_paths_get_a_clean_404(
    served: Served, bad: str, where: str
) -> None:
    parts = {"namespace": "skillswarm", "name": "agent", "revision": "main"}
    parts[where] = parts[where] + bad
    encoded = {key: quote(value, safe="") for key, value in parts.items()}
    for target in (
        f"/api/models/{encoded['namespace']}/{encoded['name']}/revision/{encoded['revision']}",
        f"/{encoded['namespace']}/{encoded['name']}/resolve/{encoded['revision']}/config.json",
    ):
        status, head = served.get(target)
        assert status == 404, (target, head)
        for line in head.split(b"\r\n")[1:]:
            assert re.fullmatch(rb"[\x21-\x7e]+: [\x20-\x7e]*", line), line


def test_made_up_methods_do_not_grow_the_metrics(served: Served) -> None:
    for index in range(20):
        status, _ = served.get("/v1/info", method=f"BREW{index}")
        assert _client_error(status)
    status, head = served.get("/metrics")
    assert status == 200
    _, _, body = served.request(b"GET /metrics HTTP/1.1\r\nHost: c\r\nConnection: close\r\n\r\n")
    methods = set(re.findall(rb'method="([^"]*)"', body))
    assert b"other" in methods
    assert not any(method.startswith(b"BREW") for method in methods)


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "application/json"),  # body limit first: 413
        (b"[" * 30_000, "application/json"),
        (b'{"a":' * 5_000 + b"1" + b"}" * 5_000, "application/json"),
        (b"[" * 20_000 + b"]" * 20_000, "application/yaml"),
        (b"merge_method: linear\nparameters:\n" + b"".join(
            b"  " * (depth + 1) + b"k%d:\n" % depth for depth in range(2000)
        ), "application/yaml"),
        (b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
            b"%c: &%c [*%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c]\n" % ((c, c) + (c - 1,) * 9)
            for c in range(ord("b"), ord("k"))
        ) + b"merge_method: *j\n", "application/yaml"),
        (b"\xff\xfe", "application/json"),
        (b"{}", "text/plain"),
    ],
)  # fmt: skip
def test_operator_bodies_deep_huge_or_malformed_are_4xx(
    served: Served, body: bytes, content_type: str
) -> None:
    status = served.body("PUT", "/v1/operator/merge", body, content_type)
    assert _client_error(status), status


def test_operator_routes_refuse_bad_tokens(served: Served) -> None:
    for authorization in ("Bearer wrong", "Bearer ", "Basic Zm9vOmJhcg==", "Bearer " + "x" * 8000):
        status, _ = served.get(
            "/v1/operator/rounds", f"Authorization: {authorization}", method="POST"
        )
        assert _client_error(status), authorization


def test_clients_that_never_finish_their_headers_are_cut_off(served: Served) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        sock.sendall(b"GET /v1/info HTTP/1.1\r\nHost: coordinator\r\n")  # never ends
        assert sock.recv(1024) == b""  # closed by the server
    assert time.monotonic() - started < HEADER_TIMEOUT_S + 10
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        sock.sendall(b"GET /v1/info HTTP/1.1\r\nHost: coordinator\r\n\r\n")  # kept alive
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /v1/info HTTP/1.1\r\n")  # the next request stalls
        closed = b""
        while chunk := sock.recv(65536):
            closed += chunk
    assert time.monotonic() - started < 2 * HEADER_TIMEOUT_S + 20


def test_traversal_and_odd_paths_are_404(served: Served) -> None:
    for target in (
        f"/{REPO}/resolve/main/..%2F..%2Fcoordinator.db",
        f"/{REPO}/resolve/main/../../etc/passwd",
        f"/{REPO}/resolve/main/%2Fetc%2Fpasswd",
        f"/api/models/{REPO}/tree/main/..%2F..",
        "/v1/checkpoints/..%2F..%2Fcoordinator.db/manifest",
        "/v1/deltas/" + "a" * 10_000,
    ):
        status, head = served.get(target)
        assert _client_error(status), (target, head)


# -- property-based: any revision, name or path ----------------------------------------------

_any_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(namespace=_any_text, name=_any_text, revision=_any_text)
def test_hub_routes_answer_any_names_with_a_clean_4xx(
    served: Served, namespace: str, name: str, revision: str
) -> None:
    n, m, r = (quote(part, safe="") for part in (namespace, name, revision))
    for target in (
        f"/api/models/{n}/{m}/revision/{r}",
        f"/api/models/{n}/{m}/tree/{r}",
        f"/{n}/{m}/resolve/{r}/config.json",
    ):
        status, head = served.get(target)
        assert status is not None and status < 500, (target, head)
