"""Drafts from the engine's earlier answers: a receptionist says the same things all day.

    memory = AnswerMemory(max_answers=256)        # one per engine, shared by every call
                                                  # ([llm] answer_memory: 256 by default, 0 off)
    drafter = AnswerDrafter(memory)               # one per conversation, a free drafter
    memory.add(prompt, answer_tokens)             # each finished answer, by the engine

Prompt lookup (llm.drafters.NgramDrafter) drafts from the conversation's own context: the
system prompt's facts and the call so far. What it cannot offer is an answer this call has
not given yet but another call has: "Yes, we are open on Saturday from 9 a.m. to 1 p.m."
is written token by token in every call that asks, although the words after "Yes, we are
open" were the same the last ten times. This keeps the target's recent answers (their
tokens, as the target wrote them) and, when the end of the context matches n tokens of
one of them, proposes what followed there. The idea is SuffixDecoding's (Oliaro et al.,
2024: a suffix tree over earlier outputs, for repetitive agent workloads), kept to the
n-gram index the conversation's own lookup already uses.

Drafts are only proposals: the target verifies every token, so greedy answers stay
token-identical. Only greedy answers are remembered and drafted: a sampled answer would
keep the target's distribution (a point mass, as the n-gram drafter's), but its random
draws would depend on what other calls said, so a seed would no longer repeat one call
alone. Nothing of one call's answer reaches another call's output; what one call can
notice of another is at most that a common answer came faster.

Which continuation a key gets: the longest key first (n = max_n .. min_n), then the
latest answer that holds it. A key whose earlier answers went on differently is
*ambiguous* ("Yes, we" then " are" once and " have" another time): its source is
`answers{n}a`, otherwise `answers{n}`, so the gamma controller learns an acceptance for
each and drafts long only where the answers agreed. An answer's first tokens are keyed on
the prompt's last tokens (the chat template's "assistant" line, a plan line's opening), so
they can be drafted too; those keys are the most ambiguous of all, and the controller
learns so.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from llm.drafters import Proposal
from llm.types import SamplingParams

__all__ = ["AnswerDrafter", "AnswerMemory"]


@dataclass
class _Entry:
    """Where a key was last seen: answer `serial`, the position after the key in it, and
    whether an earlier answer went on with another token after the same key."""

    serial: int
    end: int
    ambiguous: bool = False


@dataclass
class AnswerMemory:
    """The last `max_answers` answers of the engine (each with the prompt's last `max_n`
    tokens before it), indexed by their n-grams (n = min_n .. max_n). Thread-safe: answers
    are added from the conversations' threads, looked up on the engine thread."""

    max_answers: int = 256
    max_n: int = 4
    min_n: int = 2  # one token is no key across calls: " the" was followed by everything
    max_tokens: int = 256  # the first tokens of an answer only: a long one is cut here
    _answers: deque = field(default_factory=deque)  # (serial, tokens, lead) oldest first
    _index: dict[tuple, _Entry] = field(default_factory=dict)
    _serial: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __len__(self) -> int:
        return len(self._answers)

    def clear(self) -> None:
        """Forget every answer (a benchmark's modes each start from an empty memory)."""
        with self._lock:
            self._answers.clear()
            self._index.clear()

    def add(self, prompt: list[int], answer: list[int]) -> None:
        """Remember `answer` (the tokens the target wrote after `prompt`)."""
        if len(answer) < 2 or self.max_answers <= 0:
            return
        lead = list(prompt[-self.max_n:])
        tokens = lead + list(answer[: self.max_tokens])
        with self._lock:
            serial = self._serial
            self._serial += 1
            self._answers.append((serial, tokens, len(lead)))
            while len(self._answers) > self.max_answers:
                self._forget(*self._answers.popleft())
            for key, end in self._keys(tokens, len(lead)):
                old = self._index.get(key)
                ambiguous = False
                if old is not None:
                    before = self._tokens_of(old.serial)
                    ambiguous = old.ambiguous or before is None or before[old.end] != tokens[end]
                self._index[key] = _Entry(serial, end, ambiguous)

    def _keys(self, tokens: list[int], lead: int):
        """(key, end) of every n-gram that ends inside the answer (after its `lead` prompt
        tokens) and has a continuation."""
        for end in range(lead, len(tokens)):
            for n in range(self.min_n, self.max_n + 1):
                if end - n >= 0:
                    yield tuple(tokens[end - n:end]), end

    def _forget(self, serial: int, tokens: list[int], lead: int) -> None:
        """Drop an evicted answer's keys that still point at it, so that the index stays as
        small as the answers kept (a server's memory does not grow with the calls it took).
        Called with the lock held."""
        for key, _ in self._keys(tokens, lead):
            entry = self._index.get(key)
            if entry is not None and entry.serial == serial:
                del self._index[key]

    def _tokens_of(self, serial: int) -> list[int] | None:
        """An answer still kept, by serial (None once evicted). Called with the lock held."""
        if not self._answers or serial < self._answers[0][0]:
            return None
        i = serial - self._answers[0][0]
        return self._answers[i][1] if i < len(self._answers) else None

    def lookup(self, context: list[int], k: int) -> tuple[list[int], str]:
        """Up to k tokens that followed the end of `context` in a remembered answer, and the
        source they come from (`answers{n}` or `answers{n}a`); ([], "") if none."""
        with self._lock:
            for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
                entry = self._index.get(tuple(context[len(context) - n:]))
                if entry is None:
                    continue
                tokens = self._tokens_of(entry.serial)
                if tokens is None:
                    continue
                return tokens[entry.end:entry.end + k], f"answers{n}{'a' if entry.ambiguous else ''}"
        return [], ""


@dataclass
class AnswerDrafter:
    """A conversation's view of the engine's AnswerMemory: a free drafter (a dict lookup)."""

    memory: AnswerMemory
    name: str = "answers"

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        t0 = time.perf_counter()
        # Greedy answers only: a sampled answer's draws would depend on what other calls
        # said (its distribution kept, its seed no longer repeating one call alone).
        tokens, source = self.memory.lookup(context, k) if k > 0 and params.greedy else ([], "")
        return Proposal(tokens, None, source or self.name, time.perf_counter() - t0)

    def accepted(self, n: int) -> None:
        pass
