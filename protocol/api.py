"""The coordinator's HTTP contract: the models of its /v1 answers and the status values they carry,
shared by the coordinator's routes (as response models) and the node's client (to parse answers).
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "CheckpointOut",
    "DeltaOut",
    "DeltaStatus",
    "FanoutHolder",
    "FanoutOut",
    "HealthOut",
    "InfoOut",
    "MergekitYamlBody",
    "NodeOut",
    "OperatorError",
    "PeerAccessOut",
    "RoundOut",
    "RoundStatus",
    "RoundTrigger",
]


class DeltaStatus(StrEnum):
    """Where an announced delta stands; the values are the strings stored in the database."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    MERGED = "merged"


class RoundStatus(StrEnum):
    """Where a round stands; the values are the strings stored in the database."""

    OPEN = "open"
    MERGING = "merging"
    PUBLISHED = "published"
    HELD = "held"  # merged, but worse than the base on a domain: nothing published
    FAILED = "failed"
    ABANDONED = "abandoned"


RoundTrigger = Literal["quorum", "deadline", "operator"]
"""What made a round merge: its quorum, its deadline, or the operator."""


class HealthOut(BaseModel):
    """`GET /healthz`: whether every worker of the coordinator is alive (503 when not)."""

    ok: bool
    workers: dict[str, bool] = Field(
        description="each worker thread of a started coordinator and whether it is alive"
    )


class InfoOut(BaseModel):
    """What a node needs to join: the coordinator's peer, the topic, the round and its base."""

    peer_id: str
    multiaddrs: list[str]
    topic: str
    repo_id: str
    round: int
    base_id: str
    base_revision: str
    merge: dict[str, Any] = Field(
        description="the merge plan in force: a MergePlan (merge spec and candidates)"
    )


class DeltaOut(BaseModel):
    """One announced delta and the coordinator's verdict on it."""

    id: str
    peer_id: str
    announced_by: str
    domain: str | None
    base_id: str | None
    round: int | None
    steps: int | None
    status: DeltaStatus
    reason: str | None
    rejection_kind: str | None = None
    metrics: dict[str, Any]
    checks: dict[str, Any] | None = Field(default=None, description="what the gates measured")
    received_at: dt.datetime


class NodeOut(BaseModel):
    """A peer the coordinator has heard from, with its latest progress and its verdict counts."""

    peer_id: str
    domain: str | None
    first_seen: dt.datetime
    last_seen: dt.datetime
    last_heartbeat: dt.datetime | None = None
    round: int | None = None
    step: int | None = None
    reward: float | None = None
    accepted: int = Field(description="deltas accepted or merged")
    rejected: int


class RoundOut(BaseModel):
    """A round as recorded: its base, inputs, merge method, evaluation and outcome."""

    number: int
    base_id: str
    status: RoundStatus
    method: dict[str, Any]
    inputs: list[str]
    evaluation: dict[str, Any]
    candidates: list[dict[str, Any]] = Field(
        default_factory=list, description="merge candidates tried on the validation tasks"
    )
    trigger: RoundTrigger | None = Field(default=None, description="quorum, deadline or operator")
    merge_seconds: float | None = None
    checkpoint_id: str | None
    decision: dict[str, Any] | None = Field(
        default=None,
        description="the publication rule's verdict: publish, reason, and per domain the paired "
        "difference candidate - base with its interval and one-sided p-values",
    )
    error: str | None
    started_at: dt.datetime
    finished_at: dt.datetime | None

    @field_validator("candidates", mode="before")
    @classmethod
    def _none_is_no_candidates(cls, value: Any) -> Any:
        return [] if value is None else value


class FanoutHolder(BaseModel):
    """A peer that serves a checkpoint delta's blobs, and where to dial it."""

    peer_id: str = Field(max_length=128)
    multiaddrs: list[str] = Field(max_length=8)


class FanoutOut(BaseModel):
    """A merged checkpoint as a signed delta from its parent (`manifest`: the checkpoint delta's
    msgpack bytes, `signature`: the coordinator's over them), and where to fetch its blobs:
    `holders` in the order to try them (the coordinator itself only while it hands this node one
    of its seed slots). With no holder yet, ask again after `retry_after_s`. Bytes travel as
    base64 in JSON."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    checkpoint_id: str
    base_id: str
    download_size: int
    manifest: bytes
    signature: bytes
    holders: list[FanoutHolder] = Field(max_length=32)
    retry_after_s: float | None = None


class CheckpointOut(BaseModel):
    """A checkpoint in the registry, with the evaluation of the round that made it."""

    id: str
    revision: str
    round: int
    parent: str | None
    method: str | None
    created_at: str
    size: int
    retired: bool
    evaluation: dict[str, Any] | None = None


class OperatorError(BaseModel):
    """Body of every error the operator API answers itself."""

    detail: str


class PeerAccessOut(BaseModel):
    """Whether a peer's deltas are now admitted."""

    peer_id: str
    allowed: bool


class MergekitYamlBody(BaseModel):
    """A mergekit-style YAML fragment carried in a JSON body."""

    model_config = ConfigDict(extra="forbid")

    mergekit_yaml: str = Field(
        description="mergekit YAML: merge_method, top-level parameters, dtype, out_dtype"
    )
    seed: int = Field(default=0, description="RNG seed (mergekit-yaml --random-seed)")
