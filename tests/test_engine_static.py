"""The fixed-width static path (the GPU path, run eagerly on CPU): static KV cache,
R-row passes, masked attention over the whole cache, rollback by position.

Greedy output must be token-identical between gamma = 0 and gamma = k (both run every
pass at width R = max_gamma + 1, one float GEMM per layer) and equal to Hugging Face
generate. The `cuda` test runs the captured CUDA-graph path on a GPU.
"""

import pytest
import torch

from llm.engine import SpeculativeEngine
from llm.model import forward, forward_fixed, new_cache
from greedy_refs import PROMPTS, assert_hf_greedy, gamma0_outputs
from llm.types import SamplingParams

NEW = 32


def engine(path, draft=None, drafter="none", gamma=0, dtype="float32", device="cpu", **kw):
    kw.setdefault("fixed_width", True)
    return SpeculativeEngine.load(path, draft, drafter=drafter, gamma=gamma, dtype=dtype, device=device, calibrate=False, **kw)


def run(eng, text, conv=None, max_new=NEW):
    prompt = eng.encode(text)
    ids, groups, stats = eng.generate(prompt, SamplingParams(max_new_tokens=max_new), conv)
    return ids, groups, stats


@pytest.fixture(scope="module")
def baselines(tiny_models):
    """gamma = 0, fixed width: outputs per (target, dtype, prompt)."""
    return gamma0_outputs(tiny_models, engine, lambda eng, p: run(eng, p)[0])


def test_fixed_width_options_and_static_cache(tiny_models):
    plain = SpeculativeEngine.load(tiny_models["target"], drafter="none", gamma=0, dtype="float32", calibrate=False)
    assert not plain.fixed_width and not plain.cuda_graphs  # CPU default: unchanged
    assert plain.target.model.blocks[0].qkv.mode == "rowwise"
    with pytest.raises(ValueError, match="cuda_graphs needs device cuda"):
        engine(tiny_models["target"], cuda_graphs=True)
    eng = engine(tiny_models["target"], tiny_models["draft"], "model", 3)
    assert eng.fixed_width and not eng.cuda_graphs
    assert eng.target.model.blocks[0].qkv.mode == "float"  # one GEMM per layer, not row by row
    r = eng.verify_width
    assert r == eng.max_gamma + 1 == 9
    conv = eng.new_conversation()
    cache = conv.seq.cache
    assert cache.static and cache.capacity == eng.context_tokens + r
    assert list(cache.steps.runners) == [r]  # every target pass runs R rows
    assert list(conv.drafters[0].cache.steps.runners) == [1, r]
    keys = [k.data_ptr() for k in cache.keys]
    run(eng, PROMPTS[0], conv)
    assert [k.data_ptr() for k in cache.keys] == keys  # never reallocated
    with pytest.raises(ValueError, match="context limit"):
        cache.ensure(cache.capacity + 1, 10**6)


@pytest.mark.parametrize("name", ["target", "target2", "llama"])
def test_gamma0_fixed_width_matches_hf_generate(tiny_models, baselines, name):
    assert_hf_greedy(tiny_models[name], engine(tiny_models[name]), baselines, name, NEW)


@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, 6, 7, 8])
def test_fixed_width_exact_draft_equal_to_target(tiny_models, baselines, gamma):
    for name in ("target", "llama"):
        eng = engine(tiny_models[name], tiny_models[name], "model", gamma)
        for p in PROMPTS:
            ids, groups, stats = run(eng, p)
            assert ids == baselines[name, "float32", p]
            assert stats.acceptance_rate == 1.0
            assert max(len(g.token_ids) for g in groups) == min(gamma + 1, NEW - 1)


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_fixed_width_exact_unrelated_draft(tiny_models, baselines, gamma, drafter):
    for name in ("target", "target2"):
        eng = engine(tiny_models[name], tiny_models["draft"], drafter, gamma)
        for p in PROMPTS:
            ids, _, stats = run(eng, p)
            assert ids == baselines[name, "float32", p], (name, p)
            assert stats.drafted > 0 and stats.accepted < stats.drafted


class PoisonAfterRollback:
    """Wraps a drafter; after every pass (the decoder has rolled the target cache back
    by then) it fills every target K/V slot beyond the valid length with poison:
    NaN keys and huge values."""

    def __init__(self, inner, cache):
        self.inner, self.cache, self.name = inner, cache, inner.name
        self.poisoned = 0

    def propose(self, context, k, params):
        return self.inner.propose(context, k, params)

    def accepted(self, n):
        n0 = self.cache.length
        for layer in range(len(self.cache.keys)):
            self.cache.keys[layer][:, n0:] = float("nan")
            self.cache.values[layer][:, n0:] = 1e30
        self.poisoned += 1
        self.inner.accepted(n)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_rollback_by_position_never_reads_stale_entries(tiny_models, baselines, dtype):
    eng = engine(tiny_models["target"], tiny_models["draft"], "model", 4, dtype)
    for p in PROMPTS:
        conv = eng.new_conversation()
        conv.drafters = [PoisonAfterRollback(conv.drafters[0], conv.seq.cache)]
        ids, _, stats = run(eng, p, conv)
        assert stats.accepted < stats.drafted  # rejections happened: stale drafts were in the cache
        assert conv.drafters[0].poisoned == stats.passes - 1
        assert ids == baselines["target", dtype, p]


def test_fixed_step_rows_do_not_see_each_other_or_the_future(tiny_models):
    """A row's logits do not depend on later rows, on what lies beyond it in the cache,
    or on the row it occupies in the step."""
    eng = engine(tiny_models["target"])
    m = eng.target.model
    ids = torch.randint(0, m.args.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    c1, c2 = new_cache(m, 64, static=True), new_cache(m, 64, static=True)
    start = torch.tensor([10])
    forward(m, c1, ids[:10], 0)
    forward(m, c2, ids[:10], 0)
    a = forward_fixed(m, c1, ids[10:19], start)  # nine real rows
    junk = ids[10:19].clone()
    junk[3:] = torch.tensor([5, 6, 7, 8, 9, 1])
    for layer in range(m.args.num_layers):
        c2.keys[layer][:, 30:] = 1e6
    b = forward_fixed(m, c2, junk, start)
    assert torch.equal(a[:3], b[:3])
    # Position 13 as row 0 of a step starting at 13 is bitwise row 3 of the step above.
    c = forward_fixed(m, c1, torch.cat([ids[13:14], torch.zeros(8, dtype=torch.long)]), torch.tensor([13]))
    assert torch.equal(c[0], a[3])


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_int8_fixed_width_stays_exact(tiny_models, baselines, gamma):
    for draft, drafter in (("target", "model"), ("draft", "hybrid")):
        eng = engine(tiny_models["target"], tiny_models[draft], drafter, gamma, "int8")
        for p in PROMPTS:
            ids, _, stats = run(eng, p)
            assert ids == baselines["target", "int8", p]
            if draft == "target":
                assert stats.acceptance_rate == 1.0


def test_fixed_width_conversation_turns_exact(tiny_models):
    """A second turn on the same static cache (prefix kept, stale tail masked) gives the
    same tokens at gamma 0 and gamma 3."""
    outs = []
    for gamma, drafter in ((0, "none"), (3, "hybrid")):
        eng = engine(tiny_models["target"], tiny_models["draft"] if gamma else None, drafter, gamma)
        conv = eng.new_conversation()
        p1 = eng.encode(PROMPTS[0])
        ids1, _, _ = eng.generate(p1, SamplingParams(max_new_tokens=16), conv)
        p2 = p1 + ids1 + eng.encode(" And Saturday?")
        ids2, _, s2 = eng.generate(p2, SamplingParams(max_new_tokens=16), conv)
        assert s2.prefilled_tokens < len(p2)
        outs.append((ids1, ids2))
    assert outs[0] == outs[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_graph_path_exact(tiny_models):
    """Captured CUDA graphs: float32 equals HF generate at every gamma; bfloat16 equals its own gamma 0."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32).to("cuda").eval()
    base = engine(tiny_models["target"], device="cuda", fixed_width=None)
    assert base.fixed_width and base.cuda_graphs
    for p in PROMPTS:
        prompt = base.encode(p)
        ref = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
        ref = ref[0, len(prompt):].tolist()
        assert run(base, p)[0] == ref
        for gamma in (1, 3, 8):
            for draft in ("target", "draft"):
                eng = engine(tiny_models["target"], tiny_models[draft], "model", gamma, device="cuda", fixed_width=None)
                conv = eng.new_conversation()
                assert run(eng, p, conv)[0] == ref, (gamma, draft)
                assert conv.seq.cache.steps.runners[eng.verify_width].replays > 0  # the graph ran
    for p in PROMPTS:
        ref = run(engine(tiny_models["target"], dtype="bfloat16", device="cuda", fixed_width=None), p)[0]
        for gamma in (1, 4, 8):
            eng = engine(tiny_models["target"], tiny_models["draft"], "hybrid", gamma, "bfloat16", "cuda", fixed_width=None)
            assert run(eng, p)[0] == ref
