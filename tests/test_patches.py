"""Each fix of protocol.patches: its bug shown on the unpatched py-libp2p, then gone with the patch.

The unpatched runs happen in a subprocess of their own: patches apply to the whole process, and
another test in this one may already have started a SwarmHost (which applies them).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

# A Noise transport writer over a connection whose writes take 50 ms; its first write_msg is
# cancelled after 10 ms (as a stream write under a timeout is), the second runs to its end. A
# Noise session of the other end then opens, in order, every message that reached the wire.
NOISE_CANCELLED_WRITE = """
import struct, sys
import trio
from noise.connection import NoiseConnection
from libp2p.security.noise.io import NoiseTransportReadWriter
from skillswarm.protocol import patches

if sys.argv[1] == "patched":
    patches.monkey_patch_noise_cancel_safe_write()
    patches.monkey_patch_noise_cancel_safe_write()  # idempotent

def handshake():
    writer, reader = (NoiseConnection.from_name(b"Noise_NN_25519_ChaChaPoly_SHA256") for _ in "ab")
    writer.set_as_initiator()
    reader.set_as_responder()
    writer.start_handshake()
    reader.start_handshake()
    reader.read_message(writer.write_message())
    writer.read_message(reader.write_message())
    return writer, reader

class SlowConnection:
    def __init__(self):
        self.wire = bytearray()
    async def write(self, data):
        await trio.sleep(0.05)
        self.wire += data
    async def read(self, n=None):
        return b""
    async def close(self):
        pass

async def main():
    writer_state, reader_state = handshake()
    connection = SlowConnection()
    writer = NoiseTransportReadWriter(connection, writer_state)
    with trio.move_on_after(0.01):
        await writer.write_msg(b"first")
    await writer.write_msg(b"second")
    wire, opened = bytes(connection.wire), []
    while wire:
        (length,) = struct.unpack(">H", wire[:2])
        try:
            opened.append(reader_state.decrypt(wire[2 : 2 + length]).decode())
        except Exception as error:
            opened.append(type(error).__name__)
        wire = wire[2 + length :]
    print(",".join(opened))

trio.run(main)
"""


def run_scenario(script: str, mode: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_cancelled_noise_write_no_longer_breaks_every_later_message() -> None:
    # py-libp2p 0.8.1: the cancelled write spent nonce 0 without sending; the next message,
    # sealed with nonce 1, fails authentication at the peer, as would every later one.
    assert run_scenario(NOISE_CANCELLED_WRITE, "unpatched") == "NoiseInvalidMessage"
    # Patched: the sealed message is written before the cancellation takes effect.
    assert run_scenario(NOISE_CANCELLED_WRITE, "patched") == "first,second"


def test_a_noise_write_to_a_peer_that_takes_nothing_closes_the_connection() -> None:
    """A shielded write must not hang forever: after the stall timeout the connection is closed
    and the write fails."""
    import trio
    from libp2p.network.connection.exceptions import RawConnError
    from libp2p.security.noise.io import NoiseTransportReadWriter
    from noise.connection import NoiseConnection
    from skillswarm.protocol import patches

    patches.monkey_patch_noise_cancel_safe_write()

    class StuckConnection:
        closed = False

        async def write(self, data: bytes) -> None:
            await trio.sleep_forever()

        async def read(self, n: int | None = None) -> bytes:
            return b""

        async def close(self) -> None:
            self.closed = True

    async def main() -> None:
        state = NoiseConnection.from_name(b"Noise_NN_25519_ChaChaPoly_SHA256")
        peer = NoiseConnection.from_name(b"Noise_NN_25519_ChaChaPoly_SHA256")
        state.set_as_initiator()
        peer.set_as_responder()
        state.start_handshake()
        peer.start_handshake()
        peer.read_message(state.write_message())
        state.read_message(peer.write_message())
        connection = StuckConnection()
        writer = NoiseTransportReadWriter(connection, state)  # type: ignore[arg-type]
        with pytest.raises(RawConnError, match="no room"):
            await writer.write_msg(b"never taken")
        assert connection.closed

    original = patches.NOISE_WRITE_STALL_TIMEOUT_S
    patches.NOISE_WRITE_STALL_TIMEOUT_S = 0.2
    try:
        trio.run(main)
    finally:
        patches.NOISE_WRITE_STALL_TIMEOUT_S = original


def test_a_restarted_gossip_peer_no_longer_reuses_its_message_ids() -> None:
    """Message ids are (origin, sequence number). py-libp2p 0.8.1 starts the numbers at the time
    in whole seconds, so a peer restarted within the same second (or after publishing more
    messages than seconds passed) sends ids the others have already seen, and its new messages
    are dropped. GuardedPubsub starts at the time in nanoseconds."""
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12, GossipSub
    from libp2p.pubsub.pubsub import Pubsub
    from skillswarm.protocol.patches import GuardedPubsub

    key_pair = create_new_key_pair()

    def first_seqnos(make: Any) -> tuple[int, int]:
        before, after = make(), make()  # the same peer, started twice in a row
        return (
            int.from_bytes(before._next_seqno(), "big"),
            int.from_bytes(after._next_seqno(), "big"),
        )

    def stock() -> Pubsub:
        return Pubsub(
            new_host(key_pair=key_pair),
            GossipSub([PROTOCOL_ID_V12], degree=6, degree_low=4, degree_high=12),
        )

    def guarded() -> Pubsub:
        router = GossipSub([PROTOCOL_ID_V12], degree=6, degree_low=4, degree_high=12)
        return GuardedPubsub(new_host(key_pair=key_pair), router, True, 1 << 20)

    before, after = first_seqnos(stock)
    assert after - before <= 1  # the restarted peer's first message takes an id already used
    before, after = first_seqnos(guarded)
    assert after > before + 1_000  # nanoseconds apart: fresh ids
