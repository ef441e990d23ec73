"""The coordinator's HTTP face: the /v1 JSON API, the operator API, the Hugging Face download
routes, /metrics, the dashboard page, and serving.

The answers' models are skillswarm.protocol.api's, which the node's client parses them with.
`create_app` builds the FastAPI app around a Coordinator; `serve` runs it under uvicorn with the
libp2p host in its own thread, and stops both cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import uvicorn
from fastapi import APIRouter, FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse
from skillswarm.coordinator.config import CoordinatorConfig
from skillswarm.coordinator.dashboard import dashboard_router
from skillswarm.coordinator.http_server import server_config
from skillswarm.coordinator.hub_api import hub_router
from skillswarm.coordinator.operator_api import operator_router
from skillswarm.coordinator.prometheus import instrument_app
from skillswarm.coordinator.service import Coordinator
from skillswarm.coordinator.store import DeltaRecord, RoundRecord
from skillswarm.protocol.api import (
    CheckpointOut,
    DeltaOut,
    DeltaStatus,
    FanoutOut,
    HealthOut,
    InfoOut,
    NodeOut,
    RoundOut,
)
from skillswarm.protocol.canonical import MAX_WIRE_INT
from skillswarm.protocol.host import freeze_startup_heap
from sqlalchemy import select

log = logging.getLogger(__name__)


def _coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


def v1_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["swarm"])

    @router.get("/info", response_model=InfoOut)
    def info(request: Request) -> InfoOut:
        c = _coordinator(request)
        current = c.current_round()
        base = c.round_base(current)
        return InfoOut(
            peer_id=c.host.peer_id,
            multiaddrs=c.advertised_addrs(),
            topic=c.config.topic,
            repo_id=c.config.repo_id,
            round=current.number,
            base_id=base.id,
            base_revision=base.revision,
            merge=c.config.merge.model_dump(mode="json"),
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
    def deltas(
        request: Request,
        round: Annotated[int | None, Query(ge=0, le=MAX_WIRE_INT)] = None,
        status: DeltaStatus | None = None,
    ) -> Any:
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

    @router.get("/checkpoints/{revision}/fanout", response_model=FanoutOut)
    def fanout(
        request: Request,
        revision: Annotated[str, Path(pattern=r"^[0-9a-f]{40}([0-9a-f]{24})?$")],
        peer: Annotated[str | None, Query(max_length=128)] = None,
    ) -> FanoutOut:
        """The checkpoint as a signed delta from its parent and the peers to fetch it from
        (`peer`: the asking node's PeerID, so it is not named to itself)."""
        offer = _coordinator(request).fanout.offer(revision, peer)
        if offer is None:
            raise HTTPException(404, f"checkpoint {revision} is not fanned out as a delta")
        return offer

    @router.get("/nodes", response_model=list[NodeOut])
    def nodes(request: Request) -> list[NodeOut]:
        return [NodeOut.model_validate(node) for node in _coordinator(request).nodes()]

    return router


def create_app(coordinator: Coordinator) -> FastAPI:
    """The FastAPI app; the coordinator starts with the app and stops with it.

    The operator token is read now from the environment variable the config names; without it
    the operator routes answer 503.
    """
    token_env = coordinator.config.operator_token_env
    operator_token = os.environ.get(token_env, "").strip() or None
    if operator_token is None:
        log.warning("operator API disabled: set $%s to enable it", token_env)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        coordinator.start()
        try:
            yield
        finally:
            coordinator.stop()

    app = FastAPI(title="skillswarm coordinator", version="1", lifespan=lifespan)
    app.state.coordinator = coordinator

    @app.get(
        "/healthz",
        tags=["ops"],
        response_model=HealthOut,
        responses={
            503: {"model": HealthOut, "description": "a worker is gone; restart the coordinator"}
        },
    )
    def healthz() -> JSONResponse:
        """200 while every worker of a started coordinator is alive, else 503 naming them."""
        workers = coordinator.worker_liveness()
        health = HealthOut(ok=all(workers.values()), workers=workers)
        return JSONResponse(health.model_dump(), status_code=200 if health.ok else 503)

    app.include_router(v1_router())
    app.include_router(operator_router(coordinator, operator_token, token_env))
    app.include_router(dashboard_router())
    app.include_router(hub_router(coordinator.registry))
    instrument_app(app, coordinator.metrics)
    return app


def serve(config: CoordinatorConfig) -> None:
    """Run the coordinator until SIGINT/SIGTERM."""
    import torch

    torch.set_num_threads(config.torch_threads)
    freeze_startup_heap()
    coordinator = Coordinator(config)
    coordinator.prepare()  # a missing base fails here, before the server starts
    app = create_app(coordinator)
    server = uvicorn.Server(
        server_config(app, config.http_host, config.http_port, log_level="info")
    )
    server.run()
