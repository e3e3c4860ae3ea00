"""The speculative decoding loop: prefill, then draft -> verify -> accept -> emit, one
group per pass.

Small functions over explicit state, in the manner of gpt-fast's generate.py:

    speculative_stream(...)          yields one TokenGroup per target pass:
      first_pass(state, runner)      the prompt's prefill; its last row picks the first token
      speculative_pass(state, runner)  then, until the answer ends, one pass:
        draft(state, limit, load)      the drafters' best offer, cut where a constraint says no
        verify(state, drafted, logits) the target's verdict on pending + drafts
        accept(state, ...)             roll the cache back to what was kept
        learn, record(state, ...)      the gamma controller learns; the stats and the trace
        emit(state, tokens, ...)       the kept tokens out, with eos / stop / length

`Decoding` is one generation's state between passes. Drafting and the verdict run where
the runner runs passes (the engine thread, batched with other conversations:
llm/scheduler.py); the rest runs on the generation's own thread.

`Sequence` is a conversation's target-side state: its KV cache and the tokens whose
K/V the cache holds. It outlives one generation, so turn N of a call prefills only
the tokens turn N added. Rolling back after a rejection is setting the valid length.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import torch

from llm.constrain import ConstraintState
from llm.detokenize import IncrementalDetokenizer
from llm.drafters import Drafter, DraftStep, Proposal, common_prefix
from llm.gamma import GammaController, Load
from llm.model import KVCache, Segment, Transformer, new_cache
from llm.sampling import Verdict, apply_mask, choose, verify_greedy, verify_sampled, warp
from llm.scheduler import PassInfo, PassSkipped, Piece, PieceSteps, Runner, SoloRunner
from llm.types import GenerationStats, SamplingParams, TokenGroup


@dataclass
class Sequence:
    cache: KVCache
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are valid in `cache`


def new_sequence(model: Transformer, capacity: int = 256) -> Sequence:
    return Sequence(new_cache(model, capacity))


@dataclass(frozen=True)
class Choice:
    """The offer draft_steps chose, and what the controller expected of it (for the pass's
    trace record). No expected rate: nothing was weighed (a fixed gamma, no offer)."""

    proposal: Proposal
    expected_rate: float | None = None
    catch_up_s: float = 0.0  # what the drafter had to run first (a draft model behind the context)
    unchosen: tuple[Proposal, ...] = ()  # the answer memory's offers not drafted (see learn)


# draft_steps as a generator: yields the draft model's forwards, is sent (logits, seconds)
# for each, returns the Choice.
ChoiceSteps = Generator[DraftStep, tuple[torch.Tensor, float], Choice]


# Drafters whose offer costs no forward pass: asked every pass, their offers weighed by
# the acceptance the controller learns for each (llm/drafters.py, llm/call_drafter.py).
FREE_DRAFTERS = frozenset({"ngram", "answers", "call", "grammar"})


def draft_steps(drafters: list[Drafter], controller: GammaController, context: list[int], limit: int,
                params: SamplingParams, guide: ConstraintState | None = None) -> ChoiceSteps:
    """Ask the drafters for at most `limit` tokens and keep the offer worth most tokens/s.

    N-gram lookup and the tool-call skeleton (FREE_DRAFTERS) tell their offers for free, so
    they are looked up first; a draft model,
    whose cost grows with every token, runs only for the gamma the controller picks
    and only if its expected rate beats the free offer. With a fixed gamma the first
    drafter with an offer wins. A generator: the draft model's forwards are yielded
    (llm.drafters.DraftStep), so the engine thread can batch them across conversations.
    Under a constraint (`guide`) a free offer is cut before its first token the
    constraint rejects, so it is weighed for what can be verified; a draft model drafts
    from its masked distribution. A draft model that fell behind the context is charged
    its catch-up (`catch_up_s`) in the pass it would draft in.

    Returns what was chosen and what the controller expected of it (the pass's record,
    GenerationStats.trace)."""
    offers: list[tuple[float, Proposal | None, Drafter | None, int, float]] = []
    memory: list[Proposal] = []  # the answer memory's offers, checked after the pass if not drafted
    for d in drafters:
        if d.name in FREE_DRAFTERS:
            offer = d.propose(context, limit, params)
            if guide is not None and offer.tokens:
                offer.tokens = offer.tokens[: guide.valid_prefix(offer.tokens)]
            if offer.tokens and d.name == "answers":
                memory.append(offer)
            if offer.tokens:
                g = controller.choose(offer.source, len(offer.tokens))
                if g > 0:
                    offers.append((controller.rate(offer.source, g), Proposal(offer.tokens[:g], None, offer.source, offer.cost_s), None, g, 0.0))
        else:
            behind = getattr(d, "behind", None)
            extra = controller.catch_up_s(d.name, behind(context) - 1) if behind is not None else 0.0
            g = controller.choose(d.name, limit, extra)
            if g > 0:
                offers.append((controller.rate(d.name, g, extra), None, d, g, extra))
    if not offers:
        return Choice(Proposal([], None, "none", 0.0), unchosen=tuple(memory))
    if controller.fixed is None:
        offers.sort(key=lambda o: o[0], reverse=True)
    rate, proposal, drafter, g, extra = offers[0]
    chosen = proposal.source if proposal is not None else None
    memory = [m for m in memory if m.source != chosen]
    # A fixed gamma has no expected rate (the controller does not choose): none recorded.
    expected_rate = None if rate == float("inf") else rate
    if proposal is None:
        steps = getattr(drafter, "propose_steps", None)
        if steps is None:  # a drafter that runs its own forwards
            proposal = drafter.propose(context, g, params)
        elif guide is not None:
            proposal = yield from steps(context, g, params, guide=guide)
        else:
            proposal = yield from steps(context, g, params)
    return Choice(proposal, expected_rate, extra, tuple(memory))


@dataclass(frozen=True)
class Observe:
    """Show `see` the float32 logits at the prompt's row `before_end` tokens before its last
    one (0: the last, whose row picks the first token), before any constraint, when the
    prefill computes that row (not when the cache already held it). A row before the last
    costs one more row of the vocabulary head, no pass."""

    before_end: int
    see: Callable[[torch.Tensor], None]


@dataclass
class Generation:
    """Everything one generation needs besides the models."""

    params: SamplingParams
    eos_ids: frozenset[int]
    max_context: int
    cancel: threading.Event | None = None
    lock: threading.Lock | None = None  # serialises passes when several calls share a model
    # Runs each pass. The engine's scheduler batches the passes of all its conversations on
    # one thread; None: each pass runs on the calling thread behind `lock` (SoloRunner).
    runner: Runner | None = None
    # The constraint's state (llm/constrain.py) when the request has one: every position's
    # distribution is masked to what it allows, and it moves by the tokens kept.
    guide: ConstraintState | None = None
    # Shown the logits of one prompt row if the prefill computes it (engine.end_probability,
    # and a preemptive start: whether the caller's words end their message).
    observe: Observe | None = None

    @property
    def background(self) -> bool:
        """A preemptive answer whose turn has not ended: its passes yield to the others'
        (llm/scheduler.py). Its cancel says so (`background`), read whenever the scheduler
        chooses a round: a pass queued before the turn ended goes with the next one."""
        return bool(getattr(self.cancel, "background", False))

    def cancelled(self) -> bool:
        """Read by the scheduler while a pass waits: a cancelled generation's pass is not run."""
        return self.cancel is not None and self.cancel.is_set()


@dataclass
class Decoding:
    """One generation's state between passes: what gpt-fast passes as arguments."""

    target: Transformer
    seq: Sequence
    prompt: list[int]
    drafters: list[Drafter]
    controller: GammaController
    detok: IncrementalDetokenizer
    gen: Generation
    stats: GenerationStats
    clock: Callable[[], float]
    generator: torch.Generator | None  # the target's random draws (sampled); None: greedy
    t_start: float
    context: list[int]  # the tokens whose K/V the target's cache holds
    pending: int = -1  # the target's latest token: out already, not yet in its cache
    produced: list[int] = field(default_factory=list)  # the answer so far
    # What this conversation brings to a pass, for the others' gamma (llm.gamma.Load),
    # until it prepares its next.
    hint: Load = field(default_factory=lambda: Load(rows=1, tokens=1.0))


@dataclass(frozen=True)
class Drafted:
    """What one pass drafted, from draft() to the verdict and the pass's record."""

    proposal: Proposal
    seconds: float  # drafting, wall time (the constraint's checks included)
    masks: torch.Tensor | None  # the constraint's mask of each target row; None: unconstrained
    expected_rate: float | None
    catch_up_s: float
    unchosen: tuple[Proposal, ...] = ()  # the answer memory's offers not drafted (see learn)


def start(target: Transformer, seq: Sequence, prompt: list[int], drafters: list[Drafter],
          controller: GammaController, detok: IncrementalDetokenizer, gen: Generation,
          stats: GenerationStats, clock: Callable[[], float]) -> Decoding:
    """A generation's state before its first pass (a prompt that does not fit is refused)."""
    params = gen.params
    generator = None
    if not params.greedy:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(params.seed if params.seed is not None else int(time.time_ns() % 2**63))
    if len(prompt) == 0:
        raise ValueError("empty prompt: give at least one token")
    if len(prompt) >= gen.max_context:
        raise ValueError(
            f"prompt has {len(prompt)} tokens but the context holds {gen.max_context}: "
            "shorten the history or the system prompt, or raise llm.context_tokens"
        )
    stats.prompt_tokens = len(prompt)
    return Decoding(target, seq, prompt, drafters, controller, detok, gen, stats, clock, generator,
                    t_start=clock(), context=list(prompt))


def first_pass(s: Decoding, runner: Runner) -> TokenGroup:
    """The prefill: computes the prompt's tokens the cache does not hold yet (at least the
    last, whose row picks the first token) and emits that token."""
    prompt, guide, stats = s.prompt, s.gen.guide, s.stats
    keep = min(common_prefix(s.seq.tokens, prompt), len(prompt) - 1)
    # What the constraint forces at the start (a turn plan's '{"act": "answer"}\n') is
    # computed with the prompt, in the prefill: the target can write nothing else there, so
    # those rows cost a few more prefill rows instead of a pass of their own before the
    # first free token. Greedy output is the same; a sampled one skips the draws of tokens
    # that had one choice (the same distribution).
    room = min(s.gen.params.max_new_tokens - 1, s.gen.max_context - len(prompt) - 1)
    forced = _forced_start(guide, room)
    ahead = [*prompt, *forced]
    computed = len(ahead) - keep
    # The row Generation.observe asks for: the last one, one before it (one more row of
    # logits), or none when the cache already held it.
    observe, also_row = s.gen.observe, None
    if observe is not None:
        at = len(prompt) - 1 - observe.before_end
        if keep <= at < len(ahead) - 1:
            also_row = at - keep
        elif at != len(ahead) - 1:
            observe = None

    # Both run where the runner runs passes (the engine thread); they touch only this conversation.
    def prepare(load: Load) -> Piece:
        todo = torch.tensor(ahead[keep:], dtype=torch.long, device=s.target.device)
        return Piece(s.target, Segment(s.seq.cache, todo, keep, all_logits=False, also_row=also_row), 1.0, 0.0)

    def finish(logits: torch.Tensor) -> int:
        s.seq.tokens = list(ahead)
        row = logits[-1]
        if observe is not None:
            observe.see(logits[0])  # the asked row: the last, or the one before it
        if guide is not None:
            allowed = guide.mask()
            stats.forced_tokens += int(allowed.sum()) == 1
            row = apply_mask(row, allowed)
        return choose(row, s.gen.params, s.generator)

    t0 = s.clock()
    token, _ = runner.run(prepare, finish, Load(rows=computed, tokens=1.0), background=lambda: s.gen.background,
                          skip=s.gen.cancelled)
    if guide is not None:
        guide.advance([token])
    stats.prefill_s = s.clock() - t0
    stats.prefilled_tokens = computed
    stats.forced_tokens += len(forced)
    stats.passes = 1
    s.context.extend(forced)
    s.pending = token
    group = emit(s, [*forced, token], 0, 0)
    stats.ttft_s = s.clock() - s.t_start
    return group


def _forced_start(guide: ConstraintState | None, room: int) -> list[int]:
    """The tokens the constraint allows alone from its start (none without one), advanced
    past: they go into the prefill (an end of the answer among them ends it in `emit`)."""
    if guide is None or room <= 0:
        return []
    forced = guide.forced(room)
    guide.advance(forced)
    return forced


def speculative_pass(s: Decoding, runner: Runner) -> TokenGroup:
    """One pass: draft -> verify `pending` and the drafts in one target forward -> accept
    -> emit. The runner calls the pass's prepare (draft) and finish (verify) on the
    engine thread; the drafts travel between them in the _PassJob."""
    base = len(s.context)  # the position of `pending`
    s.context.append(s.pending)
    job = _PassJob(s, base, draft_limit(s))
    verdict, info = runner.run(job.prepare, job.finish, s.hint, background=lambda: s.gen.background,
                               skip=s.gen.cancelled)
    drafted = job.drafted
    n = len(drafted.proposal.tokens)
    # Told to the others' passes until this one prepares its next (before the controller
    # learns from this pass: what it expected when it chose).
    s.hint = Load(rows=n + 1, tokens=s.controller.expected(drafted.proposal.source, n), draft_s=drafted.seconds)
    kept = accept(s, drafted, verdict, base)
    learn(s, drafted, len(kept), info)
    record(s, drafted, len(kept), info)
    return emit(s, kept + [s.pending], n, len(kept))


def draft_limit(s: Decoding) -> int:
    """The most drafts this pass may verify: the answer's budget and the context's room
    both keep one token for the target's own. Also tells the controller the horizon a
    catch-up is spread over."""
    remaining = s.gen.params.max_new_tokens - len(s.produced)
    room = s.gen.max_context - len(s.context)
    s.controller.horizon = float(min(remaining, room, 48))
    return max(0, min(s.controller.max_gamma, remaining - 1, room - 1))


@dataclass
class _PassJob:
    """A speculative pass as the runner takes it: prepare drafts and names the target rows,
    finish judges them; `drafted` carries the drafts from one to the other."""

    s: Decoding
    base: int  # the position of `pending`
    limit: int
    drafted: Drafted | None = None

    def prepare(self, load: Load) -> PieceSteps:
        # A generator: it yields the draft model's forwards (batched with the other
        # conversations' on the engine thread) and returns the target's rows.
        self.drafted = yield from draft(self.s, self.limit, load)
        return verify_piece(self.s, self.drafted, self.base)

    def finish(self, logits: torch.Tensor) -> Verdict:
        return verify(self.s, self.drafted, logits)


def draft(s: Decoding, limit: int, load: Load) -> Generator[DraftStep, tuple[torch.Tensor, float], Drafted]:
    """At most `limit` drafts, chosen for the batch the pass is in (`load`); under a
    constraint they end at the first token it rejects (never verified)."""
    s.controller.load = load
    guide = s.gen.guide
    t0 = s.clock()
    choice = Choice(Proposal([]))
    if limit > 0 and s.drafters and not (guide is not None and guide.done):
        choice = yield from draft_steps(s.drafters, s.controller, s.context, limit, s.gen.params, guide)
    proposal, masks = choice.proposal, None
    if guide is not None:
        # The rows' masks are the constraint's state after pending + drafts[:i].
        kept, masks = guide.check_drafts(proposal.tokens)
        if len(kept) < len(proposal.tokens):
            probs = None if proposal.probs is None else proposal.probs[: len(kept)]
            proposal = Proposal(kept, probs, proposal.source, proposal.cost_s)
    return Drafted(proposal, s.clock() - t0, masks, choice.expected_rate, choice.catch_up_s, choice.unchosen)


def verify_piece(s: Decoding, drafted: Drafted, base: int) -> Piece:
    """The target's rows: `pending` and the drafts, every row's logits kept."""
    drafts = drafted.proposal.tokens
    rows = torch.tensor([s.pending] + drafts, dtype=torch.long, device=s.target.device)
    expected = s.controller.expected(drafted.proposal.source, len(drafts))
    return Piece(s.target, Segment(s.seq.cache, rows, base, all_logits=True), expected, drafted.seconds)


def verify(s: Decoding, drafted: Drafted, logits: torch.Tensor) -> Verdict:
    """How many drafts the target keeps, and its own next token. Greedy: its argmax row by
    row. Sampled: rejection sampling, so the tokens follow the target's distribution."""
    params, proposal = s.gen.params, drafted.proposal
    if drafted.masks is not None:
        logits = apply_mask(logits, drafted.masks)
    if params.greedy:
        return verify_greedy(logits, proposal.tokens)
    return verify_sampled(warp(logits, params), proposal.tokens, proposal.probs, s.generator)


def accept(s: Decoding, drafted: Drafted, verdict: Verdict, base: int) -> list[int]:
    """Keep pending and the accepted drafts (the rest of the cache is stale: rolled back by
    its length); the target's own token becomes pending. Returns the accepted drafts."""
    kept = drafted.proposal.tokens[: verdict.accepted]
    s.seq.cache.length = base + 1 + len(kept)
    s.seq.tokens = s.context + kept
    s.context.extend(kept)
    s.pending = verdict.next_token
    guide = s.gen.guide
    if guide is not None:
        # Exactly the accepted drafts and the target's own token; a token each row's
        # mask left alone was forced.
        guide.advance(kept + [s.pending])
        s.stats.forced_tokens += int((drafted.masks[: len(kept) + 1].sum(dim=-1) == 1).sum())
        s.stats.mask_s = guide.mask_s
    return kept


def learn(s: Decoding, drafted: Drafted, accepted: int, info: PassInfo) -> None:
    """The controller learns the pass's costs and the drafter's acceptance."""
    c, proposal = s.controller, drafted.proposal
    n = len(proposal.tokens)
    # The pass's cost is a function of all its rows (other conversations' too).
    c.observe_verify(info.rows, info.seconds)
    c.observe_draft(proposal.source, n, accepted, proposal.cost_s)
    for d in s.drafters:  # a draft model that caught up this pass: what a row of that cost
        if getattr(d, "last_catch_up", None):
            c.observe_catch_up(d.name, *d.last_catch_up)
            d.last_catch_up = None
    if info.conversations == 1:  # alone in its pass: the wall time is all its own
        c.observe_pass(proposal.source, n, accepted + 1, drafted.seconds + info.seconds)
    if s.gen.params.greedy:
        # The answer memory's offers that were not drafted, checked against the tokens the
        # target wrote: its sources learn while prompt lookup is chosen over them, and in a
        # batch where no conversation drafts (the bar a pass of many rows must clear), so
        # that a common answer is trusted once it is seen again. Greedy only: there the
        # target's tokens are what a draft is judged by.
        written = proposal.tokens[:accepted] + [s.pending]
        for offer in drafted.unchosen:
            matched = common_prefix(offer.tokens, written)
            c.observe_offer(offer.source, matched, matched < min(len(offer.tokens), len(written)))
    for d in s.drafters:
        d.accepted(accepted)


def record(s: Decoding, drafted: Drafted, accepted: int, info: PassInfo) -> None:
    """The pass in the stats, and its trace record: what the controller expected (after
    learning from it) and what was measured; why speculation paid or did not."""
    stats, c, proposal = s.stats, s.controller, drafted.proposal
    n = len(proposal.tokens)
    stats.passes += 1
    stats.drafted += n
    stats.accepted += accepted
    stats.draft_s += drafted.seconds
    stats.verify_s += info.seconds
    stats.gammas.append(n)
    stats.trace.append({
        "g": n, "source": proposal.source if n else "none", "accepted": accepted,
        "draft_s": round(drafted.seconds, 5), "verify_s": round(info.seconds, 5), "rows": info.rows,
        "expected_rate": None if not n or drafted.expected_rate is None else round(drafted.expected_rate, 3),
        "plain_rate": round(1.0 / c.verify.cost(1), 3),
        "estimated_verify_s": round(c.verify.cost(info.rows), 5),
        "acceptance_estimate": round(c.stats(proposal.source).estimate, 3) if n else None,
        "catch_up_s": round(drafted.catch_up_s, 5) if n else 0.0,
    })


def emit(s: Decoding, tokens: list[int], drafted: int, accepted: int) -> TokenGroup:
    """Append the pass's tokens to the answer, up to eos / a stop string / the length
    limit; returns the pass's group."""
    params, out, text, reason = s.gen.params, [], [], None
    for tok in tokens:
        out.append(tok)
        s.produced.append(tok)
        if tok in s.gen.eos_ids:
            reason = "eos"
            break
        text.append(s.detok.add(tok))
        if s.detok.stopped:
            reason = "stop"
            break
        if len(s.produced) >= params.max_new_tokens or len(s.prompt) + len(s.produced) >= s.gen.max_context:
            reason = "length"
            break
    if reason in ("eos", "length"):
        text.append(s.detok.finish())
    s.stats.new_tokens = len(s.produced)
    return TokenGroup(tuple(out), "".join(text), drafted, accepted, time.monotonic(), reason)


def speculative_stream(
    target: Transformer,
    seq: Sequence,
    prompt: list[int],
    drafters: list[Drafter],
    controller: GammaController,
    detok: IncrementalDetokenizer,
    gen: Generation,
    stats: GenerationStats,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[TokenGroup]:
    """Generate from `prompt`, yielding one TokenGroup per target pass.

    Greedy: identical tokens to the same loop with no drafters. Sampled: the target's
    distribution, by rejection sampling. Every group holds 1..gamma+1 tokens, except a
    final empty group when cancelled between passes.
    """
    runner = gen.runner if gen.runner is not None else SoloRunner(gen.lock)
    s = start(target, seq, prompt, drafters, controller, detok, gen, stats, clock)
    try:
        group = first_pass(s, runner)
        yield group
        while group.finish_reason is None:
            if gen.cancelled():
                raise PassSkipped()
            group = speculative_pass(s, runner)
            yield group
    except PassSkipped:  # cancelled between passes, or while its pass waited (not run)
        stats.total_s = clock() - s.t_start
        yield TokenGroup((), "", 0, 0, time.monotonic(), "cancelled")
        return
    # The last token is not in the cache yet; a next turn's prefill computes it.
    stats.total_s = clock() - s.t_start
