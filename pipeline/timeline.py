"""Per-turn timeline: monotonic timestamps of named events, and the metrics derived from them.

Every stage stamps events here; every latency number (reports, MQTT, the demo's live
print-out) comes from `compute_metrics`, so a metric has exactly one definition.

Metrics are computed on integer nanoseconds, so the parts of `voice_to_voice` telescope
exactly:

    voice_to_voice = endpoint_delay + stt_latency + agent_gap
                     + first_sentence_latency + tts_first_audio + output_gap
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.events import KeypadEntry
    from voice.endpointer import SpeechEnded

__all__ = [
    "EVENTS",
    "METRICS",
    "V2V_PARTS",
    "TurnTimeline",
    "compute_metrics",
    "compute_metrics_ns",
    "validate_order",
]

# In the order they normally happen.
EVENTS: tuple[str, ...] = (
    "speech_start",  # VAD: the user started speaking
    "last_voiced",  # the last voiced audio of the user's utterance
    "end_of_speech",  # the endpointer declared the utterance over
    "transcript",  # STT returned the final transcript
    "llm_request",  # the LLM request started
    "first_token",  # the first token group arrived
    "first_sentence",  # the first complete sentence was handed to TTS
    "tts_request",  # TTS started on the first sentence (normally == first_sentence)
    "tts_first_audio",  # TTS yielded the first audio chunk of the first sentence
    "first_audio_out",  # the first agent audio was sent to the caller / speaker
    "llm_done",  # the LLM stream finished (any finish reason)
    "playback_done",  # the last agent audio of the turn was played / sent
    "barge_in",  # the user interrupted the agent during this turn
)

# metric name -> (from event, to event); see DESIGN.md "Per-turn metrics".
METRIC_SPANS: dict[str, tuple[str, str]] = {
    "endpoint_delay": ("last_voiced", "end_of_speech"),
    # The same span under the end-of-turn model's name: end of voiced speech -> turn end
    # decided (end_of_speech is stamped when the turn-taker decides, model or timeout).
    "eot_delay": ("last_voiced", "end_of_speech"),
    "stt_latency": ("end_of_speech", "transcript"),
    # The same span under streaming STT's name: what transcription still costs once the
    # turn has ended (with stt.streaming only the unconfirmed tail is left to transcribe).
    "stt_after_endpoint": ("end_of_speech", "transcript"),
    "agent_gap": ("transcript", "llm_request"),
    "ttft": ("llm_request", "first_token"),
    "first_sentence_latency": ("llm_request", "first_sentence"),
    "tts_first_audio": ("first_sentence", "tts_first_audio"),
    "output_gap": ("tts_first_audio", "first_audio_out"),
    "voice_to_voice": ("last_voiced", "first_audio_out"),
    "llm_total": ("llm_request", "llm_done"),
}
METRICS: tuple[str, ...] = tuple(METRIC_SPANS)

# The consecutive spans whose sum is voice_to_voice.
V2V_PARTS: tuple[str, ...] = (
    "endpoint_delay",
    "stt_latency",
    "agent_gap",
    "first_sentence_latency",
    "tts_first_audio",
    "output_gap",
)

# Pairs (earlier, later) that must be in this order when both are stamped.
_ORDER: tuple[tuple[str, str], ...] = (
    ("speech_start", "last_voiced"),
    ("last_voiced", "end_of_speech"),
    ("end_of_speech", "transcript"),
    ("transcript", "llm_request"),
    ("llm_request", "first_token"),
    ("first_token", "first_sentence"),
    ("first_sentence", "tts_request"),
    ("tts_request", "tts_first_audio"),
    ("first_sentence", "tts_first_audio"),
    ("tts_first_audio", "first_audio_out"),
    ("first_token", "llm_done"),
    ("llm_request", "llm_done"),
    ("first_audio_out", "playback_done"),
    ("speech_start", "barge_in"),
    ("transcript", "barge_in"),
)


@dataclass
class TurnTimeline:
    """Monotonic timestamps (time.monotonic() seconds) of one turn's events.

    The first stamp of an event wins (a stage that stamps "first_token" on every group
    stays correct); pass `overwrite=True` to replace it deliberately.
    """

    index: int = 0
    events: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of_utterance(cls, index: int, utterance: SpeechEnded) -> "TurnTimeline":
        """A caller turn's timeline, up to its end of speech."""
        tl = cls(index=index)
        tl.mark("speech_start", utterance.start_t)
        tl.mark("last_voiced", utterance.last_voiced_t)
        tl.mark("end_of_speech", utterance.declared_t)
        return tl

    @classmethod
    def of_keypad(cls, index: int, entry: KeypadEntry) -> "TurnTimeline":
        """A keypad turn's timeline: it starts at the first key and has no last_voiced
        (nothing was voiced), so the turn stays out of voice-to-voice figures instead of
        counting the keypad pause; its "transcript" is the entry's end (no STT)."""
        tl = cls(index=index)
        tl.mark("speech_start", entry.first_t)
        tl.mark("end_of_speech", entry.ended_t)
        tl.mark("transcript", entry.ended_t)
        return tl

    def mark(self, name: str, t: float | None = None, *, overwrite: bool = False) -> float:
        """Stamp `name` at `t` (default: now); returns the stamp in effect."""
        if name not in EVENTS:
            raise ValueError(f"unknown timeline event {name!r}; known events: {', '.join(EVENTS)}")
        if name in self.events and not overwrite:
            return self.events[name]
        stamp = time.monotonic() if t is None else float(t)
        if not math.isfinite(stamp):
            raise ValueError(f"timeline event {name!r} needs a finite timestamp, got {t!r}")
        self.events[name] = stamp
        return stamp

    def get(self, name: str) -> float | None:
        return self.events.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.events

    def relative(self, origin: float) -> dict[str, float]:
        """Events as seconds since `origin` (e.g. the call start), in EVENTS order."""
        return {name: self.events[name] - origin for name in EVENTS if name in self.events}

    def metrics(self) -> dict[str, float | None]:
        return compute_metrics(self)


def _ns(t: float) -> int:
    return round(t * 1e9)


def compute_metrics_ns(timeline: TurnTimeline) -> dict[str, int | None]:
    """Every metric in integer nanoseconds; None where an event is missing."""
    out: dict[str, int | None] = {}
    for metric, (start, end) in METRIC_SPANS.items():
        t0, t1 = timeline.events.get(start), timeline.events.get(end)
        out[metric] = None if t0 is None or t1 is None else _ns(t1) - _ns(t0)
    return out


def compute_metrics(timeline: TurnTimeline) -> dict[str, float | None]:
    """Every metric in seconds; None where an event is missing. The one definition."""
    return {k: None if v is None else v / 1e9 for k, v in compute_metrics_ns(timeline).items()}


def validate_order(timeline: TurnTimeline) -> list[str]:
    """Problems with the timeline's ordering (an empty list when it is consistent)."""
    problems = []
    ev = timeline.events
    for earlier, later in _ORDER:
        if earlier in ev and later in ev and ev[later] < ev[earlier]:
            problems.append(
                f"{later} ({ev[later]:.6f}) is before {earlier} ({ev[earlier]:.6f}) by "
                f"{ev[earlier] - ev[later]:.6f} s"
            )
    if "first_sentence" in ev and "first_token" not in ev:
        problems.append("first_sentence is stamped but first_token is not")
    if "first_audio_out" in ev and "tts_first_audio" not in ev:
        problems.append("first_audio_out is stamped but tts_first_audio is not")
    return problems
