"""The coordinator's records in SQL (SQLite by default): deltas and verdicts, rounds, checkpoints.

Blobs and checkpoint files live on disk; this store holds what was decided about them and why.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import JSON, DateTime, Integer, LargeBinary, String, Text, create_engine, event
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


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
    status: Mapped[str] = mapped_column(String(16), index=True)  # accepted | rejected | merged
    reason: Mapped[str | None] = mapped_column(Text)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    manifest: Mapped[bytes | None] = mapped_column(LargeBinary)  # only for verified manifests
    received_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RoundRecord(Base):
    """A round: its base, the deltas merged, the method, the evaluation table, the result."""

    __tablename__ = "rounds"

    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    base_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # open | merging | published | failed
    method: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    inputs: Mapped[list[str]] = mapped_column(JSON, default=list)
    evaluation: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    checkpoint_id: Mapped[str | None] = mapped_column(String(64))
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
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session whose changes commit together on success and roll back on error."""
        with self._sessions() as session, session.begin():
            yield session

    def close(self) -> None:
        self.engine.dispose()
