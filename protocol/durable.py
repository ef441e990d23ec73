"""Durable writes: fsync a directory, replace a small file atomically (temp, fsync, rename)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_bytes_atomically(target: Path, data: bytes) -> None:
    """Write `data` to a temp file beside `target`, fsync, rename over `target`, fsync the dir."""
    target = Path(target)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_directory(target.parent)
