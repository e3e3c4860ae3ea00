"""normalize_for_speech: table tests of what a voice should say."""

from __future__ import annotations

import pytest

from voice.normalize import decimal_to_words, normalize_for_speech, number_to_words, ordinal_to_words, year_to_words

CASES = [
    # money
    ("It costs $29.99.", "It costs twenty-nine dollars and ninety-nine cents."),
    ("Only $1 today", "Only one dollar today"),
    ("$0.01", "one cent"),
    ("$5.50", "five dollars and fifty cents"),
    ("$1,250", "one thousand two hundred fifty dollars"),
    ("$2.5 million", "two point five million dollars"),
    ("€3.50", "three euros and fifty cents"),
    ("£20", "twenty pounds"),
    # times
    ("Come at 10:30.", "Come at ten thirty."),
    ("at 9:05", "at nine oh five"),
    ("at 7:00", "at seven o'clock"),
    ("Open 10:30 a.m. to 5pm.", "Open ten thirty A M to five P M."),
    ("We open at 9 a.m. Come early.", "We open at nine A M. Come early."),
    ("at 7:00 p.m. on Monday", "at seven P M on Monday"),
    # percentages
    ("15% off", "fifteen percent off"),
    ("2.5 % more", "two point five percent more"),
    # abbreviations
    ("Dr. Smith will see you.", "Doctor Smith will see you."),
    ("We are on Elm Dr.", "We are on Elm Drive."),
    ("Main St. We close late.", "Main Street. We close late."),
    ("Go to St. Louis", "Go to Saint Louis"),
    ("Mr. and Mrs. Lee", "Mister and Missus Lee"),
    ("fruit, e.g. apples, etc. and more", "fruit, for example apples, et cetera and more"),
    ("Room No. 5", "Room number five"),
    ("salt & pepper", "salt and pepper"),
    # numbers, ordinals, years, phone numbers
    ("We have 1,200 seats", "We have one thousand two hundred seats"),
    ("3.5 rooms", "three point five rooms"),
    ("the 21st of May", "the twenty-first of May"),
    ("the 2nd and 3rd", "the second and third"),
    ("since 1999", "since nineteen ninety-nine"),
    ("in 2024", "in twenty twenty-four"),
    ("in 2005", "in two thousand five"),
    ("Call 555-123-4567", "Call five five five, one two three, four five six seven"),
    # plain text is untouched
    ("Hello, how can I help you today?", "Hello, how can I help you today?"),
    ("", ""),
]


@pytest.mark.parametrize("text,spoken", CASES)
def test_normalize_for_speech(text, spoken):
    assert normalize_for_speech(text) == spoken


@pytest.mark.parametrize("n,words", [
    (0, "zero"), (7, "seven"), (13, "thirteen"), (40, "forty"), (99, "ninety-nine"), (100, "one hundred"),
    (101, "one hundred one"), (1000, "one thousand"), (1234, "one thousand two hundred thirty-four"),
    (1_000_000, "one million"), (2_000_017, "two million seventeen"), (-5, "minus five"),
])
def test_number_to_words(n, words):
    assert number_to_words(n) == words


@pytest.mark.parametrize("n,words", [
    (1, "first"), (2, "second"), (3, "third"), (4, "fourth"), (5, "fifth"), (8, "eighth"), (9, "ninth"),
    (12, "twelfth"), (20, "twentieth"), (21, "twenty-first"), (100, "one hundredth"), (103, "one hundred third"),
])
def test_ordinal_to_words(n, words):
    assert ordinal_to_words(n) == words


@pytest.mark.parametrize("n,words", [(1999, "nineteen ninety-nine"), (1900, "nineteen hundred"),
                                     (1905, "nineteen oh five"), (2000, "two thousand"), (2010, "twenty ten")])
def test_year_to_words(n, words):
    assert year_to_words(n) == words


def test_decimal_to_words():
    assert decimal_to_words("3.14") == "three point one four"
    assert decimal_to_words("1,000,000") == "one million"


def test_output_has_no_digits_left_for_typical_answers():
    text = "Your cleaning on the 3rd at 10:30 a.m. costs $89.50, 20% less than 2023."
    assert not any(ch.isdigit() for ch in normalize_for_speech(text))
