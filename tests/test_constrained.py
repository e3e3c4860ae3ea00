"""Constrained decoding under speculation (issue 22): exact, and faster where the grammar
forces tokens.

The oracle for "constrained greedy" is outside our engine: Hugging Face `generate()` with
a logits processor that applies the same llguidance mask at every step. Every speculative
mode must give the tokens of the same constraint decoded without speculation, solo and
batched with other calls that have other constraints or none.
"""

import collections
import json
import re
import threading

import pytest
import torch

import llm.decoder
from llm.constrain import ConstraintError, ConstraintState, GrammarDrafter, check_text
from llm.drafters import NgramDrafter
from llm.engine import SpeculativeEngine
from llm.model import forward, new_cache
from llm.sampling import warp
from llm.types import Constraint, SamplingParams
from test_engine_sampling import engine_tv

SCHEMA = {
    "type": "object",
    "properties": {
        "day": {"enum": ["Monday", "Tuesday", "Saturday"]},
        "time": {"type": "string", "pattern": "^[0-9]{1,2}:[0-9]{2}$"},
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
    },
    "required": ["day", "time", "name"],
    "additionalProperties": False,
}
REGEX = r"(Monday|Tuesday|Saturday) at [0-9]{1,2}:[0-9]{2} (a\.m\.|p\.m\.)"
LARK = 'start: "Dr. " NAME " has a slot on " DAY "."\nNAME: "Patel" | "Chen" | "Okafor"\nDAY: "Tuesday" | "Friday"\n'
CONSTRAINTS = {
    "json": Constraint.json_schema(SCHEMA),
    "regex": Constraint.regex(REGEX),
    "lark": Constraint.grammar(LARK),
}
PROMPT = 'Dr. Patel has a slot on Tuesday at 10:30 a.m. {"day": "Tuesday", "time": "10:30", "name": "Ana"} Dr. Chen'
MAX_NEW = 48


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def load(path, draft=None, drafter="none", gamma=0, dtype="float32", **kw):
    return SpeculativeEngine.load(path, draft, drafter=drafter, gamma=gamma, dtype=dtype, calibrate=gamma == "auto", **kw)


def generate(eng, constraint, conv=None, max_new=MAX_NEW, prompt=PROMPT):
    ids, groups, stats = eng.generate(eng.encode(prompt), SamplingParams(max_new_tokens=max_new, constraint=constraint), conv)
    return ids, groups, stats


@pytest.fixture(scope="module")
def baselines(tiny_models):
    """Each constraint decoded without speculation (gamma 0), per target and dtype."""
    out = {}
    for name in ("target", "llama"):
        for dtype in ("float32", "int8"):
            eng = load(tiny_models[name], dtype=dtype)
            for key, c in CONSTRAINTS.items():
                out[name, dtype, key] = generate(eng, c)[0]
    return out


class GrammarMask:
    """A Hugging Face logits processor masking each step with llguidance: the oracle."""

    def __init__(self, state: ConstraintState, prompt_len: int):
        self.state, self.prompt_len, self.seen = state, prompt_len, 0

    def __call__(self, input_ids, scores):
        new = input_ids[0, self.prompt_len:].tolist()
        self.state.advance(new[self.seen:])
        self.seen = len(new)
        allowed = self.state.mask()[: scores.shape[-1]]
        return scores.masked_fill(~allowed[None], float("-inf"))


@pytest.mark.parametrize("key", list(CONSTRAINTS))
@pytest.mark.parametrize("name", ["target", "llama"])
def test_gamma0_constrained_matches_hf_generate_with_the_same_mask(tiny_models, baselines, name, key):
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    eng = load(tiny_models[name])
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[name], dtype=torch.float32).eval()
    prompt = eng.encode(PROMPT)
    mask = GrammarMask(eng.grammars.start(CONSTRAINTS[key]), len(prompt))
    eos = sorted(eng.target.eos_ids)
    ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=eos[0],
                      logits_processor=LogitsProcessorList([mask]))
    assert baselines[name, "float32", key] == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("key", list(CONSTRAINTS))
def test_constrained_output_satisfies_its_constraint(tiny_models, baselines, key):
    eng = load(tiny_models["target"])
    ids = baselines["target", "float32", key]
    assert ids[-1] in eng.target.eos_ids, "the tiny model should finish these short constraints"
    text = eng.target.tokenizer.decode(ids[:-1])
    assert check_text(CONSTRAINTS[key], text) is None, text
    # And an unconstrained run of the same model writes something else (the mask mattered).
    free = eng.generate(eng.encode(PROMPT), SamplingParams(max_new_tokens=len(ids)))[0]
    assert check_text(CONSTRAINTS[key], eng.target.tokenizer.decode(free)) is not None


MODES = [
    # (drafter, gamma, draft model)
    ("ngram", 3, None),
    ("ngram", "auto", None),
    ("model", 3, "draft"),
    ("model", 4, "target"),  # a draft equal to the target: long accepted runs
    ("hybrid", "auto", "draft"),
    ("hybrid", 5, "draft"),
]


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m[0]}-{m[1]}-{m[2]}")
def test_constrained_greedy_is_token_identical_for_every_drafter(tiny_models, baselines, mode, dtype):
    drafter, gamma, draft = mode
    for name in ("target", "llama"):
        eng = load(tiny_models[name], tiny_models[draft] if draft else None, drafter, gamma, dtype)
        for key, c in CONSTRAINTS.items():
            ids, groups, stats = generate(eng, c)
            assert ids == baselines[name, dtype, key], (name, key)
            assert stats.passes < len(ids), "speculation never kept a draft under the constraint"
            assert all(1 <= len(g.token_ids) for g in groups)


def test_batched_calls_each_with_its_own_constraint_or_none(tiny_models, baselines):
    """Four calls share batched passes: three constraints and one free answer; each gets
    the tokens it gets alone."""
    eng = load(tiny_models["target"], tiny_models["draft"], "hybrid", 3, "int8", gather_s=20.0)
    keys = ["json", "regex", None, "lark"]
    alone = {}
    for i, key in enumerate(keys):
        alone[i] = generate(eng, CONSTRAINTS[key] if key else None)[0]
    for i, key in enumerate(keys):
        if key:
            assert alone[i] == baselines["target", "int8", key]
    out, errors = {}, []
    start = threading.Barrier(len(keys))

    def run(i, key):
        try:
            start.wait(10)
            out[i] = generate(eng, CONSTRAINTS[key] if key else None)[0]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    before = eng.scheduler.batched_passes
    threads = [threading.Thread(target=run, args=(i, k)) for i, k in enumerate(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert out == alone
    assert eng.scheduler.batched_passes - before >= 3, "the calls never shared a target pass"
    eng.close()


def test_a_draft_the_grammar_rejects_is_cut_before_verify(tiny_models, baselines, monkeypatch):
    """N-gram lookup over a prompt of every token proposes at every pass, mostly tokens the
    constraint forbids. Those drafts end before the first forbidden token: every draft
    that reaches verification is one the row's mask allows."""
    eng = load(tiny_models["target"], None, "ngram", 4)
    vocab = eng.target.model.args.vocab_size
    prompt = torch.randperm(vocab, generator=torch.Generator().manual_seed(3)).tolist() + eng.encode(PROMPT)
    cut, verified = [], []
    real_valid_prefix = ConstraintState.valid_prefix

    def valid_prefix(self, tokens):
        n = real_valid_prefix(self, tokens)
        if n < len(tokens):
            cut.append((len(tokens), n))
        return n

    real_verify = llm.decoder.verify_greedy

    def verify(logits, drafts):
        for i, d in enumerate(drafts):
            assert torch.isfinite(logits[i, d]), f"draft {i} ({d}) is forbidden by its row's mask but was verified"
        verified.append(len(drafts))
        return real_verify(logits, drafts)

    monkeypatch.setattr(ConstraintState, "valid_prefix", valid_prefix)
    monkeypatch.setattr(llm.decoder, "verify_greedy", verify)
    conv = eng.new_conversation()
    conv.drafters = [NgramDrafter(min_n=1)]
    ids = eng.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW, constraint=CONSTRAINTS["json"]), conv)[0]
    plain = load(tiny_models["target"])
    assert ids == plain.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW, constraint=CONSTRAINTS["json"]))[0]
    assert any(n < total for total, n in cut), "no n-gram draft was ever cut by the grammar"
    assert verified


def test_check_drafts_cuts_at_the_first_forbidden_token_and_keeps_its_state(tiny_models):
    eng = load(tiny_models["target"])
    state = eng.grammars.start(CONSTRAINTS["lark"])
    good = eng.encode("Dr. Chen has")
    bad = eng.encode("X")
    kept, masks = state.check_drafts(good[:3] + bad + good[3:])
    assert kept == good[:3]
    assert masks.shape[0] == 4
    for i, tok in enumerate(kept):
        assert masks[i, tok]
    # Still at the start: the same drafts check again the same way, then it moves by kept.
    again, _ = state.check_drafts(good)
    assert again == good
    state.advance(good)
    assert state.valid_prefix(eng.encode(" a slot on Friday.")) == len(eng.encode(" a slot on Friday."))


def test_grammar_drafter_proposes_what_the_constraint_forces(tiny_models):
    eng = load(tiny_models["target"])
    state = eng.grammars.start(CONSTRAINTS["lark"])
    d = GrammarDrafter(state)
    first = d.propose([], 16, SamplingParams()).tokens
    assert eng.target.tokenizer.decode(first) == "Dr. "[: len(eng.target.tokenizer.decode(first))]
    assert first, "the grammar's literal opening is forced"
    state.advance(eng.encode("Dr. Ok"))
    rest = eng.target.tokenizer.decode(d.propose([], 32, SamplingParams()).tokens)
    assert rest.startswith("afor has a slot on"), rest  # the name's rest once its prefix picked it
    assert d.propose([], 2, SamplingParams()).tokens == d.propose([], 32, SamplingParams()).tokens[:2]


def test_forced_tokens_are_drafted_for_free_and_accepted(tiny_models, baselines):
    """With speculation on, the tokens the constraint forces arrive as drafts and the
    target keeps them all: fewer passes than tokens even where nothing else drafts."""
    eng = load(tiny_models["target"], None, "ngram", 6)
    conv = eng.new_conversation()
    conv.drafters = [NgramDrafter(min_n=4)]  # almost never finds a match in this prompt
    ids, groups, stats = eng.generate(eng.encode("Hi."), SamplingParams(max_new_tokens=MAX_NEW, constraint=CONSTRAINTS["lark"]), conv)
    plain = load(tiny_models["target"]).generate(eng.encode("Hi."), SamplingParams(max_new_tokens=MAX_NEW, constraint=CONSTRAINTS["lark"]))[0]
    assert ids == plain
    assert stats.forced_tokens >= len(ids) // 2
    assert stats.passes <= len(ids) // 2
    grammar = conv.controller.stats("grammar")
    assert grammar.acceptance > 0.9
    assert eng.target.tokenizer.decode(ids[:-1]) in {f"Dr. {n} has a slot on {d}." for n in ("Patel", "Chen", "Okafor") for d in ("Tuesday", "Friday")}


def test_a_forced_opening_is_computed_with_the_prompt(tiny_models, baselines):
    """What the constraint forces at its start goes into the prefill: the first group holds
    it and the first token the model chose, one pass, and the tokens are the same as
    without speculation (test_gamma0_constrained_matches_hf_generate_with_the_same_mask)."""
    eng = load(tiny_models["target"])
    ids, groups, stats = generate(eng, CONSTRAINTS["lark"])
    opening = eng.grammars.start(CONSTRAINTS["lark"]).forced(16)
    assert opening and list(groups[0].token_ids) == [*opening, ids[len(opening)]]
    assert stats.prefilled_tokens == len(eng.encode(PROMPT)) + len(opening)
    assert ids == baselines["target", "float32", "lark"]


@pytest.mark.parametrize("constraint,words", [
    (Constraint("json_schema", "{not json"), "not JSON"),
    (Constraint("json_schema", "[1, 2]"), "JSON object"),
    (Constraint.json_schema({"type": "objectx"}), "objectx"),
    (Constraint.regex("(unclosed"), "unclosed group"),
    (Constraint.grammar("start: undefined_rule\n"), "undefined_rule"),
])
def test_a_bad_constraint_is_a_clear_error_before_any_token(tiny_models, constraint, words):
    eng = load(tiny_models["target"], None, "ngram", 3)
    produced = []
    with pytest.raises(ConstraintError, match=words):
        for g in eng.stream(eng.encode(PROMPT), SamplingParams(max_new_tokens=8, constraint=constraint)):
            produced.append(g)
    assert produced == []


def test_constraint_values_are_checked_when_made():
    with pytest.raises(ValueError, match="kind"):
        Constraint("xml", "<a/>")
    with pytest.raises(ValueError, match="empty"):
        Constraint.regex("")


def test_a_request_without_a_constraint_pays_nothing(tiny_models, monkeypatch):
    eng = load(tiny_models["target"], tiny_models["draft"], "hybrid", 3)

    def no(*a, **k):
        raise AssertionError("an unconstrained request touched the constraint machinery")

    monkeypatch.setattr(ConstraintState, "mask", no)
    monkeypatch.setattr(type(eng), "grammars", property(no))
    ids, _, stats = eng.generate(eng.encode(PROMPT), SamplingParams(max_new_tokens=16))
    assert len(ids) == 16 and stats.mask_s == 0 and stats.forced_tokens == 0


def test_check_text_reads_whitespace_a_server_may_write():
    c = CONSTRAINTS["json"]
    assert check_text(c, json.dumps({"day": "Monday", "time": "9:00", "name": "Al"}, indent=2)) is None
    assert "stops matching" in check_text(c, '{"day": "Sunday"}')
    assert "ends before" in check_text(c, '{"day": "Monday"')
    assert check_text(c, '{"day": "Monday"', complete=False) is None  # an answer cut by its length


# ---------------------------------------------------------------- sampling under a mask

N_SAMPLES = 3000
ENGINE_BOUND = 0.075  # as tests/test_engine_sampling.py: at most 27 outcomes at 3000 samples
PARAMS = dict(temperature=1.5, top_k=4)
# Any lowercase letters and spaces: a mask that cuts the tiny model's distribution a lot.
LOWER = Constraint.regex(r"[a-z ]{3,8}")


def exact_masked_distribution(eng, prompt, constraint, params, length=3):
    """P(t1..t_length) of the target alone, each position masked then warped."""
    out = {}

    def walk(prefix, prob):
        state = eng.grammars.start(constraint)
        state.advance(prefix)
        with torch.inference_mode():
            logits = forward(eng.target.model, new_cache(eng.target.model), torch.tensor(prompt + prefix), 0)[-1]
        row = logits.masked_fill(~state.mask()[: logits.shape[-1]], float("-inf"))
        p = warp(row, params)
        for t in torch.nonzero(p).flatten().tolist():
            if len(prefix) + 1 == length or t in eng.target.eos_ids:  # the answer ends at EOS
                out[tuple(prefix + [t])] = prob * float(p[t])
            else:
                walk(prefix + [t], prob * float(p[t]))

    walk([], 1.0)
    return out


def sampled_tv(eng, prompt, constraint, ngram_min_n=None):
    params = SamplingParams(max_new_tokens=3, constraint=constraint, **PARAMS)
    joint = exact_masked_distribution(eng, prompt, constraint, params)
    return engine_tv(eng, prompt, params, n=N_SAMPLES, min_n=ngram_min_n, joint=joint)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_sampled_output_keeps_the_masked_target_distribution(tiny_models, drafter):
    if drafter == "model":
        eng = load(tiny_models["target"], tiny_models["draft"], "model", 2)
        prompt = eng.encode("Hello! How can I help you today? Hello! How")
        distance, drafted = sampled_tv(eng, prompt, LOWER)
    else:
        eng = load(tiny_models["target"], None, "ngram", 2)
        # 1-gram lookup over every lowercase token in a random order always drafts, mostly
        # tokens the constraint allows; the grammar cuts a draft that runs past 8 letters.
        tok = eng.target.tokenizer
        lower = [t for t in range(eng.target.model.args.vocab_size) if re.fullmatch(r"[a-z ]+", tok.decode([t]))]
        order = torch.randperm(len(lower), generator=torch.Generator().manual_seed(3)).tolist()
        prompt = [lower[i] for i in order] + eng.encode("Hello! How")
        distance, drafted = sampled_tv(eng, prompt, LOWER, ngram_min_n=1)
    assert drafted > 0
    assert distance < ENGINE_BOUND


def test_why_a_sampling_drafter_drafts_from_the_masked_distribution():
    """Cutting a *sampled* draft where the grammar rejects its token biases the output
    (the rejection sampler would have resampled from the residual, the cut samples from
    p); drafting from the masked q keeps p exactly. One position, p masked to {0, 1}."""
    from llm.sampling import verify_sampled

    p = torch.tensor([0.5, 0.5, 0.0])  # the masked target: token 2 is forbidden
    q = torch.tensor([0.5, 0.0, 0.5])  # the draft's own distribution puts half its mass there
    allowed = p > 0
    q_masked = torch.where(allowed, q, 0.0) / torch.where(allowed, q, 0.0).sum()
    P = torch.stack([p, p])

    def first_tokens(q_draft, cut):
        g = torch.Generator().manual_seed(0)
        counts = collections.Counter()
        for _ in range(20000):
            x = int(torch.multinomial(q_draft, 1, generator=g))
            if cut and not allowed[x]:  # the draft ends before x: the target samples from p
                counts[int(torch.multinomial(p, 1, generator=g))] += 1
                continue
            v = verify_sampled(P, [x], q_draft[None], g)
            counts[x if v.accepted == 1 else v.next_token] += 1
        return torch.tensor([counts[i] / 20000 for i in range(3)])

    assert 0.5 * float((first_tokens(q_masked, cut=True) - p).abs().sum()) < 0.02
    assert 0.5 * float((first_tokens(q, cut=True) - p).abs().sum()) > 0.2


def test_drafts_running_past_the_grammars_end_keep_the_state_in_step(tiny_models):
    """The history holds the same answer followed by the end token, so n-gram lookup drafts
    the answer's rest up to the grammar's end; the look-ahead for the verify's rows runs on
    a fork, and the generation's state stays where the text is: the output is the
    constrained target's own, ending where the grammar does."""
    eng = load(tiny_models["target"], None, "ngram", 6)
    plain = load(tiny_models["target"])
    eos = sorted(eng.target.eos_ids)[0]
    constraint = Constraint.regex(r"(Tuesday at 10|Friday at 9:30)")  # complete: nothing may follow
    for answer in ("Tuesday at 10", "Friday at 9:30"):
        history = eng.encode("Dr. Patel: " + answer) + [eos] + eng.encode(" Dr. Patel: " + answer) + [eos]
        prompt = history + eng.encode(" Dr. Patel:")
        conv = eng.new_conversation()
        conv.drafters = [NgramDrafter(min_n=1)]
        params = SamplingParams(max_new_tokens=24, constraint=constraint)
        ids, _, stats = eng.generate(prompt, params, conv)
        assert ids == plain.generate(prompt, params)[0]
        assert eng.target.tokenizer.decode([t for t in ids if t != eos]).strip() in ("Tuesday at 10", "Friday at 9:30")
        assert stats.drafted > 0
