"""Greedy speculative output is token-identical to the target alone, and streams in groups."""

import threading

import pytest
import torch

from llm.engine import SpeculativeEngine
from llm.loading import load_model
from llm.model import forward, new_cache
from greedy_refs import PROMPTS, assert_hf_greedy, gamma0_outputs
from llm.types import SamplingParams



def engine(path, draft=None, drafter="none", gamma=0, dtype="float32"):
    return SpeculativeEngine.load(path, draft, drafter=drafter, gamma=gamma, dtype=dtype, calibrate=gamma == "auto")


def run(eng, prompt_text, max_new=32):
    prompt = eng.encode(prompt_text)
    ids, groups, stats = eng.generate(prompt, SamplingParams(max_new_tokens=max_new))
    return prompt, ids, groups, stats


@pytest.fixture(scope="module")
def baselines(tiny_models):
    """gamma = 0 outputs of each target, per dtype and prompt."""
    return gamma0_outputs(tiny_models, engine, lambda eng, p: run(eng, p)[1])


@pytest.mark.parametrize("name", ["target", "target2", "llama"])
def test_gamma0_matches_hf_generate(tiny_models, baselines, name):
    assert_hf_greedy(tiny_models[name], engine(tiny_models[name]), baselines, name, 32)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, 6, 7, 8])
def test_greedy_exact_draft_equal_to_target(tiny_models, baselines, gamma, dtype):
    """A draft identical to the target: every draft accepted, output unchanged."""
    for name in ("target", "llama"):
        eng = engine(tiny_models[name], tiny_models[name], "model", gamma, dtype)
        for p in PROMPTS:
            _, ids, groups, stats = run(eng, p)
            assert ids == baselines[name, dtype, p]
            assert stats.acceptance_rate == 1.0
            assert all(len(g.token_ids) <= gamma + 1 for g in groups)
            assert max(len(g.token_ids) for g in groups) == min(gamma + 1, 32 - 1)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
def test_greedy_exact_unrelated_draft(tiny_models, baselines, gamma, drafter, dtype):
    """An unrelated draft (nearly nothing accepted) and n-gram lookup: same output."""
    for name in ("target", "target2"):
        eng = engine(tiny_models[name], tiny_models["draft"], drafter, gamma, dtype)
        for p in PROMPTS:
            _, ids, groups, stats = run(eng, p)
            assert ids == baselines[name, dtype, p], (name, p)
            assert stats.drafted > 0 or drafter == "ngram"
            assert all(1 <= len(g.token_ids) <= gamma + 1 for g in groups)


def test_adaptive_gamma_exact(tiny_models, baselines):
    for drafter in ("model", "hybrid", "ngram"):
        for draft in ("target", "draft"):
            eng = engine(tiny_models["target"], tiny_models[draft], drafter, "auto", "int8")
            for p in PROMPTS:
                assert run(eng, p)[1] == baselines["target", "int8", p]


def test_adaptive_gamma_turns_speculation_off_for_a_useless_draft(tiny_models):
    eng = engine(tiny_models["target"], tiny_models["draft"], "model", "auto", "int8")
    conv = eng.new_conversation()
    # Make the draft look as costly as the target: speculation cannot pay.
    conv.controller.stats("model").cost_per_token = conv.controller.verify.cost(1)
    conv.controller.stats("model").accepted, conv.controller.stats("model").rejected = 0.1, 10.0
    _, _, stats = eng.generate(eng.encode(PROMPTS[0]), SamplingParams(max_new_tokens=20), conv)
    assert stats.drafted <= 1


def test_groups_concatenate_and_text_is_utf8_whole(tiny_models):
    eng = engine(tiny_models["target"], tiny_models["target"], "model", 4)
    tok = eng.target.tokenizer
    # Multi-byte characters that byte-level BPE splits across tokens.
    prompt = eng.encode("日本語 ✓ ünïcödé jalapeño")
    ids, groups, _ = eng.generate(prompt, SamplingParams(max_new_tokens=48))
    assert [t for g in groups for t in g.token_ids] == ids
    text = "".join(g.text for g in groups)
    assert text == tok.decode(ids, skip_special_tokens=True)
    for g in groups:
        assert "\ufffd" not in g.text or "\ufffd" in tok.decode(ids)
        assert g.accepted <= g.drafted and len(g.token_ids) <= g.accepted + 1
    assert groups[-1].finish_reason == "length"
    assert all(g.finish_reason is None for g in groups[:-1])
    # The target itself splits a character across tokens somewhere in these.
    split_chars = [t for t in ids if "\ufffd" in tok.decode([t])]
    pieces = [tok.decode([t]) for t in eng.encode("日本語")]
    assert split_chars or any("\ufffd" in s for s in pieces)


def test_utf8_character_split_across_groups_comes_out_whole(tiny_models):
    """Feed a known split character through the detokenizer one token at a time."""
    from llm.detokenize import IncrementalDetokenizer

    tok = load_model(tiny_models["target"], dtype="float32").tokenizer
    ids = tok.encode("a日本語✓b", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) + detok.finish() == "a日本語✓b"
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some token completed no character on its own


def test_cancel_stops_within_one_pass(tiny_models):
    eng = engine(tiny_models["target"], tiny_models["target"], "model", 2)
    cancel = threading.Event()
    prompt = eng.encode(PROMPTS[0])
    seen = []
    for g in eng.stream(prompt, SamplingParams(max_new_tokens=200), cancel=cancel):
        seen.append(g)
        if len(seen) == 3:
            cancel.set()
    assert len(seen) == 4
    assert seen[-1].finish_reason == "cancelled" and seen[-1].token_ids == ()


def test_cancel_from_another_thread(tiny_models):
    eng = engine(tiny_models["target"], tiny_models["target"], "model", 2)
    cancel = threading.Event()
    seen = []
    first = threading.Event()

    def consume():
        for g in eng.stream(eng.encode(PROMPTS[1]), SamplingParams(max_new_tokens=100000 // 100), cancel=cancel):
            seen.append(g)
            first.set()

    th = threading.Thread(target=consume)
    th.start()
    assert first.wait(10)
    cancel.set()
    th.join(10)
    assert not th.is_alive()
    assert seen[-1].finish_reason == "cancelled"
    assert sum(len(g.token_ids) for g in seen) < 1000


@pytest.mark.parametrize("gamma", [0, 3])
def test_stop_string_ends_output_exactly(tiny_models, gamma):
    eng = engine(tiny_models["target"], tiny_models["target"], "model", gamma)
    prompt = eng.encode(PROMPTS[0])
    ids, groups, _ = eng.generate(prompt, SamplingParams(max_new_tokens=40))
    full = "".join(g.text for g in groups)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    _, groups2, _ = eng.generate(prompt, SamplingParams(max_new_tokens=40, stop=(stop,)))
    text = "".join(g.text for g in groups2)
    assert text == full[: full.index(stop)]
    assert groups2[-1].finish_reason == "stop"


def test_eos_ends_generation(tiny_models):
    eng = engine(tiny_models["target"])
    prompt = eng.encode(PROMPTS[0])
    ids, _, _ = eng.generate(prompt, SamplingParams(max_new_tokens=20))
    eng.target.eos_ids = frozenset({ids[5]})
    ids2, groups, _ = eng.generate(prompt, SamplingParams(max_new_tokens=20))
    assert ids2 == ids[: ids.index(ids[5]) + 1]
    assert groups[-1].finish_reason == "eos"


def test_conversation_cache_prefills_only_new_tokens(tiny_models, baselines):
    eng = engine(tiny_models["target"], tiny_models["target"], "model", 3, "int8")
    conv = eng.new_conversation()
    p1 = eng.encode(PROMPTS[0])
    ids1, _, s1 = eng.generate(p1, SamplingParams(max_new_tokens=16), conv)
    p2 = p1 + ids1 + eng.encode(" And Saturday?")
    ids2, _, s2 = eng.generate(p2, SamplingParams(max_new_tokens=16), conv)
    assert s1.prefilled_tokens == len(p1)
    assert s2.prefilled_tokens <= len(eng.encode(" And Saturday?")) + 1
    fresh = engine(tiny_models["target"], dtype="int8")
    assert ids2 == fresh.generate(p2, SamplingParams(max_new_tokens=16))[0]


def test_shared_system_prefix_is_computed_once(tiny_models):
    eng = engine(tiny_models["target"], dtype="int8")
    system = eng.encode("Riverside Dental is open Monday to Friday from 8 a.m. to 6 p.m.")
    eng.warm_prefix(system)
    prompt = system + eng.encode(" When are you open?")
    ids, _, stats = eng.generate(prompt, SamplingParams(max_new_tokens=12))
    assert stats.prefilled_tokens == len(prompt) - len(system)
    cold = engine(tiny_models["target"], dtype="int8")
    ids_cold, _, stats_cold = cold.generate(prompt, SamplingParams(max_new_tokens=12))
    assert stats_cold.prefilled_tokens == len(prompt)
    assert ids == ids_cold


@pytest.mark.parametrize("mode", ["int8", "rowwise"])
def test_layers_and_model_are_batch_invariant(tiny_models, mode):
    """Each row of a k-token forward is bitwise what a one-token step gives, layer by layer."""
    from llm.quant import Linear

    torch.manual_seed(0)
    lin = Linear(torch.randn(96, 64), torch.randn(96), mode, torch.float32)
    x = torch.randn(9, 64) * torch.logspace(-2, 2, 9)[:, None]  # rows of very different scales
    assert torch.equal(lin(x), torch.cat([lin(x[i : i + 1]) for i in range(9)]))
    dtype = "int8" if mode == "int8" else "float32"
    m = load_model(tiny_models["target"], dtype=dtype).model
    ids = torch.randint(0, m.args.vocab_size, (24,))
    c1, c2 = new_cache(m), new_cache(m)
    forward(m, c1, ids[:15], 0)
    batch = forward(m, c1, ids[15:], 15)
    forward(m, c2, ids[:15], 0)
    single = torch.cat([forward(m, c2, ids[i : i + 1], i) for i in range(15, 24)])
    assert torch.equal(batch, single)
    for layer in range(m.args.num_layers):
        assert torch.equal(c1.keys[layer][:, :24], c2.keys[layer][:, :24])
        assert torch.equal(c1.values[layer][:, :24], c2.values[layer][:, :24])


def test_plain_float_gemm_is_not_assumed_invariant():
    """Why the engine does not use one float GEMM per layer on CPU: it can differ per batch size."""
    from llm.quant import Linear

    torch.manual_seed(0)
    lin = Linear(torch.randn(4096, 1024), None, "float", torch.float32)
    x = torch.randn(8, 1024)
    diff = (lin(x) - torch.cat([lin(x[i : i + 1]) for i in range(8)])).abs().max()
    int8 = Linear(torch.randn(4096, 1024), None, "int8", torch.float32)
    assert torch.equal(int8(x), torch.cat([int8(x[i : i + 1]) for i in range(8)]))
    assert diff < 1e-3  # close, just not guaranteed bitwise: recorded, not relied on


def test_a_turn_reads_the_previous_answer_as_the_tokens_the_model_wrote(tiny_models):
    """The next turn's prompt renders the answer as text, whose encoding may differ from the
    tokens the model wrote: those (in the cache) are kept, and only what is new is
    prefilled; the tokens are those of a fresh prefill of that same sequence."""
    from llm.engine import realign

    eng = engine(tiny_models["target"])
    decode = eng.target.tokenizer.decode
    conv = eng.new_conversation()
    p1 = eng.encode(PROMPTS[0])
    text = " We open at nine on Saturday."
    written = [t for ch in text for t in eng.encode(ch)]  # the same text, one character a token
    canonical = eng.encode(text)
    assert canonical != written and decode(written) == decode(canonical) == text
    eng.generate(p1 + written, SamplingParams(max_new_tokens=1), conv)  # the cache holds p1 + written
    new = eng.encode(" And on Sunday?")
    p2 = p1 + canonical + new
    assert realign(p1 + written, p2, decode) == p1 + written + new
    ids2, _, s2 = eng.generate(p2, SamplingParams(max_new_tokens=16), conv)
    assert s2.prefilled_tokens == len(new)
    fresh, _, _ = engine(tiny_models["target"]).generate(p1 + written + new, SamplingParams(max_new_tokens=16))
    assert ids2 == fresh
    # Text that differs, or bytes that are not text, are left alone: prefilled from where they part.
    other = p1 + eng.encode(" Something else entirely.")
    assert realign(p1 + written, other, decode) == other
    broken = [t for t in range(eng.target.model.args.vocab_size) if "\ufffd" in decode([t])][:2]
    assert broken and realign(p1 + broken, p1 + canonical, decode) == p1 + canonical


def test_end_probability_is_the_targets_mass_on_end_marks_and_leaves_the_conversation_exact(tiny_models):
    """engine.end_probability: the probability HF's own forward gives the next token being
    an end mark ("." "?" "!" and the like) or end of text, after the prompt; its prefill
    leaves the conversation's cache exact (a later prompt that goes on from it generates
    what a fresh engine does)."""
    from transformers import AutoModelForCausalLM

    eng = engine(tiny_models["target"])
    tok = eng.target.tokenizer
    ends = eng.end_ids
    assert set(ends) >= {tok.convert_tokens_to_ids(t) for t in (".", "?", "!")} | set(eng.target.eos_ids)
    assert all(set(tok.decode([i]).strip()) <= set(".?!") for i in ends if i not in eng.target.eos_ids)
    assert tok.convert_tokens_to_ids("a") not in ends
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["target"], torch_dtype=torch.float32).eval()
    conv = eng.new_conversation()
    for text in ("Riverside Dental is open Monday to Friday", "A cleaning costs $89, a check-up"):
        prompt = eng.encode(text)
        with torch.no_grad():
            row = hf(torch.tensor([prompt])).logits[0, -1]
        expected = float(torch.softmax(row.float(), -1)[ends].sum())
        assert eng.end_probability(prompt, conv) == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert eng.end_probability(eng.encode("A"), conv) is None  # under 2 tokens: nothing computed
    later = eng.encode("A cleaning costs $89, a check-up $59. When?")
    ids, _, stats = eng.generate(later, SamplingParams(max_new_tokens=16), conv)
    assert stats.prefilled_tokens < len(later)  # the scored words' K/V was reused
    assert ids == engine(tiny_models["target"]).generate(later, SamplingParams(max_new_tokens=16))[0]


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_stream_reads_the_logits_after_the_words_off_its_own_prefill_and_writes_the_same_tokens(tiny_models, dtype):
    """Observe(before_end): the prefill also returns the logits of an earlier prompt row
    (one more row of the vocabulary head): they are HF's logits at that position, and the
    generation's tokens are those of the same stream without it. A row the cache already
    held is not reported."""
    from transformers import AutoModelForCausalLM

    from llm.decoder import Observe

    eng = engine(tiny_models["target"], tiny_models["target"], "model", 3, dtype)
    plain = engine(tiny_models["target"], tiny_models["target"], "model", 3, dtype)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["target"], torch_dtype=torch.float32).eval()
    words = eng.encode("Riverside Dental is open Monday to Friday")
    prompt = words + eng.encode("? Hello!")
    seen = []
    params = SamplingParams(max_new_tokens=12)
    conv = eng.new_conversation()
    groups = list(eng.stream(prompt, params, conv, observe=Observe(len(prompt) - len(words), seen.append)))
    ids = [t for g in groups for t in g.token_ids]
    assert ids == plain.generate(prompt, params)[0]
    with torch.no_grad():
        expected = hf(torch.tensor([words])).logits[0, -1]
    (row,) = seen
    if dtype == "float32":
        assert torch.allclose(row, expected, atol=1e-4)
    assert int(row.argmax()) == int(expected.argmax())
    # The same words again on the same conversation: their row is in the cache, not computed.
    again = []
    later = prompt + ids + eng.encode(" Riverside")
    list(eng.stream(later, params, conv, observe=Observe(len(later) - len(words), again.append)))
    assert again == []


async def test_the_backend_scores_a_cancels_words_end_from_the_streams_prefill(tiny_models):
    """SpeculativeBackend.stream with a cancel carrying `words_end`: the report is end_mass
    of the logits after the words (engine.end_probability's, on a fresh conversation), and
    the tokens are those of the same stream without it. Words that are not the prompt's
    opening are not scored."""
    import threading

    from llm.backend import SpeculativeBackend
    from llm.types import WordsEnd

    eng = engine(tiny_models["target"])
    history = [{"role": "user", "content": "Riverside Dental is open Monday to Friday"}]
    messages = [{"role": "user", "content": "Riverside Dental is open Monday to Friday?"}]
    reports, threads = [], []

    class Cancel(threading.Event):
        words_end = WordsEnd(history, lambda p: (reports.append(p), threads.append(threading.current_thread())))

    async def tokens(backend, cancel):
        return [t async for g in backend.stream(messages, SamplingParams(max_new_tokens=10), cancel) for t in g.token_ids]

    scored = await tokens(SpeculativeBackend(eng), Cancel())
    assert scored == await tokens(SpeculativeBackend(eng), None)
    expected = eng.end_probability(eng.open_prompt(history), eng.new_conversation())
    assert reports == [pytest.approx(expected, rel=1e-4, abs=1e-7)]
    assert threads[0] is not threading.main_thread()  # from the engine's thread
    Cancel.words_end = WordsEnd([{"role": "user", "content": "Something else entirely"}], reports.append)
    await tokens(SpeculativeBackend(eng), Cancel())
    assert len(reports) == 1
