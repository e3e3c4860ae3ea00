"""A Starlette WebSocket as the telephony loop's `StreamSocket` (and the browser call's).

ASGI reports a close as a `websocket.disconnect` message whichever side closed; the loop
needs to know which (a close the server made for a reason of its own is logged as a
protocol error), so closes made here are remembered, and the codes uvicorn itself sends
when a frame breaks the rules (1002 protocol, 1007 bad UTF-8, 1009 over the size limit)
count as the server's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState
from websockets.exceptions import ConnectionClosed

from pipeline.transports.telephony.media_stream import StreamClosed

__all__ = ["AsgiSocket", "peer_of"]

# uvicorn reports the transport itself gone as a disconnect with this code (never sent on the wire).
TRANSPORT_LOST = (1005, 1006)
# How long a closed connection may linger, its peer not reading our close (uvicorn gives up at 10 s).
LINGER_S = 15.0

# Close codes uvicorn sends itself when an incoming frame breaks a limit or the protocol.
SERVER_CODES = frozenset({1002, 1007, 1009})


def peer_of(scope_client) -> str:
    if scope_client:
        return f"{scope_client[0]}:{scope_client[1]}"
    return "?"


class AsgiSocket:
    def __init__(self, ws: WebSocket, receive=None):
        self.ws = ws
        self._receive = receive  # the raw ASGI receive: it still reports the transport's end after a close
        self._lost = False  # the transport's end was already reported
        self.peer = peer_of(ws.client)
        self.sent_code: int | None = None  # set once we closed it

    @property
    def open(self) -> bool:
        return self.sent_code is None and self.ws.application_state == WebSocketState.CONNECTED

    async def recv(self) -> str | bytes:
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            code = message.get("code")
            self._lost = self._lost or code in TRANSPORT_LOST
            ours = self.sent_code is not None or code in SERVER_CODES
            raise StreamClosed(self.sent_code if self.sent_code is not None else code, ours,
                               message.get("reason") or "")
        if message.get("text") is not None:
            return message["text"]
        return message.get("bytes") or b""

    async def send(self, text: str) -> None:
        await self._send(self.ws.send_text, text)

    async def send_bytes(self, data: bytes) -> None:
        await self._send(self.ws.send_bytes, data)

    async def _send(self, send: Callable[[Any], Awaitable[None]], data: str | bytes) -> None:
        """One message out; a socket we closed, or one gone under us, raises ConnectionClosed."""
        if self.sent_code is not None:
            raise ConnectionClosed(None, None)
        try:
            await send(data)
        except (WebSocketDisconnect, OSError, RuntimeError) as exc:
            raise ConnectionClosed(None, None) from exc

    async def gone(self, timeout_s: float = LINGER_S) -> None:
        """Wait until the connection is really closed: a peer that never reads our close frame
        holds its socket (and the call's slot) until uvicorn gives up on it."""
        if self._receive is None or self._lost:
            return
        with contextlib.suppress(TimeoutError, Exception):
            async with asyncio.timeout(timeout_s):
                while True:
                    message = await self._receive()
                    if message.get("type") == "websocket.disconnect" and message.get("code") in TRANSPORT_LOST:
                        self._lost = True
                        return

    async def close(self, code: int, reason: str) -> None:
        if self.sent_code is not None:
            return
        self.sent_code = code
        with contextlib.suppress(Exception):  # already gone: nothing to close
            await self.ws.close(code, reason)
