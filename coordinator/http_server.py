"""The coordinator's HTTP server settings: uvicorn with h11, bounded header size, and a deadline
for a request's headers, so that clients that never finish them cannot hold connections open."""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 15.0
MAX_HEADER_BYTES = 16 * 1024


class HeaderDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose client has not finished a request's
    headers `header_timeout_s` after connecting or after the previous response (uvicorn's own
    keep-alive timeout stops counting at the first byte of the next request)."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_deadline(self) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        """Both sides idle: the client has not sent a whole request since the deadline was set
        (once its headers are in, h11 has moved it on, and the request runs as long as it needs)."""
        self._header_deadline = None
        waiting = self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE
        if waiting and not self.transport.is_closing():
            self.transport.close()


def server_config(
    app: Any,
    host: str,
    port: int,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    **options: Any,
) -> uvicorn.Config:
    """uvicorn's Config for the coordinator: h11 with the header deadline and size bound."""
    protocol = type(
        "HeaderDeadlineH11Protocol",
        (HeaderDeadlineH11Protocol,),
        {"header_timeout_s": header_timeout_s},
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        **options,
    )
