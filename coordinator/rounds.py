"""Rounds: the policy that fires a merge, merging the accepted deltas (one or several candidate
specs), publishing the chosen checkpoint, recovering a round a crash cut short, and retiring.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from skillswarm.coordinator.candidates import gate_by_own_domain, merge_and_decide
from skillswarm.coordinator.config import CoordinatorConfig, MergePlan
from skillswarm.coordinator.evaluation import (
    DomainScores,
    Evaluator,
    ExpertInput,
    expert_label,
)
from skillswarm.coordinator.fanout import Fanout
from skillswarm.coordinator.publication import publication_rule
from skillswarm.coordinator.registry import CheckpointInfo, Registry, RevisionNotFound
from skillswarm.coordinator.store import (
    CheckpointRecord,
    CoordinatorStore,
    DeltaRecord,
    RoundRecord,
    as_utc,
    utcnow,
)
from skillswarm.merge.outer import OuterOptimizer
from skillswarm.merge.streaming import TaskVector
from skillswarm.protocol.api import DeltaStatus, RoundStatus, RoundTrigger
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import DeltaReader
from skillswarm.protocol.manifest import DeltaManifest
from skillswarm.protocol.messages import CheckpointPublished, encode_message
from sqlalchemy import select

from skillswarm.tracking import Tracker

__all__ = [
    "MERGE_WORK_PREFIX",
    "MissingBaseCheckpoint",
    "Rounds",
    "round_dict",
    "round_scores",
]

log = logging.getLogger(__name__)

MERGE_WORK_PREFIX = "merge-"  # work folders of a merge under work_dir; removed at start
# A round in one of these states is over: the next one opens.
CLOSED_STATUSES = (
    RoundStatus.PUBLISHED,
    RoundStatus.HELD,
    RoundStatus.FAILED,
    RoundStatus.ABANDONED,
)


class MissingBaseCheckpoint(RuntimeError):
    """The registry is empty and the configuration names no usable round-0 checkpoint."""


class Rounds:
    """Round records, merges and publication; thread-safe.

    `_state_lock` guards changes of a round's status (and admitting a delta into the open round,
    see `record_if_open`); `_merge_lock` lets one merge (or retirement) run at a time and is only
    ever tried, never waited for. With a `tracker`, each decided round's scores are logged to
    it at step = the round's number (`round_scores`).
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        store: CoordinatorStore,
        registry: Registry,
        blobs: BlobStore,
        evaluator: Evaluator,
        publish_gossip: Callable[[bytes], object],
        tracker: Tracker | None = None,
        fanout: Fanout | None = None,
    ) -> None:
        self.config = config
        self.tracker = tracker
        self.store = store
        self.registry = registry
        self.blobs = blobs
        self.evaluator = evaluator
        self._publish_gossip = publish_gossip
        self.fanout = fanout
        self._state_lock = threading.RLock()
        self._merge_lock = threading.Lock()
        self.outer = OuterOptimizer(config.work_dir / "outer", config.outer)

    # state ---------------------------------------------------------------------------------

    def current_round(self) -> RoundRecord:
        with self.store.session() as s:
            row = s.scalars(select(RoundRecord).order_by(RoundRecord.number.desc())).first()
            if row is None:
                raise LookupError("no round is recorded yet; call Coordinator.prepare() first")
            return row

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
            return round_dict(row)

    def accepted(self, number: int) -> list[DeltaRecord]:
        """Round `number`'s accepted (not yet merged) deltas, oldest first."""
        with self.store.session() as s:
            return list(
                s.scalars(
                    select(DeltaRecord)
                    .where(DeltaRecord.round == number)
                    .where(DeltaRecord.status == DeltaStatus.ACCEPTED)
                    .order_by(DeltaRecord.received_at)
                )
            )

    def record_if_open(self, record: DeltaRecord) -> bool:
        """Add `record` (an accepted delta) if its round is still the open one; False when that
        round closed meanwhile (then nothing is recorded)."""
        with self._state_lock:
            current = self.current_round()
            if current.number != record.round or current.status != RoundStatus.OPEN:
                return False
            with self.store.session() as s:
                s.add(record)
            return True

    def set_merge_plan(self, plan: MergePlan) -> None:
        """Merge by `plan` from the next merge on."""
        self.config = self.config.model_copy(update={"merge": plan})

    # start ---------------------------------------------------------------------------------

    def ensure_base(self) -> None:
        """Publish the configured base as round 0 when the registry is empty."""
        if self.registry.list():
            return
        source = self.config.base_checkpoint
        if source is None or not (Path(source) / "config.json").is_file():
            where = "is not set" if source is None else f"({source}) has no config.json"
            raise MissingBaseCheckpoint(
                f"the coordinator has no round-0 checkpoint: base_checkpoint {where}. Point it at "
                "a Hugging Face model folder, or build the embedded one with "
                "`skillswarm bootstrap DIR` and set base_checkpoint = DIR"
            )
        info = self.registry.publish(Path(source), round=0, parent=None, method=None)
        with self.store.session() as s:
            s.merge(CheckpointRecord(id=info.id, revision=info.revision, round=0, parent=None))
        log.info("published base checkpoint %s as round 0", info.id[:12])

    def recover_interrupted_round(self) -> None:
        """A round left "merging" by a crash: record it if its checkpoint reached the registry
        (publication is atomic), else reopen it so that it merges again. The outer optimizer's
        pending state is kept if its checkpoint was published, else dropped."""
        self.outer.recover(
            lambda number, parent: getattr(self._published_checkpoint(number, parent), "id", None)
        )
        with self.store.session() as s:
            last = s.scalars(select(RoundRecord).order_by(RoundRecord.number.desc())).first()
            if last is None or last.status != RoundStatus.MERGING:
                return
            number, base_id = last.number, last.base_id
        published = self._published_checkpoint(number, base_id)
        if published is not None:
            log.info("round %d was published before the coordinator stopped; recording it", number)
            self.record_published(number, published)
            return
        with self._state_lock, self.store.session() as s:
            row = s.get(RoundRecord, number)
            if row is None:
                raise LookupError(f"round {number} vanished from the store during recovery")
            row.status = RoundStatus.OPEN
        log.info("round %d's merge was cut short; it merges again once its policy is met", number)

    def origin_validation(self, base_id: str) -> DomainScores | None:
        """The round-0 checkpoint's validation scores, which the publication rule compares a
        candidate with beside the current base; None when the rule does not ask for them, when
        round 0 is the current base, or when it has been retired."""
        if not (self.config.publish.no_regression and self.config.publish.against_origin):
            return None
        origins = [i for i in self.registry.list() if i.round == 0 and not i.retired]
        if not origins or origins[0].id == base_id:
            return None
        origin = origins[0]
        return self.evaluator.validation_scores(
            self.registry.checkpoint_dir(origin), cache_as=origin.id
        )

    def _published_checkpoint(self, number: int, parent: str) -> CheckpointInfo | None:
        """The checkpoint round `number` published on `parent` (the latest, if several), if any."""
        published = [
            info
            for info in self.registry.list()
            if info.round == number and info.parent == parent and not info.retired
        ]
        return published[-1] if published else None

    def ensure_open_round(self) -> None:
        """Open the next round on `main` unless the last one is still open or merging."""
        base = self.current_base()
        with self._state_lock, self.store.session() as s:
            last = s.scalars(select(RoundRecord).order_by(RoundRecord.number.desc())).first()
            if last is None or last.status in CLOSED_STATUSES:
                number = 1 if last is None else last.number + 1
                s.add(RoundRecord(number=number, base_id=base.id, status=RoundStatus.OPEN))

    # merging -------------------------------------------------------------------------------

    def policy_trigger(
        self, current: RoundRecord, accepted: Sequence[DeltaRecord]
    ) -> RoundTrigger | None:
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
            if current.status != RoundStatus.OPEN:
                return None
            accepted = self.accepted(current.number)
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
            if current.status != RoundStatus.OPEN:
                raise ValueError(f"round {current.number} is {current.status}, not open")
            if not self.accepted(current.number):
                raise ValueError(f"no accepted deltas in round {current.number}")
            self.store.record_action("request_round", str(current.number), {})
            try:
                self._run_round(current.number, "operator")
            except Exception:  # the failure is on the round's record, which is returned
                log.exception("operator-requested merge of round %d failed", current.number)
            return self.round_record(current.number)
        finally:
            self._merge_lock.release()

    def _run_round(self, number: int, trigger: RoundTrigger) -> CheckpointInfo | None:
        """Merge round `number` (open, with accepted deltas) and publish the merge, or hold the
        round (None) when the publication rule refuses it; the caller holds the merge lock."""
        plan = self.config.merge
        with self._state_lock, self.store.session() as s:
            row = s.get(RoundRecord, number)
            if row is None or row.status != RoundStatus.OPEN:
                raise LookupError(f"round {number} is not open; it cannot merge")
            accepted = list(
                s.scalars(
                    select(DeltaRecord)
                    .where(DeltaRecord.round == number)
                    .where(DeltaRecord.status == DeltaStatus.ACCEPTED)
                    .order_by(DeltaRecord.received_at)
                )
            )
            row.status = RoundStatus.MERGING
            row.inputs = [d.id for d in accepted]
            row.method = plan.recorded(plan.specs()[0])
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
        work = Path(
            tempfile.mkdtemp(prefix=f"{MERGE_WORK_PREFIX}round{number}-", dir=self.config.work_dir)
        )
        try:
            base = self.registry.get(base_id)
            base_dir = self.registry.checkpoint_dir(base)
            expert_inputs = [
                ExpertInput(expert_label(record), record.domain, _reader_of(record, self.blobs))
                for record in accepted
            ]
            merging, gate = gate_by_own_domain(
                plan, self.evaluator, base.id, base_dir, expert_inputs, work
            )
            if not merging:
                extra = {
                    "inputs": [d.id for d in accepted],
                    "evaluation": {},
                    "merge_spec": plan.recorded(plan.specs()[0]),
                    "candidates": [],
                    "trigger": trigger,
                    "merge_seconds": round(time.monotonic() - started, 3),
                    "decision": {
                        "publish": False,
                        "reason": "every delta scored below the base on its own domain"
                        + (
                            f" or gained less than {plan.own_domain_min_gain:g} there"
                            if any(entry.get("short_of_min_gain") for entry in gate)
                            else ""
                        ),
                        "comparisons": {},
                        "gate": gate,
                    },
                }
                self.record_held(number, base_id, extra)
                log.warning("round %d held: %s", number, extra["decision"]["reason"])
                return None
            ids = {e.label: r.id for e, r in zip(expert_inputs, accepted, strict=True)}
            decide = publication_rule(
                self.evaluator.validation_scores(base_dir, cache_as=base.id),
                self.config.publish,
                self.config.eval.level,
                origin_scores=self.origin_validation(base.id),
            )
            verdict = merge_and_decide(
                plan,
                self.evaluator,
                self.outer,
                base.id,
                base_dir,
                merging,
                work,
                number,
                decide,
                lambda e: TaskVector(name=ids[e.label][:16], expert=e.reader.expert),
                gate,
            )
            chosen, decision = verdict.merged.spec, verdict.decision
            evaluation = self.evaluator.evaluation_table(
                base.id,
                base_dir,
                expert_inputs,
                verdict.candidate_dir,
                work,
                keep_base=plan.kept_for,
            )
            extra = {
                "inputs": [d.id for d in accepted],
                "merged_inputs": [ids[e.label] for e in verdict.merging],
                "evaluation": evaluation,
                "merge_spec": plan.recorded(chosen),
                "candidates": verdict.merged.records,
                "trigger": trigger,
                "merge_seconds": round(time.monotonic() - started, 3),
                "decision": decision.to_dict() | {"gate": gate, "subsets": verdict.subsets},
                "outer": self.config.outer.model_dump(),
            }
            if not decision.publish:
                self.outer.discard()
                self.record_held(number, base_id, extra)
                log.warning("round %d held: %s", number, decision.reason)
                return None
            info = self.registry.publish(
                verdict.candidate_dir,
                round=number,
                parent=base.id,
                method=chosen.method,
                extra=extra,
            )
        except Exception as exc:  # any failure ends the round on record, never half-published
            self.outer.discard()
            with self._state_lock, self.store.session() as s:
                row = s.get(RoundRecord, number)
                if row is not None:
                    row.status = RoundStatus.FAILED
                    row.error = f"{type(exc).__name__}: {exc}"
                    row.finished_at = utcnow()
                s.add(RoundRecord(number=number + 1, base_id=base_id, status=RoundStatus.OPEN))
            log.exception("round %d failed: %s", number, exc)
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self.outer.commit(info.id)
        self.fan_out(info)  # before the round opens on it: nodes find its delta at once
        self.record_published(number, info)
        log.info("round %d published checkpoint %s (%s)", number, info.id[:12], decision.reason)
        self._announce_checkpoint(info, number, base_id)
        return info

    def record_held(self, number: int, base_id: str, extra: dict[str, Any]) -> None:
        """Record round `number` as held (its candidate failed the publication rule): its deltas
        are set aside with the reason, and the next round opens on the same base."""
        reason = f"round {number} held: {extra['decision']['reason']}"
        with self._state_lock, self.store.session() as s:
            row = s.get(RoundRecord, number)
            if row is None:
                raise LookupError(f"no round {number} to hold")
            row.status = RoundStatus.HELD
            row.evaluation = dict(extra["evaluation"])
            row.candidates = list(extra["candidates"])
            row.method = dict(extra["merge_spec"])
            row.merge_seconds = extra["merge_seconds"]
            row.decision = dict(extra["decision"])
            row.error = reason
            row.finished_at = utcnow()
            for delta_id in extra["inputs"]:
                delta = s.get(DeltaRecord, delta_id)
                if delta is not None:
                    delta.status, delta.reason, delta.rejection_kind = (
                        DeltaStatus.REJECTED,
                        reason,
                        "held",
                    )
            s.add(RoundRecord(number=number + 1, base_id=base_id, status=RoundStatus.OPEN))
        if self.tracker is not None:
            self.tracker.log(round_scores(RoundStatus.HELD, extra), step=number)

    def record_published(self, number: int, info: CheckpointInfo) -> None:
        """Record round `number` as published by `info` (whose extra holds the round's results)
        and open the next round on it."""
        extra = info.extra
        with self._state_lock, self.store.session() as s:
            row = s.get(RoundRecord, number)
            if row is None:
                raise LookupError(f"no round {number} to record checkpoint {info.id[:12]} on")
            row.status = RoundStatus.PUBLISHED
            row.inputs = list(extra.get("inputs", row.inputs))
            row.evaluation = dict(extra.get("evaluation", {}))
            row.candidates = list(extra.get("candidates", []))
            row.method = dict(extra.get("merge_spec", row.method))
            row.trigger = extra.get("trigger", row.trigger)
            row.merge_seconds = extra.get("merge_seconds")
            row.decision = dict(extra.get("decision") or {})
            row.checkpoint_id = info.id
            row.error = None
            row.finished_at = utcnow()
            for delta_id in row.inputs:
                delta = s.get(DeltaRecord, delta_id)
                if delta is not None:
                    delta.status = DeltaStatus.MERGED
            s.merge(
                CheckpointRecord(
                    id=info.id,
                    revision=info.revision,
                    round=number,
                    parent=info.parent,
                    method=info.method,
                )
            )
            s.add(RoundRecord(number=number + 1, base_id=info.id, status=RoundStatus.OPEN))
        if self.tracker is not None:
            self.tracker.log(round_scores(RoundStatus.PUBLISHED, extra), step=number)

    def fan_out(self, info: CheckpointInfo) -> None:
        """Pack and serve `info` as a delta from its parent; a failure is logged, and nodes
        then pull the checkpoint whole from the registry."""
        if self.fanout is None:
            return
        try:
            self.fanout.publish(info)
        except Exception:
            log.exception("checkpoint %s will not be fanned out as a delta", info.id[:12])

    def _announce_checkpoint(self, info: CheckpointInfo, number: int, parent: str) -> None:
        try:
            self._publish_gossip(
                encode_message(
                    CheckpointPublished(checkpoint_id=info.id, round=number, parent=parent)
                )
            )
        except Exception as exc:  # nodes also poll the registry; gossip is a shortcut
            log.warning("could not announce checkpoint %s on gossip: %s", info.id[:12], exc)

    # retirement ----------------------------------------------------------------------------

    def retire_checkpoint(self, revision: str) -> CheckpointInfo:
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
            self.store.record_action("retire_checkpoint", info.id, {"revision": info.revision})
            self._abandon_round_on(info.id)
            log.info("retired checkpoint %s", info.id[:12])
            return retired
        finally:
            self._merge_lock.release()

    def _abandon_round_on(self, retired_id: str) -> None:
        new_base = self.current_base()
        with self._state_lock, self.store.session() as s:
            row = s.scalars(select(RoundRecord).order_by(RoundRecord.number.desc())).first()
            if row is None or row.status != RoundStatus.OPEN or row.base_id != retired_id:
                return
            reason = f"base {retired_id[:12]} was retired before round {row.number} merged"
            row.status = RoundStatus.ABANDONED
            row.error = reason
            row.finished_at = utcnow()
            for delta in s.scalars(
                select(DeltaRecord)
                .where(DeltaRecord.round == row.number)
                .where(DeltaRecord.status == DeltaStatus.ACCEPTED)
            ):
                delta.status, delta.reason, delta.rejection_kind = (
                    DeltaStatus.REJECTED,
                    reason,
                    "retired",
                )
            s.add(RoundRecord(number=row.number + 1, base_id=new_base.id, status=RoundStatus.OPEN))
        log.info("round abandoned: %s; the next round builds on %s", reason, new_base.id[:12])


def round_dict(row: RoundRecord) -> dict[str, Any]:
    """A round row as the API lists it (see skillswarm.protocol.api.RoundOut)."""
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
        "decision": row.decision or None,
        "error": row.error,
        "started_at": row.started_at,
        "finished_at": row.finished_at,
    }


def round_scores(status: str, extra: Mapping[str, Any]) -> dict[str, float]:
    """A decided round's numbers for a tracker, from its record's `extra`: published (1) or
    held (0), deltas merged and merge time; `{model}/{domain}/{score}` of the base, each
    expert (`expert-{domain}-{delta id}`) and the merge: mean reward, success rate and its
    interval; each candidate's validation score; `decision/{domain}/…`, the paired difference
    merge − base, and `decision_origin/{domain}/…`, merge − round 0."""
    scores: dict[str, float] = {
        "round/published": float(status == RoundStatus.PUBLISHED),
        "round/deltas": float(len(extra.get("inputs") or [])),
    }
    if isinstance(extra.get("merge_seconds"), int | float):
        scores["round/merge_seconds"] = float(extra["merge_seconds"])
    for label, by_domain in (extra.get("evaluation") or {}).items():
        model = label.replace(":", "-")  # TensorBoard's tags keep no colons
        for domain, row in by_domain.items():
            for key in ("mean_reward", "success_rate", "success_low", "success_high"):
                if isinstance(row.get(key), int | float):
                    scores[f"{model}/{domain}/{key}"] = float(row[key])
    for index, candidate in enumerate(extra.get("candidates") or []):
        name = f"candidate/{index}-{candidate.get('spec', {}).get('method', '?')}"
        if isinstance(candidate.get("score"), int | float):
            scores[f"{name}/validation_score"] = float(candidate["score"])
        scores[f"{name}/chosen"] = float(bool(candidate.get("chosen")))
    decision = extra.get("decision") or {}
    for against, prefix in (("comparisons", "decision"), ("origin_comparisons", "decision_origin")):
        for domain, comparison in (decision.get(against) or {}).items():
            for key in ("mean", "low", "high", "p_worse"):
                if isinstance(comparison.get(key), int | float):
                    scores[f"{prefix}/{domain}/{key}"] = float(comparison[key])
    return scores


def _reader_of(record: DeltaRecord, blobs: BlobStore) -> DeltaReader:
    if record.manifest is None:
        raise LookupError(f"accepted delta {record.id[:12]} has no stored manifest")
    return DeltaReader(DeltaManifest.decode(record.manifest), blobs)
