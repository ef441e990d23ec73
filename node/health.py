"""The node daemon's health and metrics endpoint: `GET /healthz` (JSON: phase, round, step, last
reward, the code sandbox in force, seconds since the last progress) and `GET /metrics`
(Prometheus text format), served by a small threaded HTTP server beside the daemon."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)


class NodeStatus:
    """What the daemon is doing, updated by the daemon and read by the endpoint (thread-safe)."""

    def __init__(self, peer_id: str, domain: str) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {
            "peer_id": peer_id,
            "domain": domain,
            "phase": "starting",
            "round": None,
            "step": None,
            "reward": None,
            "sandbox": None,
        }
        self._last_progress = time.monotonic()
        self.round = Gauge("skillswarm_node_round", "round being trained", registry=self.registry)
        self.step = Gauge(
            "skillswarm_node_step", "training step within the round", registry=self.registry
        )
        self.reward = Gauge(
            "skillswarm_node_reward",
            "mean reward of the last training step",
            registry=self.registry,
        )
        self.deltas = Counter(
            "skillswarm_node_deltas_published",
            "deltas signed and announced",
            registry=self.registry,
        )
        self.rounds = Counter(
            "skillswarm_node_rounds_completed",
            "rounds whose merged checkpoint this node saw",
            registry=self.registry,
        )

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._state.update(fields)
            self._last_progress = time.monotonic()
        if fields.get("round") is not None:
            self.round.set(fields["round"])
        if fields.get("step") is not None:
            self.step.set(fields["step"])
        if fields.get("reward") is not None:
            self.reward.set(fields["reward"])

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self._state,
                "seconds_since_progress": round(time.monotonic() - self._last_progress, 1),
            }


class _Handler(BaseHTTPRequestHandler):
    status: NodeStatus

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        if self.path == "/healthz":
            body, content_type = json.dumps(self.status.snapshot()).encode(), "application/json"
        elif self.path == "/metrics":
            body, content_type = generate_latest(self.status.registry), CONTENT_TYPE_LATEST
        else:
            self.send_error(404, "only /healthz and /metrics are served here")
            return
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the http.server API
        log.debug("health endpoint: " + format, *args)


class HealthServer:
    """Serves a NodeStatus on host:port (port 0 picks a free one) until `stop()`."""

    def __init__(self, status: NodeStatus, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = type("NodeHealthHandler", (_Handler,), {"status": status})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="node-health", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("health and metrics on %s/healthz and %s/metrics", self.url, self.url)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
