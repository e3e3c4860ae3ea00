"""The Media Streams WebSocket, one connection: messages in, one TelephonyCall, its end.

    await serve_stream(socket, settings, on_call, host)

`socket` is any `StreamSocket` (the web server wraps its ASGI WebSocket in one), so this
loop knows the Twilio protocol and nothing of HTTP servers. For every call it awaits
`on_call(call: TelephonyCall)`. A failing call never takes the server down; when the caller
goes away the call's tasks are cancelled and awaited, the handler getting `end_grace_s` to
write its report first.

Close codes: 1003 binary frame (Twilio sends JSON text), 1007 bad JSON or base64, 1008 any
other protocol error (a second start, a wrong media format), 1011 the handler failed, 1000
the call ended or the line went idle (`idle_timeout_s` without a message).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from pipeline.transports.telephony.call import TelephonyCall
from pipeline.transports.telephony.protocol import (
    Connected,
    ProtocolError,
    Start,
    Stop,
    UnknownEvent,
    parse_message,
)

log = logging.getLogger("pipeline.transports.telephony.server")  # the name operators grep for

__all__ = ["OnCall", "StreamClosed", "StreamHost", "StreamSettings", "StreamSocket", "serve_stream"]

OnCall = Callable[[TelephonyCall], Awaitable[None]]


class StreamClosed(Exception):
    """The connection is closed. `by_server`: the server side closed it (with `code`), for a
    reason of its own (a message over the size limit); False: the caller went away."""

    def __init__(self, code: int | None, by_server: bool, reason: str = ""):
        super().__init__(f"closed {code} ({reason})" if reason else f"closed {code}")
        self.code, self.by_server, self.reason = code, by_server, reason


class StreamSocket(Protocol):
    peer: str

    async def recv(self) -> str | bytes: ...  # raises StreamClosed

    async def send(self, text: str) -> None: ...  # raises websockets' ConnectionClosed once gone

    async def close(self, code: int, reason: str) -> None: ...


class StreamHost(Protocol):
    """What the server keeps of its calls: the live ones, whether it is stopping, and what a
    finished call's agent asked for (Twilio asks for it at the stream-ended action)."""

    stopping: bool

    def call_started(self, call: TelephonyCall) -> None: ...

    def call_ended(self, call: TelephonyCall) -> None: ...

    def remember_action(self, call: TelephonyCall) -> None: ...


@dataclass(frozen=True)
class StreamSettings:
    max_media_bytes: int
    idle_timeout_s: float
    send_ahead_s: float
    end_grace_s: float
    record: bool = False  # keep both sides of each call (TelephonyCall.recording)


async def serve_stream(sock: StreamSocket, settings: StreamSettings, on_call: OnCall, host: StreamHost) -> None:
    state = _State()
    try:
        await _receive(sock, settings, on_call, host, state)
    finally:  # whatever ended the loop (cancellation too), the call it started is wound up
        await _finish(sock, settings, host, state.call, state.task)


@dataclass
class _State:
    call: TelephonyCall | None = None
    task: asyncio.Task | None = None


async def _receive(sock: StreamSocket, settings: StreamSettings, on_call: OnCall, host: StreamHost,
                   state: _State) -> None:
    """Read messages until the call ends (the caller stops or goes away, or we close)."""
    ignored_before_start = 0
    peer = sock.peer

    async def close(reason: str | None, code: int, why: str) -> None:
        _ended(state.call, reason)
        await sock.close(code, why)

    while True:
        call = state.call
        try:
            async with asyncio.timeout(settings.idle_timeout_s):
                raw = await sock.recv()
        except TimeoutError:
            log.warning("call %s: no message for %.1f s, closing", _sid(call, peer), settings.idle_timeout_s)
            return await close("idle_timeout", 1000, "idle timeout")
        except StreamClosed as exc:
            if exc.by_server and exc.code not in (1000, 1001):
                # The server closed it (1009: a message over max_message_bytes): say why.
                log.warning("call %s: connection closed with %d (%s)", _sid(call, peer), exc.code,
                            exc.reason or "protocol error")
                _ended(call, "protocol_error")
            return
        if isinstance(raw, bytes):
            log.warning("call %s: binary frame, closing (Twilio sends JSON text)", _sid(call, peer))
            return await close("protocol_error", 1003, "text frames only")
        try:
            event = parse_message(raw, settings.max_media_bytes)
        except UnknownEvent as exc:
            log.info("call %s: ignoring %s", _sid(call, peer), exc)
            continue
        except ProtocolError as exc:
            code = 1007 if exc.kind in ("json", "base64") else 1008
            log.warning("call %s: protocol error (%s): %s; closing %d", _sid(call, peer), exc.kind, exc, code)
            return await close("protocol_error", code, str(exc)[:120])
        if isinstance(event, Connected):
            continue
        if call is None:
            if isinstance(event, Start):
                call = state.call = TelephonyCall(event, sock.send, send_ahead_s=settings.send_ahead_s,
                                                  record=settings.record)
                host.call_started(call)
                log.info("call %s started (callSid %s) from %s", event.stream_sid, event.call_sid, peer)
                state.task = asyncio.create_task(_run_call(call, sock, on_call, host),
                                                 name=f"call-{event.stream_sid}")
            elif isinstance(event, Stop):
                log.info("connection %s: stop before start", peer)
                return await close(None, 1000, "stopped")
            else:
                if ignored_before_start == 0:
                    log.warning("connection %s: %s before start, ignored", peer, type(event).__name__.lower())
                ignored_before_start += 1
            continue
        if isinstance(event, Start):
            log.warning("call %s: second start message, closing", call.stream_sid)
            return await close("protocol_error", 1008, "second start")
        call.deliver(event)
        if isinstance(event, Stop):
            log.info("call %s: caller stopped the stream", call.stream_sid)
            return


async def _run_call(call: TelephonyCall, sock: StreamSocket, on_call: OnCall, host: StreamHost) -> None:
    try:
        await on_call(call)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("call %s: handler failed", call.stream_sid)
        await sock.close(1011, "internal error")
        return
    # The agent ended the call: let queued audio go out, then close the stream. (The agent's
    # last sentence has played by now: the speaker waited for its mark.) The action is
    # remembered first: Twilio asks for the next TwiML as soon as we close.
    host.remember_action(call)
    await call.output.drain(timeout=30.0)
    await sock.close(1000, "transfer" if call.agent_action == "transfer" else "call ended")


async def _finish(sock: StreamSocket, settings: StreamSettings, host: StreamHost, call: TelephonyCall | None,
                  task: asyncio.Task | None) -> None:
    """Cancel and await everything of the call; the handler gets `end_grace_s` to wrap up
    (write its report) after the inbound stream ended."""
    if call is None:
        return
    if host.stopping:
        _ended(call, "server_shutdown")
    try:
        call.end_inbound()
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=settings.end_grace_s)
    finally:
        if task is not None and not task.done():
            task.cancel()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        await call.close()
        host.call_ended(call)
        with contextlib.suppress(Exception):
            await sock.close(1000, "call ended")
        s = call.stats
        log.info(
            "call %s ended: %d media in, %d frames out, %d late, %d marks echoed",
            call.stream_sid, s.media_received, s.frames_sent, call.output.stats.late_frames, s.marks_echoed,
        )


def _ended(call: TelephonyCall | None, reason: str | None) -> None:
    if call is not None and reason is not None and call.end_reason is None:
        call.end_reason = reason


def _sid(call: TelephonyCall | None, peer: str) -> str:
    return call.stream_sid if call is not None else peer
