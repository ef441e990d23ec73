"""A bad-input corpus against a running coordinator's libp2p side: malformed, truncated and
unknown gossip, integers past storage, a flood, forged and oversized delta declarations, a delta
whose bytes do not match its manifest, and raw blob streams asking for unknown or path-like ids or
never sending anything. Each is refused with its reason recorded against the sending peer;
nothing is stored or merged; the intake thread lives on and an honest delta is accepted after."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import multiaddr
import pytest
import torch
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from skillswarm.coordinator.config import CoordinatorConfig, EvalConfig, RoundPolicy
from skillswarm.coordinator.intake import record_id
from skillswarm.coordinator.service import Coordinator
from skillswarm.coordinator.store import DeltaRecord, GossipRefusalRecord
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.protocol import blobwire, identity
from skillswarm.protocol.api import DeltaStatus
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import pack_delta
from skillswarm.protocol.host import BLOB_PROTOCOL_ID, SwarmHost
from skillswarm.protocol.identity import load_or_create_identity, peer_id_of, public_key_bytes
from skillswarm.protocol.manifest import SignedManifest, sign_manifest
from skillswarm.protocol.messages import DeltaAnnounced, encode_message
from test_host_interop import stock_peer

pytestmark = pytest.mark.timeout(600)

MALFORMED_GOSSIP = {
    "wrong-type body field": msgpack.packb({"v": 1, "body": {"type": ["delta_announced"]}}),
    "string field as a list": msgpack.packb(
        {"v": 1, "body": {"type": "node_heartbeat", "domain": ["m"], "round": 1, "step": 1}}
    ),
    "deep nesting": b"\x82\xa1v\x01\xa4body" + b"\x91" * 5000 + b"\xc0",
    "truncated": msgpack.packb({"v": 1, "body": {"type": "node_heartbeat"}})[:-3],
    "not msgpack": b"\xc1\xc1\xc1",
    "integer past storage": msgpack.packb(
        {"v": 1, "body": {"type": "node_heartbeat", "domain": "m", "round": 1 << 63, "step": 1}}
    ),
    "version as text": msgpack.packb({"v": "1", "body": {"type": "node_heartbeat"}}),
}
UNKNOWN_GOSSIP = msgpack.packb({"v": 1, "body": {"type": "please_merge_me"}})


@pytest.fixture
def coordinator(tmp_path: Path, tiny_base: Path):
    config = CoordinatorConfig(
        work_dir=tmp_path / "coord",
        p2p_port=0,
        base_checkpoint=tiny_base,
        eval=EvalConfig(n_tasks=2),
        round=RoundPolicy(min_deltas=5),  # nothing merges during these tests
        max_blob_bytes=64 << 20,
    )
    c = Coordinator(config)
    c.start()
    yield c
    c.stop()


def _peer(tmp_path: Path, name: str, c: Coordinator) -> tuple[object, BlobStore, SwarmHost]:
    key = load_or_create_identity(tmp_path / f"{name}.key")
    store = BlobStore(tmp_path / f"{name}-blobs")
    host = SwarmHost(key, store, topic=c.config.topic)
    host.start()
    host.connect(c.host.listen_addrs[0])
    host.wait_for_peers_in_topic(1, timeout=30)
    return key, store, host


def _signed_delta(key, store: BlobStore, c: Coordinator, seed: int = 1):
    base = c.current_base()
    tensors = dict(iter_base_tensors(c.registry.checkpoint_dir(base)))
    generator = torch.Generator().manual_seed(seed)
    tuned = {n: t + 1e-3 * torch.randn(t.shape, generator=generator) for n, t in tensors.items()}
    manifest = pack_delta(
        tensors, tuned, store, peer_id=peer_id_of(key), public_key=public_key_bytes(key),
        domain="math", base_id=base.id, round=c.current_round().number, steps=1,
    )  # fmt: skip
    return sign_manifest(manifest, key)


def _announce(host: SwarmHost, signed) -> None:
    host.publish(
        encode_message(
            DeltaAnnounced(manifest_bytes=signed.manifest_bytes, signature=signed.signature)
        )
    )


def _wait(condition, what: str, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _record(c: Coordinator, signed: SignedManifest, from_peer: str) -> DeltaRecord | None:
    with c.store.session() as s:
        record = s.get(DeltaRecord, record_id(signed, from_peer))
        if record is not None:
            s.expunge(record)
        return record


def _refusals(c: Coordinator, peer_id: str) -> dict[str, GossipRefusalRecord]:
    with c.store.session() as s:
        rows = s.query(GossipRefusalRecord).filter_by(peer_id=peer_id).all()
        s.expunge_all()
        return {row.kind: row for row in rows}


def _honest_delta_is_accepted(tmp_path: Path, c: Coordinator, seed: int) -> None:
    key, store, host = _peer(tmp_path, f"honest-{seed}", c)
    try:
        signed = _signed_delta(key, store, c, seed)
        for sha in signed.verify().blobs:
            host.serve_blob(sha)
        _announce(host, signed)
        record = _wait(lambda: _record(c, signed, host.peer_id), "the honest delta")
        assert record.status == DeltaStatus.ACCEPTED, record.reason
    finally:
        host.stop()
    assert c.worker_liveness() == {name: True for name in c.worker_liveness()}


def test_malformed_gossip_is_refused_and_recorded_and_intake_goes_on(
    tmp_path: Path, coordinator: Coordinator
) -> None:
    c = coordinator
    _, _, mallory = _peer(tmp_path, "mallory", c)
    try:
        for payload in MALFORMED_GOSSIP.values():
            mallory.publish(payload)
        mallory.publish(UNKNOWN_GOSSIP)
        refusals = _wait(
            lambda: (
                (r := _refusals(c, mallory.peer_id))
                and r.get("malformed") is not None
                and r["malformed"].count >= len(MALFORMED_GOSSIP)
                and "unknown" in r
                and r
            ),
            "mallory's refusals",
        )
        assert refusals["malformed"].count == len(MALFORMED_GOSSIP)
        assert refusals["unknown"].count == 1
        assert "please_merge_me" in refusals["unknown"].last_reason
        with c.store.session() as s:
            assert s.query(DeltaRecord).count() == 0  # nothing stored
    finally:
        mallory.stop()
    _honest_delta_is_accepted(tmp_path, c, seed=1)


def _resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


# The flooding peer runs in a process of its own, so the resident size the test samples is the
# coordinator's alone (libp2p keeps a sender's recent messages for a while too).
FLOODER = """
import sys
from pathlib import Path
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.host import SwarmHost
from skillswarm.protocol.identity import load_or_create_identity
work, topic, address, count = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
payload = (work / "payload").read_bytes()
key = load_or_create_identity(work / "flood.key")
host = SwarmHost(key, BlobStore(work / "blobs"), topic=topic)
host.start()
try:
    host.connect(address)
    host.wait_for_peers_in_topic(1, timeout=30)
    print("connected", flush=True)
    for _ in range(count):
        host.publish(payload)
    print("sent", flush=True)
    sys.stdin.read()  # connected until the test closes stdin
finally:
    host.stop()
"""


def test_a_gossip_flood_is_bounded_in_memory(tmp_path: Path, coordinator: Coordinator) -> None:
    """A peer in another process offers ~400 MiB of malformed gossip in a few seconds; the
    coordinator (this process) holds only a bounded part of it in memory."""
    c = coordinator
    work = tmp_path / "flood"
    work.mkdir()
    (work / "payload").write_bytes(MALFORMED_GOSSIP["deep nesting"] + b"\x00" * (200 << 10))
    flooder_id = peer_id_of(load_or_create_identity(work / "flood.key"))
    start = _resident_mib()
    peak = [start]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.05):
            peak[0] = max(peak[0], _resident_mib())

    sampler = threading.Thread(target=sample, name="rss-sampler")
    sampler.start()
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER, str(work), c.config.topic, c.host.listen_addrs[0], "2000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flooder.stdout is not None
        assert flooder.stdout.readline().strip() == "connected"
        assert flooder.stdout.readline().strip() == "sent"
        _wait(
            lambda: (row := _refusals(c, flooder_id).get("malformed")) and row.count >= 50,
            "the flood to reach intake",
        )
        time.sleep(2)
        refused = _refusals(c, flooder_id)["malformed"]
    finally:
        sampling.set()
        sampler.join()
        try:
            flooder.communicate(timeout=60)
        finally:
            flooder.kill()  # a no-op once it has exited; a hung flooder does not outlive the test
    assert flooder.returncode == 0
    growth = peak[0] - start
    print(f"flood: {refused.count} messages refused, peak resident growth {growth:.0f} MiB")
    assert growth < 256  # gossip waiting to be read is bounded at 64 MiB
    _honest_delta_is_accepted(tmp_path, c, seed=2)


def test_bad_delta_declarations_are_refused_with_nothing_stored(
    tmp_path: Path, coordinator: Coordinator
) -> None:
    c = coordinator
    key, store, mallory = _peer(tmp_path, "declarer", c)
    try:
        # Oversized: validly signed, listing a blob beyond max_blob_bytes; refused unfetched.
        signed = _signed_delta(key, store, c, seed=3)
        data = msgpack.unpackb(signed.manifest_bytes, raw=False)
        sha = next(iter(data["blobs"]))
        data["blobs"][sha] = c.config.max_blob_bytes + 1
        raw = msgpack.packb(data, use_bin_type=True)
        oversized = SignedManifest(manifest_bytes=raw, signature=identity.sign(key, raw))
        _announce(mallory, oversized)
        record = _wait(lambda: _record(c, oversized, mallory.peer_id), "the oversized delta")
        assert record.status == DeltaStatus.REJECTED
        # Wrong bytes behind a valid manifest: the blob served is not the one it names.
        honest = _signed_delta(key, store, c, seed=4)
        for sha in honest.verify().blobs:
            path = store.path(sha)
            size = path.stat().st_size
            path.unlink()
            path.write_bytes(b"\x00" * size)  # same size, other bytes
            mallory.serve_blob(sha)
        _announce(mallory, honest)
        record = _wait(lambda: _record(c, honest, mallory.peer_id), "the corrupt delta")
        assert record.status == DeltaStatus.REJECTED
        assert not any(c.blobs.has(sha) for sha in honest.verify().blobs)
        with c.store.session() as s:
            assert s.query(DeltaRecord).filter_by(status=DeltaStatus.ACCEPTED).count() == 0
    finally:
        mallory.stop()


def test_raw_blob_streams_for_unknown_or_path_like_ids_are_refused(
    tmp_path: Path, coordinator: Coordinator
) -> None:
    c = coordinator
    requests = [
        blobwire.request_frame("ab" * 32, 0, 10),  # unknown blob
        blobwire.frame(msgpack.packb({"sha256": "../../coordinator.db", "offset": 0, "length": 9})),
        blobwire.frame(msgpack.packb({"sha256": "/etc/passwd", "offset": 0, "length": 9})),
        blobwire.frame(msgpack.packb({"sha256": "ab" * 32, "offset": -1, "length": 1 << 62})),
        blobwire.frame(msgpack.packb([1, 2, 3])),
        b"\xff\xff\xff\xff" + b"x" * 100,  # declares a 4 GiB request
    ]
    answers: list[object] = []

    async def exercise() -> None:
        async with stock_peer() as peer:
            await peer.connect(info_from_p2p_addr(multiaddr.Multiaddr(c.host.listen_addrs[0])))
            coordinator_id = ID.from_base58(c.host.peer_id)
            idle = [
                await peer.new_stream(coordinator_id, [TProtocol(BLOB_PROTOCOL_ID)])
                for _ in range(3)
            ]  # opened and never written to
            for request in requests:
                with trio.fail_after(30):
                    stream = await peer.new_stream(coordinator_id, [TProtocol(BLOB_PROTOCOL_ID)])
                    await stream.write(request)
                    try:
                        header = blobwire.parse_header(
                            await blobwire.read_frame(
                                stream, blobwire.MAX_BLOB_RESPONSE_HEADER_BYTES
                            )
                        )
                        answers.append(header)
                    except Exception as error:  # the server may close instead of answering
                        answers.append(error)
                    await stream.reset()
            for stream in idle:
                await stream.reset()

    trio.run(exercise)
    assert len(answers) == len(requests)
    for answer in answers:
        assert not isinstance(answer, blobwire.BlobHeader) or not answer.ok, answer
    assert not [path for path in (c.config.work_dir / "blobs").rglob("*") if path.is_file()]
    _honest_delta_is_accepted(tmp_path, c, seed=5)


def test_a_failing_intake_pass_is_gone_past_and_a_dead_worker_turns_health_503(
    tmp_path: Path, coordinator: Coordinator
) -> None:
    from fastapi.testclient import TestClient
    from skillswarm.coordinator.app import create_app

    c = coordinator
    health = TestClient(create_app(c))
    assert health.get("/healthz").json() == {
        "ok": True,
        "workers": {"intake": True, "libp2p-host": True},
    }
    _, _, peer = _peer(tmp_path, "trigger", c)
    handle = c.intake.handle_gossip
    try:
        c.intake.handle_gossip = lambda *_: 1 / 0  # an error no message should cause
        peer.publish(UNKNOWN_GOSSIP)
        _wait(lambda: c.intake_errors >= 1, "the failed pass")
        assert health.get("/healthz").status_code == 200  # the loop went on

        def die(*_: object) -> None:
            raise SystemExit("intake killed")

        c.intake.handle_gossip = die
        peer.publish(UNKNOWN_GOSSIP + b"\x00")
        _wait(lambda: not c.worker_liveness()["intake"], "the intake thread to end")
        answer = health.get("/healthz")
        assert answer.status_code == 503
        assert answer.json() == {"ok": False, "workers": {"intake": False, "libp2p-host": True}}
    finally:
        c.intake.handle_gossip = handle
        peer.stop()
