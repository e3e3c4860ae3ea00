"""uvicorn's WebSocket protocol (websockets, sans-I/O) without its DEBUG lines, and with
refused handshakes taken as finished.

websockets logs every handshake header at DEBUG (Authorization and X-Twilio-Signature
among them) and every frame; uvicorn hands it the "uvicorn.error" logger, so `-vv` would
write credentials to the log. This protocol's websockets connection gets a view of that
logger that never passes DEBUG on (a view, not a level set on a shared logger: importing
and running change nothing for anyone else).
"""

from __future__ import annotations

import logging

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

__all__ = ["QuietWebSocketProtocol"]


class _NoDebug(logging.LoggerAdapter):
    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 - logging's name
        return level > logging.DEBUG and self.logger.isEnabledFor(level)

    def log(self, level: int, msg, *args, **kwargs) -> None:
        if level > logging.DEBUG:
            super().log(level, msg, *args, **kwargs)


class QuietWebSocketProtocol(WebSocketsSansIOProtocol):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn.logger = _NoDebug(self.conn.logger, {})
        self.conn.debug = False

    async def send(self, message) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            # A refused handshake (401, 403, 503) is a finished exchange: without this, uvicorn
            # logs every refusal as an ERROR ("returned without completing handshake").
            self.handshake_complete = True
