"""Input stage: caller audio through the endpointer and the turn-taker, as typed events.

    async for event in listen(source, endpointer, turns):   # SpeechStarted | TurnEnd
        ...

SpeechStarted passes through at once (barge-in needs it); a TurnEnd comes when the
turn-taker decides the caller's turn is over (pipeline/stages/turn_taking.py). When the
script ends (not a hang-up) an utterance still in progress is closed, so the call answers
it; when the caller hangs up nobody is left to answer a half-said one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pipeline.ports import AudioSource
from pipeline.stages.turn_taking import TurnEnd, TurnTaker
from voice.audio import STT_RATE
from voice.endpointer import Endpointer, SpeechStarted

__all__ = ["listen"]


async def listen(source: AudioSource, endpointer: Endpointer, turns: TurnTaker) -> AsyncIterator[SpeechStarted | TurnEnd]:
    async for frame in source:
        for event in endpointer.feed(frame.pcm, frame.t):
            for out in await turns.on_event(event):
                yield out
        if (ended := turns.on_time(frame.t + len(frame.pcm) / STT_RATE)) is not None:
            yield ended
    if source.hangup:
        return
    for event in endpointer.flush():
        for out in await turns.on_event(event):
            yield out
    if (ended := turns.flush()) is not None:
        yield ended
