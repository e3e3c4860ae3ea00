"""`specvoice serve`'s server: one ASGI app (Starlette) on uvicorn, one port.

    bridge = Bridge(config.bridge, on_call, tokens, on_browser_call=..., site=Site(...))
    port = await bridge.start();  await bridge.drain(30);  await bridge.stop()

Why an ASGI server: Twilio's voice webhook is a form POST by default, and the WebSocket
library's own HTTP handling (what served the bridge before) drops request bodies; one
uvicorn port now serves the webhooks with their bodies, both WebSockets, the pages and
the metrics (app.py lists the routes).

What the server keeps: the connections admitted as calls (a slot each, taken before the
WebSocket handshake completes and freed when its handler ends: `max_calls` counts phone
and browser calls together, since they share the models), the live TelephonyCalls, and
the last few finished calls' agent actions (Twilio asks for them at the stream-ended
action, seconds after the stream). Stopping closes every call with 1001 (going away),
lets each handler write its report, then stops uvicorn; drain() first refuses new calls
(503) and waits for the calls in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import uvicorn

from pipeline.config import BridgeConfig
from pipeline.transports.telephony.auth import AuthConfigError, BridgeTokens
from pipeline.transports.telephony.call import TelephonyCall
from pipeline.transports.telephony.media_stream import OnCall, StreamSettings
from pipeline.transports.web.access import Access
from pipeline.transports.web.metrics import ServerMetrics
from pipeline.transports.web.quiet_ws import QuietWebSocketProtocol
from pipeline.transports.web.request_deadline import with_request_deadline
from pipeline.transports.web.sockets import AsgiSocket

log = logging.getLogger("pipeline.transports.telephony.server")

__all__ = ["Bridge", "BridgeAuthError", "Site", "check_auth_configured"]

# What the bridge remembers of ended calls for Twilio's action request (which comes within
# seconds of the stream's end): the last few, so a long-running server holds no more.
KEEP_OUTCOMES = 1024


class BridgeAuthError(AuthConfigError):
    """The bridge would accept anyone: refuse to start."""


@dataclass
class Site:
    """The people's side of the server: where reports are, how one is drawn as a page
    (`specvoice report`'s renderer, handed in from demo/: pipeline/ never imports it)."""

    report_dir: Path
    render_report: Callable[[dict, str | None], str] | None = None
    recent_calls: int = 50


def check_auth_configured(config, tokens: BridgeTokens, insecure: bool = False) -> None:
    """Raise BridgeAuthError when the bridge would accept unauthenticated calls by accident."""
    if tokens.configured or insecure or not config.require_auth:
        return
    raise BridgeAuthError(
        "the bridge requires authentication but no token is configured: set TWILIO_AUTH_TOKEN "
        "(Twilio signature) and/or SPECVOICE_BRIDGE_TOKEN (bearer), or bridge.twilio_auth_token_file / "
        "bridge.auth_token_file in the config; for local development only, pass --insecure "
        "(or set bridge.require_auth = false)"
    )


class Bridge:
    """`Bridge(config.bridge, on_call, tokens)`; `port = await bridge.start()`; `await bridge.stop()`."""

    def __init__(
        self,
        config: BridgeConfig,
        on_call: OnCall,
        tokens: BridgeTokens | None = None,
        *,
        insecure: bool = False,
        max_media_bytes: int | None = None,
        end_grace_s: float | None = None,
        send_ahead_s: float | None = None,
        on_browser_call: Callable[..., Awaitable[None]] | None = None,
        site: Site | None = None,
        record_phone_calls: bool = False,
    ):
        self.config = config
        self.tokens = tokens or BridgeTokens()
        check_auth_configured(config, self.tokens, insecure)
        self.access = Access(self.tokens, config.public_url, config.host, open_all=not self.tokens.configured)
        self.on_call = on_call
        self.on_browser_call = on_browser_call
        self.site = site
        # Keyword arguments (tests, embedding) override the config.
        self.settings = StreamSettings(
            max_media_bytes=max_media_bytes if max_media_bytes is not None else config.max_media_bytes,
            idle_timeout_s=config.idle_timeout_s,
            send_ahead_s=send_ahead_s if send_ahead_s is not None else config.send_ahead_s,
            end_grace_s=end_grace_s if end_grace_s is not None else config.end_grace_s,
            record=record_phone_calls,
        )
        self.transfer_to: str = config.transfer_to
        self.metrics = ServerMetrics(lambda: self.active_calls)
        self._agent_actions: OrderedDict[str, str] = OrderedDict()  # CallSid -> "transfer" | "end_call"
        self._slots: set[AsgiSocket] = set()  # connections admitted as calls, until their handler ends
        self._slots_changed = asyncio.Event()
        self.calls: set[TelephonyCall] = set()
        self.calls_total = 0
        self.port: int | None = None
        self.stopping = False
        self.draining = False  # drain(): new calls refused, calls in progress go on
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        from pipeline.transports.web.app import build_app

        self._sock = _listen(self.config.host, self.config.port)
        config = uvicorn.Config(
            build_app(self),
            http=with_request_deadline(self.config.handshake_timeout_s),
            ws=QuietWebSocketProtocol,
            ws_max_size=self.config.max_message_bytes,
            ws_ping_interval=None,  # Twilio does not answer pings on a media stream; idle_timeout_s guards the line
            lifespan="off",
            log_config=None,  # the CLI configures logging; uvicorn must not reconfigure it
            access_log=False,  # request lines carry query strings (CallSid, From): we log what we mean to
            server_header=False,
            date_header=False,
            timeout_graceful_shutdown=15,
        )
        config.load()
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)
        # startup() and shutdown(), not serve(): serve() installs its own SIGINT/SIGTERM
        # handlers, and `specvoice serve` drains on SIGTERM itself.
        await self._server.startup(sockets=[self._sock])
        self.port = self._sock.getsockname()[1]
        log.info("bridge listening on %s:%d (stream /media-stream)", self.config.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._server is None:
            return
        self.stopping = True
        # Every call is told the server is going away (1001); each handler then winds its call
        # up (the report is written) within end_grace_s.
        for sock in list(self._slots):
            await sock.close(1001, "server shutdown")
        with contextlib.suppress(TimeoutError):
            await self._wait_slots(0, self.settings.end_grace_s + 10.0)
        server, self._server = self._server, None
        server.should_exit = True
        await server.shutdown(sockets=[self._sock] if self._sock is not None else None)
        self._sock = None

    async def serve_forever(self) -> None:
        """Serve until cancelled (SIGINT), then stop: calls in progress end as server_shutdown."""
        if self._server is None:
            await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def drain(self, timeout_s: float) -> int:
        """Stop taking calls and let those in progress finish, up to `timeout_s`: the webhook,
        new calls and /health answer 503 (a load balancer takes this process out; Twilio
        tries the webhook's fallback URL). Returns how many calls were still in progress at
        the deadline (stop() then closes them, reports written)."""
        self.draining = True
        log.info("draining: no new calls; waiting up to %.0f s for %d call(s)", timeout_s, self.active_calls)
        with contextlib.suppress(TimeoutError):
            await self._wait_slots(0, timeout_s)
        return self.active_calls

    async def _wait_slots(self, n: int, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self._slots) > n:
                self._slots_changed.clear()
                await self._slots_changed.wait()

    @property
    def active_calls(self) -> int:
        return len(self._slots)

    # ------------------------------------------------------------ slots (app.py admits, handlers free)

    def admit(self, sock: AsgiSocket) -> str | None:
        """Take a call slot for `sock`; None when admitted, else why not ("draining", "busy")."""
        if self.draining or self.stopping:
            return "draining"
        if len(self._slots) >= self.config.max_calls:
            return "busy"
        self._slots.add(sock)
        return None

    def release(self, sock: AsgiSocket) -> None:
        self._slots.discard(sock)
        self._slots_changed.set()

    # ------------------------------------------------------------ StreamHost (telephony/media_stream.py)

    def call_started(self, call: TelephonyCall) -> None:
        self.calls.add(call)
        self.calls_total += 1
        self.metrics.call_started("twilio")

    def call_ended(self, call: TelephonyCall) -> None:
        self.calls.discard(call)

    def remember_action(self, call: TelephonyCall) -> None:
        if not call.agent_action or not call.start.call_sid:
            return
        self._agent_actions[call.start.call_sid] = call.agent_action
        self._agent_actions.move_to_end(call.start.call_sid)
        while len(self._agent_actions) > KEEP_OUTCOMES:
            self._agent_actions.popitem(last=False)

    def agent_action(self, call_sid: str) -> str | None:
        return self._agent_actions.get(call_sid)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, made here so a busy port is an OSError for the caller (uvicorn
    would exit the process)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock

