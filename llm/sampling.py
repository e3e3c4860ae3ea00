"""Token choice and speculative verification, as small pure functions.

Greedy verification keeps the longest prefix of drafts equal to the target's argmax,
then adds the target's own argmax: token-identical to decoding the target alone.

Sampled verification is the rejection sampler of Leviathan et al. / Chen et al.: draft
token x (drawn from q) is kept with probability min(1, p(x) / q(x)); on the first
rejection the replacement is drawn from max(0, p - q) renormalised; when every draft
passes, a bonus token is drawn from p. The output then has exactly the target's
distribution p. p and q must be the *warped* distributions actually sampled from
(temperature, top-k, top-p applied to both). A drafter without probabilities (n-gram
lookup) proposes deterministically, so its q is a point mass on its token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm.types import SamplingParams


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of logits -> the probabilities a sampler with `params` draws from."""
    logits = logits.to(torch.float32) / max(params.temperature, 1e-6)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits with every token a constraint forbids at -inf (llm/constrain.py). `allowed`
    is bool, one row per row of logits (or one row for all); a model whose head is wider
    than the mask (padding rows) or narrower gets the common width, the rest forbidden."""
    width = min(logits.shape[-1], allowed.shape[-1])
    out = torch.full_like(logits, float("-inf"))
    out[..., :width] = logits[..., :width].masked_fill(~allowed[..., :width].to(logits.device), float("-inf"))
    return out


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits: argmax when greedy, else a draw from the warped row."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(warp(logits, params), 1, generator=generator))


@dataclass(frozen=True)
class Verdict:
    accepted: int  # how many drafts were kept
    next_token: int  # the target's own token after them (correction or bonus)


def verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> Verdict:
    """target_logits: (len(drafts) + 1, vocab); row i predicts the token after drafts[:i]."""
    best = torch.argmax(target_logits, dim=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return Verdict(n, best[n])


def verify_sampled(
    target_probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Verdict:
    """Rejection sampling. target_probs: (g + 1, V) warped; draft_probs: (g, V) or None (point masses)."""
    for i, x in enumerate(drafts):
        p_x = float(target_probs[i, x])
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if q_x > 0 and float(torch.rand((), generator=generator)) < min(1.0, p_x / q_x):
            continue
        if draft_probs is None:
            residual = target_probs[i].clone()
            residual[x] = 0.0
        else:
            residual = torch.clamp(target_probs[i] - draft_probs[i], min=0.0)
        total = float(residual.sum())
        # p == q gives a zero residual but then x is never rejected; guard against rounding.
        dist = residual / total if total > 0 else target_probs[i]
        return Verdict(i, int(torch.multinomial(dist, 1, generator=generator)))
    return Verdict(len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
