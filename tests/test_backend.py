"""The in-process LLM backend on a tiny model: the stream is the engine's, cancellation
(an asyncio Event, as the call passes its barge-in) stops it between passes, last_stats
follows the generation in progress, and aclose frees the conversation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from llm.backend import SpeculativeBackend
from llm.engine import SpeculativeEngine
from llm.types import LLMBackend, SamplingParams

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something long."}]


@pytest.fixture(scope="module")
def engine(tiny_models):
    return SpeculativeEngine.load(tiny_models["target"], dtype="float32", drafter="ngram", gamma=2)


async def test_stream_is_the_engines_own_generation(engine):
    params = SamplingParams(max_new_tokens=12)
    backend = SpeculativeBackend(engine)
    assert isinstance(backend, LLMBackend)
    groups = [g async for g in backend.stream(MESSAGES, params)]
    ids = [t for g in groups for t in g.token_ids]
    want, _, _ = engine.generate(engine.chat_prompt(MESSAGES), params)
    assert ids == want
    assert backend.last_stats is not None and backend.last_stats.new_tokens == len(ids)


async def test_asyncio_cancel_stops_between_passes_and_stats_are_live(engine):
    backend = SpeculativeBackend(engine)
    cancel = asyncio.Event()
    seen = []
    async with contextlib.aclosing(backend.stream(MESSAGES, SamplingParams(max_new_tokens=200), cancel)) as stream:
        async for group in stream:
            seen.append(group)
            if len(seen) == 2:
                live = backend.last_stats  # the generation in progress, counted by the engine
                assert live is not None and live.passes >= 2
                passes_at_cancel = live.passes
                cancel.set()
    assert seen[-1].finish_reason == "cancelled"
    # The engine checks the cancel before each pass: at most the pass it was in finished after it.
    assert backend.last_stats is live and live.passes <= passes_at_cancel + 1


async def test_aclose_frees_the_conversation(engine):
    backend = SpeculativeBackend(engine)
    _ = [g async for g in backend.stream(MESSAGES, SamplingParams(max_new_tokens=3))]
    await backend.aclose()
    assert backend.last_stats is None
    with pytest.raises(RuntimeError, match="closed"):
        _ = [g async for g in backend.stream(MESSAGES, SamplingParams(max_new_tokens=3))]
