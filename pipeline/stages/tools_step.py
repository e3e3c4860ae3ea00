"""The tool step of a turn: generate, run the tool calls the model wrote, feed their
results back, generate again; at most `MAX_ROUNDS` tool rounds.

    round 0: "Let me check." <tool_call>{"name": "check_slots", ...}</tool_call>   (the tags unheard)
             -> ToolBox.run in a worker thread -> assistant tool-call message + tool message
    round 1: "Tuesday at nine is free. Shall I book it?"

A call that fails (bad JSON, unknown tool, wrong arguments, the tool's own error: a
ToolOutcome with ok False) is fed back to the model once as the tool's result; a second
failing round, or a model still calling tools after MAX_ROUNDS, ends the turn with the
fixed FALLBACK sentence: never a crash, never a silent success. A barge-in stops the loop
between rounds (a tool already running finishes: a booking is not torn in half). A tool
outcome with an action ("transfer", "end_call") ends the loop: the turn says a fixed line
(ACTION_LINES) unless the model already spoke in it, and the call acts once the turn has
been spoken. No round after it: given the transfer result, the 1.5B echoed the reason back
("I need help with my bill"); a fixed line is right every time and costs no generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from llm.tool_calls import ToolCall, ToolCallFilter, ToolCallParse
from pipeline.events import ToolCallRejected, ToolCallStarted, ToolResult
from pipeline.ports import LLMBackend, ToolRunner
from pipeline.receptionist.tools import TOOLS, stays_done
from pipeline.stages.answer import AnswerStream

log = logging.getLogger(__name__)

__all__ = ["ACTION_LINES", "FALLBACK", "MAX_ROUNDS", "result_line", "tool_names", "tool_turn"]

MAX_ROUNDS = 3
FALLBACK = "Sorry, I couldn't do that. Let me take a message instead."
# Said when a tool ends the call and the model said nothing in the turn before calling it.
ACTION_LINES = {"transfer": "Let me transfer you now.", "end_call": "Goodbye."}


async def tool_turn(answer: AnswerStream, messages: list[dict], toolbox: ToolRunner,
                    max_rounds: int = MAX_ROUNDS) -> None:
    result, barge_in = answer.result, answer.barge_in
    messages = list(messages)
    failures = 0
    names = tool_names(answer.backend)
    for n in range(max_rounds + 1):
        said, parse = await answer.round(messages, ToolCallFilter(tool_names=names))
        if barge_in.fired or result.finish_reason in ("cancelled", "error"):
            return
        if not parse.found:
            if result.tool_calls and not result.model_spoke:
                # Tools ran and the model then said nothing (bench tools: the 1.5B booked,
                # repeated the call, was refused, and went quiet): the caller must not be left
                # in silence. Say what the database did, from the tool results themselves.
                line = result_line(result.tool_calls)
                _fall_back(answer) if line == FALLBACK else answer.line(line)
            return
        if n == max_rounds:
            _record_refused(result, parse, n, f"more than {max_rounds} tool rounds in one turn")
            _fall_back(answer)
            return
        step, ok = await _run_round(said, parse, toolbox, n, answer)
        messages = messages + step  # a new list: a backend may keep the one it was given
        result.tool_messages += step
        if barge_in.fired:
            return
        if result.action is not None:
            if not result.model_spoke:
                answer.line(ACTION_LINES.get(result.action, ACTION_LINES["end_call"]))
            return
        if not ok:
            failures += 1
            if failures >= 2:
                _fall_back(answer)
                return


def tool_names(backend: LLMBackend) -> frozenset[str]:
    """The names the model may write a call with: the tool box's tools and those in the
    backend's schemas. The filter holds a call written in prose with one of them
    ("take_message, {...}"), which the 1.5B writes now and then, instead of speaking it."""
    schemas = backend.tools or ()
    return frozenset(TOOLS) | {t["function"]["name"] for t in schemas
                               if isinstance(t, dict) and isinstance(t.get("function"), dict)
                               and isinstance(t["function"].get("name"), str)}


async def _run_round(said: str, parse: ToolCallParse, toolbox: ToolRunner, n: int,
                     answer: AnswerStream) -> tuple[list[dict], bool]:
    """Run one round's calls; returns (the messages to append, all calls succeeded)."""
    result, emit, turn = answer.result, answer.emit, answer.reply.turn
    if parse.error is not None:
        # No call to run: the model gets its own text back with what was wrong with it.
        t = time.monotonic()
        result.tool_calls.append(_entry(None, parse.raw, False, None, parse.error, 0.0, None, None, n, t, t))
        emit(ToolCallRejected(turn, None, False, parse.error))
        return [{"role": "assistant", "content": (said.rstrip() + "\n" + parse.raw).strip(),
                 **_as_written(answer)},
                {"role": "tool", "content": json.dumps({"error": parse.error}, ensure_ascii=False)}], False
    # A server's own ids (OpenAI tool_calls) are kept: its tool messages must answer them.
    ids = [c.id or f"call_{len(result.tool_calls) + i}" for i, c in enumerate(parse.calls)]
    step: list[dict] = [{"role": "assistant", "content": said.strip(),
                         "tool_calls": [{"id": i, **c.message()} for i, c in zip(ids, parse.calls)],
                         **_as_written(answer)}]
    ok_all = True
    for call_id, call in zip(ids, parse.calls):
        entry = await _run_one(call, toolbox, n, answer)
        result.tool_calls.append(entry)
        ok_all &= entry["ok"]
        if entry["ok"] and entry["action"] and result.action is None:
            result.action, result.action_reason = entry["action"], entry["reason"]
        content = entry["result"] if entry["ok"] else {"error": entry["error"]}
        step.append({"role": "tool", "tool_call_id": call_id, "name": call.name,
                     "content": json.dumps(content, ensure_ascii=False, default=str)})
    if not any(stays_done(c["name"], c["ok"], c["action"]) for c in result.tool_calls):
        result.acted_t = None  # only read (check_slots) or refused: nothing stays done (take_back.py)
    return step, ok_all


def _as_written(answer: AnswerStream) -> dict:
    """The round's text exactly as the model wrote it (`as_written`), for a backend that
    renders the prompt itself: the 1.5B writes its calls as `{{"name": ...}}}}` (copying
    the braces of Qwen2.5's own tool instructions), so a call re-rendered from the parsed
    `tool_calls` (`<tool_call>\\n{"name": ...}}`) no longer matches the tokens in the KV cache
    and the next round read the whole call again (~40 tokens, ~0.6 s on the 2-core CPU).
    The OpenAI backend drops it (wire_messages): a server renders its own calls."""
    return {"as_written": answer.written} if answer.written.strip() else {}


async def _run_one(call: ToolCall, toolbox: ToolRunner, n: int, answer: AnswerStream) -> dict:
    answer.emit(ToolCallStarted(answer.reply.turn, call.name, call.arguments))
    start = time.monotonic()
    if answer.result.acted_t is None:
        answer.result.acted_t = start
    try:
        o = await asyncio.to_thread(toolbox.run, call.name, call.arguments)
        entry = _entry(o.name, o.arguments, o.ok, o.result, o.error, o.elapsed_ms, o.action, o.reason,
                       n, start, time.monotonic())
    except Exception as exc:  # the tool box promises not to raise; a turn must survive if it does
        log.exception("tool %s raised", call.name)
        end = time.monotonic()
        entry = _entry(call.name, call.arguments, False, None, f"{type(exc).__name__}: {exc}",
                       (end - start) * 1000, None, None, n, start, end)
    answer.emit(ToolResult(answer.reply.turn, entry["name"], entry["ok"], entry["error"], entry["elapsed_ms"]))
    return entry


def _entry(name: str | None, arguments: Any, ok: bool, result: Any, error: str | None, elapsed_ms: float,
           action: str | None, reason: str | None, n: int, start: float, end: float) -> dict:
    return {"name": name, "arguments": arguments, "ok": bool(ok), "result": result, "error": error,
            "elapsed_ms": round(float(elapsed_ms), 3), "action": action, "reason": reason,
            "round": n, "start": start, "end": end}


def _record_refused(result: Any, parse: ToolCallParse, n: int, why: str) -> None:
    t = time.monotonic()
    names = ", ".join(c.name for c in parse.calls) or None
    result.tool_calls.append(_entry(names, parse.raw, False, None, f"not run: {why}", 0.0, None, None, n, t, t))


def result_line(calls: list[dict]) -> str:
    """One true sentence about a turn's tool calls: the last call that changed something (or
    listed slots), from its result; FALLBACK if none succeeded."""
    for c in reversed(calls):
        r = c["result"] if c["ok"] and isinstance(c["result"], dict) else None
        if r is None:
            continue
        if r.get("booked"):
            return f"You're booked for {r['slot']}, under the name {r['name']}."
        if r.get("cancelled"):
            return f"Your booking for {r['slot']} is cancelled."
        if r.get("message_taken"):
            return "I've taken your message, and someone will call you back."
        if "open_slots" in r:
            slots = r["open_slots"]
            return f"The open slots are: {'; '.join(slots)}." if slots else "There are no open slots right now."
    return FALLBACK


def _fall_back(answer: AnswerStream) -> None:
    answer.result.fallback = True
    answer.line(FALLBACK)
