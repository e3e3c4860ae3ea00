"""In-process audio for a call: a source fed by code and a sink that records.

`PushSource` is a live "microphone" fed by code, pacing silence between pushes in real
time (`wav_source` says WAV files through one). `PacedSink()` is the one paced output
(pipeline.playout.Playout) writing into a `Recording`, which can be written as a WAV
file, so tests and the benchmark see exactly what went out when. The telephony transport
lives in pipeline/transports/telephony; the sound-device one in pipeline/transports/local_audio.py.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.playout import FRAME_S, Playout
from pipeline.ports import AudioFrame
from voice.audio import STT_RATE, resample, to_float32

__all__ = ["AudioFrame", "PushSource", "PacedSink", "Recording", "RecordingWriter", "wav_source", "FRAME_S"]


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
        self.end_reason: str | None = None
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


# ---------------------------------------------------------------- in-process output


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


class RecordingWriter:
    """An in-process output: every frame with the time it went out, into a `Recording`."""

    remote_marks = False

    def __init__(self, sample_rate: int = STT_RATE):
        self.sample_rate = sample_rate
        self.recording = Recording(sample_rate)

    async def write_frame(self, pcm: np.ndarray) -> None:
        self.recording.frames.append((time.monotonic(), pcm))

    async def write_mark(self, name: str) -> None:
        return None

    async def write_clear(self) -> None:
        return None


def PacedSink(sample_rate: int = STT_RATE) -> Playout:  # noqa: N802 - reads as the thing it makes
    """Plays audio in real time, 20 ms at a time, into a `Recording` (no device needed):
    `sink.writer.recording` holds each frame with the moment a listener would hear it."""
    return Playout(RecordingWriter(sample_rate))
