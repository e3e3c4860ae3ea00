"""The stream one turn's answer takes on its way to the speaker: model text -> (tool-call
filter) -> sentence splitter -> (fact guard) -> sentence queue, over one or more rounds
(generations). The respond stage drives it; the tool and plan steps (tools_step.py,
plan_step.py) run their rounds through it. Its own module so that those steps and
respond.py do not import each other.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

from llm.tool_calls import ToolCallFilter, ToolCallParse
from llm.types import GenerationStats, SamplingParams
from pipeline.events import CallEvent, HoldLine, LLMText, SentenceGuarded, SentenceReady
from pipeline.ports import LLMBackend
from pipeline.turn import BargeIn, LLMResult, Reply

__all__ = ["AnswerStream"]

# A sentence that ends: its terminator, then any closing quotes or brackets.
_ENDED = re.compile(r"[.!?…][\"'”’»)\]}]*\s*$")


@dataclass
class AnswerStream:
    """One turn's LLM output on its way to the speaker, over one or more rounds
    (generations): text -> (tool-call filter) -> splitter -> sentence queue."""

    backend: LLMBackend
    reply: Reply  # the turn's: timeline, barge-in, results, hold line, guard, sentence queue
    params: SamplingParams = field(init=False)  # the reply's, unless a step swaps them for a round (plan_step)
    rounds: list[GenerationStats] = field(default_factory=list)  # one per finished generation
    # The last round's text as the model wrote it, tool calls included (the tool step puts it
    # in the history so that the next round's prompt starts with the tokens already in the
    # KV cache; see llm.engine.template_messages).
    written: str = ""
    _before: Any = None  # the backend's stats before the live round: ours is the next to appear
    _live: bool = False
    _held: bool = False
    _after_line: bool = False

    def __post_init__(self) -> None:
        self.params = self.reply.params

    @property
    def result(self) -> LLMResult:
        return self.reply.llm

    @property
    def barge_in(self) -> BargeIn:
        return self.reply.barge_in

    def emit(self, event: CallEvent) -> None:
        self.reply.emit(event)

    async def round(self, messages: list[dict], filt: ToolCallFilter | None = None) -> tuple[str, ToolCallParse]:
        """Generate once; speak what may be spoken (the end of the round flushes the
        splitter: the caller hears "Let me check" before a tool runs). Returns the round's
        speakable text and what the filter held back."""
        self._before, self._live = self.backend.last_stats, True
        said, written = [], []
        self.written, finish = "", None
        try:
            async with contextlib.aclosing(self.backend.stream(messages, self.params, self.barge_in.event)) as stream:
                async for group in stream:
                    self.reply.timeline.mark("first_token", min(group.timestamp, time.monotonic()))
                    self.result.groups += 1
                    if group.finish_reason:
                        self.result.finish_reason = finish = group.finish_reason
                    if not group.text or self.barge_in.fired:
                        continue
                    written.append(group.text)
                    said.append(self.say(filt.feed(group.text) if filt is not None else group.text))
                    if filt is not None and filt.holding and self.reply.hold_line and not self._held:
                        self._hold()
            parse = ToolCallParse()
            if filt is not None:
                tail, parse = filt.finish()
                # Calls the server parsed itself (OpenAI `tool_calls`, llm/openai_backend.py)
                # come from the backend; the filter's parse is for calls written as text.
                parsed = self.backend.last_tool_parse
                if parsed is not None and parsed.found:
                    parse = parsed
                if not self.barge_in.fired:
                    said.append(self.say(tail))
            if not self.barge_in.fired:
                self.flush(cut=finish == "length")
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
            self.line(self.reply.hold_line)
            self.emit(HoldLine(self.reply.turn, self.reply.hold_line))

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
            self.emit(LLMText(self.reply.turn, text))
            for sentence in self.reply.splitter.feed(text):
                self._hand(sentence)
        return text

    def flush(self, cut: bool = False) -> None:
        """Hand on what the splitter holds. `cut`: the token limit ended the round, so an
        unfinished last sentence is not spoken (LLMResult.cut_short), unless it is all the
        turn has to say: a run-on answer beats silence."""
        sentences = self.reply.splitter.flush()
        if cut and sentences and not _ENDED.search(sentences[-1]) and (self.result.sentences or len(sentences) > 1):
            self.result.cut_short = sentences.pop()
        for sentence in sentences:
            self._hand(sentence)

    def line(self, sentence: str) -> None:
        """A fixed sentence of ours (not the model's), spoken after whatever is pending."""
        self.flush()
        self.result.text += (" " if self.result.text and not self.result.text.endswith(" ") else "") + sentence
        self._after_line = True
        self._hand(sentence, ours=True)

    def _hand(self, sentence: str, ours: bool = False) -> None:
        if self.reply.guard is not None and not ours:
            said = self.reply.guard(sentence)
            if said != sentence:
                self.emit(SentenceGuarded(self.reply.turn, sentence, said))
            if said is None:
                return
            sentence = said
        self.reply.timeline.mark("first_sentence")
        self.result.sentences.append(sentence)
        self.reply.sentences.put_nowait(sentence)
        self.emit(SentenceReady(self.reply.turn, sentence))
