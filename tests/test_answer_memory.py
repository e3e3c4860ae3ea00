"""Drafting from the engine's earlier answers (llm/answer_memory.py): the index proposes what
followed a key in a remembered answer, says when answers disagreed, forgets evicted
answers; in the engine it drafts a repeated answer in fewer passes, and greedy output stays
the target's own (its gamma-0 decoding, and Hugging Face's generate)."""

from __future__ import annotations

import pytest

from llm.answer_memory import AnswerDrafter, AnswerMemory
from llm.engine import SpeculativeEngine
from llm.types import SamplingParams

PROMPT = [90, 91, 92, 93]


def test_a_key_of_an_earlier_answer_proposes_what_followed_it():
    memory = AnswerMemory(max_n=3, min_n=2)
    memory.add(PROMPT, [10, 11, 12, 13, 14, 15])
    assert memory.lookup([5, 6, 11, 12], 3) == ([13, 14, 15], "answers2")
    assert memory.lookup([10, 11, 12], 2) == ([13, 14], "answers3")  # the longest key first
    assert memory.lookup([1, 92, 93], 4) == ([10, 11, 12, 13], "answers2")  # an answer's start, after its prompt
    assert memory.lookup([7, 12], 3) == ([], "")  # one token is no key across answers
    assert memory.lookup([14, 15], 3) == ([], "")  # the answer's end: nothing followed


def test_a_key_whose_answers_went_on_differently_is_marked_ambiguous():
    memory = AnswerMemory(max_n=2, min_n=2)
    memory.add(PROMPT, [10, 11, 12, 13])
    memory.add(PROMPT, [10, 11, 20, 21])  # after (10, 11): 12 once, 20 the next time
    assert memory.lookup([10, 11], 2) == ([20, 21], "answers2a")  # the latest, marked
    memory.add(PROMPT, [30, 31, 32, 33])
    memory.add(PROMPT, [40, 31, 32, 34])  # (31, 32) went on to 33, then 34
    assert memory.lookup([31, 32], 1) == ([34], "answers2a")
    assert memory.lookup([40, 31], 2) == ([32, 34], "answers2")  # seen once: not ambiguous


def test_an_evicted_answer_is_forgotten():
    memory = AnswerMemory(max_answers=2, max_n=2, min_n=2)
    memory.add(PROMPT, [10, 11, 12])
    memory.add(PROMPT, [20, 21, 22])
    memory.add(PROMPT, [30, 31, 32])
    assert len(memory) == 2
    assert memory.lookup([10, 11], 1) == ([], "")
    assert memory.lookup([20, 21], 1) == ([22], "answers2")
    off = AnswerMemory(max_answers=0)
    off.add(PROMPT, [10, 11, 12])
    assert len(off) == 0 and off.lookup([10, 11], 1) == ([], "")


def test_the_index_stays_as_small_as_the_answers_kept():
    """A server takes calls for weeks: an evicted answer's keys go with it."""
    memory = AnswerMemory(max_answers=3)
    sizes = []
    for i in range(40):
        memory.add(PROMPT, [1000 + 10 * i + j for j in range(8)])  # every answer its own tokens
        sizes.append(len(memory._index))
    assert sizes[-1] == sizes[2] and len(memory) == 3
    assert memory.lookup([1390, 1391], 2) == ([1392, 1393], "answers2")  # the last answer's keys are kept
    memory.add(PROMPT, [10, 11, 12])
    memory.add(PROMPT, [10, 11, 13])
    memory.add(PROMPT, [2000, 2001, 2002])
    memory.add(PROMPT, [2010, 2011, 2012])  # [10, 11, 12] evicted: the key is [10, 11, 13]'s, kept
    assert memory.lookup([10, 11], 1) == ([13], "answers2a")
    memory.add(PROMPT, [2020, 2021, 2022])
    assert memory.lookup([10, 11], 1) == ([], "")  # both evicted now
    assert all(e.serial >= memory._answers[0][0] for e in memory._index.values())


def test_the_drafter_names_its_source_per_key_length():
    memory = AnswerMemory(max_n=2, min_n=2)
    memory.add(PROMPT, [10, 11, 12])
    drafter = AnswerDrafter(memory)
    proposal = drafter.propose([10, 11], 4, SamplingParams())
    assert (proposal.tokens, proposal.source, proposal.probs) == ([12], "answers2", None)
    assert drafter.propose([10, 11], 0, SamplingParams()).tokens == []


def _engine(path, **kw):
    return SpeculativeEngine.load(path, drafter="ngram", dtype="float32", calibrate=False, **kw)


def test_an_engine_remembers_only_when_asked(tiny_models):
    assert not any(type(d).__name__ == "AnswerDrafter" for d in _engine(tiny_models["target"]).new_conversation().drafters)
    eng = _engine(tiny_models["target"], answer_memory=8)
    assert any(type(d).__name__ == "AnswerDrafter" for d in eng.new_conversation().drafters)


@pytest.mark.parametrize("gamma", [4, "auto"])
def test_a_repeated_answer_is_drafted_from_memory_and_stays_the_targets_own(tiny_models, gamma):
    """Two calls ask the same thing: the second's answer is drafted from the first's and
    accepted, in fewer passes; both are the target's gamma-0 answer, which is Hugging
    Face's greedy generate."""
    from transformers import AutoModelForCausalLM
    import torch

    path = tiny_models["target"]
    plain = SpeculativeEngine.load(path, drafter="none", gamma=0, dtype="float32", calibrate=False)
    eng = _engine(path, gamma=gamma, answer_memory=8)
    prompt = eng.encode("Hello! How can I help you today? We open at nine on Saturday and")
    params = SamplingParams(max_new_tokens=24)
    ref, _, _ = plain.generate(prompt, params)
    first, _, first_stats = eng.generate(prompt, params)
    second, _, second_stats = eng.generate(prompt, params, eng.new_conversation())
    assert first == ref and second == ref
    from_memory = [p for p in second_stats.trace if p["source"].startswith("answers") and p["accepted"] > 0]
    assert from_memory and second_stats.passes < first_stats.passes
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24,
                      eos_token_id=None, pad_token_id=0)
    assert ref == out[0, len(prompt):].tolist()


def test_clear_forgets_every_answer():
    memory = AnswerMemory(max_n=2, min_n=2)
    memory.add(PROMPT, [10, 11, 12])
    memory.clear()
    assert len(memory) == 0 and memory.lookup([10, 11], 1) == ([], "")
    memory.add(PROMPT, [20, 21, 22])  # and it remembers again after
    assert memory.lookup([20, 21], 1) == ([22], "answers2")


def test_a_sampled_answer_is_drafted_from_none():
    """Sampled answers keep what a seed gives one call alone: the memory offers them nothing."""
    memory = AnswerMemory(max_n=2, min_n=2)
    memory.add(PROMPT, [10, 11, 12, 13])
    drafter = AnswerDrafter(memory)
    assert drafter.propose([10, 11], 2, SamplingParams()).tokens == [12, 13]
    assert drafter.propose([10, 11], 2, SamplingParams(temperature=0.7, seed=1)).tokens == []


def test_a_sampled_answer_is_not_remembered(tiny_models):
    path = tiny_models["target"]
    eng = _engine(path, gamma=4, answer_memory=8)
    prompt = eng.encode("Hello! How can I help you today? We open at nine on Saturday and")
    eng.generate(prompt, SamplingParams(max_new_tokens=24))
    assert len(eng.answers) == 1
    eng.generate(prompt, SamplingParams(max_new_tokens=24, temperature=1.0, seed=7), eng.new_conversation(seed=7))
    assert len(eng.answers) == 1
    assert eng.answers.lookup(prompt, 4)[0]  # the greedy answer is still there to draft
