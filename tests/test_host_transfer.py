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
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import multiaddr
import pytest
import torch
import trio
from skillswarm.protocol import blobwire
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import DeltaReader, pack_delta
from skillswarm.protocol.host import (
    AllHoldersFailed,
    BlobFetchError,
    HostNotRunning,
    PeerConnectError,
    SwarmHost,
)
from skillswarm.protocol.identity import load_or_create_identity, peer_id_of, public_key_bytes
from skillswarm.protocol.manifest import DeltaManifest
from skillswarm.protocol.partial import PartialDownload

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


# Cancelled downloads


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


# The partial download and the wire format


def test_a_partial_download_resumes_where_it_stopped_and_a_failed_write_leaves_a_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(3 << 20)
    sha256 = hashlib.sha256(data).hexdigest()
    store = BlobStore(tmp_path / "blobs")
    with PartialDownload(store, sha256) as partial:
        assert partial.have == 0
        partial.append(data[: 1 << 20])
    partial = PartialDownload(store, sha256)  # a later attempt: resumes from the file
    assert partial.have == 1 << 20

    class FullDisk:
        def __init__(self, file: Any) -> None:
            self._file = file

        def write(self, piece: bytes) -> int:
            self._file.write(piece[:1000])  # half written, then the disk is full
            self._file.flush()
            raise OSError(28, "No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(self._file, name)

    monkeypatch.setattr(partial, "_file", FullDisk(partial._file))
    with pytest.raises(OSError, match="No space"):
        partial.append(data[1 << 20 : 2 << 20])
    assert store.partial_path(sha256).read_bytes() == data[: 1 << 20]  # back to what was hashed
    partial.append(data[1 << 20 :])
    assert partial.commit().read_bytes() == data


def test_a_partial_download_syncs_beside_the_appends_and_close_waits_for_the_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from skillswarm.protocol import partial as partial_module

    data = os.urandom(5 << 20)
    sha256 = hashlib.sha256(data).hexdigest()
    store = BlobStore(tmp_path / "blobs")
    started, release, synced = threading.Event(), threading.Event(), []

    def slow_sync(fd: int) -> None:  # a disk whose writeback takes a while
        started.set()
        release.wait(10)
        synced.append(fd)

    monkeypatch.setattr(partial_module, "SYNC_EVERY_BYTES", 1 << 20)
    monkeypatch.setattr(partial_module, "_sync_data", slow_sync)
    download = PartialDownload(store, sha256)
    download.append(data[: 1 << 20])  # the first MiB asks for a sync...
    assert started.wait(10)
    for offset in range(1 << 20, len(data), 1 << 20):  # ...and appending goes on meanwhile
        download.append(data[offset : offset + (1 << 20)])
    assert download.have == len(data) and not synced  # one sync at a time, still running
    closer = threading.Thread(target=download.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # close waits for the sync before closing the file
    release.set()
    closer.join(10)
    assert not closer.is_alive() and len(synced) == 1
    assert PartialDownload(store, sha256).commit().read_bytes() == data


def test_wire_frames_are_bounded_and_checked() -> None:
    class Chunks:
        def __init__(self, data: bytes) -> None:
            self._data = data

        async def read(self, n: int | None = None) -> bytes:
            count = min(3, len(self._data) if n is None else n)  # a stream that trickles
            piece, self._data = self._data[:count], self._data[count:]
            return piece

    async def read(data: bytes, limit: int = 1024) -> dict[str, Any]:
        return await blobwire.read_frame(Chunks(data), limit)

    request = blobwire.request_frame("ab" * 32, 5, 10)
    assert blobwire.parse_request(trio.run(read, request)) == ("ab" * 32, 5, 10)
    with pytest.raises(blobwire.BlobWireError, match="exceeds"):
        trio.run(read, request, 10)
    with pytest.raises(blobwire.BlobWireError, match="ended"):
        trio.run(read, request[:-1])
    with pytest.raises(blobwire.BlobWireError, match="map"):
        trio.run(read, blobwire.frame(msgpack.packb([1, 2])))
    for bad in ({"sha256": "x", "offset": 0, "length": 1}, {"sha256": "ab" * 32, "offset": -1}):
        with pytest.raises(blobwire.BlobWireError):
            blobwire.parse_request(bad)
    header = blobwire.parse_header(trio.run(read, blobwire.ok_header(100, 40)))
    assert (header.ok, header.size, header.length) == (True, 100, 40)
    refusal = blobwire.parse_header(trio.run(read, blobwire.error_header("no" * 400)))
    assert not refusal.ok and len(refusal.error or "") == blobwire.MAX_ERROR_TEXT_CHARS
    with pytest.raises(blobwire.BlobWireError, match="integer"):
        blobwire.parse_header({"ok": True, "size": True, "length": 1})
