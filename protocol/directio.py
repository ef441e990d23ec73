"""Appending a download to its file without the page cache (O_DIRECT), where the system has it.

A blob is written once, hashed on the way in, and read later, if at all, by whoever decodes it:
keeping hundreds of MiB of it in the page cache only evicts what the trainer or the merge is
using, and filling fresh page-cache pages is most of the write's CPU time. A download's writer
thread spent 0.5-0.6 ms of system time per MiB writing through the cache here, 2.3-2.9 ms when
the VM's host had taken the free memory back (each new page then faults on the host), and
0.1-0.2 ms writing directly.
Direct writes need aligned offsets, lengths and memory. Whole blocks given in aligned memory
(`aligned_buffers`) at an aligned offset are written from where they lie; other bytes go through
an aligned staging buffer (a copy, 0.1 ms per MiB); what does not fill an aligned block (the head
up to the first boundary, the tail at a flush) is written through the page cache. A file system
that refuses O_DIRECT gets plain buffered writes, as does everything after a direct write it
refuses.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

# Covers the 512- and 4096-byte logical blocks of common disks, and the page size (so that a
# block written through the page cache never shares a page with one written directly).
DIRECT_IO_ALIGN_BYTES = max(4096, mmap.PAGESIZE)
DIRECT_STAGING_BYTES = 4 << 20
_O_DIRECT: int | None = getattr(os, "O_DIRECT", None)
_PRIVATE_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


class AppendFile(Protocol):
    """What a download writes through: the part of a binary file it uses."""

    def write(self, data: memoryview) -> object: ...
    def flush(self) -> None: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...


class DirectAppender:
    """Appends to an existing file: aligned blocks with O_DIRECT, the rest through the page cache.

    Bytes are written in order; bytes still staged reach the file at `flush` or `close`. After a
    write fails, nothing more is written (`write` and `flush` raise AppendFailed, `close` only
    closes): the file holds a prefix of what was given. `direct_bytes` counts the bytes written
    directly.
    """

    def __init__(self, path: Path) -> None:
        if _O_DIRECT is None:
            raise OSError(errno.EINVAL, "this system has no O_DIRECT")
        # Page-aligned, private memory; its pages are faulted in only as far as it is used.
        self._staging = mmap.mmap(-1, DIRECT_STAGING_BYTES, flags=_PRIVATE_ANONYMOUS)
        self._view = memoryview(self._staging)
        self._plain = self._direct = -1
        try:
            self._plain = os.open(path, os.O_WRONLY)
            self._direct = os.open(path, os.O_WRONLY | _O_DIRECT)
            self._position = os.fstat(self._plain).st_size
        except OSError:
            self._release()
            raise
        self._direct_refused = False
        self._staged = 0
        self._failed = False
        self._closed = False
        self.direct_bytes = 0

    def write(self, data: memoryview | bytes | bytearray) -> int:
        self._check()
        with memoryview(data) as given, given.cast("B") as whole:
            total = len(whole)
            done = 0
            while done < total:
                misaligned = self._position % DIRECT_IO_ALIGN_BYTES
                if self._staged == 0 and misaligned:  # up to the next boundary, via the cache
                    head = min(total - done, DIRECT_IO_ALIGN_BYTES - misaligned)
                    self._guarded(self._write_plain, whole, done, done + head)
                    done += head
                    continue
                if self._staged == 0 and total - done >= DIRECT_IO_ALIGN_BYTES:
                    with whole[done:] as rest:
                        aligned = _is_aligned(rest)
                    if aligned:  # whole blocks straight from the caller's memory, no copy
                        blocks = (total - done) - (total - done) % DIRECT_IO_ALIGN_BYTES
                        self._guarded(self._write_direct, whole, done, done + blocks)
                        done += blocks
                        continue
                count = min(total - done, len(self._view) - self._staged)
                self._view[self._staged : self._staged + count] = whole[done : done + count]
                self._staged += count
                done += count
                if self._staged == len(self._view):
                    self._write_staged_blocks()
        return total

    def flush(self) -> None:
        """Write everything staged: the whole blocks directly, the rest through the cache."""
        self._check()
        self._flush()

    def _flush(self) -> None:
        self._write_staged_blocks()
        if self._staged:
            self._guarded(self._write_plain, self._view, 0, self._staged)
            self._staged = 0

    def fileno(self) -> int:
        return self._plain

    def close(self) -> None:
        """Flush (unless a write failed) and close; the descriptors are closed even if the
        flush fails."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._failed:
                self._flush()
        finally:
            self._release()

    def _check(self) -> None:
        if self._closed:
            raise ValueError("write to a closed DirectAppender")
        if self._failed:
            raise AppendFailed("an earlier write to this file failed; nothing more is written")

    def _release(self) -> None:
        for descriptor in (self._direct, self._plain):
            if descriptor >= 0:
                os.close(descriptor)
        self._direct = self._plain = -1
        self._view.release()
        self._staging.close()

    def _write_staged_blocks(self) -> None:
        blocks = self._staged - self._staged % DIRECT_IO_ALIGN_BYTES
        if not blocks:
            return
        self._guarded(self._write_direct, self._view, 0, blocks)
        rest = self._staged - blocks
        self._view[:rest] = self._view[blocks : self._staged]
        self._staged = rest

    def _guarded(
        self, write: Callable[[memoryview], None], source: memoryview, start: int, end: int
    ) -> None:
        """`write(source[start:end])`, marking the appender failed if it raises (some of the
        bytes may have reached the file: writing them again would break the prefix)."""
        try:
            with source[start:end] as part:
                write(part)
        except BaseException:
            self._failed = True
            raise

    def _write_direct(self, blocks: memoryview) -> None:
        written = 0
        if not self._direct_refused:
            try:
                written = os.pwrite(self._direct, blocks, self._position)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                # Alignment this file system or device does not take: no more direct writes.
                self._direct_refused = True
            self._position += written
            self.direct_bytes += written
        if written < len(blocks):
            with blocks[written:] as rest:
                self._write_plain(rest)

    def _write_plain(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            with data[done:] as rest:
                written = os.pwrite(self._plain, rest, self._position)
            self._position += written
            done += written


def aligned_buffers(count: int, size: int) -> list[memoryview]:
    """`count` writable buffers of `size` bytes, each starting on a DIRECT_IO_ALIGN_BYTES
    boundary (views of one private anonymous mapping, unmapped once all are released); with
    `size` a multiple of it, a DirectAppender writes them without copying."""
    if count == 0:
        return []
    stride = -(-size // DIRECT_IO_ALIGN_BYTES) * DIRECT_IO_ALIGN_BYTES
    with memoryview(mmap.mmap(-1, max(1, count * stride), flags=_PRIVATE_ANONYMOUS)) as whole:
        return [whole[index * stride : index * stride + size] for index in range(count)]


class AlignedBufferPool:
    """Aligned buffers of one size (`aligned_buffers`), kept between transfers for the next.

    Memory fresh from the kernel is faulted in a page at a time, and on a VM whose host takes
    freed memory back (Firecracker's free-page reporting) each new page also faults on the host:
    a fresh MiB cost 0.4-0.6 ms here, up to 3 ms just after the memory was returned, against
    0.1 ms to copy a MiB. Buffers handed back are kept, up to `max_idle` of them, and used
    before new ones are mapped. Thread-safe: every host of a process shares one.
    """

    def __init__(self, buffer_bytes: int, max_idle: int) -> None:
        self.buffer_bytes = buffer_bytes
        self.max_idle = max_idle
        self._idle: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self, count: int) -> list[memoryview]:
        """`count` buffers of `buffer_bytes`: idle ones first, then newly mapped ones."""
        with self._lock:
            kept = max(len(self._idle) - count, 0)
            reused, self._idle = self._idle[kept:], self._idle[:kept]
        return reused + aligned_buffers(count - len(reused), self.buffer_bytes)

    def give(self, buffers: list[memoryview]) -> None:
        """Keep `buffers` (from `take`, and no longer used by anyone) for later takers, as many
        as `max_idle` allows."""
        with self._lock:
            room = self.max_idle - len(self._idle)
            fitting = [buffer for buffer in buffers if len(buffer) == self.buffer_bytes]
            self._idle += fitting[: max(room, 0)]

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)


def _is_aligned(view: memoryview) -> bool:
    """Whether a writable buffer starts on a DIRECT_IO_ALIGN_BYTES boundary (a read-only one is
    taken as unaligned: its address cannot be had without a copy)."""
    if view.readonly:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % DIRECT_IO_ALIGN_BYTES == 0


class AppendFailed(OSError):
    """A DirectAppender was used again after one of its writes failed."""


def supports_direct_io(directory: Path) -> bool:
    """Whether files in `directory` can be opened with O_DIRECT (a probe file is made, then
    removed)."""
    if _O_DIRECT is None:
        return False
    probe = Path(directory) / f".direct-io-probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | _O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def open_for_append(path: Path) -> AppendFile:
    """`path` (which must exist) opened for appending: a DirectAppender where the system and the
    file system take O_DIRECT, else an ordinary binary file in append mode."""
    try:
        return DirectAppender(path)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND), "ab")
