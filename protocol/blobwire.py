"""Wire format of the `/skillswarm/blob/1.0.0` stream protocol: length-prefixed msgpack headers.

A request and a response header are each a 4-byte big-endian length and a msgpack map; the blob's
bytes from the requested offset follow an accepted response, and the stream is closed after them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, BinaryIO, NamedTuple, Protocol

import msgpack
import trio
from skillswarm.protocol.blobstore import InvalidBlobId, validate_blob_id

__all__ = [
    "MAX_BLOB_REQUEST_BYTES",
    "MAX_BLOB_RESPONSE_HEADER_BYTES",
    "BlobHeader",
    "BlobRequest",
    "BlobWireError",
    "error_header",
    "frame",
    "ok_header",
    "parse_header",
    "parse_request",
    "read_frame",
    "receive_body",
    "request_frame",
    "send_body",
]

MAX_BLOB_REQUEST_BYTES = 1024
MAX_BLOB_RESPONSE_HEADER_BYTES = 4096
MAX_ERROR_TEXT_CHARS = 500
_FRAME_LENGTH = struct.Struct(">I")


class BlobWireError(Exception):
    """A frame that breaks the protocol (too long, cut short, bad fields) or a refused request."""


class Readable(Protocol):
    """What reading a frame needs of a stream (an INetStream has it)."""

    async def read(self, n: int | None = None) -> bytes: ...


class Writable(Protocol):
    """What sending a blob needs of a stream (an INetStream has it)."""

    async def write(self, data: bytes) -> None: ...


class BlobRequest(NamedTuple):
    """A validated request: the blob id, the offset to start from and how many bytes."""

    sha256: str
    offset: int
    length: int


class BlobHeader(NamedTuple):
    """A validated response header: `size` and `length` when `ok`, else the refusal's `error`."""

    ok: bool
    size: int | None
    length: int | None
    error: str | None


def frame(payload: bytes) -> bytes:
    """`payload` with its 4-byte big-endian length in front."""
    return _FRAME_LENGTH.pack(len(payload)) + payload


def request_frame(sha256: str, offset: int, length: int) -> bytes:
    """The request for `length` bytes of blob `sha256` from byte `offset`."""
    return frame(msgpack.packb({"sha256": sha256, "offset": offset, "length": length}))


def ok_header(size: int, length: int) -> bytes:
    """The answer to an accepted request: the blob's size and how many bytes follow."""
    return frame(msgpack.packb({"ok": True, "size": size, "length": length, "error": None}))


def error_header(error: str) -> bytes:
    """The answer to a refused request, with its reason."""
    return frame(msgpack.packb({"ok": False, "size": None, "length": None, "error": error}))


async def read_exactly(stream: Readable, count: int) -> bytes:
    """Exactly `count` bytes from the stream; BlobWireError if it ends first."""
    data = bytearray()
    while len(data) < count:
        chunk = await stream.read(count - len(data))
        if not chunk:
            raise BlobWireError(f"stream ended after {len(data)} of {count} bytes")
        data += chunk
    return bytes(data)


async def read_frame(stream: Readable, max_bytes: int) -> dict[str, Any]:
    """One frame's msgpack map, refused (BlobWireError) before its body is read when its length
    exceeds `max_bytes`."""
    (length,) = _FRAME_LENGTH.unpack(await read_exactly(stream, _FRAME_LENGTH.size))
    if length > max_bytes:
        raise BlobWireError(f"frame of {length} bytes exceeds the limit of {max_bytes}")
    try:
        decoded = msgpack.unpackb(await read_exactly(stream, length), raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise BlobWireError(f"frame is not valid msgpack: {error}") from error
    if not isinstance(decoded, dict):
        raise BlobWireError("frame is not a msgpack map")
    return decoded


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_request(request: dict[str, Any]) -> BlobRequest:
    """The request's blob id, offset and length, checked; BlobWireError if one is bad."""
    sha256, offset, length = request.get("sha256"), request.get("offset"), request.get("length")
    try:
        validate_blob_id(sha256)  # type: ignore[arg-type]
    except InvalidBlobId as error:
        raise BlobWireError(str(error)) from None
    for name, value in (("offset", offset), ("length", length)):
        if not _is_count(value):
            raise BlobWireError(f"{name} must be a non-negative integer")
    return BlobRequest(sha256, offset, length)  # type: ignore[arg-type]


def parse_header(header: dict[str, Any]) -> BlobHeader:
    """A response header, checked: an accepted one must carry non-negative integer size and
    length; a refusal's reason is cut to MAX_ERROR_TEXT_CHARS."""
    if header.get("ok") is True:
        size, length = header.get("size"), header.get("length")
        if not (_is_count(size) and _is_count(length)):
            raise BlobWireError("blob response header lacks integer size and length")
        return BlobHeader(True, size, length, None)  # type: ignore[arg-type]
    error = str(header.get("error"))[:MAX_ERROR_TEXT_CHARS]
    return BlobHeader(False, None, None, error)


async def send_body(
    stream: Writable,
    blob_file: BinaryIO,
    length: int,
    chunk_bytes: int,
    stall: trio.CancelScope,
    on_sent: Callable[[int], None],
    queued_chunks: int = 2,
) -> None:
    """Send `length` bytes of the file from where it stands, `chunk_bytes` at a time.

    A task of its own reads the chunks ahead in a worker thread (the event loop never waits for
    the disk; at most `queued_chunks` wait) while this one writes them. `stall`, a scope with a
    deadline, is pushed back after each chunk sent: only a peer that stops reading trips it.
    """
    timeout = stall.deadline - trio.current_time()
    send, receive = trio.open_memory_channel[bytes](queued_chunks)

    async def read_chunks() -> None:
        async with send:
            remaining = length
            while remaining > 0:
                chunk = await trio.to_thread.run_sync(blob_file.read, min(remaining, chunk_bytes))
                if not chunk:
                    break
                await send.send(chunk)
                remaining -= len(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_chunks)
        sent = 0
        async with receive:
            async for chunk in receive:
                await stream.write(chunk)
                stall.deadline = trio.current_time() + timeout
                sent += len(chunk)
                on_sent(len(chunk))
    if sent < length:
        raise OSError("the blob file shrank while being served")


async def receive_body(
    stream: Readable,
    count: int,
    append: Callable[[bytearray], None],
    chunk_bytes: int,
    queued_chunks: int = 4,
) -> None:
    """Receive exactly `count` bytes and hand them, in order, to `append` in pieces of at least
    `chunk_bytes` (under twice that; the last may be shorter), each in a worker thread.

    A task of its own appends the pieces while this one goes on reading (at most
    `queued_chunks` pieces wait): reading is what makes libp2p grant the sender more window,
    so a reader that waited for each append would stall the sender. A piece handed to `append`
    is appended whole even when the receiver is cancelled meanwhile; after an error what
    arrived before it is appended before the error is raised. Either way the receiver keeps a
    prefix of the body.
    """
    send, receive = trio.open_memory_channel[bytearray](queued_chunks)

    async def append_pieces() -> None:
        async with receive:
            async for piece in receive:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(append, piece)

    async def read_pieces() -> None:
        remaining, piece = count, bytearray()
        try:
            while remaining > 0:
                # Whole-size reads, whatever the piece holds: each read may send the peer a
                # window update, so short reads to top a piece up cost frames.
                data = await stream.read(min(remaining, chunk_bytes))
                if not data:
                    raise BlobWireError(f"stream ended with {remaining} bytes still to come")
                piece += data
                remaining -= len(data)
                if len(piece) >= chunk_bytes or remaining == 0:
                    await send.send(piece)
                    piece = bytearray()
        except Exception:
            if piece:
                await send.send(piece)
            raise

    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(append_pieces)
        async with send:
            try:
                await read_pieces()
            except Exception as error:  # raised once the pieces before it are appended
                failure = error
    if failure is not None:
        raise failure
