"""The coordinator's engine: hears delta announcements, verifies and fetches them, runs rounds.

A round: deltas against the current base are verified (signature, signer, base, round), fetched
over the blob protocol (sha256 checked), validated against the base, and recorded; when the round
policy is met they are merged with mergekit, the candidate is evaluated beside the base, published
to the registry, and announced on gossip as the next base.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import select

from coordinator.config import CoordinatorConfig
from coordinator.registry import CheckpointInfo, Registry
from coordinator.store import CheckpointRecord, CoordinatorStore, DeltaRecord, RoundRecord, utcnow
from merge.streaming import CheckpointTensors, TaskVector, merge_checkpoint
from protocol.blobstore import BlobStore
from protocol.delta import DTYPE_NAMES, DeltaError, DeltaReader
from protocol.host import BlobFetchError, SwarmHost
from protocol.identity import load_or_create_identity
from protocol.manifest import DeltaManifest, ManifestError, SignedManifest
from protocol.messages import (
    CheckpointPublished,
    DeltaAnnounced,
    MessageError,
    UnknownMessage,
    decode_message,
    encode_message,
)

log = logging.getLogger(__name__)


class DeltaRejected(Exception):
    """A delta failed a check; the message is the reason kept on record."""


class Coordinator:
    """Owns the store, registry, blob store and libp2p host of one coordinator process."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        config.work_dir.mkdir(parents=True, exist_ok=True)
        self.store = CoordinatorStore(config.db_url)
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
        self._lock = threading.RLock()
        self._base_tensors: dict[str, CheckpointTensors] = {}

    # lifecycle -----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Publish the base as round 0 if the registry is empty; make sure a round is open."""
        self._ensure_base()
        self._ensure_open_round()

    def start(self) -> None:
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

    def current_base(self) -> CheckpointInfo:
        return self.registry.get("main")

    def _ensure_base(self) -> None:
        if self.registry.list():
            return
        source = self.config.base_checkpoint
        if source is None:
            from node.model import create_base_checkpoint

            source = self.config.work_dir / "embedded-base"
            if not (source / "config.json").exists():
                log.info("building the embedded base model in %s", source)
                create_base_checkpoint(source)
        info = self.registry.publish(Path(source), round=0, parent=None, method=None)
        with self.store.session() as s:
            s.merge(CheckpointRecord(id=info.id, revision=info.revision, round=0, parent=None))
        log.info("published base checkpoint %s as round 0", info.id[:12])

    def _ensure_open_round(self) -> None:
        base = self.current_base()
        with self.store.session() as s:
            last = s.scalars(select(RoundRecord).order_by(RoundRecord.number.desc())).first()
            if last is None or last.status == "published":
                number = 1 if last is None else last.number + 1
                s.add(RoundRecord(number=number, base_id=base.id, status="open"))
            elif last.status == "merging":
                # A merge was cut by a crash: nothing was published (publish is atomic), so the
                # round reopens with the same accepted deltas and merges again.
                last.status = "open"

    # intake --------------------------------------------------------------------------------

    def _intake_loop(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.host.messages.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                body = decode_message(msg.data)
            except UnknownMessage as exc:
                log.info("ignored gossip from %s: %s", msg.from_peer, exc)
                continue
            except MessageError as exc:
                log.warning("refused gossip from %s: %s", msg.from_peer, exc)
                continue
            if isinstance(body, DeltaAnnounced):
                try:
                    self.handle_announcement(msg.from_peer, body)
                except Exception:  # one bad delta must not stop intake
                    log.exception("error handling a delta from %s", msg.from_peer)

    def handle_announcement(self, from_peer: str, body: DeltaAnnounced) -> DeltaRecord:
        """Verify, fetch, validate and record one announced delta; maybe close the round."""
        signed = body.signed
        delta_id = record_id(signed, from_peer)
        with self._lock:
            with self.store.session() as s:
                existing = s.get(DeltaRecord, delta_id)
                if existing is not None:
                    log.info(
                        "ignored repeated announcement of delta %s (%s in round %s)",
                        delta_id[:12],
                        existing.status,
                        existing.round,
                    )
                    return existing
            try:
                manifest = signed.verify(announcing_peer=from_peer)
                self._check_admission(manifest)
                self._fetch_and_validate(from_peer, manifest)
            except (ManifestError, DeltaRejected, DeltaError, BlobFetchError) as exc:
                return self._record_rejection(delta_id, from_peer, signed.manifest_bytes, exc)
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
                manifest=signed.manifest_bytes,
            )
            with self.store.session() as s:
                s.add(record)
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
        self, delta_id: str, from_peer: str, raw: bytes, exc: Exception
    ) -> DeltaRecord:
        reason = str(exc)
        claimed: DeltaManifest | None = None
        try:
            claimed = DeltaManifest.decode(raw)
        except ManifestError:
            pass
        record = DeltaRecord(
            id=delta_id,
            peer_id=claimed.peer_id if claimed else from_peer,
            announced_by=from_peer,
            domain=claimed.domain if claimed else None,
            base_id=claimed.base_id if claimed else None,
            round=claimed.round if claimed else None,
            steps=claimed.steps if claimed else None,
            status="rejected",
            reason=reason,
            metrics={},
            manifest=None,
        )
        with self.store.session() as s:
            s.add(record)
        log.warning("rejected delta %s from %s: %s", delta_id[:12], from_peer, reason)
        return record

    def _check_admission(self, manifest: DeltaManifest) -> None:
        allowed = self.config.allowed_peers
        if allowed and manifest.peer_id not in allowed:
            raise DeltaRejected(f"peer {manifest.peer_id} is not on the allow-list")
        current = self.current_round()
        if manifest.base_id != current.base_id:
            raise DeltaRejected(
                f"base {manifest.base_id[:12]} is not the current base {current.base_id[:12]}"
            )
        if manifest.round != current.number:
            raise DeltaRejected(f"delta is for round {manifest.round}, current is {current.number}")
        if current.status != "open":
            raise DeltaRejected(f"round {current.number} is {current.status}, not open")
        total = sum(manifest.blobs.values())
        if total > self.config.max_blob_bytes:
            raise DeltaRejected(f"delta of {total} bytes exceeds {self.config.max_blob_bytes}")

    def _fetch_and_validate(self, from_peer: str, manifest: DeltaManifest) -> None:
        if manifest.lossy and not self.config.accept_lossy:
            raise DeltaRejected("lossy (int8) deltas are not accepted by this coordinator")
        base = self._tensors_of(manifest.base_id)
        for name, entry in manifest.tensors.items():  # everything checkable before fetching
            if name not in base.meta:
                raise DeltaRejected(f"tensor {name} is not in the base")
            dtype, shape = base.meta[name]
            if entry.shape != shape:
                raise DeltaRejected(f"{name}: shape {entry.shape} != base {shape}")
            if DTYPE_NAMES.get(dtype) != entry.dtype:
                raise DeltaRejected(f"{name}: dtype {entry.dtype} != base {dtype}")
        for sha, size in manifest.blobs.items():
            self.host.fetch_blob(from_peer, sha, size)
        reader = DeltaReader(manifest, self.blobs)
        for name in reader.names():
            tuned = reader.expert(name, base.get(name))
            assert tuned is not None
            if not bool(tuned.isfinite().all()):
                raise DeltaRejected(f"{name}: delta holds NaN or Inf")

    def _tensors_of(self, checkpoint_id: str) -> CheckpointTensors:
        if checkpoint_id not in self._base_tensors:
            folder = self._folder(self.registry.get(checkpoint_id))
            self._base_tensors[checkpoint_id] = CheckpointTensors(folder)
        return self._base_tensors[checkpoint_id]

    def _folder(self, info: CheckpointInfo) -> Path:
        return self.registry.checkpoint_dir(info)

    # rounds --------------------------------------------------------------------------------

    def _round_ready(self, accepted: list[DeltaRecord]) -> bool:
        policy = self.config.round
        if len(accepted) < policy.min_deltas:
            return False
        domains = {d.domain for d in accepted}
        return all(d in domains for d in policy.required_domains)

    def maybe_merge(self, force: bool = False) -> CheckpointInfo | None:
        """Merge the current round if its policy is met (or `force`); returns what was published."""
        with self._lock:
            current = self.current_round()
            with self.store.session() as s:
                accepted = list(
                    s.scalars(
                        select(DeltaRecord)
                        .where(DeltaRecord.round == current.number)
                        .where(DeltaRecord.status == "accepted")
                        .order_by(DeltaRecord.received_at)
                    )
                )
            if current.status != "open" or not accepted:
                return None
            if not force and not self._round_ready(accepted):
                return None
            return self._run_round(current, accepted)

    def _run_round(self, current: RoundRecord, accepted: list[DeltaRecord]) -> CheckpointInfo:
        spec = self.config.merge
        with self.store.session() as s:
            row = s.get(RoundRecord, current.number)
            assert row is not None
            row.status = "merging"
            row.inputs = [d.id for d in accepted]
            row.method = spec.model_dump()
        base = self.registry.get(current.base_id)
        base_dir = self._folder(base)
        experts = []
        for record in accepted:
            assert record.manifest is not None
            reader = DeltaReader(DeltaManifest.decode(record.manifest), self.blobs)
            experts.append(TaskVector(name=record.id[:16], expert=reader.expert))
        log.info("round %d: merging %d deltas by %s", current.number, len(experts), spec.method)
        tmp = Path(tempfile.mkdtemp(prefix="merge-", dir=self.config.work_dir))
        try:
            merge_checkpoint(base_dir, experts, tmp / "candidate", spec)
            evaluation = self.evaluate({"base": base_dir, "merged": tmp / "candidate"})
            info = self.registry.publish(
                tmp / "candidate",
                round=current.number,
                parent=base.id,
                method=spec.method,
                extra={"inputs": [d.id for d in accepted], "evaluation": evaluation},
            )
        except Exception as exc:  # any failure ends the round on record, never half-published
            with self.store.session() as s:
                row = s.get(RoundRecord, current.number)
                assert row is not None
                row.status = "failed"
                row.error = str(exc)
                row.finished_at = utcnow()
                s.add(RoundRecord(number=current.number + 1, base_id=base.id, status="open"))
            log.exception("round %d failed: %s", current.number, exc)
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        with self.store.session() as s:
            row = s.get(RoundRecord, current.number)
            assert row is not None
            row.status = "published"
            row.evaluation = evaluation
            row.checkpoint_id = info.id
            row.finished_at = utcnow()
            for record in accepted:
                delta = s.get(DeltaRecord, record.id)
                assert delta is not None
                delta.status = "merged"
            s.merge(
                CheckpointRecord(
                    id=info.id,
                    revision=info.revision,
                    round=current.number,
                    parent=base.id,
                    method=spec.method,
                )
            )
            s.add(RoundRecord(number=current.number + 1, base_id=info.id, status="open"))
        log.info("round %d published checkpoint %s", current.number, info.id[:12])
        self._announce_checkpoint(info, current.number, base.id)
        self.collect_garbage()
        return info

    def collect_garbage(self) -> int:
        """Delete delta blobs of rounds older than `keep_rounds`; returns blobs removed."""
        oldest_kept = self.current_round().number - self.config.keep_rounds
        keep: set[str] = set()
        with self.store.session() as s:
            rows = s.scalars(
                select(DeltaRecord)
                .where(DeltaRecord.manifest.is_not(None))
                .where(DeltaRecord.round >= oldest_kept)
            )
            for row in rows:
                assert row.manifest is not None
                keep.update(DeltaManifest.decode(row.manifest).blobs)
        removed = self.blobs.gc(keep)
        if removed:
            log.info("removed %d delta blobs of rounds before %d", removed, oldest_kept)
        return removed

    def evaluate(self, checkpoints: dict[str, Path]) -> dict[str, Any]:
        """Held-out scores of each named checkpoint on every configured domain."""
        from node.evaluate import evaluate_checkpoint

        table: dict[str, Any] = {}
        for label, folder in checkpoints.items():
            row = {}
            for domain in self.config.eval.domains:
                result = evaluate_checkpoint(
                    folder, domain, n_tasks=self.config.eval.n_tasks, seed=self.config.eval.seed
                )
                row[domain] = {
                    "mean_reward": _finite(result.mean_reward),
                    "success_rate": _finite(result.success_rate),
                    "n": result.n,
                }
            table[label] = row
        return table

    def _announce_checkpoint(self, info: CheckpointInfo, number: int, parent: str) -> None:
        try:
            self.host.publish(
                encode_message(
                    CheckpointPublished(checkpoint_id=info.id, round=number, parent=parent)
                )
            )
        except Exception as exc:  # nodes also poll the registry; gossip is a shortcut
            log.warning("could not announce checkpoint %s on gossip: %s", info.id[:12], exc)


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


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
