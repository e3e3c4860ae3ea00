"""The plan step of a turn ([tools] plan): one constrained generation whose first line is
the turn's plan (pipeline/receptionist/plan.py), then the database acts, then the caller hears what
it did.

    {"act": "answer"}\\nWe're open until 6.     -> the line after the plan is spoken as it comes
    {"act": "book", "slot": ..., "name": ...}  -> ToolBox.book_slot -> "You're booked for ..."

The plan line is never spoken (`PlanFilter`). The grammar is built at the start of the
turn from the database's open slots, so a plan can only name a slot that was open then;
one taken by another caller since is refused by the database (its unique index), and
the turn says so and offers the slots open now. When the act is an action and nothing
was said yet, the hold line goes out while the plan's slot and name are written.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from dataclasses import dataclass

from llm.tool_calls import ToolCallParse
from llm.types import Constraint, SamplingParams
from pipeline.events import ToolResult
from pipeline.ports import ToolRunner
from pipeline.receptionist.caller import agent_before, caller_lines
from pipeline.receptionist.plan import (ANSWER_LINE, ANSWER_ONLY_GRAMMAR, Outcome, act, allowed_acts, parse_plan,
                                        plan_grammar, plan_slots)
from pipeline.stages.answer import AnswerStream

log = logging.getLogger(__name__)

__all__ = ["PlanFilter", "PlanRequest", "first_round", "plan_request", "plan_turn"]

# Said when the plan could not be made (the model or the grammar failed mid-line).
PLAN_FAILED = "Sorry, could you say that again?"
_ACT = re.compile(r'\s*\{\s*"act"\s*:\s*"(\w+)"')
_BOOKING_ACTS = ("book", "move", "cancel")


class PlanFilter:
    """Holds back the plan line; lets the answer after an answer plan through as it comes.
    Text that does not open with a plan (a backend that ignored the constraint) is all
    answer. Same interface as llm.tool_calls.ToolCallFilter (AnswerStream.round)."""

    def __init__(self) -> None:
        self.text = ""  # everything the model wrote this round
        self.act: str | None = None
        self._state = "head"  # head -> answer | action | free
        self._cut = False  # the answer ended where the model began another plan line

    def feed(self, text: str) -> str:
        self.text += text
        if self._state == "answer":
            return self._answer(text)
        if self._state == "free":
            return text
        if self._state == "action":
            return ""
        head = self.text.lstrip()
        if head and not head.startswith("{"):
            self._state = "free"
            return self.text
        m = _ACT.match(self.text)
        if m and self.act is None:
            self.act = m.group(1)
            if self.act != "answer":
                self._state = "action"
                return ""
        if self.act == "answer" and "\n" in self.text:
            self._state = "answer"
            return self._answer(self.text.partition("\n")[2])
        return ""

    def _answer(self, text: str) -> str:
        """The answer as it comes, up to a plan line the model began after it ("UPS\n\n{"act":
        "end_call"}" was held back whole as markup, and the caller heard the fallback for a
        right answer: specvoice chat, shop). Markup is never spoken; the answer before it is."""
        if self._cut:
            return ""
        i = text.find("{")
        if i < 0:
            return text
        self._cut = True
        return text[:i]

    @property
    def holding(self) -> bool:
        """An action's plan is being written (AnswerStream says the hold line then). Not
        for ending the call: "One moment, please. Goodbye." (specvoice chat) asks the
        caller to wait for nothing."""
        return self._state == "action" and self.act != "end_call"

    def finish(self) -> tuple[str, ToolCallParse]:
        if self._state == "head":  # no complete plan line: whatever it was, it is the answer
            parse = parse_plan(self.text)
            return (parse.answer if parse.plan is None or parse.plan.act == "answer" else ""), ToolCallParse()
        return "", ToolCallParse()


@dataclass
class PlanRequest:
    """A plan turn's one generation: the messages and constraint it runs on, the acts the
    turn allows, the slots the grammar was built from (None: none read), and the text the
    reply starts with already (the answer line a prefilling backend is given)."""

    messages: list[dict]
    constraint: Constraint | None
    acts: tuple[str, ...]
    open_slots: list[str] | None
    given: str = ""


def plan_request(messages: list[dict], caller_text: str, store, prefills: bool) -> PlanRequest:
    """What a plan turn on `messages` generates from (reads the database's open slots when
    the turn may act). A pure function of the messages and the database: a preemptive
    start (stages/preempt.py) runs the very request its turn would, or is not kept."""
    callers = caller_lines(messages)
    acts = allowed_acts(caller_text, callers or [caller_text], agent_before(messages))
    slots = None
    if any(a in _BOOKING_ACTS for a in acts):
        slots = plan_slots(store)
        if not slots[1]:
            # A business with no slots at all (an online shop) has nothing to book, move or
            # cancel: "Can I change the delivery address of order 48213?" was planned as a
            # move and answered "Sorry, we don't have that time, and no slot is open right
            # now." (specvoice chat, shop).
            acts = tuple(a for a in acts if a not in _BOOKING_ACTS)
    if acts == ("answer",):
        # Nothing the caller said asks for an action: the plan line is ours to write, not the
        # model's to choose. The prompt ends with it (a backend that prefills: the model
        # writes free text after it, unmasked, drafted as any answer), else a grammar forces
        # it. No slot is read. Not left out: under a prompt that says every reply starts
        # with a plan, the 1.5B answered plain questions with the fallback without one.
        if prefills:
            return PlanRequest([*messages, {"role": "assistant", "content": ANSWER_LINE, "prefix": True}], None, acts,
                               None, ANSWER_LINE)
        return PlanRequest(messages, Constraint.grammar(ANSWER_ONLY_GRAMMAR), acts, None)
    open_slots, all_slots = slots or plan_slots(store)
    return PlanRequest(messages, Constraint.grammar(plan_grammar(open_slots, all_slots, acts)), acts, open_slots)


def first_round(messages: list[dict], text: str, toolbox: ToolRunner | None, plan: bool, prefills: bool,
                params: SamplingParams) -> tuple[list[dict], SamplingParams]:
    """What a turn on `messages` (the caller said `text`) first sends the backend, as
    respond() would: with an answer plan, its prefilled line or grammar (read from the
    database now); a preemptive start runs exactly this (stages/preempt.py)."""
    if toolbox is None or not plan:
        return messages, params
    request = plan_request(messages, text, toolbox.store, prefills)
    return request.messages, dataclasses.replace(params, constraint=request.constraint)


async def plan_turn(answer: AnswerStream, messages: list[dict], toolbox: ToolRunner, caller_text: str = "") -> None:
    result = answer.result
    start = time.monotonic()
    callers = caller_lines(messages)
    request = await asyncio.to_thread(plan_request, messages, caller_text, toolbox.store, answer.backend.prefills)
    acts, open_slots, constraint, messages = request.acts, request.open_slots, request.constraint, request.messages
    filt = PlanFilter()
    if request.given:
        filt.feed(request.given)
    params = answer.params
    answer.params = dataclasses.replace(params, constraint=constraint)
    try:
        await answer.round(messages, filt)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        # The model or its constraint failed mid-plan: nothing we could act on was decided.
        # Ask again rather than leave the caller with the hold line alone.
        log.exception("plan round failed")
        result.error, result.finish_reason = f"plan: {type(exc).__name__}: {str(exc)[:300]}", "error"
        result.plan = {"act": None, "acts": list(acts), "error": result.error,
                       "line": filt.text.partition("\n")[0][:400]}
        answer.line(PLAN_FAILED)
        return
    finally:
        answer.params = params
    parse = parse_plan(filt.text)
    result.plan = {"act": parse.plan.act if parse.plan else None,
                   **({k: v for k, v in dataclasses.asdict(parse.plan).items() if v and k != "act"}
                      if parse.plan else {}),
                   "acts": list(acts), "open_slots": None if open_slots is None else len(open_slots),
                   "error": parse.error,
                   "line": filt.text.partition("\n")[0][:400],
                   "plan_ms": round((time.monotonic() - start) * 1000, 1)}
    if answer.barge_in.fired or result.finish_reason in ("cancelled", "error"):
        return
    if parse.plan is None and filt.act not in (None, "answer") or parse.plan is not None and parse.plan.act not in acts:
        # An action's line left unfinished (the token budget ran out), or one the turn does
        # not allow (a backend that ignored the grammar): nothing is done.
        answer.line(PLAN_FAILED)
        return
    if parse.plan is None or parse.plan.act == "answer":
        # The answer was spoken as it came (through the fact guard). The history keeps the
        # turn as written, plan line included, so that the next turn's prompt starts with
        # the tokens already in the KV cache (History.add uses it when the caller heard it all).
        result.written = filt.text
        return
    t = result.acted_t = time.monotonic()
    try:
        outcome = await asyncio.to_thread(act, parse.plan, toolbox, caller_text, callers or [caller_text],
                                          agent_before(messages))
    except Exception as exc:  # act never raises by design; a turn must survive if it does
        log.exception("plan act %s failed", parse.plan.act)
        outcome = Outcome("Sorry, I couldn't do that just now. I can take a message instead.")
        result.error = f"plan: {type(exc).__name__}: {exc}"
    end = time.monotonic()
    for o in outcome.calls:
        result.tool_calls.append({"name": o.name, "arguments": o.arguments, "ok": o.ok, "result": o.result,
                                  "error": o.error, "elapsed_ms": round(o.elapsed_ms, 3), "action": o.action,
                                  "reason": o.reason, "round": 0, "start": t, "end": end})
        answer.emit(ToolResult(answer.reply.turn, o.name, o.ok, o.error, o.elapsed_ms))
    # For the model's later turns: what it decided and what the database said, as a tool
    # round in the history (as a call with tool calls keeps it).
    if outcome.calls:
        result.tool_messages += [
            {"role": "assistant", "content": "", "as_written": filt.text,
             "tool_calls": [{"id": f"plan_{i}", "type": "function",
                             "function": {"name": o.name, "arguments": json.dumps(o.arguments, ensure_ascii=False)}}
                            for i, o in enumerate(outcome.calls)]},
            *({"role": "tool", "tool_call_id": f"plan_{i}", "name": o.name, "content": o.content()}
              for i, o in enumerate(outcome.calls))]
    if outcome.action is not None:
        result.action, result.action_reason = outcome.action, outcome.reason
    if not outcome.stays_done:
        # It asked (a name, which slot, whether to take a message) or was refused: nothing
        # the caller would have to undo, so the turn may still be taken back when they go on
        # (pipeline/stages/take_back.py; "... a cleaning for | next Tuesday morning" was
        # answered as two turns because a plan that only asked for a name counted as acted).
        result.acted_t = None
    answer.line(outcome.line)
