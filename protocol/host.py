"""The peer transport of skillswarm: a py-libp2p host (TCP + Noise + Yamux) with gossip and blobs.

SwarmHost runs the host in its own thread under its own `trio.run` and offers a small thread-safe
synchronous interface: signed gossip on one topic, and the `/skillswarm/blob/1.0.0` stream protocol.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import logging
import os
import queue
import random
import socket
import struct
import threading
import time
import weakref
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, closing
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, NoReturn, TypeVar

import msgpack
import multiaddr
import trio
from cryptography.exceptions import InvalidTag
from libp2p import new_host
from libp2p.abc import (
    ConnectionType,
    IHost,
    IMuxedConn,
    IMuxedStream,
    INetStream,
    IRawConnection,
    ISecureConn,
    ISubscriptionAPI,
)
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError
from libp2p.network.connection.exceptions import RawConnError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.protocol_muxer.multiselect import is_valid_handshake
from libp2p.protocol_muxer.multiselect_client import MULTISELECT_PROTOCOL_ID, PROTOCOL_NOT_FOUND_MSG
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux.yamux import MAX_WINDOW_SIZE as YAMUX_MAX_WINDOW_SIZE
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import (
    TYPE_DATA,
    YAMUX_HEADER_FORMAT,
    Yamux,
    YamuxStream,
)
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils import encode_delim
from noise.backends.default.ciphers import ChaCha20Cipher
from noise.constants import MAX_NONCE as NOISE_MAX_NONCE
from noise.exceptions import NoiseMaxNonceError
from skillswarm.protocol.blobstore import (
    BlobCorrupted,
    BlobNotFound,
    BlobStore,
    InvalidBlobId,
    validate_blob_id,
)
from skillswarm.protocol.directio import AlignedBufferPool, AppendFile, open_for_append
from skillswarm.protocol.identity import peer_id_of

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
# What a blob client sends before its request: the multistream-select header and its proposal.
_BLOB_PROPOSAL = encode_delim(MULTISELECT_PROTOCOL_ID.encode()) + encode_delim(
    BLOB_PROTOCOL_ID.encode()
)

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

# Buffers of BLOB_CHUNK_BYTES (defined below) a download fills while full ones are written and
# hashed; lent to its stream, they are also its receive window.
BLOB_WRITE_BUFFERS = 8
# A download's partial file is synced to disk every BLOB_SYNC_BYTES as it grows, in the
# background, so that the commit's fsync finds little left to write (a 256 MiB blob's one fsync
# took 70-80 ms here, a seventh of its transfer; with syncs every 16 MiB a 64 MiB blob's commit
# still took 27-30 ms, every 4 MiB 10-15 ms) and a crash keeps a durable prefix to resume from.
BLOB_SYNC_BYTES = 4 << 20
MAX_BLOB_REQUEST_BYTES = 1024
MAX_BLOB_RESPONSE_HEADER_BYTES = 4096
BLOB_REQUEST_READ_TIMEOUT_S = 30.0
BLOB_NEGOTIATE_TIMEOUT_S = 30.0  # for the peer's two multistream-select answers
BLOB_WRITE_STALL_TIMEOUT_S = 60.0
_FRAME_LENGTH = struct.Struct(">I")

# A connection that takes less than RAW_WRITE_STALL_BYTES (one Noise message) in
# RAW_WRITE_STALL_TIMEOUT_S is treated as dead; writes go out RAW_WRITE_PIECE_BYTES at a time,
# each piece with a proportionally longer deadline.
RAW_WRITE_STALL_TIMEOUT_S = 10.0
RAW_WRITE_STALL_BYTES = 64 << 10
RAW_WRITE_PIECE_BYTES = 1 << 20
# Bytes asked of the socket per read; Noise's small reads are then served from what came back.
RAW_READ_BYTES = 1 << 20
# Reads and writes that find the socket ready let the host's other tasks run once this many bytes
# have moved, or this many calls have been made, without a wait (small frames, such as a flood of
# pings, move few bytes per call).
RAW_YIELD_BYTES = 4 << 20
RAW_YIELD_CALLS = 64
# Noise transport messages: a 2-byte big-endian length, then at most 65535 bytes of ciphertext,
# of which the last 16 are the ChaCha20-Poly1305 tag.
NOISE_TAG_BYTES = 16
NOISE_MAX_PLAINTEXT_BYTES = 65535 - NOISE_TAG_BYTES
_NOISE_LENGTH = struct.Struct(">H")
# The ChaChaPoly nonce of message n: 32 zero bits, then n as a little-endian 64-bit integer.
_NOISE_NONCE = struct.Struct("<4xQ")
NOISE_MAX_WIRE_BYTES = _NOISE_LENGTH.size + 65535
# Yamux DATA frames this host sends carry up to YAMUX_FRAME_PAYLOAD_BYTES (py-libp2p sends 64 KiB;
# the spec bounds a frame only by the receive window, and rust-yamux reads frames up to 1 MiB).
# Each frame's header goes in a Noise message of its own and its payload in the next ones: 1 MiB
# is sixteen whole messages and a short one. Every frame costs both ends a header message and a
# pass through the frame loop: sixteen messages a frame instead of four saved 2-4% of a loopback
# blob's time. A whole number of pages, a frame fills a download buffer that is written to disk
# straight from where it lies (see DirectAppender); frames of sixteen messages, 272 bytes short
# of that, had every buffer copied into the appender's staging memory. A stream write hands the
# connection up to YAMUX_WRITE_BATCH_BYTES at once.
YAMUX_FRAME_PAYLOAD_BYTES = 1 << 20
assert YAMUX_FRAME_PAYLOAD_BYTES <= 1 << 20  # rust-yamux's and jvm-libp2p's bound on a frame
YAMUX_WRITE_BATCH_BYTES = 1 << 20
# A blob server reads and sends BLOB_CHUNK_BYTES at a time, and a download receives into buffers
# of that size: one whole frame, so that every Noise message of a frame's payload fits whole in the
# buffer it is opened into.
BLOB_CHUNK_BYTES = YAMUX_FRAME_PAYLOAD_BYTES
# Buffers of BLOB_CHUNK_BYTES a blob server reads its file into ahead of sending them.
BLOB_SEND_BUFFERS = 3
# The buffers downloads and blob servers use, kept between transfers (enough for two downloads).
_TRANSFER_BUFFERS = AlignedBufferPool(BLOB_CHUNK_BYTES, max_idle=2 * BLOB_WRITE_BUFFERS)
_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
YAMUX_WINDOW_POLL_INTERVAL_S = 0.01
YAMUX_WINDOW_WAIT_TIMEOUT_S = 5.0
YAMUX_DATA_READ_TIMEOUT_S = 60.0
_YAMUX_HEADER = struct.Struct(YAMUX_HEADER_FORMAT)

# fetch_blob_from_any: delay before the k-th retry at one holder is about
# FETCH_RETRY_INITIAL_DELAY_S * 2**(k-1), capped, with jitter.
FETCH_RETRY_INITIAL_DELAY_S = 0.5
FETCH_RETRY_MAX_DELAY_S = 15.0

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

    A full collection walks every tracked object while holding the GIL. With py-libp2p and its
    dependencies imported (about 100 000 objects) one took about 105 ms here, and the first one
    came during a process's first blob transfer: its host's event loop stood still for it, a
    third of a 64 MiB fetch on loopback. The objects frozen are those of the imports (modules,
    classes, functions), alive as long as the process anyway; whatever is made afterwards is
    collected as before.
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


class _BlobRequestRefused(Exception):
    """A blob request the server answers with an error header."""


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


class _GuardedPubsub(Pubsub):
    """Pubsub hardened against peers' malformed input and against its own interleaved writes.

    py-libp2p 0.8.1 lets three things through that this class stops:
    - an RPC frame that is not valid protobuf raises out of the stream handler and stops the whole
      host (any connected peer could crash us); such a stream is reset and the peer's pubsub
      state dropped, as libp2p already does for oversized frames;
    - the signature check raises (rather than rejecting) on an undecodable public key, and an
      error in a pubsub task stops the pubsub service; such a message is dropped;
    - the replay of recent messages to a joining peer writes to its stream while the peer's send
      queue writes too; a message over one yamux frame (64 KiB) then interleaves with the other
      writes and the peer reads a corrupt RPC; writes to one stream are serialized;
    - message sequence numbers start at the current time in whole seconds, so a peer that
      restarts within seconds reuses the ids of its earlier messages and the others drop its new
      ones as already seen; they start at the time in nanoseconds instead, as go-libp2p does.
    """

    def __init__(self, host: IHost, router: GossipSub, strict_signing: bool) -> None:
        super().__init__(
            host, router, strict_signing=strict_signing, max_inbound_rpc_size=GOSSIP_RPC_LIMIT_BYTES
        )
        self._stream_write_locks: weakref.WeakKeyDictionary[INetStream, trio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self.counter = time.time_ns()

    async def stream_handler(self, stream: INetStream) -> None:
        try:
            await super().stream_handler(stream)
        except Exception as error:
            remote = stream.muxed_conn.peer_id
            logger.warning(
                "reset the gossip stream from %s after an unreadable RPC: %r", remote, error
            )
            await _reset_quietly(stream)
            self._handle_dead_peer(remote)

    async def write_msg(self, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
        lock = self._stream_write_locks.setdefault(stream, trio.Lock())
        async with lock:
            return await super().write_msg(stream, rpc_msg)

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        if msg_forwarder == self.my_id:
            await super().push_msg(msg_forwarder, msg)
            return
        try:
            await super().push_msg(msg_forwarder, msg)
        except Exception as error:
            logger.warning("dropped a malformed gossip message from %s: %r", msg_forwarder, error)


class _EagerLock:
    """A trio lock whose uncontended acquire does not yield to the scheduler.

    py-libp2p's Yamux takes its stream-table lock for every frame it receives and every read, and
    a trio.Lock yields on each acquire: a trip through the scheduler per frame. The critical
    sections it guards are short, so a free lock is taken at once; a held one is waited for in
    turn, as with trio.Lock.
    """

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def __aenter__(self) -> None:
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


def _reserve(buffer: bytearray, size: int) -> bytearray:
    """`buffer` if it holds `size` bytes, else a new one that does.

    The Noise session seals into one buffer reused for every write: a fresh megabyte per write
    comes from mmap, and the kernel's page faults on it cost more CPU than the encryption. A
    buffer is replaced, never resized in place, since a view of it may outlive a failed write.
    """
    return buffer if len(buffer) >= size else bytearray(size)


def _tcp_socket_of(conn: IRawConnection) -> trio.socket.SocketType | None:
    """The trio socket under a py-libp2p TCP connection (a RawConnection over a TrioTCPStream
    over a trio.SocketStream); None for any other kind of connection, and off POSIX systems,
    where a socket is no file descriptor for os.read and os.write."""
    stream = getattr(getattr(conn, "stream", None), "stream", None)
    if os.name != "posix" or not isinstance(stream, trio.SocketStream):
        return None
    return stream.socket


def _connection_closed(
    doing: str, remote: tuple[str, int] | None, error: OSError
) -> ConnectionClosedError:
    return ConnectionClosedError(
        f"TCP connection {doing} {remote} failed: {error}", transport="tcp"
    )


class _CancelSafeRawConnection(IRawConnection):
    """A TCP connection whose writes a cancellation cannot cut short, with buffered reads.

    Noise encrypts each message with the next nonce just before it writes it. A write cancelled
    before it sent its bytes (a fetch timeout, the blob server's stall timeout) would spend that
    nonce: the peer could decrypt nothing after it and the whole connection, gossip included,
    would die. Writes here finish, or fail and close the connection when the peer takes less
    than RAW_WRITE_STALL_BYTES per RAW_WRITE_STALL_TIMEOUT_S; a cancellation then takes effect
    at the next checkpoint.

    Reads ask the socket for RAW_READ_BYTES at a time and serve the Noise handshake's small
    reads (a 2-byte length, then the message) from that. Over TCP both go straight to the
    socket (see _send_all).
    """

    def __init__(self, conn: IRawConnection) -> None:
        self._conn = conn
        self.is_initiator = conn.is_initiator
        self._read_buffer = b""
        self._read_offset = 0
        self._socket = _tcp_socket_of(conn)
        self._unyielded = 0  # bytes moved on the socket since the last schedule point
        self._unyielded_calls = 0  # reads and writes made since then

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send all of `data`, RAW_WRITE_PIECE_BYTES at a time, each piece under its own
        deadline: a long write to a slow but live peer is not mistaken for a dead one."""
        with memoryview(data) as view:
            for start in range(0, len(view), RAW_WRITE_PIECE_BYTES):
                await self._write_piece(view[start : start + RAW_WRITE_PIECE_BYTES])

    async def _write_piece(self, piece: memoryview) -> None:
        stall_timeout = RAW_WRITE_STALL_TIMEOUT_S * max(1.0, len(piece) / RAW_WRITE_STALL_BYTES)
        with trio.CancelScope(shield=True) as write_scope:
            write_scope.deadline = trio.current_time() + stall_timeout
            if self._socket is None:
                await self._conn.write(piece)  # type: ignore[arg-type]
            else:
                await self._send_all(piece)
        if write_scope.cancelled_caught:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self._conn.close()
            raise RawConnError(
                f"the connection to {self.get_remote_address()} accepted less than "
                f"{RAW_WRITE_STALL_BYTES} bytes per {RAW_WRITE_STALL_TIMEOUT_S} s; closed it"
            )

    async def read(self, n: int | None = None) -> bytes:
        """At most `n` bytes (any available if None), from a buffer filled RAW_READ_BYTES at a
        time."""
        if self._read_offset >= len(self._read_buffer):
            data = await self._receive(RAW_READ_BYTES if n is None else max(n, RAW_READ_BYTES))
            if self._read_offset < len(self._read_buffer):  # another reader refilled meanwhile
                data = self._read_buffer[self._read_offset :] + data
            elif n is None or len(data) <= n:
                return data
            self._read_buffer, self._read_offset = data, 0
        start = self._read_offset
        end = len(self._read_buffer) if n is None else min(start + n, len(self._read_buffer))
        self._read_offset = end
        return self._read_buffer[start:end]

    async def _send_all(self, piece: memoryview) -> None:
        """Write all of `piece` to the socket, waiting for room only when the kernel has none.

        py-libp2p's TCP stream goes through trio's SocketStream, which passes through the
        scheduler after every send that succeeds and takes a lock per write. A write here is a
        plain non-blocking send, repeated once the socket is writable, with a schedule point
        only every RAW_YIELD_BYTES or RAW_YIELD_CALLS. With reads done the same way, a 256 MiB
        loopback blob cost its server 2.8 ms of CPU per MiB instead of 3.1, and its client's
        event loop 2.0 instead of 2.2-2.3. Errors read as they do there: a connection closed
        here drops the write, one broken by the peer raises ConnectionClosedError.
        """
        sock = self._socket
        assert sock is not None
        while piece:
            descriptor = sock.fileno()
            if descriptor < 0:
                return  # closed here: py-libp2p's TCP stream drops such a write too
            try:
                sent = os.write(descriptor, piece)
            except BlockingIOError:
                await self._wait_for(trio.lowlevel.wait_writable)
                continue
            except OSError as error:
                raise _connection_closed("write to", self.get_remote_address(), error) from error
            piece = piece[sent:]
            await self._count_and_maybe_yield(sent)

    async def _receive(self, most: int) -> bytes:
        """Up to `most` bytes from the connection (b"" at its end), as _send_all writes: a
        plain non-blocking read, waiting only when nothing has arrived."""
        sock = self._socket
        if sock is None:
            return await self._conn.read(most)
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            descriptor = sock.fileno()
            if descriptor < 0:
                return b""  # closed here: py-libp2p's TCP stream reads that as the end
            try:
                data = os.read(descriptor, most)
            except BlockingIOError:
                if not await self._wait_for(trio.lowlevel.wait_readable):
                    return b""
                continue
            except OSError as error:
                raise _connection_closed("read from", self.get_remote_address(), error) from error
            await self._count_and_maybe_yield(len(data))
            return data

    async def _wait_for(self, wait: Callable[[Any], Awaitable[None]]) -> bool:
        """Wait until the socket is ready; False if it was closed here meanwhile."""
        self._unyielded = self._unyielded_calls = 0  # waiting is a schedule point
        try:
            await wait(self._socket)
        except trio.ClosedResourceError:
            return False
        return True

    async def _count_and_maybe_yield(self, count: int) -> None:
        """Let other tasks run once RAW_YIELD_BYTES have moved, or RAW_YIELD_CALLS reads and
        writes were made, without waiting: a peer that keeps the socket busy must not keep the
        rest of the host from running."""
        self._unyielded += count
        self._unyielded_calls += 1
        if self._unyielded >= RAW_YIELD_BYTES or self._unyielded_calls >= RAW_YIELD_CALLS:
            self._unyielded = self._unyielded_calls = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def close(self) -> None:
        await self._conn.close()

    def get_remote_address(self) -> tuple[str, int] | None:
        return self._conn.get_remote_address()

    def get_transport_addresses(self) -> list[multiaddr.Multiaddr]:
        return self._conn.get_transport_addresses()

    def get_connection_type(self) -> ConnectionType:
        return self._conn.get_connection_type()


class _BatchedNoiseSession(SecureSession):
    """A Noise transport session that seals a whole write at once and opens messages straight
    into their reader's memory where it can.

    The bytes on the wire are py-libp2p's own: each message a 2-byte length and a
    ChaCha20-Poly1305 ciphertext of at most NOISE_MAX_PLAINTEXT_BYTES, sealed with the cipher
    states the XX handshake left, so their nonces run on. What changes is the work per byte.
    py-libp2p seals each 64 KiB message and sends it on its own, and reads each one with two
    raw reads and a copy into a growing buffer. Here a write of any number of parts is sealed
    into one reused buffer (each part as messages of its own) and sent as one raw write. A raw
    read of up to RAW_READ_BYTES is split in place into its sealed messages, which are opened
    in order as they are read: into the opened-bytes queue, or (`read_available_into`) straight
    into a buffer the reader lent. Writes hold a lock from sealing to sending, so that the
    nonces go out in the order they were spent.
    """

    def __init__(self, session: SecureSession, raw: _CancelSafeRawConnection) -> None:
        super().__init__(
            local_peer=session.local_peer,
            local_private_key=session.local_private_key,
            remote_peer=session.remote_peer,
            remote_permanent_pubkey=session.remote_permanent_pubkey,
            is_initiator=session.is_initiator,
            conn=session.conn,
        )
        noise_protocol = session.conn.noise_state.noise_protocol  # type: ignore[attr-defined]
        self._sealer = noise_protocol.cipher_state_encrypt
        # The handshake's AEADs (cryptography's ChaCha20Poly1305) are called directly: sealing
        # and opening into the caller's buffer, without the cipher state's three layers of
        # Python calls and its copy per message. For any other cipher the cipher state's own
        # methods are used.
        self._direct_seal = _is_keyed_chacha(self._sealer)
        self._opener = noise_protocol.cipher_state_decrypt
        self._direct_open = _is_keyed_chacha(self._opener)
        self._raw = raw
        self._write_lock = _EagerLock()
        self._wire = bytearray()
        self._sealed: deque[memoryview] = deque()  # received whole messages, not yet opened
        self._opened = _StreamBuffer()  # opened messages, not yet read
        self._ciphertext = b""  # the start of a message whose end has not arrived yet

    async def write(self, data: bytes) -> None:
        await self.write_parts((data,))

    async def write_parts(self, parts: Sequence[bytes | memoryview]) -> None:
        """Send `parts` in order, each sealed as messages of its own (so a reader that knows
        where the parts begin finds each one at the start of a message), in one raw write."""
        async with self._write_lock:  # waiting here spends no nonce: a cancellation is harmless
            length = self._seal(parts)
            with memoryview(self._wire) as wire:
                await self._raw.write(wire[:length])

    async def read(self, n: int | None = None) -> bytes:
        """Exactly `n` bytes (fewer only at the end of the connection), or all that is
        buffered (at least one byte) when `n` is None."""
        if n == 0:
            return b""
        wanted = 1 if n is None else n
        while len(self._opened) < wanted:
            if not await self._open_next():
                if self._opened:
                    break
                raise self._closed_error(wanted)
        return self._opened.take(len(self._opened) if n is None else n)

    async def read_available_to(self, target: bytearray | _StreamBuffer, most: int) -> int:
        """Append up to `most` ready bytes to `target` (a _StreamBuffer keeps the opened
        messages without copying them), opening whole sealed messages as needed; returns how
        many. It waits for nothing (only a failed authentication awaits, to close the
        connection)."""
        taken = 0
        while taken < most and (self._opened or self._sealed):
            if not self._opened:
                await self._open_next()  # a whole sealed message is there: nothing to wait for
            count = min(most - taken, len(self._opened))
            for part in self._opened.pop_parts(count):
                target.extend(part)
            taken += count
        return taken

    async def wait_readable(self) -> None:
        """Return once bytes are ready to be read without waiting (opened, or a whole sealed
        message); raise if the connection ends first."""
        while not (self._opened or self._sealed):
            if not await self._receive():
                raise self._closed_error(1)

    async def read_available_into(self, target: memoryview) -> int:
        """Move ready bytes into the start of `target`; returns how many. It waits for nothing
        (only a failed authentication awaits, to close the connection), so `target` is
        written only while this runs.

        A sealed message whose plaintext fits in what is left of `target` is opened straight
        into it; one that does not is opened into the queue and `target` takes its start.
        """
        filled = self._opened.take_into(target)
        try:
            while filled < len(target) and self._sealed and not self._opened:
                sealed = self._sealed[0]
                plaintext_length = len(sealed) - NOISE_TAG_BYTES
                if plaintext_length <= len(target) - filled:
                    self._open_into(sealed, target[filled : filled + plaintext_length])
                    filled += plaintext_length
                else:
                    self._opened.extend(self._open(sealed))
                    filled += self._opened.take_into(target[filled:])
                self._sealed.popleft()
        except InvalidTag:
            await self._fail_authentication()
        return filled

    def _closed_error(self, wanted: int) -> IncompleteReadError:
        return IncompleteReadError(
            f"connection closed after {len(self._ciphertext)} bytes of a Noise message",
            expected_bytes=wanted,
            received_bytes=len(self._ciphertext),
        )

    def _seal(self, parts: Sequence[bytes | memoryview]) -> int:
        """Seal each of `parts` into the wire buffer as Noise messages, length prefixes included
        (an empty part as one empty message); returns how many bytes of the buffer they fill."""
        views = [memoryview(part) for part in parts]
        try:
            messages = sum(max(1, -(-len(view) // NOISE_MAX_PLAINTEXT_BYTES)) for view in views)
            overhead = _NOISE_LENGTH.size + NOISE_TAG_BYTES
            self._wire = _reserve(self._wire, sum(map(len, views)) + messages * overhead)
            end = 0
            with memoryview(self._wire) as wire:
                for plaintext in views:
                    for start in range(0, max(len(plaintext), 1), NOISE_MAX_PLAINTEXT_BYTES):
                        piece = plaintext[start : start + NOISE_MAX_PLAINTEXT_BYTES]
                        sealed_length = len(piece) + NOISE_TAG_BYTES
                        _NOISE_LENGTH.pack_into(wire, end, sealed_length)
                        end += _NOISE_LENGTH.size
                        self._seal_into(piece, wire[end : end + sealed_length])
                        end += sealed_length
            return end
        finally:
            for view in views:
                view.release()

    def _seal_into(self, piece: memoryview, target: memoryview) -> None:
        """Encrypt one message with the next nonce straight into `target` (its ciphertext and
        tag), as the cipher state's encrypt_with_ad would, without its copy."""
        state = self._sealer
        if not self._direct_seal:
            target[:] = state.encrypt_with_ad(None, piece)
            return
        state.cipher.cipher.encrypt_into(_next_nonce(state), piece, None, target)
        state.n += 1

    async def _open_next(self) -> bool:
        """Open the next sealed message into the queue, reading from the connection as needed;
        False at its end."""
        while not self._sealed:
            if not await self._receive():
                return False
        try:
            self._opened.extend(self._open(self._sealed[0]))
        except InvalidTag:
            await self._fail_authentication()
        self._sealed.popleft()
        return True

    async def _receive(self) -> bool:
        """Read from the connection and queue the whole sealed messages it completes, without
        copying the read; False at the end of the connection.

        A message cut by the previous read is completed from the start of this one.
        """
        received = await self._raw.read(RAW_READ_BYTES)
        if not received:
            return False
        view = memoryview(received)
        offset = 0
        if self._ciphertext:
            pending = self._ciphertext
            head = memoryview(pending + view[:NOISE_MAX_WIRE_BYTES])
            spanned = self._queue_messages(head)
            if spanned < len(pending):  # still cut: `head` holds all of this read
                self._ciphertext = bytes(head)
                return True
            offset = spanned - len(pending)
        offset += self._queue_messages(view[offset:])
        self._ciphertext = bytes(view[offset:])
        return True

    def _queue_messages(self, ciphertext: memoryview) -> int:
        """Queue views of the whole messages at the start of `ciphertext`, without their length
        prefixes; returns the bytes they span."""
        start = 0
        while len(ciphertext) - start >= _NOISE_LENGTH.size:
            (length,) = _NOISE_LENGTH.unpack_from(ciphertext, start)
            end = start + _NOISE_LENGTH.size + length
            if end > len(ciphertext):
                break
            self._sealed.append(ciphertext[start + _NOISE_LENGTH.size : end])
            start = end
        return start

    def _open(self, sealed: memoryview) -> bytes:
        """Decrypt one message with the next nonce, as the cipher state's decrypt_with_ad
        would; raises InvalidTag if it fails authentication (the nonce is then not spent)."""
        state = self._opener
        if not self._direct_open:
            return bytes(state.decrypt_with_ad(None, sealed))
        message = state.cipher.cipher.decrypt(_next_nonce(state), sealed, None)
        state.n += 1
        return message

    def _open_into(self, sealed: memoryview, target: memoryview) -> None:
        """Decrypt one message with the next nonce straight into `target` (as long as its
        plaintext); raises InvalidTag if it fails authentication, and `target` then holds
        nothing to be used."""
        state = self._opener
        if not self._direct_open:
            target[:] = self._open(sealed)
            return
        state.cipher.cipher.decrypt_into(_next_nonce(state), sealed, None, target)
        state.n += 1

    async def _fail_authentication(self) -> NoReturn:
        """Drop everything received and close the connection: after a forged or damaged
        message nothing more on it can be trusted."""
        self._sealed.clear()
        self._opened.clear()
        self._ciphertext = b""
        await self._raw.close()
        raise RawConnError("a Noise message failed authentication") from None


def _next_nonce(state: Any) -> bytes:
    """The nonce a Noise cipher state spends next, formatted for ChaCha20Poly1305 (the caller
    advances `state.n` once the message is sealed or opened)."""
    if state.n == NOISE_MAX_NONCE:
        raise NoiseMaxNonceError("Nonce has depleted!")
    return _NOISE_NONCE.pack(state.n)


def _is_keyed_chacha(state: Any) -> bool:
    """Whether a Noise cipher state is keyed and runs cryptography's ChaCha20Poly1305 (as
    `state.cipher.cipher`, with encrypt_into), whose nonces _NOISE_NONCE formats."""
    cipher = getattr(state, "cipher", None)
    return (
        isinstance(cipher, ChaCha20Cipher)
        and state.has_key()
        and hasattr(getattr(cipher, "cipher", None), "encrypt_into")
    )


class _CancelSafeNoiseTransport(NoiseTransport):
    """Noise over _CancelSafeRawConnection, so a cancelled stream write ends only that stream,
    with _BatchedNoiseSession carrying the data once the handshake is done."""

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        raw = _CancelSafeRawConnection(conn)
        session = await super().secure_inbound(raw)
        return _BatchedNoiseSession(session, raw)  # type: ignore[arg-type]

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID) -> ISecureConn:
        raw = _CancelSafeRawConnection(conn)
        session = await super().secure_outbound(raw, peer_id)
        return _BatchedNoiseSession(session, raw)  # type: ignore[arg-type]


class _StreamBuffer:
    """Received, unread bytes as a queue of the chunks they arrived in: a Yamux stream's buffer,
    and the Noise session's opened messages.

    py-libp2p keeps them in a bytearray, appended at the end and cut from the front. Once bytes
    have been cut from its front, CPython moves the whole bytearray to grow it, so with megabytes
    of a fast transfer waiting to be read every arriving message copies all of them (measured:
    1.5 ms of CPU per MiB at a 4 MiB backlog, against 0.13 ms with none). Here a chunk is kept as
    it came (opened Noise messages are immutable bytes, kept without a copy) and reads copy only
    what they take. The class answers what py-libp2p's Yamux asks of a stream buffer: len, truth,
    extend, bytes(), a prefix slice, deleting a prefix, and clear.
    """

    __slots__ = ("_chunks", "_offset", "_size")

    def __init__(self, data: bytes | bytearray | memoryview = b"") -> None:
        self._chunks: deque[bytes | memoryview] = deque()
        self._offset = 0  # bytes already taken of the first chunk
        self._size = 0
        self.extend(data)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def extend(self, data: bytes | bytearray | memoryview) -> None:
        """Append `data`; bytes and views of bytes are kept as they are, anything mutable is
        copied."""
        if not len(data):
            return
        if not isinstance(data, bytes) and not (
            isinstance(data, memoryview) and isinstance(data.obj, bytes)
        ):
            data = bytes(data)
        self._chunks.append(data)
        self._size += len(data)

    def __iadd__(self, data: bytes | bytearray | memoryview) -> _StreamBuffer:
        self.extend(data)
        return self

    def take(self, count: int) -> bytes:
        """Remove and return the first `count` bytes (all of them if fewer are buffered)."""
        parts = list(self.pop_parts(min(count, self._size)))
        if len(parts) == 1 and isinstance(parts[0], bytes):
            return parts[0]
        return b"".join(parts)

    def take_into(self, target: memoryview) -> int:
        """Move up to len(target) bytes into the start of `target`; returns how many."""
        count = min(len(target), self._size)
        filled = 0
        for part in self.pop_parts(count):
            target[filled : filled + len(part)] = part
            filled += len(part)
        return count

    def pop_parts(self, count: int) -> Iterator[bytes | memoryview]:
        """Remove the first `count` bytes (at most len(self)), as whole chunks or views of
        them."""
        self._size -= count
        while count > 0:
            first, start = self._chunks[0], self._offset
            end = min(len(first), start + count)
            yield first if start == 0 and end == len(first) else memoryview(first)[start:end]
            count -= end - start
            if end == len(first):
                self._chunks.popleft()
                self._offset = 0
            else:
                self._offset = end

    def _peek(self) -> bytes:
        if not self._chunks:
            return b""
        with memoryview(self._chunks[0]) as first:
            head = first[self._offset :]
            return b"".join([head, *list(self._chunks)[1:]])

    def __bytes__(self) -> bytes:
        return self._peek()

    def __getitem__(self, key: slice) -> bytes:
        if not isinstance(key, slice):
            raise TypeError("a stream buffer is read by slices")
        return self._peek()[key]

    def __delitem__(self, key: slice) -> None:
        if not isinstance(key, slice):
            raise TypeError("a stream buffer is cut by slices")
        start, stop, step = key.indices(self._size)
        if start == 0 and step == 1:
            for _ in self.pop_parts(max(0, stop)):
                pass
            return
        rest = bytearray(self._peek())  # not a prefix: py-libp2p never does this
        del rest[key]
        self.clear()
        self.extend(bytes(rest))

    def clear(self) -> None:
        self._chunks.clear()
        self._offset = 0
        self._size = 0


class _BatchedYamuxStream(YamuxStream):
    """A Yamux stream whose writes go out as few, large frames, and whose reads and window
    updates cost less.

    py-libp2p writes a frame of at most 64 KiB at a time, taking two locks and a trip through
    the scheduler per frame, and polls every 10 ms while the peer grants no window. Here a
    write takes as much of the send window as it can (up to YAMUX_WRITE_BATCH_BYTES), the
    connection writes it as frames of up to YAMUX_FRAME_PAYLOAD_BYTES at once, and a window
    update wakes a waiting writer. Frames of concurrent writes to one stream may interleave,
    as in py-libp2p. Reads take buffered bytes directly, and the peer is granted window in
    halves of the target window rather than after every read; or the reader lends buffers for
    the frame reader to open the payload into, and the window is their room (see `lend`).
    """

    conn: _BatchedYamux
    _window_opened: trio.Event
    _filling: deque[memoryview]  # buffers lent and not full yet; the first one is filling
    _fill_at: int  # bytes in the first of them
    _full: deque[memoryview]  # buffers lent and full, not yet returned by next_filled

    async def write(self, data: bytes) -> None:
        sent = 0
        with memoryview(data) as view:
            while sent < len(view):
                await self._wait_for_send_window()
                batch = min(self.send_window, len(view) - sent, YAMUX_WRITE_BATCH_BYTES)
                self.send_window -= batch
                await self.conn.write_data_frames(self.stream_id, view[sent : sent + batch])
                sent += batch

    async def read(self, n: int | None = -1) -> bytes:
        """Up to `n` bytes straight from the stream's buffer while the stream is open and has
        some; waiting, the end of the stream, a reset and reading all (`n` of -1) are left to
        py-libp2p, whose every read takes its stream-table lock and formats a few debug
        messages."""
        buffer = self._readable_buffer()
        if n is None or n <= 0 or buffer is None:
            return await super().read(n)
        data = buffer.take(n)
        await self._auto_tune_and_send_window_update(bytes_read=len(data))
        return data

    async def read_buffered_into(self, target: memoryview) -> int:
        """Move buffered bytes straight into `target` (copied once); 0 when none are buffered
        or the stream is closing, for the caller to wait in `read`. With none buffered, the peer
        is granted window first if it has little: after `reclaim` it may have none left, and
        py-libp2p grants window only after a read that found bytes."""
        buffer = self._readable_buffer()
        if buffer is None:
            if not self._receiving_ended():
                await self._auto_tune_and_send_window_update()
            return 0
        count = buffer.take_into(target)
        await self._auto_tune_and_send_window_update(bytes_read=count)
        return count

    # A reader that knows how much is coming (a blob download) lends the stream buffers ahead
    # of the bytes, in order, and the frame reader opens the payload straight into them: no
    # fresh memory per Noise message and no copy afterwards. The window granted to the peer is
    # the room left in the lent buffers, so nothing overflows into the stream's buffer.

    def lend(self, buffer: memoryview) -> None:
        """Lend `buffer` (not empty) to be filled after those lent before it; it is the stream's
        until `next_filled` returns it or `reclaim` takes it back."""
        self._filling.append(buffer)

    def has_buffered(self) -> bool:
        """Whether bytes wait in the stream's own buffer (they come before any lent buffer)."""
        return bool(self.conn.stream_buffers.get(self.stream_id))

    def take_buffered_into(self, target: memoryview) -> int:
        """Move bytes from the stream's own buffer into the start of `target`, without waiting;
        returns how many."""
        buffer = self.conn.stream_buffers.get(self.stream_id)
        return buffer.take_into(target) if isinstance(buffer, _StreamBuffer) else 0

    async def grant_lent_space(self) -> None:
        """Let the peer send as much as the lent buffers have room for, beyond what it may send
        already and what waits in the stream's buffer. The peer can then fill every lent
        buffer; a reader lends and grants once per buffer filled, so updates come about one
        buffer apart and the peer's credit stays near the whole room (what a long link needs)."""
        room = sum(map(len, self._filling)) - self._fill_at
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        increment = room - self.recv_window - buffered
        if increment <= 0:
            return
        self.recv_window += increment
        await self.send_window_update(increment)

    async def next_filled(self) -> memoryview | None:
        """The next lent buffer, once it is full; None once no more will fill in order: none is
        lent, the stream is ending or was reset, or bytes wait in its own buffer (sent beyond
        the lent room, or while none was lent). `reclaim` then takes the buffers back."""
        while not self._full:
            event = self.conn.stream_events.get(self.stream_id)
            if event is None or not self._filling or self.has_buffered() or self._receiving_ended():
                return None
            if event.is_set():  # an old wakeup: the state it announced was seen above
                event = self.conn.stream_events[self.stream_id] = trio.Event()
            await event.wait()
        return self._full.popleft()

    def reclaim(self) -> int:
        """Take back every lent buffer not yet returned by `next_filled`; returns how many bytes
        they received, which fill them in the order they were lent. The frame reader writes
        into none of them after this."""
        arrived = sum(map(len, self._full)) + self._fill_at
        self._full.clear()
        self._filling.clear()
        self._fill_at = 0
        return arrived

    def lent_space(self, most: int) -> memoryview | None:
        """Where the frame reader puts the next at most `most` bytes: the unfilled part of the
        first lent buffer not yet full; None when none is lent, or when bytes wait in the
        stream's buffer (they come first)."""
        if not self._filling or self.has_buffered():
            return None
        return self._filling[0][self._fill_at : self._fill_at + most]

    def lent_filled(self, count: int) -> bool:
        """Record `count` more bytes in the buffer `lent_space` gave; True if that filled it."""
        self._fill_at += count
        if self._fill_at < len(self._filling[0]):
            return False
        self._full.append(self._filling.popleft())
        self._fill_at = 0
        return True

    def _receiving_ended(self) -> bool:
        return bool(
            self.closed
            or self.recv_closed
            or self.reset_received
            or self.conn.event_shutting_down.is_set()
        )

    def _readable_buffer(self) -> _StreamBuffer | None:
        """The stream's buffer while it is open and holds bytes (_batched made it a
        _StreamBuffer); None leaves waiting and the stream's end to py-libp2p."""
        buffer = self.conn.stream_buffers.get(self.stream_id)
        if not isinstance(buffer, _StreamBuffer) or not buffer or self.closed or self.recv_closed:
            return None
        return buffer

    @property
    def send_window(self) -> int:
        """Bytes the peer lets us send; Yamux's frame loop raises it on each window update."""
        return self._send_window

    @send_window.setter
    def send_window(self, value: int) -> None:
        self._send_window = value
        if value > 0:
            self._window_opened.set()

    async def _wait_for_send_window(self) -> None:
        """Return once the peer lets us send; raise if the stream closes, or if no window
        update comes within YAMUX_WINDOW_WAIT_TIMEOUT_S (py-libp2p's limit). A window update
        wakes the writer at once; a closing is noticed within YAMUX_WINDOW_POLL_INTERVAL_S."""
        if self._may_send():
            return
        with trio.move_on_after(YAMUX_WINDOW_WAIT_TIMEOUT_S):
            while not self._may_send():
                self._zero_window_waits += 1
                self._window_opened = trio.Event()
                with trio.move_on_after(YAMUX_WINDOW_POLL_INTERVAL_S):
                    await self._window_opened.wait()
            return
        raise MuxedStreamError(
            f"Timed out waiting for window update after {YAMUX_WINDOW_WAIT_TIMEOUT_S} seconds."
        )

    def _may_send(self) -> bool:
        """Whether the send window is open; raises if the stream is closed for sending."""
        if self.send_closed:
            raise MuxedStreamError("Stream is closed for sending")
        if self.closed:
            raise MuxedStreamError("Stream is closed")
        return self.send_window > 0

    async def _auto_tune_and_send_window_update(self, *, bytes_read: int = 0) -> None:
        """Grant the peer more window once half the target window is free, as go-yamux does.

        py-libp2p grants the bytes of every read at once: a frame, a Noise message and a socket
        write per read. The target window still grows towards py-libp2p's 16 MiB maximum as the
        transfer rate asks for it. The peer is never left waiting: once the reader has taken
        every buffered byte, the whole target window is free.
        """
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        free = self.target_recv_window - (self.recv_window + buffered)
        if free <= 0 or free < self.target_recv_window // 2:
            return
        increment = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
        await self.send_window_update(increment)


class _BatchedYamux(Yamux):
    """py-libp2p's Yamux with _BatchedYamuxStream streams, _EagerLock locks and a
    _YamuxFrameReader under its frame loop, writing frames without py-libp2p's per-frame debug
    decoding and extra trip through the scheduler."""

    def __init__(self, session: _BatchedNoiseSession, peer_id: ID, is_initiator: bool) -> None:
        super().__init__(session, peer_id, is_initiator=is_initiator)
        self.session = session
        self.secured_conn = _YamuxFrameReader(session, self)  # type: ignore[assignment]
        self.streams_lock = _EagerLock()  # type: ignore[assignment]
        self._write_lock = _EagerLock()  # type: ignore[assignment]

    async def _write_frame(self, data: bytes) -> None:
        async with self._write_lock:
            await self.session.write(data)

    async def write_data_frames(self, stream_id: int, payload: memoryview) -> None:
        """Write `payload` to a stream as DATA frames of up to YAMUX_FRAME_PAYLOAD_BYTES, in one
        connection write. Each frame's header and payload are separate parts of the write, so
        the payload is sealed from where it lies, and a receiving _BatchedNoiseSession finds it
        in whole Noise messages that it can open straight into the reader's buffer."""
        parts: list[bytes | memoryview] = []
        for start in range(0, len(payload), YAMUX_FRAME_PAYLOAD_BYTES):
            piece = payload[start : start + YAMUX_FRAME_PAYLOAD_BYTES]
            parts += (_YAMUX_HEADER.pack(0, TYPE_DATA, 0, stream_id, len(piece)), piece)
        async with self._write_lock:
            await self.session.write_parts(parts)

    async def open_stream(self) -> YamuxStream:
        return _batched(await super().open_stream())

    async def accept_stream(self) -> IMuxedStream:
        return _batched(await super().accept_stream())  # type: ignore[arg-type]


class _YamuxFrameReader:
    """The secured connection as py-libp2p's Yamux frame loop reads it: a plain DATA frame for
    an open stream goes from the Noise session straight into the buffer its reader lent (see
    _BatchedYamuxStream.lend) or else into the stream's buffer, and the loop sees
    only the other frames.

    The loop reads each frame body through two intermediate copies (fresh memory each, and the
    kernel's page faults on it), under a deadline, with half a dozen debug messages formatted
    whether or not they are logged: for a blob, most of the cost of receiving it. A DATA frame
    that opens, acknowledges, closes or resets a stream, or that is for a stream closing or
    unknown, still goes to the loop, as does every other frame. The body of a frame taken here
    must arrive within YAMUX_DATA_READ_TIMEOUT_S, as in the loop. Every other attribute is the
    session's.
    """

    def __init__(self, session: _BatchedNoiseSession, yamux: _BatchedYamux) -> None:
        self._session = session
        self._yamux = yamux
        self._body_left = 0  # bytes of the body of a frame passed to the loop, not yet read

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    async def read(self, n: int | None = None) -> bytes:
        if self._body_left:
            data = await self._session.read(min(n or self._body_left, self._body_left))
            self._body_left -= len(data)
            return data
        while True:
            header = await self._session.read(_YAMUX_HEADER.size)
            if len(header) < _YAMUX_HEADER.size:
                return header  # the connection ended; the loop sees it
            _, frame_type, flags, stream_id, length = _YAMUX_HEADER.unpack(header)
            if not self._takes(frame_type, flags, stream_id, length):
                self._body_left = length if frame_type == TYPE_DATA else 0
                return header
            await self._take_data(stream_id, length)

    def _takes(self, frame_type: int, flags: int, stream_id: int, length: int) -> bool:
        if frame_type != TYPE_DATA or flags or not 0 < length <= YAMUX_MAX_WINDOW_SIZE:
            return False
        stream = self._yamux.streams.get(stream_id)
        return (
            stream is not None
            and not (stream.closed or stream.recv_closed or stream.reset_received)
            and stream_id in self._yamux.stream_buffers
        )

    async def _take_data(self, stream_id: int, length: int) -> None:
        """Read a DATA frame's body into the buffer its stream's reader lent (as much as fits)
        and its stream's buffer (the rest), and wake the stream's reader."""
        stream = self._yamux.streams[stream_id]
        if length > stream.recv_window:
            logger.warning(
                "stream %d of %s: the peer sent %d bytes beyond the receive window",
                stream_id,
                self._yamux.peer_id,
                length - stream.recv_window,
            )
        stream.recv_window = max(0, stream.recv_window - length)
        lender = stream if isinstance(stream, _BatchedYamuxStream) else None  # not yet accepted
        # Looked up once: a stream reset while its frame arrives leaves the table, and the rest
        # of the frame must still be read (into the buffer it had) for the next frame's sake.
        buffer = self._yamux.stream_buffers[stream_id]
        wake = False
        with trio.fail_after(YAMUX_DATA_READ_TIMEOUT_S):
            while length > 0:
                await self._session.wait_readable()
                # Asked again after every wait: a reader may have lent buffers meanwhile (the
                # rest of a frame that began before it did goes into them), or given up and
                # taken its buffers back.
                lent = None if lender is None else lender.lent_space(length)
                if lent is None:
                    count = await self._session.read_available_to(buffer, length)
                    wake = True
                else:
                    count = await self._session.read_available_into(lent)
                    wake = lender.lent_filled(count) or wake  # type: ignore[union-attr]
                length -= count
        event = self._yamux.stream_events.get(stream_id)
        if event is not None and wake:  # bytes buffered, or a lent buffer full
            event.set()


def _batched(stream: YamuxStream) -> _BatchedYamuxStream:
    """Make a stream a _BatchedYamuxStream. Yamux builds its streams itself, inbound ones deep
    in its frame loop, but no method of a stream runs before it is opened or accepted. The
    send window moves from the plain attribute to the property that wakes a waiting writer, and
    the stream's bytearray buffer (with anything already in it) becomes a _StreamBuffer."""
    send_window = stream.__dict__.pop("send_window")
    buffers = stream.conn.stream_buffers
    if stream.stream_id in buffers:
        buffers[stream.stream_id] = _StreamBuffer(buffers[stream.stream_id])
    stream.__class__ = _BatchedYamuxStream
    assert isinstance(stream, _BatchedYamuxStream)
    stream._window_opened = trio.Event()
    stream._filling, stream._fill_at, stream._full = deque(), 0, deque()
    stream.send_window = send_window
    return stream


class _BatchedMuxerMultistream(MuxerMultistream):
    """Negotiates /yamux/1.0.0 as py-libp2p does, then runs _BatchedYamux on the connection:
    py-libp2p 0.8.1 builds its own Yamux for that protocol, whatever class muxer_opt names."""

    async def new_conn(self, conn: ISecureConn, peer_id: ID) -> IMuxedConn:
        await self.select_transport(conn)  # type: ignore[arg-type]
        assert isinstance(conn, _BatchedNoiseSession)
        muxed_conn = _BatchedYamux(conn, peer_id, is_initiator=conn.is_initiator)
        return self._annotate_connection(muxed_conn, conn, TProtocol(YAMUX_PROTOCOL_ID))


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

    @property
    def bytes_served(self) -> int:
        """Total blob bytes this host has sent to peers."""
        return self._bytes_served

    def fetch_blob(self, peer_id: str, sha256: str, size: int, timeout: float = 300) -> Path:
        """Download a blob from a peer into the blob store; returns its path.

        Resumes from the partial download left by an earlier attempt and verifies the sha256.
        Raises BlobFetchError (partial kept) or BlobCorrupted (partial deleted).
        """
        validate_blob_id(sha256)
        if self.blob_store.has(sha256):
            return self.blob_store.path(sha256)
        if size < 0:
            raise ValueError(f"blob size must be non-negative, got {size}")
        if size > self.max_blob_bytes:
            raise BlobFetchError(
                f"blob {sha256} of {size} bytes exceeds the limit of {self.max_blob_bytes} bytes"
            )
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
        validate_blob_id(sha256)
        if self.blob_store.has(sha256):
            return self.blob_store.path(sha256)
        if size < 0:
            raise ValueError(f"blob size must be non-negative, got {size}")
        if attempts_per_peer < 1:
            raise ValueError(f"attempts_per_peer must be at least 1, got {attempts_per_peer}")
        if size > self.max_blob_bytes:
            raise BlobFetchError(
                f"blob {sha256} of {size} bytes exceeds the limit of {self.max_blob_bytes} bytes"
            )
        holders = [peer_id for peer_id in dict.fromkeys(peer_ids) if peer_id != self.peer_id]
        if not holders:
            raise BlobFetchError(f"no peer to fetch blob {sha256} from (holders: {peer_ids!r})")
        return self._call(
            self._fetch_blob_from_any, holders, sha256, size, timeout, attempts_per_peer
        )

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
                    NOISE_PROTOCOL_ID: _CancelSafeNoiseTransport(
                        self.key_pair, noise_privkey=create_x25519_key_pair().private_key
                    )
                },
                muxer_opt={YAMUX_PROTOCOL_ID: _BatchedYamux},
                listen_addrs=[listen_addr],
            )
            upgrader = host.get_network().upgrader  # type: ignore[attr-defined]
            upgrader.muxer_multistream = _BatchedMuxerMultistream(
                {TProtocol(YAMUX_PROTOCOL_ID): _BatchedYamux},
                upgrader.muxer_multistream.negotiate_timeout,
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
            pubsub = _GuardedPubsub(host, gossipsub, strict_signing=True)
            host.set_stream_handler(BLOB_PROTOCOL_ID, self._serve_blob_stream)
            self._host, self._pubsub, self._gossipsub = host, pubsub, gossipsub
            try:
                async with (
                    host.run(listen_addrs=[listen_addr]),
                    background_trio_service(pubsub),
                    background_trio_service(gossipsub),
                ):
                    await pubsub.wait_until_ready()
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
            await _answer_and_close(stream, _error_header("busy: too many concurrent streams"))
            return
        self._active_streams[remote] += 1
        try:
            await self._answer_blob_request(stream, remote)
        except _BlobRequestRefused as refusal:
            logger.info("refused a blob request from %s: %s", remote, refusal)
            await _answer_and_close(stream, _error_header(str(refusal)))
        except Exception as error:
            logger.info("blob stream from %s ended early: %r", remote, error)
            await _reset_quietly(stream)
        finally:
            self._active_streams[remote] -= 1
            if self._active_streams[remote] <= 0:
                del self._active_streams[remote]

    async def _answer_blob_request(self, stream: INetStream, remote: str) -> None:
        request: dict[str, Any] | None = None
        with trio.move_on_after(BLOB_REQUEST_READ_TIMEOUT_S):
            request = await _read_frame(stream, MAX_BLOB_REQUEST_BYTES)
        if request is None:
            raise _BlobRequestRefused("no request received in time")
        sha256, offset, length = _parse_blob_request(request)
        with self._served_lock:
            served = sha256 in self._served
        if not served:
            raise _BlobRequestRefused("not served")
        path = self.blob_store.path(sha256)
        try:
            blob_file = open(path, "rb")
        except FileNotFoundError:
            raise _BlobRequestRefused("not available") from None
        with blob_file:
            size = _file_size(blob_file)
            if offset > size:
                raise _BlobRequestRefused(f"offset {offset} is beyond the blob size {size}")
            length = min(length, size - offset)
            header = {"ok": True, "size": size, "length": length, "error": None}
            await stream.write(_frame(msgpack.packb(header)))
            blob_file.seek(offset)
            await self._send_from_file(stream, blob_file, length, sha256)
        logger.debug("served %d bytes of blob %s to %s", length, sha256, remote)
        await stream.close()

    async def _send_from_file(
        self, stream: INetStream, blob_file: BinaryIO, length: int, sha256: str
    ) -> None:
        """Send `length` bytes of the file from where it stands, BLOB_CHUNK_BYTES at a time.

        A child task reads the chunks into BLOB_SEND_BUFFERS reusable buffers, ahead of the
        sending: the next chunk is read while this one is written. A chunk the page cache
        holds is copied at once (_read_cached); what of it must come from the disk is read in
        a worker thread, so the event loop never waits for the disk, and every chunk but the
        last is whole (a short one would leave every later frame across two of the receiver's
        buffers). Read in turn, the event loop sat idle for each read's trip through a worker
        thread, a quarter of a loopback transfer. An error of either side is raised once both
        have stopped.
        """
        free_send, free = trio.open_memory_channel[memoryview](BLOB_SEND_BUFFERS)
        # Never more items than buffers, and the one error: sending never waits.
        filled_send, filled = trio.open_memory_channel[tuple[memoryview, int] | Exception](
            BLOB_SEND_BUFFERS + 1
        )
        buffers = _TRANSFER_BUFFERS.take(BLOB_SEND_BUFFERS)
        for buffer in buffers:
            free_send.send_nowait(buffer)

        async def read_ahead() -> None:
            remaining, position = length, blob_file.tell()
            descriptor = blob_file.fileno()
            try:
                if hasattr(os, "posix_fadvise"):  # the kernel's readahead, for what is not cached
                    os.posix_fadvise(descriptor, position, length, os.POSIX_FADV_SEQUENTIAL)
                while remaining > 0:
                    buffer = await free.receive()
                    wanted = buffer[: min(remaining, BLOB_CHUNK_BYTES)]
                    count = _read_cached(descriptor, wanted, position)
                    if count < len(wanted):  # the rest (or the end) is the disk's to tell
                        count += await trio.to_thread.run_sync(
                            os.preadv, descriptor, [wanted[count:]], position + count
                        )
                    if not count:
                        raise OSError(f"blob {sha256} shrank while being served")
                    filled_send.send_nowait((buffer, count))
                    remaining -= count
                    position += count
            except Exception as error:  # raised by the sender, outside the nursery
                filled_send.send_nowait(error)

        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_ahead)
            sent = 0
            while sent < length:
                item = await filled.receive()
                if isinstance(item, Exception):
                    failure = item
                    break
                buffer, count = item
                try:
                    # A peer that stops reading must not hold its stream slot forever.
                    with trio.fail_after(BLOB_WRITE_STALL_TIMEOUT_S):
                        await stream.write(buffer[:count])  # type: ignore[arg-type]
                except Exception as error:
                    failure = error
                    break
                sent += count
                self._bytes_served += count
                free_send.send_nowait(buffer)
            nursery.cancel_scope.cancel()  # a reader still waiting for a buffer
        # Both sides have stopped: no read fills a buffer now, and a written one was sealed.
        _TRANSFER_BUFFERS.give(buffers)
        if failure is not None:
            raise failure

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
                        logger.info(
                            "resuming blob %s at byte %d of %d from %s",
                            sha256,
                            resumed_from,
                            size,
                            holder,
                        )
                    try:
                        return await self._download_and_commit(remote, sha256, size, timeout)
                    except BlobCorrupted as error:
                        errors.append(f"attempt {attempt}: {error}")
                        logger.warning(
                            "blob %s from %s failed its sha256 check (resumed from byte %d); "
                            "fetching it again from scratch",
                            sha256,
                            holder,
                            resumed_from,
                        )
                        if resumed_from == 0:
                            break  # every byte came from this holder: it holds a bad copy
                    except BlobFetchError as error:
                        errors.append(f"attempt {attempt}: {error}")
                        if attempt < attempts_per_peer:
                            delay = _backoff_delay(
                                attempt, FETCH_RETRY_INITIAL_DELAY_S, FETCH_RETRY_MAX_DELAY_S
                            )
                            logger.info(
                                "fetching blob %s from %s failed (%s); retrying in %.2f s",
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
        partial, have, digest = await trio.to_thread.run_sync(
            self.blob_store.resume_partial, sha256
        )
        if have > size:
            logger.warning("partial of blob %s is longer than the blob; restarting", sha256)
            self.blob_store.discard_partial(sha256)
            partial, have, digest = self.blob_store.resume_partial(sha256)
        if have < size:
            try:
                with trio.fail_after(timeout):
                    await self._download_range(remote, sha256, size, partial, have, digest)
            except trio.TooSlowError:
                raise BlobFetchError(
                    f"fetching blob {sha256} from {remote} timed out after {timeout} s; "
                    "the partial download is kept for resuming"
                ) from None
            finally:
                if have == 0:
                    self.blob_store.discard_partial_if_empty(sha256)
        return await trio.to_thread.run_sync(self.blob_store.commit_partial, sha256, digest)

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

    async def _open_blob_stream(self, remote: ID, request: bytes) -> INetStream:
        """Open a blob stream to `remote` and send `request` on it, negotiating the protocol
        lazily: the multistream-select header, the protocol and the request go out in one
        write, and the peer's two answers are read afterwards. A stock client waits a round trip
        for each answer before its first request byte; here a fetch waits for none. A peer that
        answers "na" has read the request as its next proposal; the stream is reset."""
        assert self._host is not None
        failed = f"could not open a blob stream to {remote}"
        try:
            stream = await self._host.get_network().new_stream(remote)
        except Exception as error:
            raise BlobFetchError(f"{failed}: {error}") from error
        try:
            with trio.fail_after(BLOB_NEGOTIATE_TIMEOUT_S):
                await stream.write(_BLOB_PROPOSAL + request)
                communicator = MultiselectCommunicator(stream)
                answers = [await communicator.read() for _ in range(2)]
        except trio.TooSlowError as error:
            await _reset_quietly(stream)
            reason = f"no answer within {BLOB_NEGOTIATE_TIMEOUT_S} s"
            raise BlobFetchError(f"{failed}: {reason}") from error
        except Exception as error:
            # A peer that answers "na" may reset the stream on reading the request as its next
            # proposal, before its answers are read here.
            await _reset_quietly(stream)
            cause = "" if error.__cause__ is None else f" ({error.__cause__!r})"
            raise BlobFetchError(
                f"{failed}: the stream failed before the peer accepted the blob protocol: "
                f"{error}{cause}"
            ) from error
        except BaseException:  # cancelled
            await _reset_quietly(stream)
            raise
        if not is_valid_handshake(answers[0]) or answers[1] != BLOB_PROTOCOL_ID:
            await _reset_quietly(stream)
            refused = answers[1] == PROTOCOL_NOT_FOUND_MSG
            raise BlobFetchError(
                f"{failed}: "
                + ("it does not serve the blob protocol" if refused else f"it answered {answers!r}")
            )
        stream.set_protocol(BLOB_PROTOCOL_ID)
        return stream

    async def _download_range(
        self, remote: ID, sha256: str, size: int, partial: Path, offset: int, digest: hashlib._Hash
    ) -> None:
        wanted = size - offset
        request = _frame(msgpack.packb({"sha256": sha256, "offset": offset, "length": wanted}))
        stream = await self._open_blob_stream(remote, request)
        try:
            header = _parse_blob_header(await _read_frame(stream, MAX_BLOB_RESPONSE_HEADER_BYTES))
            if not header["ok"]:
                raise BlobFetchError(f"peer {remote} refused blob {sha256}: {header['error']}")
            if header["size"] != size:
                raise BlobFetchError(
                    f"peer {remote} has blob {sha256} with {header['size']} bytes, expected {size}"
                )
            if header["length"] != wanted:
                raise BlobFetchError(
                    f"peer {remote} offered {header['length']} bytes of blob {sha256}, "
                    f"asked for {wanted}"
                )
            await _receive_into(stream, partial, wanted, digest)
        except BlobFetchError:
            await _reset_quietly(stream)
            raise
        except Exception as error:
            await _reset_quietly(stream)
            raise BlobFetchError(
                f"transfer of blob {sha256} from {remote} failed: {error!r}; "
                "the partial download is kept for resuming"
            ) from error
        except BaseException:  # cancelled (timeout or host stopping): tell the server at once
            await _reset_quietly(stream)
            raise
        await _close_quietly(stream)


# Wire format: a 4-byte big-endian length, then a msgpack map; blob bytes follow the response.


def _frame(payload: bytes) -> bytes:
    return _FRAME_LENGTH.pack(len(payload)) + payload


async def _read_exactly(stream: INetStream, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = await stream.read(count - len(data))
        if not chunk:
            raise EOFError(f"stream ended after {len(data)} of {count} bytes")
        data += chunk
    return bytes(data)


async def _read_frame(stream: INetStream, max_bytes: int) -> dict[str, Any]:
    (length,) = _FRAME_LENGTH.unpack(await _read_exactly(stream, _FRAME_LENGTH.size))
    if length > max_bytes:
        raise _BlobRequestRefused(f"frame of {length} bytes exceeds the limit of {max_bytes}")
    try:
        decoded = msgpack.unpackb(await _read_exactly(stream, length), raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise _BlobRequestRefused(f"frame is not valid msgpack: {error}") from error
    if not isinstance(decoded, dict):
        raise _BlobRequestRefused("frame is not a msgpack map")
    return decoded


def _parse_blob_request(request: dict[str, Any]) -> tuple[str, int, int]:
    sha256, offset, length = request.get("sha256"), request.get("offset"), request.get("length")
    try:
        validate_blob_id(sha256)  # type: ignore[arg-type]
    except InvalidBlobId as error:
        raise _BlobRequestRefused(str(error)) from None
    for name, value in (("offset", offset), ("length", length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise _BlobRequestRefused(f"{name} must be a non-negative integer")
    return sha256, offset, length  # type: ignore[return-value]


def _parse_blob_header(header: dict[str, Any]) -> dict[str, Any]:
    ok = header.get("ok")
    if ok is True:
        size, length = header.get("size"), header.get("length")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (size, length)):
            raise BlobFetchError("blob response header lacks integer size and length")
        return {"ok": True, "size": size, "length": length, "error": None}
    error = header.get("error")
    return {"ok": False, "size": None, "length": None, "error": str(error)[:500]}


def _error_header(error: str) -> bytes:
    return _frame(msgpack.packb({"ok": False, "size": None, "length": None, "error": error}))


async def _receive_into(
    stream: INetStream, partial: Path, count: int, digest: hashlib._Hash
) -> None:
    """Append exactly `count` bytes from the stream to the partial file, feeding them to
    `digest` too, so that the commit need not read the blob back to hash it.

    The bytes are gathered in BLOB_WRITE_BUFFERS buffers of BLOB_CHUNK_BYTES: _PartialWriter
    writes and hashes the full ones, in order, while the next ones fill. On a
    _BatchedYamuxStream the free buffers are lent to the stream ahead of the bytes
    (_receive_lent); what that does not receive is read and copied (_receive_copied). Whatever
    arrived before an error or a cancellation is written before this returns: a correct prefix
    of the rest of the blob, kept for resuming.
    """
    muxed = getattr(stream, "muxed_stream", None)
    with closing(open_for_append(partial)) as partial_file:
        writer = _PartialWriter(partial_file, digest)
        try:
            if isinstance(muxed, _BatchedYamuxStream):
                count -= await _receive_lent(muxed, writer, count)
            await _receive_copied(stream, writer, count)
        finally:
            with trio.CancelScope(shield=True):
                await writer.finish()


async def _receive_lent(stream: _BatchedYamuxStream, writer: _PartialWriter, count: int) -> int:
    """Receive up to `count` bytes into the writer's buffers, each lent to the stream as soon
    as it is free, and hand each to the writer once full; returns how many bytes were handed
    over: `count`, or fewer if the stream ended early or its peer sent beyond the lent room
    (the caller reads the rest, or learns why it cannot, with plain reads). Bytes that arrived
    before anything was lent are copied into the first buffers. Every lent buffer is taken back
    before this returns, and what it received, in order, handed to the writer."""
    lent: deque[tuple[memoryview, int, int]] = deque()  # buffer, bytes copied first, bytes lent
    received, to_lend = 0, count
    try:
        while received < count:
            buffer = None
            if to_lend and not lent:
                buffer = await writer.free_buffer()
            elif to_lend and not stream.has_buffered():
                buffer = writer.free_buffer_nowait()
            if buffer is not None:
                size = min(len(buffer), to_lend)
                to_lend -= size
                copied = 0 if lent else stream.take_buffered_into(buffer[:size])
                if copied == size:
                    writer.write(buffer, size)
                    received += size
                else:
                    stream.lend(buffer[copied:size])
                    lent.append((buffer, copied, size))
                continue  # every free buffer is lent before waiting
            await stream.grant_lent_space()
            if await stream.next_filled() is None:
                break
            buffer, _, size = lent.popleft()
            writer.write(buffer, size)
            received += size
    finally:
        arrived = stream.reclaim()
        for buffer, copied, size in lent:
            got = min(arrived, size - copied)
            arrived -= got
            if copied + got:
                writer.write(buffer, copied + got)
                received += copied + got
            else:
                writer.give_back(buffer)
    return received


async def _receive_copied(stream: INetStream, writer: _PartialWriter, count: int) -> None:
    """Receive exactly `count` bytes by reading them into the writer's buffers (a copy), and
    hand each to the writer once full, and the last one however full on the way out."""
    remaining = count
    batch: memoryview | None = None
    filled = 0
    try:
        while remaining > 0:
            if batch is None:
                batch = await writer.free_buffer()
            received = await _read_into(stream, batch[filled : filled + remaining])
            if not received:
                raise EOFError(f"stream ended with {remaining} bytes still to come")
            filled += received
            remaining -= received
            if filled == len(batch):
                writer.write(batch, filled)
                batch, filled = None, 0
    finally:
        if batch is not None:
            if filled:
                writer.write(batch, filled)
            else:
                writer.give_back(batch)


async def _read_into(stream: INetStream, target: memoryview) -> int:
    """Read at least one byte (none only at the end of the stream) into the start of `target`;
    returns how many. Bytes already buffered by a _BatchedYamuxStream are copied once."""
    muxed = getattr(stream, "muxed_stream", None)
    if isinstance(muxed, _BatchedYamuxStream):
        count = await muxed.read_buffered_into(target)
        if count:
            return count
    chunk = await stream.read(len(target))
    target[: len(chunk)] = chunk
    return len(chunk)


class _PartialWriter:
    """Appends the batches of a download to its partial file and hashes them, in order, in two
    worker threads (one writes, the other hashes what was written), in BLOB_WRITE_BUFFERS
    page-aligned buffers (written to disk without a copy) taken from the process's
    _TRANSFER_BUFFERS and given back by `finish`.

    Disk writes and sha256 both release the GIL: in a thread they overlap the receiving of the next
    batches instead of holding up the host's event loop (sha256 about 0.6 ms of CPU per MiB). The
    file is one from `open_for_append`, written around the page cache where the file system
    allows (0.1-0.2 ms per MiB instead of 0.5-2.9). Several buffers let a slow write or a late
    network read pass without stalling the other side. Every BLOB_SYNC_BYTES the file is synced
    to disk by a _BackgroundSync, so that writeback overlaps the transfer and the writer never
    waits for the disk; what the file still stages is written once the last batch is. After a
    failed write or sync nothing more is written, so the file holds a correct prefix; the error
    is raised by the next `free_buffer` or by `finish`.
    """

    def __init__(self, partial_file: AppendFile, digest: hashlib._Hash) -> None:
        self._file = partial_file
        self._digest = digest
        self._jobs: queue.SimpleQueue[tuple[memoryview, int] | None] = queue.SimpleQueue()
        self._hash_jobs: queue.SimpleQueue[tuple[memoryview, int] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._free_send, self._free = trio.open_memory_channel[memoryview](BLOB_WRITE_BUFFERS)
        for buffer in _TRANSFER_BUFFERS.take(BLOB_WRITE_BUFFERS):
            self._free_send.send_nowait(buffer)
        self._token = trio.lowlevel.current_trio_token()
        self._stopped = trio.Event()  # set once both threads have ended
        self._running_threads = 2
        self._started = False
        self._unsynced = 0  # bytes written since the last sync was asked for
        self._syncer: _BackgroundSync | None = None  # made at the first sync

    async def free_buffer(self) -> memoryview:
        """A buffer to fill, once one is written; raises the error of a failed write."""
        self._raise_error()
        buffer = await self._free.receive()
        self._raise_error()
        return buffer

    def free_buffer_nowait(self) -> memoryview | None:
        """A buffer to fill if one is free now, else None; raises the error of a failed write."""
        self._raise_error()
        try:
            return self._free.receive_nowait()
        except trio.WouldBlock:
            return None

    def give_back(self, buffer: memoryview) -> None:
        """Return a buffer from `free_buffer` unused."""
        self._free_send.send_nowait(buffer)

    def write(self, buffer: memoryview, length: int) -> None:
        """Queue the first `length` bytes of `buffer` (one from `free_buffer`) for writing; leave
        the buffer alone until `free_buffer` hands it out again."""
        if not self._started:
            self._started = True
            for work in (self._work, self._hash):
                trio.lowlevel.start_thread_soon(
                    work, lambda _: self._token.run_sync_soon(self._thread_ended)
                )
        self._jobs.put((buffer, length))

    async def finish(self) -> None:
        """Wait until every queued batch is written (and a sync in flight is done), and raise
        the error of a failed write or sync. A cancellation waits too: the file must stay open
        while the threads use it."""
        if self._started:
            self._jobs.put(None)
            with trio.CancelScope(shield=True):
                await self._stopped.wait()
        self._keep_free_buffers()
        self._raise_error()

    def _keep_free_buffers(self) -> None:
        """Hand the free buffers to the pool for the next transfer; every buffer comes back
        free once the threads have stopped and the stream has had its lent ones taken back (one
        that does not is left to the garbage collector)."""
        free: list[memoryview] = []
        while True:
            try:
                free.append(self._free.receive_nowait())
            except trio.WouldBlock:
                break
        _TRANSFER_BUFFERS.give(free)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _thread_ended(self) -> None:
        self._running_threads -= 1
        if self._running_threads == 0:
            self._stopped.set()

    def _work(self) -> None:
        """The writing thread: writes each batch, then passes it on to the hashing thread, which
        hashes it while the next one is written (a direct write waits for the disk)."""
        try:
            while (job := self._jobs.get()) is not None:
                buffer, length = job
                if self._error is None:
                    try:
                        self._write_batch(buffer[:length])
                    except BaseException as error:  # handed to the event loop, not lost here
                        self._error = error
                if self._error is None:
                    self._hash_jobs.put(job)
                else:  # not written, so not hashed: the digest stays that of the file's bytes
                    self._token.run_sync_soon(self._free_send.send_nowait, buffer)
            if self._error is None:
                try:
                    self._file.flush()  # what the file still stages, written here, off the loop
                except BaseException as error:
                    self._error = error
        finally:
            try:
                if self._syncer is not None:
                    self._syncer.close()
                    self._error = self._error or self._syncer.error
            finally:
                self._hash_jobs.put(None)

    def _hash(self) -> None:
        """The hashing thread: feeds the digest each written batch, in order, and frees its
        buffer; it ends after the writing thread."""
        while (job := self._hash_jobs.get()) is not None:
            buffer, length = job
            try:
                with buffer[:length] as batch:
                    self._digest.update(batch)
            except BaseException as error:  # the download fails; the buffers still come back
                self._error = self._error or error
            self._token.run_sync_soon(self._free_send.send_nowait, buffer)

    def _write_batch(self, batch: memoryview) -> None:
        """Write one batch, ask for a sync every BLOB_SYNC_BYTES, and raise the error of a
        failed sync."""
        with batch:
            self._file.write(batch)
            self._unsynced += len(batch)
        if self._unsynced >= BLOB_SYNC_BYTES:
            self._file.flush()
            self._syncer = self._syncer or _BackgroundSync(self._file.fileno())
            self._syncer.request()
            self._unsynced = 0
        if self._syncer is not None and self._syncer.error is not None:
            raise self._syncer.error


class _BackgroundSync:
    """fdatasync of one file in a thread of its own, started on request and never waited for
    by the one who asks: a download's writer asks every BLOB_SYNC_BYTES and goes on writing
    while the disk catches up (a blocking sync of 16 MiB took 30 ms here, long enough for the
    download's buffers to fill and its stream to stall). Requests made while a sync runs are
    served by one more sync when it ends, which covers everything written by then. `close`
    waits for the sync in flight and skips one only requested (the commit's fsync covers it).
    The first failed sync is kept in `error` and no other is tried.
    """

    def __init__(self, descriptor: int) -> None:
        self._descriptor = descriptor
        self._wakeup = threading.Condition()
        self._requested = False
        self._closing = False
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="skillswarm-blob-sync", daemon=True)
        self._thread.start()

    def request(self) -> None:
        with self._wakeup:
            self._requested = True
            self._wakeup.notify()

    def close(self) -> None:
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not (self._requested or self._closing):
                    self._wakeup.wait()
                if self._closing:
                    return
                self._requested = False
            try:
                _sync_data(self._descriptor)
            except OSError as error:
                self.error = error
                return


# fdatasync where the platform has it (it skips metadata such as the modification time).
_sync_data: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)


def _read_cached(descriptor: int, target: memoryview, position: int) -> int:
    """Read into `target` from `position` what the page cache holds of it, without waiting for
    the disk (Linux's RWF_NOWAIT); returns how many bytes: 0 at the end of the file, when the
    first of them would need the disk, and on a system without RWF_NOWAIT.

    Handing each read of a served blob to a worker thread cost the event loop more CPU than the
    copy (a lock, a wakeup and the result's trip back per chunk); a blob just written or served
    is nearly always cached.
    """
    if _RWF_NOWAIT is None:
        return 0
    try:
        return os.preadv(descriptor, [target], position, _RWF_NOWAIT)
    except BlockingIOError:
        return 0
    except OSError as error:
        if error.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it
            return 0
        raise


def _file_size(blob_file: Any) -> int:
    blob_file.seek(0, 2)
    size = blob_file.tell()
    blob_file.seek(0)
    return int(size)


async def _answer_and_close(stream: INetStream, frame: bytes) -> None:
    try:
        await stream.write(frame)
        await stream.close()
    except Exception as error:
        logger.debug("could not answer a blob stream: %r", error)
        await _reset_quietly(stream)


async def _close_quietly(stream: INetStream) -> None:
    try:
        await stream.close()
    except Exception as error:
        logger.debug("closing a blob stream failed: %r", error)


async def _reset_quietly(stream: INetStream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1):
        try:
            await stream.reset()
        except Exception as error:
            logger.debug("resetting a blob stream failed: %r", error)


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
    try:
        trio.from_thread.run_sync(fn, trio_token=token)
    except trio.RunFinishedError:
        pass
