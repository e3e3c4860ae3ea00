"""A turn and the conversation history: plain data, owned by the call's turn runner.

Stages report what they did as results (`LLMResult`, `SpeechResult`); the turn runner
alone builds the `Turn` from them, so a turn's state has one owner. Every stage stamps
the turn's `TurnTimeline` (the one shared ledger of events, from which every metric comes).

A `Reply` is one answer of the agent's as the respond and speak stages share it: the
turn's timeline, barge-in and results, the LLM's parameters, the tools, the guard and the
sentence queue between the two stages, and where the turn's events go.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from llm.types import GenerationStats, SamplingParams
from llm.voice_first import VoiceFirst
from pipeline.events import CallEvent, TurnEnd
from pipeline.ports import ToolRunner
from pipeline.sentences import SentenceSplitter
from pipeline.timeline import TurnTimeline

__all__ = ["BargeIn", "History", "LLMResult", "Reply", "SpeechResult", "Turn"]


@dataclass
class BargeIn:
    """The caller talked over the agent: one event, handled by every stage in its own place
    (the speaker clears the output, the LLM stage stops between passes, the turn runner
    records what was heard)."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    declared_t: float | None = None  # the endpointer's decision time

    def fire(self, declared_t: float) -> None:
        if not self.event.is_set():
            self.declared_t = declared_t
            self.event.set()

    @property
    def fired(self) -> bool:
        return self.event.is_set()


@dataclass
class LLMResult:
    """What the LLM stage produced in one turn."""

    text: str = ""
    sentences: list[str] = field(default_factory=list)  # handed to TTS, in order
    groups: int = 0
    finish_reason: str | None = None
    stats: GenerationStats | None = None  # the turn's, over its rounds (merge_stats)
    rounds: list[GenerationStats] = field(default_factory=list)  # one per generation (tool turns: several)
    passes_at_barge_in: int | None = None  # target passes done when the caller barged in
    error: str | None = None
    # Tools (pipeline/stages/tools_step.py): one dict per call (name, arguments, ok, result,
    # error, elapsed_ms, action, reason, round, and its start/end on the monotonic clock);
    # the assistant tool-call and tool-result messages, for the history; the call-level
    # action a tool asked for ("transfer", "end_call") and why; whether the fixed fallback
    # sentence was spoken because the tools could not do what was asked.
    tool_calls: list[dict] = field(default_factory=list)
    tool_messages: list[dict] = field(default_factory=list)
    action: str | None = None
    action_reason: str | None = None
    fallback: bool = False
    # When the turn began to act (a tool run, a plan acted on): from then on it cannot be
    # taken back (stages/take_back.py), since what it did stays done. None again once the
    # act is known to have changed nothing (it only read the slots, asked for a name, or was
    # refused: receptionist.tools.stays_done).
    acted_t: float | None = None
    # The hold line ([tools] hold_line, "One moment, please.") spoken when the model began a
    # tool call before saying anything: its monotonic time, None if not spoken.
    hold_line_t: float | None = None
    # The fact guard's record (pipeline/receptionist/guard.py): each sentence of the model's not spoken,
    # why, and what was said instead ({"sentence", "why", "said"}).
    guarded: list[dict] = field(default_factory=list)
    # The turn's plan ([tools] plan, pipeline/stages/plan_step.py): act, slot, name, ...
    plan: dict | None = None
    # The model's output as written when it differs from what is spoken (an answer plan's
    # line before the answer): the history keeps it, so that the next prompt starts with
    # the tokens in the KV cache (`written_if_heard`).
    written: str = ""
    # The sentence the token limit (max_new_tokens) cut before its end: not spoken ("They
    # accept Delta Dental and Aet" was, before), kept here for the report.
    cut_short: str = ""

    def written_if_heard(self, heard: str) -> str:
        """`written`, when the caller heard the answer whole and as the model wrote it (no
        barge-in, no guarded sentence); else "" (the history keeps what was heard)."""
        if not self.written or self.guarded:
            return ""
        return self.written if " ".join(heard.split()) == " ".join(" ".join(self.sentences).split()) else ""

    @property
    def model_spoke(self) -> bool:
        """Something besides the hold line (always the first sentence when spoken) was said."""
        return len(self.sentences) > (0 if self.hold_line_t is None else 1)


@dataclass
class SpeechResult:
    """What the speaker stage played in one turn."""

    heard: list[str] = field(default_factory=list)  # sentences whose audio fully played (marks confirmed)
    audio_s: float = 0.0  # agent audio handed to the sink
    error: str | None = None


@dataclass
class Turn:
    index: int
    timeline: TurnTimeline
    user_text: str = ""
    greeting: bool = False
    llm: LLMResult = field(default_factory=LLMResult)
    speech: SpeechResult = field(default_factory=SpeechResult)
    barge_in: BargeIn = field(default_factory=BargeIn)
    end_of_turn: TurnEnd | None = None  # how the caller's turn ended (reason, probability)
    error: str | None = None
    # The caller went on speaking (at this time, their first voiced sample) before the answer
    # was heard: the turn is taken back, its audio begins the next (stages/take_back.py).
    taken_back_t: float | None = None

    @property
    def agent_text(self) -> str:
        return self.llm.text

    @property
    def sentences(self) -> list[str]:
        return self.llm.sentences

    @property
    def heard(self) -> list[str]:
        return self.speech.heard

    @property
    def heard_text(self) -> str:
        return " ".join(self.speech.heard)

    @property
    def interrupted(self) -> bool:
        return self.barge_in.fired

    @property
    def barge_in_declared_t(self) -> float | None:
        return self.barge_in.declared_t

    @property
    def stats(self) -> GenerationStats | None:
        return self.llm.stats

    @property
    def finish_reason(self) -> str | None:
        return self.llm.finish_reason

    @property
    def llm_passes_after_barge_in(self) -> int | None:
        if self.llm.passes_at_barge_in is None or self.llm.stats is None:
            return None
        return self.llm.stats.passes - self.llm.passes_at_barge_in


def _ignore(event: CallEvent) -> None:
    pass


@dataclass
class Reply:
    """One answer of the agent's, handed to both stages that make it: respond (LLM ->
    sentences) fills `llm` and puts each sentence in `sentences`, speak (sentences -> audio)
    fills `speech`; both stamp `timeline` and stop on `barge_in`."""

    timeline: TurnTimeline
    barge_in: BargeIn = field(default_factory=BargeIn)
    llm: LLMResult = field(default_factory=LLMResult)
    speech: SpeechResult = field(default_factory=SpeechResult)
    params: SamplingParams = field(default_factory=SamplingParams)
    splitter: SentenceSplitter = field(default_factory=SentenceSplitter)
    turn: int = 0  # the turn's index, on the events the stages emit
    emit: Callable[[CallEvent], None] = _ignore
    # The model may call tools (pipeline.receptionist.tools.ToolBox); `hold_line` is said when
    # it starts a call before saying anything; `plan` ([tools] plan): the turn is decided as a
    # constrained plan (stages/plan_step.py) on `caller_text` instead.
    toolbox: ToolRunner | None = None
    hold_line: str = ""
    plan: bool = False
    caller_text: str = ""
    greet_back: bool = False  # a `caller_text` that only greets is greeted back, not sent to the model
    # The fact guard (pipeline.receptionist.guard.TurnGuard): a model sentence -> what is
    # said instead (itself, another, or None: nothing); our own lines skip it.
    guard: Callable[[str], str | None] | None = None
    # The call's LLM gate (llm.voice_first.VoiceFirst): held while the reply's first audio is
    # made, so that the model's next pass waits for it; None: the model never waits.
    voice_first: VoiceFirst | None = None
    sentences: asyncio.Queue = field(default_factory=asyncio.Queue)  # respond -> speak; None ends it

    @classmethod
    def of(cls, turn: "Turn", **options: object) -> "Reply":
        """The reply of a call's turn: its timeline, barge-in and results are the turn's."""
        return cls(turn.timeline, turn.barge_in, turn.llm, turn.speech, turn=turn.index, **options)  # type: ignore[arg-type]

    @classmethod
    def said(cls, turn: "Turn", text: str, **options: object) -> "Reply":
        """A reply in our own words (the greeting): `text` its one sentence, already written."""
        reply = cls.of(turn, **options)
        reply.sentences.put_nowait(text)
        reply.sentences.put_nowait(None)
        return reply


@dataclass
class History:
    """System prompt + (user, agent-as-heard) exchanges, within a token budget.

    `count_tokens(messages)` is the LLM's own count (chat template included); the budget
    covers everything after the system prompt. The newest user message is always kept;
    whole exchanges are dropped oldest first so roles keep alternating.
    """

    system_prompt: str
    budget_tokens: int
    count_tokens: Callable[[list[dict]], int]
    exchanges: list[tuple[str, str]] = field(default_factory=list)
    # The tool-call and tool-result messages of each exchange (aligned with `exchanges`):
    # a booking made stays known to the model, even when the caller barged in over its answer.
    steps: list[tuple[dict, ...]] = field(default_factory=list)
    # Each exchange's agent turn as the model wrote it, or "" (LLMResult.written_if_heard).
    written: list[str] = field(default_factory=list)
    dropped: int = 0

    def add(self, user_text: str, agent_text: str, steps: tuple[dict, ...] | list[dict] = (), written: str = "") -> None:
        self.exchanges.append((user_text, agent_text))
        self.steps.append(tuple(steps))
        self.written.append(written)

    def add_agent(self, agent_text: str) -> None:
        """An agent line with no user line before it (the greeting)."""
        self.add("", agent_text)

    def _messages(self) -> list[dict]:
        out = []
        for (user, agent), steps, written in zip(self.exchanges, self._aligned(self.steps, ()),
                                                 self._aligned(self.written, "")):
            if user:
                out.append({"role": "user", "content": user})
            out.extend(steps)
            if agent:
                # as_written: the in-process engine's prompt (llm.engine.template_messages).
                out.append({"role": "assistant", "content": agent, **({"as_written": written} if written else {})})
        return out

    def _aligned(self, values: list, empty: object) -> list:
        # `exchanges` may have been filled directly (tests, old callers): no steps for those.
        pad = len(self.exchanges) - len(values)
        return [empty] * pad + values if pad >= 0 else values[-pad:]

    def messages(self, user_text: str) -> list[dict]:
        """The prompt for a new user message, trimming old exchanges to fit the budget."""
        system = [{"role": "system", "content": self.system_prompt}]
        base = self.count_tokens(system)
        user = [{"role": "user", "content": user_text}]
        while self.exchanges:
            msgs = system + self._messages() + user
            if self.count_tokens(msgs) - base <= self.budget_tokens:
                return msgs
            self.exchanges.pop(0)
            for values in (self.steps, self.written):
                if len(values) > len(self.exchanges):
                    values.pop(0)
            self.dropped += 1
        return system + user
