"""LLM stage: one turn's messages -> token groups -> complete sentences, each handed on
the moment it exists (the first one is what the caller waits for).

The backend streams one TokenGroup per target pass; the splitter declares a sentence as
soon as the text received proves it. A barge-in is passed to the backend as its cancel
event (the engine stops between passes) and ends the stream here; what was pending is
then not spoken. A failing model ends the turn with what it said so far and the error.

With a tool box the turn may take several rounds (stages/tools_step.py): each round's
text goes through a `ToolCallFilter`, so a tool call's tokens are never spoken; a backend
that receives calls already parsed (the OpenAI one) leaves them in `last_tool_parse`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llm.tool_calls import ToolCallFilter, ToolCallParse
from llm.types import GenerationStats, SamplingParams
from pipeline.ports import LLMBackend
from pipeline.sentences import SentenceSplitter
from pipeline.stages.plan_step import plan_turn
from pipeline.stages.tools_step import tool_turn
from pipeline.timeline import TurnTimeline
from pipeline.turn import BargeIn, LLMResult

log = logging.getLogger(__name__)

__all__ = ["AnswerStream", "merge_stats", "respond"]


async def respond(
    backend: LLMBackend,
    messages: list[dict],
    params: SamplingParams,
    splitter: SentenceSplitter,
    sentences: asyncio.Queue,
    timeline: TurnTimeline,
    barge_in: BargeIn,
    result: LLMResult,
    emit: Callable[..., None] = lambda kind, **data: None,
    toolbox: Any | None = None,
    hold_line: str = "",
    guard: Callable[[str], str | None] | None = None,
    plan: bool = False,
    caller_text: str = "",
) -> LLMResult:
    """Stream the answer; put each sentence into `sentences`, then None. Fills `result` as
    it goes (text, sentences, finish reason, stats, passes at a barge-in, error, tool calls),
    so that a hang-up mid-answer still leaves what was said; returns it. With `toolbox`
    (pipeline.receptionist.tools.ToolBox) the model may call tools between rounds; `hold_line` is said
    when the model starts a call before it said anything (AnswerStream.round). `guard`
    (pipeline.receptionist.guard.TurnGuard) judges each of the model's sentences before TTS: it returns
    the sentence, what to say instead, or None (say nothing); our own lines skip it. `plan`
    (with a toolbox): the turn is decided as a constrained plan and acted on
    (stages/plan_step.py) instead of the model calling tools; `caller_text` is its line."""
    answer = AnswerStream(backend, params, splitter, sentences, timeline, barge_in, result, emit,
                          hold_line=hold_line, guard=guard)

    async def note_barge_in() -> None:
        await barge_in.event.wait()
        result.passes_at_barge_in = answer.passes_so_far()

    watcher = asyncio.create_task(note_barge_in())
    timeline.mark("llm_request")
    try:
        if toolbox is None:
            await answer.round(messages)
        elif plan:
            await plan_turn(answer, messages, toolbox, caller_text)
        else:
            await tool_turn(answer, messages, toolbox)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        # The model failed mid-answer: say what we have, record the error, go on.
        log.exception("LLM failed mid-answer")
        result.error = f"llm: {type(exc).__name__}: {exc}"
        result.finish_reason = "error"
        answer.flush()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        answer.close_round()
        result.rounds = list(answer.rounds)
        result.stats = merge_stats(answer.rounds)
        if "first_token" in timeline:
            timeline.mark("llm_done")
        sentences.put_nowait(None)
    return result


@dataclass
class AnswerStream:
    """One turn's LLM output on its way to the speaker, over one or more rounds
    (generations): text -> (tool-call filter) -> splitter -> sentence queue."""

    backend: LLMBackend
    params: SamplingParams
    splitter: SentenceSplitter
    sentences: asyncio.Queue
    timeline: TurnTimeline
    barge_in: BargeIn
    result: LLMResult
    emit: Callable[..., None]
    hold_line: str = ""  # said when a tool call begins before anything was said (once a turn)
    guard: Callable[[str], str | None] | None = None  # the fact guard: a model sentence -> what is said
    rounds: list[GenerationStats] = field(default_factory=list)  # one per finished generation
    # The last round's text as the model wrote it, tool calls included (the tool step puts it
    # in the history so that the next round's prompt starts with the tokens already in the
    # KV cache; see llm.engine.template_messages).
    written: str = ""
    _before: Any = None  # the backend's stats before the live round: ours is the next to appear
    _live: bool = False
    _held: bool = False
    _after_line: bool = False

    async def round(self, messages: list[dict], filt: ToolCallFilter | None = None) -> tuple[str, ToolCallParse]:
        """Generate once; speak what may be spoken (the end of the round flushes the
        splitter: the caller hears "Let me check" before a tool runs). Returns the round's
        speakable text and what the filter held back."""
        self._before, self._live = self.backend.last_stats, True
        said, written = [], []
        self.written = ""
        try:
            async with contextlib.aclosing(self.backend.stream(messages, self.params, self.barge_in.event)) as stream:
                async for group in stream:
                    self.timeline.mark("first_token", min(group.timestamp, time.monotonic()))
                    self.result.groups += 1
                    if group.finish_reason:
                        self.result.finish_reason = group.finish_reason
                    if not group.text or self.barge_in.fired:
                        continue
                    written.append(group.text)
                    said.append(self.say(filt.feed(group.text) if filt is not None else group.text))
                    if filt is not None and filt.holding and self.hold_line and not self._held:
                        self._hold()
            parse = ToolCallParse()
            if filt is not None:
                tail, parse = filt.finish()
                # Calls the server parsed itself (OpenAI `tool_calls`, llm/openai_backend.py)
                # come from the backend; the filter's parse is for calls written as text.
                parsed = getattr(self.backend, "last_tool_parse", None)
                if parsed is not None and parsed.found:
                    parse = parsed
                if not self.barge_in.fired:
                    said.append(self.say(tail))
            if not self.barge_in.fired:
                self.flush()
            self.written = "".join(written)
            return "".join(said), parse
        finally:
            self.close_round()

    def _hold(self) -> None:
        """A tool call began: whatever the model said before it goes out now; if that was
        nothing, the hold line does, so the caller is not left in silence while the call is
        written, run and answered."""
        self._held = True  # once a turn
        self.flush()
        if not self.result.sentences:
            self.result.hold_line_t = time.monotonic()
            self.line(self.hold_line)
            self.emit("hold_line", text=self.hold_line)

    def close_round(self) -> None:
        if self._live:
            stats = self.backend.last_stats
            if stats is not None and stats is not self._before:
                self.rounds.append(stats)
            self._live = False

    def passes_so_far(self) -> int:
        done = sum(s.passes for s in self.rounds)
        live = self.backend.last_stats
        return done + (live.passes if self._live and live is not None and live is not self._before else 0)

    def say(self, text: str) -> str:
        if text:
            if self._after_line and not text[0].isspace():
                self.result.text += " "  # the model goes on after a line of ours (the hold line)
            self._after_line = False
            self.result.text += text
            self.emit("llm_text", text=text)
            for sentence in self.splitter.feed(text):
                self._hand(sentence)
        return text

    def flush(self) -> None:
        for sentence in self.splitter.flush():
            self._hand(sentence)

    def line(self, sentence: str) -> None:
        """A fixed sentence of ours (not the model's), spoken after whatever is pending."""
        self.flush()
        self.result.text += (" " if self.result.text and not self.result.text.endswith(" ") else "") + sentence
        self._after_line = True
        self._hand(sentence, ours=True)

    def _hand(self, sentence: str, ours: bool = False) -> None:
        if self.guard is not None and not ours:
            said = self.guard(sentence)
            if said != sentence:
                self.emit("guarded", sentence=sentence, said=said)
            if said is None:
                return
            sentence = said
        self.timeline.mark("first_sentence")
        self.result.sentences.append(sentence)
        self.sentences.put_nowait(sentence)
        self.emit("sentence", text=sentence)


def merge_stats(rounds: list[GenerationStats]) -> GenerationStats | None:
    """One turn's stats over its rounds: counters and times add up, TTFT is the first
    round's (the caller's wait), the gammas follow each other."""
    if len(rounds) <= 1:
        return rounds[0] if rounds else None
    total = GenerationStats()
    for f in dataclasses.fields(GenerationStats):
        if f.name == "ttft_s":
            total.ttft_s = rounds[0].ttft_s
        elif isinstance(getattr(rounds[0], f.name), list):  # gammas, trace: one after the other
            setattr(total, f.name, [x for s in rounds for x in getattr(s, f.name)])
        else:
            setattr(total, f.name, sum(getattr(s, f.name) for s in rounds))
    return total
