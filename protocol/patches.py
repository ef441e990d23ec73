"""Fixes for bugs of py-libp2p 0.8.1 (the version pyproject.toml pins) that SwarmHost depends on.

The only module of skillswarm that touches libp2p's internals. `apply_all` applies each once.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

import trio
from libp2p.abc import IHost, INetStream
from libp2p.network.connection.exceptions import RawConnError
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, NoiseTransportReadWriter
from skillswarm.protocol.streams import reset_quietly

__all__ = [
    "NOISE_WRITE_STALL_TIMEOUT_S",
    "GuardedPubsub",
    "apply_all",
    "monkey_patch_noise_cancel_safe_write",
]

logger = logging.getLogger(__name__)

# A connection that cannot take one Noise message (at most 64 KiB) in this time is treated as dead.
NOISE_WRITE_STALL_TIMEOUT_S = 10.0

_lock = threading.Lock()
_applied: set[str] = set()


def monkey_patch_noise_cancel_safe_write() -> None:
    """Make a Noise transport write finish once its message is sealed (libp2p==0.8.1).

    Bug: `NoiseTransportReadWriter.write_msg` encrypts a message with the next nonce, then awaits
    the socket write. A cancellation in that await (a stream write under a timeout, such as a
    blob server's stall timeout or a fetch's deadline) spends the nonce without sending the
    message, or sends half of it. Symptom: the peer fails to decrypt every later message
    (NoiseInvalidMessage) and the whole connection dies, gossip and every other stream included.

    Fix: each message is sealed and written inside a shielded cancel scope; a cancellation takes
    effect after it. A peer that takes no message for NOISE_WRITE_STALL_TIMEOUT_S gets its
    connection closed (RawConnError), so a shielded write never hangs forever. Idempotent.
    """
    with _lock:
        if "noise_cancel_safe_write" in _applied:
            return
        _applied.add("noise_cancel_safe_write")

    async def write_msg(
        self: NoiseTransportReadWriter, msg: bytes, prefix_encoded: bool = False
    ) -> None:
        total = len(msg)
        for start in range(0, max(total, 1), MAX_PLAINTEXT_LENGTH):
            chunk = (
                msg if total <= MAX_PLAINTEXT_LENGTH else msg[start : start + MAX_PLAINTEXT_LENGTH]
            )
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + NOISE_WRITE_STALL_TIMEOUT_S
                sealed = self.encrypt(chunk)
                if prefix_encoded and start == 0:
                    sealed = self.prefix + sealed
                await self.read_writer.write_msg(sealed)
            if scope.cancelled_caught:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await self.read_writer.close()
                raise RawConnError(
                    f"a Noise message found no room for {NOISE_WRITE_STALL_TIMEOUT_S} s; "
                    "closed the connection"
                )
        await trio.lowlevel.checkpoint_if_cancelled()

    NoiseTransportReadWriter.write_msg = write_msg  # type: ignore[method-assign]


def apply_all() -> None:
    """Apply every patch of this module (each only once)."""
    monkey_patch_noise_cancel_safe_write()


class GuardedPubsub(Pubsub):
    """Pubsub with fixes for four bugs of libp2p==0.8.1, each covered by tests/test_host.py.

    - An RPC frame that is not valid protobuf raises out of `stream_handler` and stops the whole
      host (any connected peer could crash it): such a stream is reset and the peer's pubsub
      state dropped, as libp2p already does for oversized frames.
    - The signature check raises (rather than rejecting) on an undecodable public key, and an
      error in a pubsub task stops the pubsub service: such a message is dropped.
    - The replay of recent messages to a joining peer writes to its stream while the peer's
      send queue writes too; a message over one Yamux frame (64 KiB) then interleaves with the
      other writes and the peer reads a corrupt RPC: writes to one stream are serialized.
    - Message sequence numbers start at the time in whole seconds, so a peer that restarts
      within seconds reuses the ids of its earlier messages and the others drop its new ones as
      already seen: they start at the time in nanoseconds instead, as go-libp2p does.
    """

    def __init__(
        self, host: IHost, router: GossipSub, strict_signing: bool, max_inbound_rpc_size: int
    ) -> None:
        super().__init__(
            host, router, strict_signing=strict_signing, max_inbound_rpc_size=max_inbound_rpc_size
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
            await reset_quietly(stream, "gossip stream")
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
