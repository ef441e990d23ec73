"""Hostile bytes at the decoders a peer reaches first: gossip envelopes and delta manifests.
Whatever arrives, decoding returns a typed value or raises its one documented error; the classes
that once escaped as other exceptions (and killed the coordinator's intake thread) are named
regression tests, then a seeded fuzz of 10^5 mutated inputs checks the rest."""

from __future__ import annotations

import math
import random

import msgpack
import pytest
import torch
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.canonical import MAX_WIRE_INT
from skillswarm.protocol.delta import pack_delta
from skillswarm.protocol.identity import load_or_create_identity, peer_id_of, public_key_bytes
from skillswarm.protocol.manifest import DeltaManifest, ManifestError, SignedManifest, sign_manifest
from skillswarm.protocol.messages import (
    CheckpointPublished,
    DeltaAnnounced,
    MessageError,
    NodeHeartbeat,
    decode_message,
    encode_message,
)

BASE_ID = "ab" * 32
FUZZ_MESSAGES = 60_000
FUZZ_MANIFESTS = 40_000


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[SignedManifest, object]:
    folder = tmp_path_factory.mktemp("fuzz")
    key_pair = load_or_create_identity(folder / "node.key")
    torch.manual_seed(0)
    base = {"w": torch.randn(4, 3), "b": torch.randn(64)}
    tuned = {"w": base["w"] + 0.5, "b": base["b"].clone()}
    tuned["b"][1] += 1.0
    manifest = pack_delta(
        base,
        tuned,
        BlobStore(folder / "blobs"),
        peer_id=peer_id_of(key_pair),
        public_key=public_key_bytes(key_pair),
        domain="math",
        base_id=BASE_ID,
        round=1,
        steps=3,
        metrics={"reward_mean": 0.25},
    )
    return sign_manifest(manifest, key_pair), key_pair


def _valid_messages(signed: SignedManifest) -> list[bytes]:
    return [
        encode_message(
            DeltaAnnounced(manifest_bytes=signed.manifest_bytes, signature=signed.signature)
        ),
        encode_message(CheckpointPublished(checkpoint_id="cd" * 32, round=2, parent=BASE_ID)),
        encode_message(NodeHeartbeat(domain="code", round=3, step=7, reward=0.5)),
    ]


# -- named regressions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"type": ["delta_announced"]},  # a list where the type's string belongs
        {"type": {"nested": 1}},
        {"type": "node_heartbeat", "domain": ["math"], "round": 1, "step": 1},
        {"type": "node_heartbeat", "domain": "math", "round": [1], "step": {"x": 1}},
        {"type": "delta_announced", "manifest_bytes": ["x"], "signature": {}},
    ],
)
def test_a_body_field_of_the_wrong_type_is_a_message_error(body: dict) -> None:
    with pytest.raises(MessageError):
        decode_message(msgpack.packb({"v": 1, "body": body}))


@pytest.mark.parametrize("version", [[1], "1", True, 1.0, None])
def test_a_version_that_is_not_an_integer_is_a_message_error(version: object) -> None:
    with pytest.raises(MessageError):
        decode_message(msgpack.packb({"v": version, "body": {"type": "node_heartbeat"}}))


@pytest.mark.parametrize("depth", [100, 2_000, 100_000])
def test_deeply_nested_gossip_is_a_message_error(depth: int) -> None:
    nested = b"\x91" * depth + b"\xc0"  # arrays of one element, `depth` deep, around a nil
    for raw in (
        nested,
        msgpack.packb({"v": 1})[:-1],  # a truncated map
        b"\x82\xa1v\x01\xa4body" + b"\x81\xa4type" + nested,
    ):
        with pytest.raises(MessageError):
            decode_message(raw)


@pytest.mark.parametrize("field", ["round", "step"])
@pytest.mark.parametrize("value", [MAX_WIRE_INT + 1, (1 << 64) - 1, -1])
def test_heartbeat_integers_beyond_storage_are_refused(field: str, value: int) -> None:
    body = {"type": "node_heartbeat", "domain": "math", "round": 1, "step": 1, field: value}
    with pytest.raises(MessageError, match=field):
        decode_message(msgpack.packb({"v": 1, "body": body}))
    body[field] = MAX_WIRE_INT
    assert getattr(decode_message(msgpack.packb({"v": 1, "body": body})), field) == MAX_WIRE_INT


@pytest.mark.parametrize("field", ["round", "steps"])
def test_a_validly_signed_manifest_with_integers_beyond_storage_is_refused(
    signed: tuple[SignedManifest, object], field: str
) -> None:
    good, key_pair = signed
    data = msgpack.unpackb(good.manifest_bytes, raw=False)
    data[field] = 1 << 63
    raw = msgpack.packb(data, use_bin_type=True)
    from skillswarm.protocol import identity

    forged = SignedManifest(manifest_bytes=raw, signature=identity.sign(key_pair, raw))
    with pytest.raises(ManifestError, match=field):
        forged.verify()


# -- fuzz ----------------------------------------------------------------------------------------

_ODD_VALUES: list[object] = [
    None, True, -1, 0, MAX_WIRE_INT + 1, (1 << 64) - 1, -(1 << 63), math.nan, math.inf, 1e308,
    "", "x" * 300, "\x00\ud7ff", b"", b"\xff" * 70, [], [[[]]], {}, {"a": {"b": {}}}, [1] * 200,
]  # fmt: skip


def _mutate_structure(value: object, rng: random.Random) -> object:
    """`value` with one node somewhere replaced by an odd value or a wrong-typed container."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        if rng.random() < 0.1:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: _mutate_structure(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.8:
        index = rng.randrange(len(value))
        return [*value[:index], _mutate_structure(value[index], rng), *value[index + 1 :]]
    return rng.choice(_ODD_VALUES)


def _mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(5)
        position = rng.randrange(len(data) + 1)
        if kind == 0 and data:
            data[min(position, len(data) - 1)] = rng.randrange(256)
        elif kind == 1:
            data[position:position] = rng.randbytes(rng.randint(1, 8))
        elif kind == 2:
            del data[position : position + rng.randint(1, 16)]
        elif kind == 3:
            del data[position:]
        else:
            data[position:position] = rng.choice([b"\xdd\xff\xff\xff\xff", b"\x91" * 64, b"\xc1"])
    return bytes(data)


def _mutants(seeds: list[bytes], count: int, rng: random.Random):
    decoded = [msgpack.unpackb(seed, raw=False) for seed in seeds]
    for index in range(count):
        which = index % len(seeds)
        if index % 2:
            yield _mutate_bytes(seeds[which], rng)
        else:
            try:
                yield msgpack.packb(_mutate_structure(decoded[which], rng), use_bin_type=True)
            except (ValueError, TypeError, OverflowError):
                yield _mutate_bytes(seeds[which], rng)


def test_fuzzed_gossip_raises_only_message_error(signed: tuple[SignedManifest, object]) -> None:
    rng = random.Random(20261203)
    outcomes = {"decoded": 0, "refused": 0}
    for raw in _mutants(_valid_messages(signed[0]), FUZZ_MESSAGES, rng):
        try:
            decode_message(raw)
            outcomes["decoded"] += 1
        except MessageError:
            outcomes["refused"] += 1
    assert sum(outcomes.values()) == FUZZ_MESSAGES
    assert outcomes["refused"] > FUZZ_MESSAGES // 2  # the fuzz mostly reaches the refusals


def test_fuzzed_manifests_raise_only_manifest_error(signed: tuple[SignedManifest, object]) -> None:
    good, _ = signed
    rng = random.Random(1203)
    refused = 0
    for raw in _mutants([good.manifest_bytes], FUZZ_MANIFESTS, rng):
        try:
            manifest = DeltaManifest.decode(raw)
        except ManifestError:
            refused += 1
            continue
        SignedManifest(manifest_bytes=raw, signature=good.signature)  # constructible either way
        assert manifest.round <= MAX_WIRE_INT and manifest.steps <= MAX_WIRE_INT
    assert refused > FUZZ_MANIFESTS // 2


def test_fuzzed_signed_manifests_verify_or_raise_manifest_error(
    signed: tuple[SignedManifest, object],
) -> None:
    good, _ = signed
    rng = random.Random(7)
    for raw in _mutants([good.manifest_bytes], 2_000, rng):
        if raw == good.manifest_bytes:
            continue  # a mutation that changed nothing
        with pytest.raises(ManifestError):
            SignedManifest(manifest_bytes=raw, signature=good.signature).verify()
