"""Input stage: caller audio through the endpointer, as typed events.

    async for event in listen(source, endpointer):   # SpeechStarted | SpeechEnded
        ...

When the script ends (not a hang-up) an utterance still in progress is closed, so the
call answers it; when the caller hangs up nobody is left to answer a half-said one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pipeline.ports import AudioSource
from voice.endpointer import Endpointer, SpeechEnded, SpeechStarted

__all__ = ["listen"]


async def listen(source: AudioSource, endpointer: Endpointer) -> AsyncIterator[SpeechStarted | SpeechEnded]:
    async for frame in source:
        for event in endpointer.feed(frame.pcm, frame.t):
            yield event
    if source.hangup:
        return
    for event in endpointer.flush():
        yield event
