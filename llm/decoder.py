"""The speculative decoding loop: prefill, then draft -> verify -> emit, one group per pass.

Pure functions over explicit state, in the manner of gpt-fast's generate.py:

    speculative_stream(...)                -> yields one TokenGroup per target pass

`Sequence` is a conversation's target-side state: its KV cache and the tokens whose
K/V the cache holds. It outlives one generation, so turn N of a call prefills only
the tokens turn N added. Rolling back after a rejection is setting the valid length.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from llm.constrain import ConstraintState
from llm.detokenize import IncrementalDetokenizer
from llm.drafters import Drafter, DraftSteps, Proposal, common_prefix
from llm.gamma import GammaController, Load
from llm.model import KVCache, Segment, Transformer, new_cache
from llm.sampling import apply_mask, choose, verify_greedy, verify_sampled, warp
from llm.scheduler import Piece, PieceSteps, Runner, SoloRunner
from llm.types import GenerationStats, SamplingParams, TokenGroup


@dataclass
class Sequence:
    cache: KVCache
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are valid in `cache`


def new_sequence(model: Transformer, capacity: int = 256) -> Sequence:
    return Sequence(new_cache(model, capacity))


# Drafters whose offer costs no forward pass: asked every pass, their offers weighed by
# the acceptance the controller learns for each (llm/drafters.py, llm/call_drafter.py).
FREE_DRAFTERS = frozenset({"ngram", "call", "grammar"})


def draft_steps(drafters: list[Drafter], controller: GammaController, context: list[int], limit: int,
                params: SamplingParams, guide: ConstraintState | None = None) -> DraftSteps:
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

    What was chosen, and what the controller expected of it, is left in
    `controller.last_choice` for the pass's record (GenerationStats.trace)."""
    controller.last_choice = {"expected_rate": None, "extra_s": 0.0}
    offers: list[tuple[float, Proposal | None, Drafter | None, int, float]] = []
    for d in drafters:
        if d.name in FREE_DRAFTERS:
            offer = d.propose(context, limit, params)
            if guide is not None and offer.tokens:
                offer.tokens = offer.tokens[: guide.valid_prefix(offer.tokens)]
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
        return Proposal([], None, "none", 0.0)
    if controller.fixed is None:
        offers.sort(key=lambda o: o[0], reverse=True)
    rate, proposal, drafter, g, extra = offers[0]
    # A fixed gamma has no expected rate (the controller does not choose): none recorded.
    controller.last_choice = {"expected_rate": None if rate == float("inf") else rate, "extra_s": extra}
    if proposal is not None:
        return proposal
    steps = getattr(drafter, "propose_steps", None)
    if steps is None:  # a drafter that runs its own forwards
        return drafter.propose(context, g, params)
    if guide is not None:
        return (yield from steps(context, g, params, guide=guide))
    return (yield from steps(context, g, params))


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
    runner = gen.runner if gen.runner is not None else SoloRunner(gen.lock)
    t_start = clock()
    stats.prompt_tokens = len(prompt)

    # Prefill: the prompt's last position predicts the first new token. Both callbacks run
    # where the runner runs passes (the engine thread); they touch only this conversation.
    keep = min(common_prefix(seq.tokens, prompt), len(prompt) - 1)
    computed = len(prompt) - keep

    def prepare_prefill(load: Load) -> Piece:
        todo = torch.tensor(prompt[keep:], dtype=torch.long, device=target.device)
        return Piece(target, Segment(seq.cache, todo, keep, all_logits=False), 1.0, 0.0)

    guide = gen.guide

    def finish_prefill(logits: torch.Tensor) -> int:
        seq.tokens = list(prompt)
        row = logits[-1]
        if guide is not None:
            allowed = guide.mask()
            stats.forced_tokens += int(allowed.sum()) == 1
            row = apply_mask(row, allowed)
        return choose(row, params, generator)

    t0 = clock()
    token, _ = runner.run(prepare_prefill, finish_prefill, Load(rows=computed, tokens=1.0))
    if guide is not None:
        guide.advance([token])
    stats.prefill_s = clock() - t0
    stats.prefilled_tokens = computed
    stats.passes = 1
    pending = token  # sampled but not yet in the target's cache
    hint = Load(rows=1, tokens=1.0)
    context = list(prompt)
    produced: list[int] = []

    def emit(tokens: list[int], drafted: int, accepted: int) -> TokenGroup:
        """Append accepted tokens, applying eos / stop / length; returns this pass's group."""
        out: list[int] = []
        text = []
        reason = None
        for tok in tokens:
            out.append(tok)
            produced.append(tok)
            if tok in gen.eos_ids:
                reason = "eos"
                break
            text.append(detok.add(tok))
            if detok.stopped:
                reason = "stop"
                break
            if len(produced) >= params.max_new_tokens or len(prompt) + len(produced) >= gen.max_context:
                reason = "length"
                break
        if reason in ("eos", "length"):
            text.append(detok.finish())
        stats.new_tokens = len(produced)
        return TokenGroup(tuple(out), "".join(text), drafted, accepted, time.monotonic(), reason)

    group = emit([pending], 0, 0)
    stats.ttft_s = clock() - t_start
    yield group
    if group.finish_reason:
        stats.total_s = clock() - t_start
        return

    while True:
        if gen.cancel is not None and gen.cancel.is_set():
            stats.total_s = clock() - t_start
            yield TokenGroup((), "", 0, 0, time.monotonic(), "cancelled")
            return
        base = len(context)  # position of `pending`
        context.append(pending)
        remaining = params.max_new_tokens - len(produced)
        room = gen.max_context - len(context)
        limit = max(0, min(controller.max_gamma, remaining - 1, room - 1))
        controller.horizon = float(min(remaining, room, 48))
        box: dict = {}

        # Called by the runner before it returns, within this iteration (defaults bind the values).
        def prepare(load: Load, box=box, limit=limit, pending=pending, base=base) -> PieceSteps:
            # A generator: it yields the draft model's forwards (batched with the other
            # conversations' on the engine thread) and returns the target's rows.
            controller.load = load
            t0 = clock()
            proposal = Proposal([])
            if limit > 0 and drafters and not (guide is not None and guide.done):
                proposal = yield from draft_steps(drafters, controller, context, limit, params, guide)
            if guide is not None:
                # Drafts end at the first token the constraint rejects (never verified); the
                # rows' masks are the constraint's state after pending + drafts[:i].
                kept, box["masks"] = guide.check_drafts(proposal.tokens)
                if len(kept) < len(proposal.tokens):
                    probs = None if proposal.probs is None else proposal.probs[: len(kept)]
                    proposal = Proposal(kept, probs, proposal.source, proposal.cost_s)
            box["draft_s"] = clock() - t0
            box["proposal"] = proposal
            rows = torch.tensor([pending] + proposal.tokens, dtype=torch.long, device=target.device)
            expected = controller.expected(proposal.source, len(proposal.tokens))
            return Piece(target, Segment(seq.cache, rows, base, all_logits=True), expected, box["draft_s"])

        def finish(logits: torch.Tensor, box=box):
            drafts = box["proposal"].tokens
            if guide is not None:
                logits = apply_mask(logits, box["masks"])
            if params.greedy:
                return verify_greedy(logits, drafts)
            return verify_sampled(warp(logits, params), drafts, box["proposal"].probs, generator)

        verdict, info = runner.run(prepare, finish, hint)
        proposal = box["proposal"]
        drafts = proposal.tokens
        # What this conversation brings to a pass, for the others' gamma until it prepares its next.
        hint = Load(rows=len(drafts) + 1, tokens=controller.expected(proposal.source, len(drafts)), draft_s=box["draft_s"])
        # Roll back: keep pending + accepted drafts; the rest of the cache is stale.
        kept = drafts[: verdict.accepted]
        seq.cache.length = base + 1 + len(kept)
        seq.tokens = context + kept
        context.extend(kept)
        stats.passes += 1
        stats.drafted += len(drafts)
        stats.accepted += len(kept)
        stats.draft_s += box["draft_s"]
        stats.verify_s += info.seconds
        stats.gammas.append(len(drafts))
        # The pass's cost is a function of all its rows (other conversations' too).
        controller.observe_verify(info.rows, info.seconds)
        controller.observe_draft(proposal.source, len(drafts), len(kept), proposal.cost_s)
        for d in drafters:  # a draft model that caught up this pass: what a row of that cost
            if getattr(d, "last_catch_up", None):
                controller.observe_catch_up(d.name, *d.last_catch_up)
                d.last_catch_up = None
        if info.conversations == 1:  # alone in its pass: the wall time is all its own
            controller.observe_pass(proposal.source, len(drafts), len(kept) + 1, box["draft_s"] + info.seconds)
        stats.trace.append({
            "g": len(drafts), "source": proposal.source if drafts else "none", "accepted": len(kept),
            "draft_s": round(box["draft_s"], 5), "verify_s": round(info.seconds, 5), "rows": info.rows,
            "expected_rate": None if not drafts or controller.last_choice["expected_rate"] is None
            else round(controller.last_choice["expected_rate"], 3),
            "plain_rate": round(1.0 / controller.verify.cost(1), 3),
            "estimated_verify_s": round(controller.verify.cost(info.rows), 5),
            "acceptance_estimate": round(controller.stats(proposal.source).estimate, 3) if drafts else None,
            "catch_up_s": round(controller.last_choice["extra_s"], 5) if drafts else 0.0,
        })
        for d in drafters:
            d.accepted(len(kept))
        pending = verdict.next_token
        if guide is not None:
            # Exactly the accepted drafts and the target's own token; a token each row's
            # mask left alone was forced.
            guide.advance(kept + [pending])
            stats.forced_tokens += int((box["masks"][: len(kept) + 1].sum(dim=-1) == 1).sum())
            stats.mask_s = guide.mask_s
        group = emit(kept + [pending], len(drafts), len(kept))
        yield group
        if group.finish_reason:
            break
    # The last token is not in the cache yet; a next turn's prefill computes it.
    stats.total_s = clock() - t_start
