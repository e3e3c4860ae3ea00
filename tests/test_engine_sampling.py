"""Speculative sampling keeps the target's distribution (rejection sampling).

Statistical tests with fixed seeds: the empirical distribution of thousands of samples
must be within a total-variation bound of the exact target distribution. Each test
also runs a deliberately wrong sampler through the same check and asserts it fails,
so the bound is tight enough to catch a broken acceptance rule or residual.
"""

import collections

import pytest
import torch

from llm.drafters import NgramDrafter
from llm.engine import SpeculativeEngine
from llm.model import forward, new_cache
from llm.sampling import Verdict, verify_sampled, warp
from llm.types import SamplingParams

N = 20000
BOUND = 0.025  # TV between an exact sampler's histogram and p over <= 6 outcomes at N draws: ~0.008


def tv(counts: dict, p: torch.Tensor, n: int) -> float:
    emp = torch.zeros_like(p)
    for k, c in counts.items():
        emp[k] = c / n
    return 0.5 * float((emp - p).abs().sum())


def wrong_residual_sampler(target_probs, drafts, draft_probs, generator):
    """Bug: on rejection, resample from p instead of max(0, p - q)."""
    for i, x in enumerate(drafts):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if float(torch.rand((), generator=generator)) < min(1.0, float(target_probs[i, x]) / q_x):
            continue
        return Verdict(i, int(torch.multinomial(target_probs[i], 1, generator=generator)))
    return Verdict(len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))


def wrong_acceptance_sampler(target_probs, drafts, draft_probs, generator):
    """Bug: always accept the draft token (speculation without verification)."""
    return Verdict(len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))


def first_token_hist(sampler, p, q, seed=0):
    """Distribution of the first emitted token when one draft is proposed from q."""
    g = torch.Generator().manual_seed(seed)
    counts = collections.Counter()
    P = torch.stack([p, p])
    for _ in range(N):
        if q is None:
            x = 3  # a one-hot draft (n-gram style): always token 3, no probabilities
            probs = None
        else:
            x = int(torch.multinomial(q, 1, generator=g))
            probs = q[None]
        v = sampler(P, [x], probs, g)
        counts[x if v.accepted == 1 else v.next_token] += 1
    return counts


CASES = {
    "disjoint": (torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.0, 0.2, 0.3, 0.5])),
    "identical": (torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0]), torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0])),
    "overlapping": (torch.tensor([0.05, 0.15, 0.4, 0.1, 0.2, 0.1]), torch.tensor([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])),
    "one_hot_draft": (torch.tensor([0.1, 0.2, 0.3, 0.25, 0.1, 0.05]), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_token_has_target_distribution(case):
    p, q = CASES[case]
    assert tv(first_token_hist(verify_sampled, p, q), p, N) < BOUND


@pytest.mark.parametrize(
    "case,sampler",
    [
        # With disjoint supports every draft is rejected and resampling from p happens to be
        # right, so only the acceptance bug shows there; where supports overlap both do.
        ("disjoint", wrong_acceptance_sampler),
        ("overlapping", wrong_acceptance_sampler),
        ("overlapping", wrong_residual_sampler),
        ("one_hot_draft", wrong_acceptance_sampler),
        ("one_hot_draft", wrong_residual_sampler),
    ],
)
def test_wrong_samplers_fail_the_same_check(case, sampler):
    p, q = CASES[case]
    assert tv(first_token_hist(sampler, p, q), p, N) > BOUND


def test_warp_matches_definition():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = warp(logits, SamplingParams(temperature=0.5, top_k=3))
    assert p[0, 3] == 0 and p[0, 4] == 0
    ref = torch.softmax(logits[0, :3] / 0.5, -1)
    assert torch.allclose(p[0, :3], ref)
    p = warp(logits, SamplingParams(temperature=1.0, top_p=0.7))
    full = torch.softmax(logits[0], -1)  # 0.53, 0.19, ... -> first two reach 0.7
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(p[0, :2], full[:2] / full[:2].sum())


def exact_distribution(model, prompt, params, length=3):
    """P(t1..t_length) of the target alone with warping, computed exactly from its logits."""
    out = {}
    with torch.inference_mode():

        def walk(prefix, prob):
            cache = new_cache(model)
            p = warp(forward(model, cache, torch.tensor(prompt + prefix), 0)[-1], params)
            for t in torch.nonzero(p).flatten().tolist():
                if len(prefix) + 1 == length:
                    out[tuple(prefix + [t])] = prob * float(p[t])
                else:
                    walk(prefix + [t], prob * float(p[t]))

        walk([], 1.0)
    return out


def engine_tv(eng, prompt, params, n=3000, min_n=None, joint=None):
    """TV between the engine's samples of its first 3 tokens and the exact distribution
    (`joint`; by default the target's own, from `exact_distribution`). Sampled under
    `params.constraint` when it has one (tests/test_constrained.py).

    Token 1 comes from the prefill; tokens 2 and 3 from the first speculative pass (one
    draft verified, then the correction or bonus token)."""
    if joint is None:
        joint = exact_distribution(eng.target.model, prompt, params)
    eng.warm_prefix(prompt[:-1])  # each sample copies the prompt's K/V instead of recomputing it
    gen = torch.Generator().manual_seed(99)
    counts = collections.Counter()
    drafted = 0
    for i in range(n):
        seed = int(torch.randint(0, 2**31, (), generator=gen))
        conv = eng.new_conversation(seed=seed)
        if min_n is not None:
            conv.drafters = [NgramDrafter(min_n=min_n)]
        ids, _, stats = eng.generate(prompt, SamplingParams(3, params.temperature, params.top_k, 1.0, seed,
                                                            constraint=params.constraint), conv)
        counts[tuple(ids)] += 1
        drafted += stats.drafted
    # Outcomes the target can never produce count with their whole mass.
    distance = 0.5 * sum(abs(counts.get(k, 0) / n - joint.get(k, 0.0)) for k in set(joint) | set(counts))
    return distance, drafted


# At most 27 outcomes at 3000 samples: an exact sampler's TV is about 0.035.
ENGINE_BOUND = 0.075
PARAMS = SamplingParams(max_new_tokens=3, temperature=1.5, top_k=3, seed=1234)
PROMPT = "Hello! How can I help you today? Hello! How"


@pytest.mark.parametrize("drafter,draft", [("model", "draft"), ("model", "target"), ("ngram", None)])
def test_engine_first_tokens_have_target_distribution(tiny_models, drafter, draft):
    eng = SpeculativeEngine.load(
        tiny_models["target"], tiny_models[draft] if draft else None, drafter=drafter, gamma=2, dtype="float32", calibrate=False
    )
    prompt = eng.encode(PROMPT)
    min_n = None
    if drafter == "ngram":
        # Every token id occurs earlier with a successor, so 1-gram lookup always has a draft.
        prompt = torch.randperm(eng.target.model.args.vocab_size, generator=torch.Generator().manual_seed(3)).tolist() + prompt
        min_n = 1
    distance, drafted = engine_tv(eng, prompt, PARAMS, min_n=min_n)
    assert drafted > 0
    assert distance < ENGINE_BOUND


def test_engine_check_catches_a_wrong_sampler(tiny_models, monkeypatch):
    import llm.decoder

    monkeypatch.setattr(llm.decoder, "verify_sampled", wrong_acceptance_sampler)
    eng = SpeculativeEngine.load(tiny_models["target"], tiny_models["draft"], drafter="model", gamma=2, dtype="float32", calibrate=False)
    distance, drafted = engine_tv(eng, eng.encode(PROMPT), PARAMS)
    assert drafted > 0
    assert distance > ENGINE_BOUND
