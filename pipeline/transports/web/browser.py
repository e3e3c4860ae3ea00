"""A call from the browser page: its WebSocket as a call's source and output.

Wire format (`/call`), chosen for a page with no libraries:

    page -> server  binary   caller audio: int16 little-endian mono PCM at 16 kHz (the page's
                             AudioWorklet sends 20 ms at a time)
                    text     {"type": "played", "mark": name}   the audio before that mark has played
                             {"type": "hangup"}                   the person pressed Hang up
    server -> page  binary   agent audio: int16 LE mono PCM at 16 kHz, paced in real time
                    text     {"type": "ready", "call_id", "sample_rate"}
                             {"type": "mark", "name"}            echo it once played (like Twilio)
                             {"type": "clear"}                   barge-in: drop what is queued
                             {"type": "event", "kind", "t", ...} the call's events (transcripts,
                                                                 sentences, end of turn, barge-in)
                             {"type": "turn", "entry"}           a finished turn's report figures
                             {"type": "ended", "report"}         the call's report page

Marks are echoed by the page's player when the audio before them has played, so the call
knows what the person heard, as on the phone. The server records both sides (caller left,
agent right, on one clock) for the report page.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.playout import Playout
from pipeline.ports import AudioFrame
from pipeline.transports.telephony.media_stream import StreamClosed
from pipeline.transports.recording import CallRecording
from pipeline.transports.web.sockets import AsgiSocket

if TYPE_CHECKING:
    from pipeline.transports.web.server import Bridge

log = logging.getLogger(__name__)

__all__ = ["BrowserCall", "SAMPLE_RATE", "serve_browser"]

SAMPLE_RATE = 16000
MAX_AUDIO_BYTES = SAMPLE_RATE * 2  # one message: at most a second of audio
AHEAD_S = 0.06  # the page's player absorbs this much network and event-loop jitter
_END = object()


class BrowserWriter:
    """The paced output's frames to the page: binary PCM, marks and clear as JSON."""

    sample_rate = SAMPLE_RATE
    remote_marks = True  # the page's player echoes them once played

    def __init__(self, call: "BrowserCall"):
        self.call = call

    async def write_frame(self, pcm: np.ndarray) -> None:
        pcm16 = (np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")
        self.call.recording.agent(pcm16, time.monotonic())
        await self.call.sock.send_bytes(pcm16.tobytes())

    async def write_mark(self, name: str) -> None:
        await self.call.send_json({"type": "mark", "name": name})

    async def write_clear(self) -> None:
        await self.call.send_json({"type": "clear"})


class BrowserSource:
    """The page's microphone as 16 kHz AudioFrames; ends when the person hangs up."""

    hangup = True

    def __init__(self, call: "BrowserCall"):
        self.call = call

    @property
    def end_reason(self) -> str | None:
        return self.call.end_reason

    def __aiter__(self) -> AsyncIterator[AudioFrame]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[AudioFrame]:
        while True:
            item = await self.call.inbound.get()
            if item is _END:
                self.call.inbound.put_nowait(_END)
                return
            yield item


class BrowserCall:
    """One browser call: `source` and `output` for the pipeline's Call, `publish` for its events."""

    def __init__(self, sock: AsgiSocket, call_id: str, send_ahead_s: float = AHEAD_S, inbound_max: int = 3000):
        self.sock = sock
        self.call_id = call_id
        self.t0 = time.monotonic()
        self.end_reason: str | None = None
        self.inbound: asyncio.Queue = asyncio.Queue(maxsize=max(1, inbound_max))
        self.recording = CallRecording(SAMPLE_RATE, self.t0)
        self.source = BrowserSource(self)
        self.output = Playout(BrowserWriter(self), ahead_s=send_ahead_s)
        self.report_url: str | None = None  # set by the handler once the report is written
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._sender = asyncio.create_task(self._send_events(), name=f"{call_id}-events")
        self.frames_in = 0

    # ------------------------------------------------------------ inbound

    def deliver_audio(self, data: bytes) -> None:
        pcm16 = np.frombuffer(data[: len(data) - len(data) % 2], dtype="<i2")
        if not len(pcm16):
            return
        arrived = time.monotonic()
        captured = arrived - len(pcm16) / SAMPLE_RATE
        self.recording.caller(pcm16, captured)
        frame = AudioFrame(pcm16.astype(np.float32) / 32768.0, captured)
        self.frames_in += 1
        try:
            self.inbound.put_nowait(frame)
        except asyncio.QueueFull:  # the pipeline stalled: drop the oldest rather than grow
            with contextlib.suppress(asyncio.QueueEmpty):
                self.inbound.get_nowait()
            self.inbound.put_nowait(frame)

    def end_inbound(self) -> None:
        while True:
            try:
                self.inbound.put_nowait(_END)
                return
            except asyncio.QueueFull:
                self.inbound.get_nowait()

    # ------------------------------------------------------------ to the page

    def publish(self, kind: str, data: dict[str, Any]) -> None:
        """A call event for the page (from any thread); sent in order, never blocking the call."""
        message = {"type": "event", "kind": kind, "t": round(time.monotonic() - self.t0, 4), **data}
        self._loop.call_soon_threadsafe(self._outbox.put_nowait, message)

    def publish_turn(self, entry: dict[str, Any]) -> None:
        keep = ("index", "user_text", "agent_text", "agent_text_heard", "interrupted", "metrics", "finish_reason")
        llm = entry.get("llm") or {}
        message = {"type": "turn", "entry": {**{k: entry.get(k) for k in keep},
                                             "llm": {k: llm.get(k) for k in ("tokens_per_pass", "tokens_per_s",
                                                                             "new_tokens", "passes")}}}
        self._loop.call_soon_threadsafe(self._outbox.put_nowait, message)

    async def send_json(self, message: dict[str, Any]) -> None:
        await self.sock.send(json.dumps(message, default=str, allow_nan=False))

    async def _send_events(self) -> None:
        while (message := await self._outbox.get()) is not None:
            try:
                await self.send_json(message)
            except ValueError:  # NaN or the like in an event: skip it, the page can live without it
                log.debug("call %s: event not sent: %r", self.call_id, message.get("kind"))
            except Exception:
                return  # the page is gone

    async def flush_events(self) -> None:
        self._outbox.put_nowait(None)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._sender), 5.0)
        self._sender.cancel()

    def write_recording(self, path: Path, start_t: float) -> Path | None:
        try:
            return self.recording.write(path, start_t)
        except OSError:
            log.exception("call %s: cannot write the recording", self.call_id)
            return None


async def serve_browser(sock: AsgiSocket, bridge: "Bridge") -> None:
    """One page's call: read its audio and messages until it hangs up or goes away."""
    from pipeline.agent import new_call_id  # the call's id, named as every call's is

    call = BrowserCall(sock, new_call_id())
    await call.send_json({"type": "ready", "call_id": call.call_id, "sample_rate": SAMPLE_RATE})
    log.info("browser call %s started from %s", call.call_id, sock.peer)
    task = asyncio.create_task(bridge.on_browser_call(call), name=f"browser-{call.call_id}")
    try:
        await _receive(call, sock, bridge.settings.idle_timeout_s, task)
    finally:
        if bridge.stopping and call.end_reason is None:
            call.end_reason = "server_shutdown"
        call.end_inbound()
        if not task.done():
            await asyncio.wait({task}, timeout=bridge.settings.end_grace_s)
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await call.output.aclose()
        await call.flush_events()
        if call.report_url:
            with contextlib.suppress(Exception):
                await call.send_json({"type": "ended", "report": call.report_url})
        if call.end_reason == "protocol_error":
            await sock.close(1008, "protocol error")
        await sock.close(1000, "call ended")
        log.info("browser call %s ended: %d audio messages in, %d frames out", call.call_id, call.frames_in,
                 call.output.stats.frames)


async def _receive(call: BrowserCall, sock: AsgiSocket, idle_timeout_s: float, task: asyncio.Task) -> None:
    while not task.done():
        try:
            async with asyncio.timeout(idle_timeout_s):
                raw = await sock.recv()
        except TimeoutError:
            log.warning("browser call %s: nothing from the page for %.1f s, closing", call.call_id, idle_timeout_s)
            call.end_reason = "idle_timeout"
            return
        except StreamClosed as exc:
            if exc.by_server and exc.code not in (1000, 1001):
                call.end_reason = "protocol_error"
            return
        if isinstance(raw, bytes):
            if len(raw) > MAX_AUDIO_BYTES:
                log.warning("browser call %s: audio message of %d bytes, closing", call.call_id, len(raw))
                call.end_reason = "protocol_error"
                return
            call.deliver_audio(raw)
            continue
        try:
            message = json.loads(raw)
        except ValueError:
            continue
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "played" and isinstance(message.get("mark"), str):
            call.output.confirm_mark(message["mark"])
        elif kind == "hangup":
            return
