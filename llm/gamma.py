"""Adaptive gamma: how many draft tokens to verify next, chosen for tokens per second.

With per-token acceptance a, a pass that verifies g drafts yields on average
E(g) = (1 - a^(g+1)) / (1 - a) tokens (Leviathan et al. 2022) and costs
g * c_draft + T(g + 1), where T(k) is the measured cost of a k-row target forward.
We pick the g in [0, max] that maximises E(g) / cost(g). g = 0 is plain decoding, so
whenever the estimates say speculation does not pay, it is switched off.

Estimates are learnt while generating: acceptance per drafter from counts of accepted
tokens and rejections (the maximum-likelihood estimate for a geometric run, with a
prior and a slow decay so it follows the conversation), costs as moving averages of
measured times, seeded by a calibration at load time. They belong to the engine, not to
a turn or a call: every conversation's controller shares one `verify` cost model and one
table of `sources` (llm/engine.py), so what the first turns learnt holds for the next
call, and a machine that slows down (a busy neighbour, another call) is seen by all.

Never slower than plain decoding (issue 27). Four rules keep the controller honest:
- a margin: g > 0 only where the estimate beats plain decoding by `margin` (10%);
- costs rise fast: a pass slower than estimated moves the estimate a third of the way
  (capped at 2x a pass, so one stall does not switch speculation off), a faster one
  moves it a fifth of the way; a line fitted to one-row passes is not trusted for wide
  ones: g is capped at 1 until a 2-row pass was measured, and doubles with each wide
  pass measured (slow start);
- what a drafter must do before it can draft is counted: a draft model that fell behind
  the context (a new turn's prompt, tokens another drafter proposed) runs those tokens
  first, and that catch-up (`extra_s`) is part of the pass it would draft in;
- measured passes have the last word: for each drafter the realised tokens per second
  of its passes (drafting and verifying, wall time) is compared with plain decoding's;
  where it falls below 0.9x over its last passes, the drafter is benched for a while
  (16 passes, doubling each time it fails again after its probe, up to 256) whatever its
  estimates say.

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
    # Measured passes: realised tokens/s of this source's passes over plain decoding's
    # estimate (a moving average; 1.0 = no gain), and the bench it is on when that fell short.
    realized: float = 1.0
    realized_passes: int = 0
    benched: int = 0  # passes left before it may draft again
    bench_for: int = 16  # the next bench's length (doubles while probes keep failing)
    catch_up_row_s: float = 0.0  # a draft model's re-sync, per row (0: not yet measured)

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
    alpha: float = 0.2  # a pass faster than estimated: the estimate follows a fifth of the way
    alpha_up: float = 0.3  # slower: a third of the way at once (capped at 2x, see observe)
    wide_seen: int = 0  # multi-row passes measured so far (see trusted_rows)

    def cost(self, rows: int) -> float:
        return self.step_s + self.per_extra_row_s * (rows - 1)

    def trusted_rows(self) -> int:
        """The widest pass the line is trusted for: 2 rows before any wide pass was
        measured, doubling with each one seen (slow start). A machine whose extra rows are
        dear is found out by a 2-row pass, not by a 9-row one."""
        return 2 ** min(self.wide_seen + 1, 12)

    def observe(self, rows: int, seconds: float) -> None:
        estimate = self.cost(rows)
        seconds = min(seconds, 2.0 * estimate)
        alpha = self.alpha_up if seconds > estimate else self.alpha
        if rows == 1:
            self.step_s += alpha * (seconds - self.step_s)
        else:
            self.wide_seen += 1
            slope = max(0.0, (seconds - self.step_s) / (rows - 1))
            self.per_extra_row_s += alpha * (slope - self.per_extra_row_s)


@dataclass
class GammaController:
    max_gamma: int = 8
    fixed: int | None = None  # a fixed gamma turns adaptation off
    verify: CostModel = field(default_factory=CostModel)
    sources: dict[str, SourceStats] = field(default_factory=dict)
    decay: float = 0.9  # acceptance follows the last dozen or so passes
    explore_every: int = 16
    load: Load = field(default_factory=Load)  # the batch this conversation's next pass is in
    margin: float = 0.1  # speculate only where the estimate beats plain decoding by this much
    # Tokens the answer still has to go (set by the decoder each pass: the budget left, at
    # most 48, a spoken answer's length): what a draft model's catch-up is spread over.
    horizon: float = 48.0
    max_bench: int = 256  # longest a drafter whose passes did not pay sits out
    judge_after: int = 4  # measured passes of a drafter before its realised rate can bench it
    bench_below: float = 0.9  # benched when its realised rate is under this share of plain decoding's

    def stats(self, source: str) -> SourceStats:
        if source not in self.sources:
            self.sources[source] = SourceStats(certain=source in CERTAIN_SOURCES)
        return self.sources[source]

    def plain_rate(self) -> float:
        """Expected tokens per second of the next pass without drafts (with the others')."""
        load = self.load
        return (1.0 + load.tokens) / (load.draft_s + self.verify.cost(load.rows + 1))

    def best(self, source: str, available: int, extra_s: float = 0.0, margin: float | None = None) -> tuple[int, float]:
        """(gamma, expected tokens per second) maximising throughput for drafts from `source`;
        g > 0 only where it beats plain decoding by the margin. `extra_s`: what the drafter
        must run before it can draft (a draft model's catch-up)."""
        limit = max(0, min(self.max_gamma, available))
        plain = self.plain_rate()
        if self.fixed is not None:
            g = min(self.fixed, limit)
            return g, plain if g == 0 else float("inf")
        limit = min(limit, self.verify.trusted_rows() - 1 - self.load.rows)
        bar = plain * (1.0 + (self.margin if margin is None else margin))
        best_g, best_rate = 0, plain
        for g in range(1, limit + 1):
            rate = self.rate(source, g, extra_s)
            if rate > bar and rate > best_rate:
                best_g, best_rate = g, rate
        return best_g, best_rate

    def rate(self, source: str, g: int, extra_s: float = 0.0) -> float:
        """Expected tokens per second of a pass verifying g drafts from `source` (with the
        other conversations of the pass, all of its tokens over all of its time). A
        catch-up (`extra_s`) is paid once and serves the passes after it: it is spread
        over the passes of the `horizon` (the tokens still to come, at most 48)."""
        s, load = self.stats(source), self.load
        mine = expected_tokens(s.estimate, g)
        catch_up = extra_s * mine / max(self.horizon, 1.0)
        return (mine + load.tokens) / (catch_up + g * s.cost_per_token + load.draft_s + self.verify.cost(load.rows + g + 1))

    def expected(self, source: str, g: int) -> float:
        """Tokens a pass verifying g drafts from `source` is expected to yield."""
        return expected_tokens(self.stats(source).estimate, g) if g > 0 else 1.0

    def choose(self, source: str, available: int, extra_s: float = 0.0) -> int:
        """Best number of drafts from `source`, given it can offer `available` of them."""
        if self.fixed is not None or available <= 0:
            return self.best(source, available, extra_s)[0]
        s = self.stats(source)
        if s.benched > 0:  # its measured passes did not pay: it sits out, then one probe
            s.benched -= 1
            if s.benched > 0:
                return 0
            return 1  # the probe: one draft, the cheapest measurement of whether it pays now
        g, _ = self.best(source, available, extra_s)
        if g == 0:
            s.idle_passes += 1
            if s.idle_passes >= self.explore_every and extra_s == 0.0:
                # Keep the estimate alive: try one draft now and then (never with a catch-up to pay).
                s.idle_passes = 0
                return 1
        else:
            s.idle_passes = 0
        return g

    def catch_up_s(self, source: str, rows: int) -> float:
        """What `source` must run before it can draft: `rows` behind the context. Unmeasured,
        a row is taken to cost a draft step (pessimistic: a catch-up runs rows together)."""
        if rows <= 0:
            return 0.0
        s = self.stats(source)
        return rows * (s.catch_up_row_s or s.cost_per_token)

    def observe_catch_up(self, source: str, rows: int, seconds: float) -> None:
        s = self.stats(source)
        per_row = seconds / max(rows, 1)
        if s.catch_up_row_s == 0:
            s.catch_up_row_s = per_row
        else:
            s.catch_up_row_s += (0.5 if per_row > s.catch_up_row_s else 0.25) * (per_row - s.catch_up_row_s)

    def observe_pass(self, source: str, drafted: int, tokens: int, seconds: float) -> None:
        """A pass that verified `drafted` drafts from `source` yielded `tokens` in `seconds`
        of wall time (drafting and verifying): the measured check on the estimates."""
        if drafted <= 0 or seconds <= 0 or self.fixed is not None or self.stats(source).certain:
            return
        s = self.stats(source)
        gain = (tokens / seconds) / self.plain_rate()
        s.realized_passes += 1
        # The mean of its first passes, then a moving average: one pass whose drafts were all
        # refused is expected now and then (acceptance is a rate), a run of them is not.
        s.realized += max(1.0 / s.realized_passes, 0.25) * (gain - s.realized)
        if s.realized_passes >= self.judge_after and s.realized < self.bench_below:
            s.benched, s.bench_for = s.bench_for, min(2 * s.bench_for, self.max_bench)
            s.realized, s.realized_passes = 1.0, 0  # the probe after the bench starts afresh
        elif s.realized_passes >= 2 * self.judge_after and s.realized >= 1.0:
            s.bench_for = 16

    def observe_offer(self, source: str, matched: int, refused: bool) -> None:
        """An offer from `source` that was not drafted, checked against the tokens the target
        wrote in the pass: `matched` of them agreed, and `refused` if one after them did not.
        The same counts a drafted one gives (tokens the pass did not reach are unknown, as
        drafts after a rejection are); its cost is not learnt, as nothing was drafted."""
        if matched <= 0 and not refused:
            return
        s = self.stats(source)
        s.accepted = s.accepted * self.decay + matched
        s.rejected = s.rejected * self.decay + (1 if refused else 0)

    def observe_draft(self, source: str, drafted: int, accepted: int, seconds: float) -> None:
        if drafted <= 0:
            return
        s = self.stats(source)
        s.accepted = s.accepted * self.decay + accepted
        s.rejected = s.rejected * self.decay + (1 if accepted < drafted else 0)
        per_token = seconds / drafted
        if s.cost_per_token == 0:
            s.cost_per_token = per_token
        else:  # as the verify cost: up fast (half way), down slowly; a draft model's step
            # time is already its own moving average (llm/drafters.py), so no cap here
            alpha = 0.5 if per_token > s.cost_per_token else 0.25
            s.cost_per_token += alpha * (per_token - s.cost_per_token)

    def observe_verify(self, rows: int, seconds: float) -> None:
        self.verify.observe(rows, seconds)
