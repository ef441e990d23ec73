"""Ending a libp2p stream without raising: a close, a reset, or one last frame and a close. A
peer may have gone or reset first; the host logs that at debug level and goes on. `what` names
the stream in those log lines ("blob stream", "gossip stream")."""

from __future__ import annotations

import logging

import trio
from libp2p.abc import INetStream

__all__ = ["close_quietly", "reset_quietly", "write_and_close"]

logger = logging.getLogger(__name__)

RESET_TIMEOUT_S = 1.0


async def close_quietly(stream: INetStream, what: str) -> None:
    """Close `stream` (half-close our side); a failure is logged, not raised."""
    try:
        await stream.close()
    except Exception as error:
        logger.debug("closing a %s failed: %r", what, error)


async def reset_quietly(stream: INetStream, what: str) -> None:
    """Reset `stream` within RESET_TIMEOUT_S, shielded from the caller's cancellation so that
    the peer hears of it even when a timeout or a stopping host ends the caller."""
    with trio.CancelScope(shield=True), trio.move_on_after(RESET_TIMEOUT_S):
        try:
            await stream.reset()
        except Exception as error:
            logger.debug("resetting a %s failed: %r", what, error)


async def write_and_close(stream: INetStream, frame: bytes, what: str) -> None:
    """Write `frame` and close; if either fails, reset the stream instead."""
    try:
        await stream.write(frame)
        await stream.close()
    except Exception as error:
        logger.debug("could not answer a %s: %r", what, error)
        await reset_quietly(stream, what)
