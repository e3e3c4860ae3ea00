"""The far end of a Media Stream, as Twilio plays it: what a simulated caller or a load
test sends and receives, without naming the protocol's messages outside this package.

    far = FarEnd(ws, stream_sid, call_sid)
    await far.open(custom_parameters)          # connected + start
    await far.send_audio(frame, k)             # one 20 ms mu-law media message
    msg = far.read(raw)                        # AgentMessage: "audio" (payload) | "mark" (name) | "clear"
    await far.echo_mark(name)                  # the audio before that mark has played
    await far.stop()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pipeline.transports.telephony.protocol import (
    Clear,
    Connected,
    Mark,
    Media,
    OutboundMark,
    OutboundMedia,
    Start,
    Stop,
    encode_event,
    parse_outbound,
)

__all__ = ["AgentMessage", "FarEnd"]


@dataclass(frozen=True)
class AgentMessage:
    """What the agent's side sent: audio to play, a mark to echo once played, or a clear."""

    kind: Literal["audio", "mark", "clear"]
    stream_sid: str
    payload: bytes = b""  # mu-law 8 kHz, for "audio"
    name: str = ""  # for "mark"


class FarEnd:
    """One phone call's far end over a WebSocket (anything with `send(text)`)."""

    def __init__(self, ws: Any, stream_sid: str, call_sid: str, account_sid: str = "AC" + "0" * 32):
        self.ws, self.stream_sid, self.call_sid, self.account_sid = ws, stream_sid, call_sid, account_sid

    async def open(self, custom_parameters: dict[str, str] | None = None) -> None:
        await self.ws.send(encode_event(Connected()))
        await self.ws.send(encode_event(Start(self.stream_sid, self.call_sid, self.account_sid,
                                              custom_parameters=dict(custom_parameters or {}))))

    async def send_audio(self, frame: bytes, k: int) -> None:
        """The k-th (0-based) 20 ms frame of caller audio."""
        await self.ws.send(encode_event(Media(self.stream_sid, frame, chunk=k + 1, timestamp=int(k * 20),
                                              sequence_number=k + 3)))

    async def echo_mark(self, name: str) -> None:
        await self.ws.send(encode_event(Mark(self.stream_sid, name)))

    async def stop(self) -> None:
        await self.ws.send(encode_event(Stop(self.stream_sid, self.call_sid)))

    @staticmethod
    def read(raw: str | bytes) -> AgentMessage:
        """Parse one message from the agent's side (raises ProtocolError when malformed)."""
        msg = parse_outbound(raw)
        if isinstance(msg, OutboundMedia):
            return AgentMessage("audio", msg.stream_sid, payload=msg.payload)
        if isinstance(msg, OutboundMark):
            return AgentMessage("mark", msg.stream_sid, name=msg.name)
        assert isinstance(msg, Clear)
        return AgentMessage("clear", msg.stream_sid)
