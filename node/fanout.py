"""A node's side of checkpoint fan-out: rebuild the round's base from the delta its parent makes,
fetched from peers that hold it, and serve that delta on until the next round.

The coordinator's answer (`GET /v1/checkpoints/{revision}/fanout`) carries the delta's signed
manifest and the peers to fetch from. The manifest must be signed by the coordinator's peer (the
one `/v1/info` names) and name the checkpoint `/v1/info` gives as the base; the blobs are checked
by sha256 as they arrive, and every rebuilt file against the checkpoint's manifest. Anything that
fails leaves the node to pull the checkpoint whole from the registry, as it does without a parent.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import httpx
from skillswarm.protocol.api import FanoutHolder, FanoutOut, InfoOut
from skillswarm.protocol.checkpoint import CheckpointError
from skillswarm.protocol.durable import write_bytes_atomically
from skillswarm.protocol.fanout import (
    CheckpointDelta,
    FanoutError,
    SignedCheckpointDelta,
    holds_checkpoint,
    rebuild_checkpoint,
)
from skillswarm.protocol.host import BlobFetchError, PeerConnectError, SwarmHost
from skillswarm.protocol.manifest import ManifestError
from skillswarm.protocol.messages import CheckpointDeltaServed, encode_message

log = logging.getLogger(__name__)

# How often a node repeats that it serves the delta (the coordinator forgets a silent holder).
ANNOUNCE_EVERY_S = 30.0
# Failed fetches (every named holder failing) before the node pulls whole.
MAX_FETCH_FAILURES = 3


class FanoutClient:
    """Rebases a node on the round's checkpoint through its delta; thread-safe enough for the
    daemon (one rebase at a time, `announce` from the training thread)."""

    def __init__(
        self,
        host: SwarmHost,
        coordinator_url: str,
        checkpoints_dir: Path,
        kept_dir: Path,
        *,
        wait_s: float,
        announce_addrs: list[str] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.host = host
        self.url = coordinator_url.rstrip("/")
        self.checkpoints_dir = checkpoints_dir
        self.kept_dir = kept_dir
        self.wait_s = wait_s
        self.announce_addrs = announce_addrs or []
        self._stop = stop or threading.Event()
        self._serving: tuple[str, set[str]] | None = None  # checkpoint id, its delta's blobs
        self._last_announce = 0.0
        self._lock = threading.Lock()

    # rebase ----------------------------------------------------------------------------------

    def rebase(self, info: InfoOut, out_dir: Path) -> bool:
        """Rebuild `info`'s base into `out_dir` from its delta; True when it is there (the delta
        is then served), False when the node should pull it whole: no delta for it, the parent
        not held here, no holder delivered within `wait_s`, or anything refused."""
        if self._resume_serving(info, out_dir):
            return True
        deadline = time.monotonic() + self.wait_s
        offer = self._ask_until_answered(info, deadline)
        if offer is None:
            return False
        signed = SignedCheckpointDelta(manifest_bytes=offer.manifest, signature=offer.signature)
        try:
            delta = signed.verify(info.peer_id)
        except ManifestError as exc:
            log.warning("refused the delta of checkpoint %s: %s", info.base_id[:12], exc)
            return False
        if delta.checkpoint_id != info.base_id:
            log.warning(
                "refused a delta of checkpoint %s offered for %s",
                delta.checkpoint_id[:12],
                info.base_id[:12],
            )
            return False
        parent = self._held(delta.base_id)
        if parent is None:
            log.info(
                "checkpoint %s is a delta from %s, which this node does not hold; pulling whole",
                info.base_id[:12],
                delta.base_id[:12],
            )
            return False
        failures = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            if offer.holders:
                try:
                    self._fetch(delta, offer.holders, deadline)
                except BlobFetchError as exc:
                    failures += 1
                    log.warning("fetching the delta of %s failed: %s", info.base_id[:12], exc)
                    if failures >= MAX_FETCH_FAILURES:
                        return False
                else:
                    return self._rebuild(signed, delta, parent, out_dir)
            self._stop.wait(offer.retry_after_s or 1.0)
            offer = self._ask_until_answered(info, deadline)
            if offer is None or offer.manifest != signed.manifest_bytes:
                return False
        log.info("no peer delivered the delta of %s in time; pulling whole", info.base_id[:12])
        return False

    def _ask_until_answered(self, info: InfoOut, deadline: float) -> FanoutOut | None:
        """The coordinator's offer; asked again every 2 s while it cannot be reached (a cut
        link: the delta may still come from peers once it answers), until `deadline`. None for
        no delta of this checkpoint, an answer that does not parse, or no answer in time."""
        url = f"{self.url}/v1/checkpoints/{info.base_id}/fanout"
        warned = False
        while not self._stop.is_set():
            try:
                response = httpx.get(url, params={"peer": self.host.peer_id}, timeout=30.0)
            except httpx.TransportError as exc:
                if not warned:
                    log.warning("could not ask for the delta of %s: %s", info.base_id[:12], exc)
                    warned = True
                if time.monotonic() + 2.0 > deadline:
                    return None
                self._stop.wait(2.0)
                continue
            if response.status_code == 404:
                return None
            try:
                response.raise_for_status()
                return FanoutOut.model_validate_json(response.content)
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("refused the answer about the delta of %s: %s", info.base_id[:12], exc)
                return None
        return None

    def _held(self, checkpoint_id: str) -> Path | None:
        """A complete local folder of this checkpoint, if the node has one."""
        folders = self.checkpoints_dir.iterdir() if self.checkpoints_dir.is_dir() else []
        for folder in folders:
            if folder.is_dir() and holds_checkpoint(folder, checkpoint_id):
                return folder
        return None

    def _fetch(self, delta: CheckpointDelta, holders: list[FanoutHolder], deadline: float) -> None:
        """Every blob of the delta, from the first holder that delivers it."""
        reachable = []
        for holder in holders:
            if holder.peer_id == self.host.peer_id:
                continue
            for addr in holder.multiaddrs:
                try:
                    self.host.connect(addr, timeout=10)
                except (PeerConnectError, ValueError) as exc:
                    log.debug("cannot dial holder %s at %s: %s", holder.peer_id, addr, exc)
                    continue
                reachable.append(holder.peer_id)
                break
        if not reachable:
            raise BlobFetchError(f"none of the {len(holders)} holders named could be dialled")
        for sha, size in delta.blobs.items():
            timeout = max(deadline - time.monotonic(), 1.0)
            self.host.fetch_blob_from_any(
                reachable, sha, size, timeout=timeout, attempts_per_peer=1
            )

    def _rebuild(
        self, signed: SignedCheckpointDelta, delta: CheckpointDelta, parent: Path, out_dir: Path
    ) -> bool:
        try:
            rebuild_checkpoint(delta, parent, self.host.blob_store, out_dir)
        except (FanoutError, CheckpointError) as exc:
            log.warning("the delta of %s did not rebuild it: %s", delta.checkpoint_id[:12], exc)
            for sha in delta.blobs:
                self.host.blob_store.delete(sha)
            return False
        self.kept_dir.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(self.kept_dir / f"{delta.checkpoint_id}.msgpack", signed.to_bytes())
        for stale in self.kept_dir.glob("*.msgpack"):
            if stale.name != f"{delta.checkpoint_id}.msgpack":
                stale.unlink(missing_ok=True)
        log.info(
            "rebuilt checkpoint %s from a delta of %d bytes",
            delta.checkpoint_id[:12],
            delta.download_size,
        )
        self._serve(delta)
        return True

    def _resume_serving(self, info: InfoOut, out_dir: Path) -> bool:
        """After a restart: the base is already here, rebuilt from the delta kept beside it;
        serve that delta again."""
        path = self.kept_dir / f"{info.base_id}.msgpack"
        if not path.is_file() or not holds_checkpoint(out_dir, info.base_id):
            return False
        try:
            delta = SignedCheckpointDelta.from_bytes(path.read_bytes()).verify(info.peer_id)
        except (OSError, ManifestError):
            return False
        if not all(self.host.blob_store.has(sha) for sha in delta.blobs):
            return False
        self._serve(delta)
        return True

    # serving ---------------------------------------------------------------------------------

    def _serve(self, delta: CheckpointDelta) -> None:
        with self._lock:
            previous = self._serving
            self._serving = (delta.checkpoint_id, set(delta.blobs))
        if previous is not None:
            for sha in previous[1] - set(delta.blobs):
                self.host.unserve_blob(sha)
        for sha in delta.blobs:
            self.host.serve_blob(sha)
        self.announce(force=True)

    def kept_blobs(self) -> set[str]:
        """The blobs of the delta being served (the daemon's garbage collection keeps them)."""
        with self._lock:
            return set(self._serving[1]) if self._serving is not None else set()

    def announce(self, force: bool = False) -> None:
        """Say on gossip that this node serves the current delta (at most every
        ANNOUNCE_EVERY_S unless forced)."""
        with self._lock:
            serving = self._serving
            due = force or time.monotonic() - self._last_announce >= ANNOUNCE_EVERY_S
            if serving is None or not due:
                return
            self._last_announce = time.monotonic()
        addrs = self.announce_addrs or self.host.listen_addrs
        try:
            self.host.publish(
                encode_message(
                    CheckpointDeltaServed(checkpoint_id=serving[0], multiaddrs=addrs[:8])
                )
            )
        except Exception as exc:  # the coordinator forgets us at worst; the node trains on
            log.warning("could not announce the served delta: %s", exc)
