"""Local audio: the microphone as a call's source, the speakers as its output (`specvoice mic`).

The speaker side is only a FrameWriter: pacing, marks (confirmed by the local clock) and
clear are the one paced output's (pipeline.playout). Frames are written a little ahead of
real time so the sound card's callback never runs dry while the models keep the CPU busy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import numpy as np

from pipeline.playout import Playout
from pipeline.ports import AudioFrame
from voice.devices import Speaker, microphone

__all__ = ["MicSource", "SpeakerWriter", "speaker_sink"]

AHEAD_S = 0.06


class MicSource:
    """Microphone frames; muted (zeros) while `muted()` says so (half-duplex)."""

    hangup = True
    end_reason: str | None = None

    def __init__(self, device: int | str | None = None, muted: Callable[[], bool] | None = None):
        self.device = device
        self.muted = muted or (lambda: False)

    def __aiter__(self) -> AsyncIterator[AudioFrame]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[AudioFrame]:
        async for frame in microphone(device=self.device):
            pcm = np.zeros_like(frame.pcm) if self.muted() else frame.pcm
            yield AudioFrame(pcm, frame.t)


class SpeakerWriter:
    """Frames into voice.devices.Speaker's buffer; clear drops what it still holds."""

    remote_marks = False

    def __init__(self, speaker: Speaker):
        self.speaker = speaker
        self.sample_rate = speaker.sample_rate

    async def write_frame(self, pcm: np.ndarray) -> None:
        self.speaker.play(pcm)

    async def write_mark(self, name: str) -> None:
        return None

    async def write_clear(self) -> None:
        self.speaker.clear()


def speaker_sink(speaker: Speaker) -> Playout:
    return Playout(SpeakerWriter(speaker), ahead_s=AHEAD_S)
