"""uvicorn's HTTP/1.1 protocol with a deadline on a connection's first request.

uvicorn times out idle keep-alive connections, but not a peer that opens a connection and
trickles its request line a byte at a time (slowloris): that peer would hold a socket, and
a WebSocket upgrade it never finishes must not look like a call either. With this protocol
a connection whose first request's headers are not complete within `timeout_s` is closed.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["with_request_deadline"]


def with_request_deadline(timeout_s: float) -> type[H11Protocol]:
    class DeadlineH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._deadline = self.loop.call_later(timeout_s, self._too_slow)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # Headers complete (a request cycle began), or handed over to the WebSocket
            # protocol: the deadline is met.
            if self.cycle is not None or self.transport.get_protocol() is not self:
                self._cancel_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_deadline()
            super().connection_lost(exc)

        def _cancel_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.cycle is None and self.transport.get_protocol() is self and not self.transport.is_closing():
                self.transport.close()

    return DeadlineH11Protocol
