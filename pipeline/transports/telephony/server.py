"""The telephony bridge: a WebSocket server speaking Twilio Media Streams.

One port serves both:
  * WebSocket `/media-stream`: one phone call per connection (Twilio, or any client
    speaking the same protocol), authenticated at the handshake;
  * plain HTTP through `process_request`: `GET|POST /voice` answers Twilio's voice
    webhook with TwiML that connects the call to the stream; `GET /stream-ended` answers
    what comes after the stream (below); `GET /health`.

The bridge knows nothing of the pipeline. For every call it awaits
`on_call(call: TelephonyCall)`; the call gives the parsed `start`, an async iterator
of inbound events, and outbound audio paced in real time (20 ms frames), marks and
`clear`. A failing call never takes the server down; when the caller goes away the
call's tasks are cancelled and awaited.

Transfer: with `bridge.transfer_to` set, the TwiML is `<Connect action=".../stream-ended"
method="GET">`: Twilio requests that URL (with the CallSid) when the stream ends. A call
whose agent asked for a transfer (the handler sets `TelephonyCall.agent_action`) has its
stream closed once the agent's last words were played (the speaker waits for their
marks), and the action URL answers `<Dial>transfer_to</Dial>`; any other call gets
`<Hangup/>`. Without `transfer_to` there is no action URL: when the stream ends, the call
ends (the adapter makes transfer_to_human fail, so the agent offers a message instead).
docs/tools.md ("Transfer") has the TwiML and the REST alternative.

Limitation: the websockets HTTP parser refuses request bodies, so Twilio's voice
webhook must be configured with HTTP **GET** (parameters then travel in the query
string, which is also what Twilio signs), and the action URL is asked for with GET. A
body-less POST works.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable
from urllib.parse import parse_qsl, urlsplit
from xml.sax.saxutils import escape, quoteattr

import numpy as np
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Response
from websockets.protocol import State

from pipeline.playout import Playout

from pipeline.transports.telephony.auth import (
    AuthConfigError,
    BridgeTokens,
    public_base,
    signed_url_candidates,
    validate_bearer,
    validate_twilio_signature,
)
from pipeline.transports.telephony.protocol import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    SAMPLE_RATE,
    Connected,
    InboundEvent,
    Mark,
    Media,
    ProtocolError,
    Start,
    Stop,
    UnknownEvent,
    parse_message,
    serialize_clear,
    serialize_mark,
    serialize_media,
)
from voice import mulaw
from voice.audio import to_int16

log = logging.getLogger(__name__)


class _NoDebug(logging.LoggerAdapter):
    """websockets logs every request header at DEBUG (Authorization, X-Twilio-Signature
    among them): this view of its logger never passes DEBUG on, so `-vv` never writes
    credentials to a log. (A view, not a level set at import: importing has no effect.)"""

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 - logging's name
        return level > logging.DEBUG and self.logger.isEnabledFor(level)

    def log(self, level: int, msg, *args, **kwargs) -> None:
        if level > logging.DEBUG:
            super().log(level, msg, *args, **kwargs)


ws_log = _NoDebug(logging.getLogger(__name__ + ".websockets"), {})

STREAM_PATH = "/media-stream"
VOICE_PATH = "/voice"
ACTION_PATH = "/stream-ended"
HEALTH_PATH = "/health"
# What the bridge remembers of ended calls for Twilio's action request (which comes within
# seconds of the stream's end): the last few, so a long-running server holds no more.
KEEP_OUTCOMES = 1024
# Said when a call asks for a transfer the bridge cannot make (no bridge.transfer_to).
NO_TRANSFER_LINE = "Sorry, nobody can take your call right now. Please call again later. Goodbye."
_HOST_RE = re.compile(r"^[A-Za-z0-9.\-]+(:\d{1,5})?$|^\[[0-9A-Fa-f:.]+\](:\d{1,5})?$")


class BridgeAuthError(AuthConfigError):
    """The bridge would accept anyone: refuse to start."""


OnCall = Callable[["TelephonyCall"], Awaitable[None]]


@dataclass
class CallStats:
    media_received: int = 0
    inbound_dropped: int = 0  # inbound events dropped because the pipeline did not keep up
    frames_sent: int = 0
    bytes_sent: int = 0
    marks_sent: int = 0
    marks_echoed: int = 0
    clears_sent: int = 0


_END = object()  # ends the inbound iterator


class TwilioWriter:
    """The paced output's frame writer for a phone call: 8 kHz mu-law `media` messages,
    `mark` (Twilio echoes it once the audio before it has played) and `clear`."""

    sample_rate = SAMPLE_RATE
    remote_marks = True

    def __init__(self, call: "TelephonyCall"):
        self.call = call

    async def write_frame(self, pcm: np.ndarray) -> None:
        await self.call.send_media_now(mulaw.encode_bytes(to_int16(pcm)))

    async def write_mark(self, name: str) -> None:
        await self.call.send_mark_now(name)

    async def write_clear(self) -> None:
        await self.call.send_clear_now()


class TelephonyCall:
    """One call as the pipeline sees it.

    Inbound: `async for event in call` yields Media (decoded mu-law), Dtmf, Mark and Stop
    events after `start`, and ends when the caller stops or goes away.
    Outbound: `call.output`, the one paced output (pipeline.playout.Playout) over a
    TwilioWriter: 20 ms media frames in real time, marks confirmed by Twilio's echo, clear.
    """

    def __init__(
        self,
        start: Start,
        send: Callable[[str], Awaitable[None]],
        *,
        send_ahead_s: float = 0.04,
        inbound_max: int = 3000,
    ):
        self.start = start
        self.stream_sid = start.stream_sid
        self.stats = CallStats()
        self.played_marks: list[str] = []
        self._send = send
        self._inbound: asyncio.Queue = asyncio.Queue(maxsize=max(1, inbound_max))
        self._closed = False
        # Frames go out `send_ahead_s` ahead of real time: Twilio's buffer absorbs our
        # event-loop jitter (the CPU is busy with the models), yet `clear` still leaves little queued.
        self.output = Playout(TwilioWriter(self), ahead_s=send_ahead_s)
        # How the connection ended when the bridge ended it (idle_timeout, protocol_error,
        # server_shutdown); None when the caller went away (stop or disconnect). The
        # pipeline reads it when the inbound stream ends, for the call's report.
        self.end_reason: str | None = None
        # Set by the handler when a tool ended the call ("transfer", "end_call"): what the
        # bridge tells Twilio to do once the stream is closed.
        self.agent_action: str | None = None

    # ------------------------------------------------------------ inbound

    def __aiter__(self) -> AsyncIterator[InboundEvent]:
        return self.events()

    async def events(self) -> AsyncIterator[InboundEvent]:
        while True:
            item = await self._inbound.get()
            if item is _END:
                self._inbound.put_nowait(_END)  # a second iterator ends too
                return
            yield item

    def deliver(self, event: InboundEvent) -> None:
        if isinstance(event, Media):
            self.stats.media_received += 1
        elif isinstance(event, Mark):
            self.played_marks.append(event.name)
            self.stats.marks_echoed += 1
            self.output.confirm_mark(event.name)
        try:
            self._inbound.put_nowait(event)
        except asyncio.QueueFull:
            # The pipeline stalled: drop the oldest rather than grow without bound.
            with contextlib.suppress(asyncio.QueueEmpty):
                self._inbound.get_nowait()
            self.stats.inbound_dropped += 1
            self._inbound.put_nowait(event)

    def end_inbound(self) -> None:
        while True:
            try:
                self._inbound.put_nowait(_END)
                return
            except asyncio.QueueFull:
                self._inbound.get_nowait()
                self.stats.inbound_dropped += 1

    # ------------------------------------------------------------ outbound (the writer's sends)

    @property
    def closed(self) -> bool:
        return self._closed

    async def send_media_now(self, payload: bytes) -> None:
        """One media message at once (the Playout paces). Raises ConnectionClosed when gone."""
        await self._send(serialize_media(self.stream_sid, payload))
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(payload)

    async def send_mark_now(self, name: str) -> None:
        await self._send(serialize_mark(self.stream_sid, name))
        self.stats.marks_sent += 1

    async def send_clear_now(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(ConnectionClosed):
            await self._send(serialize_clear(self.stream_sid))
            self.stats.clears_sent += 1

    async def close(self) -> None:
        self._closed = True
        self.end_inbound()
        await self.output.aclose()


# ---------------------------------------------------------------- the server

def _response(status: int, body: str, content_type: str = "text/plain; charset=utf-8", extra: dict | None = None) -> Response:
    data = body.encode("utf-8")
    headers = Headers()
    headers["Content-Type"] = content_type
    headers["Content-Length"] = str(len(data))
    headers["Connection"] = "close"
    headers["Cache-Control"] = "no-store"
    for key, value in (extra or {}).items():
        headers[key] = value
    return Response(status, http.HTTPStatus(status).phrase, headers, data)


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
        config,
        on_call: OnCall,
        tokens: BridgeTokens | None = None,
        *,
        insecure: bool = False,
        max_media_bytes: int | None = None,
        end_grace_s: float | None = None,
        send_ahead_s: float | None = None,
    ):
        self.config = config
        self.tokens = tokens or BridgeTokens()
        check_auth_configured(config, self.tokens, insecure)
        self.open = not self.tokens.configured  # insecure dev mode: nothing to check
        self._on_call = on_call
        # Keyword arguments (tests, embedding) override the config.
        self.max_media_bytes = _pick(max_media_bytes, config, "max_media_bytes", DEFAULT_MAX_PAYLOAD_BYTES)
        self.end_grace_s = _pick(end_grace_s, config, "end_grace_s", 5.0)
        self.send_ahead_s = _pick(send_ahead_s, config, "send_ahead_s", 0.04)
        self.transfer_to: str = getattr(config, "transfer_to", "") or ""
        self._agent_actions: OrderedDict[str, str] = OrderedDict()  # CallSid -> "transfer" | "end_call"
        self._server: Server | None = None
        self._slots: set[ServerConnection] = set()  # stream connections admitted at the handshake
        self.calls: set[TelephonyCall] = set()
        self.calls_total = 0
        self.port: int | None = None
        self._stopping = False
        self.draining = False  # drain(): new calls refused, calls in progress go on
        self._calls_changed = asyncio.Event()  # a call ended (drain waits on it)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        self._server = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            process_request=self._process_request,
            max_size=self.config.max_message_bytes,
            open_timeout=self.config.handshake_timeout_s,
            server_header="specvoice",
            logger=ws_log,
        )
        sock = next(iter(self._server.sockets))
        self.port = sock.getsockname()[1]
        log.info("bridge listening on %s:%d (stream %s)", self.config.host, self.port, STREAM_PATH)
        return self.port

    async def stop(self) -> None:
        if self._server is None:
            return
        self._stopping = True
        self._server.close()
        await self._server.wait_closed()
        self._server = None

    async def serve_forever(self) -> None:
        """Serve until cancelled (SIGINT). The server accepts from start(); this only waits.
        Not websockets' own serve_forever: cancelled, it closes every connection itself,
        before stop() has marked the bridge as stopping, and the calls it cut then read as
        hung up by the caller instead of server_shutdown."""
        if self._server is None:
            await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def drain(self, timeout_s: float) -> int:
        """Stop taking calls and let those in progress finish, up to `timeout_s`: the webhook,
        new streams and /health answer 503 (a load balancer takes this process out; Twilio
        tries the webhook's fallback URL). Returns how many calls were still in progress at
        the deadline (stop() then closes them, reports written)."""
        self.draining = True
        log.info("draining: no new calls; waiting up to %.0f s for %d call(s)", timeout_s, self.active_calls)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.active_calls and (left := deadline - loop.time()) > 0:
            self._calls_changed.clear()
            with contextlib.suppress(TimeoutError):
                # Woken when a call ends; the timeout also catches a slot whose connection
                # closed without a call (a failed handshake is only noticed by _admitted()).
                await asyncio.wait_for(self._calls_changed.wait(), min(left, 1.0))
        return self.active_calls

    @property
    def active_calls(self) -> int:
        return len(self._admitted())

    def _admitted(self) -> set[ServerConnection]:
        # A connection admitted at the handshake whose handshake then failed never reaches
        # the handler; drop it here once closed so it does not hold a slot forever.
        self._slots = {c for c in self._slots if c.state is not State.CLOSED}
        return self._slots

    # ------------------------------------------------------------ HTTP side

    def _authorized(self, request, path_with_query: str, params: dict | None = None) -> int:
        """0 when allowed, else the HTTP status to refuse with (401 no credentials, 403 wrong)."""
        if self.open:
            return 0
        headers = request.headers
        signature = headers.get("X-Twilio-Signature")
        authorization = headers.get("Authorization")
        if signature and self.tokens.twilio_auth_token is not None:
            urls = signed_url_candidates(path_with_query, headers.get("Host"), self.config.public_url)
            if validate_twilio_signature(self.tokens.twilio_auth_token, urls, signature, params):
                return 0
        if authorization and self.tokens.bearer_token is not None:
            if validate_bearer(authorization, self.tokens.bearer_token):
                return 0
        return 403 if (signature or authorization) else 401

    def _process_request(self, connection: ServerConnection, request) -> Response | None:
        parts = urlsplit(request.path)
        path = parts.path.rstrip("/") or "/"
        method = getattr(request, "method", "GET")
        peer = _peer(connection)
        if path == HEALTH_PATH and method in ("GET", "HEAD"):
            body = json.dumps({"ok": not self.draining, "draining": self.draining, "calls_active": self.active_calls,
                               "max_calls": self.config.max_calls, "calls_total": self.calls_total})
            return _response(503 if self.draining else 200, body, "application/json")
        if self.draining and path in (VOICE_PATH, STREAM_PATH):
            log.warning("%s refused (503: draining) from %s", path, peer)
            return _response(503, "shutting down, try another server\n", extra={"Retry-After": "5"})
        if path == VOICE_PATH and method in ("GET", "POST"):
            status = self._authorized(request, request.path)
            if status:
                log.warning("voice webhook refused (%d) from %s", status, peer)
                return _response(status, "unauthorized\n" if status == 401 else "forbidden\n")
            host = request.headers.get("Host", "")
            if not self.config.public_url and not _HOST_RE.match(host):
                return _response(400, "bad Host header\n")
            return _response(200, self.twiml(host, dict(parse_qsl(parts.query))), "text/xml; charset=utf-8")
        if path == ACTION_PATH and method in ("GET", "POST"):
            status = self._authorized(request, request.path)
            if status:
                log.warning("stream-ended request refused (%d) from %s", status, peer)
                return _response(status, "unauthorized\n" if status == 401 else "forbidden\n")
            call_sid = dict(parse_qsl(parts.query)).get("CallSid", "")
            return _response(200, self.after_stream_twiml(call_sid), "text/xml; charset=utf-8")
        if path == STREAM_PATH and method == "GET":
            status = self._authorized(request, request.path)
            if status:
                log.warning("stream handshake refused (%d) from %s", status, peer)
                extra = {"WWW-Authenticate": 'Bearer realm="specvoice"'} if status == 401 else None
                return _response(status, "unauthorized\n" if status == 401 else "forbidden\n", extra=extra)
            if len(self._admitted()) >= self.config.max_calls:
                log.warning("stream handshake refused (503: %d calls active) from %s", self.config.max_calls, peer)
                return _response(503, "too many calls\n", extra={"Retry-After": "5"})
            self._slots.add(connection)
            return None  # go on with the WebSocket handshake
        return _response(404, "not found\n")

    def stream_url(self, host: str) -> str:
        return self._public_url(host, STREAM_PATH, websocket=True)

    def action_url(self, host: str) -> str:
        """Where Twilio asks what to do once the stream ended (https, like the webhook)."""
        return self._public_url(host, ACTION_PATH, websocket=False)

    def _public_url(self, host: str, path: str, websocket: bool) -> str:
        """`path` on the public address (config.public_url, else the request's host), with
        the scheme Twilio uses for it: wss/ws for the stream, https/http for webhooks."""
        if not self.config.public_url:
            return f"{'wss' if websocket else 'https'}://{host}{path}"
        base = public_base(self.config.public_url)
        if websocket:
            base = base.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        else:
            base = base.replace("wss://", "https://", 1).replace("ws://", "http://", 1)
        return base + path

    def twiml(self, host: str, params: dict[str, str] | None = None) -> str:
        """<Connect><Stream> TwiML; the caller's number and call id travel as custom parameters.
        With a transfer number, <Connect> names the action URL (asked with GET: see above)."""
        parameters = ""
        for key in ("CallSid", "From", "To"):
            value = (params or {}).get(key)
            if value:
                parameters += f"<Parameter name={quoteattr(key)} value={quoteattr(value[:256])}/>"
        stream = f"<Stream url={quoteattr(self.stream_url(host))}>{parameters}</Stream>" if parameters else \
            f"<Stream url={quoteattr(self.stream_url(host))}/>"
        connect = f"<Connect action={quoteattr(self.action_url(host))} method=\"GET\">" if self.transfer_to \
            else "<Connect>"
        return f'<?xml version="1.0" encoding="UTF-8"?><Response>{connect}{stream}</Connect></Response>'

    def after_stream_twiml(self, call_sid: str) -> str:
        """What the call does once its stream ended: <Dial> the transfer number for a call
        whose agent asked for a transfer, else hang up. (Asked again, the same answer.)"""
        action = self._agent_actions.get(call_sid)
        if action == "transfer" and self.transfer_to:
            log.info("call %s: transferring to the configured number", call_sid[:64])
            verbs = f"<Dial>{escape(self.transfer_to)}</Dial>"
        elif action == "transfer":
            log.warning("call %s asked for a transfer but bridge.transfer_to is empty: hanging up", call_sid[:64])
            verbs = f"<Say>{escape(NO_TRANSFER_LINE)}</Say><Hangup/>"
        else:
            verbs = "<Hangup/>"
        return f'<?xml version="1.0" encoding="UTF-8"?><Response>{verbs}</Response>'

    def _remember_action(self, call: TelephonyCall) -> None:
        if not call.agent_action or not call.start.call_sid:
            return
        self._agent_actions[call.start.call_sid] = call.agent_action
        self._agent_actions.move_to_end(call.start.call_sid)
        while len(self._agent_actions) > KEEP_OUTCOMES:
            self._agent_actions.popitem(last=False)

    # ------------------------------------------------------------ WebSocket side

    async def _handle(self, ws: ServerConnection) -> None:
        peer = _peer(ws)
        try:
            await self._run_connection(ws, peer)
        finally:
            self._slots.discard(ws)
            self._calls_changed.set()

    async def _run_connection(self, ws: ServerConnection, peer: str) -> None:
        call: TelephonyCall | None = None
        task: asyncio.Task | None = None
        ignored_before_start = 0
        try:
            while True:
                try:
                    async with asyncio.timeout(self.config.idle_timeout_s):
                        raw = await ws.recv()
                except TimeoutError:
                    log.warning("call %s: no message for %.1f s, closing", _sid(call, peer), self.config.idle_timeout_s)
                    _ended(call, "idle_timeout")
                    await ws.close(1000, "idle timeout")
                    return
                except ConnectionClosed as exc:
                    if exc.sent is not None and exc.sent.code not in (1000, 1001):
                        # We closed it (e.g. 1009: a message over max_message_bytes): say why.
                        log.warning("call %s: connection closed with %d (%s)", _sid(call, peer), exc.sent.code,
                                    exc.sent.reason or "protocol error")
                        _ended(call, "protocol_error")
                    return
                if isinstance(raw, bytes):
                    log.warning("call %s: binary frame, closing (Twilio sends JSON text)", _sid(call, peer))
                    _ended(call, "protocol_error")
                    await ws.close(1003, "text frames only")
                    return
                try:
                    event = parse_message(raw, self.max_media_bytes)
                except UnknownEvent as exc:
                    log.info("call %s: ignoring %s", _sid(call, peer), exc)
                    continue
                except ProtocolError as exc:
                    code = 1007 if exc.kind in ("json", "base64") else 1008
                    log.warning("call %s: protocol error (%s): %s; closing %d", _sid(call, peer), exc.kind, exc, code)
                    _ended(call, "protocol_error")
                    await ws.close(code, str(exc)[:120])
                    return
                if isinstance(event, Connected):
                    continue
                if call is None:
                    if isinstance(event, Start):
                        call = TelephonyCall(event, ws.send, send_ahead_s=self.send_ahead_s)
                        self.calls.add(call)
                        self.calls_total += 1
                        log.info("call %s started (callSid %s) from %s", event.stream_sid, event.call_sid, peer)
                        task = asyncio.create_task(self._run_call(call, ws), name=f"call-{event.stream_sid}")
                    elif isinstance(event, Stop):
                        log.info("connection %s: stop before start", peer)
                        await ws.close(1000, "stopped")
                        return
                    else:
                        if ignored_before_start == 0:
                            log.warning("connection %s: %s before start, ignored", peer, type(event).__name__.lower())
                        ignored_before_start += 1
                    continue
                if isinstance(event, Start):
                    log.warning("call %s: second start message, closing", call.stream_sid)
                    _ended(call, "protocol_error")
                    await ws.close(1008, "second start")
                    return
                call.deliver(event)
                if isinstance(event, Stop):
                    log.info("call %s: caller stopped the stream", call.stream_sid)
                    return
        finally:
            await self._finish(call, task, ws)

    async def _run_call(self, call: TelephonyCall, ws: ServerConnection) -> None:
        try:
            await self._on_call(call)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("call %s: handler failed", call.stream_sid)
            await ws.close(1011, "internal error")
            return
        # The agent ended the call: let queued audio go out, then close the stream. (The
        # agent's last sentence has played by now: the speaker waited for its mark.) The
        # action is remembered first: Twilio asks for the next TwiML as soon as we close.
        self._remember_action(call)
        await call.output.drain(timeout=30.0)
        await ws.close(1000, "transfer" if call.agent_action == "transfer" else "call ended")

    async def _finish(self, call: TelephonyCall | None, task: asyncio.Task | None, ws: ServerConnection) -> None:
        """Cancel and await everything of the call; the handler gets `end_grace_s` to wrap up
        (write its report) after the inbound stream ended."""
        if call is None:
            return
        if self._stopping:
            _ended(call, "server_shutdown")
        try:
            call.end_inbound()
            if task is not None and not task.done():
                await asyncio.wait({task}, timeout=self.end_grace_s)
        finally:
            if task is not None and not task.done():
                task.cancel()
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
            await call.close()
            self.calls.discard(call)
            with contextlib.suppress(Exception):
                await ws.close(1000, "call ended")
            s = call.stats
            log.info(
                "call %s ended: %d media in, %d frames out, %d late, %d marks echoed",
                call.stream_sid, s.media_received, s.frames_sent, call.output.stats.late_frames, s.marks_echoed,
            )


def _ended(call: TelephonyCall | None, reason: str) -> None:
    if call is not None and call.end_reason is None:
        call.end_reason = reason


def _pick(value, config, name: str, default):
    if value is not None:
        return value
    from_config = getattr(config, name, None)
    return default if from_config is None else from_config


def _peer(connection: ServerConnection) -> str:
    with contextlib.suppress(Exception):
        host, port = connection.remote_address[:2]
        return f"{host}:{port}"
    return "?"


def _sid(call: TelephonyCall | None, peer: str) -> str:
    return call.stream_sid if call is not None else peer
