"""The routes of `specvoice serve`, on one port:

    GET|POST /voice            Twilio's voice webhook: TwiML that connects the call to the stream
    GET|POST /stream-ended     what the call does once its stream ended (transfer or hang up)
    WS       /media-stream     Twilio Media Streams: one phone call per connection
    GET      /health           JSON: ok, draining, calls active, max calls
    GET      /                 the call page: talk to the agent from a browser
    WS       /call             the page's call: PCM both ways, the call's events to the page
    GET      /calls            recent calls, each linking to its report page
    GET      /calls/{name}     a call's report page (with its recording, when it has one)
    GET      /metrics          Prometheus text format

Twilio's paths check Twilio's signature (or the bearer token); people's paths
(the page, /call, /calls, /metrics) check access.person (token needed off loopback).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from pipeline.transports.telephony.media_stream import serve_stream
from pipeline.transports.web import pages, webhooks
from pipeline.transports.web.access import BASIC_REALM
from pipeline.transports.web.metrics import CONTENT_TYPE
from pipeline.transports.web.sockets import AsgiSocket

if TYPE_CHECKING:
    from pipeline.transports.web.server import Bridge

log = logging.getLogger("pipeline.transports.telephony.server")

__all__ = ["build_app"]

STATIC = Path(__file__).resolve().parent / "static"


def build_app(bridge: "Bridge") -> Starlette:
    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route(webhooks.VOICE_PATH, webhooks.voice, methods=["GET", "POST"]),
        Route(webhooks.ACTION_PATH, webhooks.stream_ended, methods=["GET", "POST"]),
        WebSocketRoute(webhooks.STREAM_PATH, _WebSocketEndpoint(media_stream)),
        Route("/", person(pages.call_page), methods=["GET"]),
        WebSocketRoute("/call", _WebSocketEndpoint(browser_call)),
        Route("/calls", person(pages.calls_page), methods=["GET"]),
        Route("/calls/{name}", person(pages.report_page), methods=["GET"]),
        Route("/calls/{name}/recording.wav", person(pages.recording), methods=["GET"]),
        Route("/metrics", person(metrics), methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ])
    # "/voice/" is not "/voice": no redirects that a probe could follow to somewhere else.
    app.router.redirect_slashes = False
    app.state.bridge = bridge
    return app


def person(endpoint):
    """An endpoint for people (and Prometheus): open on loopback, else the bridge's token as
    bearer or basic-auth password."""
    async def guarded(request: Request) -> Response:
        bridge: Bridge = request.app.state.bridge
        status = bridge.access.person(request.headers)
        if status:
            return _ask_credentials(status)
        return await endpoint(request)
    return guarded


def _ask_credentials(status: int) -> Response:
    headers = {"WWW-Authenticate": BASIC_REALM} if status == 401 else {}
    return PlainTextResponse("unauthorized\n" if status == 401 else "forbidden\n", status, headers=headers)


async def health(request: Request) -> Response:
    bridge: Bridge = request.app.state.bridge
    body = {"ok": not bridge.draining, "draining": bridge.draining, "calls_active": bridge.active_calls,
            "max_calls": bridge.config.max_calls, "calls_total": bridge.calls_total}
    return JSONResponse(body, 503 if bridge.draining else 200, headers={"Cache-Control": "no-store"})


async def metrics(request: Request) -> Response:
    bridge: Bridge = request.app.state.bridge
    return Response(bridge.metrics.render(), 200, media_type=CONTENT_TYPE)


async def _refuse(ws: WebSocket, status: int, text: str, headers: dict | None = None) -> None:
    await ws.send_denial_response(PlainTextResponse(text, status, headers=headers))


async def _admit(ws: WebSocket, sock: AsgiSocket, what: str) -> bool:
    bridge: Bridge = ws.app.state.bridge
    why = bridge.admit(sock)
    if why is None:
        return True
    bridge.metrics.refused(why)
    if why == "draining":
        log.warning("%s refused (503: draining) from %s", what, sock.peer)
        await _refuse(ws, 503, "shutting down, try another server\n", {"Retry-After": "5"})
    else:
        log.warning("%s refused (503: %d calls active) from %s", what, bridge.config.max_calls, sock.peer)
        await _refuse(ws, 503, "too many calls\n", {"Retry-After": "5"})
    return False


class _WebSocketEndpoint:
    """A WebSocket route as an ASGI app (not a plain function), so the handler also gets the
    raw `receive`: AsgiSocket.gone() reads the transport's end from it after a close."""

    def __init__(self, handler):
        self.handler = handler

    async def __call__(self, scope, receive, send) -> None:
        await self.handler(WebSocket(scope, receive, send), receive)


async def media_stream(ws: WebSocket, receive) -> None:
    bridge: Bridge = ws.app.state.bridge
    sock = AsgiSocket(ws, receive)
    status = bridge.access.twilio(ws.headers, webhooks.path_with_query(ws))
    if status:
        log.warning("stream handshake refused (%d) from %s", status, sock.peer)
        extra = {"WWW-Authenticate": 'Bearer realm="specvoice"'} if status == 401 else None
        return await _refuse(ws, status, "unauthorized\n" if status == 401 else "forbidden\n", extra)
    if not await _admit(ws, sock, "stream handshake"):
        return
    try:
        await ws.accept()
        await serve_stream(sock, bridge.settings, bridge.on_call, bridge)
        await sock.gone()  # the slot is held while the connection is (a peer may not read our close)
    finally:
        bridge.release(sock)


async def browser_call(ws: WebSocket, receive) -> None:
    from pipeline.transports.web.browser import serve_browser

    bridge: Bridge = ws.app.state.bridge
    sock = AsgiSocket(ws, receive)
    status = bridge.access.person(ws.headers)
    if status:
        log.warning("browser call refused (%d) from %s", status, sock.peer)
        return await _refuse(ws, status, "unauthorized\n" if status == 401 else "forbidden\n")
    if bridge.on_browser_call is None:
        return await _refuse(ws, 404, "this server takes no browser calls\n")
    if not await _admit(ws, sock, "browser call"):
        return
    try:
        await ws.accept()
        bridge.metrics.call_started("browser")
        await serve_browser(sock, bridge)
        await sock.gone()
    finally:
        bridge.release(sock)
