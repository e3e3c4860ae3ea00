"""Prompt lookup (llm/drafters.NgramDrafter): keys down to one token, and which source a
proposal is learnt under (the gamma controller keeps an acceptance per source)."""

from llm.drafters import NgramDrafter
from llm.types import SamplingParams

PARAMS = SamplingParams()


def test_a_one_token_key_drafts_what_followed_it():
    # "... 4 2 Harbor Street ... <answer> 4": after the fact's first token, the rest of it.
    p = NgramDrafter().propose([10, 4, 2, 30, 31, 11, 4], 8, PARAMS)
    assert p.tokens == [2, 30, 31, 11, 4]
    assert p.source == "ngram1u"  # "4" occurs once before: a unique key


def test_a_common_one_token_key_is_its_own_source_and_takes_the_latest_occurrence():
    p = NgramDrafter().propose([7, 1, 7, 2, 7], 8, PARAMS)
    assert p.tokens == [2, 7]
    assert p.source == "ngram1m"


def test_the_longest_key_wins_and_longer_keys_are_sourced_by_length_only():
    p = NgramDrafter().propose([1, 2, 3, 9, 5, 2, 8, 1, 2], 2, PARAMS)
    assert p.tokens == [3, 9]  # "1 2" -> "3 9", not "2" -> "8" (the latest one-token match)
    assert p.source == "ngram2"


def test_two_token_keys_only_when_asked():
    assert NgramDrafter(min_n=2).propose([10, 4, 2, 30, 31, 11, 4], 8, PARAMS).tokens == []


def test_a_diverged_context_starts_the_counts_over():
    d = NgramDrafter()
    assert d.propose([5, 6, 5], 4, PARAMS).source == "ngram1u"
    assert d.propose([5, 6, 5, 7, 5], 4, PARAMS).source == "ngram1m"  # the same context, grown
    # Another conversation: "5" occurs once in it, whatever the last one held.
    p = d.propose([8, 5, 9, 5], 4, PARAMS)
    assert (p.tokens, p.source) == ([9, 5], "ngram1u")


def test_a_number_is_looked_up_where_a_number_begins():
    # "42 Harbor ... 555-0142 ... <answer> 4": the "4" inside "0142" is the latest one, but
    # the answer's "4" begins a number, as the address's does.
    digits = frozenset({0, 1, 2, 4, 5})
    context = [20, 4, 2, 30, 31, 21, 5, 5, 5, 0, 1, 4, 2, 22, 23, 4]
    p = NgramDrafter(digits=digits).propose(context, 8, PARAMS)
    assert p.tokens[:3] == [2, 30, 31]
    assert p.source == "ngram1u"  # one number begins with "4"
    assert NgramDrafter().propose(context, 8, PARAMS).tokens[:3] == [2, 22, 23]  # without: the phone's
    # ... and a digit inside a number is looked up inside numbers ("15" -> "7", the "5"
    # inside "15"), not where one begins (the later "5" -> "8").
    context = [20, 1, 5, 7, 22, 5, 8, 23, 1, 5]
    assert NgramDrafter(max_n=1, digits=digits).propose(context, 2, PARAMS).tokens == [7, 22]
    assert NgramDrafter(max_n=1).propose(context, 2, PARAMS).tokens == [8, 23]


def test_the_engine_gives_the_lookup_its_vocabularys_digits(tiny_models):
    from llm.engine import SpeculativeEngine

    eng = SpeculativeEngine.load(tiny_models["target"], drafter="ngram", dtype="float32", calibrate=False)
    (lookup,) = eng.new_conversation().drafters
    assert lookup.digits == eng.digit_ids
    vocab = eng.target.tokenizer.get_vocab()
    assert eng.digit_ids == {i for text, i in vocab.items() if text.isdigit()}
    assert {vocab[d] for d in "0123456789" if d in vocab} <= eng.digit_ids
