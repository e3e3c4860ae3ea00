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
import dataclasses
import logging

from llm.types import GenerationStats
from pipeline.ports import LLMBackend
from pipeline.receptionist.caller import own_reply
from pipeline.stages.answer import AnswerStream
from pipeline.stages.plan_step import plan_turn
from pipeline.stages.tools_step import tool_turn
from pipeline.turn import Reply

log = logging.getLogger(__name__)

__all__ = ["merge_stats", "respond"]


async def respond(backend: LLMBackend, messages: list[dict], reply: Reply) -> Reply:
    """Stream the answer; put each sentence into `reply.sentences`, then None. Fills
    `reply.llm` as it goes (text, sentences, finish reason, stats, passes at a barge-in,
    error, tool calls), so that a hang-up mid-answer still leaves what was said. With
    `reply.toolbox` the model may call tools between rounds (or, with `reply.plan`, the turn
    is decided as a constrained plan and acted on, stages/plan_step.py); the hold line is
    said when the model starts a call before it said anything (AnswerStream.round).
    `reply.guard` judges each of the model's sentences before TTS."""
    answer = AnswerStream(backend, reply)
    result, timeline, barge_in = reply.llm, reply.timeline, reply.barge_in

    async def note_barge_in() -> None:
        await barge_in.event.wait()
        result.passes_at_barge_in = answer.passes_so_far()

    watcher = asyncio.create_task(note_barge_in())
    timeline.mark("llm_request")
    try:
        own = own_reply(reply.caller_text, messages) if reply.greet_back else None
        if own is not None:
            # A greeting, or the caller's own name asked for: said in our words, no model
            # time (receptionist/caller.py).
            answer.line(own)
        elif reply.toolbox is None:
            await answer.round(messages)
        elif reply.plan:
            await plan_turn(answer, messages, reply.toolbox, reply.caller_text)
        else:
            await tool_turn(answer, messages, reply.toolbox)
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
        reply.sentences.put_nowait(None)
    return reply


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
