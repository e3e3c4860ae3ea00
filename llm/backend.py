"""The LLM backend interface and its in-process implementation.

    backend.stream(messages, params, cancel) -> async iterator of TokenGroup

The speculative engine runs in a worker thread (torch releases the GIL in its
kernels), so the event loop stays free for audio while the model thinks. Groups cross
to the loop through a queue as each target pass finishes. Cancelling (an asyncio or
threading Event, or closing the iterator) stops the engine between passes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Protocol

from llm.engine import Conversation, SpeculativeEngine
from llm.types import GenerationStats, SamplingParams, TokenGroup


class LLMBackend(Protocol):
    def stream(
        self, messages: list[dict], params: SamplingParams, cancel: asyncio.Event | threading.Event | None = None
    ) -> AsyncIterator[TokenGroup]: ...


class SpeculativeBackend:
    """One conversation (one call) on a shared engine: its KV cache lives across turns."""

    def __init__(self, engine: SpeculativeEngine, conversation: Conversation | None = None):
        self.engine = engine
        self.conversation = conversation or engine.new_conversation()
        self.last_stats: GenerationStats | None = None

    async def stream(
        self, messages: list[dict], params: SamplingParams, cancel: asyncio.Event | threading.Event | None = None
    ) -> AsyncIterator[TokenGroup]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        prompt = await asyncio.to_thread(self.engine.chat_prompt, messages)
        done = object()

        def produce() -> None:
            try:
                for group in self.engine.stream(prompt, params, self.conversation, stop):
                    loop.call_soon_threadsafe(queue.put_nowait, group)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer to re-raise
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, done)

        async def relay_cancel() -> None:
            if isinstance(cancel, asyncio.Event):
                await cancel.wait()
            else:
                while not cancel.is_set():
                    await asyncio.sleep(0.01)
            stop.set()

        watcher = asyncio.create_task(relay_cancel()) if cancel is not None else None
        worker = loop.run_in_executor(None, produce)
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()  # the consumer went away (barge-in, hang-up): stop at the next pass
            if watcher is not None:
                watcher.cancel()
            await asyncio.shield(worker)
            self.last_stats = self.conversation.last_stats
