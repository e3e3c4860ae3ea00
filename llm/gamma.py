"""Adaptive gamma: how many draft tokens to verify next, chosen for tokens per second.

With per-token acceptance a, a pass that verifies g drafts yields on average
E(g) = (1 - a^(g+1)) / (1 - a) tokens (Leviathan et al. 2022) and costs
g * c_draft + T(g + 1), where T(k) is the measured cost of a k-row target forward.
We pick the g in [0, max] that maximises E(g) / cost(g). g = 0 is plain decoding, so
whenever the estimates say speculation does not pay, it is switched off.

Estimates are learnt while generating: acceptance per drafter from counts of accepted
tokens and rejections (the maximum-likelihood estimate for a geometric run, with a
prior and a slow decay so it follows the conversation), costs as moving averages of
measured times, seeded by a calibration at load time.

Under load (several conversations batched into one target pass, see llm/scheduler.py)
a pass costs T(all rows of all conversations) plus every conversation's drafting, and
yields every conversation's tokens. Each conversation is told what the others bring
(`Load`: their rows, expected tokens and draft time) and picks the g that maximises the
pass's aggregate tokens per second, (E(g) + others' tokens) / (g * c_draft + others'
draft time + T(others' rows + g + 1)). g = 0 stays a candidate, so a conversation
speculates only where the estimates say the whole batch goes faster for it than
without; with no load this is the single-conversation rule above.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SourceStats:
    accepted: float = 2.0  # prior: a = 2/3 until measured
    rejected: float = 1.0
    cost_per_token: float = 0.0  # seconds per drafted token
    idle_passes: int = 0  # passes in a row where this source was not used (for exploration)

    certain: bool = False  # drafts the target cannot refuse (tokens a constraint forces)

    @property
    def acceptance(self) -> float:
        if self.certain:
            return 1.0
        return self.accepted / (self.accepted + self.rejected)

    @property
    def estimate(self) -> float:
        """The acceptance the rate is computed with: a learnt one is never taken as certain."""
        return 1.0 if self.certain else min(self.acceptance, 0.999)


# Tokens a constraint forces (llm/constrain.py GrammarDrafter): the masked target can write
# nothing else, so they are accepted with certainty and need no learnt estimate.
CERTAIN_SOURCES = frozenset({"grammar"})


def expected_tokens(a: float, g: int) -> float:
    if a >= 1.0:
        return float(g + 1)
    return (1.0 - a ** (g + 1)) / (1.0 - a)


@dataclass(frozen=True)
class Load:
    """What the other conversations of a batched pass bring to it."""

    rows: int = 0  # their target rows
    tokens: float = 0.0  # tokens they expect from the pass
    draft_s: float = 0.0  # the time their drafting adds to the pass


@dataclass
class CostModel:
    """T(k) = step + per_extra_row * (k - 1): seconds for a target forward over k rows.

    A line, not a table per k: every observation refines both parameters, so a gamma
    that is not currently chosen still has an up-to-date cost. Observations are capped
    at 1.5x the current estimate, so a spike from other work on a shared machine cannot
    switch speculation off for good; real changes still come through, a step at a time.
    """

    step_s: float = 0.1
    per_extra_row_s: float = 0.005
    alpha: float = 0.2

    def cost(self, rows: int) -> float:
        return self.step_s + self.per_extra_row_s * (rows - 1)

    def observe(self, rows: int, seconds: float) -> None:
        seconds = min(seconds, 1.5 * self.cost(rows))
        if rows == 1:
            self.step_s += self.alpha * (seconds - self.step_s)
        else:
            slope = max(0.0, (seconds - self.step_s) / (rows - 1))
            self.per_extra_row_s += self.alpha * (slope - self.per_extra_row_s)


@dataclass
class GammaController:
    max_gamma: int = 8
    fixed: int | None = None  # a fixed gamma turns adaptation off
    verify: CostModel = field(default_factory=CostModel)
    sources: dict[str, SourceStats] = field(default_factory=dict)
    decay: float = 0.9  # acceptance follows the last dozen or so passes
    explore_every: int = 16
    load: Load = field(default_factory=Load)  # the batch this conversation's next pass is in

    def stats(self, source: str) -> SourceStats:
        if source not in self.sources:
            self.sources[source] = SourceStats(certain=source in CERTAIN_SOURCES)
        return self.sources[source]

    def best(self, source: str, available: int) -> tuple[int, float]:
        """(gamma, expected tokens per second) maximising throughput for drafts from `source`."""
        limit = max(0, min(self.max_gamma, available))
        load = self.load
        plain = (1.0 + load.tokens) / (load.draft_s + self.verify.cost(load.rows + 1))
        if self.fixed is not None:
            g = min(self.fixed, limit)
            return g, plain if g == 0 else float("inf")
        best_g, best_rate = 0, plain
        for g in range(1, limit + 1):
            rate = self.rate(source, g)
            if rate > best_rate:
                best_g, best_rate = g, rate
        return best_g, best_rate

    def rate(self, source: str, g: int) -> float:
        """Expected tokens per second of a pass verifying g drafts from `source` (with the
        other conversations of the pass, all of its tokens over all of its time)."""
        s, load = self.stats(source), self.load
        tokens = expected_tokens(s.estimate, g) + load.tokens
        return tokens / (g * s.cost_per_token + load.draft_s + self.verify.cost(load.rows + g + 1))

    def expected(self, source: str, g: int) -> float:
        """Tokens a pass verifying g drafts from `source` is expected to yield."""
        return expected_tokens(self.stats(source).estimate, g) if g > 0 else 1.0

    def choose(self, source: str, available: int) -> int:
        """Best number of drafts from `source`, given it can offer `available` of them."""
        g, _ = self.best(source, available)
        if self.fixed is not None or available <= 0:
            return g
        s = self.stats(source)
        if g == 0:
            s.idle_passes += 1
            if s.idle_passes >= self.explore_every:  # keep the estimate alive: try one draft now and then
                s.idle_passes = 0
                return 1
        else:
            s.idle_passes = 0
        return g

    def observe_draft(self, source: str, drafted: int, accepted: int, seconds: float) -> None:
        if drafted <= 0:
            return
        s = self.stats(source)
        s.accepted = s.accepted * self.decay + accepted
        s.rejected = s.rejected * self.decay + (1 if accepted < drafted else 0)
        per_token = seconds / drafted
        if s.cost_per_token == 0:
            s.cost_per_token = per_token
        else:  # capped like the verify cost: one slow moment must not stop a drafter for good
            s.cost_per_token += 0.25 * (min(per_token, 1.5 * s.cost_per_token) - s.cost_per_token)

    def observe_verify(self, rows: int, seconds: float) -> None:
        self.verify.observe(rows, seconds)
