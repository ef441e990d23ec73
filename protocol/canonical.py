"""The one canonical msgpack encoding (maps with string keys in sorted order, tuples as arrays),
whose sha256 names delta manifests and checkpoints, and the range every wire integer must fit."""

from __future__ import annotations

from typing import Annotated

import msgpack
from pydantic import Field

# What SQLite (a signed 64-bit integer) can store: a count, round or step read from a peer is
# refused beyond it at decoding, before it reaches storage.
MAX_WIRE_INT = (1 << 63) - 1
WireCount = Annotated[int, Field(ge=0, le=MAX_WIRE_INT)]


class CanonicalEncodingError(ValueError):
    """A value has no canonical encoding (a non-string map key, or a type msgpack cannot pack)."""


def _canonical(value: object) -> object:
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise CanonicalEncodingError("maps must have string keys")
        return {key: _canonical(value[key]) for key in sorted(value)}
    if isinstance(value, list | tuple):
        return [_canonical(item) for item in value]
    return value


def canonical_packb(value: object) -> bytes:
    """`value` as canonical msgpack bytes: equal values always give equal bytes."""
    ordered = _canonical(value)
    try:
        return msgpack.packb(ordered, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise CanonicalEncodingError(f"not msgpack-encodable: {exc}") from exc
