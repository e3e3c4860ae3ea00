"""Streaming endpointing: when did the caller start talking, and when have they finished?

An `Endpointer` is fed audio frames with the time each frame began
(`feed(frame, t) -> list of events`). It never reads a clock, so callers (a live
microphone, a phone bridge, a test, a benchmark faster than real time) own time.

States: IDLE -> (min_speech_ms of voiced audio) -> SPEECH -> (min_silence_ms of
unvoiced audio, or max_utterance_s) -> IDLE.

Timestamps: all `t` values are in the caller's clock (e.g. time.monotonic()).
- `SpeechStarted.start_t`: first sample of the voiced run that triggered the start.
- `SpeechEnded.last_voiced_t`: end of the last voiced chunk (what `endpoint_delay`
  and `voice_to_voice` are measured from).
- `SpeechEnded.declared_t`: end of the chunk whose silence completed the endpoint,
  i.e. the moment the decision could be made when the audio arrives in real time.

The speech decision per 512-sample chunk comes from any callable `vad(chunk) -> P(speech)`
with `reset()`, normally `voice.vad.SileroVAD`; tests can pass a scripted one.
Hysteresis as in Silero's own iterator: a chunk is voiced at P >= threshold, and
once in speech, audio stays speech while P >= threshold - 0.15.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from voice.audio import Rebuffer

SAMPLE_RATE = 16000


class ChunkVAD(Protocol):
    chunk_samples: int

    def __call__(self, chunk: np.ndarray) -> float: ...

    def reset(self) -> None: ...


@dataclass(frozen=True)
class EndpointConfig:
    threshold: float = 0.5  # P(speech) to call a chunk voiced
    neg_threshold: float | None = None  # below it, speech counts as silence; default threshold - 0.15
    min_speech_ms: float = 200.0  # voiced audio needed before declaring a start (drops clicks, coughs)
    min_silence_ms: float = 500.0  # trailing silence before declaring the end
    pre_roll_ms: float = 300.0  # audio kept from before the start so the first syllable is not cut
    post_roll_ms: float = 150.0  # audio kept after the last voiced chunk (soft word endings)
    max_utterance_s: float = 30.0  # force an end: Whisper sees at most 30 s at once

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError("threshold must be in (0, 1)")
        if self.min_speech_ms < 0 or self.min_silence_ms <= 0 or self.max_utterance_s <= 0:
            raise ValueError("durations must be positive")

    @property
    def low(self) -> float:
        return self.neg_threshold if self.neg_threshold is not None else max(0.01, self.threshold - 0.15)


@dataclass(frozen=True)
class SpeechStarted:
    start_t: float  # first sample of the voiced run
    declared_t: float  # end of the chunk that confirmed the start


@dataclass(frozen=True)
class SpeechEnded:
    audio: np.ndarray = field(repr=False)  # float32 16 kHz: pre-roll + speech + post-roll
    start_t: float  # first voiced sample (as in SpeechStarted)
    last_voiced_t: float  # end of the last voiced chunk
    declared_t: float  # when the end was decided
    reason: str = "silence"  # "silence" | "max_length" | "flush"
    audio_start_t: float = 0.0  # time of audio[0] (start_t minus the pre-roll actually kept)

    @property
    def endpoint_delay(self) -> float:
        return self.declared_t - self.last_voiced_t

    @property
    def duration(self) -> float:
        return len(self.audio) / SAMPLE_RATE


Event = SpeechStarted | SpeechEnded


class Endpointer:
    """Turns a stream of frames into SpeechStarted / SpeechEnded events. One per stream."""

    def __init__(self, vad: ChunkVAD, config: EndpointConfig | None = None, sample_rate: int = SAMPLE_RATE):
        if sample_rate != SAMPLE_RATE:
            raise ValueError(f"the endpointer works on {SAMPLE_RATE} Hz audio, got {sample_rate} Hz: resample first")
        self.vad = vad
        self.config = config or EndpointConfig()
        self.chunk = int(getattr(vad, "chunk_samples", 512))
        self._chunk_s = self.chunk / SAMPLE_RATE
        self.reset()

    def reset(self) -> None:
        """Forget everything (new call or after barge-in handling)."""
        self.vad.reset()
        self._rebuf = Rebuffer(self.chunk)
        self._buf_t: float | None = None  # time of the first sample waiting in the rebuffer
        self.in_speech = False
        c = self.config
        keep = int(np.ceil((c.pre_roll_ms + c.min_speech_ms) / 1000.0 / self._chunk_s)) + 2
        self._history: deque[tuple[float, np.ndarray, bool]] = deque(maxlen=keep)  # (t, chunk, voiced) while idle
        self._run_start: float | None = None  # start of the current voiced run while idle
        self._run_voiced = 0.0  # seconds voiced in that run
        self._voice_t: float | None = None  # end of the latest voiced chunk while idle (voice_t)
        self._utt: list[np.ndarray] = []
        self._utt_t0 = 0.0  # time of self._utt[0][0]
        self._start_t = 0.0
        self._last_voiced_t = 0.0
        self._silence = 0.0

    # -------------------------------------------------------------- feeding

    def feed(self, frame: np.ndarray, t: float) -> list[Event]:
        """Add a frame (float32 16 kHz) whose first sample was captured at time `t`."""
        frame = np.asarray(frame, dtype=np.float32).reshape(-1)
        if self._buf_t is None or len(self._rebuf) == 0:
            # The rebuffer is empty, so this frame's first sample starts the next chunk. With
            # samples still waiting, the chunk's time follows from theirs (frames are contiguous).
            self._buf_t = t
        events: list[Event] = []
        for chunk in self._rebuf.push(frame):
            chunk_t = self._buf_t
            self._buf_t = chunk_t + self._chunk_s
            events.extend(self._step(chunk, chunk_t))
        return events

    def flush(self) -> list[Event]:
        """End of stream: close an utterance in progress (reason "flush")."""
        if not self.in_speech:
            return []
        end_t = self._utt_t0 + sum(len(c) for c in self._utt) / SAMPLE_RATE
        return [self._finish(end_t, "flush")]

    @property
    def trailing_silence_s(self) -> float:
        """In speech: seconds of silence since the last voiced chunk (0 while voiced)."""
        return self._silence if self.in_speech else 0.0

    @property
    def voice_t(self) -> float | None:
        """Between utterances: the end of the latest voiced chunk since the last one ended
        (a click, a breath, or the caller's next words starting, which become speech only
        after min_speech_ms); None when there was none, or in speech."""
        return None if self.in_speech else self._voice_t

    @property
    def voiced_samples(self) -> int:
        """How many samples `voiced_audio()` would return now (0 when not in speech)."""
        if not self.in_speech or not self._utt:
            return 0
        keep_until = self._last_voiced_t + self.config.post_roll_ms / 1000.0
        return max(0, min(len(self._utt) * self.chunk, int(round((keep_until - self._utt_t0) * SAMPLE_RATE))))

    def voiced_audio(self, start: int = 0) -> np.ndarray:
        """While in speech: the utterance's audio from sample `start` up to the last sample
        its SpeechEnded is sure to keep (the end of the last voiced chunk plus post-roll;
        that end only moves forward, so what this returns never changes later). Empty when
        not in speech. A streaming transcriber fed these pieces holds, at the SpeechEnded,
        a prefix of exactly that event's audio."""
        if not self.in_speech or not self._utt:
            return np.zeros(0, np.float32)
        keep_until = self._last_voiced_t + self.config.post_roll_ms / 1000.0
        n = min(len(self._utt) * self.chunk, int(round((keep_until - self._utt_t0) * SAMPLE_RATE)))
        if n <= start:
            return np.zeros(0, np.float32)
        first = start // self.chunk  # chunks are all self.chunk samples long
        audio = np.concatenate(self._utt[first: -(-n // self.chunk)])
        return audio[start - first * self.chunk: n - first * self.chunk]

    # -------------------------------------------------------------- internals

    def _step(self, chunk: np.ndarray, t: float) -> list[Event]:
        c = self.config
        p = self.vad(chunk)
        end = t + self._chunk_s
        if not self.in_speech:
            voiced = p >= c.threshold
            self._history.append((t, chunk, voiced))
            if voiced:
                self._voice_t = end
                if self._run_start is None:
                    self._run_start = t
                self._run_voiced += self._chunk_s
            elif p < c.low:
                # A real gap breaks the run; in-between chunks neither add nor break.
                self._run_start, self._run_voiced = None, 0.0
            if self._run_start is not None and self._run_voiced * 1000.0 >= c.min_speech_ms - 1e-9:
                return [self._begin(end)]
            return []

        self._utt.append(chunk)
        if p >= c.low:
            self._last_voiced_t = end
            self._silence = 0.0
        else:
            self._silence += self._chunk_s
        if self._silence * 1000.0 >= c.min_silence_ms - 1e-9:
            return [self._finish(end, "silence")]
        if end - self._start_t >= c.max_utterance_s:
            return [self._finish(end, "max_length")]
        return []

    def _begin(self, declared_t: float) -> SpeechStarted:
        c = self.config
        self.in_speech = True
        self._start_t = self._run_start
        keep_from = self._start_t - c.pre_roll_ms / 1000.0 - 1e-9
        kept = [(t, ch) for t, ch, _ in self._history if t + self._chunk_s > keep_from]
        self._utt = [ch for _, ch in kept]
        self._utt_t0 = kept[0][0]
        self._last_voiced_t = declared_t
        self._silence = 0.0
        self._history.clear()
        self._run_start, self._run_voiced = None, 0.0
        return SpeechStarted(start_t=self._start_t, declared_t=declared_t)

    def _finish(self, declared_t: float, reason: str) -> SpeechEnded:
        c = self.config
        audio = np.concatenate(self._utt) if self._utt else np.zeros(0, np.float32)
        # Trim the trailing silence to post_roll_ms: it only costs STT time.
        keep_until = self._last_voiced_t + c.post_roll_ms / 1000.0
        n = int(round((keep_until - self._utt_t0) * SAMPLE_RATE))
        audio = audio[: max(0, min(len(audio), n))]
        event = SpeechEnded(
            audio=audio, start_t=self._start_t, last_voiced_t=self._last_voiced_t,
            declared_t=declared_t, reason=reason, audio_start_t=self._utt_t0,
        )
        self.in_speech = False
        self._utt = []
        self._silence = 0.0
        self._voice_t = None
        if reason != "max_length":
            # Fresh recurrent state for the next utterance; after a forced cut the
            # speaker is still talking, so keep the state to resume at once.
            self.vad.reset()
        return event
