"""The coordinator's records in SQL (SQLite by default): deltas and verdicts, rounds, checkpoints,
the nodes heard from, operator settings and the operator's actions.

Blobs and checkpoint files live on disk; this store holds what was decided about them and why.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    String,
    Text,
    create_engine,
    event,
    inspect,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def as_utc(moment: dt.datetime) -> dt.datetime:
    """A stored time as an aware UTC datetime (SQLite hands back naive ones)."""
    return moment.replace(tzinfo=dt.UTC) if moment.tzinfo is None else moment.astimezone(dt.UTC)


class StoreError(RuntimeError):
    """The database cannot be used as this version of the coordinator needs it."""


class Base(DeclarativeBase):
    pass


class DeltaRecord(Base):
    """One announced delta: accepted, rejected (with the reason) or merged."""

    __tablename__ = "deltas"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 of manifest bytes
    peer_id: Mapped[str] = mapped_column(String(128), index=True)
    announced_by: Mapped[str] = mapped_column(String(128))
    domain: Mapped[str | None] = mapped_column(String(64))
    base_id: Mapped[str | None] = mapped_column(String(64))
    round: Mapped[int | None] = mapped_column(Integer, index=True)
    steps: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), index=True)  # a protocol.api.DeltaStatus
    reason: Mapped[str | None] = mapped_column(Text)
    rejection_kind: Mapped[str | None] = mapped_column(String(16))  # see gates.REJECTION_KINDS
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    checks: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # what the gates measured
    manifest: Mapped[bytes | None] = mapped_column(LargeBinary)  # only for verified manifests
    received_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RoundRecord(Base):
    """A round: its base, the deltas merged, the method, the evaluation table, the result."""

    __tablename__ = "rounds"

    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    base_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # a protocol.api.RoundStatus
    method: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    inputs: Mapped[list[str]] = mapped_column(JSON, default=list)
    # {label: {domain: score}}; labels "base", "expert:<domain>:<delta id[:12]>", "merged"
    evaluation: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # [{spec, validation: {domain: score}, score, chosen}] when merge.candidates are tried
    candidates: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    trigger: Mapped[str | None] = mapped_column(String(16))  # quorum | deadline | operator
    merge_seconds: Mapped[float | None] = mapped_column(Float)
    checkpoint_id: Mapped[str | None] = mapped_column(String(64))
    # {publish, reason, comparisons: {domain: paired difference}}: the publication rule's verdict
    decision: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class CheckpointRecord(Base):
    """A checkpoint in the registry, with the round that made it."""

    __tablename__ = "checkpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    revision: Mapped[str] = mapped_column(String(40), unique=True)
    round: Mapped[int] = mapped_column(Integer)
    parent: Mapped[str | None] = mapped_column(String(64))
    method: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class NodeRecord(Base):
    """A peer heard from: by heartbeat gossip or by announcing a delta."""

    __tablename__ = "nodes"

    peer_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    domain: Mapped[str | None] = mapped_column(String(64))
    round: Mapped[int | None] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(Integer)
    reward: Mapped[float | None] = mapped_column(Float)
    first_seen: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_heartbeat: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class GossipRefusalRecord(Base):
    """Gossip refused from one peer, by kind ("malformed", "unknown"): how often, and the last
    reason. One row per peer and kind, however many messages."""

    __tablename__ = "gossip_refusals"

    peer_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    count: Mapped[int] = mapped_column(Integer, default=0)
    last_reason: Mapped[str] = mapped_column(Text, default="")
    last_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class PeerAccessRecord(Base):
    """An operator's verdict on a peer: allowed (added to the allow-list) or denied."""

    __tablename__ = "peer_access"

    peer_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    allowed: Mapped[bool] = mapped_column(Boolean)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class SettingRecord(Base):
    """A setting changed at run time that outlives a restart (e.g. the merge spec)."""

    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[Any] = mapped_column(JSON)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class OperatorActionRecord(Base):
    """One thing the operator did (set the merge spec, allow or deny a peer, retire, merge now)."""

    __tablename__ = "operator_actions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    action: Mapped[str] = mapped_column(String(32))
    subject: Mapped[str | None] = mapped_column(String(128))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CoordinatorStore:
    """Opens the database, creates the tables, and hands out transactional sessions."""

    def __init__(self, url: str) -> None:
        self.engine = create_engine(url, future=True)
        if url.startswith("sqlite"):

            @event.listens_for(self.engine, "connect")
            def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=FULL")
                cur.close()

        Base.metadata.create_all(self.engine)
        self._add_missing_columns()
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session whose changes commit together on success and roll back on error."""
        with self._sessions() as session, session.begin():
            yield session

    def setting(self, key: str) -> Any:
        """A stored setting's value, or None."""
        with self.session() as s:
            row = s.get(SettingRecord, key)
            return None if row is None else row.value

    def set_setting(self, key: str, value: Any) -> None:
        with self.session() as s:
            s.merge(SettingRecord(key=key, value=value, updated_at=utcnow()))

    def record_action(self, action: str, subject: str, detail: dict[str, Any]) -> None:
        """Note one thing the operator did (an OperatorActionRecord)."""
        with self.session() as s:
            s.add(OperatorActionRecord(action=action, subject=subject, detail=detail))

    def close(self) -> None:
        self.engine.dispose()

    def _add_missing_columns(self) -> None:
        """Bring tables made by an older version up to date by adding the columns they lack.

        Every column added since the first version is nullable or has a JSON default, so old
        rows stay valid; anything else is refused with the column's name.
        """
        inspector = inspect(self.engine)
        with self.engine.begin() as conn:
            for table in Base.metadata.sorted_tables:
                present = {column["name"] for column in inspector.get_columns(table.name)}
                for column in table.columns:
                    if column.name in present:
                        continue
                    default = _json_default_literal(column.default)
                    if column.primary_key or (not column.nullable and default is None):
                        raise StoreError(
                            f"table {table.name} lacks column {column.name}, which cannot be "
                            "added in place; move the old database aside"
                        )
                    ddl_type = column.type.compile(dialect=self.engine.dialect)
                    clause = f" DEFAULT '{default}'" if default is not None else ""
                    conn.execute(
                        text(
                            f"ALTER TABLE {table.name} ADD COLUMN {column.name} {ddl_type}{clause}"
                        )
                    )


def _json_default_literal(default: Any) -> str | None:
    """'{}' or '[]' for a column defaulting to dict or list; None otherwise."""
    if default is None or not getattr(default, "is_callable", False):
        return None
    value = default.arg(None)
    if value == {}:
        return "{}"
    if value == []:
        return "[]"
    return None
