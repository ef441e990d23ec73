"""Round policy, evaluation, operator settings and crash safety of a real Coordinator: quorum or
deadline, the evaluation table (base, each expert, merged) and merge candidates, settings and
accepted deltas that outlive restarts, heartbeats, retiring a base, and a coordinator process
killed with SIGKILL mid-merge that completes the round when restarted."""

from __future__ import annotations

import datetime as dt
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
import torch
from delta_helpers import current_base_tensors, hand_in_delta, noisy, signed_announcement
from skillswarm.coordinator.config import CoordinatorConfig, EvalConfig, MergePlan, RoundPolicy
from skillswarm.coordinator.registry import Registry
from skillswarm.coordinator.service import Coordinator
from skillswarm.coordinator.store import (
    CheckpointRecord,
    CoordinatorStore,
    DeltaRecord,
    OperatorActionRecord,
    RoundRecord,
    utcnow,
)
from skillswarm.merge.methods import MergeSpec
from skillswarm.merge.outer import OuterOptimizerConfig, load_state
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.checkpoint import verify_folder
from skillswarm.protocol.host import SwarmHost
from skillswarm.protocol.identity import KeyPair, load_or_create_identity, peer_id_of
from skillswarm.protocol.manifest import DeltaManifest
from skillswarm.protocol.messages import NodeHeartbeat, encode_message
from skillswarm.protocol.tomlconfig import write_toml_config
from sqlalchemy import create_engine, text

from skillswarm.demo import free_port, spawn, wait_http


def _config(tmp_path: Path, base: Path, **fields) -> CoordinatorConfig:
    defaults = {
        "work_dir": tmp_path / "coord",
        "p2p_port": 0,
        "base_checkpoint": base,
        "eval": EvalConfig(n_tasks=1),
    }
    return CoordinatorConfig(**(defaults | fields))


def _hand_in(c: Coordinator, key: KeyPair, seed: int, domain: str = "math") -> DeltaRecord:
    """A signed delta whose blobs are already in the coordinator's store, as after a fetch."""
    return hand_in_delta(c, key, noisy(current_base_tensors(c), seed), domain=domain)


def _open_since(c: Coordinator, seconds: float) -> None:
    """Move the open round's start back, as if it had opened `seconds` ago."""
    with c.store.session() as s:
        row = s.get(RoundRecord, c.current_round().number)
        row.started_at = utcnow() - dt.timedelta(seconds=seconds)


def _wait(condition, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _keys(tmp_path: Path, *names: str) -> list[KeyPair]:
    return [load_or_create_identity(tmp_path / f"{name}.key") for name in names]


def test_deadline_merges_with_the_minimum_count_without_a_quorum(tmp_path, tiny_base):
    policy = RoundPolicy(min_deltas=3, deadline_s=600, min_deltas_at_deadline=2)
    c = Coordinator(_config(tmp_path, tiny_base, round=policy))
    c.prepare()
    try:
        alice, bob = _keys(tmp_path, "alice", "bob")
        first = _hand_in(c, alice, seed=1)
        assert first.status == "accepted"
        assert c.current_round().status == "open"  # no quorum, deadline not reached

        _open_since(c, 601)
        assert c.maybe_merge() is None  # past the deadline, but 1 < min_deltas_at_deadline
        assert c.current_round().number == 1

        second = _hand_in(c, bob, seed=2)
        assert second.status == "accepted"
        merged = c.round_record(1)
        assert (merged["status"], merged["trigger"]) == ("published", "deadline")
        assert merged["inputs"] == [first.id, second.id]
        assert c.current_round().number == 2
    finally:
        c.store.close()


def test_started_coordinator_merges_at_the_deadline_and_lists_heartbeats(tmp_path, tiny_base):
    policy = RoundPolicy(min_deltas=2, deadline_s=600, min_deltas_at_deadline=1)
    c = Coordinator(_config(tmp_path, tiny_base, round=policy))
    c.start()
    (key,) = _keys(tmp_path, "node")
    node = SwarmHost(key, BlobStore(tmp_path / "node-blobs"), topic=c.config.topic)
    node.start()
    try:
        node.connect(c.host.listen_addrs[0])
        node.wait_for_peers_in_topic(1, timeout=30)
        delta = _hand_in(c, key, seed=1)
        assert c.current_round().status == "open"

        heartbeat = NodeHeartbeat(domain="math", round=1, step=6, reward=0.375)
        node.publish(encode_message(heartbeat))
        (seen,) = _wait(lambda: [n for n in c.nodes() if n["step"] == 6], "the heartbeat")
        assert (seen["peer_id"], seen["domain"], seen["round"]) == (node.peer_id, "math", 1)
        assert (seen["reward"], seen["accepted"], seen["rejected"]) == (0.375, 1, 0)
        last_seen = dt.datetime.fromisoformat(seen["last_seen"])
        assert last_seen.tzinfo is not None and seen["last_heartbeat"] is not None

        _open_since(c, 601)  # nothing else arrives: the intake loop's clock closes the round
        _wait(lambda: c.round_record(1)["status"] == "published", "the deadline merge")
        record = c.round_record(1)
        assert (record["trigger"], record["inputs"]) == ("deadline", [delta.id])
        assert c.metrics()["nodes_seen"] == 1
    finally:
        node.stop()
        c.stop()


def test_evaluation_table_and_merge_candidates(tmp_path, tiny_base):
    plan = MergePlan(
        method="task_arithmetic",
        parameters={"weight": 1.0},
        candidates=[
            MergeSpec(method="task_arithmetic", parameters={"weight": 0.5}),
            MergeSpec(method="linear", parameters={"weight": 1.0}),
        ],
    )
    eval_config = EvalConfig(
        domains=["math", "code"], n_tasks=1, validation_tasks=2, seed=0, validation_seed=5
    )
    c = Coordinator(
        _config(tmp_path, tiny_base, merge=plan, eval=eval_config, round=RoundPolicy(min_deltas=2))
    )
    c.prepare()
    try:
        math_key, code_key = _keys(tmp_path, "math", "code")
        math_delta = _hand_in(c, math_key, seed=1, domain="math")
        code_delta = _hand_in(c, code_key, seed=2, domain="code")
        record = c.round_record(1)  # the quorum merged it when the second delta arrived
        assert (record["status"], record["trigger"]) == ("published", "quorum")

        table = record["evaluation"]
        experts = [f"expert:math:{math_delta.id[:12]}", f"expert:code:{code_delta.id[:12]}"]
        assert list(table) == ["base", *experts, "merged"]
        for label, row in table.items():
            assert set(row) == {"math", "code"}, label
            for score in row.values():
                assert score["n"] == 1 and 0.0 <= score["mean_reward"] <= 1.0

        candidates = record["candidates"]
        assert [c_["spec"] for c_ in candidates] == [s.model_dump() for s in plan.specs()]
        assert all(
            c_["seed"] == 5 and set(c_["validation"]) == {"math", "code"} for c_ in candidates
        )
        # Candidates are chosen on validation_tasks tasks, the table reports n_tasks.
        assert all(row["n"] == 2 for c_ in candidates for row in c_["validation"].values())
        (chosen,) = [c_ for c_ in candidates if c_["chosen"]]
        assert chosen["score"] == max(c_["score"] for c_ in candidates)
        assert record["method"] == chosen["spec"]
        published = c.current_base()
        assert published.id == record["checkpoint_id"]
        assert published.method == chosen["spec"]["method"]
        assert published.extra["evaluation"] == table
    finally:
        c.store.close()


def test_domain_weights_make_one_candidate_per_uneven_assignment() -> None:
    assert MergePlan().domain_weights == []  # off by default
    plan = MergePlan(domain_weights=[0.5, 1.0])
    three = plan.domain_weight_specs({"a": "math", "b": "math", "c": "code", "d": "search"})
    weights = [s.parameters["weight"] for s in three]
    assert len(weights) == 2**3 - 2  # every assignment but all 0.5 and all 1 (the plain λs)
    assert len({tuple(sorted(w.items())) for w in weights}) == len(weights)
    for w in weights:
        assert w["a"] == w["b"]  # a domain's deltas share its weight
        assert len({w["a"], w["c"], w["d"]}) == 2
    assert all(s.method == "task_arithmetic" and s.seed == plan.seed for s in three)
    assert plan.domain_weight_specs({"a": "math", "b": "math"}) == []  # one domain
    assert MergePlan(domain_weights=[1.0]).domain_weight_specs({"a": "math", "c": "code"}) == []
    # A plan that names its own method weights no domain apart, unless it says so.
    assert MergePlan(method="ties", parameters={"weight": 1.0, "density": 0.5}).domain_weights == []
    assert MergePlan(method="linear", domain_weights=[0.25, 1.0]).domain_weights == [0.25, 1.0]
    for bad in ([0.0, 1.0], [1.0, 1.0], [0.5, 3.0]):
        with pytest.raises(ValueError, match="domain_weights"):
            MergePlan(domain_weights=bad)


def test_a_round_of_two_domains_also_tries_each_domain_weighted_apart(tmp_path, tiny_base):
    eval_config = EvalConfig(domains=["math", "code"], n_tasks=1, seed=0, validation_seed=5)
    plan = MergePlan(domain_weights=[0.5, 1.0])
    round_policy = RoundPolicy(min_deltas=2)
    c = Coordinator(_config(tmp_path, tiny_base, eval=eval_config, round=round_policy, merge=plan))
    c.prepare()
    try:
        math_key, code_key = _keys(tmp_path, "math", "code")
        math_delta = _hand_in(c, math_key, seed=1, domain="math")
        code_delta = _hand_in(c, code_key, seed=2, domain="code")
        record = c.round_record(1)
        assert record["status"] == "published", record.get("decision")
        specs = [c_["spec"] for c_ in record["candidates"]]
        plain = [s.model_dump() for s in plan.specs()]
        assert specs[: len(plain)] == plain
        names = (math_delta.id[:16], code_delta.id[:16])
        assert [s["parameters"]["weight"] for s in specs[len(plain) :]] == [
            {names[0]: 1.0, names[1]: 0.5},
            {names[0]: 0.5, names[1]: 1.0},
        ]
        (chosen,) = [c_ for c_ in record["candidates"] if c_["chosen"]]
        assert chosen["score"] == max(c_["score"] for c_ in record["candidates"])
    finally:
        c.store.close()


def test_restart_keeps_accepted_deltas_and_merges_a_round_whose_policy_is_met(tmp_path, tiny_base):
    first = Coordinator(_config(tmp_path, tiny_base, round=RoundPolicy(min_deltas=3)))
    first.prepare()
    alice, bob = _keys(tmp_path, "alice", "bob")
    accepted = [_hand_in(first, alice, seed=1), _hand_in(first, bob, seed=2)]
    blobs = [sha for d in accepted for sha in DeltaManifest.decode(d.manifest).blobs]
    first.store.close()

    second = Coordinator(_config(tmp_path, tiny_base, round=RoundPolicy(min_deltas=2)))
    with second.store.session() as s:
        assert {d.id: d.status for d in s.query(DeltaRecord)} == {
            d.id: "accepted" for d in accepted
        }
    assert all(second.blobs.has(sha) for sha in blobs)
    second.start()
    try:
        _wait(lambda: second.round_record(1)["status"] == "published", "the merge at start")
        assert second.round_record(1)["inputs"] == [d.id for d in accepted]
        assert [i.round for i in second.registry.list()] == [0, 1]
    finally:
        second.stop()


def test_merge_spec_and_peer_access_survive_a_restart(tmp_path, tiny_base):
    listed, denied, allowed, stranger = _keys(tmp_path, "listed", "denied", "allowed", "stranger")
    config = _config(
        tmp_path, tiny_base, allowed_peers=[peer_id_of(listed)], round=RoundPolicy(min_deltas=9)
    )
    first = Coordinator(config)
    first.prepare()
    linear = MergeSpec(method="linear", parameters={"weight": 1.0})
    first.set_merge_spec(linear)
    first.set_peer_allowed(peer_id_of(listed), False)
    first.set_peer_allowed(peer_id_of(denied), False)
    first.set_peer_allowed(peer_id_of(allowed), True)
    first.set_peer_allowed(peer_id_of(listed), True)  # a denial lifted again
    with pytest.raises(ValueError, match="not a base58 PeerID"):
        first.set_peer_allowed("not a peer id", False)
    per_expert = MergeSpec(method="task_arithmetic", parameters={"weight": {"x": 1.0}})
    with pytest.raises(ValueError, match="per-expert values"):
        first.set_merge_spec(per_expert)
    first.store.close()

    second = Coordinator(config)
    second.prepare()
    try:
        assert second.config.merge.specs() == [linear]
        refused = _hand_in(second, denied, seed=1)
        assert refused.reason == f"peer {peer_id_of(denied)} is denied"
        assert refused.rejection_kind == "denied"
        unlisted = _hand_in(second, stranger, seed=2)
        assert unlisted.reason == f"peer {peer_id_of(stranger)} is not on the allow-list"
        admitted = [_hand_in(second, allowed, seed=3), _hand_in(second, listed, seed=4)]
        assert [d.status for d in admitted] == ["accepted", "accepted"]

        merged = second.request_round()
        assert merged["status"] == "published"
        assert merged["method"] == linear.model_dump()
        assert merged["inputs"] == [d.id for d in admitted]
        with second.store.session() as s:
            actions = [(a.action, a.subject) for a in s.query(OperatorActionRecord)]
        assert actions[0] == ("set_merge_spec", "linear")
        assert ("deny_peer", peer_id_of(denied)) in actions
        assert actions[-1] == ("request_round", "1")
    finally:
        second.store.close()


def test_operator_round_request_and_retiring_the_open_rounds_base(tmp_path, tiny_base):
    c = Coordinator(_config(tmp_path, tiny_base, round=RoundPolicy(min_deltas=5)))
    c.prepare()
    try:
        base = c.current_base()
        with pytest.raises(ValueError, match="no accepted deltas in round 1"):
            c.request_round()
        (key,) = _keys(tmp_path, "node")
        _hand_in(c, key, seed=1)
        first = c.request_round()
        assert (first["status"], first["trigger"]) == ("published", "operator")
        assert isinstance(first["started_at"], dt.datetime)

        pending = _hand_in(c, key, seed=2)  # round 2, built on round 1's checkpoint
        assert pending.status == "accepted"
        retired = c.retire_checkpoint(first["checkpoint_id"][:40])
        assert (retired["id"], retired["retired"], retired["round"]) == (
            first["checkpoint_id"],
            True,
            1,
        )
        assert retired["evaluation"] == first["evaluation"]
        abandoned = c.round_record(2)
        assert abandoned["status"] == "abandoned"
        with c.store.session() as s:
            row = s.get(DeltaRecord, pending.id)
            assert (row.status, row.rejection_kind) == ("rejected", "retired")
        now = c.current_round()
        assert (now.number, now.status, now.base_id) == (3, "open", base.id)
        assert c.current_base().id == base.id

        with pytest.raises(ValueError, match="only one in service"):
            c.retire_checkpoint(base.revision)
        with pytest.raises(KeyError):
            c.retire_checkpoint("0" * 40)
        assert c.metrics()["checkpoints_retired_total"] == 1
    finally:
        c.store.close()


def test_a_round_published_just_before_a_crash_is_recorded_not_merged_again(tmp_path, tiny_base):
    config = _config(tmp_path, tiny_base, round=RoundPolicy(min_deltas=1))
    first = Coordinator(config)
    first.prepare()
    (key,) = _keys(tmp_path, "node")
    delta = _hand_in(first, key, seed=1)
    published = first.round_record(1)
    assert published["status"] == "published"
    # The state a crash leaves between the registry's atomic publish and the store's commit.
    with first.store.session() as s:
        s.get(RoundRecord, 1).status = "merging"
        s.delete(s.get(RoundRecord, 2))
        s.delete(s.get(CheckpointRecord, published["checkpoint_id"]))
        s.get(DeltaRecord, delta.id).status = "accepted"
    first.store.close()

    second = Coordinator(config)
    second.prepare()
    try:
        recovered = second.round_record(1)
        for field in ("status", "checkpoint_id", "inputs", "evaluation", "method", "trigger"):
            assert recovered[field] == published[field], field
        assert [i.round for i in second.registry.list()] == [0, 1]
        assert second.current_round().base_id == published["checkpoint_id"]
        with second.store.session() as s:
            assert s.get(DeltaRecord, delta.id).status == "merged"
    finally:
        second.store.close()


def test_store_adds_the_columns_an_older_database_lacks(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    with engine.begin() as conn:  # the rounds table as the first version created it
        conn.execute(
            text(
                "CREATE TABLE rounds (number INTEGER PRIMARY KEY, base_id VARCHAR(64), "
                "status VARCHAR(16), method JSON, inputs JSON, evaluation JSON, "
                "checkpoint_id VARCHAR(64), error TEXT, started_at DATETIME, finished_at DATETIME)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO rounds VALUES (1, 'b', 'published', '{}', '[]', '{}', NULL, NULL, "
                "'2025-01-01 00:00:00', NULL)"
            )
        )
    engine.dispose()
    store = CoordinatorStore(url)
    try:
        with store.session() as s:
            row = s.get(RoundRecord, 1)
            assert (row.candidates, row.trigger, row.merge_seconds) == ([], None, None)
            row.trigger = "quorum"
        with store.session() as s:
            assert s.get(RoundRecord, 1).trigger == "quorum"
    finally:
        store.close()


def _round_status(db: Path, number: int) -> str | None:
    with sqlite3.connect(db, timeout=10) as conn:
        row = conn.execute("SELECT status FROM rounds WHERE number = ?", (number,)).fetchone()
    return None if row is None else row[0]


def test_coordinator_killed_mid_merge_restarts_and_completes_the_round(tmp_path, tiny_base):
    url_port = free_port()
    config = _config(
        tmp_path,
        tiny_base,
        http_port=url_port,
        round=RoundPolicy(min_deltas=2),
        eval=EvalConfig(n_tasks=6),  # a merge that lasts a few seconds
        outer=OuterOptimizerConfig(learning_rate=1.0, momentum=0.5),
    )
    toml = write_toml_config(config, tmp_path / "coordinator.toml")
    url = f"http://127.0.0.1:{url_port}"
    work, db = config.work_dir, config.work_dir / "coordinator.db"
    args = ["coordinator", "serve", "--config", str(toml)]
    (key,) = _keys(tmp_path, "node")
    node = SwarmHost(key, BlobStore(tmp_path / "node-blobs"), topic=config.topic)
    node.start()
    first = spawn("coordinator", args, tmp_path / "first.log")
    try:
        wait_http(url, first, timeout=120)
        info = httpx.get(f"{url}/v1/info", timeout=5).json()
        node.connect(info["multiaddrs"][0])
        node.wait_for_peers_in_topic(1, timeout=30)
        base = dict(iter_base_tensors(tiny_base))
        ids = []
        for seed in (1, 2):
            body = signed_announcement(
                base,
                noisy(base, seed),
                node.blob_store,
                key,
                base_id=info["base_id"],
                round_number=info["round"],
            )
            for sha in DeltaManifest.decode(body.manifest_bytes).blobs:
                node.serve_blob(sha)
            ids.append(body.signed.manifest_id)
            node.publish(encode_message(body))
        _wait(lambda: _round_status(db, 1) == "merging", "the merge to start", timeout=120)
        first.popen.send_signal(signal.SIGKILL)
        assert first.popen.wait(timeout=30) == -signal.SIGKILL
    finally:
        if first.popen.poll() is None:
            first.popen.kill()
        node.stop()
    assert _round_status(db, 1) == "merging"
    with sqlite3.connect(db, timeout=10) as conn:  # the accepted deltas and their blobs are kept
        kept = conn.execute("SELECT id, status, manifest FROM deltas ORDER BY id").fetchall()
    assert [(i, status) for i, status, _ in kept] == [(i, "accepted") for i in sorted(ids)]
    blobs = BlobStore(work / "blobs")
    assert all(blobs.has(sha) for *_, raw in kept for sha in DeltaManifest.decode(raw).blobs)

    second = spawn("coordinator", args, tmp_path / "second.log")
    try:
        wait_http(url, second, timeout=120)

        def round_one_finished() -> dict | None:
            (round_one, *_) = httpx.get(f"{url}/v1/rounds", timeout=5).json()
            return round_one if round_one["status"] in ("published", "failed") else None

        round_one = _wait(round_one_finished, "round 1 to finish after the restart", 180)
        assert round_one["status"] == "published", round_one["error"]
        assert sorted(round_one["inputs"]) == sorted(ids)
        checkpoints = httpx.get(f"{url}/v1/checkpoints", timeout=5).json()
        assert [c["round"] for c in checkpoints] == [0, 1]
        assert checkpoints[1]["id"] == round_one["checkpoint_id"]
        deltas = httpx.get(f"{url}/v1/deltas", timeout=5).json()
        assert sorted((d["id"], d["status"]) for d in deltas) == sorted((i, "merged") for i in ids)
    finally:
        second.popen.send_signal(signal.SIGTERM)
        second.popen.wait(timeout=60)
    registry = Registry(work / "registry", repo_id=config.repo_id)
    for checkpoint in registry.list():  # every listed checkpoint is complete on disk
        verify_folder(registry.checkpoint_dir(checkpoint), registry.manifest(checkpoint))
    # The outer optimizer's momentum belongs to the published checkpoint: with no momentum
    # before, m = g (the merged delta) and the Nesterov step published base + lr (g + μ m).
    momentum = load_state(work / "outer", round_one["checkpoint_id"], config.outer)
    assert momentum is not None
    published = dict(iter_base_tensors(registry.checkpoint_dir(registry.get("main"))))
    for name, tensor in base.items():
        if tensor.is_floating_point():
            step = published[name].float() - tensor.float()
            torch.testing.assert_close(step, 1.5 * momentum[name], rtol=1e-4, atol=1e-6)
    assert not list(work.glob("merge-*"))
    assert not list((work / "registry" / "incoming").iterdir())
