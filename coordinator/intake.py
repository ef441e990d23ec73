"""Delta intake: admission (deny, allow-list, replay, base and round), fetching the blobs, the
gates, recording each verdict, heartbeats and peers seen, and collecting old deltas' blobs.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import math
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import msgpack
from skillswarm.coordinator.config import CoordinatorConfig
from skillswarm.coordinator.evaluation import Evaluator, mean_reward
from skillswarm.coordinator.gates import (
    DeltaRejected,
    check_domain_scores,
    check_layout,
    check_values,
    write_expert_checkpoint,
)
from skillswarm.coordinator.registry import Registry
from skillswarm.coordinator.rounds import Rounds
from skillswarm.coordinator.store import (
    CoordinatorStore,
    DeltaRecord,
    GossipRefusalRecord,
    NodeRecord,
    PeerAccessRecord,
    as_utc,
    utcnow,
)
from skillswarm.merge.tensors import CheckpointTensors
from skillswarm.protocol.api import DeltaStatus, RoundStatus
from skillswarm.protocol.blobstore import BlobStore, BlobStoreError
from skillswarm.protocol.delta import DeltaError, DeltaReader
from skillswarm.protocol.host import BlobFetchError, SwarmHost
from skillswarm.protocol.manifest import DeltaManifest, ManifestError, SignedManifest
from skillswarm.protocol.messages import (
    CheckpointDeltaServed,
    DeltaAnnounced,
    MessageError,
    NodeHeartbeat,
    UnknownMessage,
    decode_message,
)
from sqlalchemy import select
from sqlalchemy.orm import Session

__all__ = ["GATE_WORK_PREFIX", "GOSSIP_REFUSAL_KINDS", "Intake", "record_id"]

log = logging.getLogger(__name__)

# Attempts at fetching each blob of an announced delta before it is recorded as a failed fetch
# (which a later announcement of the same delta retries).
FETCH_ATTEMPTS = 3
# A delta whose fetch failed is taken again only once this long has passed since that failure
# was recorded: a peer re-announcing it in a tight loop gets one fetch per cooldown, not one per
# message. Nodes re-announce every 10 s, so an honest retry is never held back by more than that.
FETCH_RETRY_COOLDOWN_S = 5.0
# Each attempt at a blob may take FETCH_BASE_TIMEOUT_S plus its size at FETCH_MIN_RATE_BYTES_PER_S:
# intake takes one delta at a time, so a peer that trickles its bytes must not hold it for the
# full five minutes a slow link to a large blob may need.
FETCH_BASE_TIMEOUT_S = 30.0
FETCH_MIN_RATE_BYTES_PER_S = 1 << 20
FETCH_MAX_TIMEOUT_S = 300.0  # a larger blob goes on from its partial download at the next attempt
MAX_REASON_CHARS = 500  # of a refusal's reason kept on record
# Gossip refused and recorded against its sender: undecodable, of a type this coordinator does
# not speak, or one whose handling failed.
GOSSIP_REFUSAL_KINDS = ("malformed", "unknown", "failed")
GATE_WORK_PREFIX = "gate-"  # work folders of the evaluation gate under work_dir; removed at start
# Errors that refuse a delta (recorded as rejected) rather than fail intake.
REFUSALS = (DeltaRejected, ManifestError, DeltaError, BlobFetchError, BlobStoreError)


class Intake:
    """Takes announced deltas one at a time through admission, fetch and the gates; thread-safe.

    `_lock` (re-entrant) is held while one delta goes through intake, while a node row is
    written, and while garbage is collected, so that the blobs of a delta being fetched (or
    fetched and not yet recorded) are never taken for garbage.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        store: CoordinatorStore,
        registry: Registry,
        blobs: BlobStore,
        host: SwarmHost,
        rounds: Rounds,
        evaluator: Evaluator,
    ) -> None:
        self.config = config
        self.store = store
        self.registry = registry
        self.blobs = blobs
        self.host = host
        self.rounds = rounds
        self.evaluator = evaluator
        self.fetch_retry_cooldown_s = FETCH_RETRY_COOLDOWN_S
        self._lock = threading.RLock()
        self._base_tensors: dict[str, CheckpointTensors] = {}
        self.garbage_due = False  # collect_garbage found intake busy; the intake loop runs it
        self.refused_by_access = 0  # gossip from denied peers or outside the allow-list

    # gossip --------------------------------------------------------------------------------

    def handle_gossip(self, from_peer: str, data: bytes) -> DeltaRecord | None:
        """Take one gossip message: an announced delta (returns its record) or a heartbeat.

        A peer the operator denied, or one outside the allow-list, is turned away before a byte
        of its message is decoded (counted, nothing stored); a message that does not decode is
        recorded against its sender. Nothing raised escapes: one bad message must not stop
        intake."""
        refusal = self.sender_refusal(from_peer)
        if refusal is not None:
            with self._lock:
                self.refused_by_access += 1
            log.debug("ignored gossip: %s", refusal)
            return None
        try:
            body = decode_message(data)
        except UnknownMessage as exc:
            self._note_refusal(from_peer, "unknown", str(exc))
            log.info("ignored gossip from %s: %s", from_peer, exc)
            return None
        except MessageError as exc:
            self._note_refusal(from_peer, "malformed", str(exc))
            log.warning("refused gossip from %s: %s", from_peer, exc)
            return None
        try:
            if isinstance(body, DeltaAnnounced):
                return self.handle_announcement(from_peer, body)
            if isinstance(body, NodeHeartbeat):
                self.record_heartbeat(from_peer, body)
            if isinstance(body, CheckpointDeltaServed) and self.rounds.fanout is not None:
                self.rounds.fanout.note_holder(from_peer, body)
        except Exception as exc:  # one bad message must not stop intake
            log.exception("error handling %s from %s", body.type, from_peer)
            self._note_refusal(from_peer, "failed", f"{type(exc).__name__}: {exc}")
        return None

    def _note_refusal(self, peer_id: str, kind: str, reason: str) -> None:
        with self._lock, self.store.session() as s:
            row = s.get(GossipRefusalRecord, (peer_id, kind))
            if row is None:
                row = GossipRefusalRecord(peer_id=peer_id, kind=kind, count=0)
                s.add(row)
            row.count += 1
            row.last_reason = reason[:MAX_REASON_CHARS]
            row.last_at = utcnow()

    def record_heartbeat(self, peer_id: str, heartbeat: NodeHeartbeat) -> None:
        """Note a node's heartbeat: its domain, round, step and latest reward."""
        now = utcnow()
        reward = heartbeat.reward
        with self._lock, self.store.session() as s:
            node = _node_row(s, peer_id, now)
            node.domain = heartbeat.domain
            node.round = heartbeat.round
            node.step = heartbeat.step
            node.reward = reward if reward is not None and math.isfinite(reward) else None
            node.last_seen = now
            node.last_heartbeat = now

    def _saw_peer(self, peer_id: str, domain: str | None) -> None:
        now = utcnow()
        with self._lock, self.store.session() as s:
            node = _node_row(s, peer_id, now)
            if domain is not None:
                node.domain = domain
            node.last_seen = now

    # announcements -------------------------------------------------------------------------

    def handle_announcement(self, from_peer: str, body: DeltaAnnounced) -> DeltaRecord:
        """Verify, fetch, validate and record one announced delta (merging is the caller's)."""
        signed = body.signed
        delta_id = record_id(signed, from_peer)
        with self._lock:
            existing = self._earlier_verdict(delta_id)
            if existing is not None:
                return existing
            manifest: DeltaManifest | None = None
            fresh: set[str] = set()  # blobs this intake brings in: neither whole nor begun before
            try:
                refusal = self.sender_refusal(from_peer)
                if refusal is not None:
                    raise DeltaRejected(refusal, "denied")
                manifest = signed.verify(announcing_peer=from_peer)
                self._check_admission(manifest)
                fresh = {
                    sha
                    for sha in manifest.blobs
                    if not self.blobs.has(sha) and not self.blobs.partial_path(sha).exists()
                }
                checks = self._fetch_and_validate(from_peer, manifest)
            except REFUSALS as exc:
                # What was fetched goes before the verdict is stored: whoever reads the verdict
                # finds nothing of the delta kept.
                if _rejection_kind(exc) != "fetch":
                    self._discard_blobs(fresh)
                return self._record_rejection(delta_id, from_peer, manifest, exc)
            record = DeltaRecord(
                id=delta_id,
                peer_id=manifest.peer_id,
                announced_by=from_peer,
                domain=manifest.domain,
                base_id=manifest.base_id,
                round=manifest.round,
                steps=manifest.steps,
                status=DeltaStatus.ACCEPTED,
                metrics=dict(manifest.metrics),
                checks=checks,
                manifest=signed.manifest_bytes,
            )
            if not self.rounds.record_if_open(record):
                closed = DeltaRejected(
                    f"round {manifest.round} closed while the delta was being checked", "stale"
                )
                self._discard_blobs(fresh)
                return self._record_rejection(delta_id, from_peer, manifest, closed)
            self._saw_peer(from_peer, manifest.domain)
            log.info(
                "accepted delta %s from %s (%s, round %d)",
                delta_id[:12],
                manifest.peer_id,
                manifest.domain,
                manifest.round,
            )
        return record

    def _earlier_verdict(self, delta_id: str) -> DeltaRecord | None:
        """The verdict already on record for `delta_id`, or None when it is to be taken (never
        seen, or its fetch failed long enough ago to retry; that failure is then forgotten)."""
        with self.store.session() as s:
            existing = s.get(DeltaRecord, delta_id)
            if existing is None:
                return None
            if existing.rejection_kind == "fetch":
                if existing.status == DeltaStatus.REJECTED and self._fetch_retry_due(existing):
                    # Its blobs could not be fetched last time (the node was unreachable, the
                    # link dropped): the announcement is taken again, resuming any partial blob.
                    log.info(
                        "retrying delta %s, whose earlier fetch failed: %s",
                        delta_id[:12],
                        existing.reason,
                    )
                    s.delete(existing)
                    return None
                log.info(
                    "ignored announcement of delta %s: its fetch failed under %.0f s ago",
                    delta_id[:12],
                    self.fetch_retry_cooldown_s,
                )
                return existing
            log.info(
                "ignored repeated announcement of delta %s (%s in round %s)",
                delta_id[:12],
                existing.status,
                existing.round,
            )
            return existing

    def _record_rejection(
        self, delta_id: str, from_peer: str, manifest: DeltaManifest | None, exc: Exception
    ) -> DeltaRecord:
        """Record why a delta was refused, under the peer that announced it (gossip is signed, so
        that peer is known), with the manifest's fields only when its signature held: a forged
        manifest's claims are not filed under the peer it names."""
        reason = str(exc)
        kind = _rejection_kind(exc)
        record = DeltaRecord(
            id=delta_id,
            peer_id=from_peer,
            announced_by=from_peer,
            domain=manifest.domain if manifest else None,
            base_id=manifest.base_id if manifest else None,
            round=manifest.round if manifest else None,
            steps=manifest.steps if manifest else None,
            status=DeltaStatus.REJECTED,
            reason=reason,
            rejection_kind=kind,
            metrics={},
            checks={},
            manifest=None,
        )
        with self.store.session() as s:
            s.add(record)
        # A peer outside the allow-list gets no node row (anyone can gossip; the nodes table is
        # not theirs to grow); one the operator denied by name is listed with its refusals.
        if kind != "denied" or self._peer_verdict(from_peer) is False:
            self._saw_peer(from_peer, manifest.domain if manifest else None)
        log.warning("rejected delta %s from %s (%s): %s", delta_id[:12], from_peer, kind, reason)
        return record

    def sender_refusal(self, peer_id: str) -> str | None:
        """Why nothing from `peer_id` is taken (denied by the operator, or not on a configured
        allow-list); None when it may take part."""
        verdict = self._peer_verdict(peer_id)
        if verdict is False:
            return f"peer {peer_id} is denied"
        allowed = self.config.allowed_peers
        if allowed and peer_id not in allowed and verdict is not True:
            return f"peer {peer_id} is not on the allow-list"
        return None

    def _peer_verdict(self, peer_id: str) -> bool | None:
        with self.store.session() as s:
            row = s.get(PeerAccessRecord, peer_id)
            return None if row is None else row.allowed

    def _check_admission(self, manifest: DeltaManifest) -> None:
        """Base, round, size and lossiness (its signer, the announcing peer, was admitted
        before its signature was checked)."""
        current = self.rounds.current_round()
        if manifest.base_id != current.base_id:
            raise DeltaRejected(
                f"base {manifest.base_id[:12]} is not the current base {current.base_id[:12]}",
                "stale",
            )
        if manifest.round != current.number:
            raise DeltaRejected(
                f"delta is for round {manifest.round}, current is {current.number}", "stale"
            )
        if current.status != RoundStatus.OPEN:
            raise DeltaRejected(f"round {current.number} is {current.status}, not open", "stale")
        total = sum(manifest.blobs.values())
        if total > self.config.max_blob_bytes:
            raise DeltaRejected(
                f"delta of {total} bytes exceeds {self.config.max_blob_bytes}", "size"
            )
        if manifest.lossy and not self.config.accept_lossy:
            raise DeltaRejected("lossy (int8) deltas are not accepted by this coordinator", "lossy")

    def _fetch_retry_due(self, failed: DeltaRecord) -> bool:
        """Whether the retry cooldown has passed since `failed`'s fetch failure was recorded."""
        waited = (utcnow() - as_utc(failed.received_at)).total_seconds()
        return waited >= self.fetch_retry_cooldown_s

    # fetch and gates -----------------------------------------------------------------------

    def _fetch_and_validate(self, from_peer: str, manifest: DeltaManifest) -> dict[str, Any]:
        """Layout before fetching; then values and norms; then, if configured, the evaluation
        gate. Returns what the gates measured."""
        base = self._tensors_of(manifest.base_id)
        check_layout(manifest, base.meta)
        for sha, size in manifest.blobs.items():
            # Retried with backoff, resuming from the partial download; the announcing node is
            # the holder (the manifest's signer, checked by verify()).
            self.host.fetch_blob_from_any(
                [from_peer],
                sha,
                size,
                timeout=min(
                    FETCH_MAX_TIMEOUT_S, FETCH_BASE_TIMEOUT_S + size / FETCH_MIN_RATE_BYTES_PER_S
                ),
                attempts_per_peer=FETCH_ATTEMPTS,
            )
        reader = DeltaReader(manifest, self.blobs)
        checks: dict[str, Any] = dict(check_values(reader, base, self.config.gates).to_dict())
        if self.config.gates.eval_gate:
            checks["scores"] = self._evaluation_gate(manifest, reader)
        return checks

    def _evaluation_gate(self, manifest: DeltaManifest, reader: DeltaReader) -> dict[str, Any]:
        """Score base + Δ alone on the gate's domains (and its own, if known) on the validation
        tasks; refuse it if another domain falls below the configured bound."""
        from skillswarm.agent.envs import list_environments

        gates, seed = self.config.gates, self.config.eval.validation_tasks_seed()
        domains = list(self.config.gate_domains)
        if manifest.domain not in domains and manifest.domain in list_environments():
            domains.append(manifest.domain)
        base_info = self.registry.get(manifest.base_id)
        base_dir = self.registry.checkpoint_dir(base_info)
        base_scores = self.evaluator.scores(
            base_dir, domains, gates.n_tasks, seed, cache_as=base_info.id
        )
        folder = Path(tempfile.mkdtemp(prefix=GATE_WORK_PREFIX, dir=self.config.work_dir))
        try:
            # Scored as the merge plan in force applies it (an operator may have set another
            # since start): the tensors it keeps at the base stay there.
            keep_base = self.rounds.config.merge.kept_for(manifest.domain)
            write_expert_checkpoint(base_dir, reader, folder / "expert", keep_base)
            expert_scores = self.evaluator.scores(folder / "expert", domains, gates.n_tasks, seed)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        check_domain_scores(
            manifest.domain,
            {d: mean_reward(row) for d, row in expert_scores.items()},
            {d: mean_reward(row) for d, row in base_scores.items()},
            gates,
        )
        return {"seed": seed, "expert": expert_scores, "base": base_scores}

    def _tensors_of(self, checkpoint_id: str) -> CheckpointTensors:
        if checkpoint_id not in self._base_tensors:
            folder = self.registry.checkpoint_dir(self.registry.get(checkpoint_id))
            self._base_tensors[checkpoint_id] = CheckpointTensors(folder)
        return self._base_tensors[checkpoint_id]

    # blobs ---------------------------------------------------------------------------------

    def collect_garbage(self) -> int:
        """Delete delta blobs of rounds older than `keep_rounds`; returns blobs removed.

        Runs between two deltas of intake (under its lock), so that the blobs of a delta being
        fetched, or fetched and not yet recorded, are never taken for garbage. While intake is
        busy with a delta it does not wait: the intake loop collects once that delta is done.
        """
        if not self._lock.acquire(blocking=False):
            self.garbage_due = True  # the intake loop collects once this delta is recorded
            return 0
        try:
            self.garbage_due = False
            removed = self.blobs.gc(self._kept_blobs())
        finally:
            self._lock.release()
        if removed:
            oldest_kept = self.rounds.current_round().number - self.config.keep_rounds
            log.info("removed %d delta blobs of rounds before %d", removed, oldest_kept)
        return removed

    def _discard_blobs(self, fetched: set[str]) -> None:
        """Delete what intake fetched of a refused delta (`fetched`: blobs it had neither whole
        nor begun before), except blobs that a kept delta also lists (they are
        content-addressed). Blobs that were there already are left alone: an announcement names
        any blobs it likes, and must not remove another delta's partial download."""
        if not fetched:
            return
        in_use = self._kept_blobs()
        for sha in fetched - in_use:
            self.blobs.delete(sha)
            self.blobs.discard_partial(sha)

    def _kept_blobs(self) -> set[str]:
        """Blobs of the recorded deltas (accepted or merged) of the last `keep_rounds` rounds."""
        keep: set[str] = set()
        oldest_kept = self.rounds.current_round().number - self.config.keep_rounds
        with self.store.session() as s:
            rows = s.scalars(
                select(DeltaRecord)
                .where(DeltaRecord.manifest.is_not(None))
                .where(DeltaRecord.round >= oldest_kept)
            )
            for row in rows:
                if row.manifest is not None:
                    keep.update(_listed_blobs(row.manifest))
        if self.rounds.fanout is not None:
            keep |= self.rounds.fanout.kept_blobs()
        return keep


def record_id(signed: SignedManifest, from_peer: str) -> str:
    """The id a delta announcement is recorded under.

    A manifest announced by the peer it names is recorded under the manifest's id, which the node
    polls. One relayed by another peer gets an id of its own, so a relay can never pre-empt
    (and get rejected in place of) the genuine announcement.
    """
    try:
        claimed = DeltaManifest.decode(signed.manifest_bytes).peer_id
    except ManifestError:
        claimed = from_peer
    if claimed == from_peer:
        return signed.manifest_id
    return hashlib.sha256(f"{signed.manifest_id}:{from_peer}".encode()).hexdigest()


def _node_row(session: Session, peer_id: str, now: dt.datetime) -> NodeRecord:
    node = session.get(NodeRecord, peer_id)
    if node is None:
        node = NodeRecord(peer_id=peer_id, first_seen=now, last_seen=now)
        session.add(node)
    return node


def _listed_blobs(raw: bytes) -> list[str]:
    """The blobs a stored manifest lists. One accepted under older, looser checks may no longer
    decode; its blobs are still kept (read from the msgpack itself), and garbage collection
    goes on."""
    try:
        return list(DeltaManifest.decode(raw).blobs)
    except ManifestError as error:
        log.warning("a stored delta manifest no longer validates (%s); keeping its blobs", error)
        data = msgpack.unpackb(raw, raw=False)
        blobs = data.get("blobs") if isinstance(data, dict) else None
        return [sha for sha in blobs if isinstance(sha, str)] if isinstance(blobs, dict) else []


def _rejection_kind(exc: Exception) -> str:
    if isinstance(exc, DeltaRejected):
        return exc.kind
    if isinstance(exc, ManifestError):
        return "signature"
    if isinstance(exc, BlobFetchError | BlobStoreError):
        return "fetch"
    return "corrupt"  # DeltaError: a payload that does not decode against its manifest
