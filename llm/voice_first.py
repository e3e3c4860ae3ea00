"""The caller's first audio goes before the rest of the answer.

    gate = VoiceFirst()
    hold = gate.hold()      # the speaker starts the answer's first sentence (caller in silence)
    ...                     # the LLM's next pass of this conversation waits (gate.wait())
    hold.release()          # its first chunk of audio exists: the model writes on

On two cores the model and the voice share them. Once a turn's first sentence is written,
what the caller waits for is Piper's first chunk of it, not the model's next sentence
(that one is not heard before the first has played, a second or more later). Both at
once, Piper and the model's OpenMP threads take turns on two cores: measured on a 2-core
EPYC (AVX2), a first chunk on one Piper thread took 200-418 ms beside a decoding model
against 118-235 ms alone (and 90-99 ms on two threads alone, which is why Piper now has
two: pipeline.agent._threads). So while the speaker makes the answer's first audio, this
conversation's next pass is not started (a pass already running ends first). Other calls'
passes are not held: their own first sentences wait for the cores as much as this one.
Only where the model's passes take every core (llm.backend.SpeculativeBackend): with a
core to spare the voice runs beside them.

The hold is bounded (`max_hold_s`) so that a voice that hangs cannot stop the model;
`release` is idempotent and every hold is released in a `finally`.
"""

from __future__ import annotations

import threading
import time

__all__ = ["VoiceFirst", "Hold"]


class Hold:
    """One hold of a gate, from `VoiceFirst.hold()` until `release()` (idempotent)."""

    def __init__(self, gate: "VoiceFirst") -> None:
        self._gate = gate
        self.since = time.monotonic()

    def release(self) -> None:
        self._gate._release(self)

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class VoiceFirst:
    """One conversation's gate: its LLM passes wait while any hold is on (module doc).
    Thread-safe: holds come from the event loop and the voice threads, waits from the
    thread that runs the generation."""

    def __init__(self, max_hold_s: float = 1.0) -> None:
        self.max_hold_s = max_hold_s
        self._cond = threading.Condition()
        self._holds: list[Hold] = []
        self.waits = 0  # passes that waited
        self.waiting = 0  # threads in wait() now

    def hold(self) -> Hold:
        with self._cond:
            h = Hold(self)
            self._holds.append(h)
            return h

    def _release(self, h: Hold) -> None:
        with self._cond:
            if h in self._holds:
                self._holds.remove(h)
                self._cond.notify_all()

    @property
    def held(self) -> bool:
        with self._cond:
            return bool(self._holds)

    def _left(self) -> float:
        """Seconds until every current hold is released or has run out (0: go)."""
        now = time.monotonic()
        return max((h.since + self.max_hold_s - now for h in self._holds), default=0.0)

    def wait(self) -> float:
        """Block while a hold is on, at most until each has lasted max_hold_s; the seconds waited."""
        with self._cond:
            if (left := self._left()) <= 0:
                return 0.0
            t0 = time.monotonic()
            self.waiting += 1
            self._cond.notify_all()  # wait_until_waiting
            try:
                while left > 0:
                    self._cond.wait(left)
                    left = self._left()
            finally:
                self.waiting -= 1
            self.waits += 1
            return time.monotonic() - t0

    def wait_until_waiting(self, n: int = 1, timeout: float = 30.0) -> bool:
        """Block until n threads wait at the gate (for tests: no sleeps)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.waiting >= n, timeout)
