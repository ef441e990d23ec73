"""The one canonical msgpack encoding behind delta-manifest and checkpoint ids."""

from __future__ import annotations

import msgpack
import pytest
from skillswarm.protocol.canonical import CanonicalEncodingError, canonical_packb
from skillswarm.protocol.checkpoint import CheckpointError, CheckpointManifest


def test_equal_values_give_equal_bytes_whatever_the_key_order() -> None:
    one = {"b": 1, "a": {"y": [1, 2], "x": (3, b"\x00")}}
    two = {"a": {"x": [3, b"\x00"], "y": (1, 2)}, "b": 1}
    assert canonical_packb(one) == canonical_packb(two)
    decoded = msgpack.unpackb(canonical_packb(one), raw=False)
    assert list(decoded) == ["a", "b"] and list(decoded["a"]) == ["x", "y"]
    assert decoded["a"]["x"] == [3, b"\x00"]


@pytest.mark.parametrize("value", [{1: "a"}, {"a": {b"k": 1}}, {"a": object()}])
def test_values_without_a_canonical_form_are_refused(value: object) -> None:
    with pytest.raises(CanonicalEncodingError):
        canonical_packb(value)


def test_a_checkpoint_manifest_is_named_by_its_canonical_bytes() -> None:
    manifest = CheckpointManifest(files=[], created_at="2025-01-01T00:00:00+00:00")
    assert manifest.encode() == canonical_packb(manifest.model_dump(by_alias=True, mode="python"))
    with pytest.raises(CheckpointError, match="canonical"):
        CheckpointManifest(
            files=[], created_at="2025-01-01T00:00:00+00:00", extra={"a": {1: "x"}}
        ).encode()
