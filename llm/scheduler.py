"""One engine thread owns the model; conversations submit their passes to it.

    runner = PassScheduler(lock)
    result, info = runner.run(prepare, finish, hint)   # from a conversation's thread; blocks

A conversation's pass is two callbacks, both run on the engine thread:

- `prepare(load) -> Piece`: draft (the draft model runs here too) and name the rows the
  target must run: `Piece(model, Segment(cache, tokens, start, all_logits))`. `load` tells
  it what the other conversations of this pass bring (`llm.gamma.Load`), so it can
  choose its gamma for the batch it is in.
- `finish(logits) -> result`: the verdict from this conversation's rows of logits.

The loop takes every pass waiting at that moment (and, for up to `gather_s`, waits for
the active conversations that have not submitted yet: after a pass they all wake
together), prepares each, runs the target rows of all of them as ONE forward
(`llm.model.forward_many`: linears over all rows, attention per conversation), and
finishes each. A fixed-width (static) cache runs its own step, alone, in the same round.
Conversations join and leave between passes. Every torch operation of a generation runs
on this one thread: the OpenMP teams of waiting threads no longer spin against it.

Each round holds the engine's pass lock (a FIFO lock; tests wrap it to pace passes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from llm.cuda_graphs import synchronize
from llm.gamma import Load
from llm.model import Segment, Transformer, forward, forward_many

log = logging.getLogger(__name__)


@dataclass
class Piece:
    """What one conversation puts into a pass: its target rows, and for the others' gamma
    choice, the tokens it expects from them and the time its drafting took."""

    model: Transformer
    segment: Segment
    expected_tokens: float = 1.0
    draft_s: float = 0.0


@dataclass(frozen=True)
class PassInfo:
    """The target pass a conversation's rows ran in."""

    seconds: float  # the forward over all its rows
    rows: int  # rows of every conversation in it
    conversations: int


@dataclass
class _Work:
    prepare: Callable[[Load], Piece | None]
    finish: Callable[[torch.Tensor], Any]
    hint: Load  # what this conversation brought to its last pass (before it prepares this one)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    info: PassInfo | None = None
    error: BaseException | None = None
    piece: Piece | None = None


class SoloRunner:
    """Passes run on the caller's thread, one at a time behind a lock (no engine thread)."""

    def __init__(self, lock=None):
        self.lock = lock if lock is not None else threading.Lock()

    def run(self, prepare, finish, hint: Load | None = None):
        with self.lock:
            piece = prepare(Load())
            seg = piece.segment
            t0 = time.perf_counter()
            logits = forward(piece.model, seg.cache, seg.tokens, seg.start, seg.all_logits)
            synchronize(piece.model.device)
            info = PassInfo(time.perf_counter() - t0, int(seg.tokens.shape[0]), 1)
            return finish(logits), info


class PassScheduler:
    """The engine thread: batches the passes of all conversations (see the module doc)."""

    def __init__(self, lock=None, gather_s: float = 0.002, batched: bool = True):
        self.lock = lock if lock is not None else threading.Lock()
        self.gather_s = gather_s
        self.batched = batched
        self._cond = threading.Condition()
        self._queue: list[_Work] = []
        self._active = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        # Counters (read by tests and benchmarks).
        self.passes = 0  # target forwards run
        self.rounds = 0
        self.batched_passes = 0  # forwards that carried the rows of 2+ conversations
        self.max_conversations = 0  # most conversations in one forward
        self.rows = 0  # target rows run, all passes

    # ---- conversations' side -------------------------------------------------------------
    @contextmanager
    def active(self):
        """A generation in progress: rounds wait (up to gather_s) for its next pass."""
        with self._cond:
            self._active += 1
        try:
            yield self
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def run(self, prepare: Callable[[Load], Piece | None], finish: Callable[[torch.Tensor], Any],
            hint: Load | None = None) -> tuple[Any, PassInfo | None]:
        """Submit one pass and wait for it: (finish's result, the pass it ran in)."""
        work = _Work(prepare, finish, hint or Load(rows=1, tokens=1.0))
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine's scheduler was closed")
            self._queue.append(work)
            self._cond.notify_all()
            self._start()
        work.done.wait()
        if work.error is not None:
            raise work.error
        return work.result, work.info

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn alone on the engine thread (a prefix's prefill, a calibration)."""
        box = {}

        def prepare(load) -> None:
            box["value"] = fn()

        self.run(prepare, lambda logits: None)
        return box["value"]

    def waiting(self) -> int:
        with self._cond:
            return len(self._queue)

    def wait_until_waiting(self, n: int, timeout: float = 30.0) -> bool:
        """Block until at least n passes wait for the engine thread (for tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._queue) >= n, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=10)

    # ---- the engine thread -------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="specvoice-engine", daemon=True)
            self._thread.start()

    def _take(self) -> list[_Work] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            if not self._queue:
                return None
            # The others finished the last pass with us: give their next pass a moment.
            deadline = time.monotonic() + self.gather_s
            while len(self._queue) < self._active and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    break
            works, self._queue = self._queue, []
            return works

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                works = self._take()
                if works is None:
                    return
                with self.lock:
                    # Passes submitted while the lock was held join this round.
                    with self._cond:
                        works += self._queue
                        self._queue = []
                    self._round(works)
                works = None  # nothing of a finished pass stays referenced while idle

    def _round(self, works: list[_Work]) -> None:
        self.rounds += 1
        prepared: list[_Work] = []
        for i, w in enumerate(works):
            others = [o for o in works if o is not w]
            rows = tokens = draft_s = 0.0
            for o in others:
                if o.piece is not None:  # prepared already: what it really brings
                    rows += o.piece.segment.tokens.shape[0]
                    tokens += o.piece.expected_tokens
                    draft_s += o.piece.draft_s
                else:
                    rows += o.hint.rows
                    tokens += o.hint.tokens
                    draft_s += o.hint.draft_s
            try:
                w.piece = w.prepare(Load(int(rows), tokens, draft_s))
            except BaseException as e:  # noqa: BLE001 - handed to the conversation that caused it
                w.error = e
                w.done.set()
                continue
            if w.piece is None:  # a job with no target rows
                w.done.set()
                continue
            prepared.append(w)
        groups: list[list[_Work]] = []
        for w in prepared:
            alone = not self.batched or w.piece.segment.cache.steps is not None
            for g in groups:
                if not alone and g[0].piece.model is w.piece.model and g[0].piece.segment.cache.steps is None:
                    g.append(w)
                    break
            else:
                groups.append([w])
        for g in groups:
            self._pass(g)

    def _pass(self, group: list[_Work]) -> None:
        model = group[0].piece.model
        segs = [w.piece.segment for w in group]
        rows = sum(int(s.tokens.shape[0]) for s in segs)
        try:
            t0 = time.perf_counter()
            if len(segs) == 1:
                s = segs[0]
                logits = [forward(model, s.cache, s.tokens, s.start, s.all_logits)]
            else:
                logits = forward_many(model, segs)
            synchronize(model.device)
            info = PassInfo(time.perf_counter() - t0, rows, len(segs))
        except BaseException as e:  # noqa: BLE001
            for w in group:
                w.error = e
                w.done.set()
            return
        self.passes += 1
        self.rows += rows
        self.max_conversations = max(self.max_conversations, len(segs))
        if len(segs) > 1:
            self.batched_passes += 1
        for w, out in zip(group, logits):
            w.info = info
            try:
                w.result = w.finish(out)
            except BaseException as e:  # noqa: BLE001
                w.error = e
            w.piece = None  # drop the tensors
            w.done.set()
