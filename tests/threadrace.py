"""Threads racing each other, all let go at once: the double-booking and first-open races."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def race(n: int, call: Callable[[int], Any], *, catch: tuple[type[BaseException], ...] = ()) -> dict[int, Any]:
    """call(0) ... call(n - 1), each in a thread of its own, started together at a barrier.
    Returns {i: what call(i) returned, or the exception it raised of a type in `catch`}; a
    thread that raised anything else (or never finished) has no entry."""
    barrier = threading.Barrier(n)
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        barrier.wait(timeout=60)
        try:
            results[i] = call(i)
        except catch as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results
