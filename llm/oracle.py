"""An oracle drafter for controlled acceptance: the target's own greedy continuation,
each proposed token corrupted with probability 1 - a.

With per-token acceptance a fixed by construction and a drafting cost of ~0, a
benchmark measures what verification and the decoding loop cost, and compares it with
what Leviathan et al.'s formula predicts: a pass that verifies g drafts yields on
average E(g) = (1 - a^(g+1)) / (1 - a) tokens.

The reference continuation comes from running the target greedily once (for example
the same engine at gamma = 0: `greedy_reference`). Greedy speculative decoding keeps
the context on that reference whatever is rejected, so the oracle only indexes into
it. A corrupted token is replaced by a different token, so it is always rejected.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from llm.drafters import Proposal
from llm.types import SamplingParams


@dataclass
class OracleDrafter:
    prompt: list[int]
    reference: list[int]  # the target's greedy continuation of `prompt`
    acceptance: float  # a: probability that a proposed token is the reference token
    vocab_size: int
    seed: int = 0
    name: str = "oracle"
    proposed: int = 0
    corrupted: int = 0
    cost_s: float = 0.0  # total time spent proposing
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {self.acceptance}")
        if self.vocab_size < 2:
            raise ValueError("the oracle needs a vocabulary of at least 2 tokens to corrupt a token")
        self._rng = random.Random(self.seed)

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        t0 = time.perf_counter()
        n = len(self.prompt)
        done = len(context) - n
        # Off the reference (another prompt, or a sampled answer): nothing to offer.
        if k <= 0 or done < 0 or context[n:] != self.reference[:done] or context[:n] != self.prompt:
            return Proposal([], None, self.name, time.perf_counter() - t0)
        tokens = []
        for tok in self.reference[done : done + k]:
            if self._rng.random() >= self.acceptance:
                tok = (tok + 1 + self._rng.randrange(self.vocab_size - 1)) % self.vocab_size
                self.corrupted += 1
            tokens.append(tok)
        self.proposed += len(tokens)
        cost = time.perf_counter() - t0
        self.cost_s += cost
        return Proposal(tokens, None, self.name, cost)

    def accepted(self, n: int) -> None:
        pass


def measured_acceptance(accepted: int, drafted: int, passes_with_rejection: int) -> float:
    """Per-token acceptance estimated from a run: accepted / (accepted + rejections), the
    maximum-likelihood estimate of a for runs truncated at gamma (each pass that stops
    early stops on one rejected token)."""
    trials = accepted + passes_with_rejection
    return accepted / trials if trials else 0.0


def greedy_reference(engine, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's greedy continuation of `prompt` (the engine, no drafts)."""
    conv = engine.new_conversation()
    conv.drafters = []
    ids, _, _ = engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens), conv)
    return ids
