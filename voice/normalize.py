"""Text normalisation for speech: write out what a TTS voice would otherwise misread.

LLM answers are full of "$29.99", "10:30 a.m.", "15%", "Dr. Lee", "2nd"; espeak (under
Piper) reads some of them oddly ("dollar twenty nine point nine nine") or letter by
letter. `normalize_for_speech` rewrites them as words. It is a pure function of the
text, applied sentence by sentence just before synthesis, and leaves ordinary words
alone.
"""

from __future__ import annotations

import re

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
         "fourteen fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = [(10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand")]
_ORD_IRREGULAR = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                  "nine": "ninth", "twelve": "twelfth"}


def number_to_words(n: int) -> str:
    """Cardinal number in words: 1234 -> "one thousand two hundred thirty-four"."""
    if n < 0:
        return "minus " + number_to_words(-n)
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + ("-" + _ONES[ones] if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return _ONES[hundreds] + " hundred" + (" " + number_to_words(rest) if rest else "")
    for value, name in _SCALES:
        if n >= value:
            head, rest = divmod(n, value)
            return number_to_words(head) + " " + name + (" " + number_to_words(rest) if rest else "")
    raise AssertionError("unreachable")


def ordinal_to_words(n: int) -> str:
    """21 -> "twenty-first"."""
    words = number_to_words(n)
    head, sep, last = words.rpartition("-") if "-" in words.split(" ")[-1] else words.rpartition(" ")
    if last in _ORD_IRREGULAR:
        last = _ORD_IRREGULAR[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last = last + "th"
    return head + sep + last


def year_to_words(n: int) -> str:
    """1999 -> "nineteen ninety-nine", 2005 -> "two thousand five", 2024 -> "twenty twenty-four"."""
    if 2000 <= n <= 2009:
        return number_to_words(n)
    hi, lo = divmod(n, 100)
    if lo == 0:
        return number_to_words(hi) + " hundred"
    return number_to_words(hi) + " " + (("oh " + _ONES[lo]) if lo < 10 else number_to_words(lo))


def _digits(s: str) -> str:
    return " ".join(_ONES[int(d)] for d in s)


def decimal_to_words(s: str) -> str:
    """"3.14" -> "three point one four"; "1,200" -> "one thousand two hundred"."""
    s = s.replace(",", "")
    whole, _, frac = s.partition(".")
    words = number_to_words(int(whole or "0"))
    return words + (" point " + _digits(frac) if frac else "")


_CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
               "£": ("pound", "pounds", "penny", "pence")}


def _money(symbol: str, amount: str, scale: str | None) -> str:
    one, many, sub_one, sub_many = _CURRENCIES[symbol]
    amount = amount.replace(",", "")
    whole, _, frac = amount.partition(".")
    if scale:  # "$2.5 million" -> "two point five million dollars"
        return f"{decimal_to_words(amount)} {scale.lower()} {many}"
    units = int(whole or "0")
    cents = int((frac + "00")[:2]) if frac else 0
    parts = []
    if units or not cents:
        parts.append(f"{number_to_words(units)} {one if units == 1 else many}")
    if cents:
        parts.append(f"{number_to_words(cents)} {sub_one if cents == 1 else sub_many}")
    return " and ".join(parts)


def _end_dot(m: re.Match, words: str) -> str:
    """Keep a sentence-final period that an abbreviation's own dot has swallowed.

    "until 5 p.m. Then" and "at 5 p.m." end a sentence; "at 5 p.m. on Monday" does not.
    """
    if not m.group(0).endswith("."):
        return words
    rest = m.string[m.end():]
    stripped = rest.lstrip()
    if not stripped or (stripped[0].isupper() and rest[:1].isspace()):
        return words + "."
    return words


def _time(h: str, m: str, meridiem: str | None) -> str:
    hour, minute = int(h), int(m)
    if minute == 0:
        words = f"{number_to_words(hour)} o'clock" if not meridiem else number_to_words(hour)
    elif minute < 10:
        words = f"{number_to_words(hour)} oh {number_to_words(minute)}"
    else:
        words = f"{number_to_words(hour)} {number_to_words(minute)}"
    if meridiem:
        # Spelled as letters separated by spaces; espeak says "A M", not the word "am".
        words += " " + ("A M" if meridiem[0].lower() == "a" else "P M")
    return words


# Abbreviations that are unambiguous in a receptionist's answers. Matched with their
# trailing dot; case-sensitive where the lower-case form is a real word.
_ABBREVIATIONS = [
    (r"\bMr\.", "Mister"), (r"\bMrs\.", "Missus"), (r"\bMs\.", "Miz"), (r"\bProf\.", "Professor"),
    (r"\bJr\.", "Junior"), (r"\bSr\.", "Senior"), (r"\bAve\.", "Avenue"), (r"\bBlvd\.", "Boulevard"),
    (r"\bRd\.", "Road"), (r"\bSt\.(?=\s+[A-Z])", "Saint"), (r"\bSt\.", "Street"),
    (r"\bDr\.(?=\s+[A-Z])", "Doctor"), (r"\bDr\.", "Drive"),
    (r"\be\.g\.", "for example"), (r"\bi\.e\.", "that is"), (r"\betc\.", "et cetera"),
    (r"\bvs\.", "versus"), (r"\bapprox\.", "approximately"), (r"\bNo\.(?=\s*\d)", "number"),
    (r"\bmin\.", "minutes"), (r"\bhrs?\.", "hours"), (r"\bMon\.", "Monday"), (r"\bTue\.", "Tuesday"),
    (r"\bWed\.", "Wednesday"), (r"\bThu\.", "Thursday"), (r"\bFri\.", "Friday"), (r"\bSat\.", "Saturday"),
    (r"\bSun\.", "Sunday"),
]

# Titles come before a name, never at the end of a sentence: their dot is never a period.
_MID_TITLES = {"Mister", "Missus", "Miz", "Professor", "Saint", "Doctor", "number"}

_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_SCALE = r"(?:\s+(million|billion|thousand|trillion))?"

_RULES: list[tuple[re.Pattern, object]] = [
    # Phone numbers before anything else eats their digits: digit by digit.
    (re.compile(r"\b(\d{3})-(\d{3})-(\d{4})\b"),
     lambda m: ", ".join(_digits(g) for g in m.groups())),
    (re.compile(r"\b(\d{3})-(\d{4})\b"), lambda m: ", ".join(_digits(g) for g in m.groups())),
    # Times: 10:30, 9:05 a.m., 7:00pm
    (re.compile(r"\b(\d{1,2}):([0-5]\d)(?:\s*([aApP])\.?\s?[mM]\.?(?=\W|$))?"),
     lambda m: _end_dot(m, _time(m.group(1), m.group(2), m.group(3)))),
    # Bare hour with meridiem: 9am, 5 p.m.
    (re.compile(r"\b(\d{1,2})\s*([aApP])\.?\s?[mM]\.?(?=\W|$)"),
     lambda m: _end_dot(m, number_to_words(int(m.group(1))) + (" A M" if m.group(2).lower() == "a" else " P M"))),
    # Money: $29.99, $5, €3.50, $2.5 million
    (re.compile(r"([$€£])\s?(" + _NUM + r")" + _SCALE, re.IGNORECASE),
     lambda m: _money(m.group(1), m.group(2), m.group(3))),
    # Percentages: 15%, 2.5 %
    (re.compile(r"(" + _NUM + r")\s?%"), lambda m: decimal_to_words(m.group(1)) + " percent"),
    # Ordinals: 1st 2nd 3rd 21st 4th
    (re.compile(r"\b(\d+)(?:st|nd|rd|th)\b"), lambda m: ordinal_to_words(int(m.group(1)))),
    # Years: a lone 4-digit number 1100-2099 that is not a quantity with commas.
    (re.compile(r"(?<![\d.,])(1[1-9]\d\d|20\d\d)(?![\d.,]\d)(?!\s*(?:%|percent))"),
     lambda m: year_to_words(int(m.group(1)))),
    # Any other number (with thousands separators or a decimal part).
    (re.compile(r"(?<![\d.])(" + _NUM + r")(?![\d])"), lambda m: decimal_to_words(m.group(1))),
]


def normalize_for_speech(text: str) -> str:
    """Rewrite numbers, times, money, percentages and abbreviations as spoken words."""
    out = text
    # "Main St." is a street (a capitalised name before it), "St. Louis" a saint.
    out = re.sub(r"\b([A-Z][a-z]+) St\.", lambda m: _end_dot(m, m.group(1) + " Street"), out)
    for pattern, word in _ABBREVIATIONS:
        out = re.sub(pattern, lambda m, w=word: w if m.group(0).endswith(".") and w in _MID_TITLES else _end_dot(m, w), out)
    out = out.replace("&", " and ")
    for pattern, repl in _RULES:
        out = pattern.sub(repl, out)
    return re.sub(r"[ \t]{2,}", " ", out).strip()
