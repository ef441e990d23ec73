"""Appending downloads with O_DIRECT: the bytes land in order, whatever the offsets and sizes."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import random
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
import skillswarm.protocol.directio as directio
from skillswarm.protocol.directio import (
    DIRECT_IO_ALIGN_BYTES,
    DIRECT_STAGING_BYTES,
    AlignedBufferPool,
    AppendFailed,
    DirectAppender,
    aligned_buffers,
    open_for_append,
    supports_direct_io,
)


def _is_direct(descriptor: int) -> bool:
    return bool(fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    if not supports_direct_io(tmp_path):
        pytest.skip("the temp dir's file system does not take O_DIRECT")
    return tmp_path


@pytest.fixture
def partial(direct_dir: Path) -> Path:
    """An empty partial-download file in a directory that takes O_DIRECT."""
    path = direct_dir / "blob.partial"
    path.touch()
    return path


@pytest.mark.parametrize("start", [0, 1, DIRECT_IO_ALIGN_BYTES - 1, DIRECT_IO_ALIGN_BYTES, 70_001])
def test_appends_exactly_the_bytes_given_from_any_start(direct_dir: Path, start: int) -> None:
    rng = random.Random(start)
    path = direct_dir / "blob.partial"
    existing = rng.randbytes(start)
    path.write_bytes(existing)
    # Sizes that straddle blocks and the staging buffer, with flushes (as a sync asks) between.
    sizes = [1, 4095, 4097, 1_048_304, DIRECT_STAGING_BYTES, 3, 2 * DIRECT_STAGING_BYTES + 17]
    sizes += [rng.randrange(1, 300_000) for _ in range(8)]
    pieces = [rng.randbytes(size) for size in sizes]
    with closing(DirectAppender(path)) as appender:
        for number, piece in enumerate(pieces):
            assert appender.write(memoryview(piece)) == len(piece)
            if number % 3 == 2:
                appender.flush()
    assert path.read_bytes() == existing + b"".join(pieces)
    # Nearly all of it went around the page cache.
    assert appender.direct_bytes >= sum(sizes) - 8 * DIRECT_IO_ALIGN_BYTES


def _address(buffer: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def test_aligned_buffers_are_aligned_disjoint_and_writable() -> None:
    size = 3 * DIRECT_IO_ALIGN_BYTES + 5  # rounded up to whole blocks between buffers
    buffers = aligned_buffers(4, size)
    assert [len(buffer) for buffer in buffers] == [size] * 4
    starts = [_address(buffer) for buffer in buffers]
    assert all(start % DIRECT_IO_ALIGN_BYTES == 0 for start in starts)
    assert all(later - earlier >= size for earlier, later in zip(starts, starts[1:], strict=False))
    for number, buffer in enumerate(buffers):
        buffer[:] = bytes([number]) * size
    assert [bytes(buffer) for buffer in buffers] == [bytes([n]) * size for n in range(4)]


def test_a_buffer_pool_hands_back_kept_buffers_before_mapping_new_ones() -> None:
    pool = AlignedBufferPool(2 * DIRECT_IO_ALIGN_BYTES, max_idle=3)
    first = pool.take(2)
    assert [len(buffer) for buffer in first] == [2 * DIRECT_IO_ALIGN_BYTES] * 2
    assert all(_address(buffer) % DIRECT_IO_ALIGN_BYTES == 0 for buffer in first)
    pool.give(first)
    assert pool.idle == 2
    again = pool.take(3)  # the two kept ones, and one new
    assert {_address(buffer) for buffer in first} < {_address(buffer) for buffer in again}
    assert pool.idle == 0
    pool.give(again + pool.take(2))  # five given, three kept
    assert pool.idle == 3
    pool.give([memoryview(bytearray(100))])  # not one of its size: not kept
    assert pool.idle == 3
    assert pool.take(0) == []


def test_a_buffer_pool_never_hands_one_buffer_to_two_takers_at_once() -> None:
    pool = AlignedBufferPool(DIRECT_IO_ALIGN_BYTES, max_idle=8)
    held: list[int] = []
    clash = threading.Event()
    lock = threading.Lock()

    def churn() -> None:
        for _ in range(300):
            buffers = pool.take(3)
            addresses = [_address(buffer) for buffer in buffers]
            with lock:
                if set(addresses) & set(held):
                    clash.set()
                held.extend(addresses)
            time.sleep(0)  # hold them while the other threads take and give
            with lock:
                for address in addresses:
                    held.remove(address)
            pool.give(buffers)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not clash.is_set()
    kept = [_address(buffer) for buffer in pool.take(pool.idle)]
    assert 3 <= len(kept) <= 8 and len(set(kept)) == len(kept)  # none kept twice


def test_aligned_whole_blocks_are_written_straight_from_the_callers_memory(
    partial: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Aligned buffers at an aligned offset reach the file by direct writes at once, with
    nothing staged; an odd tail, a read-only buffer or an unaligned view is staged, and the
    aligned writes after it are staged too until a flush (the file offset is then unaligned to
    the memory), and the file holds every byte in order."""
    block = DIRECT_IO_ALIGN_BYTES
    real_pwrite = os.pwrite
    direct_sources: list[int] = []

    def pwrite(descriptor: int, data: memoryview, position: int) -> int:
        if _is_direct(descriptor):
            direct_sources.append(_address(data) if not data.readonly else -1)
        return real_pwrite(descriptor, data, position)

    monkeypatch.setattr(directio.os, "pwrite", pwrite)
    first, second, third = aligned_buffers(3, 64 * block)
    for buffer in (first, second, third):
        buffer[:] = os.urandom(len(buffer))
    expected = bytearray()
    with closing(DirectAppender(partial)) as appender:
        appender.write(first)
        expected += first
        assert appender.direct_bytes == len(first)  # written already, nothing waits in staging
        assert direct_sources == [_address(first)]
        appender.write(second[: 10 * block + 7])  # whole blocks direct, the 7 bytes staged
        expected += second[: 10 * block + 7]
        assert appender.direct_bytes == len(first) + 10 * block
        assert direct_sources[1] == _address(second)
        appender.write(third)  # behind the staged 7 bytes: copied through the staging buffer
        expected += third
        assert _address(third) not in direct_sources
        appender.flush()
        appender.write(bytes(first))  # read-only memory is staged whatever its address
        expected += first
        appender.write(second[1 : 1 + 8 * block])  # so is memory off a block boundary
        expected += second[1 : 1 + 8 * block]
    assert partial.read_bytes() == bytes(expected)
    assert appender.direct_bytes >= len(expected) - 2 * block


def test_a_refused_direct_write_from_the_callers_memory_goes_through_the_page_cache(
    partial: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pwrite = os.pwrite

    def pwrite(descriptor: int, data: memoryview, position: int) -> int:
        if _is_direct(descriptor):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(descriptor, data, position)

    monkeypatch.setattr(directio.os, "pwrite", pwrite)
    (buffer,) = aligned_buffers(1, 16 * DIRECT_IO_ALIGN_BYTES)
    buffer[:] = os.urandom(len(buffer))
    with closing(DirectAppender(partial)) as appender:
        appender.write(buffer)
        appender.write(buffer)
    assert partial.read_bytes() == bytes(buffer) * 2
    assert appender.direct_bytes == 0


def test_direct_writes_leave_the_page_cache_alone(partial: Path) -> None:
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None:
        pytest.skip("no RWF_NOWAIT to ask the page cache with")
    with closing(DirectAppender(partial)) as appender:
        appender.write(os.urandom(DIRECT_STAGING_BYTES))
    descriptor = os.open(partial, os.O_RDONLY)
    try:
        # A read that the page cache cannot answer at once fails rather than wait for the disk.
        with pytest.raises(BlockingIOError):
            os.preadv(descriptor, [bytearray(DIRECT_IO_ALIGN_BYTES)], 0, nowait)
    finally:
        os.close(descriptor)


def test_a_refused_direct_write_goes_through_the_page_cache(
    partial: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device or file system that refuses the alignment (EINVAL) gets the bytes buffered,
    this write and every later one."""
    real_pwrite = os.pwrite
    refused: list[int] = []

    def pwrite(descriptor: int, data: memoryview, position: int) -> int:
        if _is_direct(descriptor):
            refused.append(position)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(descriptor, data, position)

    monkeypatch.setattr(directio.os, "pwrite", pwrite)
    pieces = [os.urandom(DIRECT_STAGING_BYTES + 5) for _ in range(3)]
    with closing(DirectAppender(partial)) as appender:
        for piece in pieces:
            appender.write(piece)
    assert partial.read_bytes() == b"".join(pieces)
    assert refused == [0]  # tried once, then never again
    assert appender.direct_bytes == 0


def _open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else set()


def test_a_failed_write_leaves_a_prefix_and_nothing_more_is_written(
    partial: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pwrite = os.pwrite
    calls = 0

    def pwrite(descriptor: int, data: memoryview, position: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(descriptor, data, position)

    monkeypatch.setattr(directio.os, "pwrite", pwrite)
    data = os.urandom(5 * DIRECT_STAGING_BYTES)
    before = _open_descriptors()
    appender = DirectAppender(partial)
    with pytest.raises(OSError, match="No space left"):
        appender.write(data)
    monkeypatch.setattr(directio.os, "pwrite", real_pwrite)
    with pytest.raises(AppendFailed):
        appender.write(b"more")
    with pytest.raises(AppendFailed):
        appender.flush()
    appender.close()  # closes only: what is staged would not follow on from the file's end
    assert _open_descriptors() == before
    assert partial.read_bytes() == data[: 2 * DIRECT_STAGING_BYTES]


def test_a_write_cut_partway_is_never_written_twice(
    partial: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused direct write, then a plain write that goes short and one that fails: the bytes
    that did reach the file stay a prefix, and closing writes nothing again."""
    real_pwrite = os.pwrite
    plain_calls = 0

    def pwrite(descriptor: int, data: memoryview, position: int) -> int:
        nonlocal plain_calls
        if _is_direct(descriptor):
            raise OSError(errno.EINVAL, "Invalid argument")
        plain_calls += 1
        if plain_calls == 1:
            return real_pwrite(descriptor, data[:1000], position)  # a short write
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(directio.os, "pwrite", pwrite)
    data = os.urandom(DIRECT_STAGING_BYTES + 100)
    before = _open_descriptors()
    appender = DirectAppender(partial)
    with pytest.raises(OSError, match="No space left"):
        appender.write(data)
    appender.close()
    assert _open_descriptors() == before
    assert partial.read_bytes() == data[:1000]


def test_close_closes_the_descriptors_even_when_its_flush_fails(
    partial: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _open_descriptors()
    appender = DirectAppender(partial)
    appender.write(b"x" * 10_000)

    def failing_pwrite(descriptor: int, data: memoryview, position: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(directio.os, "pwrite", failing_pwrite)
    with pytest.raises(OSError, match="Input/output"):
        appender.close()
    assert _open_descriptors() == before
    appender.close()  # a second close does nothing
    with pytest.raises(ValueError, match="closed"):
        appender.write(b"y")


def test_open_for_append_falls_back_to_a_plain_file_without_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "blob.partial"
    path.write_bytes(b"head")
    monkeypatch.setattr(directio, "_O_DIRECT", None)  # as on a system without O_DIRECT
    appended = open_for_append(path)
    assert not isinstance(appended, DirectAppender)
    appended.write(memoryview(b"-tail"))
    appended.close()
    assert path.read_bytes() == b"head-tail"


def test_supports_direct_io_probes_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    supported = supports_direct_io(tmp_path)
    assert list(tmp_path.iterdir()) == []
    if supported:  # the probe's answer is what opening a file with O_DIRECT there does
        (tmp_path / "f").touch()
        os.close(os.open(tmp_path / "f", os.O_WRONLY | os.O_DIRECT))
    assert not supports_direct_io(tmp_path / "absent")
    monkeypatch.setattr(directio, "_O_DIRECT", None)
    assert not supports_direct_io(tmp_path)


def test_open_for_append_needs_the_file_to_exist(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_for_append(tmp_path / "absent.partial")
