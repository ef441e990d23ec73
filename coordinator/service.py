"""The coordinator's engine: delta intake (verify, fetch, gate, record), the round policy, merges
evaluated beside the base and each expert, publication, operator actions, and crash recovery.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import math
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import torch
from pydantic import ValidationError
from skillswarm.coordinator.config import CoordinatorConfig, MergePlan
from skillswarm.coordinator.gates import (
    REJECTION_KINDS,
    DeltaRejected,
    check_domain_scores,
    check_layout,
    check_values,
    write_expert_checkpoint,
)
from skillswarm.coordinator.registry import CheckpointInfo, Registry, RevisionNotFound
from skillswarm.coordinator.store import (
    CheckpointRecord,
    CoordinatorStore,
    DeltaRecord,
    NodeRecord,
    OperatorActionRecord,
    PeerAccessRecord,
    RoundRecord,
    as_utc,
    utcnow,
)
from skillswarm.merge.methods import MergeSpec
from skillswarm.merge.streaming import CheckpointTensors, MergeError, TaskVector, merge_checkpoint
from skillswarm.protocol.blobstore import BlobStore, BlobStoreError
from skillswarm.protocol.delta import DeltaError, DeltaReader
from skillswarm.protocol.host import BlobFetchError, SwarmHost
from skillswarm.protocol.identity import (
    IdentityError,
    load_or_create_identity,
    public_key_bytes_from_peer_id,
)
from skillswarm.protocol.manifest import DeltaManifest, ManifestError, SignedManifest
from skillswarm.protocol.messages import (
    CheckpointPublished,
    DeltaAnnounced,
    MessageError,
    NodeHeartbeat,
    UnknownMessage,
    decode_message,
    encode_message,
)
from sqlalchemy import func, select
from sqlalchemy.orm import Session

__all__ = ["Coordinator", "DeltaRejected", "expert_label", "record_id"]

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

log = logging.getLogger(__name__)

MERGE_PLAN_SETTING = "merge_plan"
POLICY_CHECK_INTERVAL_S = 0.5
# Work folders made under work_dir while merging or gating; what a crash leaves is removed at start.
WORK_FOLDER_PREFIXES = ("merge-", "gate-")
ACCEPTED_STATUSES = ("accepted", "merged")


class MissingBaseCheckpoint(RuntimeError):
    """The registry is empty and the configuration names no usable round-0 checkpoint."""


class Coordinator:
    """Owns the store, registry, blob store and libp2p host of one coordinator process.

    The public methods are thread-safe: intake runs in its own thread, the HTTP layer calls in
    from its worker threads.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        config.work_dir.mkdir(parents=True, exist_ok=True)
        self.store = CoordinatorStore(config.db_url)
        self.config = self._with_persisted_merge_plan(config)
        self.registry = Registry(config.work_dir / "registry", repo_id=config.repo_id)
        self.blobs = BlobStore(config.work_dir / "blobs")
        self.key_pair = load_or_create_identity(config.identity_path)
        self.host = SwarmHost(
            self.key_pair,
            self.blobs,
            topic=config.topic,
            listen_host=config.p2p_host,
            listen_port=config.p2p_port,
            max_blob_bytes=config.max_blob_bytes,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._intake_lock = threading.RLock()  # one delta through the checks at a time
        self._state_lock = threading.RLock()  # round status changes vs. admitting a delta
        self._merge_lock = threading.Lock()  # one merge at a time
        self._nodes_lock = threading.Lock()
        self._base_tensors: dict[str, CheckpointTensors] = {}
        self._garbage_due = False  # collect_garbage found intake busy; the intake loop runs it
        self._score_cache: dict[tuple[str, str, int, int], dict[str, Any]] = {}
        self.fetch_retry_cooldown_s = FETCH_RETRY_COOLDOWN_S

    # lifecycle -----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Publish the base as round 0 if the registry is empty; settle a merge a crash cut
        short; make sure a round is open."""
        self._remove_work_leftovers()
        self._ensure_base()
        self._recover_interrupted_round()
        self._ensure_open_round()

    def start(self) -> None:
        """Prepare, start the libp2p host and the intake thread (which also merges a round whose
        policy is met, e.g. one left open by a restart, or one whose deadline passed)."""
        self.prepare()
        self.host.start()
        log.info("coordinator peer %s listening on %s", self.host.peer_id, self.host.listen_addrs)
        self._thread = threading.Thread(target=self._intake_loop, name="delta-intake", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.host.stop()
        self.store.close()

    # state ---------------------------------------------------------------------------------

    def current_round(self) -> RoundRecord:
        with self.store.session() as s:
            row = s.scalars(select(RoundRecord).order_by(RoundRecord.number.desc())).first()
            assert row is not None, "a round is opened at start"
            return row

    def advertised_addrs(self) -> list[str]:
        """The libp2p multiaddrs nodes should dial: `p2p_announce_addrs` with this peer's id
        appended, or, without them, the addresses the host listens on (a host listening on
        0.0.0.0 is advertised by its interface addresses only when configured)."""
        if not self.config.p2p_announce_addrs:
            return self.host.listen_addrs
        peer = self.host.peer_id
        return [
            addr if "/p2p/" in addr else f"{addr.rstrip('/')}/p2p/{peer}"
            for addr in self.config.p2p_announce_addrs
        ]

    def current_base(self) -> CheckpointInfo:
        return self.registry.get("main")

    def round_base(self, round_record: RoundRecord) -> CheckpointInfo:
        """The checkpoint a round trains on. Between publishing a merge (which moves `main`)
        and opening the next round, `main` is already the next round's base: a node that paired
        it with the current round's number would train a delta for a round that is closing."""
        return self.registry.get(round_record.base_id)

    def round_record(self, number: int) -> dict[str, Any]:
        """One round as the API lists it; KeyError for an unknown round."""
        with self.store.session() as s:
            row = s.get(RoundRecord, number)
            if row is None:
                raise KeyError(f"no round {number}")
            return _round_dict(row)

    def _with_persisted_merge_plan(self, config: CoordinatorConfig) -> CoordinatorConfig:
        stored = self.store.setting(MERGE_PLAN_SETTING)
        if stored is None:
            return config
        try:
            plan = MergePlan.model_validate(stored)
        except ValidationError as exc:
            log.warning("ignored the stored merge spec, which no longer validates: %s", exc)
            return config
        if plan != config.merge:
            log.info("merge spec %s set by the operator overrides the config file's", plan.method)
        return config.model_copy(update={"merge": plan})

    def _remove_work_leftovers(self) -> None:
        for entry in self.config.work_dir.iterdir():
            if entry.is_dir() and entry.name.startswith(WORK_FOLDER_PREFIXES):
                log.info("removing %s, left by an interrupted merge or check", entry)
                shutil.rmtree(entry, ignore_errors=True)

    def _ensure_base(self) -> None:
        if self.registry.list():
            return
        source = self.config.base_checkpoint
        if source is None or not (Path(source) / "config.json").is_file():
            where = "is not set" if source is None else f"({source}) has no config.json"
            raise MissingBaseCheckpoint(
                f"the coordinator has no round-0 checkpoint: base_checkpoint {where}. Point it at "
                "a Hugging Face model folder, or build the embedded one with "
                "`skillswarm bootstrap --out DIR` and set base_checkpoint = DIR"
            )
        info = self.registry.publish(Path(source), round=0, parent=None, method=None)
        with self.store.session() as s:
            s.merge(CheckpointRecord(id=info.id, revision=info.revision, round=0, parent=None))
        log.info("published base checkpoint %s as round 0", info.id[:12])

    def _recover_interrupted_round(self) -> None:
        """A round left "merging" by a crash: record it if its checkpoint reached the registry
        (publication is atomic), else reopen it so that it merges again."""
        with self.store.session() as s:
            last = s.scalars(select(RoundRecord).order_by(RoundRecord.number.desc())).first()
            if last is None or last.status != "merging":
                return
            number, base_id = last.number, last.base_id
        published = [
            info
            for info in self.registry.list()
            if info.round == number and info.parent == base_id and not info.retired
        ]
        if published:
            log.info("round %d was published before the coordinator stopped; recording it", number)
            self._record_published(number, published[-1])
            return
        with self._state_lock, self.store.session() as s:
            row = s.get(RoundRecord, number)
            assert row is not None
            row.status = "open"
        log.info("round %d's merge was cut short; it merges again once its policy is met", number)

    def _ensure_open_round(self) -> None:
        base = self.current_base()
        with self._state_lock, self.store.session() as s:
            last = s.scalars(select(RoundRecord).order_by(RoundRecord.number.desc())).first()
            if last is None or last.status in ("published", "failed", "abandoned"):
                number = 1 if last is None else last.number + 1
                s.add(RoundRecord(number=number, base_id=base.id, status="open"))

    # intake --------------------------------------------------------------------------------

    def _intake_loop(self) -> None:
        next_policy_check = 0.0
        while not self._stop.is_set():
            try:
                msg = self.host.messages.get(timeout=POLICY_CHECK_INTERVAL_S)
            except queue.Empty:
                msg = None
            if msg is not None:
                self._handle_gossip(msg.from_peer, msg.data)
            if self._garbage_due:
                self.collect_garbage()
            if time.monotonic() >= next_policy_check:
                next_policy_check = time.monotonic() + POLICY_CHECK_INTERVAL_S
                try:
                    self.maybe_merge()
                except Exception:  # recorded on the round; intake goes on
                    log.exception("a merge due by the round policy failed")

    def _handle_gossip(self, from_peer: str, data: bytes) -> None:
        try:
            body = decode_message(data)
        except UnknownMessage as exc:
            log.info("ignored gossip from %s: %s", from_peer, exc)
            return
        except MessageError as exc:
            log.warning("refused gossip from %s: %s", from_peer, exc)
            return
        try:
            if isinstance(body, DeltaAnnounced):
                self.handle_announcement(from_peer, body)
            elif isinstance(body, NodeHeartbeat):
                refusal = self._sender_refusal(from_peer)
                if refusal is not None:  # nothing of a refused peer is recorded
                    log.debug("ignored a heartbeat: %s", refusal)
                    return
                self.record_heartbeat(from_peer, body)
        except Exception:  # one bad message must not stop intake
            log.exception("error handling %s from %s", body.type, from_peer)

    def record_heartbeat(self, peer_id: str, heartbeat: NodeHeartbeat) -> None:
        """Note a node's heartbeat: its domain, round, step and latest reward."""
        now = utcnow()
        reward = heartbeat.reward
        with self._nodes_lock, self.store.session() as s:
            node = _node_row(s, peer_id, now)
            node.domain = heartbeat.domain
            node.round = heartbeat.round
            node.step = heartbeat.step
            node.reward = reward if reward is not None and math.isfinite(reward) else None
            node.last_seen = now
            node.last_heartbeat = now

    def _saw_peer(self, peer_id: str, domain: str | None) -> None:
        now = utcnow()
        with self._nodes_lock, self.store.session() as s:
            node = _node_row(s, peer_id, now)
            if domain is not None:
                node.domain = domain
            node.last_seen = now

    def handle_announcement(self, from_peer: str, body: DeltaAnnounced) -> DeltaRecord:
        """Verify, fetch, validate and record one announced delta; maybe close the round."""
        signed = body.signed
        delta_id = record_id(signed, from_peer)
        with self._intake_lock:
            with self.store.session() as s:
                existing = s.get(DeltaRecord, delta_id)
                if (
                    existing is not None
                    and existing.status == "rejected"
                    and existing.rejection_kind == "fetch"
                    and self._fetch_retry_due(existing)
                ):
                    # Its blobs could not be fetched last time (the node was unreachable, the
                    # link dropped): the announcement is taken again, resuming any partial blob.
                    log.info(
                        "retrying delta %s, whose earlier fetch failed: %s",
                        delta_id[:12],
                        existing.reason,
                    )
                    s.delete(existing)
                    existing = None
                if existing is not None and existing.rejection_kind == "fetch":
                    log.info(
                        "ignored announcement of delta %s: its fetch failed under %.0f s ago",
                        delta_id[:12],
                        self.fetch_retry_cooldown_s,
                    )
                    return existing
                if existing is not None:
                    log.info(
                        "ignored repeated announcement of delta %s (%s in round %s)",
                        delta_id[:12],
                        existing.status,
                        existing.round,
                    )
                    return existing
            manifest: DeltaManifest | None = None
            fresh: set[str] = set()  # blobs this intake brings in: neither whole nor begun before
            try:
                refusal = self._sender_refusal(from_peer)
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
            except (
                DeltaRejected,
                ManifestError,
                DeltaError,
                BlobFetchError,
                BlobStoreError,
            ) as exc:
                record = self._record_rejection(delta_id, from_peer, manifest, exc)
                if record.rejection_kind != "fetch":
                    self._discard_blobs(fresh)
                return record
            record = DeltaRecord(
                id=delta_id,
                peer_id=manifest.peer_id,
                announced_by=from_peer,
                domain=manifest.domain,
                base_id=manifest.base_id,
                round=manifest.round,
                steps=manifest.steps,
                status="accepted",
                metrics=dict(manifest.metrics),
                checks=checks,
                manifest=signed.manifest_bytes,
            )
            with self._state_lock:
                current = self.current_round()
                if current.number != manifest.round or current.status != "open":
                    closed = DeltaRejected(
                        f"round {manifest.round} closed while the delta was being checked",
                        "stale",
                    )
                    rejected = self._record_rejection(delta_id, from_peer, manifest, closed)
                    self._discard_blobs(fresh)
                    return rejected
                with self.store.session() as s:
                    s.add(record)
            self._saw_peer(from_peer, manifest.domain)
            log.info(
                "accepted delta %s from %s (%s, round %d)",
                delta_id[:12],
                manifest.peer_id,
                manifest.domain,
                manifest.round,
            )
        self.maybe_merge()
        return record

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
            status="rejected",
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

    def _sender_refusal(self, peer_id: str) -> str | None:
        """Why nothing from `peer_id` is taken (denied by the operator, or not on a configured
        allow-list); None when it may take part."""
        verdict = self._peer_verdict(peer_id)
        if verdict is False:
            return f"peer {peer_id} is denied"
        allowed = self.config.allowed_peers
        if allowed and peer_id not in allowed and verdict is not True:
            return f"peer {peer_id} is not on the allow-list"
        return None

    def _check_admission(self, manifest: DeltaManifest) -> None:
        """Base, round, size and lossiness (its signer, the announcing peer, was admitted
        before its signature was checked)."""
        current = self.current_round()
        if manifest.base_id != current.base_id:
            raise DeltaRejected(
                f"base {manifest.base_id[:12]} is not the current base {current.base_id[:12]}",
                "stale",
            )
        if manifest.round != current.number:
            raise DeltaRejected(
                f"delta is for round {manifest.round}, current is {current.number}", "stale"
            )
        if current.status != "open":
            raise DeltaRejected(f"round {current.number} is {current.status}, not open", "stale")
        total = sum(manifest.blobs.values())
        if total > self.config.max_blob_bytes:
            raise DeltaRejected(
                f"delta of {total} bytes exceeds {self.config.max_blob_bytes}", "size"
            )
        if manifest.lossy and not self.config.accept_lossy:
            raise DeltaRejected("lossy (int8) deltas are not accepted by this coordinator", "lossy")

    def _peer_verdict(self, peer_id: str) -> bool | None:
        with self.store.session() as s:
            row = s.get(PeerAccessRecord, peer_id)
            return None if row is None else row.allowed

    def _fetch_retry_due(self, failed: DeltaRecord) -> bool:
        """Whether FETCH_RETRY_COOLDOWN_S has passed since `failed`'s fetch failure was recorded."""
        waited = (utcnow() - as_utc(failed.received_at)).total_seconds()
        return waited >= self.fetch_retry_cooldown_s

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
        base_scores = self._scores(
            self._folder(base_info), domains, gates.n_tasks, seed, cache_as=base_info.id
        )
        folder = Path(tempfile.mkdtemp(prefix="gate-", dir=self.config.work_dir))
        try:
            write_expert_checkpoint(self._folder(base_info), reader, folder / "expert")
            expert_scores = self._scores(folder / "expert", domains, gates.n_tasks, seed)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        check_domain_scores(
            manifest.domain,
            {d: _mean_reward(row) for d, row in expert_scores.items()},
            {d: _mean_reward(row) for d, row in base_scores.items()},
            gates,
        )
        return {"seed": seed, "expert": expert_scores, "base": base_scores}

    def _tensors_of(self, checkpoint_id: str) -> CheckpointTensors:
        if checkpoint_id not in self._base_tensors:
            folder = self._folder(self.registry.get(checkpoint_id))
            self._base_tensors[checkpoint_id] = CheckpointTensors(folder)
        return self._base_tensors[checkpoint_id]

    def _folder(self, info: CheckpointInfo) -> Path:
        return self.registry.checkpoint_dir(info)

    # rounds --------------------------------------------------------------------------------

    def _accepted(self, number: int) -> list[DeltaRecord]:
        with self.store.session() as s:
            return list(
                s.scalars(
                    select(DeltaRecord)
                    .where(DeltaRecord.round == number)
                    .where(DeltaRecord.status == "accepted")
                    .order_by(DeltaRecord.received_at)
                )
            )

    def policy_trigger(self, current: RoundRecord, accepted: Sequence[DeltaRecord]) -> str | None:
        """ "quorum" or "deadline" when the round should merge now, else None."""
        policy = self.config.round
        domains = {d.domain for d in accepted}
        if len(accepted) >= policy.min_deltas and all(
            d in domains for d in policy.required_domains
        ):
            return "quorum"
        if policy.deadline_s is not None and len(accepted) >= policy.min_deltas_at_deadline:
            open_for = (utcnow() - as_utc(current.started_at)).total_seconds()
            if open_for >= policy.deadline_s:
                return "deadline"
        return None

    def maybe_merge(self, force: bool = False) -> CheckpointInfo | None:
        """Merge the current round if its policy is met (or `force`); returns what was published.

        Returns None when nothing is due, or when another merge is running.
        """
        if not self._merge_lock.acquire(blocking=False):
            return None
        try:
            current = self.current_round()
            if current.status != "open":
                return None
            accepted = self._accepted(current.number)
            if not accepted:
                return None
            trigger = "operator" if force else self.policy_trigger(current, accepted)
            if trigger is None:
                return None
            return self._run_round(current.number, trigger)
        finally:
            self._merge_lock.release()

    def request_round(self) -> dict[str, Any]:
        """Merge the current round now, whatever its policy says; returns the round's record
        (status "published", or "failed" with the error). ValueError when there is nothing to
        merge or a merge is already running."""
        if not self._merge_lock.acquire(blocking=False):
            raise ValueError(f"round {self.current_round().number} is already merging")
        try:
            current = self.current_round()
            if current.status != "open":
                raise ValueError(f"round {current.number} is {current.status}, not open")
            if not self._accepted(current.number):
                raise ValueError(f"no accepted deltas in round {current.number}")
            self._record_action("request_round", str(current.number), {})
            try:
                self._run_round(current.number, "operator")
            except Exception:  # the failure is on the round's record, which is returned
                log.exception("operator-requested merge of round %d failed", current.number)
            return self.round_record(current.number)
        finally:
            self._merge_lock.release()

    def _run_round(self, number: int, trigger: str) -> CheckpointInfo:
        """Merge round `number` (open, with accepted deltas); the caller holds the merge lock."""
        plan = self.config.merge
        with self._state_lock, self.store.session() as s:
            row = s.get(RoundRecord, number)
            assert row is not None and row.status == "open"
            accepted = list(
                s.scalars(
                    select(DeltaRecord)
                    .where(DeltaRecord.round == number)
                    .where(DeltaRecord.status == "accepted")
                    .order_by(DeltaRecord.received_at)
                )
            )
            row.status = "merging"
            row.inputs = [d.id for d in accepted]
            row.method = plan.specs()[0].model_dump()
            row.trigger = trigger
            row.error = None
            base_id = row.base_id
        started = time.monotonic()
        log.info(
            "round %d (%s): merging %d deltas by %s",
            number,
            trigger,
            len(accepted),
            ", ".join(spec.method for spec in plan.specs()),
        )
        work = Path(tempfile.mkdtemp(prefix=f"merge-round{number}-", dir=self.config.work_dir))
        try:
            base = self.registry.get(base_id)
            base_dir = self._folder(base)
            readers = {record.id: _reader_of(record, self.blobs) for record in accepted}
            experts = [TaskVector(name=i[:16], expert=r.expert) for i, r in readers.items()]
            chosen, candidate_dir, candidates = self._merge_candidates(
                plan.specs(), base_dir, experts, work
            )
            evaluation = self._evaluation_table(base, accepted, readers, candidate_dir, work)
            info = self.registry.publish(
                candidate_dir,
                round=number,
                parent=base.id,
                method=chosen.method,
                extra={
                    "inputs": [d.id for d in accepted],
                    "evaluation": evaluation,
                    "merge_spec": chosen.model_dump(),
                    "candidates": candidates,
                    "trigger": trigger,
                    "merge_seconds": round(time.monotonic() - started, 3),
                },
            )
        except Exception as exc:  # any failure ends the round on record, never half-published
            with self._state_lock, self.store.session() as s:
                row = s.get(RoundRecord, number)
                assert row is not None
                row.status = "failed"
                row.error = f"{type(exc).__name__}: {exc}"
                row.finished_at = utcnow()
                s.add(RoundRecord(number=number + 1, base_id=base_id, status="open"))
            log.exception("round %d failed: %s", number, exc)
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self._record_published(number, info)
        log.info("round %d published checkpoint %s", number, info.id[:12])
        self._announce_checkpoint(info, number, base_id)
        self.collect_garbage()
        return info

    def _record_published(self, number: int, info: CheckpointInfo) -> None:
        """Record round `number` as published by `info` (whose extra holds the round's results)
        and open the next round on it."""
        extra = info.extra
        with self._state_lock, self.store.session() as s:
            row = s.get(RoundRecord, number)
            assert row is not None
            row.status = "published"
            row.inputs = list(extra.get("inputs", row.inputs))
            row.evaluation = dict(extra.get("evaluation", {}))
            row.candidates = list(extra.get("candidates", []))
            row.method = dict(extra.get("merge_spec", row.method))
            row.trigger = extra.get("trigger", row.trigger)
            row.merge_seconds = extra.get("merge_seconds")
            row.checkpoint_id = info.id
            row.error = None
            row.finished_at = utcnow()
            for delta_id in row.inputs:
                delta = s.get(DeltaRecord, delta_id)
                if delta is not None:
                    delta.status = "merged"
            s.merge(
                CheckpointRecord(
                    id=info.id,
                    revision=info.revision,
                    round=number,
                    parent=info.parent,
                    method=info.method,
                )
            )
            s.add(RoundRecord(number=number + 1, base_id=info.id, status="open"))

    def _merge_candidates(
        self, specs: Sequence[MergeSpec], base_dir: Path, experts: Sequence[TaskVector], work: Path
    ) -> tuple[MergeSpec, Path, list[dict[str, Any]]]:
        """Merge by each spec; with one spec that is the candidate, with several the best mean
        reward on the validation tasks wins. Returns the chosen spec, its folder, and every
        candidate's record (empty with a single spec)."""
        if len(specs) == 1:
            return specs[0], merge_checkpoint(base_dir, experts, work / "candidate", specs[0]), []
        eval_config = self.config.eval
        seed = eval_config.validation_tasks_seed()
        records: list[dict[str, Any]] = []
        best: tuple[int, Path, float] | None = None
        for index, spec in enumerate(specs):
            folder = work / f"candidate-{index}"
            record: dict[str, Any] = {"spec": spec.model_dump(), "seed": seed, "chosen": False}
            records.append(record)
            try:
                merge_checkpoint(base_dir, experts, folder, spec)
            except Exception as exc:  # one unusable candidate does not sink the round
                record |= {"error": f"{type(exc).__name__}: {exc}", "score": None}
                shutil.rmtree(folder, ignore_errors=True)
                continue
            scores = self._scores(folder, eval_config.domains, eval_config.n_tasks, seed)
            score = sum(_mean_reward(row) for row in scores.values()) / len(scores)
            record |= {"validation": scores, "score": score}
            if best is None or score > best[2]:
                if best is not None:
                    shutil.rmtree(best[1], ignore_errors=True)
                best = (index, folder, score)
            else:
                shutil.rmtree(folder, ignore_errors=True)
        if best is None:
            errors = "; ".join(f"{r['spec']['method']}: {r['error']}" for r in records)
            raise MergeError(f"every merge candidate failed: {errors}")
        records[best[0]]["chosen"] = True
        log.info("merge candidates scored %s", [(r["spec"]["method"], r["score"]) for r in records])
        return specs[best[0]], best[1], records

    def _evaluation_table(
        self,
        base: CheckpointInfo,
        accepted: Sequence[DeltaRecord],
        readers: Mapping[str, DeltaReader],
        merged_dir: Path,
        work: Path,
    ) -> dict[str, Any]:
        """Held-out scores of the base, each expert (its delta applied alone) and the merged
        candidate on every configured domain, all through the same rollout engine."""
        eval_config = self.config.eval
        domains, n_tasks, seed = eval_config.domains, eval_config.n_tasks, eval_config.seed
        base_dir = self._folder(base)
        table: dict[str, Any] = {
            "base": self._scores(base_dir, domains, n_tasks, seed, cache_as=base.id)
        }
        for record in accepted:
            folder = write_expert_checkpoint(base_dir, readers[record.id], work / "expert")
            table[expert_label(record)] = self._scores(folder, domains, n_tasks, seed)
            shutil.rmtree(folder, ignore_errors=True)
        table["merged"] = self._scores(merged_dir, domains, n_tasks, seed)
        return table

    def evaluate(self, checkpoints: Mapping[str, Path]) -> dict[str, Any]:
        """Held-out scores of each named checkpoint on every configured domain."""
        eval_config = self.config.eval
        return {
            label: self._scores(folder, eval_config.domains, eval_config.n_tasks, eval_config.seed)
            for label, folder in checkpoints.items()
        }

    def _scores(
        self,
        folder: Path,
        domains: Sequence[str],
        n_tasks: int,
        seed: int,
        cache_as: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """{domain: {mean_reward, success_rate, n}} of one checkpoint, loaded once; results of a
        published checkpoint (`cache_as` its id) are kept for the next asks."""
        from skillswarm.agent.evaluate import evaluate_checkpoint
        from skillswarm.agent.model import load_policy

        scores: dict[str, dict[str, Any]] = {}
        policy = None
        for domain in domains:
            key = (cache_as or "", domain, n_tasks, seed)
            if cache_as is not None and key in self._score_cache:
                scores[domain] = self._score_cache[key]
                continue
            if policy is None:
                policy = load_policy(folder)
            result = evaluate_checkpoint(policy, domain, n_tasks=n_tasks, seed=seed)
            scores[domain] = {
                "mean_reward": _finite(result.mean_reward),
                "success_rate": _finite(result.success_rate),
                "n": result.n,
            }
            if cache_as is not None:
                self._score_cache[key] = scores[domain]
        return scores

    def collect_garbage(self) -> int:
        """Delete delta blobs of rounds older than `keep_rounds`; returns blobs removed.

        Runs between two deltas of intake (under its lock), so that the blobs of a delta being
        fetched, or fetched and not yet recorded, are never taken for garbage. While intake is
        busy with a delta it does not wait: the intake loop collects once that delta is done.
        """
        if not self._intake_lock.acquire(blocking=False):
            self._garbage_due = True  # the intake loop collects once this delta is recorded
            return 0
        try:
            self._garbage_due = False
            removed = self.blobs.gc(self._kept_blobs())
        finally:
            self._intake_lock.release()
        if removed:
            oldest_kept = self.current_round().number - self.config.keep_rounds
            log.info("removed %d delta blobs of rounds before %d", removed, oldest_kept)
        return removed

    def _kept_blobs(self) -> set[str]:
        """Blobs of the recorded deltas (accepted or merged) of the last `keep_rounds` rounds."""
        keep: set[str] = set()
        oldest_kept = self.current_round().number - self.config.keep_rounds
        with self.store.session() as s:
            rows = s.scalars(
                select(DeltaRecord)
                .where(DeltaRecord.manifest.is_not(None))
                .where(DeltaRecord.round >= oldest_kept)
            )
            for row in rows:
                assert row.manifest is not None
                keep.update(_listed_blobs(row.manifest))
        return keep

    def _announce_checkpoint(self, info: CheckpointInfo, number: int, parent: str) -> None:
        try:
            self.host.publish(
                encode_message(
                    CheckpointPublished(checkpoint_id=info.id, round=number, parent=parent)
                )
            )
        except Exception as exc:  # nodes also poll the registry; gossip is a shortcut
            log.warning("could not announce checkpoint %s on gossip: %s", info.id[:12], exc)

    # operator ------------------------------------------------------------------------------

    def set_merge_spec(self, spec: MergeSpec) -> None:
        """Merge by `spec` from the next merge on (it replaces the configured plan, candidates
        included); kept across restarts. ValueError if mergekit cannot merge with it."""
        if not isinstance(spec, MergeSpec):
            raise ValueError(f"expected a MergeSpec, got {type(spec).__name__}")
        try:
            plan = MergePlan.model_validate(spec.model_dump())
        except ValidationError as exc:
            raise ValueError(f"invalid merge spec: {exc}") from exc
        for candidate in plan.specs():
            probe_merge_spec(candidate)
        self.store.set_setting(MERGE_PLAN_SETTING, plan.model_dump(mode="json"))
        self.config = self.config.model_copy(update={"merge": plan})
        self._record_action("set_merge_spec", plan.method, plan.model_dump(mode="json"))
        log.info("merge spec set to %s", plan.model_dump(mode="json"))

    def set_peer_allowed(self, peer_id: str, allowed: bool) -> None:
        """Allow a peer (it joins the allow-list; a denial is lifted) or deny it (its future
        deltas are refused before anything is fetched); kept across restarts."""
        if not isinstance(allowed, bool):
            raise ValueError(f"allowed must be true or false, got {allowed!r}")
        if not isinstance(peer_id, str) or not 0 < len(peer_id) <= 128:
            raise ValueError(f"{peer_id!r} is not a PeerID")
        try:
            public_key_bytes_from_peer_id(peer_id)
        except IdentityError as exc:
            raise ValueError(f"{exc}; give the peer's base58 Ed25519 PeerID") from exc
        with self.store.session() as s:
            s.merge(PeerAccessRecord(peer_id=peer_id, allowed=allowed, updated_at=utcnow()))
        self._record_action("allow_peer" if allowed else "deny_peer", peer_id, {})
        log.info("peer %s is now %s", peer_id, "allowed" if allowed else "denied")

    def retire_checkpoint(self, revision: str) -> dict[str, Any]:
        """Retire a checkpoint (never `main` again, no longer served); if it is the open round's
        base, that round is abandoned and a new one opens on the new `main`. KeyError for an
        unknown revision; ValueError while a merge runs or for the last checkpoint in service."""
        if not self._merge_lock.acquire(blocking=False):
            raise ValueError(
                f"round {self.current_round().number} is merging; retire once it is published"
            )
        try:
            try:
                info = self.registry.get(revision)
            except RevisionNotFound as exc:
                raise KeyError(str(exc)) from exc
            in_service = [i.id for i in self.registry.list() if not i.retired]
            if in_service == [info.id]:
                raise ValueError(
                    f"checkpoint {info.revision} is the only one in service; publish another "
                    "before retiring it"
                )
            retired = self.registry.retire(info.id)
            self._record_action("retire_checkpoint", info.id, {"revision": info.revision})
            self._abandon_round_on(info.id)
            log.info("retired checkpoint %s", info.id[:12])
            return self._checkpoint_dict(retired)
        finally:
            self._merge_lock.release()

    def _abandon_round_on(self, retired_id: str) -> None:
        new_base = self.current_base()
        with self._state_lock, self.store.session() as s:
            row = s.scalars(select(RoundRecord).order_by(RoundRecord.number.desc())).first()
            if row is None or row.status != "open" or row.base_id != retired_id:
                return
            reason = f"base {retired_id[:12]} was retired before round {row.number} merged"
            row.status = "abandoned"
            row.error = reason
            row.finished_at = utcnow()
            for delta in s.scalars(
                select(DeltaRecord)
                .where(DeltaRecord.round == row.number)
                .where(DeltaRecord.status == "accepted")
            ):
                delta.status, delta.reason, delta.rejection_kind = "rejected", reason, "retired"
            s.add(RoundRecord(number=row.number + 1, base_id=new_base.id, status="open"))
        log.info("round abandoned: %s; the next round builds on %s", reason, new_base.id[:12])

    def _checkpoint_dict(self, info: CheckpointInfo) -> dict[str, Any]:
        with self.store.session() as s:
            row = s.scalars(select(RoundRecord).where(RoundRecord.checkpoint_id == info.id)).first()
            evaluation = row.evaluation if row is not None else None
        return {
            "id": info.id,
            "revision": info.revision,
            "round": info.round,
            "parent": info.parent,
            "method": info.method,
            "created_at": info.created_at,
            "size": info.total_size,
            "retired": info.retired,
            "evaluation": evaluation,
        }

    def _record_action(self, action: str, subject: str, detail: dict[str, Any]) -> None:
        with self.store.session() as s:
            s.add(OperatorActionRecord(action=action, subject=subject, detail=detail))

    # observability -------------------------------------------------------------------------

    def nodes(self) -> list[dict[str, Any]]:
        """Every peer heard from, most recent first: its domain, when it was last seen, its
        latest heartbeat (round, step, reward) and how many of its deltas were accepted or
        rejected."""
        with self.store.session() as s:
            counts: dict[tuple[str, str], int] = {
                (peer, status): count
                for peer, status, count in s.execute(
                    select(DeltaRecord.announced_by, DeltaRecord.status, func.count()).group_by(
                        DeltaRecord.announced_by, DeltaRecord.status
                    )
                )
            }
            rows = list(s.scalars(select(NodeRecord).order_by(NodeRecord.last_seen.desc())))
        return [
            {
                "peer_id": node.peer_id,
                "domain": node.domain,
                "first_seen": as_utc(node.first_seen).isoformat(),
                "last_seen": as_utc(node.last_seen).isoformat(),
                "last_heartbeat": (
                    as_utc(node.last_heartbeat).isoformat() if node.last_heartbeat else None
                ),
                "round": node.round,
                "step": node.step,
                "reward": node.reward,
                "accepted": sum(counts.get((node.peer_id, st), 0) for st in ACCEPTED_STATUSES),
                "rejected": counts.get((node.peer_id, "rejected"), 0),
            }
            for node in rows
        ]

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for Prometheus, read from the store (so they survive restarts).

        Names ending in _total are counters; `deltas_rejected_<kind>_total` split the rejections
        by gates.REJECTION_KINDS.
        """
        with self.store.session() as s:
            by_status = dict(
                s.execute(
                    select(DeltaRecord.status, func.count()).group_by(DeltaRecord.status)
                ).all()
            )
            by_kind = dict(
                s.execute(
                    select(DeltaRecord.rejection_kind, func.count())
                    .where(DeltaRecord.status == "rejected")
                    .group_by(DeltaRecord.rejection_kind)
                ).all()
            )
            rounds = dict(
                s.execute(
                    select(RoundRecord.status, func.count()).group_by(RoundRecord.status)
                ).all()
            )
            last_merge = s.scalars(
                select(RoundRecord.merge_seconds)
                .where(RoundRecord.status == "published")
                .order_by(RoundRecord.number.desc())
            ).first()
            current = s.scalars(select(func.max(RoundRecord.number))).one()
            nodes_seen = s.scalars(select(func.count()).select_from(NodeRecord)).one()
        checkpoints = self.registry.list()
        values: dict[str, float] = {
            "deltas_received_total": float(sum(by_status.values())),
            "deltas_accepted_total": float(sum(by_status.get(s, 0) for s in ACCEPTED_STATUSES)),
            "deltas_rejected_total": float(by_status.get("rejected", 0)),
            "rounds_completed_total": float(rounds.get("published", 0)),
            "rounds_failed_total": float(rounds.get("failed", 0)),
            "current_round": float(current or 0),
            "merge_seconds_last": float(last_merge or 0.0),
            "checkpoints_published_total": float(len(checkpoints)),
            "checkpoints_retired_total": float(sum(i.retired for i in checkpoints)),
            "nodes_seen": float(nodes_seen),
        }
        for kind in REJECTION_KINDS:
            values[f"deltas_rejected_{kind}_total"] = float(by_kind.get(kind, 0))
        return values


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


def expert_label(record: DeltaRecord) -> str:
    """The evaluation table's label of one delta applied alone to the base."""
    return f"expert:{record.domain}:{record.id[:12]}"


def probe_merge_spec(spec: MergeSpec) -> None:
    """Merge a few small tensors by `spec` so that an unusable spec is refused when it is set,
    not when a round merges. ValueError naming the problem."""
    from mergekit.merge_methods import merge_tensors

    for key, value in spec.parameters.items():
        if isinstance(value, Mapping):
            raise ValueError(
                f"parameter {key}: per-expert values cannot be set ahead of a round (experts are "
                "the round's deltas); give one value for all"
            )
    names = ["probe_a", "probe_b"]
    generator = torch.Generator().manual_seed(spec.seed)
    base = torch.randn(8, 8, generator=generator)
    experts = [base + 0.01 * torch.randn(8, 8, generator=generator) for _ in names]
    inputs, ids = (
        ([base, *experts], ["base", *names]) if spec.uses_base() else (experts, list(names))
    )
    try:
        merged = merge_tensors(
            inputs,
            spec.method_object(),
            parameters=spec.bound_parameters(names),
            ids=ids,
            base_index=0 if spec.uses_base() else None,
            name="probe",
            dtype=spec.torch_dtype(),
            out_dtype=torch.float32,
        )
    except Exception as exc:
        raise ValueError(
            f"merge method {spec.method} cannot merge with {spec.parameters}: {exc}"
        ) from exc
    if tuple(merged.shape) != (8, 8) or not bool(merged.isfinite().all()):
        raise ValueError(f"merge method {spec.method} with {spec.parameters} gives no usable merge")


def _node_row(session: Session, peer_id: str, now: dt.datetime) -> NodeRecord:
    node = session.get(NodeRecord, peer_id)
    if node is None:
        node = NodeRecord(peer_id=peer_id, first_seen=now, last_seen=now)
        session.add(node)
    return node


def _reader_of(record: DeltaRecord, blobs: BlobStore) -> DeltaReader:
    assert record.manifest is not None, "accepted deltas keep their manifest"
    return DeltaReader(DeltaManifest.decode(record.manifest), blobs)


def _round_dict(row: RoundRecord) -> dict[str, Any]:
    return {
        "number": row.number,
        "base_id": row.base_id,
        "status": row.status,
        "method": row.method,
        "inputs": row.inputs,
        "evaluation": row.evaluation,
        "candidates": row.candidates or [],
        "trigger": row.trigger,
        "merge_seconds": row.merge_seconds,
        "checkpoint_id": row.checkpoint_id,
        "error": row.error,
        "started_at": row.started_at,
        "finished_at": row.finished_at,
    }


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


def _mean_reward(row: Mapping[str, Any]) -> float:
    value = row.get("mean_reward")
    return 0.0 if value is None else float(value)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
