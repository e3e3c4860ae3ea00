"""The call's vocabulary: what the caller's side hands the call, and what the call tells
its observers, as typed, frozen dataclasses.

Turn-taking inputs (made by stages and transports, read by the call):

    KeyPress      one key the caller pressed (a transport puts it in the frame stream)
    KeypadEntry   keys pressed in a row, as one caller turn (stages.listen.Keypad)
    TurnEnd       a finished caller turn (stages.turn_taking)
    TurnPending   a pause after which the turn-taker waits (preemptive generation starts there)

Call events (one class per kind; `kind` is the name on the wire, `as_dict()` the data):
the call and its stages emit them into one `CallEvents` stream, and everything that
watches a call subscribes to it: the report's turn entries come from the finished turn,
MQTT publishes the kinds in MQTT_KINDS (pipeline/mqtt.py), `Call(on_event=...)` and the
browser page get `(kind, as_dict())`. The wire shapes are those the call sent before the
events were typed: a consumer that reads `kind` and the dict sees no change.

This module is core: it imports no stage, no transport, and nothing of the call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from voice.endpointer import SpeechEnded

log = logging.getLogger(__name__)

__all__ = [
    "BargedIn", "CallAction", "CallEvent", "CallEvents", "EndOfTurn", "HoldLine", "KeyPress", "KeyPressed",
    "KeypadEntry", "KeypadTurn", "LLMText", "MQTT_KINDS", "PreemptiveDiscarded", "PreemptiveKept",
    "PreemptiveStart", "SentenceGuarded", "SentenceHeard", "SentenceReady", "SpeechStart", "ToolCallRejected",
    "ToolCallStarted", "ToolResult", "TranscriptInterim", "TranscriptPause", "TranscriptStable",
    "TranscriptReady", "TurnEnd", "TurnPending", "TurnRecorded", "TurnTakenBack", "UtteranceSkipped", "event_callback",
    "turn_callback",
]


# ------------------------------------------------------------ turn-taking inputs


@dataclass(frozen=True)
class KeyPress:
    """One key the caller pressed (0-9, *, #, A-D), and when (time.monotonic())."""

    digit: str
    t: float


@dataclass(frozen=True)
class KeypadEntry:
    """Keys pressed in a row, as one turn of the caller's."""

    digits: str  # without the closing '#' ("#" alone when that was the only key)
    first_t: float  # the first key's press
    ended_t: float  # when the entry was complete
    ended_by: str  # "#" | "timeout" | "max_keys" | "flush"

    @property
    def text(self) -> str:
        """The user's text for the model: marked, so it is not read as something said."""
        return f"[keypad] {self.digits}"


@dataclass(frozen=True)
class TurnEnd:
    """A finished caller turn: the whole utterance and how its end was decided."""

    utterance: SpeechEnded
    reason: str  # "silence" (no model) | "words_end" | "model" | "timeout" | "max_length" | "flush"
    probability: float | None = None  # the end-of-turn model's last answer, if asked
    pauses: int = 1  # pauses merged into this turn
    # The transcript of exactly this audio, made at its last pause (`transcribe_pause`): the
    # turn awaits it instead of transcribing (a task giving None: transcribe as usual).
    transcript: asyncio.Future | None = field(default=None, compare=False)
    # Silence mode with preemption: the LLM's probability that the caller's words end their
    # message, scored at the last pause (TurnTaker.words_ended); None if not scored in time.
    words_end: float | None = None


@dataclass(frozen=True)
class TurnPending:
    """A pause after which the turn-taker waits: the pending turn's audio so far. If the
    turn then ends with no new speech, its TurnEnd's utterance audio is this very audio
    (same pieces, `pauses` of them)."""

    audio: np.ndarray
    pauses: int  # pieces in the turn so far: this pause's place in the turn
    start_t: float
    last_voiced_t: float
    declared_t: float  # when it was announced: at the pause (TurnTaker.on_pause), else after the model answered
    probability: float | None
    transcript: asyncio.Future | None = field(default=None, compare=False)  # as TurnEnd's


# ------------------------------------------------------------ call events


@dataclass(frozen=True)
class CallEvent:
    """One thing that happened in a call. `kind` names it on the wire; `as_dict()` is its
    data there (the fields, in order)."""

    kind: ClassVar[str] = ""

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class SpeechStart(CallEvent):
    """The endpointer declared caller speech (a barge-in if the agent is answering)."""

    kind: ClassVar[str] = "speech_started"
    t: float


@dataclass(frozen=True)
class BargedIn(CallEvent):
    kind: ClassVar[str] = "barge_in"
    turn: int
    heard: str  # what the caller had heard of the answer when they spoke


@dataclass(frozen=True)
class EndOfTurn(CallEvent):
    """How a caller turn ended (TurnEnd, as the observers see it)."""

    kind: ClassVar[str] = "end_of_turn"
    reason: str
    probability: float | None
    delay: float  # last voiced -> decided, seconds
    pauses: int

    @classmethod
    def of(cls, end: TurnEnd) -> "EndOfTurn":
        u = end.utterance
        return cls(end.reason, end.probability, round(u.declared_t - u.last_voiced_t, 6), end.pauses)


@dataclass(frozen=True)
class KeyPressed(CallEvent):
    kind: ClassVar[str] = "key"
    digit: str


@dataclass(frozen=True)
class UtteranceSkipped(CallEvent):
    """STT heard nothing in an utterance: no turn, no LLM call."""

    kind: ClassVar[str] = "skipped"
    audio_s: float
    stt_stream: dict | None = None  # the streaming STT's record, when it ran

    def as_dict(self) -> dict[str, Any]:
        data = {"audio_s": self.audio_s}
        return data if self.stt_stream is None else {**data, "stt_stream": self.stt_stream}


@dataclass(frozen=True)
class TranscriptReady(CallEvent):
    kind: ClassVar[str] = "transcript"
    turn: int
    text: str


@dataclass(frozen=True)
class KeypadTurn(CallEvent):
    kind: ClassVar[str] = "keypad"
    turn: int
    text: str
    ended_by: str


@dataclass(frozen=True)
class CallAction(CallEvent):
    """A tool ended the call: the kind is the action ("transfer", "end_call")."""

    turn: int
    action: str
    reason: str | None

    @property
    def kind(self) -> str:  # type: ignore[override]  # one class, the action's name on the wire
        return self.action

    def as_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "reason": self.reason}


@dataclass(frozen=True)
class HoldLine(CallEvent):
    """The hold line was said: the model began a tool call before saying anything."""

    kind: ClassVar[str] = "hold_line"
    turn: int
    text: str


@dataclass(frozen=True)
class LLMText(CallEvent):
    """Speakable text the model wrote (a group's, after the tool-call filter)."""

    kind: ClassVar[str] = "llm_text"
    turn: int
    text: str


@dataclass(frozen=True)
class SentenceGuarded(CallEvent):
    """The fact guard did not let a sentence through; `said` instead (None: nothing)."""

    kind: ClassVar[str] = "guarded"
    turn: int
    sentence: str
    said: str | None


@dataclass(frozen=True)
class SentenceReady(CallEvent):
    """A sentence handed to TTS."""

    kind: ClassVar[str] = "sentence"
    turn: int
    text: str


@dataclass(frozen=True)
class SentenceHeard(CallEvent):
    """A sentence whose audio fully played (its mark confirmed)."""

    kind: ClassVar[str] = "heard"
    turn: int
    text: str


@dataclass(frozen=True)
class ToolCallStarted(CallEvent):
    kind: ClassVar[str] = "tool_call"
    turn: int
    name: str
    arguments: Any


@dataclass(frozen=True)
class ToolCallRejected(CallEvent):
    """A tool call the model wrote that could not be read: nothing ran."""

    kind: ClassVar[str] = "tool_call"
    turn: int
    name: str | None
    ok: bool
    error: str | None


@dataclass(frozen=True)
class ToolResult(CallEvent):
    kind: ClassVar[str] = "tool_result"
    turn: int
    name: str | None
    ok: bool
    error: str | None
    elapsed_ms: float


@dataclass(frozen=True)
class PreemptiveStart(CallEvent):
    kind: ClassVar[str] = "preemptive_start"
    pause: int
    audio_s: float


@dataclass(frozen=True)
class PreemptiveKept(CallEvent):
    kind: ClassVar[str] = "preemptive_kept"
    groups_ready: int
    finished: bool


@dataclass(frozen=True)
class PreemptiveDiscarded(CallEvent):
    kind: ClassVar[str] = "preemptive_discarded"
    why: str


@dataclass(frozen=True)
class TranscriptInterim(CallEvent):
    """Streaming STT: the words of the caller's turn so far, not yet confirmed."""

    kind: ClassVar[str] = "transcript_interim"
    text: str
    new: str
    at: float


@dataclass(frozen=True)
class TranscriptStable(CallEvent):
    """Streaming STT: words two passes agreed on (they will not change)."""

    kind: ClassVar[str] = "transcript_stable"
    text: str
    new: str
    at: float


@dataclass(frozen=True)
class TranscriptPause(CallEvent):
    """Streaming STT: the turn so far transcribed at a pause, beside the end-of-turn model."""

    kind: ClassVar[str] = "transcript_pause"
    text: str | None
    tail_s: float
    compute_s: float


@dataclass(frozen=True)
class TurnRecorded(CallEvent):
    """A turn is over: its report entry (what the report holds, MQTT's turns topic and
    `Call(on_turn=...)` get). Not one of the live events `on_event` callbacks see."""

    kind: ClassVar[str] = "turn"
    entry: dict


@dataclass(frozen=True)
class TurnTakenBack(CallEvent):
    """The caller went on speaking before the turn's answer was heard: the turn is taken
    back, not answered, and its audio begins the next (pipeline/stages/take_back.py). Its
    entry in the report's "taken_back" list."""

    kind: ClassVar[str] = "turn_taken_back"
    entry: dict

    def as_dict(self) -> dict[str, Any]:
        return dict(self.entry)


# The kinds MQTT publishes as they happen (<prefix>/calls/<id>/events): the end-of-turn
# decision and a turn taken back, the preemptive generation's start / kept / discarded, and
# the streaming STT's interim, stable and pause transcripts. The rest reach the report with the turn.
MQTT_KINDS = frozenset({"end_of_turn", "turn_taken_back", "preemptive_start", "preemptive_kept",
                        "preemptive_discarded", "transcript_interim", "transcript_stable", "transcript_pause"})


Observer = Callable[[CallEvent], None]


class CallEvents:
    """One call's event stream: `emit` hands each event to every subscriber, in the order
    they subscribed. A failing subscriber is logged and skipped: an observer (a display, a
    telemetry link) must never break the call."""

    def __init__(self) -> None:
        self._observers: list[Observer] = []

    def subscribe(self, observer: Observer) -> None:
        self._observers.append(observer)

    def emit(self, event: CallEvent) -> None:
        for observer in self._observers:
            try:
                observer(event)
            except Exception:
                log.exception("call event observer failed on %s", event.kind)


def event_callback(on_event: Callable[[str, dict], None]) -> Observer:
    """An observer for a `(kind, data)` callback (the browser page, the terminal display):
    every live event, not the finished turns (those go to `turn_callback`)."""
    def observe(event: CallEvent) -> None:
        if not isinstance(event, TurnRecorded):
            on_event(event.kind, event.as_dict())
    return observe


def turn_callback(on_turn: Callable[[dict], None]) -> Observer:
    """An observer for an `on_turn(entry)` callback: each finished turn's report entry."""
    def observe(event: CallEvent) -> None:
        if isinstance(event, TurnRecorded):
            on_turn(event.entry)
    return observe
