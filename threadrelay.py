"""One thread-to-asyncio relay: a blocking iterator run in a worker thread, its items
handed to the event loop as they come.

    async for item in relay(lambda stop: engine.stream(prompt, stop=stop), executor):
        ...

Both the LLM stage (one TokenGroup per target pass) and TTS (one audio chunk at a time)
produce from a worker thread; they share this module so that neither `llm/` nor `voice/`
imports the other. It imports nothing of the project.

Closing the async iterator (barge-in, hang-up) sets the `stop` event the producer was
given, drops whatever it yields after that, and waits for the worker to return, so no
work outlives its consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from typing import TypeVar

__all__ = ["relay"]

T = TypeVar("T")
_DONE = object()


async def relay(
    produce: Callable[[threading.Event], Iterator[T]],
    executor: Executor | None = None,
) -> AsyncIterator[T]:
    """Iterate `produce(stop)` in a worker of `executor` (default: the loop's) and yield
    its items on the loop. An exception in the producer is raised here, in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def work() -> None:
        try:
            for item in produce(stop):
                if stop.is_set():
                    break
                loop.call_soon_threadsafe(queue.put_nowait, item)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer to re-raise
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

    worker = loop.run_in_executor(executor, work)
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        with contextlib.suppress(BaseException):  # its failure, if any, was raised above
            await asyncio.shield(worker)
