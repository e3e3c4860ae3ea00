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
