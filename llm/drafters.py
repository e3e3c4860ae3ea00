"""Drafters: cheap guesses of the target's next tokens, behind one small interface.

`propose(context, k, params)` returns up to k tokens continuing `context` (every token
the target has accepted so far: prompt, earlier turns, this answer) and, when the
drafter sampled them from a distribution, the warped probabilities (k, vocab) it used.
Without probabilities a proposal is a point mass, which keeps rejection sampling exact.
`accepted(n)` tells the drafter how many of its last proposal the target kept; a draft
model does not need it (it re-syncs to the context on the next call) but a stateful
drafter may.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from llm.cuda_graphs import timed_forward
from llm.model import KVCache, Segment, Transformer, new_cache
from llm.sampling import apply_mask, warp
from llm.types import SamplingParams


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), target vocab) or None: point masses
    source: str = "none"  # which drafter produced it: "model" or "ngram"
    cost_s: float = 0.0


class Drafter(Protocol):
    name: str

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal: ...

    def accepted(self, n: int) -> None: ...


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class DraftStep:
    """One forward a drafter needs: `segment`'s tokens through `model` (its own cache)."""

    model: Transformer
    segment: Segment


# A drafter's proposal as a generator: yields DraftSteps, is sent (logits, seconds) for each,
# returns the Proposal.
DraftSteps = Generator[DraftStep, tuple[torch.Tensor, float], Proposal]


def run_draft_steps(steps: DraftSteps, timer=timed_forward) -> Proposal:
    """Run a proposal's steps here, one forward each (no other conversation to batch with).
    `timer(model, segments) -> (logits, seconds)` runs and times each (tests inject costs)."""
    try:
        step = next(steps)
        while True:
            (logits,), seconds = timer(step.model, [step.segment])
            step = steps.send((logits, seconds))
    except StopIteration as done:
        return done.value


@dataclass
class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (longest n first) and propose what followed it. Voice-agent answers quote the system
    prompt (addresses, hours, prices) and the caller's words, so this finds real drafts
    at almost no cost. The index is updated incrementally as the context grows.

    Down to a single token (`min_n` 1): answers pick up a fact after one word of their
    own ("42" after "4", "Harbor Street" after "Harbor"), so a two-token key came one pass
    late. How often a key's continuation is right depends on its length (the source is
    `ngram{n}`: the gamma controller learns an acceptance for each) and, for one token,
    on whether it is unique in the context (" Harbor" once, " the" fifty times): those
    are `ngram1u` and `ngram1m`, so the controller drafts long after a unique word and
    little or nothing after a common one. Measured offline on the target's own answers
    to the `bench quality` and `bench llm` turns, with the controller choosing gamma:
    7-10% fewer passes than two-token keys (splitting the longer keys too gained nothing).

    A key that starts with a digit (`digits`: the vocabulary's all-digit tokens) also says
    whether a digit precedes it: the answer's "42" begins a number, so it is looked up
    where a number begins ("42 Harbor Street"), not inside one ("555-0142")."""

    max_n: int = 4
    min_n: int = 1
    name: str = "ngram"
    digits: frozenset[int] = frozenset()
    _tokens: list[int] = field(default_factory=list)
    # n -> {key (n tokens, inside a number): end index of its latest occurrence (exclusive)}
    _index: dict[int, dict[tuple, int]] = field(default_factory=dict)
    # {1-token key: how many times it occurs}
    _count: dict[tuple, int] = field(default_factory=dict)

    def _sync(self, context: list[int]) -> None:
        keep = common_prefix(self._tokens, context)
        if keep < len(self._tokens):  # the context diverged (a rolled-back or new conversation)
            self._tokens, self._index, self._count = [], {}, {}
            keep = 0
        for end in range(len(self._tokens) + 1, len(context) + 1):
            for n in range(self.min_n, self.max_n + 1):
                if end - n >= 0:
                    key = self._key(context, end - n, end)
                    self._index.setdefault(n, {})[key] = end
                    if n == 1:
                        self._count[key] = self._count.get(key, 0) + 1
        self._tokens = list(context)

    def _key(self, context: list[int], start: int, end: int) -> tuple:
        inside_number = start > 0 and context[start] in self.digits and context[start - 1] in self.digits
        return (*context[start:end], inside_number)

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        t0 = time.perf_counter()
        if k <= 0 or len(context) < self.min_n + 1:
            return Proposal([], None, self.name, time.perf_counter() - t0)
        # Index everything but the last position, so a match always has a continuation.
        self._sync(context[:-1])
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            key = self._key(context, len(context) - n, len(context))
            end = self._index.get(n, {}).get(key)
            if end is not None:
                kind = ("u" if self._count[key] == 1 else "m") if n == 1 else ""
                return Proposal(context[end : end + k], None, f"{self.name}{n}{kind}", time.perf_counter() - t0)
        return Proposal([], None, self.name, time.perf_counter() - t0)

    def accepted(self, n: int) -> None:
        pass


class ModelDrafter:
    """A small draft model with its own KV cache.

    Each proposal first re-syncs the cache to the context: it keeps the longest common
    prefix with what the cache holds (rolling back rejected drafts by position) and
    runs only the missing tokens (the bonus token, and any tokens that another drafter
    proposed), then decodes k tokens one at a time.
    """

    name = "model"

    def __init__(self, model: Transformer, target_vocab: int, generator: torch.Generator | None = None):
        self.model = model
        self.target_vocab = target_vocab
        self.cache: KVCache = new_cache(model)
        self.tokens: list[int] = []  # tokens whose K/V are valid in the cache, in order
        self.generator = generator
        self.step_s = 0.0  # moving average of one single-token draft step
        self.last_catch_up: tuple[int, float] | None = None  # (rows, seconds) of the last multi-row re-sync

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        return run_draft_steps(self.propose_steps(context, k, params))

    def behind(self, context: list[int]) -> int:
        """Tokens of `context` the draft's cache does not hold yet (its first draft step runs
        them all: one is the usual bonus token, more after a new turn's prompt or after
        another drafter's accepted tokens)."""
        return len(context) - min(common_prefix(self.tokens, context), len(context) - 1)


    def propose_steps(self, context: list[int], k: int, params: SamplingParams, guide=None) -> DraftSteps:
        """`propose` as a generator of forward steps: it yields each step it needs from the
        draft model (a `DraftStep`) and is sent back `(logits, seconds)`. The engine thread
        runs the same step of every conversation drafting in a round as ONE batched forward
        (llm.scheduler); `propose` runs them here, one at a time.

        `guide` (a llm.constrain.ConstraintState at the context's end): each draft token is
        chosen from the draft's distribution masked by the constraint, and the returned
        probabilities are that masked distribution, so a sampled draft never holds a token
        the constraint rejects (cutting one would bias rejection sampling). The guide itself
        does not move (the steps follow a fork of it)."""
        if k <= 0:
            return Proposal([], None, self.name, 0.0)
        # Re-sync: keep the longest common prefix with the cache; always run at least one
        # token to get logits.
        keep = min(common_prefix(self.tokens, context), len(context) - 1)
        todo = torch.tensor(context[keep:], dtype=torch.long, device=self.model.device)
        logits, seconds = yield DraftStep(self.model, Segment(self.cache, todo, keep, all_logits=False))
        if len(todo) > 1:  # a catch-up: what it cost is learnt by the gamma controller
            self.last_catch_up = (len(todo), seconds)
        else:  # the usual first step: one row
            self._observe_step(seconds)
        self.tokens = list(context)
        logits = logits[-1]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        if guide is not None:
            guide = guide.fork()  # the steps look ahead on a copy: the generation's state does not move
        for i in range(k):
            if guide is not None:
                if guide.done:
                    break
                logits = apply_mask(logits, guide.mask())
            if params.greedy:
                token = int(torch.argmax(logits))
            else:
                probs = warp(logits, params)
                token = int(torch.multinomial(probs, 1, generator=self.generator))
                rows.append(probs)
            tokens.append(token)
            if guide is not None:
                guide.advance([token])
            if i + 1 < k:
                one = torch.tensor([token], device=self.model.device)
                logits, seconds = yield DraftStep(self.model, Segment(self.cache, one, len(self.tokens), all_logits=False))
                logits = logits[-1]
                self._observe_step(seconds)
                self.tokens.append(token)
        probs = None
        if rows:
            probs = torch.stack(rows)
            if probs.shape[1] < self.target_vocab:  # a draft with a smaller head proposes none of the rest
                probs = torch.nn.functional.pad(probs, (0, self.target_vocab - probs.shape[1]))
            probs = probs[:, : self.target_vocab]
        # Per drafted token, one step: what the gamma controller weighs per token. A catch-up
        # beyond the first step's usual row is charged separately (catch_up_s).
        cost = self.step_s * len(tokens)
        return Proposal(tokens, probs, self.name, cost)

    def _observe_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s == 0 else 0.8 * self.step_s + 0.2 * seconds

    def accepted(self, n: int) -> None:
        pass

