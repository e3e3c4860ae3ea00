"""LLM stage: one turn's messages -> token groups -> complete sentences, each handed on
the moment it exists (the first one is what the caller waits for).

The backend streams one TokenGroup per target pass; the splitter declares a sentence as
soon as the text received proves it. A barge-in is passed to the backend as its cancel
event (the engine stops between passes) and ends the stream here; what was pending is
then not spoken. A failing model ends the turn with what it said so far and the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from llm.types import SamplingParams
from pipeline.ports import LLMBackend
from pipeline.sentences import SentenceSplitter
from pipeline.timeline import TurnTimeline
from pipeline.turn import BargeIn, LLMResult

log = logging.getLogger(__name__)

__all__ = ["respond"]


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
) -> LLMResult:
    """Stream the answer; put each sentence into `sentences`, then None. Fills `result` as
    it goes (text, sentences, finish reason, stats, passes at a barge-in, error), so that a
    hang-up mid-answer still leaves what was said; returns it."""
    before = backend.last_stats  # the previous generation's: ours is the next one to appear

    async def note_barge_in() -> None:
        await barge_in.event.wait()
        live = backend.last_stats
        result.passes_at_barge_in = live.passes if live is not None and live is not before else 0

    watcher = asyncio.create_task(note_barge_in())
    timeline.mark("llm_request")
    try:
        async with contextlib.aclosing(backend.stream(messages, params, barge_in.event)) as stream:
            async for group in stream:
                timeline.mark("first_token", min(group.timestamp, time.monotonic()))
                result.groups += 1
                if group.finish_reason:
                    result.finish_reason = group.finish_reason
                if not group.text or barge_in.fired:
                    continue
                result.text += group.text
                emit("llm_text", text=group.text)
                for sentence in splitter.feed(group.text):
                    _hand(sentence, result, sentences, timeline, emit)
        if not barge_in.fired:
            for sentence in splitter.flush():
                _hand(sentence, result, sentences, timeline, emit)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        # The model failed mid-answer: say what we have, record the error, go on.
        log.exception("LLM failed mid-answer")
        result.error = f"llm: {type(exc).__name__}: {exc}"
        result.finish_reason = "error"
        for sentence in splitter.flush():
            _hand(sentence, result, sentences, timeline, emit)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        stats = backend.last_stats
        result.stats = stats if stats is not before else None
        if "first_token" in timeline:
            timeline.mark("llm_done")
        sentences.put_nowait(None)
    return result


def _hand(sentence: str, result: LLMResult, sentences: asyncio.Queue, timeline: TurnTimeline,
          emit: Callable[..., None]) -> None:
    timeline.mark("first_sentence")
    result.sentences.append(sentence)
    sentences.put_nowait(sentence)
    emit("sentence", text=sentence)
