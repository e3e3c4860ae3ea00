"""A conversation in text: the turn loop of a call without STT or TTS.

    conv = TextConversation(config, backend, count_tokens, toolbox=box, guard=FactGuard(config.business))
    turn = await conv.turn("Can I book the Tuesday slot? I'm Ann.")
    turn.agent        # what the caller would have heard
    turn.as_dict()    # {"caller", "agent", "tools", "guarded", "first_sentence_ms", ...}

Each turn is what `Call._answer` does with a caller's transcript: the history's messages
(the same system prompt, so the warmed prompt K/V is reused), the respond stage (LLM
groups -> sentences, the tool rounds with the call's ToolBox, the hold line), the fact
guard on every sentence of the model's, and the history keeping what was said. It is
what `specvoice chat` runs, so a business file can be tried before it goes on a phone
line, and what the answer benchmarks play.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llm.types import SamplingParams
from pipeline.agent import sampling_params
from pipeline.receptionist.prompt import system_prompt
from pipeline.config import Config
from pipeline.receptionist.guard import FactGuard, turn_guard
from pipeline.ports import LLMBackend, ToolRunner
from pipeline.sentences import SentenceSplitter
from pipeline.stages.respond import respond
from pipeline.timeline import TurnTimeline
from pipeline.turn import History, LLMResult, Reply

__all__ = ["TextConversation", "TextTurn"]


@dataclass
class TextTurn:
    index: int
    caller: str
    agent: str  # the sentences handed to TTS on a call, joined: what the caller hears
    result: LLMResult
    timeline: TurnTimeline
    events: list[tuple[str, float, dict]] = field(default_factory=list)  # (kind, monotonic time, data)

    @property
    def first_sentence_ms(self) -> float | None:
        """LLM request -> the first sentence handed on (the hold line, when one was said)."""
        v = self.timeline.metrics().get("first_sentence_latency")
        return None if v is None else round(v * 1000, 1)

    @property
    def model_first_sentence_ms(self) -> float | None:
        """LLM request -> the first sentence that was not the hold line."""
        start = self.timeline.get("llm_request")
        times = [t for kind, t, _ in self.events if kind == "sentence"]
        times = times[1:] if self.result.hold_line_t is not None else times
        return None if start is None or not times else round((times[0] - start) * 1000, 1)

    def tools(self) -> list[dict]:
        return [{"name": c["name"], "arguments": c["arguments"],
                 "result": c["result"] if c["ok"] else {"error": c["error"]}} for c in self.result.tool_calls]

    def as_dict(self) -> dict:
        r = self.result
        return {"turn": self.index, "caller": self.caller, "agent": self.agent, "tools": self.tools(),
                "guarded": list(r.guarded), "first_sentence_ms": self.first_sentence_ms,
                "plan": r.plan, "hold_line": r.hold_line_t is not None, "action": r.action,
                "finish_reason": r.finish_reason,
                "error": r.error}


class TextConversation:
    """One caller's conversation with the agent, text in and out. One backend per
    conversation (its KV cache follows the conversation, as on a call)."""

    def __init__(self, config: Config, backend: LLMBackend, count_tokens: Callable[[list[dict]], int], *,
                 toolbox: ToolRunner | None = None, guard: FactGuard | None = None, greeting: str = "",
                 prompt: str | None = None, params: SamplingParams | None = None):
        self.config = config
        self.backend = backend
        self.toolbox = toolbox
        self.guard = guard
        self.params = sampling_params(config) if params is None else params
        self.history = History(system_prompt(config) if prompt is None else prompt, config.agent.history_tokens,
                               count_tokens)
        if greeting:
            self.history.add_agent(greeting)  # as a call that greets: the model sees it said it
        self.turns: list[TextTurn] = []
        self.ended: str | None = None  # "transfer" / "end_call": a tool ended the call

    async def turn(self, line: str) -> TextTurn:
        messages = self.history.messages(line)
        timeline, result = TurnTimeline(index=len(self.turns)), LLMResult()
        events: list[tuple[str, float, dict]] = []
        p = self.config.pipeline
        await respond(self.backend, messages, Reply(
            timeline, llm=result, params=self.params, splitter=SentenceSplitter(p.first_clause, p.first_clause_min_words),
            turn=len(self.turns), emit=lambda e: events.append((e.kind, time.monotonic(), e.as_dict())),
            toolbox=self.toolbox, hold_line=self.config.tools.hold_line if self.toolbox is not None else "",
            guard=turn_guard(self.guard, line, result, self.toolbox, self.history.exchanges),
            plan=self.config.tools.plan, caller_text=line, greet_back=self.config.agent.greet_back))
        said = " ".join(result.sentences)
        # What the caller heard, as a call keeps it.
        self.history.add(line, said, result.tool_messages, result.written_if_heard(said))
        turn = TextTurn(len(self.turns), line, said, result, timeline, events)
        self.turns.append(turn)
        if result.action is not None:
            self.ended = result.action
        return turn

