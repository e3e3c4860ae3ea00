"""Torch's cores belong to the engine thread.

On Linux torch runs its parallel ops on libgomp, which gives every thread that runs a
multi-threaded op a pool of OpenMP workers of its own, kept for that thread's life. Once
the process holds more OpenMP threads than cores, libgomp throttles every pool: a worker
spins about 100 iterations (a microsecond) instead of about 3 ms before it sleeps, so
each of a forward's ~400 parallel regions waits for a futex wake-up. A model loaded on
the main thread (one pool) and run on the engine thread (a second) paid that on every
pass: on a 2-core EPYC a 13-row prefill took 0.30-0.39 s against 0.21-0.23 s with one
pool, a 4-row verify 0.14-0.17 s against 0.09-0.12 s (the same forward, side by side).

So the engine thread runs torch with the cores (`claim`), models load on a thread that
ends with its pool (`on_own_thread`), and every thread that hands the engine work runs
torch single-threaded from then on (`release`): its small tensor work (token ids, a cache
to fill) needs no pool, and a pool it made would slow every pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["claim", "cores", "on_own_thread", "release"]

T = TypeVar("T")
_local = threading.local()


def cores() -> int:
    """The torch threads the calling thread asks for: its own setting, or the one it had
    before `release` made it single-threaded (a second engine loaded by the same thread
    gets the cores the first one got)."""
    n = torch.get_num_threads()
    return n if n > 1 else getattr(_local, "had", n)


def release() -> None:
    """This thread runs torch on one thread from now on (it creates no OpenMP pool). Also
    the default of threads that have not run torch yet: torch.set_num_threads sets both.
    Set even when this thread already runs on one: `claim` on the engine thread put the
    process default back to the cores, and a thread that then took it (an executor's,
    whose first torch op was a float matmul) made a second pool and throttled every pass
    (a 13-row prefill 0.31-0.47 s in a call against 0.21 s alone, on the slow EPYC)."""
    n = torch.get_num_threads()
    if n > 1:
        _local.had = n
    torch.set_num_threads(1)


def claim(n: int) -> None:
    """On the engine thread: run torch on `n` threads here. torch.get_num_threads() also
    settles this thread's setting now: torch copies the process default into a thread at
    its first parallel op, which would otherwise undo this if a `release` came between."""
    torch.set_num_threads(max(1, n))
    torch.get_num_threads()


def on_own_thread(fn: Callable[[], T], name: str = "specvoice-load") -> T:
    """fn() on a new thread, waited for: the OpenMP pool its torch ops make ends with the
    thread (loading a model packs every weight in parallel). Exceptions are re-raised here."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
