"""The streaming sentence splitter: the same sentences however the text is chunked."""

from __future__ import annotations

import random

import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.sentences import SentenceSplitter, split_sentences

# Each case: the text with a "|" wherever the splitter must cut it. The expected sentences
# are the pieces between the marks, stripped (a piece of white space alone is none). Each
# case is also fed char by char and in random pieces.
MARKED = [
    # ? and ! always end a sentence when whitespace follows
    "Hi!| How are you?",
    "Really?!| Wow.",
    "Stop!!!| Now.",
    "Is it open?| yes it is.",
    "What?|\nNothing.",
    "Wait...?| Fine.",
    "Great!",
    "Yahoo!Inc is a name.",
    # plain periods
    "Hello there.| How are you today?",
    "One.| Two.| Three.",
    "It works. it really does.",
    "Done.",
    "No.| I can't do that.",
    "So do I.| Then we go.",
    "The answer is 42.| Next question.",
    "It costs $5.| 3 people paid.",
    "   Leading space.| Trailing space.   ",
    "First line.|\nsecond line.",
    "End.|\n\nNew paragraph.",
    # titles and abbreviations
    "Dr. Smith will see you.| He is kind.",
    "Ask Mr. Jones.| Or Mrs. Jones.",
    "Ms. Lee is here.| Prof. Kim is not.",
    "We are on St. Mark Street.| Come by.",
    "Dr. Patel and Dr. Moreno are the dentists.",
    "Bring fruit, e.g. Apples.| Thanks.",
    "Bring fruit, e.g. apples and pears.",
    "Use one tool, i.e. The hammer.| Go.",
    "Use one tool, i.e. the hammer.",
    "The U.S. Army is large.| Yes.",
    "She lives in the U.S. now.",
    "Apples, pears, etc. and more.",
    "Apples, pears, etc.| That is all.",
    "J. K. Rowling wrote it.| Really.",
    "Room No. 5 is free.| No. 6 is not.",
    "Cats vs. Dogs is a debate.| Fun.",
    "It's approx. Ten minutes away.",
    # times
    "We open at 8 a.m. and close at 6 p.m. on weekdays.",
    "We close at 6 p.m.| See you then!",
    "Come at 9 a.m. Monday.| Bye.",
    "Slots: Tuesday 10:30 a.m., Wednesday 2:15 p.m.| Book now.",
    "Meet at 10:30.| Then lunch.",
    "It is 10:30 now.",
    # numbers and money
    "Version 3.5 is out.| Update now.",
    "A cleaning costs $29.99.| Whitening is $249.",
    "Rates rose 4.5% this year.| Sad.",
    "Pi is about 3.14159.| Neat.",
    "We have 1,000 seats.| Book.",
    # list numbering
    "1. First step.| 2. Second step.",
    "Steps:\n1. Open the app.|\n2. Tap Start.",
    "10. Last item here.",
    # ellipses
    "Well... I think so.| Yes.",
    "Hmm… Let me check.| Okay.",
    "And then... nothing.",
    "Wait.. What happened?",
    # emails and URLs
    "Write to a.b@c.com.| We answer fast.",
    "Mail john.doe@example.org today.",
    "See https://x.y/z.html.| It explains.",
    "Go to www.x.com for more.| Thanks.",
    "Open https://x.y/q?a=1 now.| Done.",
    # quotes and brackets
    'He said "Stop."| Then he left.',
    'She asked "Why?"| and smiled.',
    "It's done (finally).| Great.",
    "It's done (finally.)| Great.",
    'Okay.| "Next," he said.',
    "Fine.| (Mostly.)| Good.",
    "“Hello.”| “Hi!”| Bye.",
    # no terminator at all, or empty
    "no punctuation at all",
    "",
    "   \n  ",
    "!",
    "Hi !| There.",
]
CASES: list[tuple[str, list[str]]] = [(m.replace("|", ""), [p.strip() for p in m.split("|") if p.strip()]) for m in MARKED]


def feed_pieces(text: str, sizes: list[int], **kwargs) -> list[str]:
    splitter = SentenceSplitter(**kwargs)
    out: list[str] = []
    i = 0
    for size in sizes:
        out += splitter.feed(text[i : i + size])
        i += size
    out += splitter.feed(text[i:])
    return out + splitter.flush()


def random_sizes(text: str, seed: int, max_size: int = 7) -> list[int]:
    rng = random.Random(seed)
    sizes, total = [], 0
    while total < len(text):
        sizes.append(rng.randint(1, max_size))
        total += sizes[-1]
    return sizes


def test_enough_cases():
    assert len(CASES) >= 60


@pytest.mark.parametrize("text,expected", CASES, ids=[repr(c[0])[:40] for c in CASES])
def test_case_every_chunking(text, expected):
    assert split_sentences(text) == expected
    assert feed_pieces(text, [1] * len(text)) == expected
    for seed in range(6):
        assert feed_pieces(text, random_sizes(text, seed)) == expected, seed


def test_question_followed_by_space_is_final_at_once():
    s = SentenceSplitter()
    assert s.feed("Hi! How") == ["Hi!"]
    assert s.feed(" are you? ") == ["How are you?"]
    assert s.flush() == []


def test_marks_wait_for_one_more_char_only():
    s = SentenceSplitter()
    assert s.feed("Hi!") == []  # could still become 'Hi!!' or 'Hi!"'
    assert s.feed(" ") == ["Hi!"]
    assert s.feed("It costs 3.") == []  # '3.5' or 'costs 3. Then'?
    assert s.feed("5 dollars. ") == []  # a period needs the next non-space character
    assert s.feed("T") == ["It costs 3.5 dollars."]
    assert s.flush() == ["T"]


def test_newline_after_period_is_final():
    s = SentenceSplitter()
    assert s.feed("Done.\n") == ["Done."]


def test_calendar_lookahead_waits_for_the_word():
    s = SentenceSplitter()
    assert s.feed("Come at 9 a.m. Mon") == []
    assert s.feed("ey is due. ") == ["Come at 9 a.m."]  # 'Money' is no weekday
    s.reset()
    assert s.feed("Come at 9 a.m. Mon") == []
    assert s.feed("day. X") == ["Come at 9 a.m. Monday."]


def test_flush_resets_for_next_turn():
    s = SentenceSplitter()
    assert s.feed("Hello. My name") == ["Hello."]
    assert s.flush() == ["My name"]
    assert s.pending == ""
    assert s.feed("Next turn. Ok") == ["Next turn."]


def test_flush_decides_at_end_of_text():
    # With the turn over, 'a.m. Then' needs no more lookahead.
    assert split_sentences("Open at 9 a.m. Then") == ["Open at 9 a.m.", "Then"]


def test_first_clause_goes_early_once():
    text = "Sure thing, we are open on Saturday from nine, and on Sunday we are closed. Bye, now."
    kw = dict(first_clause=True, first_clause_min_words=6)
    expected = [
        "Sure thing, we are open on Saturday from nine,",
        "and on Sunday we are closed.",
        "Bye, now.",
    ]
    assert split_sentences(text, **kw) == expected
    for seed in range(5):
        assert feed_pieces(text, random_sizes(text, seed), **kw) == expected
    # Too few words before the comma: no early clause; after a sentence: never.
    assert split_sentences("Yes, of course. Fine, I will do that now, then more.", **kw) == [
        "Yes, of course.",
        "Fine, I will do that now, then more.",
    ]
    assert split_sentences("Total is 1,000 dollars for all of it, ok.", **kw) == [
        "Total is 1,000 dollars for all of it,",
        "ok.",
    ]


def _norm(text: str) -> str:
    return " ".join(text.split())


TRICKY = st.lists(
    st.sampled_from(list("aAbZ I.?!…,:;'\"()@/$%1209\n\t") + ["Dr", "e.g.", "a.m.", "U.S.", "Mon", ". ", "... "]),
    max_size=40,
).map("".join)


@settings(max_examples=examples(400), deadline=None)
@given(text=st.one_of(TRICKY, st.text(max_size=60)), cuts=st.lists(st.integers(0, 80), max_size=12),
       first_clause=st.booleans())
def test_property_lossless_and_chunking_invariant(text, cuts, first_clause):
    kw = dict(first_clause=first_clause, first_clause_min_words=2)
    whole = split_sentences(text, **kw)
    assert _norm(" ".join(whole)) == _norm(text)
    assert all(s and s == s.strip() for s in whole)
    points = sorted({c for c in cuts if c <= len(text)})
    sizes = [b - a for a, b in zip([0] + points, points)]
    assert feed_pieces(text, sizes, **kw) == whole
    assert feed_pieces(text, [1] * len(text), **kw) == whole
