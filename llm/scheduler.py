"""One engine thread owns the model; conversations submit their passes to it.

    runner = PassScheduler(lock)
    result, info = runner.run(prepare, finish, hint)   # from a conversation's thread; blocks

A conversation's pass is two callbacks, both run on the engine thread:

- `prepare(load) -> Piece`: draft and name the rows the target must run:
  `Piece(model, Segment(cache, tokens, start, all_logits))`. `load` tells it what the
  other conversations of this pass bring (`llm.gamma.Load`), so it can choose its gamma
  for the batch it is in. `prepare` may be a generator that yields the draft model's
  forwards (`llm.drafters.DraftStep`), is sent `(logits, seconds)` for each, and returns
  the Piece: the same step of every conversation drafting in the round runs as one
  batched forward of the draft model, as the target's rows do.
- `finish(logits) -> result`: the verdict from this conversation's rows of logits.

The loop takes every pass waiting at that moment (and, for up to `gather_s`, waits for
the active conversations that have not submitted yet: after a pass they all wake
together), prepares each, runs the target rows of all of them as ONE forward
(`llm.model.forward_many`: linears over all rows, attention per conversation), and
finishes each. A fixed-width (static) cache runs its own step, alone, in the same round.
Conversations join and leave between passes. Every torch operation of a generation runs
on this one thread, with the cores (`threads`); a thread that starts it runs torch on one
thread from then on, so that the process keeps one OpenMP pool (llm/threads.py: a second
pool made every pass 30-45% slower).

Each round holds the engine's pass lock (a FIFO lock; tests wrap it to pace passes).

Background passes (`run(..., background=True)`: a preemptive answer started while its
caller may still be speaking, pipeline/stages/preempt.py) run only in rounds where no
other pass waits: a turn that has ended never shares its forward with, or waits behind, an
answer that may be thrown away. A preemptive answer becomes foreground when its turn ends
on its audio (its cancel's `background` turns False): `background` may be a callable, read
each time a round is chosen, so that a pass already queued (a prefill that waited behind
other calls' answers) goes with the next round too, not only the passes after it.

A pass still queued when its generation is cancelled (`skip` says so: a speech prefill a
pause's start stopped, a discarded preemption, an answer the caller talked over) is not run:
its conversation gets `PassSkipped` and the generation ends as cancelled between passes. Its
result would be thrown away, and under load such a pass, deferred as background, held up
the start that waits for it.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from llm.cuda_graphs import timed_forward
from llm.drafters import DraftStep, run_draft_steps
from llm.gamma import Load
from llm.model import Segment, Transformer
from llm.threads import claim, cores, release

log = logging.getLogger(__name__)


@dataclass
class Piece:
    """What one conversation puts into a pass: its target rows, and for the others' gamma
    choice, the tokens it expects from them and the time its drafting took."""

    model: Transformer
    segment: Segment
    expected_tokens: float = 1.0
    draft_s: float = 0.0


# A prepare that drafts with a model: yields its DraftSteps, returns the Piece (or None).
PieceSteps = Generator[DraftStep, tuple[torch.Tensor, float], "Piece | None"]


def _run_here(out: Piece | None | PieceSteps, timer=timed_forward) -> Piece | None:
    """A prepare's result with any draft steps run on this thread, one forward each."""
    return run_draft_steps(out, timer) if inspect.isgenerator(out) else out


@dataclass(frozen=True)
class PassInfo:
    """The target pass a conversation's rows ran in."""

    seconds: float  # the forward over all its rows
    rows: int  # rows of every conversation in it
    conversations: int


Prepare = Callable[[Load], "Piece | None | PieceSteps"]
Finish = Callable[[torch.Tensor], Any]
Background = bool | Callable[[], bool]  # a flag, or one read whenever a round is chosen


class PassSkipped(Exception):
    """The pass was not run: its generation was cancelled while it waited (module doc)."""


class Runner(Protocol):
    """Runs one conversation's pass: `prepare` names its target rows (drafting first, maybe
    in steps), the target runs them (with other conversations' rows, maybe), `finish` turns
    this conversation's logits into its result. Returns (finish's result, the pass's
    PassInfo). SoloRunner runs it here; PassScheduler on the engine thread, batched."""

    def run(self, prepare: Prepare, finish: Finish, hint: Load | None = None,
            background: Background = False, skip: Callable[[], bool] | None = None) -> tuple[Any, PassInfo]: ...


@dataclass
class _Work:
    prepare: Prepare
    finish: Finish
    hint: Load  # what this conversation brought to its last pass (before it prepares this one)
    job: Callable[[], Any] | None = None  # instead of a pass: run alone, its value the result
    background: Background = False  # runs only when no foreground work waits (module doc)
    skip: Callable[[], bool] | None = None  # true once its generation is cancelled: not run
    submitted: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    info: PassInfo | None = None
    error: BaseException | None = None
    piece: Piece | None = None
    steps: PieceSteps | None = None  # a prepare still drafting
    step: DraftStep | None = None  # the draft forward it waits for

    @property
    def in_background(self) -> bool:
        """Background now: a preemptive pass whose turn has ended while it was queued is not."""
        return bool(self.background()) if callable(self.background) else self.background


def _no_rows(_) -> None:
    """A job's prepare and finish: never called (a job is not a pass)."""


class SoloRunner:
    """Passes run on the caller's thread, one at a time behind a lock (no engine thread).
    `timer(model, segments) -> (logits, seconds)` runs and times every forward: the
    seconds the gamma controller learns from (tests inject a machine's costs through it)."""

    def __init__(self, lock=None, timer=timed_forward):
        self.lock = lock if lock is not None else threading.Lock()
        self.timer = timer

    def run(self, prepare: Prepare, finish: Finish, hint: Load | None = None,
            background: Background = False, skip: Callable[[], bool] | None = None) -> tuple[Any, PassInfo]:
        with self.lock:  # one pass at a time: nothing to put before another
            if skip is not None and skip():
                raise PassSkipped()
            piece = _run_here(prepare(Load()), self.timer)
            (logits,), seconds = self.timer(piece.model, [piece.segment])
            return finish(logits), PassInfo(seconds, int(piece.segment.tokens.shape[0]), 1)


class PassScheduler:
    """The engine thread: batches the passes of all conversations (see the module doc)."""

    def __init__(self, lock=None, gather_s: float = 0.002, batched: bool = True, batch_drafts: bool = True,
                 threads: int | None = None):
        self.lock = lock if lock is not None else threading.Lock()
        self.threads = threads if threads is not None else cores()  # torch threads of the engine thread
        self.gather_s = gather_s
        self.batched = batched
        # The draft model's steps of a round batched too (off: one conversation's at a time,
        # for measuring what batching them brings).
        self.batch_drafts = batched and batch_drafts
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
        self.draft_passes = 0  # draft-model forwards run by the engine thread
        self.batched_draft_passes = 0  # of those, forwards that carried 2+ conversations' steps
        self.deferred = 0  # background passes left for a later round because foreground work waited
        self.skipped = 0  # queued passes not run: their generation was cancelled while they waited
        # Foreground passes that arrived while a round of background passes alone ran (a
        # forward is not interrupted): how many, and the seconds they waited for it to end.
        self.behind_background = 0
        self.behind_background_s = 0.0
        self._background_round: float | None = None  # such a round's start, while it runs

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

    def run(self, prepare: Prepare, finish: Finish, hint: Load | None = None,
            background: Background = False, skip: Callable[[], bool] | None = None) -> tuple[Any, PassInfo]:
        """Submit one pass and wait for it: (finish's result, the pass it ran in).
        `background`: only in a round no foreground pass waits for (module doc); a callable
        is read each time a round is chosen. `skip`: read then too; true, the pass is not
        run and this raises PassSkipped."""
        work = self._submit(_Work(prepare, finish, hint or Load(rows=1, tokens=1.0), background=background,
                                  skip=skip))
        return work.result, work.info

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn alone on the engine thread (a prefix's prefill, a calibration)."""
        return self._submit(_Work(_no_rows, _no_rows, Load(), job=fn)).result

    def _submit(self, work: _Work) -> _Work:
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine's scheduler was closed")
            self._queue.append(work)
            self._cond.notify_all()
            self._start()
        work.done.wait()
        if work.error is not None:
            raise work.error
        return work

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
            up = threading.Event()
            self._thread = threading.Thread(target=self._loop, args=(up,), name="specvoice-engine", daemon=True)
            self._thread.start()
            up.wait()
            release()  # after the engine thread took its threads: claim set the process default

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
            works, self._queue = self._first(self._queue)
            self._cond.notify_all()  # the queue changed (wait_until_waiting, tests)
            return works

    def _first(self, works: list[_Work]) -> tuple[list[_Work], list[_Work]]:
        """(this round's works, those left queued): the foreground ones when any waits, else
        all; a pass whose generation was cancelled meanwhile ends here, unrun. Called with
        _cond held."""
        works = [w for w in works if not self._skipped(w)]
        behind = [w.in_background for w in works]  # read once: the flag may turn meanwhile
        front = [w for w, b in zip(works, behind) if not b]
        if not front or len(front) == len(works):
            return works, []
        self.deferred += len(works) - len(front)
        return front, [w for w, b in zip(works, behind) if b]

    def _skipped(self, w: _Work) -> bool:
        if w.skip is None or not w.skip():
            return False
        self.skipped += 1
        w.error = PassSkipped()
        w.done.set()
        return True

    def _loop(self, up: threading.Event) -> None:
        claim(self.threads)
        up.set()
        with torch.inference_mode():
            while True:
                works = self._take()
                if works is None:
                    return
                with self.lock:
                    # Passes submitted while the lock was held join this round.
                    with self._cond:
                        works, self._queue = self._first(works + self._queue)
                        if works and all(w.in_background for w in works):
                            self._background_round = time.monotonic()
                    if works:
                        self._round(works)
                    self._count_behind_background()
                works = None  # nothing of a finished pass stays referenced while idle

    def _count_behind_background(self) -> None:
        """After a round of background passes alone: the foreground passes that came during it
        waited for it (the counters above)."""
        if self._background_round is None:  # most rounds: set and read on this thread only
            return
        with self._cond:
            began, self._background_round = self._background_round, None
            if began is None:
                return
            now = time.monotonic()
            for w in self._queue:
                if not w.in_background and w.submitted > began:
                    self.behind_background += 1
                    self.behind_background_s += now - w.submitted

    def _round(self, works: list[_Work]) -> None:
        self.rounds += 1
        prepared: list[_Work] = []
        for w in works:
            if w.job is not None:
                self._run_job(w)
                continue
            try:
                out = w.prepare(self._load(w, works))
            except BaseException as e:  # noqa: BLE001 - handed to the conversation that caused it
                self._fail([w], e)
                continue
            if inspect.isgenerator(out):
                w.steps = out
                self._advance(w, None, prepared)
            else:
                self._prepared(w, out, prepared)
        # Conversations drafting with a model: step k of each runs as one batched forward.
        while drafting := [w for w in works if w.step is not None]:
            for group in self._groups(drafting, lambda w: w.step, self.batch_drafts):
                self._draft_pass(group, prepared)
        for group in self._groups(prepared, lambda w: w.piece, self.batched):
            self._pass(group)

    @staticmethod
    def _run_job(w: _Work) -> None:
        try:
            w.result = w.job()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            w.error = e
        w.done.set()

    @staticmethod
    def _load(w: _Work, works: list[_Work]) -> Load:
        """What the other conversations of the round bring to w's pass: their rows, the
        tokens they expect and their drafting time. The drafting times are summed even
        where the draft steps run batched (then the phase lasts about the longest): an
        over-estimate, on the side of less speculation. Counting only the longest (each
        conversation then sees the others' drafts as free time for its own) was tried and
        measured no better in `bench batch` at 4 calls (README)."""
        rows = tokens = draft_s = 0.0
        for o in works:
            if o is w:
                continue
            if o.piece is not None:  # prepared already: what it really brings
                rows += o.piece.segment.tokens.shape[0]
                tokens += o.piece.expected_tokens
                draft_s += o.piece.draft_s
            else:
                rows += o.hint.rows
                tokens += o.hint.tokens
                draft_s += o.hint.draft_s
        return Load(int(rows), tokens, draft_s)

    def _advance(self, w: _Work, sent, prepared: list[_Work]) -> None:
        """Run w's prepare to its next draft step (or to its Piece)."""
        try:
            w.step = w.steps.send(sent)
        except StopIteration as done:
            w.steps = w.step = None
            self._prepared(w, done.value, prepared)
        except BaseException as e:  # noqa: BLE001
            w.steps = w.step = None
            self._fail([w], e)

    def _prepared(self, w: _Work, piece: Piece | None, prepared: list[_Work]) -> None:
        w.piece = piece
        if piece is None:  # a job with no target rows
            w.done.set()
        else:
            prepared.append(w)

    @staticmethod
    def _fail(group: list[_Work], e: BaseException) -> None:
        for w in group:
            w.error = e
            w.done.set()

    @staticmethod
    def _groups(works: list[_Work], part, batched: bool) -> list[list[_Work]]:
        """Works whose rows can share one forward: the same model, dynamic caches (a
        fixed-width cache runs its own step, alone), and batching on."""
        groups: list[list[_Work]] = []
        for w in works:
            p = part(w)
            alone = not batched or p.segment.cache.steps is not None
            for g in groups:
                q = part(g[0])
                if not alone and q.model is p.model and q.segment.cache.steps is None:
                    g.append(w)
                    break
            else:
                groups.append([w])
        return groups

    def _draft_pass(self, group: list[_Work], prepared: list[_Work]) -> None:
        segs = [w.step.segment for w in group]
        try:
            logits, seconds = timed_forward(group[0].step.model, segs)
        except BaseException as e:  # noqa: BLE001
            for w in group:
                w.steps = w.step = None
            self._fail(group, e)
            return
        self.draft_passes += 1
        if len(segs) > 1:
            self.batched_draft_passes += 1
        for w, out in zip(group, logits):
            self._advance(w, (out, seconds), prepared)

    def _pass(self, group: list[_Work]) -> None:
        model = group[0].piece.model
        segs = [w.piece.segment for w in group]
        rows = sum(int(s.tokens.shape[0]) for s in segs)
        try:
            logits, seconds = timed_forward(model, segs)
        except BaseException as e:  # noqa: BLE001
            self._fail(group, e)
            return
        info = PassInfo(seconds, rows, len(segs))
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
