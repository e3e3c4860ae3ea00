"""Input stage: caller audio through the endpointer and the turn-taker, as typed events.

    async for event in listen(source, endpointer, turns):   # SpeechStarted | TurnEnd | KeyPress
        ...

SpeechStarted passes through at once (barge-in needs it); a TurnEnd comes when the
turn-taker decides the caller's turn is over (pipeline/stages/turn_taking.py). When the
script ends (not a hang-up) an utterance still in progress is closed, so the call answers
it; when the caller hangs up nobody is left to answer a half-said one.

A source may also yield KeyPress (a phone's DTMF keys): they pass through untouched, and
the call's `Keypad` gathers them into one entry ("[keypad] 1") that is answered as a turn
without STT.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from pipeline.events import KeyPress, KeypadEntry, TurnEnd
from pipeline.ports import AudioSource
from pipeline.stages.turn_taking import TurnTaker
from voice.audio import STT_RATE
from voice.endpointer import Endpointer, SpeechEnded, SpeechStarted

__all__ = ["Keypad", "UtteranceTap", "listen"]

END_KEY = "#"  # ends an entry at once, as phone menus have taught callers
MAX_KEYS = 32  # an entry this long ends: a stuck key or a hostile peer cannot grow one forever


class Keypad:
    """Key presses in, KeypadEntry out through `on_entry`: an entry ends at '#', after
    `timeout_s` without a key, or at MAX_KEYS keys. A real timer, not frame times: a peer
    need not send audio for keys to be answered."""

    def __init__(self, on_entry: Callable[[KeypadEntry], None], timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.on_entry, self.timeout_s, self.clock = on_entry, timeout_s, clock
        self._keys: list[KeyPress] = []
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def pending(self) -> bool:
        return bool(self._keys)

    def press(self, key: KeyPress) -> None:
        if self._closed:
            return
        if key.digit == END_KEY:
            if not self._keys:
                self._keys.append(key)  # a lone '#' still says something ("press # to ...")
            self._end(key.t, END_KEY)
            return
        self._keys.append(key)
        if len(self._keys) >= MAX_KEYS:
            self._end(key.t, "max_keys")
            return
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._timed_out)

    def flush(self) -> None:
        """The input ended (not a hang-up): keys still waiting make an entry."""
        if self._keys:
            self._end(self.clock(), "flush")

    def close(self) -> None:
        """No more entries: keys waiting are dropped (nobody is left to answer them)."""
        self._closed = True
        self._cancel_timer()
        self._keys = []

    def _timed_out(self) -> None:
        self._timer = None
        if self._keys:
            self._end(self.clock(), "timeout")

    def _end(self, t: float, ended_by: str) -> None:
        self._cancel_timer()
        keys, self._keys = self._keys, []
        digits = "".join(k.digit for k in keys if k.digit != END_KEY) or END_KEY
        self.on_entry(KeypadEntry(digits, keys[0].t, max(t, keys[-1].t), ended_by))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class UtteranceTap(Protocol):
    """Sees the caller's audio as the endpointer keeps it (pipeline/stages/live_stt.py)."""

    def heard(self, endpointer: Endpointer, t: float) -> None: ...

    def piece_ended(self, ended: SpeechEnded) -> None: ...


async def listen(source: AudioSource, endpointer: Endpointer, turns: TurnTaker,
                 tap: UtteranceTap | None = None) -> AsyncIterator[SpeechStarted | TurnEnd | KeyPress]:
    async for frame in source:
        if isinstance(frame, KeyPress):
            yield frame
            continue
        end_t = frame.t + len(frame.pcm) / STT_RATE
        for event in endpointer.feed(frame.pcm, frame.t):
            if tap is not None and isinstance(event, SpeechEnded):
                tap.piece_ended(event)  # before the turn-taker: a TurnEnd finds the piece whole
            for out in await turns.on_event(event):
                yield out
        if tap is not None:
            tap.heard(endpointer, end_t)
        if (ended := turns.on_time(end_t, endpointer.voice_t)) is not None:
            yield ended
    if source.hangup:
        return
    for event in endpointer.flush():
        if tap is not None and isinstance(event, SpeechEnded):
            tap.piece_ended(event)
        for out in await turns.on_event(event):
            yield out
    if (ended := turns.flush()) is not None:
        yield ended
