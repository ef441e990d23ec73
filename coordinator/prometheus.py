"""Prometheus exposition at /metrics: the coordinator's counters, read at scrape time, plus HTTP
request counts and latency by route template. Each app gets its own CollectorRegistry, so several
apps in one process never share or clash over series."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

METRIC_NAMESPACE = "skillswarm"
UNMATCHED_ROUTE = "unmatched"
# Methods counted under their own label; anything else a client makes up is counted as "other",
# so that no request can add a metric series.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
OTHER_METHOD = "other"

COORDINATOR_METRIC_HELP = {
    "deltas_received_total": "Delta announcements recorded, whatever the verdict.",
    "deltas_accepted_total": "Deltas that passed every check.",
    "deltas_rejected_total": "Deltas refused, with the reason on record.",
    "rounds_completed_total": "Rounds merged and published.",
    "current_round": "Number of the round now open.",
    "merge_seconds_last": "Wall time of the last merge, in seconds.",
    "checkpoints_published_total": "Checkpoints published to the registry.",
    "checkpoints_retired_total": "Checkpoints retired by the operator.",
    "rounds_failed_total": "Rounds whose merge failed.",
    "rounds_held_total": "Rounds whose merge was worse than the base on a domain: not published.",
    "nodes_seen": "Peers heard from, by heartbeat or delta.",
    "gossip_refused_access_total": "Gossip from denied peers or outside the allow-list, unread.",
    "gossip_refused_malformed_total": "Gossip that did not decode, recorded against its sender.",
    "gossip_refused_unknown_total": "Gossip of a type or version this coordinator does not speak.",
    "gossip_refused_failed_total": "Gossip whose handling failed, recorded against its sender.",
    "intake_errors_total": "Intake passes that failed and were gone past.",
    "fanout_holders": "Nodes serving the current checkpoint's delta to their peers.",
    "fanout_seed_grants_total": "Times the coordinator named itself as a node's delta source.",
    "blob_bytes_served_total": "Blob bytes this coordinator sent to peers (checkpoint deltas).",
}

_INVALID_NAME_CHARACTERS = re.compile(r"[^a-zA-Z0-9_:]")
_REJECTED_BY_KIND = re.compile(r"deltas_rejected_(\w+)_total")


class CoordinatorCollector(Collector):
    """Turns the coordinator's `metrics()` mapping into Prometheus families at each scrape.

    Names ending in `_total` are counters, everything else is a gauge.
    """

    def __init__(
        self, read_metrics: Callable[[], Mapping[str, float]], namespace: str = METRIC_NAMESPACE
    ) -> None:
        self._read_metrics = read_metrics
        self._namespace = namespace

    def collect(self) -> Iterator[Metric]:
        for key, value in sorted(self._read_metrics().items()):
            name = f"{self._namespace}_{_INVALID_NAME_CHARACTERS.sub('_', key)}"
            documentation = _help_for(key)
            if name.endswith("_total"):
                yield CounterMetricFamily(
                    name.removesuffix("_total"), documentation, value=float(value)
                )
            else:
                yield GaugeMetricFamily(name, documentation, value=float(value))


def _help_for(key: str) -> str:
    if key in COORDINATOR_METRIC_HELP:
        return COORDINATOR_METRIC_HELP[key]
    by_kind = _REJECTED_BY_KIND.fullmatch(key)
    if by_kind is not None:
        return f"Deltas rejected as {by_kind[1]}."
    return f"Coordinator metric {key}."


class HTTPMetrics:
    """Request counter and latency histogram, labelled by method and route template."""

    def __init__(self, registry: CollectorRegistry, namespace: str = METRIC_NAMESPACE) -> None:
        self.requests = Counter(
            f"{namespace}_http_requests",
            "HTTP requests answered, by method, route template and status code.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            f"{namespace}_http_request_duration_seconds",
            "Time from request to the last byte of the response, by method and route template.",
            ["method", "route"],
            registry=registry,
        )

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        method = method if method in KNOWN_METHODS else OTHER_METHOD  # any client can send any
        self.requests.labels(method=method, route=route, status=str(status)).inc()
        self.latency.labels(method=method, route=route).observe(seconds)


class HTTPMetricsMiddleware:
    """ASGI middleware recording every HTTP request under the template of the route it matched.

    Labelling by template (`/v1/deltas/{delta_id}`), never by the raw path, keeps the number of
    series bounded whatever paths clients send; requests no route matched share one label.
    """

    def __init__(self, app: ASGIApp, metrics: HTTPMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
            self.metrics.observe(scope["method"], route, status, time.perf_counter() - started)


def metrics_router(registry: CollectorRegistry) -> APIRouter:
    """The `GET /metrics` route serving `registry` in the format the scraper asks for."""
    router = APIRouter(tags=["ops"])

    @router.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "content": {"text/plain": {"schema": {"type": "string"}}},
                "description": "Prometheus text exposition (OpenMetrics when the scraper asks)",
            }
        },
        summary="Prometheus metrics of the coordinator and its HTTP API",
    )
    def metrics(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(content=encoder(registry), media_type=content_type)

    return router


def instrument_app(app: FastAPI, read_metrics: Callable[[], Mapping[str, float]]) -> None:
    """Give `app` its own metrics registry, the HTTP middleware and the `/metrics` route."""
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(read_metrics))
    app.add_middleware(HTTPMetricsMiddleware, metrics=HTTPMetrics(registry))
    app.include_router(metrics_router(registry))
    app.state.metrics_registry = registry
