"""The coordinator: builds and wires intake, rounds and evaluation around one store, registry,
blob store and libp2p host; runs the intake thread; carries the operator's actions and the views.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from skillswarm.coordinator.config import CoordinatorConfig, MergePlan
from skillswarm.coordinator.evaluation import DomainScores, Evaluator
from skillswarm.coordinator.fanout import Fanout
from skillswarm.coordinator.gates import REJECTION_KINDS
from skillswarm.coordinator.intake import GATE_WORK_PREFIX, GOSSIP_REFUSAL_KINDS, Intake
from skillswarm.coordinator.registry import CheckpointInfo, Registry
from skillswarm.coordinator.rounds import MERGE_WORK_PREFIX, MissingBaseCheckpoint, Rounds
from skillswarm.coordinator.store import (
    CoordinatorStore,
    DeltaRecord,
    GossipRefusalRecord,
    NodeRecord,
    PeerAccessRecord,
    RoundRecord,
    as_utc,
    utcnow,
)
from skillswarm.merge.methods import MergeSpec
from skillswarm.protocol.api import DeltaStatus, RoundStatus
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.host import SwarmHost
from skillswarm.protocol.identity import (
    IdentityError,
    load_or_create_identity,
    public_key_bytes_from_peer_id,
)
from skillswarm.protocol.messages import DeltaAnnounced, NodeHeartbeat
from sqlalchemy import func, select

from skillswarm.tracking import Tracker, open_tracker

__all__ = ["Coordinator", "MissingBaseCheckpoint", "probe_merge_spec"]

log = logging.getLogger(__name__)

MERGE_PLAN_SETTING = "merge_plan"
POLICY_CHECK_INTERVAL_S = 0.5
INTAKE_JOIN_TIMEOUT_S = 60.0
# Work folders made under work_dir while merging or gating; what a crash leaves is removed at start.
WORK_FOLDER_PREFIXES = (MERGE_WORK_PREFIX, GATE_WORK_PREFIX)
ACCEPTED_STATUSES = (DeltaStatus.ACCEPTED, DeltaStatus.MERGED)


class Coordinator:
    """Owns the store, registry, blob store and libp2p host of one coordinator process, and the
    parts that use them: `intake`, `rounds` and `evaluator`.

    The public methods are thread-safe: intake runs in its own thread, the HTTP layer calls in
    from its worker threads. The coordinator itself holds no lock; each part guards its own state.
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
        self.evaluator = Evaluator(self.config.eval)
        self.tracker: Tracker | None = None
        if config.tracking is not None:  # the database URL may hold a password: not sent
            self.tracker = open_tracker(
                config.tracking,
                run_name="coordinator",
                default_dir=config.work_dir / "tracking",
                run_config=self.config.model_dump(mode="json", exclude={"database_url"}),
            )
        self.fanout = Fanout(
            self.config.fanout,
            config.work_dir / "fanout",
            self.registry,
            self.blobs,
            self.key_pair,
            self.host,
            self.advertised_addrs,
        )
        self.rounds = Rounds(
            self.config,
            self.store,
            self.registry,
            self.blobs,
            self.evaluator,
            self.host.publish,
            tracker=self.tracker,
            fanout=self.fanout,
        )
        self.intake = Intake(
            self.config,
            self.store,
            self.registry,
            self.blobs,
            self.host,
            self.rounds,
            self.evaluator,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.intake_errors = 0  # intake passes that failed (and were gone past)

    # lifecycle -----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Publish the base as round 0 if the registry is empty; settle a merge a crash cut
        short; make sure a round is open."""
        self._remove_work_leftovers()
        self.rounds.ensure_base()
        self.rounds.recover_interrupted_round()
        self.rounds.ensure_open_round()
        self.rounds.fan_out(self.current_base())

    def start(self) -> None:
        """Prepare, start the libp2p host and the intake thread (which also merges a round whose
        policy is met, e.g. one left open by a restart, or one whose deadline passed)."""
        self.prepare()
        self.host.start()
        log.info("coordinator peer %s listening on %s", self.host.peer_id, self.host.listen_addrs)
        self._thread = threading.Thread(target=self._intake_loop, name="delta-intake", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the intake thread (waiting for the delta or merge in hand), the host and the
        store."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=INTAKE_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning(
                    "the intake thread did not stop within %.0f s; closing anyway",
                    INTAKE_JOIN_TIMEOUT_S,
                )
            self._thread = None
        self.host.stop()
        self.store.close()
        if self.tracker is not None:
            self.tracker.close()

    def _intake_loop(self) -> None:
        """Gossip, merges due by the round policy and garbage collection, until stopped. An
        error in one pass is logged and counted and the loop goes on; only an exception that is
        not an Exception (SystemExit, say) ends it, and then /healthz says so."""
        next_policy_check = 0.0
        while not self._stop.is_set():
            try:
                next_policy_check = self._intake_pass(next_policy_check)
            except Exception:
                self.intake_errors += 1
                log.exception("intake pass failed; going on")
                self._stop.wait(POLICY_CHECK_INTERVAL_S)

    def _intake_pass(self, next_policy_check: float) -> float:
        try:
            msg = self.host.messages.get(timeout=POLICY_CHECK_INTERVAL_S)
        except queue.Empty:
            msg = None
        if msg is not None:
            record = self.intake.handle_gossip(msg.from_peer, msg.data)
            if record is not None and record.status == DeltaStatus.ACCEPTED:
                self._merge_if_due()
        if self.intake.garbage_due:
            self.intake.collect_garbage()
        if time.monotonic() >= next_policy_check:
            next_policy_check = time.monotonic() + POLICY_CHECK_INTERVAL_S
            self._merge_if_due()
        return next_policy_check

    def worker_liveness(self) -> dict[str, bool]:
        """Each long-lived worker of a started coordinator and whether it is alive (the intake
        thread, which also runs rounds; the libp2p host's thread, which runs gossip and the blob
        protocol); empty before `start()`."""
        if self._thread is None:
            return {}
        return {"intake": self._thread.is_alive(), "libp2p-host": self.host.running}

    def _merge_if_due(self) -> None:
        try:
            self.maybe_merge()
        except Exception:  # recorded on the round; intake goes on
            log.exception("a merge due by the round policy failed")

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

    # delegation ----------------------------------------------------------------------------

    def current_round(self) -> RoundRecord:
        return self.rounds.current_round()

    def current_base(self) -> CheckpointInfo:
        return self.rounds.current_base()

    def round_base(self, round_record: RoundRecord) -> CheckpointInfo:
        """The checkpoint a round trains on (see Rounds.round_base)."""
        return self.rounds.round_base(round_record)

    def round_record(self, number: int) -> dict[str, Any]:
        """One round as the API lists it; KeyError for an unknown round."""
        return self.rounds.round_record(number)

    def handle_announcement(self, from_peer: str, body: DeltaAnnounced) -> DeltaRecord:
        """Verify, fetch, validate and record one announced delta; maybe close the round."""
        record = self.intake.handle_announcement(from_peer, body)
        if record.status == DeltaStatus.ACCEPTED:
            self.maybe_merge()
        return record

    def record_heartbeat(self, peer_id: str, heartbeat: NodeHeartbeat) -> None:
        """Note a node's heartbeat: its domain, round, step and latest reward."""
        self.intake.record_heartbeat(peer_id, heartbeat)

    def maybe_merge(self, force: bool = False) -> CheckpointInfo | None:
        """Merge the current round if its policy is met (or `force`); returns what was published
        (then old rounds' blobs are collected). None when nothing is due or a merge runs."""
        info = self.rounds.maybe_merge(force)
        if info is not None:
            self.intake.collect_garbage()
        return info

    def collect_garbage(self) -> int:
        """Delete delta blobs of rounds older than `keep_rounds`; returns blobs removed."""
        return self.intake.collect_garbage()

    def evaluate(self, checkpoints: Mapping[str, Path]) -> dict[str, DomainScores]:
        """Held-out scores of each named checkpoint on every configured domain."""
        return self.evaluator.evaluate(checkpoints)

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

    # operator ------------------------------------------------------------------------------

    def request_round(self) -> dict[str, Any]:
        """Merge the current round now, whatever its policy says; returns the round's record
        (status "published", or "failed" with the error). ValueError when there is nothing to
        merge or a merge is already running."""
        record = self.rounds.request_round()
        if record["status"] == RoundStatus.PUBLISHED:
            self.intake.collect_garbage()
        return record

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
        self.rounds.set_merge_plan(plan)
        self.store.record_action("set_merge_spec", plan.method, plan.model_dump(mode="json"))
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
        self.store.record_action("allow_peer" if allowed else "deny_peer", peer_id, {})
        log.info("peer %s is now %s", peer_id, "allowed" if allowed else "denied")

    def retire_checkpoint(self, revision: str) -> dict[str, Any]:
        """Retire a checkpoint (never `main` again, no longer served); if it is the open round's
        base, that round is abandoned and a new one opens on the new `main`. KeyError for an
        unknown revision; ValueError while a merge runs or for the last checkpoint in service."""
        return self.checkpoint_dict(self.rounds.retire_checkpoint(revision))

    # views ---------------------------------------------------------------------------------

    def checkpoint_dict(self, info: CheckpointInfo) -> dict[str, Any]:
        """A checkpoint as the API lists it, with its round's evaluation."""
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
                "rejected": counts.get((node.peer_id, DeltaStatus.REJECTED), 0),
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
                    .where(DeltaRecord.status == DeltaStatus.REJECTED)
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
                .where(RoundRecord.status == RoundStatus.PUBLISHED)
                .order_by(RoundRecord.number.desc())
            ).first()
            current = s.scalars(select(func.max(RoundRecord.number))).one()
            nodes_seen = s.scalars(select(func.count()).select_from(NodeRecord)).one()
            refused = dict(
                s.execute(
                    select(GossipRefusalRecord.kind, func.sum(GossipRefusalRecord.count)).group_by(
                        GossipRefusalRecord.kind
                    )
                ).all()
            )
        checkpoints = self.registry.list()
        values: dict[str, float] = {
            "deltas_received_total": float(sum(by_status.values())),
            "deltas_accepted_total": float(sum(by_status.get(s, 0) for s in ACCEPTED_STATUSES)),
            "deltas_rejected_total": float(by_status.get(DeltaStatus.REJECTED, 0)),
            "rounds_completed_total": float(rounds.get(RoundStatus.PUBLISHED, 0)),
            "rounds_failed_total": float(rounds.get(RoundStatus.FAILED, 0)),
            "rounds_held_total": float(rounds.get(RoundStatus.HELD, 0)),
            "current_round": float(current or 0),
            "merge_seconds_last": float(last_merge or 0.0),
            "checkpoints_published_total": float(len(checkpoints)),
            "checkpoints_retired_total": float(sum(i.retired for i in checkpoints)),
            "nodes_seen": float(nodes_seen),
            "gossip_refused_access_total": float(self.intake.refused_by_access),
            "intake_errors_total": float(self.intake_errors),
            "fanout_holders": float(self.fanout.holder_count()),
            "fanout_seed_grants_total": float(self.fanout.seed_grants),
            "blob_bytes_served_total": float(self.host.bytes_served),
        }
        for kind in GOSSIP_REFUSAL_KINDS:
            values[f"gossip_refused_{kind}_total"] = float(refused.get(kind, 0))
        for kind in REJECTION_KINDS:
            values[f"deltas_rejected_{kind}_total"] = float(by_kind.get(kind, 0))
        return values


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
