"""Delta intake over real libp2p hosts: forged or misattributed deltas are refused and recorded,
nothing of them is fetched or merged; an honest delta is fetched, checked and accepted."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgpack
import pytest
import torch
from skillswarm.coordinator.config import CoordinatorConfig, EvalConfig, RoundPolicy
from skillswarm.coordinator.intake import record_id
from skillswarm.coordinator.service import Coordinator
from skillswarm.coordinator.store import DeltaRecord, GossipRefusalRecord, NodeRecord
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import pack_delta
from skillswarm.protocol.host import SwarmHost
from skillswarm.protocol.identity import load_or_create_identity, peer_id_of, public_key_bytes
from skillswarm.protocol.manifest import SignedManifest, sign_manifest
from skillswarm.protocol.messages import DeltaAnnounced, NodeHeartbeat, encode_message


def _config(tmp_path: Path, tiny_base: Path, **fields) -> CoordinatorConfig:
    """A loopback coordinator on the shared base, with a cheap evaluation; `fields` override."""
    defaults = {
        "work_dir": tmp_path / "coord",
        "p2p_port": 0,
        "base_checkpoint": tiny_base,
        "eval": EvalConfig(n_tasks=2),
    }
    return CoordinatorConfig(**(defaults | fields))


@pytest.fixture
def coordinator(tmp_path: Path, tiny_base: Path):
    c = Coordinator(_config(tmp_path, tiny_base, round=RoundPolicy(min_deltas=2)))
    c.start()
    yield c
    c.stop()


def _peer(tmp_path: Path, name: str, topic: str):
    key = load_or_create_identity(tmp_path / f"{name}.key")
    store = BlobStore(tmp_path / f"{name}-blobs")
    host = SwarmHost(key, store, topic=topic)
    host.start()
    return key, store, host


def _join(host: SwarmHost, c: Coordinator) -> None:
    """Dial the coordinator and wait until both sit in the gossip mesh."""
    host.connect(c.host.listen_addrs[0])
    host.wait_for_peers_in_topic(1, timeout=30)


def _delta_for(key, store: BlobStore, base_dir: Path, base_id: str, scale: float = 1e-3):
    base = dict(iter_base_tensors(base_dir))
    gen = torch.Generator().manual_seed(1)
    tuned = {n: t + scale * torch.randn(t.shape, generator=gen) for n, t in base.items()}
    return pack_delta(
        base,
        tuned,
        store,
        peer_id=peer_id_of(key),
        public_key=public_key_bytes(key),
        domain="math",
        base_id=base_id,
        round=1,
        steps=1,
    )


def _announce(host: SwarmHost, signed: SignedManifest) -> None:
    host.publish(
        encode_message(
            DeltaAnnounced(manifest_bytes=signed.manifest_bytes, signature=signed.signature)
        )
    )


def _wait_record(c: Coordinator, delta_id: str, timeout: float = 60) -> DeltaRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with c.store.session() as s:
            record = s.get(DeltaRecord, delta_id)
            if record is not None:
                return record
        time.sleep(0.2)
    raise AssertionError(f"coordinator never recorded delta {delta_id[:12]}")


def _wait_log(caplog, text: str, timeout: float = 30) -> None:
    """Wait until a log line (from any thread) contains `text`."""
    deadline = time.monotonic() + timeout
    while text not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.1)
    assert text in caplog.text, f"no log line with {text!r}"


def test_forged_and_misattributed_deltas_refused_honest_one_accepted(tmp_path, coordinator, caplog):
    c = coordinator
    caplog.set_level(logging.INFO, logger="skillswarm.coordinator.intake")
    base = c.current_base()
    base_dir = c.registry.checkpoint_dir(base)
    alice_key, alice_store, alice = _peer(tmp_path, "alice", c.config.topic)
    mallory_key, mallory_store, mallory = _peer(tmp_path, "mallory", c.config.topic)
    try:
        for host in (alice, mallory):
            _join(host, c)

        # 1. Mallory relays Alice's validly signed delta as her own announcement.
        alice_manifest = _delta_for(alice_key, alice_store, base_dir, base.id)
        relayed = sign_manifest(alice_manifest, alice_key)
        for sha in alice_manifest.blobs:
            mallory_store.put_bytes(alice_store.path(sha).read_bytes())
            mallory.serve_blob(sha)
        _announce(mallory, relayed)
        record = _wait_record(c, record_id(relayed, mallory.peer_id))
        assert record.status == "rejected"
        assert record.announced_by == mallory.peer_id
        assert "announced by" in (record.reason or "")

        # 2. Mallory signs with her key a manifest that claims to be Alice's.
        claims_alice = _delta_for(alice_key, mallory_store, base_dir, base.id, 2e-3)
        forged = SignedManifest(
            manifest_bytes=claims_alice.encode(),
            signature=sign_manifest(
                _delta_for(mallory_key, mallory_store, base_dir, base.id), mallory_key
            ).signature,
        )
        _announce(mallory, forged)
        record = _wait_record(c, record_id(forged, mallory.peer_id))
        assert record.status == "rejected"
        assert "bad signature" in (record.reason or "")
        # Filed under the peer that announced it, none of the forged manifest's claims kept.
        assert (record.peer_id, record.domain, record.round) == (mallory.peer_id, None, None)

        # An unknown message type and a malformed delta announcement: logged, nothing recorded.
        mallory.publish(msgpack.packb({"v": 1, "body": {"type": "please_merge_me"}}))
        mallory.publish(msgpack.packb({"v": 1, "body": {"type": "delta_announced"}}))
        _wait_log(caplog, f"ignored gossip from {mallory.peer_id}: unknown gossip message type")
        _wait_log(caplog, f"refused gossip from {mallory.peer_id}: invalid delta_announced")
        with c.store.session() as s:
            assert s.query(DeltaRecord).count() == 2

        # Nothing of the refused deltas was fetched, nothing recorded as accepted.
        for sha in [*alice_manifest.blobs, *claims_alice.blobs]:
            assert not c.blobs.has(sha)
        with c.store.session() as s:
            assert s.get(DeltaRecord, relayed.manifest_id) is None

        # 3. Alice announces the same delta herself: fetched, sha256 checked, validated, accepted.
        for sha in alice_manifest.blobs:
            alice.serve_blob(sha)
        _announce(alice, relayed)
        record = _wait_record(c, relayed.manifest_id)
        assert record.status == "accepted", record.reason
        assert record.peer_id == peer_id_of(alice_key)
        for sha in alice_manifest.blobs:
            assert c.blobs.has(sha)
        assert c.current_round().status == "open"  # one delta, the policy needs two
        assert [i.round for i in c.registry.list()] == [0]  # nothing merged
    finally:
        alice.stop()
        mallory.stop()


def test_delta_against_wrong_base_or_with_nan_refused(tmp_path, coordinator):
    c = coordinator
    base = c.current_base()
    base_dir = c.registry.checkpoint_dir(base)
    key, store, peer = _peer(tmp_path, "bob", c.config.topic)
    try:
        _join(peer, c)
        stale = sign_manifest(_delta_for(key, store, base_dir, "00" * 32), key)
        _announce(peer, stale)
        record = _wait_record(c, stale.manifest_id)
        assert record.status == "rejected" and "not the current base" in record.reason

        tensors = dict(iter_base_tensors(base_dir))
        poisoned = {n: t.clone() for n, t in tensors.items()}
        first = next(iter(poisoned))
        poisoned[first].view(-1)[0] = float("nan")
        manifest = pack_delta(
            tensors,
            poisoned,
            store,
            peer_id=peer_id_of(key),
            public_key=public_key_bytes(key),
            domain="math",
            base_id=base.id,
            round=1,
            steps=1,
        )
        for sha in manifest.blobs:
            peer.serve_blob(sha)
        signed = sign_manifest(manifest, key)
        _announce(peer, signed)
        record = _wait_record(c, signed.manifest_id)
        assert record.status == "rejected" and "NaN" in record.reason
        # Fetched to be checked, then refused: nothing of it is kept.
        assert peer.bytes_served == sum(manifest.blobs.values())
        assert not any(c.blobs.has(sha) for sha in manifest.blobs)
        assert not any(c.blobs.partial_path(sha).exists() for sha in manifest.blobs)

        # A validly signed manifest that lists its blob as larger than its tensors: refused
        # before anything is fetched (a peer could otherwise make the coordinator download
        # bytes no tensor needs, or sizes its limits do not see).
        padded = _delta_for(key, store, base_dir, base.id, 3e-3)
        sha, size = next(iter(padded.blobs.items()))
        inflated = sign_manifest(padded.model_copy(update={"blobs": {sha: size + 1}}), key)
        served_before = peer.bytes_served
        peer.serve_blob(sha)
        _announce(peer, inflated)
        record = _wait_record(c, inflated.manifest_id)
        assert (record.status, record.rejection_kind) == ("rejected", "signature")
        assert f"listed as {size + 1} bytes but its contents take {size}" in record.reason
        assert peer.bytes_served == served_before and not c.blobs.has(sha)
    finally:
        peer.stop()


def test_a_delta_whose_blobs_could_not_be_fetched_is_taken_again_when_reannounced(
    tmp_path, coordinator, caplog
):
    c = coordinator
    caplog.set_level(logging.INFO, logger="skillswarm.coordinator.intake")
    base = c.current_base()
    key, store, peer = _peer(tmp_path, "dave", c.config.topic)
    try:
        _join(peer, c)
        manifest = _delta_for(key, store, c.registry.checkpoint_dir(base), base.id)
        signed = sign_manifest(manifest, key)
        # Announced before its blobs are served: every attempt is refused by the holder.
        _announce(peer, signed)
        record = _wait_record(c, signed.manifest_id)
        assert (record.status, record.rejection_kind) == ("rejected", "fetch")
        assert "attempt 3" in (record.reason or "")  # retried before giving up
        assert not any(c.blobs.has(sha) for sha in manifest.blobs)

        # The node serves them now and announces again at once: within the cooldown, so the
        # coordinator does not fetch again yet.
        for sha in manifest.blobs:
            peer.serve_blob(sha)
        _announce(peer, signed)
        deadline = time.monotonic() + 30
        while "its fetch failed under" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "its fetch failed under" in caplog.text
        assert _wait_record(c, signed.manifest_id).rejection_kind == "fetch"
        assert not any(c.blobs.has(sha) for sha in manifest.blobs)

        # Once the cooldown has passed, an announcement is fetched, checked and accepted.
        c.intake.fetch_retry_cooldown_s = 0.0
        _announce(peer, signed)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            record = _wait_record(c, signed.manifest_id)
            if record.status != "rejected":
                break
            time.sleep(0.2)
        assert record.status == "accepted", record.reason
        assert all(c.blobs.has(sha) for sha in manifest.blobs)
        with c.store.session() as s:
            assert s.query(DeltaRecord).count() == 1

        # Any other verdict is final: a further announcement changes nothing.
        _announce(peer, signed)
        time.sleep(1)
        assert _wait_record(c, signed.manifest_id).status == "accepted"
    finally:
        peer.stop()


def test_replayed_manifest_from_an_earlier_round_is_refused(tmp_path, tiny_base):
    c = Coordinator(_config(tmp_path, tiny_base, round=RoundPolicy(min_deltas=1)))
    c.start()
    key, store, peer = _peer(tmp_path, "carol", c.config.topic)
    try:
        _join(peer, c)
        base = c.current_base()
        manifest = _delta_for(key, store, c.registry.checkpoint_dir(base), base.id)
        for sha in manifest.blobs:
            peer.serve_blob(sha)
        signed = sign_manifest(manifest, key)
        _announce(peer, signed)
        assert _wait_record(c, signed.manifest_id).status in ("accepted", "merged")
        deadline = time.monotonic() + 60
        while c.current_round().number != 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.current_round().number == 2  # round 1 merged and published
        with c.store.session() as s:
            assert s.get(DeltaRecord, signed.manifest_id).status == "merged"

        # The same signed manifest announced again in round 2: nothing new is recorded or merged.
        _announce(peer, signed)
        # A fresh manifest of the same node still naming round 1 and the old base: refused.
        stale = sign_manifest(
            _delta_for(key, store, c.registry.checkpoint_dir(base), base.id, 5e-3), key
        )
        _announce(peer, stale)
        record = _wait_record(c, stale.manifest_id)
        assert record.status == "rejected"
        assert "not the current base" in record.reason
        with c.store.session() as s:
            rows = s.query(DeltaRecord).all()
            assert sorted(r.status for r in rows) == ["merged", "rejected"]
        assert [i.round for i in c.registry.list()] == [0, 1]
        assert c.current_round().status == "open"
    finally:
        peer.stop()
        c.stop()


def test_garbage_collection_keeps_recent_rounds(tmp_path, tiny_base):
    c = Coordinator(_config(tmp_path, tiny_base, keep_rounds=1))
    c.prepare()
    try:
        key = load_or_create_identity(tmp_path / "k.key")
        base = c.current_base()
        manifest = _delta_for(key, c.blobs, c.registry.checkpoint_dir(base), base.id)
        signed = sign_manifest(manifest, key)
        orphan = c.blobs.put_bytes(b"a blob no delta refers to")
        with c.store.session() as s:
            s.add(
                DeltaRecord(
                    id=signed.manifest_id,
                    peer_id=manifest.peer_id,
                    announced_by=manifest.peer_id,
                    domain="math",
                    base_id=base.id,
                    round=1,
                    steps=1,
                    status="merged",
                    metrics={},
                    manifest=signed.manifest_bytes,
                )
            )
        assert c.collect_garbage() == 1  # round 1 is within keep_rounds of round 1
        assert not c.blobs.has(orphan)
        assert all(c.blobs.has(sha) for sha in manifest.blobs)
        with c.store.session() as s:
            s.get(DeltaRecord, signed.manifest_id).round = -5
        assert c.collect_garbage() == 1
        assert not any(c.blobs.has(sha) for sha in manifest.blobs)
    finally:
        c.store.close()


def test_peer_not_on_the_allow_list_is_refused_before_fetching(tmp_path, tiny_base, caplog):
    c = Coordinator(
        _config(
            tmp_path, tiny_base, allowed_peers=["12D3KooWNotTheSenderAtAllxxxxxxxxxxxxxxxxxxxxxxxx"]
        )
    )
    c.start()
    key, store, peer = _peer(tmp_path, "dave", c.config.topic)
    try:
        _join(peer, c)
        base = c.current_base()
        manifest = _delta_for(key, store, c.registry.checkpoint_dir(base), base.id)
        for sha in manifest.blobs:
            peer.serve_blob(sha)
        signed = sign_manifest(manifest, key)
        caplog.set_level(logging.DEBUG, logger="skillswarm.coordinator.intake")
        peer.publish(encode_message(NodeHeartbeat(domain="math", round=1, step=3, reward=0.5)))
        _announce(peer, signed)
        # Both are turned away before a byte of them is decoded, and counted.
        deadline = time.monotonic() + 30
        while c.intake.refused_by_access < 2:
            assert time.monotonic() < deadline, "the gossip was never refused"
            time.sleep(0.1)
        _wait_log(caplog, f"ignored gossip: peer {peer.peer_id} is not on the allow-list")
        assert c.metrics()["gossip_refused_access_total"] == 2
        assert peer.bytes_served == 0
        assert not any(c.blobs.has(sha) for sha in manifest.blobs)
        # Nothing of it is recorded: a peer outside the allow-list cannot grow the coordinator's
        # tables.
        with c.store.session() as s:
            assert s.get(NodeRecord, peer.peer_id) is None
            assert s.get(DeltaRecord, signed.manifest_id) is None
            assert s.query(GossipRefusalRecord).count() == 0
    finally:
        peer.stop()
        c.stop()
