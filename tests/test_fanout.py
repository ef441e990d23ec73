"""Merged checkpoints fanned out as deltas: the encoding rebuilds a checkpoint bit-exactly and
refuses anything else; on loopback a real coordinator (uvicorn, libp2p) seeds one node, a second
node rebuilds the checkpoint from the first (not from the coordinator), and a node without the
parent pulls it whole from the registry."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from delta_helpers import current_base_tensors, hand_in_delta, noisy
from safetensors.torch import load_file, save_file
from serving import serve
from skillswarm.coordinator.app import create_app
from skillswarm.coordinator.config import (
    CoordinatorConfig,
    EvalConfig,
    FanoutConfig,
    MergePlan,
    PublishPolicy,
    RoundPolicy,
)
from skillswarm.coordinator.service import Coordinator
from skillswarm.node.config import NodeConfig
from skillswarm.node.daemon import NodeDaemon
from skillswarm.node.fanout import FanoutClient
from skillswarm.protocol.api import InfoOut
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.checkpoint import (
    CheckpointMismatch,
    build_manifest,
    read_manifest,
    verify_folder,
    write_manifest,
)
from skillswarm.protocol.fanout import (
    CheckpointDelta,
    SignedCheckpointDelta,
    pack_checkpoint_delta,
    rebuild_checkpoint,
    sign_checkpoint_delta,
)
from skillswarm.protocol.host import SwarmHost
from skillswarm.protocol.identity import load_or_create_identity, peer_id_of, public_key_bytes
from skillswarm.protocol.manifest import ManifestError
from skillswarm.protocol.pull import pull

from skillswarm.demo import free_port

# -- the encoding -----------------------------------------------------------------------------


def _checkpoint(folder: Path, **metadata: object) -> Path:
    for stale in folder.glob("skillswarm_manifest*"):
        stale.unlink()
    write_manifest(folder, build_manifest(folder, **metadata))
    return folder


def _child(base: Path, out: Path, seed: int, *, changed: int = 6) -> Path:
    """A child checkpoint of `base`: noise on `changed` tensors, one tensor cast to float16 in a
    second shard, and an edited generation config."""
    shutil.copytree(base, out)
    tensors = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    names = sorted(tensors)
    for name in names[:changed]:
        tensors[name] = tensors[name] + 1e-3 * torch.randn(tensors[name].shape, generator=generator)
    cast = {names[-1]: tensors.pop(names[-1]).to(torch.float16)}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    save_file(cast, out / "extra.safetensors", metadata={"format": "pt"})
    (out / "generation_config.json").write_text('{"max_new_tokens": 7}\n')
    parent = read_manifest(base).checkpoint_id
    return _checkpoint(out, round=1, parent=parent)


@pytest.fixture
def family(tmp_path: Path, tiny_base: Path) -> tuple[Path, Path, Path]:
    base = _checkpoint(shutil.copytree(tiny_base, tmp_path / "base"))
    return base, _child(base, tmp_path / "child", 1), _child(base, tmp_path / "other", 2)


def test_a_checkpoint_delta_rebuilds_the_child_bit_exactly(tmp_path, family):
    base, child, _ = family
    key = load_or_create_identity(tmp_path / "coordinator.key")
    store = BlobStore(tmp_path / "blobs")
    delta = pack_checkpoint_delta(
        base, child, store, peer_id=peer_id_of(key), public_key=public_key_bytes(key)
    )
    sources = {f.path: f.source for f in delta.files}
    assert sources["model.safetensors"] == "safetensors"
    assert sources["extra.safetensors"] == "blob"  # a float16 tensor has no float32 base
    assert sources["generation_config.json"] == "blob"
    assert sources["config.json"] == sources["tokenizer.json"] == "base"
    assert len(delta.tensors) == 6
    assert delta.download_size < (child / "model.safetensors").stat().st_size / 3

    signed = sign_checkpoint_delta(delta, key)
    received = SignedCheckpointDelta.from_bytes(signed.to_bytes()).verify(peer_id_of(key))
    out = rebuild_checkpoint(received, base, store, tmp_path / "node" / "rebuilt")
    rebuilt = read_manifest(out)
    assert rebuilt.checkpoint_id == read_manifest(child).checkpoint_id
    verify_folder(out, rebuilt)
    for name in ("model.safetensors", "extra.safetensors", "generation_config.json"):
        assert (out / name).read_bytes() == (child / name).read_bytes()
    assert [p.name for p in out.parent.iterdir()] == ["rebuilt"]  # no work folder left


def test_a_delta_not_the_coordinators_or_not_the_checkpoint_is_refused(tmp_path, family):
    base, child, other = family
    key = load_or_create_identity(tmp_path / "coordinator.key")
    intruder = load_or_create_identity(tmp_path / "intruder.key")
    store = BlobStore(tmp_path / "blobs")
    delta = pack_checkpoint_delta(
        base, child, store, peer_id=peer_id_of(key), public_key=public_key_bytes(key)
    )
    signed = sign_checkpoint_delta(delta, key)
    with pytest.raises(ManifestError, match="not by the coordinator"):
        signed.verify(peer_id_of(intruder))
    flipped = bytearray(signed.manifest_bytes)
    flipped[len(flipped) // 2] ^= 1
    with pytest.raises(ManifestError):
        SignedCheckpointDelta(manifest_bytes=bytes(flipped), signature=signed.signature).verify(
            peer_id_of(key)
        )
    # Signed, well formed, and naming the child, but its bytes make another checkpoint.
    wrong = pack_checkpoint_delta(
        base, other, store, peer_id=peer_id_of(key), public_key=public_key_bytes(key)
    )
    forged = CheckpointDelta.model_validate(
        {
            **wrong.model_dump(by_alias=True),
            "checkpoint_manifest": delta.checkpoint_manifest,
            "checkpoint_id": delta.checkpoint_id,
        }
    )
    with pytest.raises(CheckpointMismatch, match="rebuilt with another sha256"):
        rebuild_checkpoint(forged, base, store, tmp_path / "node" / "rebuilt")
    assert not (tmp_path / "node" / "rebuilt").exists()
    assert list((tmp_path / "node").iterdir()) == []
    # The manifest must be the checkpoint's, a child of the base the delta applies to.
    with pytest.raises(ValueError, match="does not hash to the checkpoint id"):
        CheckpointDelta.model_validate(
            {**delta.model_dump(by_alias=True), "checkpoint_id": wrong.checkpoint_id}
        )
    with pytest.raises(ValueError, match="not of base"):
        CheckpointDelta.model_validate({**delta.model_dump(by_alias=True), "base_id": "ab" * 32})


# -- on loopback ------------------------------------------------------------------------------


def _coordinator_config(tmp_path: Path, base: Path) -> CoordinatorConfig:
    """A coordinator that merges once one delta is in and publishes without the regression test."""
    return CoordinatorConfig(
        work_dir=tmp_path / "coord",
        p2p_port=0,
        base_checkpoint=base,
        round=RoundPolicy(min_deltas=1),
        eval=EvalConfig(domains=["math"], n_tasks=4, experts="none"),
        publish=PublishPolicy(no_regression=False),
        merge=MergePlan(method="task_arithmetic", parameters={"weight": 1.0}),
        fanout=FanoutConfig(seed_slots=1),
    )


def _info(url: str) -> InfoOut:
    return InfoOut.model_validate_json(httpx.get(f"{url}/v1/info", timeout=10).content)


@contextmanager
def _node(tmp_path: Path, name: str, url: str, info: InfoOut) -> Iterator[NodeDaemon]:
    """A node daemon's rebasing parts (its host, fan-out client and registry pull), no training."""
    daemon = NodeDaemon(NodeConfig(work_dir=tmp_path / name, coordinator_url=url, fanout_wait_s=30))
    daemon.host = SwarmHost(daemon.key_pair, daemon.blobs, topic=info.topic)
    daemon.host.start()
    daemon.fanout = FanoutClient(
        daemon.host,
        url,
        daemon.config.work_dir / "checkpoints",
        daemon.config.work_dir / "fanout",
        wait_s=30,
    )
    try:
        yield daemon
    finally:
        daemon.host.stop()


def _wait(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_nodes_rebase_from_each_other_and_one_without_the_parent_pulls_whole(
    tmp_path: Path, tiny_base: Path
) -> None:
    config = _coordinator_config(tmp_path, tiny_base)
    c = Coordinator(config)
    with serve(create_app(c)) as url:
        round0 = _info(url)
        with (
            _node(tmp_path, "a", url, round0) as a,
            _node(tmp_path, "b", url, round0) as b,
            _node(tmp_path, "c", url, round0) as late,
        ):
            for node in (a, b):  # both trained round 0 on its base
                pull(url, round0.base_revision, node.config.work_dir / "checkpoints" / "r0")
            key = load_or_create_identity(tmp_path / "trainer.key")
            hand_in_delta(c, key, noisy(current_base_tensors(c), seed=3))
            _wait(lambda: _info(url).base_id != round0.base_id, "the merge to be published")
            round1 = _info(url)
            delta = c.fanout.publish(c.current_base())
            assert delta is not None and delta.base_id == round0.base_id

            # a: no peer holds the delta yet, so the coordinator seeds it.
            a.host.keep_connected(round1.multiaddrs)
            a.host.wait_for_peers_in_topic(1, timeout=30)
            from_coordinator = c.host.bytes_served
            a_dir = a.config.work_dir / "checkpoints" / round1.base_revision
            assert a._obtain_base(round1, a_dir)
            assert read_manifest(a_dir).checkpoint_id == round1.base_id
            verify_folder(a_dir, read_manifest(a_dir))
            assert c.host.bytes_served - from_coordinator == delta.download_size
            _wait(lambda: c.fanout.holder_count() == 1, "a's gossip that it serves the delta")
            assert a.fanout is not None and a.fanout.kept_blobs() == set(delta.blobs)

            # b: fetched from a, not from the coordinator.
            from_coordinator, from_a = c.host.bytes_served, a.host.bytes_served
            b_dir = b.config.work_dir / "checkpoints" / round1.base_revision
            assert b._obtain_base(round1, b_dir)
            assert read_manifest(b_dir).checkpoint_id == round1.base_id
            verify_folder(b_dir, read_manifest(b_dir))
            assert c.host.bytes_served == from_coordinator
            assert a.host.bytes_served - from_a == delta.download_size
            metrics = c.metrics()
            assert metrics["fanout_seed_grants_total"] == 1 and metrics["fanout_holders"] >= 1

            # An offer signed by anyone but the coordinator /v1/info names is refused.
            impostor = round1.model_copy(update={"peer_id": a.peer_id})
            assert late.fanout is not None
            assert not late.fanout.rebase(impostor, tmp_path / "impostor")
            assert not (tmp_path / "impostor").exists()

            # A coordinator out of reach is asked again until the wait is over, then given up.
            away = FanoutClient(
                b.host,
                f"http://127.0.0.1:{free_port()}",
                b.config.work_dir / "checkpoints",
                b.config.work_dir / "fanout",
                wait_s=3,
            )
            started = time.monotonic()
            assert not away.rebase(round1, tmp_path / "away")
            assert 1.5 < time.monotonic() - started < 15

            # The late node holds no round-0 base: it pulls round 1 whole from the registry.
            late_dir = late.config.work_dir / "checkpoints" / round1.base_revision
            started = time.monotonic()
            assert not late.fanout.rebase(round1, late_dir)
            assert time.monotonic() - started < 5  # it does not wait for peers
            assert late._obtain_base(round1, late_dir)
            assert read_manifest(late_dir).checkpoint_id == round1.base_id
            assert late.fanout.kept_blobs() == set()


def test_the_checkpoint_delta_is_packed_once_and_kept_across_a_restart(
    tmp_path: Path, tiny_base: Path
) -> None:
    config = _coordinator_config(tmp_path, tiny_base)
    first = Coordinator(config)
    first.prepare()
    assert first.fanout.kept_blobs() == set()  # round 0 has no parent: nothing to fan out
    key = load_or_create_identity(tmp_path / "trainer.key")
    round0 = first.current_base()
    hand_in_delta(first, key, noisy(current_base_tensors(first), seed=4))  # merges: quorum of 1
    published = first.current_base()
    assert published.parent == round0.id
    kept = config.work_dir / "fanout" / f"{published.id}.msgpack"
    packed = kept.read_bytes()
    blobs = first.fanout.kept_blobs()
    assert blobs and all(first.blobs.has(sha) for sha in blobs)
    assert first.collect_garbage() >= 0 and all(first.blobs.has(sha) for sha in blobs)
    first.store.close()

    again = Coordinator(config)  # a restart: the kept delta is served again, not repacked
    again.prepare()
    assert kept.read_bytes() == packed
    assert again.fanout.kept_blobs() == blobs
    offer = again.fanout.offer(published.revision, "12D3KooWNodeThatAsks")
    assert (
        offer is not None
        and offer.manifest == SignedCheckpointDelta.from_bytes(packed).manifest_bytes
    )
    assert [h.peer_id for h in offer.holders] == [again.host.peer_id]  # the one seed slot
    assert again.fanout.offer(published.revision, "12D3KooWSecondNode").holders == []
    assert again.fanout.offer("ab" * 20, "12D3KooWSecondNode") is None
    again.store.close()
