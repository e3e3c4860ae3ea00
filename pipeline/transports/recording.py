"""Both sides of a call on one clock, written as a stereo WAV (caller left, agent right).

Each piece of audio is placed where its time says (monotonic seconds, sample-exact at the
recording's rate): the caller's by capture time, the agent's by the time its frame went
out. A piece that would overlap the one before it on its track follows it instead (the
clock's jitter is milliseconds; the audio itself is never cut). The file starts at the
call report's t0, so a turn's timeline time is its place in the recording.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["CallRecording"]

MAX_SECONDS = 2 * 3600  # a call left open for hours still holds and writes a bounded recording


class _Track:
    def __init__(self, limit: int) -> None:
        self.pieces: list[tuple[int, np.ndarray]] = []
        self.end = 0  # first free sample
        self.limit = limit  # samples: nothing is kept past it

    def add(self, at: int, pcm: np.ndarray) -> None:
        if at >= self.limit:
            return
        if 0 < self.end - at <= len(pcm):  # jitter: follow the piece before instead of overlapping it
            at = self.end
        self.pieces.append((at, pcm.copy()))
        self.end = max(self.end, at + len(pcm))


class CallRecording:
    def __init__(self, sample_rate: int, t0: float):
        self.sample_rate = sample_rate
        self.t0 = t0
        self._caller, self._agent = _Track(MAX_SECONDS * sample_rate), _Track(MAX_SECONDS * sample_rate)

    def _at(self, t: float) -> int:
        return max(0, int(round((t - self.t0) * self.sample_rate)))

    def caller(self, pcm16: np.ndarray, t: float) -> None:
        self._caller.add(self._at(t), pcm16)

    def agent(self, pcm16: np.ndarray, t: float) -> None:
        self._agent.add(self._at(t), pcm16)

    def stereo(self, start_t: float | None = None) -> np.ndarray:
        """int16 (n, 2) from `start_t` (default: the recording's t0)."""
        skip = 0 if start_t is None else int(round((start_t - self.t0) * self.sample_rate))
        n = min(max(self._caller.end, self._agent.end), MAX_SECONDS * self.sample_rate)
        out = np.zeros((max(n, 0), 2), np.int16)
        for channel, track in enumerate((self._caller, self._agent)):
            for at, pcm in track.pieces:
                if at >= n:
                    continue
                piece = pcm[: n - at]
                out[at: at + len(piece), channel] = piece
        if skip > 0:
            return out[skip:]
        if skip < 0:
            return np.concatenate([np.zeros((-skip, 2), np.int16), out])
        return out

    def write(self, path: str | Path, start_t: float | None = None) -> Path:
        from voice.wav import write_wav

        return write_wav(path, self.stereo(start_t), self.sample_rate)
