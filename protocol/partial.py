"""A blob download's resumable `.partial` file: appended and hashed as bytes arrive.

The BlobStore keeps the partial; `commit` checks the sha256 and installs the blob atomically.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from skillswarm.protocol.blobstore import BlobStore

__all__ = ["SYNC_EVERY_BYTES", "PartialDownload"]

# The file is synced to disk each time this many bytes were appended since the last sync, in a
# thread of its own while appending goes on: writeback overlaps the transfer instead of all
# waiting for the commit's fsync, and a crash keeps a durable prefix to resume from.
SYNC_EVERY_BYTES = 8 << 20


class _BackgroundSync:
    """fdatasync of one open file in a thread of its own, one at a time: the appending thread
    asks for a sync and goes on writing. A request while a sync runs is dropped (the running one
    or the commit's fsync covers those bytes)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def request(self, fd: int) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(
            target=_sync_quietly, args=(fd,), name="partial-sync", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Return once no sync runs (call before closing the file)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _sync_quietly(fd: int) -> None:
    try:
        _sync_data(fd)
    except OSError:  # an early sync that fails is retried by the commit's fsync, which raises
        pass


class PartialDownload:
    """The partial download of one blob, opened for appending where an earlier attempt stopped.

    `have` is how many bytes the file already holds (the offset to ask the server for) and the
    digest has been fed exactly those. `append` writes with plain buffered I/O and feeds the
    digest the same bytes; a failed write truncates the file back to what the digest has seen,
    so the file always holds a prefix the digest matches. Blocking: call it off the event loop.
    """

    def __init__(self, store: BlobStore, sha256: str) -> None:
        self.store = store
        self.sha256 = sha256
        self.path, self.have, self._digest = store.resume_partial(sha256)
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        self._unsynced = 0
        self._sync = _BackgroundSync()

    def append(self, data: bytes | bytearray | memoryview) -> None:
        """Append `data` to the file and the digest, or neither (the error is raised)."""
        try:
            self._file.write(data)
            self._file.flush()
        except BaseException:
            self._sync.wait()
            self._file.close()
            with open(self.path, "rb+") as repair:
                repair.truncate(self.have)
            self._file = open(self.path, "ab")  # noqa: SIM115
            raise
        self._digest.update(data)
        self.have += len(data)
        self._unsynced += len(data)
        if self._unsynced >= SYNC_EVERY_BYTES:
            self._sync.request(self._file.fileno())
            self._unsynced = 0

    def close(self) -> None:
        """Close the file (once a sync in flight is done); the partial stays for `commit` or a
        later resume."""
        self._sync.wait()
        self._file.close()

    def commit(self) -> Path:
        """Close the file, verify the sha256 and install the blob; returns its path. Raises
        BlobCorrupted (partial deleted) when the bytes do not hash to the blob's id."""
        self.close()
        return self.store.commit_partial(self.sha256, self._digest)

    def discard_if_empty(self) -> None:
        """Delete the partial if it holds no byte (a fetch refused before its first byte)."""
        self.close()
        self.store.discard_partial_if_empty(self.sha256)

    def __enter__(self) -> PartialDownload:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


# fdatasync where the platform has it (it skips metadata such as the modification time).
_sync_data: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)
