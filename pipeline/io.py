"""Audio in and audio out of a call: two small interfaces and their in-process implementations.

    AudioSource: `async for frame in source` -> AudioFrame(pcm float32 16 kHz, t)
    AudioSink:   play(chunk), mark(name), wait_mark(name), clear(), on_audio_out

`AudioFrame.t` is the time.monotonic() at which the frame's FIRST sample was captured
(not when it reached us): the endpointer and every latency metric work on that clock.

A sink owns real-time playback. `play` queues audio and returns at once; `mark(name)`
queues a marker after it, and `wait_mark(name)` resolves True once everything before
the marker has *played* (False if it was cleared first): this is how the call learns
what the caller has actually heard, the same way Twilio's mark echo works. `clear()` drops
everything queued (barge-in). `on_audio_out(t)` is called as audio frames actually go out.

Implementations here need no device: `PushSource` (a live "microphone" fed by code,
pacing silence between pushes in real time; `wav_source` says WAV files through one) and
`PacedSink` (plays in real time into a `Recording`, which can be written as a WAV file, so
tests and the benchmark see exactly what went out when). The telephony ones live in
`pipeline.telephony`; the sound-device ones in demo/commands/mic.py (`specvoice mic`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from voice.audio import STT_RATE, resample, to_float32
from voice.tts import AudioChunk

__all__ = ["AudioFrame", "AudioSource", "AudioSink", "PushSource", "PacedSink", "Recording", "wav_source", "FRAME_S"]

FRAME_S = 0.020  # 20 ms: a phone packet, and a fine grain for pacing


@dataclass(frozen=True)
class AudioFrame:
    pcm: np.ndarray  # float32 mono, 16 kHz
    t: float  # time.monotonic() of the first sample's capture


@runtime_checkable
class AudioSource(Protocol):
    """Caller audio. Iterating ends when the caller is gone; `hangup` says how it ended."""

    hangup: bool  # True: the caller went away (cancel the turn in flight); False: end of script

    def __aiter__(self) -> AsyncIterator[AudioFrame]: ...


@runtime_checkable
class AudioSink(Protocol):
    on_audio_out: Callable[[float], None] | None

    async def play(self, chunk: AudioChunk) -> None: ...

    async def mark(self, name: str) -> None: ...

    async def wait_mark(self, name: str, timeout: float | None = None) -> bool: ...

    async def clear(self) -> None: ...

    async def aclose(self) -> None: ...


async def wait_for_mark(future: asyncio.Future | None, timeout: float | None) -> bool:
    """True once the audio before a mark has played; False if the mark is unknown,
    was dropped by a clear, or did not come back within `timeout`."""
    if future is None:
        return False
    try:
        return bool(await asyncio.wait_for(asyncio.shield(future), timeout))
    except TimeoutError:
        return False


# ---------------------------------------------------------------- PushSource


class PushSource:
    """A real-time source fed by code: silence, except for the audio `push`ed into it.

    Emits 20 ms frames on an absolute schedule (t0 + k * 20 ms) like a sound card would,
    stamping each with its capture time even when the loop wakes late. `push(pcm)` queues
    16 kHz audio to be "spoken" from the next frame on; `close()` ends the stream after
    what was pushed has gone out (plus `tail_s` of silence, so the endpointer can close
    the last utterance).
    """

    def __init__(self, sample_rate: int = STT_RATE, tail_s: float = 1.0, realtime: bool = True):
        self.sample_rate = sample_rate
        self.frame = int(sample_rate * FRAME_S)
        self.tail_s = tail_s
        self.realtime = realtime
        self.hangup = False
        self._queue: collections.deque[np.ndarray] = collections.deque()
        self._closing = False
        self._spoken: list[tuple[float, float]] = []  # (start, end) of pushed audio, monotonic
        self.t0: float | None = None

    def push(self, pcm: np.ndarray, sample_rate: int | None = None) -> None:
        pcm = to_float32(np.asarray(pcm)).reshape(-1)
        if sample_rate and sample_rate != self.sample_rate:
            pcm = resample(pcm, sample_rate, self.sample_rate)
        self._queue.append(pcm)

    @property
    def speaking(self) -> bool:
        return bool(self._queue)

    def close(self, hangup: bool = False) -> None:
        self._closing = True
        self.hangup = hangup

    def __aiter__(self) -> AsyncIterator[AudioFrame]:
        return self._frames()

    def _next_frame(self) -> np.ndarray:
        out = np.zeros(self.frame, dtype=np.float32)
        filled = 0
        while self._queue and filled < self.frame:
            head = self._queue[0]
            n = min(len(head), self.frame - filled)
            out[filled:filled + n] = head[:n]
            filled += n
            if n == len(head):
                self._queue.popleft()
            else:
                self._queue[0] = head[n:]
        return out

    async def _frames(self) -> AsyncIterator[AudioFrame]:
        self.t0 = t0 = time.monotonic()
        k = 0
        tail_left = None
        while True:
            if self._closing:
                if self.hangup:
                    return
                if not self._queue:
                    tail_left = self.tail_s if tail_left is None else tail_left
                    if tail_left <= 0:
                        return
                    tail_left -= FRAME_S
            capture_t = t0 + k * FRAME_S
            if self.realtime:
                # A frame exists once its last sample has been captured.
                delay = capture_t + FRAME_S - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
            yield AudioFrame(self._next_frame(), capture_t)
            k += 1


def wav_source(paths: list[str | Path], gap_s: float = 3.0, lead_s: float = 0.5) -> PushSource:
    """A real-time source that says WAV files one after another, `gap_s` of silence apart,
    then ends (not a hang-up: the call answers the last line before it ends). For a call
    that waits for each answer before the next line, push into a PushSource instead."""
    from voice.wav import read_wav

    source = PushSource()
    source.push(np.zeros(int(lead_s * source.sample_rate), np.float32))
    for i, path in enumerate(paths):
        pcm, _ = read_wav(path, sample_rate=source.sample_rate)
        source.push(pcm)
        if i + 1 < len(paths):
            source.push(np.zeros(int(gap_s * source.sample_rate), np.float32))
    source.close()
    return source


# ---------------------------------------------------------------- PacedSink


@dataclass
class _Mark:
    name: str
    future: asyncio.Future


@dataclass
class Recording:
    """What a PacedSink played: (monotonic start time, 20 ms frame) pairs."""

    sample_rate: int
    frames: list[tuple[float, np.ndarray]] = field(default_factory=list)

    def times(self) -> list[float]:
        return [t for t, _ in self.frames]

    def audio(self, start: float | None = None, end: float | None = None) -> np.ndarray:
        """The frames played in [start, end), concatenated (gaps not filled)."""
        picked = [f for t, f in self.frames if (start is None or t >= start) and (end is None or t < end)]
        return np.concatenate(picked) if picked else np.zeros(0, np.float32)

    def timeline(self, t0: float, end: float | None = None) -> np.ndarray:
        """The output as it sounded from `t0` on, silences included."""
        end = end if end is not None else (self.frames[-1][0] + FRAME_S if self.frames else t0)
        out = np.zeros(max(0, int(round((end - t0) * self.sample_rate))), np.float32)
        for t, f in self.frames:
            i = int(round((t - t0) * self.sample_rate))
            if 0 <= i < len(out):
                n = min(len(f), len(out) - i)
                out[i:i + n] = f[:n]
        return out

    def write(self, path: str | Path, t0: float) -> Path:
        from voice.wav import write_wav

        return write_wav(path, self.timeline(t0), self.sample_rate)


class PacedSink:
    """Plays audio in real time, 20 ms at a time, into a `Recording` (no device needed).

    Pacing is on an absolute clock (each frame starts when the previous one has
    played), so the recording's timestamps are the moments a listener would hear them.
    """

    def __init__(self, sample_rate: int = STT_RATE, on_audio_out: Callable[[float], None] | None = None):
        self.sample_rate = sample_rate
        self.frame = int(sample_rate * FRAME_S)
        self.on_audio_out = on_audio_out
        self.recording = Recording(sample_rate)
        self.clears: list[float] = []
        self._queue: collections.deque[np.ndarray | _Mark] = collections.deque()
        self._marks: dict[str, asyncio.Future] = {}
        self._wake = asyncio.Event()
        self._generation = 0
        self._play_end = 0.0
        self._task: asyncio.Task | None = None
        self._closed = False

    # -- the AudioSink side --------------------------------------------------------------

    async def play(self, chunk: AudioChunk) -> None:
        if self._closed:
            return
        pcm = to_float32(chunk.pcm).reshape(-1)
        if chunk.sample_rate != self.sample_rate:
            pcm = resample(pcm, chunk.sample_rate, self.sample_rate)
        self._queue.append(pcm)
        self._kick()

    async def mark(self, name: str) -> None:
        future = asyncio.get_running_loop().create_future()
        self._marks[name] = future
        if self._closed:
            future.set_result(False)
            return
        self._queue.append(_Mark(name, future))
        self._kick()

    async def wait_mark(self, name: str, timeout: float | None = None) -> bool:
        return await wait_for_mark(self._marks.get(name), timeout)

    async def clear(self) -> None:
        self._generation += 1
        self.clears.append(time.monotonic())
        self._drop_queue()
        self._play_end = 0.0

    async def aclose(self) -> None:
        self._closed = True
        self._drop_queue()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    @property
    def queued_s(self) -> float:
        return sum(len(x) for x in self._queue if isinstance(x, np.ndarray)) / self.sample_rate

    @property
    def busy(self) -> bool:
        """Audio queued or still playing."""
        return bool(self._queue) or self._play_end > time.monotonic()

    # -- internals -----------------------------------------------------------------------

    def _drop_queue(self) -> None:
        for item in self._queue:
            if isinstance(item, _Mark) and not item.future.done():
                item.future.set_result(False)
        self._queue.clear()

    def _kick(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._player(), name="paced-sink")
        self._wake.set()

    def _take_frame(self) -> np.ndarray:
        out = []
        n = 0
        while self._queue and n < self.frame and isinstance(self._queue[0], np.ndarray):
            head = self._queue[0]
            take = min(len(head), self.frame - n)
            out.append(head[:take])
            n += take
            if take == len(head):
                self._queue.popleft()
            else:
                self._queue[0] = head[take:]
        return np.concatenate(out)

    async def _player(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = time.monotonic()
            if self._play_end < now:
                self._play_end = now  # first audio, or we ran dry: restart the clock
            head = self._queue[0]
            generation = self._generation
            if isinstance(head, _Mark):
                # Echo once everything before it has finished playing.
                if self._play_end > now:
                    await asyncio.sleep(self._play_end - now)
                    if generation != self._generation:
                        continue
                if self._queue and self._queue[0] is head:
                    self._queue.popleft()
                    if not head.future.done():
                        head.future.set_result(True)
                continue
            # A frame starts playing when the previous one has finished.
            if self._play_end > now:
                await asyncio.sleep(self._play_end - now)
                if generation != self._generation or not self._queue or isinstance(self._queue[0], _Mark):
                    continue
            frame = self._take_frame()
            t = time.monotonic()
            self.recording.frames.append((t, frame))
            self._play_end = max(self._play_end, t) + len(frame) / self.sample_rate
            if self.on_audio_out is not None:
                self.on_audio_out(t)
