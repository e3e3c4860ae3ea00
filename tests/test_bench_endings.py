"""bench endings' line sets and its counting (the models' part runs in `specvoice bench endings`)."""

from bench import endings
from bench.pipeline import PAUSED


def test_a_line_is_cut_after_its_first_word_that_cannot_end_a_sentence():
    assert endings.cut_after_open_word("Is Dr. Moreno available on Wednesday afternoon?") == "Is Dr. Moreno available on"
    assert endings.cut_after_open_word("How much does a cleaning cost?") == "How much does a"
    assert endings.cut_after_open_word("Do you take Delta Dental or only Aetna?") == "Do you take Delta Dental or"
    assert endings.cut_after_open_word("Where are you located?") is None  # no such word
    assert endings.cut_after_open_word("I need a filling.") == "I need a"
    assert endings.cut_after_open_word("For my son, a check-up.") == "For my son, a"  # not before the third word
    assert endings.cut_after_open_word("Can I come in?") is None  # only as its last word


def test_the_synthetic_lines_are_whole_lines_and_their_cut_openings():
    lines = endings.synthetic_lines()
    whole = [t for kind, t in lines if kind == "whole"]
    cut = [t for kind, t in lines if kind == "cut"]
    assert len(whole) == len(set(whole)) >= 20 and len(cut) == len(set(cut)) >= 15
    assert [a for a, _ in PAUSED] == cut[:len(PAUSED)]
    assert {f"{a} {b}" for a, b in PAUSED} <= set(whole)
    # Every cut line is the opening words of a whole one, never a whole line itself.
    assert all(any(w.startswith(c + " ") for w in whole) for c in cut)
    assert not set(cut) & set(whole)


def test_a_line_waits_on_open_words_or_a_score_under_the_threshold():
    def row(voice, kind, heard, open_words, words_end):
        return {"voice": voice, "kind": kind, "heard": heard, "open_words": open_words, "words_end": words_end}

    rows = [row("piper", "whole", "What is your address?", None, 0.9),
            row("piper", "whole", "Can I book it at 2.15?", None, 0.003),
            row("piper", "cut", "I would like a cleaning for next.", "next", None),  # not scored: open already
            row("piper", "cut", "Do you accept?", None, 0.0002),
            row("piper", "cut", "", None, None),  # nothing heard
            row("human", "cut", "in passing,", ",", 0.01)]
    assert not endings.waits(rows[0], 0.005) and endings.waits(rows[1], 0.005) and not endings.waits(rows[1], 0.002)
    assert endings.waits(rows[2], None) and not endings.waits(rows[3], None) and endings.waits(rows[3], 0.001)
    assert not endings.waits(rows[4], 0.5)
    # Ending early: closed words scored at least the threshold; open words never, nothing heard never.
    assert endings.ends_early(rows[0], 0.5) and not endings.ends_early(rows[0], 0.95)
    assert not endings.ends_early(rows[1], 0.5) and not endings.ends_early(rows[4], 0.0)
    assert not endings.ends_early({**rows[2], "words_end": 0.9}, 0.5)
    summary = endings.summarize(rows, [0.002, 0.005], [0.001, 0.5])
    assert summary == {
        "piper": {"whole": {"lines": 2, "wait_by_words": 0, "wait_with_llm": {"0.002": 0, "0.005": 1},
                            "end_early": {"0.001": 2, "0.5": 1}},
                  "cut": {"lines": 3, "wait_by_words": 1, "wait_with_llm": {"0.002": 2, "0.005": 2},
                          "end_early": {"0.001": 0, "0.5": 0}}},
        "human": {"cut": {"lines": 1, "wait_by_words": 1, "wait_with_llm": {"0.002": 1, "0.005": 1},
                          "end_early": {"0.001": 0, "0.5": 0}}},
    }
