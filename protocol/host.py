"""The peer transport of skillswarm: a py-libp2p host (TCP + Noise + Yamux) with gossip and blobs.

SwarmHost runs the host in its own thread under its own `trio.run` and offers a small thread-safe
synchronous interface: signed gossip on one topic, and the `/skillswarm/blob/1.0.0` stream protocol.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import random
import socket
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream, ISubscriptionAPI
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service
from skillswarm.protocol import blobwire, patches
from skillswarm.protocol.blobstore import BlobCorrupted, BlobNotFound, BlobStore, validate_blob_id
from skillswarm.protocol.blobwire import (
    MAX_BLOB_REQUEST_BYTES,
    MAX_BLOB_RESPONSE_HEADER_BYTES,
    BlobWireError,
)
from skillswarm.protocol.identity import peer_id_of
from skillswarm.protocol.partial import PartialDownload
from skillswarm.protocol.streams import close_quietly, reset_quietly, write_and_close

__all__ = [
    "BLOB_PROTOCOL_ID",
    "MAX_GOSSIP_PAYLOAD_BYTES",
    "AllHoldersFailed",
    "BlobFetchError",
    "GossipInbox",
    "GossipMessage",
    "GossipMessageTooLarge",
    "HostNotRunning",
    "HostStartError",
    "PeerConnectError",
    "PeerWaitTimeout",
    "SwarmHost",
    "SwarmHostError",
    "freeze_startup_heap",
]

logger = logging.getLogger(__name__)

BLOB_PROTOCOL_ID = TProtocol("/skillswarm/blob/1.0.0")
# A blob server reads and writes BLOB_CHUNK_BYTES at a time, and a download hands the bytes to its
# partial file (written and hashed in a worker thread) in pieces of up to that size: one stream
# write or thread trip per MiB, not per 64 KiB Yamux frame.
BLOB_CHUNK_BYTES = 1 << 20
BLOB_REQUEST_READ_TIMEOUT_S = 30.0
BLOB_WRITE_STALL_TIMEOUT_S = 60.0
BLOB_OPEN_TIMEOUT_S = 30.0  # for opening a blob stream and negotiating its protocol
BLOB_STREAM = "blob stream"  # what the stream helpers call one in their log lines


# libp2p gossipsub drops any RPC frame over 1 MiB (an inbound one is refused before it is read);
# the frame also carries the topic, origin, sequence number, signature, public key and a signed
# peer record.
GOSSIP_RPC_LIMIT_BYTES = 1 << 20
GOSSIP_ENVELOPE_ALLOWANCE_BYTES = 16 << 10
MAX_GOSSIP_PAYLOAD_BYTES = GOSSIP_RPC_LIMIT_BYTES - GOSSIP_ENVELOPE_ALLOWANCE_BYTES

# Gossipsub tuned for a small swarm: a short heartbeat so the mesh forms within a second.
GOSSIP_DEGREE = 6
GOSSIP_DEGREE_LOW = 4
GOSSIP_DEGREE_HIGH = 12
GOSSIP_HEARTBEAT_INTERVAL_S = 1
GOSSIP_HEARTBEAT_INITIAL_DELAY_S = 0.1
GOSSIP_MAX_MESSAGES_PER_PEER_PER_SECOND = 100.0
MESSAGE_QUEUE_CAPACITY = 10_000
# Received gossip waiting for the application is bounded in bytes too: 10 000 messages of nearly
# 1 MiB each would let a peer make a host hold 10 GiB its application has not read yet.
MESSAGE_QUEUE_BYTES = 64 << 20
# A host drops gossip it has no room for; it says so at most once per this many seconds.
DROPPED_GOSSIP_LOG_INTERVAL_S = 10.0

# fetch_blob_from_any: delay before the k-th retry at one holder is about
# FETCH_RETRY_INITIAL_DELAY_S * 2**(k-1), capped, with jitter.
FETCH_RETRY_INITIAL_DELAY_S = 0.5
FETCH_RETRY_MAX_DELAY_S = 15.0
FETCH_RETRY_DELAYS_S = (FETCH_RETRY_INITIAL_DELAY_S, FETCH_RETRY_MAX_DELAY_S)

# keep_connected: how often a kept peer's connection is checked, and the redial backoff.
RECONNECT_POLL_INTERVAL_S = 0.25
RECONNECT_INITIAL_DELAY_S = 0.5
RECONNECT_MAX_DELAY_S = 30.0
RECONNECT_DIAL_TIMEOUT_S = 15.0
RECONNECT_STABLE_AFTER_S = 10.0

MESH_POLL_INTERVAL_S = 0.05
GRACEFUL_STOP_TIMEOUT_S = 10.0
CLOSE_CONNECTIONS_TIMEOUT_S = 5.0
FORCED_STOP_TIMEOUT_S = 5.0

_T = TypeVar("_T")


def freeze_startup_heap() -> None:
    """Exempt every object alive now from the cyclic garbage collector (gc.freeze): for a
    long-running process, once it has imported what it needs and before it builds its working
    state.

    A full collection walks every tracked object while holding the GIL; with py-libp2p imported
    (about 100 000 objects) one stalls the host's event loop for about 0.1 s. The objects frozen
    are those of the imports, alive as long as the process anyway; whatever is made afterwards
    is collected as before.
    """
    gc.collect()
    gc.freeze()


class SwarmHostError(Exception):
    """Base class of peer transport errors."""


class HostStartError(SwarmHostError):
    """The libp2p host could not start listening."""


class HostNotRunning(SwarmHostError):
    """The host is not started, or was stopped while the call was in flight."""


class PeerConnectError(SwarmHostError):
    """A peer could not be dialled (bad address, refused, wrong identity or timeout)."""


class PeerWaitTimeout(SwarmHostError, TimeoutError):
    """Not enough gossip peers joined the topic mesh in time."""


class GossipMessageTooLarge(SwarmHostError, ValueError):
    """A gossip message over the size limit; large payloads belong in blobs."""


class BlobFetchError(SwarmHostError):
    """A blob download failed (refused, timed out, disconnected); the partial is kept."""


class AllHoldersFailed(BlobFetchError):
    """No holder delivered the blob; `failures` maps each holder's peer id to its errors."""

    def __init__(self, message: str, failures: dict[str, list[str]]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclass(frozen=True)
class GossipMessage:
    """A gossip message from another peer; `from_peer` is its signature-verified origin."""

    from_peer: str
    data: bytes


class GossipInbox(queue.Queue[GossipMessage]):
    """The received gossip a host's application has not read yet: a FIFO queue of at most
    MESSAGE_QUEUE_CAPACITY messages that also counts the bytes they hold (`bytes`)."""

    def __init__(self) -> None:
        super().__init__(MESSAGE_QUEUE_CAPACITY)
        self.bytes = 0

    def _put(self, item: GossipMessage) -> None:  # under the queue's lock
        super()._put(item)
        self.bytes += len(item.data)

    def _get(self) -> GossipMessage:  # under the queue's lock
        item = super()._get()
        self.bytes -= len(item.data)
        return item


class SwarmHost:
    """A libp2p peer: gossip on one topic plus the blob stream protocol, driven from any thread."""

    def __init__(
        self,
        key_pair: KeyPair,
        blob_store: BlobStore,
        topic: str,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        max_message_bytes: int = MAX_GOSSIP_PAYLOAD_BYTES,
        max_blob_bytes: int = 8 << 30,
        max_streams_per_peer: int = 4,
        deliver_gossip: bool = True,
    ) -> None:
        """`deliver_gossip=False` is for a peer that publishes and relays gossip but reads none:
        it keeps nothing of what it receives (`messages` stays empty)."""
        if not 0 < max_message_bytes <= MAX_GOSSIP_PAYLOAD_BYTES:
            raise ValueError(
                f"max_message_bytes must be between 1 and {MAX_GOSSIP_PAYLOAD_BYTES} (gossip "
                f"frames are limited to 1 MiB including the signed envelope), "
                f"got {max_message_bytes}"
            )
        if max_blob_bytes <= 0 or max_streams_per_peer <= 0:
            raise ValueError("max_blob_bytes and max_streams_per_peer must be positive")
        if not topic:
            raise ValueError("topic must be a non-empty string")
        self.key_pair = key_pair
        self.blob_store = blob_store
        self.topic = topic
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.max_message_bytes = max_message_bytes
        self.max_blob_bytes = max_blob_bytes
        self.max_streams_per_peer = max_streams_per_peer
        self.peer_id: str = peer_id_of(key_pair)
        self.deliver_gossip = deliver_gossip
        self.messages = GossipInbox()
        self._dropped_gossip = 0  # messages dropped since the last line that said so
        self._dropped_gossip_logged_at = -DROPPED_GOSSIP_LOG_INTERVAL_S

        self._lifecycle_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._running = False
        self._stopping = False
        self._startup_error: BaseException | None = None
        self._listen_addrs: list[str] = []

        self._served_lock = threading.Lock()
        self._served: set[str] = set()
        self._bytes_served = 0

        # Owned by the trio thread once it runs.
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._stop_requested: trio.Event | None = None
        self._cancel_scope: trio.CancelScope | None = None
        self._host: IHost | None = None
        self._pubsub: Pubsub | None = None
        self._gossipsub: GossipSub | None = None
        self._active_streams: defaultdict[str, int] = defaultdict(int)
        self._fetch_locks: dict[str, trio.Lock] = {}
        self._nursery: trio.Nursery | None = None
        self._kept_peer_addrs: dict[ID, list[multiaddr.Multiaddr]] = {}

    # Lifecycle

    def start(self, timeout: float = 30) -> None:
        """Start the host thread; returns once the host listens and is subscribed to the topic."""
        with self._lifecycle_lock:
            if self._thread is not None:
                raise SwarmHostError("a SwarmHost can be started only once")
            if self.listen_port != 0:
                _ensure_port_is_free(self.listen_host, self.listen_port)
            self._thread = threading.Thread(
                target=self._thread_main, name=f"swarmhost-{self.peer_id[-8:]}", daemon=True
            )
            self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise HostStartError(f"libp2p host did not start listening within {timeout} s")
        if self._startup_error is not None:
            self._thread.join(FORCED_STOP_TIMEOUT_S)
            error = self._startup_error
            raise HostStartError(
                f"libp2p host failed to start on {self.listen_host}:{self.listen_port}: {error!r}"
            ) from error

    def stop(self) -> None:
        """Stop the host: close streams and connections, and join its thread. Idempotent."""
        with self._lifecycle_lock:
            thread = self._thread
            if thread is None or self._stopping:
                return
            self._stopping = True
        self._ready.wait(GRACEFUL_STOP_TIMEOUT_S)
        self._running = False
        token, stop_requested = self._trio_token, self._stop_requested
        if token is not None and stop_requested is not None:
            _run_sync_in_trio(stop_requested.set, token)
        thread.join(GRACEFUL_STOP_TIMEOUT_S)
        if thread.is_alive() and token is not None and self._cancel_scope is not None:
            logger.warning("swarm host %s did not stop gracefully; cancelling it", self.peer_id)
            _run_sync_in_trio(self._cancel_scope.cancel, token)
            thread.join(FORCED_STOP_TIMEOUT_S)
        if thread.is_alive():
            logger.error("swarm host thread %s is still running after stop()", thread.name)

    def __enter__(self) -> SwarmHost:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """True between a successful start() and stop()."""
        return self._running

    @property
    def listen_addrs(self) -> list[str]:
        """Full multiaddrs this host listens on, each ending in /p2p/<peer id>."""
        return list(self._listen_addrs)

    # Peers

    def connect(self, multiaddr_text: str, timeout: float = 15) -> str:
        """Dial a peer at a full multiaddr (…/p2p/<peer id>); returns the remote peer id."""
        peer_info = self._parse_peer_addr(multiaddr_text)
        remote_peer_id = peer_info.peer_id.to_base58()

        async def dial() -> None:
            assert self._host is not None
            try:
                with trio.fail_after(timeout):
                    await self._host.connect(peer_info)
            except trio.TooSlowError:
                raise PeerConnectError(
                    f"connecting to {multiaddr_text} timed out after {timeout} s"
                ) from None
            except Exception as error:
                raise PeerConnectError(f"could not connect to {multiaddr_text}: {error}") from error

        self._call(dial)
        return remote_peer_id

    def keep_connected(self, multiaddrs: Sequence[str]) -> list[str]:
        """Hold a connection to the peers at these full multiaddrs until stop(); returns their ids.

        A task per peer redials it whenever it is not connected (at once, then with capped,
        jittered exponential backoff while dials fail), and logs each reconnection. Returns at once,
        without waiting for the first connection; calling it again for a kept peer adds addresses.
        """
        peer_infos = [self._parse_peer_addr(text) for text in multiaddrs]

        async def watch_peers() -> None:
            assert self._nursery is not None
            for peer_info in peer_infos:
                known = self._kept_peer_addrs.get(peer_info.peer_id)
                if known is not None:
                    known.extend(addr for addr in peer_info.addrs if addr not in known)
                    continue
                self._kept_peer_addrs[peer_info.peer_id] = list(peer_info.addrs)
                self._nursery.start_soon(
                    self._keep_peer_connected,
                    peer_info.peer_id,
                    name=f"keep-connected-{peer_info.peer_id.to_base58()[-8:]}",
                )

        self._call(watch_peers)
        return [peer_info.peer_id.to_base58() for peer_info in peer_infos]

    def kept_peers(self) -> list[str]:
        """Peer ids that keep_connected() is holding connections to."""

        async def list_kept() -> list[str]:
            return sorted(peer.to_base58() for peer in self._kept_peer_addrs)

        return self._call(list_kept)

    def connected_peers(self) -> list[str]:
        """Peer ids of the peers this host holds a connection to."""

        async def list_peers() -> list[str]:
            assert self._host is not None
            return sorted(peer.to_base58() for peer in self._host.get_connected_peers())

        return self._call(list_peers)

    def topic_mesh_peers(self) -> list[str]:
        """Peer ids in this host's gossip mesh for the topic (the peers a publish reaches)."""

        async def list_mesh() -> list[str]:
            assert self._gossipsub is not None
            return sorted(peer.to_base58() for peer in self._gossipsub.mesh.get(self.topic, ()))

        return self._call(list_mesh)

    def wait_for_peers_in_topic(self, n: int, timeout: float) -> int:
        """Block until the topic mesh holds at least `n` peers; returns the mesh size.

        Publish only after this: messages published before the mesh forms are lost. The mesh
        holds at most GOSSIP_DEGREE_HIGH peers.
        """
        if n > GOSSIP_DEGREE_HIGH:
            raise ValueError(f"the gossip mesh holds at most {GOSSIP_DEGREE_HIGH} peers, asked {n}")

        async def wait_mesh() -> int:
            assert self._gossipsub is not None
            with trio.move_on_after(timeout):
                while True:
                    size = len(self._gossipsub.mesh.get(self.topic, ()))
                    if size >= n:
                        return size
                    await trio.sleep(MESH_POLL_INTERVAL_S)
            raise PeerWaitTimeout(
                f"only {len(self._gossipsub.mesh.get(self.topic, ()))} of {n} peers joined the "
                f"gossip mesh of topic {self.topic!r} within {timeout} s"
            )

        return self._call(wait_mesh)

    # Gossip

    def publish(self, data: bytes) -> None:
        """Sign and publish `data` on the topic (at most max_message_bytes)."""
        if len(data) > self.max_message_bytes:
            raise GossipMessageTooLarge(
                f"gossip message of {len(data)} bytes exceeds the limit of "
                f"{self.max_message_bytes} bytes; put large payloads in blobs and announce them"
            )
        payload = bytes(data)

        async def publish_payload() -> None:
            assert self._pubsub is not None
            await self._pubsub.publish(self.topic, payload)

        self._call(publish_payload)

    # Blobs

    def serve_blob(self, sha256: str) -> None:
        """Allow peers to fetch this blob (it must be in the blob store)."""
        if not self.blob_store.has(sha256):
            raise BlobNotFound(f"cannot serve blob {sha256}: it is not in {self.blob_store.root}")
        with self._served_lock:
            self._served.add(sha256)

    def unserve_blob(self, sha256: str) -> None:
        """Stop serving a blob to peers."""
        validate_blob_id(sha256)
        with self._served_lock:
            self._served.discard(sha256)

    def served_blobs(self) -> set[str]:
        """Ids of the blobs peers may fetch from this host."""
        with self._served_lock:
            return set(self._served)

    def _count_served(self, count: int) -> None:
        self._bytes_served += count

    @property
    def bytes_served(self) -> int:
        """Total blob bytes this host has sent to peers."""
        return self._bytes_served

    def fetch_blob(self, peer_id: str, sha256: str, size: int, timeout: float = 300) -> Path:
        """Download a blob from a peer into the blob store; returns its path.

        Resumes from the partial download left by an earlier attempt and verifies the sha256.
        Raises BlobFetchError (partial kept) or BlobCorrupted (partial deleted).
        """
        if (present := self._check_fetch(sha256, size)) is not None:
            return present
        try:
            remote = ID.from_base58(peer_id)
        except Exception as error:
            raise BlobFetchError(f"{peer_id!r} is not a base58 peer id") from error
        return self._call(self._fetch_blob, remote, sha256, size, timeout)

    def fetch_blob_from_any(
        self,
        peer_ids: Sequence[str],
        sha256: str,
        size: int,
        timeout: float = 300,
        attempts_per_peer: int = 2,
    ) -> Path:
        """Download a blob from the first of its holders that delivers it; returns its path.

        Holders are tried in order, each up to `attempts_per_peer` times with exponential backoff
        between attempts; `timeout` bounds each attempt. The partial download is kept across
        attempts and holders (blobs are content-addressed), so a transfer cut at one holder resumes
        from its offset at the next. A download that fails its sha256 check (partial deleted)
        starts again from scratch: at the next holder when this one sent every byte, else at the
        same holder, since the bad bytes may predate this attempt. Raises AllHoldersFailed (a
        BlobFetchError) listing each holder's failures when none delivers.
        """
        if attempts_per_peer < 1:
            raise ValueError(f"attempts_per_peer must be at least 1, got {attempts_per_peer}")
        if (present := self._check_fetch(sha256, size)) is not None:
            return present
        holders = [peer_id for peer_id in dict.fromkeys(peer_ids) if peer_id != self.peer_id]
        if not holders:
            raise BlobFetchError(f"no peer to fetch blob {sha256} from (holders: {peer_ids!r})")
        return self._call(
            self._fetch_blob_from_any, holders, sha256, size, timeout, attempts_per_peer
        )

    def _check_fetch(self, sha256: str, size: int) -> Path | None:
        """The blob's path if the store has it; else None once the arguments are checked, with
        a size over max_blob_bytes refused before any transfer."""
        validate_blob_id(sha256)
        if self.blob_store.has(sha256):
            return self.blob_store.path(sha256)
        if size < 0:
            raise ValueError(f"blob size must be non-negative, got {size}")
        if size > self.max_blob_bytes:
            raise BlobFetchError(
                f"blob {sha256} of {size} bytes exceeds the limit of {self.max_blob_bytes} bytes"
            )
        return None

    # Trio side

    def _thread_main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as error:
            if self._ready.is_set():
                logger.exception("swarm host %s stopped with an error", self.peer_id)
            else:
                self._startup_error = error
        finally:
            self._running = False
            self._ready.set()

    async def _run(self) -> None:
        patches.apply_all()
        self._stop_requested = trio.Event()
        with trio.CancelScope() as cancel_scope:
            self._cancel_scope = cancel_scope
            self._trio_token = trio.lowlevel.current_trio_token()
            ip_protocol = "ip6" if ":" in self.listen_host else "ip4"
            listen_addr = multiaddr.Multiaddr(
                f"/{ip_protocol}/{self.listen_host}/tcp/{self.listen_port}"
            )
            host = new_host(
                key_pair=self.key_pair,
                # Only Noise is offered: plaintext, TLS and SECIO are refused.
                sec_opt={
                    NOISE_PROTOCOL_ID: NoiseTransport(
                        self.key_pair, noise_privkey=create_x25519_key_pair().private_key
                    )
                },
                muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
                listen_addrs=[listen_addr],
            )
            gossipsub = GossipSub(
                protocols=[PROTOCOL_ID_V12],
                degree=GOSSIP_DEGREE,
                degree_low=GOSSIP_DEGREE_LOW,
                degree_high=GOSSIP_DEGREE_HIGH,
                heartbeat_initial_delay=GOSSIP_HEARTBEAT_INITIAL_DELAY_S,
                heartbeat_interval=GOSSIP_HEARTBEAT_INTERVAL_S,
                max_messages_per_topic_per_second=GOSSIP_MAX_MESSAGES_PER_PEER_PER_SECOND,
            )
            # strict_signing: every message we publish is signed, and every received message must
            # carry a valid signature by the key of its `from` peer id, or it is dropped.
            pubsub = patches.GuardedPubsub(
                host, gossipsub, strict_signing=True, max_inbound_rpc_size=GOSSIP_RPC_LIMIT_BYTES
            )
            host.set_stream_handler(BLOB_PROTOCOL_ID, self._serve_blob_stream)
            self._host, self._pubsub, self._gossipsub = host, pubsub, gossipsub
            try:
                async with (
                    host.run(listen_addrs=[listen_addr]),
                    background_trio_service(pubsub),
                    background_trio_service(gossipsub),
                ):
                    await pubsub.wait_until_ready()
                    # Dialling is our policy: no auto-connector redialling every peer ever seen.
                    await host.get_network().auto_connector.stop()  # type: ignore[attr-defined]
                    subscription = await pubsub.subscribe(self.topic)
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        nursery.start_soon(self._deliver_gossip, subscription)
                        self._listen_addrs = [str(addr) for addr in host.get_addrs()]
                        self._running = True
                        self._ready.set()
                        logger.info(
                            "swarm host %s listening on %s", self.peer_id, self.listen_addrs
                        )
                        await self._stop_requested.wait()
                        nursery.cancel_scope.cancel()
                    await _close_connections(host)
            finally:
                # Pubsub's seen-message cache sweeps in a thread of its own that pubsub never stops.
                pubsub.seen_messages.stop()
        logger.info("swarm host %s stopped", self.peer_id)

    def _call(self, async_fn: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        """Run `async_fn(*args)` in the host's trio thread and return its result."""
        token = self._trio_token
        if not self._running or token is None:
            raise HostNotRunning(f"swarm host {self.peer_id} is not running; call start() first")
        try:
            return trio.from_thread.run(async_fn, *args, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled):
            raise HostNotRunning(f"swarm host {self.peer_id} stopped during the call") from None

    async def _deliver_gossip(self, subscription: ISubscriptionAPI) -> None:
        own_id = ID.from_base58(self.peer_id)
        while True:
            message = await subscription.get()
            origin = ID(message.from_id)
            if origin == own_id:
                continue
            if len(message.data) > self.max_message_bytes:
                logger.warning(
                    "dropped a gossip message of %d bytes from %s (limit %d bytes)",
                    len(message.data),
                    origin,
                    self.max_message_bytes,
                )
                continue
            if not self.deliver_gossip:
                continue
            if self.messages.bytes + len(message.data) > MESSAGE_QUEUE_BYTES:
                self._note_dropped_gossip(origin)
                continue
            try:
                self.messages.put_nowait(GossipMessage(origin.to_base58(), bytes(message.data)))
            except queue.Full:
                self._note_dropped_gossip(origin)

    def _note_dropped_gossip(self, origin: ID) -> None:
        """Count a message dropped for want of room, and say so at most once per
        DROPPED_GOSSIP_LOG_INTERVAL_S (a peer flooding the topic must not flood the log)."""
        self._dropped_gossip += 1
        now = time.monotonic()
        if now - self._dropped_gossip_logged_at >= DROPPED_GOSSIP_LOG_INTERVAL_S:
            logger.warning(
                "gossip queue full: %d unread messages hold %d bytes; dropped %d message(s), "
                "the last from %s",
                self.messages.qsize(),
                self.messages.bytes,
                self._dropped_gossip,
                origin,
            )
            self._dropped_gossip = 0
            self._dropped_gossip_logged_at = now

    async def _serve_blob_stream(self, stream: INetStream) -> None:
        remote = stream.muxed_conn.peer_id.to_base58()
        if self._active_streams[remote] >= self.max_streams_per_peer:
            logger.warning("refused a blob stream from %s: too many concurrent streams", remote)
            await write_and_close(
                stream, blobwire.error_header("busy: too many concurrent streams"), BLOB_STREAM
            )
            return
        self._active_streams[remote] += 1
        try:
            await self._answer_blob_request(stream, remote)
        except BlobWireError as refusal:
            logger.info("refused a blob request from %s: %s", remote, refusal)
            await write_and_close(stream, blobwire.error_header(str(refusal)), BLOB_STREAM)
        except Exception as error:
            logger.info("blob stream from %s ended early: %r", remote, error)
            await reset_quietly(stream, BLOB_STREAM)
        finally:
            self._active_streams[remote] -= 1
            if self._active_streams[remote] <= 0:
                del self._active_streams[remote]

    async def _answer_blob_request(self, stream: INetStream, remote: str) -> None:
        request: dict[str, Any] | None = None
        with trio.move_on_after(BLOB_REQUEST_READ_TIMEOUT_S):
            request = await blobwire.read_frame(stream, MAX_BLOB_REQUEST_BYTES)
        if request is None:
            raise BlobWireError("no request received in time")
        sha256, offset, length = blobwire.parse_request(request)
        with self._served_lock:
            served = sha256 in self._served
        if not served:
            raise BlobWireError("not served")
        try:
            blob_file = open(self.blob_store.path(sha256), "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise BlobWireError("not available") from None
        with blob_file:
            size = os.fstat(blob_file.fileno()).st_size
            if offset > size:
                raise BlobWireError(f"offset {offset} is beyond the blob size {size}")
            length = min(length, size - offset)
            await stream.write(blobwire.ok_header(size, length))
            blob_file.seek(offset)
            with trio.fail_after(BLOB_WRITE_STALL_TIMEOUT_S) as stall:
                await blobwire.send_body(
                    stream, blob_file, length, BLOB_CHUNK_BYTES, stall, self._count_served
                )
        logger.debug("served %d bytes of blob %s to %s", length, sha256, remote)
        await stream.close()

    async def _fetch_blob(self, remote: ID, sha256: str, size: int, timeout: float) -> Path:
        async with self._blob_fetch_lock(sha256):
            if self.blob_store.has(sha256):
                return self.blob_store.path(sha256)
            return await self._download_and_commit(remote, sha256, size, timeout)

    async def _fetch_blob_from_any(
        self, holders: list[str], sha256: str, size: int, timeout: float, attempts_per_peer: int
    ) -> Path:
        failures: dict[str, list[str]] = {}
        async with self._blob_fetch_lock(sha256):
            for holder in holders:
                errors = failures.setdefault(holder, [])
                try:
                    remote = ID.from_base58(holder)
                except Exception:
                    errors.append(f"{holder!r} is not a base58 peer id")
                    continue
                attempt = 0
                while attempt < attempts_per_peer:
                    if self.blob_store.has(sha256):
                        return self.blob_store.path(sha256)
                    attempt += 1
                    if attempt > 1:
                        # Our own backoff decides when to dial again, not libp2p's 60 s blocklist.
                        self._forget_failed_dials(remote)
                    _, resumed_from = self.blob_store.open_partial(sha256)
                    if 0 < resumed_from < size:
                        resuming = "resuming blob %s at byte %d of %d from %s"
                        logger.info(resuming, sha256, resumed_from, size, holder)
                    try:
                        return await self._download_and_commit(remote, sha256, size, timeout)
                    except BlobCorrupted as error:
                        errors.append(f"attempt {attempt}: {error}")
                        why = "resumed from byte %d; fetching it again from scratch"
                        logger.warning(
                            f"blob %s from %s failed its sha256 check ({why})",
                            sha256,
                            holder,
                            resumed_from,
                        )
                        if resumed_from == 0:
                            break  # every byte came from this holder: it holds a bad copy
                    except BlobFetchError as error:
                        errors.append(f"attempt {attempt}: {error}")
                        if attempt < attempts_per_peer:
                            delay = _backoff_delay(attempt, *FETCH_RETRY_DELAYS_S)
                            retry = "retrying in %.2f s"
                            logger.info(
                                f"fetching blob %s from %s failed (%s); {retry}",
                                sha256,
                                holder,
                                error,
                                delay,
                            )
                            await trio.sleep(delay)
                logger.info("giving up on %s as a source of blob %s", holder, sha256)
        summary = "; ".join(
            f"{holder}: " + " | ".join(errors) for holder, errors in failures.items()
        )
        raise AllHoldersFailed(
            f"no holder delivered blob {sha256} ({len(holders)} tried): {summary}", failures
        )

    @asynccontextmanager
    async def _blob_fetch_lock(self, sha256: str) -> AsyncIterator[None]:
        """Serializes downloads of one blob: they share its partial file."""
        lock = self._fetch_locks.setdefault(sha256, trio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._fetch_locks.pop(sha256, None)

    async def _download_and_commit(
        self, remote: ID, sha256: str, size: int, timeout: float
    ) -> Path:
        """Fetch the bytes the partial download lacks, then verify and install the blob.

        Call with the blob's fetch lock held. Raises BlobFetchError (partial kept) or
        BlobCorrupted (partial deleted).
        """
        partial = await trio.to_thread.run_sync(PartialDownload, self.blob_store, sha256)
        if partial.have > size:
            logger.warning("partial of blob %s is longer than the blob; restarting", sha256)
            partial.close()
            self.blob_store.discard_partial(sha256)
            partial = await trio.to_thread.run_sync(PartialDownload, self.blob_store, sha256)
        started_empty = partial.have == 0
        try:
            if partial.have < size:
                with trio.fail_after(timeout):
                    await self._download_range(remote, sha256, size, partial)
        except BaseException as error:
            partial.close()
            if started_empty:
                self.blob_store.discard_partial_if_empty(sha256)
            if isinstance(error, trio.TooSlowError):
                raise BlobFetchError(
                    f"fetching blob {sha256} from {remote} timed out after {timeout} s; "
                    "the partial download is kept for resuming"
                ) from None
            raise
        return await trio.to_thread.run_sync(partial.commit)

    async def _keep_peer_connected(self, peer: ID) -> None:
        """Redial `peer` whenever it is not connected, backing off while it does not stay.

        Every dial after the first waits a backoff that grows with the dials made since the
        connection last held for RECONNECT_STABLE_AFTER_S: a peer that refuses us, or accepts and
        drops us at once, is not redialled in a tight loop.
        """
        assert self._host is not None
        network = self._host.get_network()
        unstable_dials = 0
        connected_since: float | None = None
        was_connected = False
        while True:
            if network.get_connections(peer):
                now = trio.current_time()
                if connected_since is None:
                    connected_since = now
                    if was_connected:
                        # The peer came back by dialling us before our redial got through.
                        logger.info("reconnected to %s (it dialled this host)", peer)
                elif now - connected_since >= RECONNECT_STABLE_AFTER_S:
                    unstable_dials = 0
                was_connected = True
                await trio.sleep(RECONNECT_POLL_INTERVAL_S)
                continue
            if connected_since is not None:
                logger.warning("lost the connection to %s; redialling", peer)
                connected_since = None
            if unstable_dials > 0:
                delay = _backoff_delay(
                    unstable_dials, RECONNECT_INITIAL_DELAY_S, RECONNECT_MAX_DELAY_S
                )
                logger.debug("redialling %s in %.2f s", peer, delay)
                await trio.sleep(delay)
            unstable_dials += 1
            self._forget_failed_dials(peer)
            try:
                with trio.fail_after(RECONNECT_DIAL_TIMEOUT_S):
                    await self._host.connect(PeerInfo(peer, list(self._kept_peer_addrs[peer])))
            except (Exception, trio.TooSlowError) as error:
                logger.info("dialling %s failed (attempt %d): %r", peer, unstable_dials, error)
                continue
            connected_since = trio.current_time()
            logger.info(
                "%s %s (attempt %d)",
                "reconnected to" if was_connected else "connected to kept peer",
                peer,
                unstable_dials,
            )
            was_connected = True

    def _forget_failed_dials(self, peer: ID) -> None:
        """Lift libp2p's 60 s block on dialling a peer whose addresses all failed recently."""
        assert self._host is not None
        unblock_peer = getattr(self._host.get_network(), "unblock_peer", None)
        if unblock_peer is not None:
            unblock_peer(peer)

    def _parse_peer_addr(self, multiaddr_text: str) -> PeerInfo:
        try:
            peer_info = info_from_p2p_addr(multiaddr.Multiaddr(multiaddr_text))
        except Exception as error:
            raise PeerConnectError(
                f"{multiaddr_text!r} is not a dialable multiaddr ending in /p2p/<peer id>: {error}"
            ) from error
        if peer_info.peer_id.to_base58() == self.peer_id:
            raise PeerConnectError(f"{multiaddr_text} is this host's own address")
        return peer_info

    async def _open_blob_stream(self, remote: ID) -> INetStream:
        """A new stream to `remote` that speaks the blob protocol (negotiated by libp2p)."""
        assert self._host is not None
        failed = f"could not open a blob stream to {remote}"
        try:
            with trio.fail_after(BLOB_OPEN_TIMEOUT_S):
                return await self._host.new_stream(remote, [BLOB_PROTOCOL_ID])
        except trio.TooSlowError:
            raise BlobFetchError(f"{failed}: no answer within {BLOB_OPEN_TIMEOUT_S} s") from None
        except Exception as error:
            cause = "" if error.__cause__ is None else f" ({error.__cause__!r})"
            raise BlobFetchError(f"{failed}: {error}{cause}") from error

    async def _download_range(
        self, remote: ID, sha256: str, size: int, partial: PartialDownload
    ) -> None:
        """Ask `remote` for the bytes of the blob from the partial's end and append them to it."""
        wanted = size - partial.have
        stream = await self._open_blob_stream(remote)
        try:
            await stream.write(blobwire.request_frame(sha256, partial.have, wanted))
            header = blobwire.parse_header(
                await blobwire.read_frame(stream, MAX_BLOB_RESPONSE_HEADER_BYTES)
            )
            if not header.ok:
                raise BlobFetchError(f"peer {remote} refused blob {sha256}: {header.error}")
            if header.size != size:
                raise BlobFetchError(
                    f"peer {remote} has blob {sha256} with {header.size} bytes, expected {size}"
                )
            if header.length != wanted:
                raise BlobFetchError(
                    f"peer {remote} offered {header.length} bytes of blob {sha256}, "
                    f"asked for {wanted}"
                )
            await blobwire.receive_body(stream, wanted, partial.append, BLOB_CHUNK_BYTES)
        except BlobFetchError:
            await reset_quietly(stream, BLOB_STREAM)
            raise
        except Exception as error:
            await reset_quietly(stream, BLOB_STREAM)
            raise BlobFetchError(
                f"transfer of blob {sha256} from {remote} failed: {error!r}; "
                "the partial download is kept for resuming"
            ) from error
        except BaseException:  # cancelled (timeout or host stopping): tell the server at once
            await reset_quietly(stream, BLOB_STREAM)
            raise
        await close_quietly(stream, BLOB_STREAM)


async def _close_connections(host: IHost) -> None:
    """Close every connection, so that peers see the disconnect and the sockets are freed.

    py-libp2p 0.8.1 closes connections only in its swarm's cancelled shutdown path, where the
    first await ends the closing: the sockets stayed open, and a peer kept writing to a host
    that was gone (a blob transfer stalled, the peer's reconnect logic never fired).
    """
    network = host.get_network()
    with trio.move_on_after(CLOSE_CONNECTIONS_TIMEOUT_S):
        for peer, connections in network.get_connections_map().items():
            for connection in connections:
                try:
                    await connection.close()
                except Exception as error:
                    logger.debug("closing the connection to %s failed: %r", peer, error)


def _ensure_port_is_free(host: str, port: int) -> None:
    """Refuse a listen port already taken: libp2p listens with SO_REUSEPORT, so two hosts on one
    port would both start and split the incoming connections between them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise HostStartError(
                f"cannot listen on {host}:{port}: {error.strerror}; is another node using it?"
            ) from error


def _backoff_delay(attempt: int, initial: float, cap: float) -> float:
    """Exponential backoff for the `attempt`-th retry (1-based), capped, with up to 50% jitter."""
    delay = min(cap, initial * 2 ** (attempt - 1))
    return delay * random.uniform(0.5, 1.0)


def _run_sync_in_trio(fn: Callable[[], object], token: trio.lowlevel.TrioToken) -> None:
    with contextlib.suppress(trio.RunFinishedError):
        trio.from_thread.run_sync(fn, trio_token=token)
