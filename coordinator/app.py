"""The coordinator's HTTP face: the /v1 JSON API, the Hugging Face download routes, and serving.

`create_app` builds the FastAPI app around a Coordinator; `serve` runs it under uvicorn with the
libp2p host in its own thread, and stops both cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, HTTPException, Request
from pydantic import BaseModel
from sqlalchemy import select

from coordinator.config import CoordinatorConfig
from coordinator.hub_api import hub_router
from coordinator.service import Coordinator
from coordinator.store import DeltaRecord, RoundRecord

log = logging.getLogger(__name__)


class InfoOut(BaseModel):
    peer_id: str
    multiaddrs: list[str]
    topic: str
    repo_id: str
    round: int
    base_id: str
    base_revision: str


class CheckpointOut(BaseModel):
    id: str
    revision: str
    round: int
    parent: str | None
    method: str | None
    created_at: str
    size: int
    retired: bool
    evaluation: dict[str, Any] | None = None


class DeltaOut(BaseModel):
    id: str
    peer_id: str
    announced_by: str
    domain: str | None
    base_id: str | None
    round: int | None
    steps: int | None
    status: str
    reason: str | None
    metrics: dict[str, Any]
    received_at: dt.datetime


class RoundOut(BaseModel):
    number: int
    base_id: str
    status: str
    method: dict[str, Any]
    inputs: list[str]
    evaluation: dict[str, Any]
    checkpoint_id: str | None
    error: str | None
    started_at: dt.datetime
    finished_at: dt.datetime | None


def _coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


def v1_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["swarm"])

    @router.get("/info", response_model=InfoOut)
    def info(request: Request) -> InfoOut:
        c = _coordinator(request)
        base = c.current_base()
        return InfoOut(
            peer_id=c.host.peer_id,
            multiaddrs=c.host.listen_addrs,
            topic=c.config.topic,
            repo_id=c.config.repo_id,
            round=c.current_round().number,
            base_id=base.id,
            base_revision=base.revision,
        )

    @router.get("/checkpoints", response_model=list[CheckpointOut])
    def checkpoints(request: Request) -> list[CheckpointOut]:
        c = _coordinator(request)
        with c.store.session() as s:
            evals = {
                r.checkpoint_id: r.evaluation
                for r in s.scalars(
                    select(RoundRecord).where(RoundRecord.checkpoint_id.is_not(None))
                )
            }
        return [
            CheckpointOut(
                id=i.id,
                revision=i.revision,
                round=i.round,
                parent=i.parent,
                method=i.method,
                created_at=i.created_at,
                size=i.total_size,
                retired=i.retired,
                evaluation=evals.get(i.id),
            )
            for i in c.registry.list()
        ]

    @router.get("/deltas", response_model=list[DeltaOut])
    def deltas(request: Request, round: int | None = None, status: str | None = None) -> Any:
        query = select(DeltaRecord).order_by(DeltaRecord.received_at)
        if round is not None:
            query = query.where(DeltaRecord.round == round)
        if status is not None:
            query = query.where(DeltaRecord.status == status)
        with _coordinator(request).store.session() as s:
            return [DeltaOut.model_validate(r, from_attributes=True) for r in s.scalars(query)]

    @router.get("/deltas/{delta_id}", response_model=DeltaOut)
    def delta(request: Request, delta_id: str) -> Any:
        with _coordinator(request).store.session() as s:
            record = s.get(DeltaRecord, delta_id)
            if record is None:
                raise HTTPException(404, f"no delta {delta_id}")
            return DeltaOut.model_validate(record, from_attributes=True)

    @router.get("/rounds", response_model=list[RoundOut])
    def rounds(request: Request) -> Any:
        with _coordinator(request).store.session() as s:
            rows = s.scalars(select(RoundRecord).order_by(RoundRecord.number))
            return [RoundOut.model_validate(r, from_attributes=True) for r in rows]

    return router


def create_app(coordinator: Coordinator) -> FastAPI:
    """The FastAPI app; the coordinator starts with the app and stops with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        coordinator.start()
        try:
            yield
        finally:
            coordinator.stop()

    app = FastAPI(title="skillswarm coordinator", version="1", lifespan=lifespan)
    app.state.coordinator = coordinator

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    app.include_router(v1_router())
    app.include_router(hub_router(coordinator.registry))
    return app


def serve(config: CoordinatorConfig) -> None:
    """Run the coordinator until SIGINT/SIGTERM."""
    import torch

    torch.set_num_threads(config.torch_threads)
    app = create_app(Coordinator(config))
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.http_host, port=config.http_port, log_level="info")
    )
    server.run()
