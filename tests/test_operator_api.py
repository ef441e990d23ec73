"""The coordinator app's operator API and observability: bearer-token operator routes whose actions
show in the read API, /v1/nodes, /metrics for Prometheus, and a valid OpenAPI document."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from delta_helpers import current_base_tensors, hand_in_delta, noisy
from fastapi.testclient import TestClient
from openapi_spec_validator import validate as validate_openapi
from prometheus_client.parser import text_string_to_metric_families
from serving import serve
from skillswarm.coordinator.app import create_app
from skillswarm.coordinator.config import CoordinatorConfig, EvalConfig, RoundPolicy
from skillswarm.coordinator.service import Coordinator
from skillswarm.coordinator.store import DeltaRecord
from skillswarm.protocol.identity import KeyPair, load_or_create_identity, peer_id_of

TOKEN = "operator-token-" + "7f3a9c" * 4
AUTH = {"Authorization": f"Bearer {TOKEN}"}
COORDINATOR_COUNTERS = [
    "deltas_received_total",
    "deltas_accepted_total",
    "deltas_rejected_total",
    "rounds_completed_total",
    "checkpoints_published_total",
]
COORDINATOR_GAUGES = ["current_round", "merge_seconds_last"]


@pytest.fixture(scope="module")
def operator_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model without warm start: cheap, and enough to merge and evaluate."""
    from skillswarm.node.bootstrap import create_base_checkpoint

    return create_base_checkpoint(
        tmp_path_factory.mktemp("operator-base") / "base", warm_start_steps=0
    )


def _config(tmp_path: Path, base: Path) -> CoordinatorConfig:
    return CoordinatorConfig(
        work_dir=tmp_path / "coord",
        p2p_port=0,
        base_checkpoint=base,
        eval=EvalConfig(n_tasks=1),
        round=RoundPolicy(min_deltas=2),
    )


@pytest.fixture
def coordinator(tmp_path: Path, operator_base: Path) -> Iterator[Coordinator]:
    """A prepared coordinator whose libp2p host is not started (deltas are handed in directly)."""
    c = Coordinator(_config(tmp_path, operator_base))
    c.prepare()
    yield c
    c.store.close()


@pytest.fixture
def client(coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setenv(coordinator.config.operator_token_env, TOKEN)
    return TestClient(create_app(coordinator))


def _hand_in_delta(c: Coordinator, key: KeyPair, scale: float) -> DeltaRecord:
    """A signed delta from `key`'s peer, its blobs already in the coordinator's store, as if
    announced on gossip and fetched."""
    tuned = noisy(current_base_tensors(c), int(scale * 1e6), scale)
    return hand_in_delta(c, key, tuned, steps=7, metrics={"reward": 0.25})


def _operator_calls(peer_id: str, revision: str) -> list[tuple[str, str, dict]]:
    return [
        ("POST", "/v1/operator/rounds", {}),
        ("PUT", "/v1/operator/merge", {"json": {"method": "linear"}}),
        ("POST", f"/v1/operator/peers/{peer_id}/allow", {}),
        ("POST", f"/v1/operator/peers/{peer_id}/deny", {}),
        ("POST", f"/v1/operator/checkpoints/{revision}/retire", {}),
    ]


# -- authentication ------------------------------------------------------------------------------


def test_operator_routes_refuse_a_missing_or_wrong_token(
    client: TestClient, coordinator: Coordinator, tmp_path: Path
) -> None:
    peer = peer_id_of(load_or_create_identity(tmp_path / "peer.key"))
    revision = coordinator.current_base().revision
    info_before = client.get("/v1/info").json()
    wrong_headers = [
        {},
        {"Authorization": "Bearer not-the-token"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
    ]
    for method, path, extra in _operator_calls(peer, revision):
        for headers in wrong_headers:
            response = client.request(method, path, headers=headers, **extra)
            assert response.status_code == 401, (method, path, headers)
            assert response.headers["www-authenticate"] == "Bearer"
            assert TOKEN not in response.text
    assert client.get("/v1/info").json() == info_before
    assert [c["retired"] for c in client.get("/v1/checkpoints").json()] == [False]
    assert client.get("/v1/rounds").json()[-1]["status"] == "open"


@pytest.mark.parametrize("token_value", [None, "", "   "])
def test_operator_api_is_disabled_without_a_configured_token(
    coordinator: Coordinator,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    token_value: str | None,
) -> None:
    variable = coordinator.config.operator_token_env
    if token_value is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, token_value)
    client = TestClient(create_app(coordinator))
    peer = peer_id_of(load_or_create_identity(tmp_path / "peer.key"))
    for method, path, extra in _operator_calls(peer, coordinator.current_base().revision):
        for headers in [{}, AUTH, {"Authorization": "Bearer "}]:
            response = client.request(method, path, headers=headers, **extra)
            assert response.status_code == 503, (method, path)
            assert response.json()["detail"] == f"operator API disabled: set ${variable}"
    assert client.get("/v1/info").status_code == 200  # the read API stays up


def test_the_token_is_read_when_the_app_is_created(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    variable = coordinator.config.operator_token_env
    monkeypatch.setenv(variable, TOKEN)
    client = TestClient(create_app(coordinator))
    monkeypatch.setenv(variable, "changed-after-start")
    spec = {"method": "linear", "parameters": {"weight": 1.0}}
    assert client.put("/v1/operator/merge", json=spec, headers=AUTH).status_code == 200
    changed = {"Authorization": "Bearer changed-after-start"}
    assert client.put("/v1/operator/merge", json=spec, headers=changed).status_code == 401


# -- merge specification ------------------------------------------------------------------------


def test_merge_spec_from_json_and_mergekit_yaml_shows_in_info(client: TestClient) -> None:
    assert client.get("/v1/info").json()["merge"]["method"] == "task_arithmetic"

    spec = {
        "method": "ties",
        "parameters": {"weight": 0.7, "density": 0.4},
        "dtype": "float32",
        "out_dtype": None,
        "seed": 3,
    }
    response = client.put("/v1/operator/merge", json=spec, headers=AUTH)
    assert response.status_code == 200, response.text
    plan = spec | {
        "candidates": [],
        "domain_weights": [],  # a spec the operator sets merges as it says
        "own_domain_gate": True,
        "own_domain_gate_alpha": 0.05,
        "own_domain_min_gain": 0.0,
        "keep_base_tensors": [],
        "domain_scale": {},
        "subsets_on_hold": True,
        "choose_by": "mean",
    }
    assert response.json() == plan
    assert client.get("/v1/info").json()["merge"] == plan

    fragment = (
        "merge_method: dare_ties\n"
        "parameters:\n"
        "  weight: 0.5\n"
        "  density: 0.3\n"
        "  normalize: true\n"
        "dtype: bfloat16\n"
    )
    response = client.put(
        "/v1/operator/merge?seed=11",
        content=fragment,
        headers=AUTH | {"Content-Type": "text/yaml; charset=utf-8"},
    )
    assert response.status_code == 200, response.text
    merge = client.get("/v1/info").json()["merge"]
    assert merge == {
        "method": "dare_ties",
        "parameters": {"weight": 0.5, "density": 0.3, "normalize": True},
        "dtype": "bfloat16",
        "out_dtype": None,
        "seed": 11,
        "candidates": [],
        "domain_weights": [],
        "own_domain_gate": True,
        "own_domain_gate_alpha": 0.05,
        "own_domain_min_gain": 0.0,
        "keep_base_tensors": [],
        "domain_scale": {},
        "subsets_on_hold": True,
        "choose_by": "mean",
    }

    in_json = {
        "mergekit_yaml": "merge_method: linear\nparameters: {weight: 1.0}\nout_dtype: float16\n",
        "seed": 4,
    }
    response = client.put("/v1/operator/merge", json=in_json, headers=AUTH)
    assert response.status_code == 200, response.text
    merge = client.get("/v1/info").json()["merge"]
    assert (merge["method"], merge["out_dtype"], merge["seed"]) == ("linear", "float16", 4)

    alternative = {"method": "ties", "parameters": {"weight": 1.0, "density": 0.5}}
    plan = {"method": "task_arithmetic", "parameters": {"weight": 0.5}, "candidates": [alternative]}
    response = client.put("/v1/operator/merge", json=plan, headers=AUTH)
    assert response.status_code == 200, response.text
    (candidate,) = client.get("/v1/info").json()["merge"]["candidates"]
    assert (candidate["method"], candidate["parameters"]) == ("ties", alternative["parameters"])


def test_unusable_merge_specs_get_422_naming_the_problem(client: TestClient) -> None:
    before = client.get("/v1/info").json()["merge"]
    yaml_headers = AUTH | {"Content-Type": "application/yaml"}
    cases: list[tuple[dict, str]] = [
        ({"json": {"method": "frankenmerge"}}, "frankenmerge"),
        ({"json": {"mergekit_yaml": "merge_method: soup_of_the_day\n"}}, "soup_of_the_day"),
        ({"content": "merge_method: not_a_method\n", "headers": yaml_headers}, "not_a_method"),
        ({"json": {"method": "ties", "parameters": {"dnsity": 0.5}}}, "dnsity"),
        ({"json": {"method": "ties", "dtype": "int8"}}, "dtype"),
        ({"json": {"method": "ties", "colour": "blue"}}, "colour"),
        ({"json": {"method": "linear", "parameters": {"weight": [0, 1]}}}, "weight"),
        (
            {
                "content": "merge_method: linear\nparameters: {weight: 1.0}\n"
                "models:\n  - model: a\n  - model: b\n",
                "headers": yaml_headers,
            },
            "per-expert",
        ),
        ({"json": {"method": "linear", "parameters": {"weight": {"a": 1.0}}}}, "per-expert"),
        ({"json": {"method": "ties", "parameters": {}}}, "weight"),
        ({"content": "parameters: {weight: 1}\n", "headers": yaml_headers}, "merge_method"),
        ({"content": "merge_method: [unclosed\n", "headers": yaml_headers}, "YAML"),
        ({"content": "- just\n- a list\n", "headers": yaml_headers}, "mapping"),
        ({"json": ["ties"]}, "object"),
        ({"json": {"mergekit_yaml": "merge_method: linear", "colour": 1}}, "colour"),
        (
            {"json": {"method": "linear", "parameters": {"weight": 1}}, "params": {"seed": 2}},
            "seed",
        ),
    ]
    for request, named in cases:
        headers = request.pop("headers", AUTH)
        response = client.put("/v1/operator/merge", headers=headers, **request)
        assert response.status_code == 422, (request, response.text)
        assert named in response.json()["detail"], (named, response.json())
    not_json_or_yaml = client.put(
        "/v1/operator/merge", content=b"method=ties", headers=AUTH | {"Content-Type": "text/plain"}
    )
    assert not_json_or_yaml.status_code == 415
    too_large = client.put(
        "/v1/operator/merge",
        content=b"merge_method: ties\n" + b"#" * (70 * 1024),
        headers=yaml_headers,
    )
    assert too_large.status_code == 413
    assert client.get("/v1/info").json()["merge"] == before


# -- peers, nodes, rounds, checkpoints -----------------------------------------------------------


def test_denied_peer_is_refused_then_admitted_again_and_nodes_show_it(
    client: TestClient, coordinator: Coordinator, tmp_path: Path
) -> None:
    key = load_or_create_identity(tmp_path / "node.key")
    peer = peer_id_of(key)
    assert client.get("/v1/nodes").json() == []

    denied = client.post(f"/v1/operator/peers/{peer}/deny", headers=AUTH)
    assert denied.status_code == 200 and denied.json() == {"peer_id": peer, "allowed": False}
    refused = _hand_in_delta(coordinator, key, 1e-3)
    deltas = client.get("/v1/deltas").json()
    assert [(d["id"], d["peer_id"], d["status"]) for d in deltas] == [
        (refused.id, peer, "rejected")
    ]
    assert deltas[0]["reason"]
    (node,) = client.get("/v1/nodes").json()
    assert (node["peer_id"], node["accepted"], node["rejected"]) == (peer, 0, 1)

    allowed = client.post(f"/v1/operator/peers/{peer}/allow", headers=AUTH)
    assert allowed.status_code == 200 and allowed.json() == {"peer_id": peer, "allowed": True}
    admitted = _hand_in_delta(coordinator, key, 2e-3)
    assert client.get(f"/v1/deltas/{admitted.id}").json()["status"] == "accepted"
    (node,) = client.get("/v1/nodes").json()
    assert (node["peer_id"], node["domain"], node["accepted"], node["rejected"]) == (
        peer,
        "math",
        1,
        1,
    )
    assert node["last_seen"]

    malformed = client.post("/v1/operator/peers/not%20a%20peer%20id/deny", headers=AUTH)
    assert malformed.status_code == 400


def test_info_pairs_the_round_with_its_own_base_while_a_merge_is_being_recorded(
    client: TestClient, coordinator: Coordinator, tmp_path: Path
) -> None:
    """A merge moves the registry's `main` a moment before the next round opens; in between,
    /v1/info still gives the closing round with its own base, never the new base with the old
    round's number (a node would train a delta for a round that is closing on it)."""
    base = coordinator.current_base()
    before = client.get("/v1/info").json()
    assert (before["round"], before["base_id"]) == (1, base.id)
    # What a merge does first when it publishes, before Rounds.record_published opens round 2.
    merged_dir = tmp_path / "merged"
    shutil.copytree(coordinator.registry.checkpoint_dir(base), merged_dir)
    (merged_dir / "generation_config.json").write_text('{"do_sample": false}')
    published = coordinator.registry.publish(merged_dir, round=1, parent=base.id, method="linear")
    assert coordinator.current_base().id == published.id != base.id
    during = client.get("/v1/info").json()
    assert (during["round"], during["base_id"], during["base_revision"]) == (
        1,
        base.id,
        base.revision,
    )
    coordinator.rounds.record_published(1, published)
    after = client.get("/v1/info").json()
    assert (after["round"], after["base_id"]) == (2, published.id)


def test_start_a_round_now_then_retire_its_checkpoint(
    client: TestClient, coordinator: Coordinator, tmp_path: Path
) -> None:
    base = coordinator.current_base()
    nothing_to_merge = client.post("/v1/operator/rounds", headers=AUTH)
    assert nothing_to_merge.status_code == 409
    assert client.get("/v1/rounds").json()[-1] == client.get("/v1/rounds").json()[0]

    delta = _hand_in_delta(coordinator, load_or_create_identity(tmp_path / "n.key"), 1e-3)
    assert coordinator.current_round().status == "open"  # policy needs two deltas; one is here
    response = client.post("/v1/operator/rounds", headers=AUTH)
    assert response.status_code == 200, response.text
    merged = response.json()
    assert (merged["number"], merged["status"], merged["inputs"]) == (1, "published", [delta.id])
    rounds = client.get("/v1/rounds").json()
    assert rounds[0] == merged
    assert [(r["number"], r["status"]) for r in rounds] == [(1, "published"), (2, "open")]
    checkpoints = client.get("/v1/checkpoints").json()
    assert [c["id"] for c in checkpoints] == [base.id, merged["checkpoint_id"]]
    info = client.get("/v1/info").json()
    assert (info["round"], info["base_id"]) == (2, merged["checkpoint_id"])
    assert client.get(f"/v1/deltas/{delta.id}").json()["status"] == "merged"

    new_revision = checkpoints[1]["revision"]
    retired = client.post(f"/v1/operator/checkpoints/{new_revision}/retire", headers=AUTH)
    assert retired.status_code == 200, retired.text
    assert (retired.json()["id"], retired.json()["retired"]) == (merged["checkpoint_id"], True)
    assert [c["retired"] for c in client.get("/v1/checkpoints").json()] == [False, True]
    rounds = client.get("/v1/rounds").json()
    assert [(r["number"], r["status"]) for r in rounds] == [
        (1, "published"),
        (2, "abandoned"),  # it was building on the retired checkpoint
        (3, "open"),
    ]
    assert client.get("/v1/info").json()["base_id"] == rounds[2]["base_id"] == base.id
    last_resort = client.post(f"/v1/operator/checkpoints/{base.revision}/retire", headers=AUTH)
    assert last_resort.status_code == 409  # the only checkpoint left in service
    hub_info = client.get(f"/api/models/{coordinator.config.repo_id}/revision/main").json()
    assert hub_info["sha"] == base.revision
    gone = client.get(f"/{coordinator.config.repo_id}/resolve/{new_revision}/config.json")
    assert (gone.status_code, gone.headers["x-error-code"]) == (404, "RevisionNotFound")

    unknown = client.post(f"/v1/operator/checkpoints/{'0' * 40}/retire", headers=AUTH)
    assert unknown.status_code == 404


# -- metrics and OpenAPI -------------------------------------------------------------------------


def _scrape(client: TestClient) -> dict[str, list]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(response.text)}


def test_metrics_expose_the_coordinator_counters_and_http_traffic(
    client: TestClient, coordinator: Coordinator, tmp_path: Path
) -> None:
    key = load_or_create_identity(tmp_path / "node.key")
    client.post(f"/v1/operator/peers/{peer_id_of(key)}/deny", headers=AUTH)
    _hand_in_delta(coordinator, key, 1e-3)
    client.post(f"/v1/operator/peers/{peer_id_of(key)}/allow", headers=AUTH)
    _hand_in_delta(coordinator, key, 2e-3)
    client.get("/v1/deltas/no-such-delta")
    client.get("/v1/deltas/another-missing-one")
    client.get("/no/such/route/at/all")

    families = _scrape(client)
    values = coordinator.metrics()
    for name in COORDINATOR_COUNTERS:
        (sample,) = families[f"skillswarm_{name.removesuffix('_total')}"]
        assert (sample.name, sample.value) == (f"skillswarm_{name}", values[name])
    for name in COORDINATOR_GAUGES:
        assert families[f"skillswarm_{name}"][0].value == pytest.approx(values[name])
    assert families["skillswarm_deltas_received"][0].value == 2
    assert families["skillswarm_deltas_accepted"][0].value == 1
    assert families["skillswarm_deltas_rejected"][0].value == 1
    assert families["skillswarm_deltas_rejected_denied"][0].value == 1  # split by kind
    assert families["skillswarm_current_round"][0].value == 1

    requests = {
        (s.labels["method"], s.labels["route"], s.labels["status"]): s.value
        for s in families["skillswarm_http_requests"]
        if s.name.endswith("_total")
    }
    assert requests[("GET", "/v1/deltas/{delta_id}", "404")] == 2
    assert requests[("POST", "/v1/operator/peers/{peer_id}/deny", "200")] == 1
    assert requests[("GET", "unmatched", "404")] == 1
    assert not any("no-such-delta" in route for _, route, _ in requests)
    latency_counts = {
        s.labels["route"]: s.value
        for s in families["skillswarm_http_request_duration_seconds"]
        if s.name.endswith("_count")
    }
    assert latency_counts["/v1/deltas/{delta_id}"] == 2


def test_each_app_has_its_own_metrics_registry(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(coordinator.config.operator_token_env, TOKEN)
    first, second = TestClient(create_app(coordinator)), TestClient(create_app(coordinator))
    for _ in range(3):
        first.get("/v1/info")

    def info_requests(client: TestClient) -> float:
        samples = _scrape(client)["skillswarm_http_requests"]
        return sum(
            s.value
            for s in samples
            if s.name.endswith("_total") and s.labels["route"] == "/v1/info"
        )

    assert info_requests(first) == 3
    assert info_requests(second) == 0


def test_openapi_document_is_valid_and_shows_the_operator_security(
    client: TestClient,
) -> None:
    document = client.get("/openapi.json").json()
    validate_openapi(document)

    scheme = document["components"]["securitySchemes"]["OperatorToken"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    paths = document["paths"]
    operator_operations = {
        ("post", "/v1/operator/rounds"),
        ("put", "/v1/operator/merge"),
        ("post", "/v1/operator/peers/{peer_id}/allow"),
        ("post", "/v1/operator/peers/{peer_id}/deny"),
        ("post", "/v1/operator/checkpoints/{revision}/retire"),
    }
    found = {(m, p) for p, ops in paths.items() for m in ops if p.startswith("/v1/operator/")}
    assert found == operator_operations
    for path in ["/v1/nodes", "/metrics", "/v1/info", "/healthz"]:
        assert path in paths
    for path, operations in paths.items():
        for method, operation in operations.items():
            if path.startswith("/v1/operator/"):
                assert operation["security"] == [{"OperatorToken": []}], path
                assert {"401", "503"} <= set(operation["responses"]), path
                assert operation["tags"] == ["operator"]
            else:
                assert "security" not in operation, path
            success = [v for k, v in operation["responses"].items() if k.startswith("2")]
            assert success, (method, path)
            content = success[0].get("content")
            assert content, (method, path)
            if "application/json" in content:
                assert content["application/json"].get("schema"), (method, path)
    body = paths["/v1/operator/merge"]["put"]["requestBody"]["content"]
    assert {"application/json", "application/yaml", "text/yaml"} <= set(body)
    node_schema = document["components"]["schemas"]["NodeOut"]
    assert {"peer_id", "last_seen", "accepted", "rejected"} <= set(node_schema["properties"])


# -- the whole app under uvicorn ------------------------------------------------------------------


def test_served_app_answers_operator_nodes_and_metrics_over_a_socket(
    tmp_path: Path, operator_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = Coordinator(_config(tmp_path, operator_base))
    monkeypatch.setenv(c.config.operator_token_env, TOKEN)
    with serve(create_app(c)) as url, httpx.Client(base_url=url) as http:
        assert http.get("/v1/info").json()["peer_id"] == c.host.peer_id
        assert http.post("/v1/operator/rounds").status_code == 401
        spec = {"method": "linear", "parameters": {"weight": 1.0}}
        assert http.put("/v1/operator/merge", json=spec, headers=AUTH).status_code == 200
        assert http.get("/v1/info").json()["merge"]["method"] == "linear"
        assert http.get("/v1/nodes").json() == []
        scraped = http.get("/metrics", headers={"Accept": "application/openmetrics-text"})
        assert scraped.headers["content-type"].startswith("application/openmetrics-text")
        assert "\nskillswarm_deltas_received_total 0" in scraped.text
        assert scraped.text.endswith("# EOF\n")
        text = http.get("/metrics").text
        names = {family.name for family in text_string_to_metric_families(text)}
        assert {"skillswarm_rounds_completed", "skillswarm_http_requests"} <= names


def test_info_advertises_the_configured_public_multiaddrs(tmp_path: Path, operator_base: Path):
    config = _config(tmp_path, operator_base).model_copy(
        update={
            "p2p_announce_addrs": ["/ip4/203.0.113.10/tcp/4001", "/dns4/coord.example/tcp/4001"]
        }
    )
    c = Coordinator(config)
    c.prepare()
    try:
        info = TestClient(create_app(c)).get("/v1/info").json()
    finally:
        c.store.close()
    assert info["multiaddrs"] == [
        f"/ip4/203.0.113.10/tcp/4001/p2p/{c.host.peer_id}",
        f"/dns4/coord.example/tcp/4001/p2p/{c.host.peer_id}",
    ]
    with pytest.raises(ValueError, match="not a TCP multiaddr"):
        CoordinatorConfig(p2p_announce_addrs=["/ip4/0.0.0.0/udp/4001"])
