"""One paced output for every transport: real-time pacing, marks, clear, and the moment
each piece of audio went out.

    sink = Playout(writer)                   # writer: a phone socket, a sound card, a recording
    went_out = sink.play(chunk)              # queued; resolves with the time its first frame went out
    heard = sink.mark("s1")                  # resolves True once the audio before it has played
    await sink.clear()                       # barge-in: drop what is queued, tell the far end too

A transport supplies only a `FrameWriter`: how to write one frame, a mark and a clear.
Everything about time lives here, once: frames of 20 ms go out on an absolute clock (each
when the one before it has played, optionally `ahead_s` early so a network peer's buffer
absorbs event-loop jitter), so sleep overshoot shorter than `ahead_s` never accumulates
into drift. A frame written later than its due time has left the listener with a gap
(nothing was queued ahead to fill it), so the clock restarts from it: with `ahead_s = 0`
(a local recording) every late wake-up shifts what follows, as it would for a listener.

Marks are how the call learns what the caller actually heard. A writer whose far end
echoes marks (Twilio) gets each mark written in order and the far end's echo confirms it
(`confirm_mark`); otherwise a mark is confirmed by the local clock once the audio before it
has played. `clear()` resolves every mark not yet confirmed as False, including those
already sent: a later echo of a cleared mark changes nothing, so "heard" never includes a
sentence the caller talked over.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from voice.audio import resample, to_float32
from voice.tts import AudioChunk

log = logging.getLogger(__name__)

__all__ = ["FRAME_S", "FrameWriter", "Playout", "PlayoutStats", "wait_confirmed"]

FRAME_S = 0.020  # 20 ms: a phone packet, and a fine grain for pacing
LATE_GAP_S = 0.040  # a frame that was ready but went out this long after the previous one is late


class FrameWriter(Protocol):
    """Where paced audio goes. `write_frame` gets float32 mono at `sample_rate`, one 20 ms
    frame (the last of a stretch may be shorter)."""

    sample_rate: int
    remote_marks: bool  # True: the far end echoes marks (Playout.confirm_mark); False: the local clock confirms them

    async def write_frame(self, pcm: np.ndarray) -> None: ...

    async def write_mark(self, name: str) -> None: ...

    async def write_clear(self) -> None: ...


@dataclass
class PlayoutStats:
    frames: int = 0
    samples: int = 0
    late_frames: int = 0  # ready but written > LATE_GAP_S after the previous frame
    max_gap_s: float = 0.0
    marks_sent: int = 0
    marks_confirmed: int = 0
    clears: list[float] = field(default_factory=list)  # monotonic times of each clear()


@dataclass
class _Audio:
    pcm: np.ndarray
    went_out: asyncio.Future  # -> monotonic time of its first frame, or None if dropped
    queued_at: float


@dataclass
class _Mark:
    name: str
    confirmed: asyncio.Future  # -> True once played, False if cleared or closed


async def wait_confirmed(future: asyncio.Future, timeout: float | None) -> bool:
    """A mark's outcome within `timeout` (False when it did not come back in time)."""
    try:
        return bool(await asyncio.wait_for(asyncio.shield(future), timeout))
    except TimeoutError:
        return False


class Playout:
    """The audio sink of a call: queue, pace, mark, clear. See the module docstring."""

    def __init__(self, writer: FrameWriter, ahead_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.writer = writer
        self.sample_rate = writer.sample_rate
        self.frame = int(round(writer.sample_rate * FRAME_S))
        self.ahead_s = max(0.0, ahead_s)
        self.clock = clock
        self.stats = PlayoutStats()
        self.closed = False
        self._queue: collections.deque[_Audio | _Mark] = collections.deque()
        self._sent_marks: collections.deque[_Mark] = collections.deque()  # awaiting the far end's echo
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._generation = 0  # bumped by clear(): a frame picked before it must not go out
        self._play_end = 0.0  # when everything written so far will have played
        self._last_write = 0.0
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------ the sink

    def play(self, chunk: AudioChunk) -> asyncio.Future:
        """Queue `chunk` (any sample rate); returns a future of the monotonic time its first
        frame went out (None if it was cleared or the output closed first)."""
        went_out = asyncio.get_running_loop().create_future()
        pcm = to_float32(np.asarray(chunk.pcm)).reshape(-1)
        if self.closed or not len(pcm):
            went_out.set_result(None)
            return went_out
        if chunk.sample_rate != self.sample_rate:
            pcm = resample(pcm, chunk.sample_rate, self.sample_rate)
        self._queue.append(_Audio(pcm, went_out, self.clock()))
        self._kick()
        return went_out

    def mark(self, name: str) -> asyncio.Future:
        """A marker after the audio queued so far; its future is True once that audio has
        played (echoed by the far end, or by the local clock), False if cleared first."""
        confirmed = asyncio.get_running_loop().create_future()
        if self.closed:
            confirmed.set_result(False)
            return confirmed
        self._queue.append(_Mark(name, confirmed))
        self._kick()
        return confirmed

    def confirm_mark(self, name: str) -> None:
        """The far end says the audio before mark `name` has played."""
        for i, mark in enumerate(self._sent_marks):
            if mark.name == name:
                del self._sent_marks[i]
                if not mark.confirmed.done():
                    mark.confirmed.set_result(True)
                    self.stats.marks_confirmed += 1
                return

    async def clear(self) -> None:
        """Barge-in: drop everything queued, forget marks not yet confirmed, and tell the
        writer (Twilio drops its own buffer)."""
        self._generation += 1
        self.stats.clears.append(self.clock())
        self._drop()
        self._play_end = 0.0
        self._last_write = 0.0
        if not self.closed:
            try:
                await self.writer.write_clear()
            except Exception as exc:  # noqa: BLE001 - a gone peer: nothing to clear
                log.debug("clear not written: %r", exc)

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything queued has been written (not played: see marks)."""
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def aclose(self) -> None:
        self.closed = True
        self._drop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    @property
    def queued_s(self) -> float:
        """Audio queued here, not yet written."""
        return sum(len(x.pcm) for x in self._queue if isinstance(x, _Audio)) / self.sample_rate

    @property
    def busy(self) -> bool:
        """Audio queued or still playing."""
        return bool(self._queue) or self._play_end > self.clock()

    # ------------------------------------------------------------ internals

    def _drop(self) -> None:
        for item in self._queue:
            future = item.went_out if isinstance(item, _Audio) else item.confirmed
            if not future.done():
                future.set_result(None if isinstance(item, _Audio) else False)
        self._queue.clear()
        while self._sent_marks:
            mark = self._sent_marks.popleft()
            if not mark.confirmed.done():
                mark.confirmed.set_result(False)
        self._drained.set()

    def _kick(self) -> None:
        self._drained.clear()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="playout")
        self._wake.set()

    def _take_frame(self) -> tuple[np.ndarray, list[asyncio.Future], float]:
        """Up to one frame from the head of the queue, across chunks; the futures of the
        chunks that start in it; when the oldest of its audio was queued."""
        out, starting = [], []
        n = 0
        queued_at = self._queue[0].queued_at
        while self._queue and n < self.frame and isinstance(self._queue[0], _Audio):
            head = self._queue[0]
            if not head.went_out.done():
                starting.append(head.went_out)
            take = min(len(head.pcm), self.frame - n)
            out.append(head.pcm[:take])
            n += take
            if take == len(head.pcm):
                self._queue.popleft()
            else:
                self._queue[0] = _Audio(head.pcm[take:], head.went_out, head.queued_at)
        return np.concatenate(out), starting, queued_at

    async def _run(self) -> None:
        try:
            await self._pace()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the peer went away: nothing more can go out
            log.debug("playout stopped: %r", exc)
            self.closed = True
            self._drop()

    async def _pace(self) -> None:
        while True:
            if not self._queue:
                self._drained.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self.clock()
            if self._play_end < now:
                self._play_end = now  # first audio, or the output ran dry: restart the clock
            head = self._queue[0]
            generation = self._generation
            if isinstance(head, _Mark):
                if self.writer.remote_marks:
                    self._queue.popleft()
                    self._sent_marks.append(head)
                    await self.writer.write_mark(head.name)
                    self.stats.marks_sent += 1
                    continue
                # Confirmed by the local clock once everything before it has played.
                if self._play_end > now:
                    await asyncio.sleep(self._play_end - now)
                    if generation != self._generation:
                        continue
                if self._queue and self._queue[0] is head:
                    self._queue.popleft()
                    if not head.confirmed.done():
                        head.confirmed.set_result(True)
                        self.stats.marks_confirmed += 1
                continue
            deadline = self._play_end - self.ahead_s
            if deadline > now:
                await asyncio.sleep(deadline - now)
                if generation != self._generation or not self._queue or isinstance(self._queue[0], _Mark):
                    continue
            frame, starting, queued_at = self._take_frame()
            written = self.clock()  # the frame goes out now (stamped before the write returns)
            await self.writer.write_frame(frame)
            for went_out in starting:
                if not went_out.done():
                    went_out.set_result(written)
            if self._last_write:
                gap = written - self._last_write
                # Only count gaps we caused: the frame was waiting while the gap grew.
                if gap > LATE_GAP_S and queued_at < self._last_write + LATE_GAP_S:
                    self.stats.late_frames += 1
                    self.stats.max_gap_s = max(self.stats.max_gap_s, gap)
            self._last_write = written
            self._play_end = max(self._play_end, written - self.ahead_s) + len(frame) / self.sample_rate
            self.stats.frames += 1
            self.stats.samples += len(frame)
