"""The ports of a call: what `Call` needs from the world, as typed protocols.

    AudioSource  caller audio: `async for frame in source` -> AudioFrame (16 kHz float32, capture time)
    AudioSink    agent audio out: play / mark / clear (pipeline.playout.Playout is the one implementation;
                 a transport supplies only its FrameWriter)
    SpeechToText a finished utterance (16 kHz mono) -> text
    TextToSpeech a sentence -> AudioChunks (any sample rate)
    LLMBackend   messages -> TokenGroups (llm.backend)
    ToolRunner   a tool call the model wrote -> its outcome (pipeline.receptionist.tools.ToolBox)

Transports (telephony, local audio, in-process) implement the first two; voice/ and llm/
implement the others. Tests swap any of them without touching the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from llm.types import LLMBackend
from voice.tts import AudioChunk

if TYPE_CHECKING:
    from pipeline.receptionist.bookings import BookingStore

__all__ = ["AudioFrame", "AudioSink", "AudioSource", "LLMBackend", "SpeechToText", "TextToSpeech", "ToolRunner"]


@dataclass(frozen=True)
class AudioFrame:
    pcm: np.ndarray  # float32 mono, 16 kHz
    t: float  # time.monotonic() at which its FIRST sample was captured (not when it reached us)


@runtime_checkable
class AudioSource(Protocol):
    """Caller audio. Iterating ends when the caller is gone (`hangup` True: cancel the turn
    in flight) or the script ended (`hangup` False: answer what was said, then end).
    `end_reason` names why a transport ended the call (None: the caller did)."""

    hangup: bool
    end_reason: str | None

    def __aiter__(self) -> AsyncIterator[AudioFrame]: ...


@runtime_checkable
class AudioSink(Protocol):
    """Real-time playback of the agent's audio (pipeline.playout.Playout)."""

    def play(self, chunk: AudioChunk) -> asyncio.Future: ...  # -> time its first frame went out, or None

    def mark(self, name: str) -> asyncio.Future: ...  # -> True once the audio before it played

    async def clear(self) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class SpeechToText(Protocol):
    def transcribe(self, audio: np.ndarray) -> str: ...


@runtime_checkable
class TextToSpeech(Protocol):
    def synthesize(self, text: str) -> Iterator[AudioChunk]: ...


class ToolRunner(Protocol):
    """The call's tools (pipeline.receptionist.tools.ToolBox): run one call, never raise."""

    # The database the tools write to and the call they write for: the turn plan reads the
    # slots from it and checks a move's booking against the call (pipeline/receptionist/plan.py).
    store: BookingStore
    call_id: str

    def run(self, name: str, arguments: str | dict) -> Any: ...  # -> ToolOutcome

    def open_slots(self) -> list[str] | None: ...  # the slots free now (the fact guard's check); None: no store

    # The caller's booked slots (their name, or None -> slots): what the fact guard lets the
    # agent say they have booked. A runner without it leaves those claims unjudged.
    def callers_bookings(self, name: str | None = None) -> list[str]: ...
