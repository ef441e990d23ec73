"""SwarmHost against a py-libp2p host built by the library alone (no SwarmHost code in it).

Each side dials, and each side serves a blob to the other over the blob wire protocol; a peer
without the protocol refuses it; and Noise messages of every size cross between sessions whose
writes go through protocol.patches.
"""

from __future__ import annotations

import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream, ISecureConn
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from skillswarm.protocol import patches
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.host import BLOB_PROTOCOL_ID, BlobFetchError, SwarmHost
from skillswarm.protocol.identity import load_or_create_identity

pytestmark = pytest.mark.timeout(60)

TOPIC = "skillswarm-interop-test"
# Several Noise messages, Yamux frames and window updates, and a tail that fills none of them.
BLOB_BYTES = (8 << 20) + 7
STOCK_WRITE_BYTES = 1 << 20
TRANSFER_TIMEOUT_S = 30
DIALERS = ["stock peer dials", "SwarmHost dials"]
# Noise messages carry at most 65519 bytes: sizes on each side of one and several of them.
MESSAGE_SIZES = [1, 12, 65_519, 65_520, 3 * 65_519 + 5, (1 << 20) + 3]


@asynccontextmanager
async def stock_peer() -> AsyncIterator[IHost]:
    """A py-libp2p host exactly as the library builds it: stock Noise and stock Yamux."""
    key_pair = create_new_key_pair()
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
    )
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        yield host


async def connect(swarm: SwarmHost, peer: IHost, dialer: str) -> None:
    if dialer == "stock peer dials":
        await peer.connect(info_from_p2p_addr(multiaddr.Multiaddr(swarm.listen_addrs[0])))
    else:
        await trio.to_thread.run_sync(swarm.connect, str(peer.get_addrs()[0]))


def run_with_stock_peer(
    tmp_path: Path, exercise: Callable[[SwarmHost, IHost], Awaitable[None]]
) -> None:
    key_pair = load_or_create_identity(tmp_path / "swarm.key")
    with SwarmHost(key_pair, BlobStore(tmp_path / "swarm-blobs"), TOPIC) as swarm:

        async def with_peer() -> None:
            async with stock_peer() as peer:
                with trio.fail_after(TRANSFER_TIMEOUT_S):
                    await exercise(swarm, peer)

        trio.run(with_peer)


async def read_exactly(stream: INetStream, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        data += await stream.read(count - len(data))
    return bytes(data)


def frame(message: dict[str, Any]) -> bytes:
    payload = msgpack.packb(message)
    return struct.pack(">I", len(payload)) + payload


async def read_frame(stream: INetStream) -> dict[str, Any]:
    (length,) = struct.unpack(">I", await read_exactly(stream, 4))
    message: dict[str, Any] = msgpack.unpackb(await read_exactly(stream, length))
    return message


@pytest.mark.parametrize("dialer", DIALERS)
def test_a_stock_peer_fetches_whole_and_ranged_blobs_from_swarm_host(
    tmp_path: Path, dialer: str
) -> None:
    data = os.urandom(BLOB_BYTES)

    async def exercise(swarm: SwarmHost, peer: IHost) -> None:
        sha256 = swarm.blob_store.put_bytes(data)
        swarm.serve_blob(sha256)
        await connect(swarm, peer, dialer)
        for offset, length in [(0, len(data)), (65_519 * 3 + 5, 1 << 20), (len(data) - 1, 1)]:
            stream = await peer.new_stream(
                ID.from_base58(swarm.peer_id), [TProtocol(BLOB_PROTOCOL_ID)]
            )
            await stream.write(frame({"sha256": sha256, "offset": offset, "length": length}))
            header = await read_frame(stream)
            assert (header["ok"], header["size"], header["length"]) == (True, len(data), length)
            assert await read_exactly(stream, length) == data[offset : offset + length]
            await stream.close()

    run_with_stock_peer(tmp_path, exercise)


@pytest.mark.parametrize("dialer", DIALERS)
def test_swarm_host_fetches_a_blob_a_stock_peer_serves(tmp_path: Path, dialer: str) -> None:
    data = os.urandom(BLOB_BYTES)
    sha256 = BlobStore(tmp_path / "reference").put_bytes(data)

    async def serve_blob(stream: INetStream) -> None:
        """The blob wire protocol as a peer without SwarmHost's code would speak it."""
        request = await read_frame(stream)
        assert request["sha256"] == sha256
        offset, length = request["offset"], request["length"]
        await stream.write(frame({"ok": True, "size": len(data), "length": length, "error": None}))
        for start in range(offset, offset + length, STOCK_WRITE_BYTES):
            await stream.write(data[start : min(start + STOCK_WRITE_BYTES, offset + length)])
        await stream.close()

    async def exercise(swarm: SwarmHost, peer: IHost) -> None:
        peer.set_stream_handler(TProtocol(BLOB_PROTOCOL_ID), serve_blob)
        await connect(swarm, peer, dialer)
        path = await trio.to_thread.run_sync(
            swarm.fetch_blob, peer.get_id().to_base58(), sha256, len(data)
        )
        assert path.read_bytes() == data

    run_with_stock_peer(tmp_path, exercise)


def test_a_peer_without_the_blob_protocol_refuses_it_and_nothing_is_stored(
    tmp_path: Path,
) -> None:
    """A peer that does not speak the blob protocol refuses it in the negotiation: the fetch
    fails, no partial is left, and the connection serves a fetch once the peer does speak it."""
    data = os.urandom(1000)
    sha256 = BlobStore(tmp_path / "reference").put_bytes(data)

    async def serve_blob(stream: INetStream) -> None:
        request = await read_frame(stream)
        assert (request["sha256"], request["offset"]) == (sha256, 0)
        await stream.write(frame({"ok": True, "size": len(data), "length": len(data)}))
        await stream.write(data)
        await stream.close()

    async def exercise(swarm: SwarmHost, peer: IHost) -> None:
        await connect(swarm, peer, "SwarmHost dials")
        fetch = partial(swarm.fetch_blob, peer.get_id().to_base58(), sha256, len(data))
        with pytest.raises(BlobFetchError, match="^could not open a blob stream"):
            await trio.to_thread.run_sync(fetch)
        assert not swarm.blob_store.has(sha256)
        assert not swarm.blob_store.partial_path(sha256).exists()

        peer.set_stream_handler(TProtocol(BLOB_PROTOCOL_ID), serve_blob)
        path = await trio.to_thread.run_sync(fetch)
        assert path.read_bytes() == data

    run_with_stock_peer(tmp_path, exercise)


@asynccontextmanager
async def noise_sessions() -> AsyncIterator[tuple[ISecureConn, ISecureConn, trio.SocketStream]]:
    """Two Noise sessions (initiator, responder) over real TCP, with protocol.patches applied,
    and the responder's socket."""
    patches.apply_all()
    ours, theirs = create_new_key_pair(), create_new_key_pair()
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listener:
        near_end = await trio.open_tcp_stream("127.0.0.1", listener.socket.getsockname()[1])
        async with near_end, await listener.accept() as far_end:
            sessions: dict[str, ISecureConn] = {}

            async def secure_ours() -> None:
                transport = NoiseTransport(ours, noise_privkey=create_x25519_key_pair().private_key)
                raw = RawConnection(TrioTCPStream(near_end), True)
                sessions["ours"] = await transport.secure_outbound(
                    raw, ID.from_pubkey(theirs.public_key)
                )

            async def secure_theirs() -> None:
                transport = NoiseTransport(
                    theirs, noise_privkey=create_x25519_key_pair().private_key
                )
                raw = RawConnection(TrioTCPStream(far_end), False)
                sessions["theirs"] = await transport.secure_inbound(raw)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(secure_ours)
                nursery.start_soon(secure_theirs)
            yield sessions["ours"], sessions["theirs"], far_end


def test_patched_noise_sessions_exchange_messages_of_every_size() -> None:
    payloads = [os.urandom(size) for size in MESSAGE_SIZES]

    async def exchange() -> None:
        async def write_all(session: ISecureConn) -> None:
            for payload in payloads:
                await session.write(payload)

        async with noise_sessions() as (ours, theirs, _):
            with trio.fail_after(TRANSFER_TIMEOUT_S):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(write_all, theirs)
                    received = await ours.read(12) + await ours.read(100_000)
                    while len(received) < sum(map(len, payloads)):
                        received += await ours.read(None)
                assert received == b"".join(payloads)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(write_all, ours)
                    for payload in payloads:
                        assert await theirs.read(len(payload)) == payload

    trio.run(exchange)
