"""One phone call on the bridge, as the pipeline sees it: `TelephonyCall` (inbound events,
the paced output) and `TwilioWriter` (the output's frames as Twilio `media`, `mark`, `clear`).

The WebSocket loop that makes one (telephony/media_stream.py) and the HTTP server around it
(pipeline/transports/web) are elsewhere: this is only the call's two directions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import numpy as np
from websockets.exceptions import ConnectionClosed

from pipeline.playout import Playout
from pipeline.transports.recording import CallRecording
from pipeline.transports.telephony.protocol import (
    SAMPLE_RATE,
    InboundEvent,
    Mark,
    Media,
    Start,
    serialize_clear,
    serialize_mark,
    serialize_media,
)
from voice import mulaw
from voice.audio import to_int16

__all__ = ["CallStats", "TelephonyCall", "TwilioWriter"]


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
        pcm16 = to_int16(pcm)
        if self.call.recording is not None:
            self.call.recording.agent(pcm16, time.monotonic())
        await self.call.send_media_now(mulaw.encode_bytes(pcm16))

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
        record: bool = False,
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
        # Both sides on one clock, when the server records phone calls ([report] record = "all").
        self.recording: CallRecording | None = CallRecording(SAMPLE_RATE, time.monotonic()) if record else None

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
            if self.recording is not None and event.payload:
                pcm16 = mulaw.decode(event.payload)
                self.recording.caller(pcm16, time.monotonic() - len(pcm16) / SAMPLE_RATE)
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
