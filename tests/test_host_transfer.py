"""Blob transfers that break and recover, between real SwarmHosts on 127.0.0.1.

The blob of a ~100 MB weight delta, packed by protocol.delta, is cut mid-transfer and resumed at
the same holder and at another one; corrupted bytes (in a holder's store or in a partial
download) are detected and fetched again; and each time the receiver rebuilds every tensor from
it bit-identical to the sender's. A dropped connection is redialled by keep_connected once the
remote host is back on the same port.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import random
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import multiaddr
import pytest
import torch
import trio
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import DeltaReader, pack_delta
from skillswarm.protocol.host import (
    BLOB_CHUNK_BYTES,
    BLOB_PROTOCOL_ID,
    BLOB_SEND_BUFFERS,
    BLOB_WRITE_BUFFERS,
    MAX_BLOB_RESPONSE_HEADER_BYTES,
    NOISE_MAX_PLAINTEXT_BYTES,
    AllHoldersFailed,
    BlobFetchError,
    HostNotRunning,
    PeerConnectError,
    SwarmHost,
    _BatchedNoiseSession,
    _BatchedYamuxStream,
    _CancelSafeRawConnection,
    _frame,
    _PartialWriter,
    _read_frame,
    _read_into,
    _StreamBuffer,
)
from skillswarm.protocol.identity import load_or_create_identity, peer_id_of, public_key_bytes
from skillswarm.protocol.manifest import DeltaManifest

# The module's ~100 MB delta is packed in the first test's setup (~20 s), which counts too.
pytestmark = pytest.mark.timeout(240)

TOPIC = "skillswarm-transfer-test"
# The delta's weights, in bf16. A fine-tune moved every element of these by as much as its own
# size, so the XOR of old and new bits deflates little (to ~1.44 of its 2 bytes an element): the
# delta's blob is ~103 MB.
MOVED_SHAPES = {
    "layers.0.attn.out": (2048, 4096),
    "layers.0.attn.qkv": (4096, 4096),
    "layers.0.mlp.down": (4096, 5632),
    "layers.0.mlp.up": (5632, 4096),
}
# One row in EDITED_ROW_STRIDE of this one moved (a few tokens' rows), and this one did not move.
EDITED = "lm_head"
EDITED_SHAPE = (1024, 4096)
EDITED_ROW_STRIDE = 64
UNCHANGED = "norm"
UNCHANGED_SHAPE = (4096,)
DELTA_SEED = 7
CORRUPTED_SPAN_BYTES = 1 << 20
DELIVERY_TIMEOUT_S = 30
MESH_TIMEOUT_S = 45
TRANSFER_TIMEOUT_S = 60
RECONNECT_TIMEOUT_S = 60
POLL_INTERVAL_S = 0.005

_T = TypeVar("_T")


@dataclass(frozen=True)
class Blob:
    sha256: str
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Delta:
    """A delta packed by protocol.delta, the weights it was packed from, and its one blob."""

    base: dict[str, torch.Tensor]
    tuned: dict[str, torch.Tensor]
    manifest: DeltaManifest
    blob: Blob


@pytest.fixture(scope="module")
def delta(tmp_path_factory: pytest.TempPathFactory) -> Delta:
    """Seeded bf16 weights and a tuning of them, packed once for the module (packing ~100 MB
    takes ~20 s on one torch thread); the trainer's store is dropped once its blob is read."""
    generator = torch.Generator().manual_seed(DELTA_SEED)
    base, tuned = {}, {}
    for name, shape in MOVED_SHAPES.items():
        base[name] = torch.randn(shape, generator=generator).to(torch.bfloat16)
        tuned[name] = torch.randn(shape, generator=generator).add_(base[name]).to(torch.bfloat16)
    base[EDITED] = torch.randn(EDITED_SHAPE, generator=generator).to(torch.bfloat16)
    tuned[EDITED] = base[EDITED].clone()
    edited_rows = tuned[EDITED][::EDITED_ROW_STRIDE]
    edited_rows += torch.randn(edited_rows.shape, generator=generator).to(torch.bfloat16)
    base[UNCHANGED] = torch.ones(UNCHANGED_SHAPE, dtype=torch.bfloat16)
    tuned[UNCHANGED] = base[UNCHANGED].clone()

    root = tmp_path_factory.mktemp("trainer")
    key_pair = load_or_create_identity(root / "trainer.key")
    store = BlobStore(root / "blobs")
    manifest = pack_delta(
        base,
        tuned,
        store,
        peer_id=peer_id_of(key_pair),
        public_key=public_key_bytes(key_pair),
        domain="math",
        base_id="ab" * 32,
        round=1,
        steps=1,
    )
    ((sha256, size),) = manifest.blobs.items()
    blob = Blob(sha256, store.path(sha256).read_bytes())
    shutil.rmtree(root)
    assert blob.size == size
    assert sorted(manifest.tensors) == sorted([*MOVED_SHAPES, EDITED])  # UNCHANGED is left out
    return Delta(base, tuned, manifest, blob)


@pytest.fixture
def background() -> Iterator[Callable[[Callable[[], _T]], Future[_T]]]:
    """Runs a blocking call (a fetch) in a worker thread, so the test can cut it meanwhile."""
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield lambda call: executor.submit(call)


def make_host(root: Path, name: str, **options: Any) -> SwarmHost:
    """A host whose key and blob store live under `root/name…`: the same name is the same peer."""
    key_pair = load_or_create_identity(root / f"{name}.key")
    return SwarmHost(key_pair, BlobStore(root / f"{name}-blobs"), TOPIC, **options)


def holder_of(blob: Blob, host: SwarmHost, stored_bytes: bytes | None = None) -> None:
    """Put the blob in the host's store (optionally with other bytes under its id) and serve it."""
    if stored_bytes is None:
        assert host.blob_store.put_bytes(blob.data) == blob.sha256
    else:
        path = host.blob_store.path(blob.sha256)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(stored_bytes)
    host.serve_blob(blob.sha256)


def with_corrupted_span(data: bytes, at: int) -> bytes:
    """`data` with CORRUPTED_SPAN_BYTES of it, starting at `at`, inverted."""
    span = bytes(byte ^ 0xFF for byte in data[at : at + CORRUPTED_SPAN_BYTES])
    return data[:at] + span + data[at + len(span) :]


def cut_point(blob: Blob) -> int:
    """Where a transfer of `blob` is cut: near halfway, with room left for the stop to land
    before the last byte on a fast machine."""
    return blob.size * 2 // 5


def cut_when_served(server: SwarmHost, at_least: int, fetch: Future[Any], cut: SwarmHost) -> None:
    """Stop `cut` as soon as `server` has sent `at_least` bytes; the fetch must still be running."""
    while server.bytes_served < at_least and not fetch.done():
        time.sleep(POLL_INTERVAL_S)
    assert not fetch.done(), "the transfer finished before it could be cut"
    cut.stop()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as blob_file:
        while chunk := blob_file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def next_message(host: SwarmHost, data: bytes) -> str:
    """Wait for the gossip message `data` at `host` (skipping others); returns its origin."""
    deadline = time.monotonic() + DELIVERY_TIMEOUT_S
    while True:
        try:
            message = host.messages.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"{data!r} did not arrive at {host.peer_id}") from None
        if message.data == data:
            return message.from_peer


def assert_rebuilds_the_tuned_weights(delta: Delta, store: BlobStore) -> None:
    """Every tensor, rebuilt from the base and the delta's blob in `store`, is bit-identical to
    the tuned one it was packed from (a tensor the delta leaves out is the base's)."""
    reader = DeltaReader(delta.manifest, store)
    for name, base in delta.base.items():
        rebuilt = reader.expert(name, base)
        if rebuilt is None:
            rebuilt = base
        expected = delta.tuned[name].to(torch.bfloat16)
        assert torch.equal(rebuilt.view(torch.int16), expected.view(torch.int16)), name


def port_of(host: SwarmHost) -> int:
    return int(multiaddr.Multiaddr(host.listen_addrs[0]).value_for_protocol("tcp"))


# Resuming a cut transfer


def test_cut_transfer_resumes_from_its_offset_at_the_same_holder(
    tmp_path: Path, delta: Delta, background: Callable[[Callable[[], Path]], Future[Path]]
) -> None:
    """The fetching node goes down halfway through a delta; once back, it asks the holder only
    for the rest, and rebuilds the tuned weights from what it pieced together."""
    blob = delta.blob
    holder, client = make_host(tmp_path, "holder"), make_host(tmp_path, "client")
    with holder, client:
        holder_of(blob, holder)
        client.connect(holder.listen_addrs[0])
        fetch = background(lambda: client.fetch_blob(holder.peer_id, blob.sha256, blob.size))
        cut_when_served(holder, cut_point(blob), fetch, cut=client)
        with pytest.raises((BlobFetchError, HostNotRunning)):
            fetch.result(TRANSFER_TIMEOUT_S)

        with make_host(tmp_path, "client") as restarted:  # same key, same blob store
            _, kept = restarted.blob_store.open_partial(blob.sha256)
            assert 0 < kept < blob.size
            served_before = holder.bytes_served
            restarted.connect(holder.listen_addrs[0])

            path = restarted.fetch_blob(holder.peer_id, blob.sha256, blob.size)

            assert holder.bytes_served - served_before == blob.size - kept
            assert sha256_of(path) == blob.sha256
            assert not restarted.blob_store.partial_path(blob.sha256).exists()
            assert_rebuilds_the_tuned_weights(delta, restarted.blob_store)


def test_cut_transfer_resumes_at_the_next_holder(
    tmp_path: Path,
    delta: Delta,
    background: Callable[[Callable[[], Path]], Future[Path]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first holder of a delta goes away mid-transfer: the fetch retries it, then resumes at
    the second from its offset, and the tuned weights rebuild bit-identical."""
    caplog.set_level(logging.INFO, logger="skillswarm.protocol.host")
    blob = delta.blob
    first, second = make_host(tmp_path, "first"), make_host(tmp_path, "second")
    with first, second, make_host(tmp_path, "client") as client:
        for holder in (first, second):
            holder_of(blob, holder)
            client.connect(holder.listen_addrs[0])
        fetch = background(
            lambda: client.fetch_blob_from_any(
                [first.peer_id, second.peer_id], blob.sha256, blob.size
            )
        )
        cut_when_served(first, cut_point(blob), fetch, cut=first)

        path = fetch.result(TRANSFER_TIMEOUT_S)

        assert sha256_of(path) == blob.sha256
        (resumed_from,) = [
            record.args[1]
            for record in caplog.records
            if record.msg.startswith("resuming blob")
            and isinstance(record.args, tuple)
            and record.args[3] == second.peer_id
        ]
        assert 0 < resumed_from < blob.size
        assert second.bytes_served == blob.size - resumed_from
        retries_of_first = [
            record
            for record in caplog.records
            if record.msg.startswith("fetching blob")
            and isinstance(record.args, tuple)
            and record.args[1] == first.peer_id
        ]
        assert len(retries_of_first) == 1  # attempts_per_peer=2: one retry, then the next holder
        assert_rebuilds_the_tuned_weights(delta, client.blob_store)


# Corrupted bytes


def test_holder_with_corrupted_bytes_is_detected_and_the_next_holder_serves_the_blob(
    tmp_path: Path, delta: Delta, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder whose copy of a delta has a corrupted span serves it whole; the download fails
    its check, the next holder serves the delta from byte 0, and the weights rebuild exactly."""
    caplog.set_level(logging.WARNING, logger="skillswarm.protocol.host")
    blob = delta.blob
    bad, good = make_host(tmp_path, "bad"), make_host(tmp_path, "good")
    with bad, good, make_host(tmp_path, "client") as client:
        holder_of(blob, bad, stored_bytes=with_corrupted_span(blob.data, blob.size * 3 // 5))
        holder_of(blob, good)
        for holder in (bad, good):
            client.connect(holder.listen_addrs[0])

        path = client.fetch_blob_from_any([bad.peer_id, good.peer_id], blob.sha256, blob.size)

        assert sha256_of(path) == blob.sha256
        # The bad copy came in whole, failed its check, and the good one came from byte 0.
        assert bad.bytes_served == blob.size
        assert good.bytes_served == blob.size
        assert any("failed its sha256 check" in record.getMessage() for record in caplog.records)
        assert_rebuilds_the_tuned_weights(delta, client.blob_store)


def test_corrupted_partial_is_detected_and_fetched_again_from_scratch(
    tmp_path: Path, delta: Delta
) -> None:
    """A resumed download that fails its check may owe the bad bytes to an earlier attempt: the
    same holder is asked again for the whole delta, and the weights rebuild exactly."""
    blob = delta.blob
    with make_host(tmp_path, "holder") as holder, make_host(tmp_path, "client") as client:
        holder_of(blob, holder)
        client.connect(holder.listen_addrs[0])
        half = blob.size // 2
        partial, _ = client.blob_store.open_partial(blob.sha256)
        partial.write_bytes(with_corrupted_span(blob.data[:half], blob.size // 10))

        path = client.fetch_blob_from_any([holder.peer_id], blob.sha256, blob.size)

        assert sha256_of(path) == blob.sha256
        assert holder.bytes_served == (blob.size - half) + blob.size
        assert_rebuilds_the_tuned_weights(delta, client.blob_store)


def test_when_no_holder_delivers_each_ones_failures_are_reported(tmp_path: Path) -> None:
    data = os.urandom(1 << 20)
    blob = Blob(hashlib.sha256(data).hexdigest(), data)
    bad, refusing = make_host(tmp_path, "bad"), make_host(tmp_path, "refusing")
    with bad, refusing, make_host(tmp_path, "client") as client:
        holder_of(blob, bad, stored_bytes=with_corrupted_span(data, 0))
        refusing.blob_store.put_bytes(data)  # held but never served
        for holder in (bad, refusing):
            client.connect(holder.listen_addrs[0])

        with pytest.raises(AllHoldersFailed) as failed:
            client.fetch_blob_from_any(
                ["not-a-peer-id", bad.peer_id, refusing.peer_id], blob.sha256, blob.size
            )

        failures = failed.value.failures
        assert list(failures) == ["not-a-peer-id", bad.peer_id, refusing.peer_id]
        assert "not a base58 peer id" in failures["not-a-peer-id"][0]
        # A holder whose whole copy is bad is not asked again; a refusal is retried.
        assert len(failures[bad.peer_id]) == 1 and "hash to" in failures[bad.peer_id][0]
        assert len(failures[refusing.peer_id]) == 2
        assert all("not served" in error for error in failures[refusing.peer_id])
        assert refusing.peer_id in str(failed.value)
        assert not client.blob_store.has(blob.sha256)


def test_fetch_from_any_refuses_bad_arguments_before_any_transfer(tmp_path: Path) -> None:
    with make_host(tmp_path, "client", max_blob_bytes=1000) as client:
        blob_id = "ab" * 32
        with pytest.raises(BlobFetchError, match="no peer to fetch"):
            client.fetch_blob_from_any([client.peer_id], blob_id, 10)
        with pytest.raises(BlobFetchError, match="exceeds the limit"):
            client.fetch_blob_from_any(["somebody"], blob_id, 1001)
        with pytest.raises(ValueError, match="attempts_per_peer"):
            client.fetch_blob_from_any(["somebody"], blob_id, 10, attempts_per_peer=0)


# Reconnecting


def test_keep_connected_redials_a_restarted_peer_and_gossip_flows_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="skillswarm.protocol.host")
    threads_before = {thread.ident for thread in threading.enumerate()}
    watcher, remote = make_host(tmp_path, "watcher"), make_host(tmp_path, "remote")
    with watcher, remote:
        assert watcher.keep_connected(remote.listen_addrs) == [remote.peer_id]
        assert watcher.kept_peers() == [remote.peer_id]
        wait_for(lambda: remote.peer_id in watcher.connected_peers(), DELIVERY_TIMEOUT_S, "dial")
        watcher.wait_for_peers_in_topic(1, MESH_TIMEOUT_S)
        remote.wait_for_peers_in_topic(1, MESH_TIMEOUT_S)
        remote.publish(b"before the restart")
        assert next_message(watcher, b"before the restart") == remote.peer_id

        port = port_of(remote)
        remote.stop()
        wait_for(
            lambda: remote.peer_id not in watcher.connected_peers(),
            DELIVERY_TIMEOUT_S,
            "the watcher to notice the dropped connection",
        )
        # While the remote is down, redials fail and back off; then it returns, same key and port.
        time.sleep(1.0)
        with make_host(tmp_path, "remote", listen_port=port) as restarted:
            assert restarted.peer_id == remote.peer_id
            wait_for(
                lambda: restarted.peer_id in watcher.connected_peers(),
                RECONNECT_TIMEOUT_S,
                "keep_connected to redial the restarted peer",
            )
            watcher.wait_for_peers_in_topic(1, MESH_TIMEOUT_S)
            restarted.wait_for_peers_in_topic(1, MESH_TIMEOUT_S)

            restarted.publish(b"after the restart")
            assert next_message(watcher, b"after the restart") == restarted.peer_id
            watcher.publish(b"welcome back")
            assert next_message(restarted, b"welcome back") == watcher.peer_id
            # The redial's log line follows the dial's return, which can trail the connection
            # (and the gossip over it) on a loaded machine: wait for it while the peer is up.
            wait_for(
                lambda: any(
                    "reconnected to" in record.getMessage()
                    and remote.peer_id in record.getMessage()
                    for record in caplog.records
                ),
                RECONNECT_TIMEOUT_S,
                "the reconnection to be logged",
            )
    # stop() cancelled the redial task with the rest: no host thread outlives its host.
    left = [
        thread.name
        for thread in threading.enumerate()
        if thread.ident not in threads_before and not thread.name.startswith("Trio thread")
    ]
    assert left == []
    assert not any(
        record.name == "skillswarm.protocol.host" and record.levelno >= logging.ERROR
        for record in caplog.records
    )


def test_keep_connected_refuses_unusable_addresses(tmp_path: Path) -> None:
    with make_host(tmp_path, "watcher") as watcher:
        with pytest.raises(PeerConnectError, match="/p2p/"):
            watcher.keep_connected(["/ip4/127.0.0.1/tcp/1"])
        with pytest.raises(PeerConnectError, match="own address"):
            watcher.keep_connected(watcher.listen_addrs)
        assert watcher.kept_peers() == []
    with pytest.raises(HostNotRunning):
        watcher.keep_connected([])


# Receiving straight into the reader's buffer


def test_a_blob_stream_is_opened_straight_into_the_readers_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two SwarmHosts the payload's Noise messages are opened in the buffers a download
    lends to its stream; only what arrives before the first is lent goes through the stream's
    own buffer. A frame that began arriving in the stream's buffer before the first buffer
    was lent goes on in the lent buffers, so a download never falls back to copying whole."""
    opened_in_place = [0]
    open_into = _BatchedNoiseSession._open_into

    def counting_open_into(session: Any, sealed: memoryview, target: memoryview) -> None:
        open_into(session, sealed, target)
        opened_in_place[0] += len(target)

    monkeypatch.setattr(_BatchedNoiseSession, "_open_into", counting_open_into)
    data = os.urandom(32 << 20)
    blob = Blob(hashlib.sha256(data).hexdigest(), data)
    with make_host(tmp_path, "server") as server, make_host(tmp_path, "client") as client:
        holder_of(blob, server)
        peer = client.connect(server.listen_addrs[0])
        assert client.fetch_blob(peer, blob.sha256, blob.size).read_bytes() == data
    assert opened_in_place[0] >= blob.size * 9 // 10, f"{opened_in_place[0]} bytes in place"


def test_buffers_taken_back_mid_transfer_hold_a_prefix_and_are_left_alone(tmp_path: Path) -> None:
    """Buffers lent to a blob stream are taken back while the peer is still sending into them:
    `reclaim` counts the bytes they received, which continue the blob in lending order; plain
    reads then go on exactly where those end; and no taken-back buffer changes afterwards."""
    data = os.urandom(8 << 20)
    blob = Blob(hashlib.sha256(data).hexdigest(), data)
    sizes = [
        100_000,
        NOISE_MAX_PLAINTEXT_BYTES,
        BLOB_CHUNK_BYTES,
        3 * NOISE_MAX_PLAINTEXT_BYTES + 5,
    ]
    pauses = [0.0, 1e-4, 1e-3, 1e-2]

    async def take_back_after(host: SwarmHost, peer: str, pause: float) -> int:
        assert host._host is not None
        stream = await host._host.new_stream(ID.from_base58(peer), [BLOB_PROTOCOL_ID])
        request = {"sha256": blob.sha256, "offset": 0, "length": blob.size}
        await stream.write(_frame(msgpack.packb(request)))
        assert (await _read_frame(stream, MAX_BLOB_RESPONSE_HEADER_BYTES))["ok"]
        muxed = stream.muxed_stream
        assert isinstance(muxed, _BatchedYamuxStream)
        received = bytearray()
        while muxed.has_buffered():  # what came before anything was lent comes first
            chunk = bytearray(BLOB_CHUNK_BYTES)
            received += chunk[: muxed.take_buffered_into(memoryview(chunk))]
        buffers = [bytearray(size) for size in sizes]
        for buffer in buffers:
            muxed.lend(memoryview(buffer))
        with trio.fail_after(TRANSFER_TIMEOUT_S):
            await muxed.grant_lent_space()
            first = await muxed.next_filled()
            assert first is not None and first.obj is buffers[0]
            await trio.sleep(pause)
        arrived = muxed.reclaim()
        snapshots = [bytes(buffer) for buffer in buffers]
        received += buffers[0] + b"".join(buffers[1:])[:arrived]
        with trio.fail_after(TRANSFER_TIMEOUT_S):
            while len(received) < blob.size:
                chunk = bytearray(BLOB_CHUNK_BYTES)
                received += chunk[: await _read_into(stream, memoryview(chunk))]
        await stream.close()
        assert received == data
        assert [bytes(buffer) for buffer in buffers] == snapshots
        return arrived

    with make_host(tmp_path, "server") as server, make_host(tmp_path, "client") as client:
        holder_of(blob, server)
        peer = client.connect(server.listen_addrs[0])
        arrivals = [client._call(take_back_after, client, peer, pause) for pause in pauses]
    assert any(arrivals), "no bytes reached the later buffers before they were taken back"


def test_downloads_and_blob_servers_reuse_their_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The buffers of a download and of the blob server that fed it go back to the process's
    pool when the transfer ends, and the next transfers take them instead of new memory; every
    blob still arrives intact."""
    import skillswarm.protocol.directio as directio
    import skillswarm.protocol.host as host_module

    pool = host_module._TRANSFER_BUFFERS
    pool.take(pool.idle)  # start with none kept
    mapped: list[int] = []
    real_aligned_buffers = directio.aligned_buffers

    def counting_aligned_buffers(count: int, size: int) -> list[memoryview]:
        mapped.append(count)
        return real_aligned_buffers(count, size)

    monkeypatch.setattr(directio, "aligned_buffers", counting_aligned_buffers)
    blobs = []
    for size in (3 * BLOB_CHUNK_BYTES + 5, 2 * BLOB_CHUNK_BYTES + 7, 100):
        data = os.urandom(size)
        blobs.append(Blob(hashlib.sha256(data).hexdigest(), data))
    with make_host(tmp_path, "server") as server, make_host(tmp_path, "client") as client:
        for blob in blobs:
            holder_of(blob, server)
        peer = client.connect(server.listen_addrs[0])
        first, *rest = blobs
        assert client.fetch_blob(peer, first.sha256, first.size).read_bytes() == first.data
        wait_for(lambda: pool.idle == BLOB_WRITE_BUFFERS + BLOB_SEND_BUFFERS, 10, "buffers back")
        assert sum(mapped) == BLOB_WRITE_BUFFERS + BLOB_SEND_BUFFERS
        for blob in rest:
            assert client.fetch_blob(peer, blob.sha256, blob.size).read_bytes() == blob.data
        wait_for(lambda: pool.idle == BLOB_WRITE_BUFFERS + BLOB_SEND_BUFFERS, 10, "buffers back")
    assert sum(mapped) == BLOB_WRITE_BUFFERS + BLOB_SEND_BUFFERS  # none mapped after the first


def test_downloads_cancelled_at_any_point_keep_a_correct_prefix(tmp_path: Path) -> None:
    """Fetches cut short by timeouts at many points of the transfer, each resuming the partial
    the one before kept: every partial is a prefix of the blob, and the last fetch completes.
    The longer timeouts cut a transfer on a loaded machine, where the first bytes can take more
    than 30 ms to come."""
    data = os.urandom(16 << 20)
    blob = Blob(hashlib.sha256(data).hexdigest(), data)
    with make_host(tmp_path, "server") as server, make_host(tmp_path, "client") as client:
        holder_of(blob, server)
        peer = client.connect(server.listen_addrs[0])
        partial = client.blob_store.partial_path(blob.sha256)
        kept = []
        for timeout in [0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12] * 2:
            try:
                client.fetch_blob(peer, blob.sha256, blob.size, timeout=timeout)
                break
            except BlobFetchError:
                size = partial.stat().st_size if partial.exists() else 0
                assert partial.read_bytes() == data[:size] if size else True
                kept.append(size)
        assert client.fetch_blob(peer, blob.sha256, blob.size).read_bytes() == data
    assert any(0 < size < blob.size for size in kept), kept


# Buffered connection reads (every blob byte passes through them)


def test_buffered_connection_reads_return_every_byte_in_order_and_never_more_than_asked() -> None:
    payload = os.urandom(700_000)
    asked = [2, 5, 300_000, None, 1, 65_535]

    async def read_everything() -> list[tuple[int | None, bytes]]:
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with listener:
            near_end = await trio.open_tcp_stream("127.0.0.1", listener.socket.getsockname()[1])
            async with near_end, await listener.accept() as far_end:
                connection = _CancelSafeRawConnection(RawConnection(TrioTCPStream(near_end), True))

                async def send_payload() -> None:
                    await far_end.send_all(payload)
                    await far_end.send_eof()

                reads = []
                with trio.fail_after(DELIVERY_TIMEOUT_S):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(send_payload)
                        for n in asked:
                            reads.append((n, await connection.read(n)))
                        while chunk := await connection.read(65_535):
                            reads.append((65_535, chunk))
                return reads

    reads = trio.run(read_everything)
    assert b"".join(data for _, data in reads) == payload
    assert all(0 < len(data) <= (n or len(payload)) for n, data in reads)


# Yamux stream buffers (every received blob byte waits in one)


def test_stream_buffer_answers_as_a_bytearray_would_and_keeps_no_mutable_input() -> None:
    rng = random.Random(3)
    buffer, reference = _StreamBuffer(b"start"), bytearray(b"start")
    for _ in range(300):
        action = rng.randrange(6)
        if action < 2:
            data = rng.randbytes(rng.randrange(0, 3000))
            source = rng.choice([data, bytearray(data), memoryview(data)[1:], memoryview(data)])
            if isinstance(source, bytearray):  # a mutable chunk is copied, not kept
                buffer.extend(source)
                source[:] = bytes(len(source))
            else:
                buffer += source
            reference += data if not isinstance(source, memoryview) else bytes(source)
        elif action == 2:
            count = rng.randrange(0, 4000)
            assert buffer.take(count) == bytes(reference[:count])
            del reference[:count]
        elif action == 3:
            target = memoryview(bytearray(rng.randrange(0, 4000)))
            moved = buffer.take_into(target)
            assert moved == min(len(target), len(reference))
            assert bytes(target[:moved]) == bytes(reference[:moved])
            del reference[:moved]
        elif action == 4:
            count = rng.randrange(0, 4000)
            assert buffer[:count] == bytes(reference[:count])
            del buffer[:count]
            del reference[:count]
        else:
            key = slice(rng.randrange(0, 50), rng.randrange(50, 100))  # not a prefix
            assert buffer[key] == bytes(reference[key])
            del buffer[key]
            del reference[key]
        assert len(buffer) == len(reference)
        assert bool(buffer) == bool(reference)
        assert bytes(buffer) == bytes(reference)
    buffer.clear()
    assert len(buffer) == 0 and not buffer and bytes(buffer) == b""
    with pytest.raises(TypeError):
        buffer[0]  # noqa: B018


# Download writer: batches are written and hashed in order in a worker thread


class _FailingFile:
    """A file whose write fails after `good_writes` writes."""

    def __init__(self, good_writes: int) -> None:
        self.written = bytearray()
        self.good_writes = good_writes

    def write(self, data: memoryview) -> int:
        if self.good_writes == 0:
            raise OSError(28, "No space left on device")
        self.good_writes -= 1
        self.written += data
        return len(data)

    def flush(self) -> None:
        pass  # every write reaches `written` at once


async def _write_batches(
    target: Any,
    digest: Any,
    batches: list[bytes],
    before_finish: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Hand each batch to a _PartialWriter in turn (each in a buffer of its own), await
    `before_finish` if given, then finish; as a download does, finish even when handing over
    fails (the writer's threads must end before the event loop does)."""
    writer = _PartialWriter(target, digest)
    try:
        for batch in batches:
            buffer = await writer.free_buffer()
            buffer[: len(batch)] = batch
            writer.write(buffer, len(batch))
        if before_finish is not None:
            await before_finish()
    finally:
        await writer.finish()


def test_partial_writer_writes_in_order_and_keeps_a_prefix_when_a_write_fails() -> None:
    batches = [bytes([n]) * 1000 for n in range(1, 11)] + [bytes([11]) * 10]  # the last one short

    whole, digest = _FailingFile(good_writes=100), hashlib.sha256()
    trio.run(_write_batches, whole, digest, batches)
    expected = b"".join(batches)
    assert bytes(whole.written) == expected
    assert digest.hexdigest() == hashlib.sha256(expected).hexdigest()

    cut, digest = _FailingFile(good_writes=3), hashlib.sha256()
    with pytest.raises(OSError, match="No space left"):
        trio.run(_write_batches, cut, digest, batches)
    assert bytes(cut.written) == b"".join(batches[:3])  # nothing after the failed batch
    assert digest.hexdigest() == hashlib.sha256(b"".join(batches[:3])).hexdigest()


def test_partial_writer_syncs_the_file_as_it_grows_without_waiting_for_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every BLOB_SYNC_BYTES written, the partial file is synced, so the commit's fsync has
    little left and a crash keeps a durable prefix; the writer goes on writing while a sync
    runs, and no sync is left running once `finish` returns."""
    import skillswarm.protocol.host as host_module

    batches = [bytes([n]) * 1000 for n in range(1, 11)]
    total = sum(map(len, batches))
    synced_sizes: list[int] = []
    syncing, first_sync_started = threading.Event(), threading.Event()

    def slow_sync(descriptor: int) -> None:
        syncing.set()
        first_sync_started.set()
        if not synced_sizes:  # the first sync waits until every batch is written
            deadline = time.monotonic() + 10
            while os.fstat(descriptor).st_size < total and time.monotonic() < deadline:
                time.sleep(0.01)
        os.fsync(descriptor)
        synced_sizes.append(os.fstat(descriptor).st_size)
        syncing.clear()

    monkeypatch.setattr(host_module, "BLOB_SYNC_BYTES", 3000)
    monkeypatch.setattr(host_module, "_sync_data", slow_sync)

    async def first_sync_has_started() -> None:
        # `finish` skips a sync only asked for; wait (on a loaded machine its thread may start
        # late) until the first one has started, so that `finish` cannot skip it.
        assert await trio.to_thread.run_sync(first_sync_started.wait, 10)

    partial = tmp_path / "blob.partial"
    with open(partial, "ab", buffering=0) as partial_file:  # each batch reaches the file at once
        trio.run(_write_batches, partial_file, hashlib.sha256(), batches, first_sync_has_started)
        assert not syncing.is_set()  # no sync outlives `finish`
    # The writer did not wait for the first sync, which saw every batch written; the requests
    # made meanwhile were served by at most one more sync.
    assert synced_sizes[0] == total
    assert synced_sizes in ([total], [total, total])
    assert partial.read_bytes() == b"".join(batches)


def test_partial_writer_stops_after_a_failed_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync that fails (the disk reporting an I/O error) fails the download: `finish` raises
    it and the partial file holds a prefix of the batches, nothing out of order."""
    import skillswarm.protocol.host as host_module

    sync_tried = threading.Event()

    def failing_sync(descriptor: int) -> None:
        sync_tried.set()
        raise OSError(5, "Input/output error")

    async def until_the_sync_was_tried() -> None:
        # A sync only asked for when the writer finishes is skipped (the commit's fsync covers
        # it): wait for the one asked for mid-download to have run.
        assert await trio.to_thread.run_sync(sync_tried.wait, DELIVERY_TIMEOUT_S)

    monkeypatch.setattr(host_module, "BLOB_SYNC_BYTES", 2000)
    monkeypatch.setattr(host_module, "_sync_data", failing_sync)
    batches = [bytes([n]) * 1000 for n in range(1, 11)]

    partial = tmp_path / "blob.partial"
    with open(partial, "ab") as partial_file, pytest.raises(OSError, match="Input/output"):
        trio.run(_write_batches, partial_file, hashlib.sha256(), batches, until_the_sync_was_tried)
    written = partial.read_bytes()
    assert len(written) >= 2000  # the failure came from the sync asked for at 2000 bytes
    assert written == b"".join(batches)[: len(written)]
