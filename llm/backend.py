"""The in-process LLM backend (the interface, `LLMBackend`, is in llm/types.py).

    backend.stream(messages, params, cancel) -> async iterator of TokenGroup
    SpeculativeBackend(engine, tools=TOOL_SCHEMAS)   # the model may call tools (llm/tool_calls.py)

The speculative engine runs in a worker thread (torch releases the GIL in its
kernels), so the event loop stays free for audio while the model thinks. Groups cross
to the loop through one relay (threadrelay) as each target pass finishes. Cancelling (an asyncio or
threading Event, or closing the iterator) stops the engine between passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Iterator

from llm.decoder import Observe
from llm.engine import Conversation, SpeculativeEngine
from llm.types import GenerationStats, LLMBackend, SamplingParams, TokenGroup, WordsEnd
from llm.voice_first import VoiceFirst
from threadrelay import relay


class SpeculativeBackend:
    """One conversation (one call) on a shared engine: its KV cache lives across turns."""

    def __init__(self, engine: SpeculativeEngine, conversation: Conversation | None = None,
                 tools: list[dict] | None = None, tool_values: dict[str, list[str]] | None = None,
                 voice_first: bool | None = None):
        self.engine = engine
        self.conversation: Conversation | None = conversation or engine.new_conversation()
        if tools:  # the calls' JSON is drafted from the schemas too (llm/call_drafter.py)
            engine.draft_calls(self.conversation, tools, tool_values)
        # OpenAI "tools" entries rendered into every prompt by the chat template (the same
        # list every turn, so the system block, and its cached K/V, stay the same).
        self.tools = tools
        self.last_tool_parse = None  # calls are written as text here: the respond stage parses them
        self.prefills = True  # the engine ends the prompt with a reply's given start
        self.scores_words_end = True  # a cancel's `words_end` is scored from the stream's prefill
        # While the call's speaker makes an answer's first audio, this conversation's next
        # pass waits (llm/voice_first.py): the caller waits for that audio, not the next
        # sentence. None (the default): so only where the model's passes take every core; with
        # a core to spare (llm.threads below the cores) the voice runs beside them.
        if voice_first is None:
            voice_first = engine.scheduler.threads >= (os.cpu_count() or 1)
        self.voice_first: VoiceFirst | None = VoiceFirst() if voice_first else None

    async def prefill(self, messages: list[dict], cancel: asyncio.Event | threading.Event | None = None) -> int:
        """Compute the K/V of the prompt of `messages` up to the words of the last one so
        far (engine.open_prompt): a caller's turn while they still speak, so that the turn's
        prompt prefills only the rest. Nothing is generated or said; the conversation stays
        exact (every later prompt reuses only its common prefix). Returns the tokens cached."""
        if self.conversation is None:
            raise RuntimeError("this backend was closed")
        conversation = self.conversation
        prompt = await asyncio.to_thread(self.engine.open_prompt, messages, self.tools)
        return await asyncio.to_thread(self.engine.prefill, prompt, conversation, _Stop(cancel))

    @property
    def last_stats(self) -> GenerationStats | None:
        return self.conversation.last_stats if self.conversation is not None else None

    async def aclose(self) -> None:
        """The call is over: free its conversation (the KV cache) now."""
        self.conversation = None

    async def stream(
        self, messages: list[dict], params: SamplingParams, cancel: asyncio.Event | threading.Event | None = None
    ) -> AsyncIterator[TokenGroup]:
        if self.conversation is None:
            raise RuntimeError("this backend was closed")
        conversation = self.conversation
        prompt = await asyncio.to_thread(self.engine.chat_prompt, messages, True, self.tools)
        observe = await self._words_end(getattr(cancel, "words_end", None), prompt)
        stop = _Stop(cancel)
        try:
            async with contextlib.aclosing(
                relay(lambda _closed: _after_voice(self.engine.stream(prompt, params, conversation, stop, observe=observe),
                                                   self.voice_first))
            ) as groups:
                async for group in groups:
                    yield group
        finally:
            stop.closed.set()  # the consumer went away (barge-in, hang-up): stop at the next pass

    async def _words_end(self, request: WordsEnd | None, prompt: list[int]) -> Observe | None:
        """The row of `prompt` where the caller's words end (request.messages' open prompt,
        when it is a prefix of `prompt`), to be scored by the prefill (llm.types.WordsEnd)."""
        if request is None:
            return None
        words = await asyncio.to_thread(self.engine.open_prompt, request.messages, self.tools)
        if len(words) < 2 or prompt[:len(words)] != words:
            return None
        engine = self.engine
        return Observe(len(prompt) - len(words), lambda row: request.report(engine.end_mass(row)))


def _after_voice(groups: Iterator[TokenGroup], gate: VoiceFirst | None) -> Iterator[TokenGroup]:
    """`groups`, each pass started only once the call's first audio is not being made (gate)."""
    if gate is None:
        yield from groups
        return
    with contextlib.closing(groups):
        while True:
            gate.wait()
            try:
                group = next(groups)
            except StopIteration:
                return
            yield group


class _Stop:
    """What the engine checks between passes: the caller's cancel (asyncio or threading
    Event; reading a flag is safe from the worker thread) or the stream being closed."""

    def __init__(self, cancel: asyncio.Event | threading.Event | None):
        self.cancel = cancel
        self.closed = threading.Event()

    def is_set(self) -> bool:
        return self.closed.is_set() or (self.cancel is not None and self.cancel.is_set())

    @property
    def background(self) -> bool:
        """The caller's cancel marks a preemptive answer (pipeline/stages/preempt.py Stop)."""
        return bool(getattr(self.cancel, "background", False))


__all__ = ["LLMBackend", "SpeculativeBackend"]
