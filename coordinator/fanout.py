"""Fan-out of merged checkpoints as deltas: the coordinator packs each published checkpoint as a
signed delta from its parent, serves it, and tells each node where to fetch it so that its own
upload stays about one delta per round whatever the number of nodes.

Nodes that rebuilt the checkpoint say so on gossip (`CheckpointDeltaServed`) and serve the delta
on. A node asking for it is named the holders it has been named least often (a fair spread, ties
broken at random); the coordinator names itself only to the `seed_slots` nodes it is seeding at
the time, each for at most `seed_grant_s` or until that node says it holds the delta.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from libp2p.crypto.keys import KeyPair
from skillswarm.coordinator.config import FanoutConfig
from skillswarm.coordinator.registry import CheckpointInfo, Registry
from skillswarm.protocol.api import FanoutHolder, FanoutOut
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.durable import write_bytes_atomically
from skillswarm.protocol.fanout import (
    CheckpointDelta,
    SignedCheckpointDelta,
    pack_checkpoint_delta,
    sign_checkpoint_delta,
)
from skillswarm.protocol.host import SwarmHost
from skillswarm.protocol.identity import peer_id_of, public_key_bytes
from skillswarm.protocol.manifest import ManifestError
from skillswarm.protocol.messages import CheckpointDeltaServed

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0


@dataclass
class _Current:
    info: CheckpointInfo
    signed: SignedCheckpointDelta
    delta: CheckpointDelta
    holders: dict[str, tuple[list[str], float]] = field(default_factory=dict)
    seeds: dict[str, float] = field(default_factory=dict)  # peer -> grant expiry (monotonic)
    named: Counter[str] = field(default_factory=Counter)  # times each holder was named


class Fanout:
    """The current checkpoint's delta, its holders and the coordinator's seed slots; thread-safe."""

    def __init__(
        self,
        config: FanoutConfig,
        folder: Path,
        registry: Registry,
        blobs: BlobStore,
        key_pair: KeyPair,
        host: SwarmHost,
        advertised_addrs: Callable[[], list[str]],
    ) -> None:
        self.config = config
        self.folder = folder
        self.registry = registry
        self.blobs = blobs
        self.key_pair = key_pair
        self.peer_id = peer_id_of(key_pair)
        self.host = host
        self._advertised_addrs = advertised_addrs
        self._lock = threading.Lock()
        self._current: _Current | None = None
        self.seed_grants = 0  # times the coordinator named itself (a metric)

    def publish(self, info: CheckpointInfo) -> CheckpointDelta | None:
        """Make `info`'s delta from its parent the one fanned out (packed once, kept on disk
        across restarts); None, and nodes pull whole, when fan-out is off or `info` has no
        parent in the registry."""
        if not self.config.enabled or info.parent is None:
            return None
        with self._lock:
            if self._current is not None and self._current.info.id == info.id:
                return self._current.delta
        try:
            parent = self.registry.get(info.parent)
        except LookupError:
            log.info("checkpoint %s has no parent in the registry to fan out from", info.id[:12])
            return None
        path = self.folder / f"{info.id}.msgpack"
        signed = self._load(path)
        if signed is None:
            started = time.monotonic()
            delta = pack_checkpoint_delta(
                self.registry.checkpoint_dir(parent),
                self.registry.checkpoint_dir(info),
                self.blobs,
                peer_id=self.peer_id,
                public_key=public_key_bytes(self.key_pair),
            )
            signed = sign_checkpoint_delta(delta, self.key_pair)
            self.folder.mkdir(parents=True, exist_ok=True)
            write_bytes_atomically(path, signed.to_bytes())
            log.info(
                "checkpoint %s packed as a delta of %d bytes from %s in %.1f s",
                info.id[:12],
                delta.download_size,
                parent.id[:12],
                time.monotonic() - started,
            )
        delta = signed.verify(self.peer_id)
        for sha in delta.blobs:
            self.host.serve_blob(sha)
        with self._lock:
            previous, self._current = self._current, _Current(info, signed, delta)
        if previous is not None:
            for sha in set(previous.delta.blobs) - set(delta.blobs):
                self.host.unserve_blob(sha)
        for stale in self.folder.glob("*.msgpack"):
            if stale != path:
                stale.unlink(missing_ok=True)
        return delta

    def _load(self, path: Path) -> SignedCheckpointDelta | None:
        """The signed delta kept at `path`, if it is whole, ours and its blobs are here."""
        try:
            signed = SignedCheckpointDelta.from_bytes(path.read_bytes())
            delta = signed.verify(self.peer_id)
        except (OSError, ManifestError) as exc:
            if path.exists():
                log.warning("ignoring the kept checkpoint delta %s: %s", path.name, exc)
            return None
        if all(self.blobs.has(sha) for sha in delta.blobs):
            return signed
        return None

    def kept_blobs(self) -> set[str]:
        """The blobs of the delta being fanned out (garbage collection keeps them)."""
        with self._lock:
            return set(self._current.delta.blobs) if self._current is not None else set()

    def note_holder(self, peer_id: str, message: CheckpointDeltaServed) -> bool:
        """A node serves the current delta at these addresses (each must name that node's peer
        id, or none, which is then appended); False for any other checkpoint."""
        addrs = []
        for addr in message.multiaddrs:
            head, _, tail = addr.partition("/p2p/")
            if tail and tail != peer_id:
                continue  # an address of someone else: never handed out
            if head.startswith(("/ip4/", "/ip6/", "/dns4/", "/dns6/", "/dns/")):
                addrs.append(f"{head}/p2p/{peer_id}")
        with self._lock:
            current = self._current
            if current is None or message.checkpoint_id != current.info.id or not addrs:
                return False
            current.holders[peer_id] = (addrs, time.monotonic())
            current.seeds.pop(peer_id, None)
            return True

    def offer(self, revision: str, requester: str | None) -> FanoutOut | None:
        """What a node asking for checkpoint `revision` (40- or 64-hex) as a delta is told; None
        when it is not the checkpoint being fanned out."""
        now = time.monotonic()
        with self._lock:
            current = self._current
            if current is None or not current.info.id.startswith(revision) or len(revision) < 40:
                return None
            ttl = self.config.holder_ttl_s
            for peer, (_, seen) in list(current.holders.items()):
                if now - seen > ttl:
                    del current.holders[peer]
            for peer, expiry in list(current.seeds.items()):
                if now > expiry:
                    del current.seeds[peer]
            live = [peer for peer in current.holders if peer != requester]
            random.shuffle(live)
            live.sort(key=lambda peer: current.named[peer])
            chosen = live[: self.config.holders_per_answer]
            if chosen:
                current.named[chosen[0]] += 1
            holders = [FanoutHolder(peer_id=p, multiaddrs=current.holders[p][0]) for p in chosen]
            seeding = requester is not None and requester in current.seeds
            if not chosen and requester is not None and not seeding:
                if len(current.seeds) < self.config.seed_slots:
                    current.seeds[requester] = now + self.config.seed_grant_s
                    seeding = True
                    self.seed_grants += 1
            if seeding:
                holders.append(
                    FanoutHolder(peer_id=self.peer_id, multiaddrs=self._advertised_addrs())
                )
            return FanoutOut(
                checkpoint_id=current.info.id,
                base_id=current.delta.base_id,
                download_size=current.delta.download_size,
                manifest=current.signed.manifest_bytes,
                signature=current.signed.signature,
                holders=holders,
                retry_after_s=None if holders else RETRY_AFTER_S,
            )

    def holder_count(self) -> int:
        with self._lock:
            return len(self._current.holders) if self._current is not None else 0
