"""The fact guard: a sentence is spoken only if what it asserts is supported by the
business's facts or by this turn's tool results.

It sits between the sentence splitter and TTS (pipeline/stages/respond.py). The default
1.5B model gets about 60% of fact questions right and makes false claims in about 15%
(README, "Answer quality"); the model cannot be replaced offline, so what it says is
checked before it is said. Each rule looks for one kind of claim in the sentence and
asks whether the facts carry it:

  figures       every price, time, count, phone number and duration ("$89", "9 am", "30 days")
                must stand in a fact line (or tool result, or open slot) about the same thing:
                the line must share a topic word with the sentence (or, when the sentence
                names nothing, with the caller's question). "A root canal is $120" fails
                although "$120" is a fact: it is the filling's price.
  prices        a price or "free" said of a priced item must be that item's price.
  days          a day said to be closed must be closed in `[business.hours]`, a day said to
                be open must be open; a day no fact, result or slot names may not be said.
  slots         "a slot / an opening / available / a table for N" with a day or time must
                match one open slot (the database's, at that moment), with the doctor(s) it
                names ("Dr. Priya" is Dr. Patel: `FactBook.surnames`).
  names         "Dr. X" must be a person of the facts; any capitalised word mid-sentence must
                be in the facts, the results or the caller's own words.
  offers        "we offer / we have / there is ..." may name only things the facts name.
  actions       "you're booked", "I've cancelled", "I've taken your message", "I'm
                transferring you" need this turn's tool to have done it.
  agreement     "Yes" / "Sure" / "That's right" to a caller's yes-no question or "..., right?"
                claim agrees with the claim: the claim itself must pass the rules above,
                and what it asks about must be in the facts ("Is there parking?").
  that          "Is that with Dr. Patel?" / "That's on Wednesday": a sentence that points back
                at the slot the agent's last line named (an open, configured or booked slot)
                must fit it: its doctor, day and time. The 1.5B said "Yes, that's with Dr.
                Patel." of "Wednesday 2:15 p.m. with Dr. Moreno" (specvoice chat).
  caller's name "Your name is X" must be the name the caller gave in this call, and "I don't
                have your name" is false once they gave one (pipeline/receptionist/caller.py):
                the correction says the name.
  markup        braces, angle brackets, [tags]: the plan's JSON written as an answer.
  echo          a statement that says back six or more of a caller's words in a row, about
                nothing the facts, results or slots name (at most one of its topic words):
                the caller's claim in the agent's voice ("The block-books were the immediate
                predecessors of the printed book." to a caller who read that out; seen with
                the 1.5B, which then said it again to the next turns). "You'd like to book a
                cleaning for next Tuesday" names the facts' cleaning and Tuesday: spoken.

A failed sentence is not spoken: the caller hears a correction built from the fact that
contradicts it (a closed day, an item's price, the open slots) when one rule names that
fact, else the business's fallback sentence, once a turn. Pure and fast: the facts are
indexed once per business (`FactBook`), a sentence costs a few precompiled regex scans
(`specvoice bench guard` measures it; README).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.ports import ToolRunner
from pipeline.receptionist.caller import NOT_NAME, caller_name, caller_phone
from pipeline.receptionist.business import DAYS, FALLBACK, NUMBER_WORDS, BusinessConfig, _is_closed, day_hours

__all__ = ["FactBook", "FactGuard", "Support", "TurnGuard", "Verdict", "claimed_actions", "normalize", "turn_guard"]

# ---------------------------------------------------------------- one spelling for text

_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_NUM_WORD = re.compile(r"\b(?:(" + "|".join(_TENS) + r")(?:[- ](" + "|".join(NUMBER_WORDS[1:10]) + r"))?|("
                       + "|".join(NUMBER_WORDS) + r"))\b")
# (trigger, pattern, replacement): a step runs only when its trigger is in the text (a
# substring test costs far less than a regex scan; the guard runs on every sentence).
_NORMAL_STEPS: list[tuple[tuple[str, ...], re.Pattern, str | Callable]] = [(t, re.compile(p), r) for t, p, r in [
    ((".",), r"\b(dr|mr|mrs|ms|st|ave|no)\.", r"\1"),
    (("doctor",), r"\bdoctor\b", "dr"),
    (("m.", ". m"), r"\b([ap])\.\s?m\b\.?", r"\1m"),
    (("am", "pm"), r"(\d)\s*([ap]m)\b", r"\1 \2"),
    (("clock",), r"\s*o'?clock\b", ""),
    (("in the", "at night"), r"(\d) in the morning\b", r"\1 am"),
    (("in the", "at night"), r"(\d) (?:in the afternoon|in the evening|at night)\b", r"\1 pm"),
    (("noon",), r"\bnoon\b", "12 pm"), (("midnight",), r"\bmidnight\b", "12 am"),
    (("am", "pm"), r"\b(\d{1,2}) (15|30|45) ([ap]m)\b", r"\1:\2 \3"),
    ((":00",), r"\b(\d{1,2}):00\b", r"\1"),
    (("cent",), r"\b(\d+) dollars? and (\d{1,2}) cents?\b", lambda m: f"${m.group(1)}.{int(m.group(2)):02d}"),
    (("dollar", "buck", "usd"), r"(?<!\$)\b(\d+(?:\.\d\d)?) (?:dollars?|bucks|usd)\b", r"$\1"),
    ((".00",), r"\$(\d+)\.00\b", r"$\1"),
    ((",",), r"(\d),(\d{3})\b", r"\1\2"),
    (("-free",), r"(?<=[a-z])-free\b", "free"),  # "gluten-free" is a kind of pasta, not a price of zero
    (("-",), r"(?<=[a-z])-(?=[a-z])", " "),  # check-up -> check up
    (("checkup",), r"\bcheckups?\b", "check up"),
    # A line break ends a clause: "Basic plan: $39.99\nPlus plan: $59.99" is a list, and
    # "$39.99" is not said of the Plus plan (bench quality: isp-plans).
    (("\n",), r"(?<=\S)\s*\n\s*(?=\S)", "; "),
    (("  ", "\n", "\t"), r"\s+", " "),
]]
_PUNCT = str.maketrans({"\u2019": "'", "\u2018": "'", "`": "'", "\u201c": '"', "\u201d": '"', "\u2013": " - ",
                        "\u2014": " - ", "\u00a0": " "})
_SPELLED = NUMBER_WORDS + tuple(_TENS)  # any number word: the trigger for _NUM_WORD
# "one" as a pronoun: after a word that picks a thing out ("Is the Friday one free again
# now?" was judged as the figure 1, not in the facts: specvoice chat). Written "ones" (a
# stop word) so that no rule reads a figure there.
_PRONOUN_ONE = re.compile(r"\b(that|this|which|other|another|same|first|second|last|next|earlier|later|morning|"
                          r"afternoon|evening|monday|tuesday|wednesday|thursday|friday|saturday|sunday) one\b")


@functools.lru_cache(maxsize=2048)
def normalize(text: str) -> str:
    """Lower case, one spelling per figure: "Nine A.M." / "9:00 am" -> "9 am", "eighty-nine
    dollars" -> "$89", "check-up" -> "check up", "Dr." -> "dr"."""
    t = text.lower().translate(_PUNCT)
    if "one" in t:  # "the Friday one", "that one": a slot, not the figure 1
        t = _PRONOUN_ONE.sub(r"\1 ones", t)
    if any(w in t for w in _SPELLED):
        t = _NUM_WORD.sub(lambda m: str(_TENS[m.group(1)] + (NUMBER_WORDS.index(m.group(2)) if m.group(2) else 0))
                          if m.group(1) else str(NUMBER_WORDS.index(m.group(3))), t)
    for triggers, pattern, repl in _NORMAL_STEPS:
        if any(x in t for x in triggers):
            t = pattern.sub(repl, t)
    return t.strip()


# ---------------------------------------------------------------- words and figures

_STOP = frozenset("""
a an the and or but if so of to in on at by for from with without about into onto over under than then that this
these those there here it its it's is are was were be been being am do does did done doing have has had having
will would shall should can could may might must not no nor n't yes yeah yep sure ok okay right correct
i i'm i'll i've i'd me my mine we we're we'll we've we'd us our ours you you're you'll you've you'd your yours
he she they them their his her him what which who whom whose when where why how all any both each few more most
other some such only own same too very just also as up down out off again further once please thank thanks
let let's get got go going come came make made take takes took give see know like want need help one ones
cost costs price prices priced much many pay charge charges fee fees something anything nothing everything
dr really actually well great good sorry course absolutely definitely certainly exactly indeed
check time times day days today tonight tomorrow now currently still around about approximately
hi hello hey bye goodbye welcome glad happy
""".split())
_WORD = re.compile(r"[a-z][a-z']*")
ECHO_WORDS = 6  # a run of the caller's words this long, said back, is an echo (FactGuard._echo)


def _words(*alternatives: str) -> re.Pattern:
    """Any one of the alternatives (regex pieces) as whole words: \\b(?:a|b|...)\\b."""
    return re.compile(r"\b(?:" + "|".join(alternatives) + r")\b")


_MONEY = re.compile(r"\$\d+(?:\.\d\d)?")
_TIME = re.compile(r"(?<![\d:.])\d{1,2}(?::\d\d)? [ap]m\b")
_PHONE = re.compile(r"(?<![\d-])(?:\d{3}-)?\d{3}-\d{4}(?![\d-])")
_UNITS = r"(?:days?|weeks?|months?|years?|hours?|minutes?|mins?|seconds?|people|persons?|guests?|mbps|gb|percent)"
_COUNT = re.compile(r"(?<![\w$:.,-])(\d+(?:\.\d+)?)(?: (?:business |working )?(" + _UNITS + r"))?(?!\w|[.:,]\d)")
_DAY_WORDS = {d.lower(): i for i, d in enumerate(DAYS)}
_DAY_NAME = "(" + "|".join(_DAY_WORDS) + ")"  # one group: (monday|tuesday|...|sunday)
_DAY = re.compile(rf"\b{_DAY_NAME}s?\b")
_DAY_RANGE = re.compile(rf"\b{_DAY_NAME}s? (?:to|through|thru|-) {_DAY_NAME}s?\b")
_WEEK_WORDS = _words("weekdays?", "weekends?", "every day", "daily", "all week", "7 days a week")
_RELATIVE = _words("today", "tonight", "tomorrow")
# A part of the day a slot claim names: a slot fits only if its time falls in it ("Dr. Patel
# is free on Wednesday afternoon" when Wednesday's one slot is 9 a.m., or is Dr. Moreno's).
_PART_OF_DAY = re.compile(r"\b(morning|afternoon|evening)s?\b")
_PART_HOURS = {"morning": (0, 12), "afternoon": (12, 17), "evening": (17, 24)}
_DOCTOR = re.compile(r"\bdr (\w+)")
_MARKUP = re.compile(r"[{}<>]|\[/?\w+\]")
# The agent says it lacks the caller's name ("I'm sorry, but I don't have your name").
_NO_NAME = re.compile(r"\b(?:don't|do not|didn't|did not|haven't|have not|never|can't|cannot)\b(?: \w+){0,3}? "
                      r"(?:have|know|catch|caught|get|got|gotten|hear|heard|been given|received|given|told|access)\b"
                      r"[^.?!]*\byour (?:full )?name\b")
_YOUR_NAME_IS = re.compile(r"\byour (?:full )?name is ([a-z][a-z' -]*)")
_NEGATION = re.compile(r"\b(?:not|no|never|none|nobody|neither|nor|cannot|unfortunately|without)\b|n't\b")
_HEDGE = re.compile(r"\b(?:not sure|don't know|do not know|can't confirm|cannot confirm|i'll check|let me check|"
                    r"i'd need to check|take a message|no information|don't have (?:that|any|information))")
_CLAUSE = re.compile(r"[;,]|:(?!\d)| - |\bbut\b|\bwhile\b|\bhowever\b|\band (?=(?:we're |we are |we )?(?:open|closed)\b)")
_CLOSED = re.compile(r"\bclosed\b|\b(?:not|n't|never) (?:be )?open\b|\bshut\b")
_OPEN = re.compile(r"\bopen\b")
_HOURS_WORD = _words("open", "opens", "close", "closes", "closing", "hours", "until", "till")
_AVAILABLE = _words("slots?", "openings?(?! hours)", "available", "availability", r"vacanc\w+", "free at",
                    "(?:is|are|be) free", "can see you", "table for",
                    "tables? (?:at|on|for)", "book(?:ing)? (?:you |it |that )?(?:for|on|at|in)", "appointments? (?:at|on)")
_FOR_N = re.compile(r"\b(?:for|of|seats?) (\d+)\b")
_OFFER = _words("we (?:do |also )?(?:offer|have|provide|sell|carry|serve|accept|take|support|do)",
                "there (?:is|are|'s)", "(?:is|are) available", "you can (?:get|order|have|use|pay)")
_AGREE = re.compile(r"^(?:yes|yeah|yep|yup|sure|correct|right|that's right|that is right|that's correct|"
                    r"that is correct|exactly|absolutely|of course|indeed|certainly|definitely|you're right|"
                    r"you are right|true|that's true)\b")
# A tag after a comma or a space: "Dr. Moreno?" ends in "no?" but is no "..., no?" tag
# (it was cut to "Dr. More", held back as no dentist of the facts: specvoice chat).
_TAG = re.compile(r"(?:(?:,\s*|\s+)(?:right|correct|is that right|is that correct|is that true|isn't it|aren't you|"
                  r"don't you|doesn't it|didn't it|won't it|isn't that right|yes|no))\s*\?\s*$")
_YES_NO = re.compile(r"^(?:(?:so|and|but|also|um|hmm|great|ok|okay|well|oh|right|thanks)[ ,]+)*(?:do|does|did|is|are|"
                     r"was|were|can|could|will|would|have|has|should|may)\b")
# Claims of an action (ours: the 1.5B said "Sure, I'll book that for you" and booked nothing).
_ACTIONS = {
    "book_slot": re.compile(
        r"\b(?:i've|i have|i) (?:booked|scheduled|reserved)\b|\byou(?:'re| are) (?:all )?(?:booked|scheduled|set for|"
        r"confirmed)\b|\b(?:booking|appointment|reservation) (?:is|has been) (?:confirmed|made|booked|set)\b|"
        r"\bi(?:'ll| will) (?:book|schedule|reserve)\b|\bbooked (?:you|it|that)\b|\bi'm booking\b"),
    "cancel_booking": re.compile(
        r"\b(?:i've|i have|i) cancel+ed\b|\b(?:booking|appointment|reservation) (?:is|has been|was) cancel+ed\b|"
        r"\bi(?:'ll| will) cancel\b|\bcancel+ed (?:it|that|your)\b|\bi'm cancel+ing\b"),
    "take_message": re.compile(
        r"\b(?:i've|i have|i) (?:taken|noted|passed on|recorded|forwarded|left) (?:your|the|a|that) message\b|"
        r"\bmessage (?:has been |is |was )?(?:taken|noted|passed on|recorded|sent|forwarded)\b|"
        r"\bi(?:'ll| will) (?:pass|give|forward|send) (?:on )?(?:your|the|that|this) message\b|"
        r"\bi(?:'ll| will) (?:let (?:them|the staff|dr \w+) know|make sure (?:they|dr \w+|someone) (?:get|know))\b"),
    "transfer_to_human": re.compile(
        r"\b(?:transferring|connecting) you\b|\bi(?:'ll| will|'m going to) (?:transfer|connect) you\b|"
        r"\bputting you through\b|\blet me (?:transfer|connect) you\b"),
}
_ACTION_WHAT = {"book_slot": "a booking", "cancel_booking": "a cancellation", "take_message": "a message taken",
                "transfer_to_human": "a transfer"}
_SLOT_TAKEN = re.compile(r"\b(?:already|just) (?:been )?(?:booked|taken)\b|\b(?:is|was|has been) (?:booked|taken)\b")


@functools.lru_cache(maxsize=8192)
def _stem(word: str) -> str:
    """One form for a word's plural, -ing, -ed and bare forms: "fillings", "filling" and
    "fill" -> "fill"; "services", "service" -> "servic"; "closes", "closed", "close" ->
    "clos". (It stripped one suffix before, so "fillings" -> "filling" missed "Price of
    filling": "Fillings are from $120." was held back.)"""
    w = word.strip("'").removesuffix("'s")
    if len(w) > 4 and w.endswith("ies"):
        w = w[:-3] + "y"
    elif len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    for suffix in ("ing", "ed"):
        if len(w) > len(suffix) + 3 and w.endswith(suffix):
            w = w[: -len(suffix)]
            break
    return w[:-1] if len(w) >= 4 and w.endswith("e") and not w.endswith("ee") else w


@functools.lru_cache(maxsize=4096)
def topic_words(norm: str) -> frozenset[str]:
    """The words that say what a sentence is about: no stop words, no figures, stemmed."""
    return frozenset(_stem(w) for w in _WORD.findall(norm)
                     if w not in _STOP and len(w) > 1 and w.strip("'") not in _STOP)


def figures(norm: str) -> list[str]:
    """The figures in normalised text: money, times, phone numbers, counts with their unit."""
    out = _MONEY.findall(norm) + _TIME.findall(norm) + _PHONE.findall(norm)
    rest = _PHONE.sub(" ", _TIME.sub(" ", _MONEY.sub(" ", norm)))
    for number, unit in _COUNT.findall(rest):
        out.append(f"{number} {_unit(unit)}" if unit else number)
    return out


def _kind(fig: str) -> str:
    """What kind of figure: "$", "time", a count's unit ("day"), or "number"."""
    if fig.startswith("$"):
        return "$"
    if _TIME.fullmatch(fig):
        return "time"
    return fig.partition(" ")[2] or "number"


def _unit(unit: str) -> str:
    u = unit.removesuffix("s") if unit not in ("mbps",) else unit
    return {"min": "minute", "person": "people", "guest": "people", "people": "people"}.get(u, u)


def _days_in(norm: str) -> list[int]:
    """Weekdays a text names, ranges and "weekends" expanded."""
    days: list[int] = []
    for m in _DAY_RANGE.finditer(norm):
        a, b = _DAY_WORDS[m.group(1)], _DAY_WORDS[m.group(2)]
        days += [(a + i) % 7 for i in range((b - a) % 7 + 1)]
    for m in _DAY.finditer(norm):
        days.append(_DAY_WORDS[m.group(1)])
    for m in _WEEK_WORDS.finditer(norm):
        w = m.group()
        days += [5, 6] if w.startswith("weekend") else list(range(5)) if w.startswith("weekday") else list(range(7))
    return list(dict.fromkeys(days))


@functools.lru_cache(maxsize=4096)
def _clauses(norm: str) -> tuple[str, ...]:
    return tuple(c.strip() for c in _CLAUSE.split(norm) if c.strip())


@functools.lru_cache(maxsize=4096)
def _figure_pattern(fig: str) -> re.Pattern:
    return re.compile(r"(?<![\w$.:])" + re.escape(fig) + r"(?![\w]|\.\d|:\d)")


def _has_figure(line: str, fig: str) -> bool:
    return _figure_pattern(fig).search(line) is not None


# ---------------------------------------------------------------- the facts, indexed once


@dataclass(frozen=True)
class Price:
    key: str  # as written: "Gigabit plan"
    value: str  # as written: "$79.99 a month"
    phrase: str  # the key normalised, its parenthesis dropped: "gigabit plan"
    words: frozenset[str]  # words that name this item and no other priced item
    norm_value: str

    @functools.cached_property
    def pattern(self) -> re.Pattern:
        return re.compile(r"\b" + re.escape(self.phrase) + r"\b")


@dataclass
class FactBook:
    """What a business's facts support, indexed once per business."""

    business: BusinessConfig
    lines: list[str]  # normalised fact lines (prices as "price of K: V")
    line_topics: list[set[str]]
    line_figures: list[set[str]]
    vocab: set[str]  # every topic word of the facts (stemmed), the business's name and address included
    raw_vocab: set[str]  # every word of the facts, unstemmed, for capitalised names
    prices: list[Price]
    hours: dict[int, str] | None  # weekday -> hours as written ("closed"), when [business.hours] names days
    people: set[str]  # "patel", "priya", "moreno": names that follow "Dr." in the facts
    slots: list[str]  # the configured open slots (a turn passes the database's own)
    fallback: str
    labels: list[str] = field(default_factory=list)  # the configured open slots, normalised
    days: set[int] = field(default_factory=set)  # weekdays the facts name (ranges expanded)
    norm_hours: dict[int, str] = field(default_factory=dict)
    said: list[str | None] = field(default_factory=list)  # each line as a sentence to say, or None
    surnames: dict[str, str] = field(default_factory=dict)  # "priya" -> "patel": a slot names the surname

    def doctor(self, name: str) -> str:
        """A name said after "Dr." as slots name the doctor: "Dr. Priya" is Dr. Patel."""
        return self.surnames.get(name, name)

    def closest(self, norm: str) -> str | None:
        """The fact most about what `norm` is about (most topic words shared; of those, one
        with a figure of the same kind: "takes 1 day" is corrected by "takes 2 days", not by
        the price), as a sentence."""
        about, kinds = topic_words(norm), {_kind(f) for f in figures(norm)}
        best, score = None, (0, 0)
        for topics, figs, said in zip(self.line_topics, self.line_figures, self.said):
            n = (len(topics & about), len(kinds & {_kind(f) for f in figs}))
            if said is not None and n[0] and n > score:
                best, score = said, n
        return best

    @classmethod
    def build(cls, b: BusinessConfig) -> "FactBook":
        # Each fact as a line to match against, and as a sentence to say (None: not one to
        # say as a correction: the name, or a slot, which has its own).
        pairs: list[tuple[str, str | None]] = [(b.name, None), (b.role, None), (b.about or "", None)]
        pairs += [(b.address or "", b.address and f"We're at {b.address}."),
                  (b.phone and f"phone {b.phone}" or "", b.phone and f"Our number is {b.phone}.")]
        if b.hours:
            hours_text = "; ".join(f"{k} {v}" for k, v in b.hours.items())
            pairs.append(("opening hours: " + hours_text, f"Our opening hours are {_end(hours_text)}"))
        pairs += [(f"price of {k}: {v}", f"The {k} is {_end(v)}") for k, v in (b.prices or {}).items()]
        pairs += [(f"open slot: {s}", None) for s in b.open_slots or []]
        pairs += [(f, _end(f)) for f in b.facts or []]
        pairs = [(r, said) for r, said in pairs if r]
        lines = [normalize(r) for r, _ in pairs]
        vocab: set[str] = set()
        raw_vocab: set[str] = set()
        for line in lines:
            vocab |= topic_words(line)
            raw_vocab |= set(_WORD.findall(line))
        if b.hours:
            for label in b.hours:  # "Phone support": a label's words are facts too
                vocab |= topic_words(normalize(label))
        prices = _prices(b.prices or {})
        hours = None
        per_day = day_hours(b.hours) if b.hours else None
        if per_day is None and b.hours and all(_EVERY_DAY.search(v.lower()) for v in b.hours.values()):
            # No label names days, and every one holds every day ("Phone support": "24 hours a
            # day, every day"): each day has those hours. "No, phone support is not open on
            # Sunday night." passed when the guard knew no day's hours (specvoice chat).
            per_day = [(d, "; ".join(b.hours.values())) for d in DAYS]
        if per_day is not None:
            hours = {i: v for i, (_, v) in enumerate(per_day)}
        people = {m.group(1) for line in lines for m in _DOCTOR.finditer(line)}
        surnames: dict[str, str] = {}
        for line in lines:  # "Dentists: Dr. Priya Patel and Dr. Luis Moreno": first names too
            for m in re.finditer(r"\bdr (\w+) (\w+)", line):
                people.add(m.group(2))
                if m.group(2) not in _NOT_A_SURNAME:
                    surnames[m.group(1)] = m.group(2)
        return cls(b, lines, [topic_words(line) for line in lines], [set(figures(line)) for line in lines], vocab,
                   raw_vocab, prices, hours, people, list(b.open_slots or []), b.fallback or FALLBACK,
                   [normalize(x) for x in b.open_slots or []], set(hours or ()) | {d for x in lines for d in _days_in(x)},
                   {d: normalize(v) for d, v in (hours or {}).items()}, [said for _, said in pairs], surnames)


# Words that may follow "Dr. X" in a fact and are no surname ("Dr. Patel and ...").
_NOT_A_SURNAME = frozenset("and or is on at in with for the has works will can".split())
_EVERY_DAY = re.compile(r"\bevery day\b|\bdaily\b|\ball week\b|24/7|\b(?:7|seven) days a week\b")


def _bare_key(key: str) -> str:
    """An item's name as a caller says it, without its notes: "Plus plan (500 Mbps)" -> "Plus plan"."""
    return " ".join(re.sub(r"\(.*?\)", " ", key).split())


def _prices(prices: dict[str, str]) -> list[Price]:
    phrases = {k: normalize(_bare_key(k)) for k in prices}
    words = {k: topic_words(p) for k, p in phrases.items()}
    out = []
    for k, v in prices.items():
        others = set().union(*(w for o, w in words.items() if o != k)) if len(prices) > 1 else set()
        out.append(Price(k, v, phrases[k], frozenset(words[k] - others), normalize(v)))
    return out


# ---------------------------------------------------------------- one sentence


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str = ""
    correction: str | None = None  # a true sentence built from the fact the claim contradicts


_OK = Verdict(True)


@dataclass
class Support:
    """What this turn may also rest on: the tool results (and errors), the database's open
    slots now, and the caller's own words (their name and number)."""

    results: list[str] = field(default_factory=list)  # normalised, one per tool call
    done: set[str] = field(default_factory=set)  # tools that succeeded this turn
    slots: list[str] | None = None  # open slots now (None: the configured ones)
    caller: str = ""  # this turn's caller line (normalised)
    caller_words: set[str] = field(default_factory=set)  # every word the caller said in this call
    # Derived once per turn state (the guard reads them for every sentence):
    labels: list[str] = field(default_factory=list)  # the open slots, normalised
    lines: list[tuple[set[str], set[str]]] = field(default_factory=list)  # (figures, topics) of results, slots
    topics: set[str] = field(default_factory=set)  # every topic word of results and slots
    days: set[int] = field(default_factory=set)  # weekdays results and slots name
    caller_digits: str = ""
    said_lines: list[list[str]] = field(default_factory=list)  # each caller line of the call, as words
    name: str | None = None  # the name the caller gave in this call (receptionist/caller.py)
    # The slots of the caller's active bookings in the database (ToolBox.callers_bookings);
    # None: no database to ask, so what the agent says of them is not judged.
    booked: list[str] | None = None
    question: str = ""  # the caller's last question in this line (normalised), else the whole line
    agent_before: str = ""  # the agent's line before this caller line (normalised): what "that" points at
    records: list[str] = field(default_factory=list)  # record numbers the caller named in this call, in order
    phone: str | None = None  # the last phone number the caller said in this call, as they said it
    # What the caller's yes-no question asks about that no fact names ("" none; None: not
    # looked at yet): FactGuard._unknown_subject fills it at its first sentence.
    asked: str | None = None

    @classmethod
    def of(cls, tool_calls: Iterable[dict] = (), slots: Sequence[str] | None = None, caller: str = "",
           earlier: Iterable[str] = (), booked: Sequence[str] | None = None, name: str | None = None,
           agent_before: str = "") -> "Support":
        """`name`: the caller's, when the caller has it already (else read from their lines);
        `agent_before`: what the agent said last, before `caller`."""
        earlier = list(earlier)
        results, done = [], set()
        for c in tool_calls:
            text = json.dumps({"result": c.get("result"), "error": c.get("error"), "arguments": c.get("arguments")},
                              ensure_ascii=False, default=str)
            results.append(normalize(re.sub(r'[{}\[\]"_]', " ", text)))
            if c.get("ok") and c.get("name"):
                done.add(str(c["name"]))
        said = normalize(" ".join([*earlier, caller]))
        labels = [normalize(x) for x in slots or []]
        name = name or caller_name([*earlier, caller])
        # The caller's name is a fact of the call: "Your name is Robert" rests on it.
        told = [f"the caller's name: {normalize(name)}"] if name else []
        lines = [(set(figures(t)), topic_words(t)) for t in [*results, *(f"open slot: {x}" for x in labels), *told]]
        questions = [x for x in _said_sentences(normalize(caller)) if x.endswith("?")]
        return cls(results, done, None if slots is None else list(slots), normalize(caller),
                   set(_WORD.findall(said)), labels, lines, set().union(*(t for _, t in lines)),
                   {d for t in [*results, *labels] for d in _days_in(t)}, re.sub(r"\D", "", said),
                   [_WORD.findall(normalize(x)) for x in [*earlier, caller] if x], name=name,
                   booked=None if booked is None else list(booked),
                   question=questions[-1] if questions else normalize(caller), agent_before=normalize(agent_before),
                   records=[x for line in [*earlier, caller] for x in _RECORD_ID.findall(normalize(line or ""))],
                   phone=caller_phone([*earlier, caller]))


class FactGuard:
    """The rules over one business's facts. `check(sentence, support)` -> Verdict."""

    def __init__(self, business: BusinessConfig):
        self.book = FactBook.build(business)
        self._fallback_norm = {normalize(s) for s in _split_fixed(self.book.fallback)}

    def is_fallback(self, sentence: str) -> bool:
        """One of the fallback's sentences, or the whole of it."""
        return normalize(sentence) in self._fallback_norm

    # -- the public check

    def check(self, sentence: str, support: Support | None = None) -> Verdict:
        s = support or Support()
        if _MARKUP.search(sentence):
            # The plan's JSON written as the answer ('{"name": "<the caller's name>"}', bench
            # quality h4-shop-no-name-followup): TTS would read its quotes and placeholder out.
            return Verdict(False, "markup, not speech")
        norm = normalize(sentence)
        if not norm or norm in self._fallback_norm:
            return _OK
        if norm.endswith("?") and not _AGREE.match(norm):
            # A question asserts nothing ("Would you like the Tuesday slot?"), but its figures
            # and names still must be real: an offered slot that does not exist misleads too.
            return self._claims(norm, s, question=True)
        v = self._unknown_subject(norm, s)
        if not v.ok:
            return v
        v = self._agreement(norm, s)
        if not v.ok:
            return v
        v = self._echo(norm, s)  # the agent's own sentence only: a caller's claim is theirs
        if not v.ok:
            return v
        return self._claims(norm, s)

    # -- the rules

    def _claims(self, norm: str, s: Support, question: bool = False) -> Verdict:
        for rule in (self._callers_name, self._callers_number, self._actions,
                     *(() if question else (self._callers_booking,)), self._names, self._records, self._referent,
                     self._days, self._slots, self._doctor_on_slot, self._doctors_days, self._prices,
                     self._exact_price, self._over_the_limit, self._figures,
                     *(() if question else (self._offers,))):
            v = rule(norm, s)
            if not v.ok:
                return v
        return _OK

    def _support_lines(self, s: Support) -> list[tuple[set[str], set[str]]]:
        """(figures, topic words) of every line the turn may rest on."""
        return list(zip(self.book.line_figures, self.book.line_topics)) + s.lines

    def _figures(self, norm: str, s: Support) -> Verdict:
        lines = None
        # What the figure is about: the sentence's words, else the caller's question's ("$59"
        # to "Good morning, my name is Tom Baker. How much is a check-up?" is about the check-up).
        about = topic_words(norm) or topic_words(s.question)
        items = self._priced_items(norm)
        # "Your internet speed is 500 Mbps" names no item, but "your" is the caller's, and the
        # one priced item their lines named ("I'm on the Gigabit plan") is what it is about.
        theirs = self._callers_item(s) if not items and _YOUR.search(norm) else []
        # A bare answer ("2 days.") is about what the question names ("How long does standard
        # shipping take?"): its item's line must hold the figure, not another item's.
        theirs = theirs or (self._priced_items(s.question) if not items and not topic_words(norm) else [])
        for clause in _clauses(norm):
            if _NEGATION.search(clause):
                continue  # "we don't close at 11 pm": denying a figure asserts none
            for fig in figures(clause):
                if _PHONE.fullmatch(fig) and fig.replace("-", "") in s.caller_digits:
                    continue  # the caller's own number, said back
                if fig.startswith("$") and any(_has_figure(p.norm_value, fig) for p in items):
                    continue  # the price of an item the sentence names (the price rule checks which)
                if len(items) > 1 and _TOGETHER.search(clause) and fig == _sum(items):
                    continue  # the items' prices added up ("together come to $338")
                if _MORE_THAN.search(clause) and fig == _difference(items):
                    continue  # the two items' prices apart ("$160 more than a cleaning")
                if not items and not topic_words(norm) and len(asked := self._priced_items(s.question)) > 1 \
                        and fig == _sum(asked):
                    continue  # a sum alone, of the items the caller asked about (the price rule)
                lines = lines if lines is not None else self._support_lines(s)
                having = [topics for figs, topics in lines if fig in figs]
                if not having:
                    return Verdict(False, f"{fig!r} is not in the facts")
                other = self._only_another_items(fig, items or theirs, s)
                if other is not None:
                    # "The Gigabit plan offers 500 Mbps speed." (specvoice chat, isp): the Plus
                    # plan's figure, said of the Gigabit plan. Its own line is what is true.
                    named = items or theirs
                    p = named[0]
                    return Verdict(False, f"{fig!r} is the {_bare_key(other.key)}'s, not the {_bare_key(p.key)}'s",
                                   f"The {p.key} is {_end(p.value)}" if len(named) == 1 else None)
                if about and not _PHONE.fullmatch(fig) and not re.fullmatch(r"\d{5,}", fig) \
                        and not any(topics & about for topics in having):
                    # A phone or order number names one thing; "$120" or "2 days" may be another item's.
                    return Verdict(False, f"{fig!r} is in the facts, but not about {_as_said(sorted(about), norm)}")
        return _OK

    def _doctor_on_slot(self, norm: str, s: Support) -> Verdict:
        """A clause that names one slot by its day and time (whatever its verb: "Dr. Moreno will
        be performing a check-up on Tuesday 10:30 a.m. with Dr. Patel", specvoice chat) names
        only that slot's doctor. The slot rule above judges claims that something is open."""
        for clause in _clauses(norm):
            doctors = {self.book.doctor(d) for d in _DOCTOR.findall(clause)}
            days, times = set(_days_in(clause)), _TIME.findall(clause)
            if not doctors or len(days) != 1 or len(times) != 1 or _NEGATION.search(clause):
                continue
            day = days.pop()
            slots = [(label, raw) for label, raw in self._slot_labels(s)
                     if _DAY_WORDS_RE[day].search(label) and _has_figure(label, times[0]) and _DOCTOR.search(label)]
            if not slots or any(all(re.search(rf"\bdr {d}\b", label) for d in doctors) for label, _ in slots):
                continue
            label, raw = slots[0]
            wrong = sorted(f"Dr. {d.capitalize()}" for d in doctors if not re.search(rf"\bdr {d}\b", label))
            return Verdict(False, f"names {' and '.join(wrong)} on {raw}", _end(f"Actually, that slot is {raw}"))
        return _OK

    def _over_the_limit(self, norm: str, s: Support) -> Verdict:
        """"$6.95" to "How much is shipping on a $60 order?" (specvoice chat, shop): the price
        paid below a limit ("free over $50, otherwise $6.95"), for an amount the caller said is
        over it."""
        amounts = [float(x[1:]) for x in _MONEY.findall(s.question)]
        if not amounts:
            return _OK
        for clause in _clauses(norm):
            if _NEGATION.search(clause):
                continue
            for fig in _MONEY.findall(clause):
                for p in self.book.prices:
                    m = _FREE_OVER.search(p.norm_value)
                    if m and fig != m.group(1) and _has_figure(p.norm_value, fig) and max(amounts) > float(m.group(1)[1:]):
                        return Verdict(False, f"{fig} for ${max(amounts):g}: the {p.key} is {p.value}",
                                       f"The {p.key} is free on orders over {m.group(1)}.")
        return _OK

    def _exact_price(self, norm: str, s: Support) -> Verdict:
        """"Is that the exact price?" "Yes, that is the exact price." of "The filling is from
        $120." (specvoice chat): a lowest price called exact. The item is the sentence's, else
        the question's, else the one the agent's line before named ("that")."""
        if not _EXACT.search(norm) or _NEGATION.search(norm):
            return _OK
        items = self._priced_items(norm) or self._priced_items(s.question) or self._priced_items(s.agent_before)
        lowest = [p for p in items if p.norm_value.startswith("from ")]
        if not lowest:
            return _OK
        p = lowest[0]
        return Verdict(False, f"calls {p.key}'s lowest price exact ({p.value})",
                       f"The {p.key} is {p.value}: that is where its price starts.")

    def _callers_item(self, s: Support, besides: Sequence[Price] = ()) -> list[Price]:
        """The priced item the caller's lines of the call name (other than `besides`), when
        they name exactly one: "I'm on the Plus plan"."""
        named = [p for p in self._priced_items(" ".join(" ".join(line) for line in s.said_lines)) if p not in besides]
        return named if len(named) == 1 else []

    def _waived_for_caller(self, p: Price, s: Support) -> bool:
        """`p` is free for this caller: its condition ("waived for Plus and Gigabit customers")
        names the item the caller said is theirs ("I'm on the Plus plan")."""
        m = re.search(r"\b(?:free|waived)\b(.*)", p.norm_value)
        theirs = self._callers_item(s, besides=[p]) if m else []
        return bool(theirs) and _names_condition(m.group(1).split(",")[0], normalize(_bare_key(theirs[0].key)))

    def _prices(self, norm: str, s: Support) -> Verdict:
        if not self.book.prices:
            return _OK
        for clause in _clauses(norm):
            money = _MONEY.findall(clause)
            no_fee = _NO_FEE.search(clause) is not None  # "there is no corkage fee": a claim that it is free
            free = no_fee or bool(re.search(r"\bfree\b|\bno charge\b|\bcosts? nothing\b", clause))
            if not money and not free or _NEGATION.search(clause) and not no_fee:
                continue
            # A price alone ("It's $89.") is the price of what the caller asked about.
            named = self._priced_items(clause)
            items = named or (self._priced_items(s.question) if not topic_words(norm) else [])
            if not items:
                continue  # a figure about no priced item: the figure rule looks for it
            if not named and len(items) > 1 and len(money) == 1 and money[0] == _sum(items):
                continue  # "$148." to "How much for a cleaning and a check-up together?": their sum
            if len(money) == 1 and len(items) > 1 and _TOGETHER.search(clause):
                if money[0] == _sum(items):
                    continue  # "... together come to $338": the sum
                # "The price of a cleaning and a whitening together is $249" (specvoice chat):
                # one item's price given for both. Each price, as written, is true.
                return Verdict(False, f"gives {money[0]} for {' and '.join(p.key for p in items)} together",
                               ", and ".join(f"{'The' if i == 0 else 'the'} {p.key} is {p.value}"
                                             for i, p in enumerate(items)) + ".")
            for fig in money:
                if _MORE_THAN.search(clause) and fig == _difference(self._priced_items(norm)):
                    continue  # "$249, which is $160 more than a cleaning": the two prices apart
                if not any(_has_figure(p.norm_value, fig) for p in items) and not any(
                        _has_figure(r, fig) for r in s.results):
                    p = items[0]
                    return Verdict(False, f"{fig} is not the price of {p.key} ({p.value})",
                                   f"Actually, the {p.key} is {_end(p.value)}" if len(items) == 1 else None)
            if free and not any(_free(p.norm_value, clause) or self._waived_for_caller(p, s) for p in items):
                p = items[0]
                return Verdict(False, f"{p.key} is not free ({p.value})",
                               f"Actually, the {p.key} is {_end(p.value)}" if len(items) == 1 else None)
            for p in items:
                if not any(_has_figure(p.norm_value, fig) for fig in money):
                    continue  # this item's price is not said in the clause
                if p.norm_value.startswith("from ") and not _AT_LEAST.search(clause):
                    # "The cost of a filling is $120." to "How much is it exactly?": the facts
                    # say "from $120", a lowest price, not the price (specvoice chat).
                    return Verdict(False, f"says {p.key}'s lowest price as its price ({p.value})",
                                   f"The {p.key} is {_end(p.value)}")
                if _waived_said_as_paid(p.norm_value, clause):
                    # "The cost of a technician visit for Plus and Gigabit customers is $49", said
                    # to a Plus customer: the price of those it is waived for (specvoice chat, isp).
                    return Verdict(False, f"gives the price of {p.key} to those it is waived for ({p.value})",
                                   f"The {p.key} is {_end(p.value)}")
                if not _condition_said(p.norm_value, norm):
                    # "$49" for a visit "waived for Plus and Gigabit customers", said to a Plus
                    # customer (bench quality: isp-plus-technician): the price without its condition.
                    return Verdict(False, f"the price of {p.key} has a condition ({p.value})",
                                   f"The {p.key} is {_end(p.value)}")
        return _OK

    def _only_another_items(self, fig: str, items: list[Price], s: Support) -> Price | None:
        """The priced item, not one of `items` (those the sentence names), whose line alone
        holds `fig`; None when a named item's line, another fact or a tool result has it."""
        if not items or fig.startswith("$"):
            return None  # prices: the price rule judges them
        owners = []
        for line, figs in zip(self.book.lines, self.book.line_figures):
            if fig not in figs:
                continue
            owner = next((p for p in self.book.prices if line.startswith(f"price of {normalize(p.key)}:")), None)
            if owner is None:  # a fact that names one priced item is that item's ("Express shipping takes 2 days")
                named = [p for p in self.book.prices if p.phrase and p.pattern.search(line)]
                owner = named[0] if len(named) == 1 else None
            if owner is None or owner in items:
                return None  # a fact of its own, or the named item's
            owners.append(owner)
        if not owners or any(fig in figs for figs, _ in s.lines):
            return None
        return owners[0]

    def _priced_items(self, text: str) -> list[Price]:
        words = topic_words(text)
        return [p for p in self.book.prices if (p.phrase and p.pattern.search(text)) or p.words & words]

    def _days(self, norm: str, s: Support) -> Verdict:
        hours = self.book.hours
        for clause in _clauses(norm):
            days = _days_in(clause)
            if not days:
                continue
            # A day nobody mentions (facts, results, open slots) is not a day to talk about.
            known = self.book.days | s.days
            if not _NEGATION.search(clause) or _CLOSED.search(clause):
                for d in days:
                    if d not in known:
                        return Verdict(False, f"{DAYS[d]} is not in the facts")
            if hours is None or _AVAILABLE.search(clause):
                continue
            if _CLOSED.search(clause):
                wrong = [d for d in days if not _is_closed(hours[d])]
                if wrong:
                    d = wrong[0]
                    return Verdict(False, f"{DAYS[d]} is open ({hours[d]}), not closed",
                                   f"Actually, on {DAYS[d]} we're open {_end(hours[d])}")
            elif _OPEN.search(clause) and not _NEGATION.search(clause):
                wrong = [d for d in days if _is_closed(hours[d])]
                if wrong:
                    d = wrong[0]
                    return Verdict(False, f"{DAYS[d]} is closed", f"Actually, we're closed on {DAYS[d]}.")
            if _HOURS_WORD.search(clause) and not _NEGATION.search(clause):
                for t in _TIME.findall(clause):
                    bad = [d for d in days if not _is_closed(hours[d]) and not _has_figure(self.book.norm_hours[d], t)]
                    if bad:
                        d = bad[0]
                        return Verdict(False, f"{t} is not in {DAYS[d]}'s hours ({hours[d]})",
                                       f"Actually, on {DAYS[d]} we're open {_end(hours[d])}")
        return _OK

    def _open_slots(self, s: Support) -> list[str]:
        return list(s.slots) if s.slots is not None else list(self.book.slots)

    def _slots(self, norm: str, s: Support) -> Verdict:
        for clause in _clauses(norm):
            if not _AVAILABLE.search(clause) or _NEGATION.search(clause):
                continue
            doctors = [self.book.doctor(d) for d in _DOCTOR.findall(clause)]
            labels = s.labels if s.slots is not None else self.book.labels
            for part in _per_time(clause):  # "a table for 4 at 6 pm and a table for 2 at 9 pm": two claims
                times, days, rel, counts = _TIME.findall(part), _days_in(part), _RELATIVE.findall(part), \
                    _FOR_N.findall(part)
                parts = _PART_OF_DAY.findall(part)
                if not (times or days or rel or counts or parts):
                    continue
                of = self._claimed_doctors(doctors, part, days, times)
                # Each day named is a claim of its own ("mornings on Tuesday and Friday").
                if not all(any(all(_has_figure(label, t) for t in times)
                               and (day is None or _DAY_WORDS_RE[day].search(label))
                               and all(r in label for r in rel)
                               and all(_in_part_of_day(label, p) for p in parts)
                               and all(f"dr {d}" in label for d in of)
                               and all(re.search(rf"\b(?:for|of) {n}\b", label) for n in counts) for label in labels)
                           for day in days or [None]):
                    slots = self._open_slots(s)
                    if not slots:
                        return Verdict(False, "no slot is open", "There are no open slots right now.")
                    return Verdict(False, "no open slot fits", "The open slots are: " + "; ".join(slots) + ".")
        return _OK

    def _claimed_doctors(self, doctors: list[str], part: str, days: list[int], times: list[str]) -> list[str]:
        """The doctors one slot claim is of: the clause's one, or, where the part names one day
        and one time, all it names ("Dr. Moreno is available on Friday at 9:00 a.m. with Dr.
        Patel" of Dr. Patel's slot, specvoice chat); a list of days and doctors is not one slot
        (none). A part begins after a time: its leading "with dr patel" is that time's."""
        if len(doctors) == 1:
            return doctors
        here = [self.book.doctor(d) for d in _DOCTOR.findall(re.sub(r"^[\s,]*with dr \w+", "", part))]
        return here if len(here) > 1 and len(set(days)) <= 1 and len(times) <= 1 else []

    def _doctors_days(self, norm: str, s: Support) -> Verdict:
        """"Dr. Moreno is in on Fridays." says which days a doctor works: true only where a fact
        or a slot (configured, open now, or the caller's) puts that doctor on that day. The
        facts name the dentists, not their days; "Is Dr. Moreno in on Fridays?" got "Yes, Dr.
        Moreno is in on Fridays." (specvoice chat), and the slot rule, which needs "available"
        or a slot word, let it pass. Said of the caller's question, a "yes" is judged the same
        way (the agreement rule runs these rules on it)."""
        sources = [*self.book.lines, *self.book.labels, *s.labels, *(normalize(b) for b in s.booked or [])]
        for clause in _clauses(norm):
            if not _PRESENT.search(clause):
                continue
            negated = bool(_NEGATION.search(clause))
            for doctor in dict.fromkeys(self.book.doctor(d) for d in _DOCTOR.findall(clause)):
                name = f"Dr. {doctor.capitalize()}"
                theirs = [x for x in self._open_slots(s) if re.search(rf"\b{doctor}\b", normalize(x))]
                for day in _days_in(clause):
                    backed = [x for x in sources if re.search(rf"\b{doctor}\b", x) and _DAY_WORDS_RE[day].search(x)]
                    if negated and backed:  # "Dr. Patel isn't in on Fridays" of her Friday slot
                        on_day = [_slot_time(x) for x in theirs if _DAY_WORDS_RE[day].search(normalize(x))]
                        said = _end(f"Actually, {name} has an open slot on {on_day[0]}") if on_day else None
                        return Verdict(False, f"{name} has a {DAYS[day]} slot", said)
                    if not negated and not backed:
                        said = None
                        if theirs:
                            said = _end(f"I can't confirm which days {name} is in; {name}'s open "
                                        + (f"slot is {_slot_time(theirs[0])}" if len(theirs) == 1 else
                                           "slots are " + "; ".join(_slot_time(x) for x in theirs)))
                        return Verdict(False, f"the facts do not put {name} on {DAYS[day]}", said)
        return _OK

    def _referent(self, norm: str, s: Support) -> Verdict:
        """"Is that with Dr. Patel?" / "That's on Wednesday.": "that" is the slot the agent's
        last line named, and what the sentence says of it must fit it (module doc, "that")."""
        if not s.agent_before or not _POINTS_BACK.search(norm) or not _ASKS_BACK.search(s.caller):
            return _OK  # the caller asked about something else: "that" is not the slot
        doctors, days, times = [self.book.doctor(d) for d in _DOCTOR.findall(norm)], _days_in(norm), _TIME.findall(norm)
        if not (doctors or days or times):
            return _OK
        named = [(label, raw) for label, raw in self._slot_labels(s) if label in s.agent_before]
        if not named or any(all(f"dr {d}" in label for d in doctors) and all(_DAY_WORDS_RE[d].search(label) for d in days)
                            and all(_has_figure(label, t) for t in times) for label, _ in named):
            return _OK
        said = " or ".join(raw for _, raw in named)
        return Verdict(False, f"says of the slot just named ({said}) what does not fit it", f"Actually, that's {said}.")

    def _slot_labels(self, s: Support) -> list[tuple[str, str]]:
        """(normalised, as written) of every slot the agent may have named: the configured
        ones, the database's open ones now, the caller's booked ones."""
        raw = dict.fromkeys([*self.book.slots, *(s.slots or []), *(s.booked or [])])
        return [(normalize(x), x) for x in raw]

    def _records(self, norm: str, s: Support) -> Verdict:
        """A sentence about a record the facts hold one line for (an order number, in the
        sentence or else in the caller's line) says what that line says: a status ("shipped",
        "packed", "delivered") only if the line has it, an arrival day only if the line's.
        The 1.5B said order 48213 was "being packed" (that is 48377), that 48377 "has
        shipped" (it ships tomorrow), that 48213 arrives Monday (it shipped Monday, arrives
        Thursday): bench quality."""
        # "your order", or "it" asked of and answered ("Is it shipped?" "Yes, it is shipped.",
        # specvoice chat, shop): the record last named in the call.
        ids = _RECORD_ID.findall(norm) or _RECORD_ID.findall(s.caller) or (
            s.records[-1:] if _YOUR_RECORD.search(norm) or _IT.search(norm) and _IT.search(s.caller) else [])
        if not ids:
            return _OK
        for i, line in enumerate(self.book.lines):
            if not any(re.search(rf"\b{x}\b", line) for x in ids):
                continue
            why = None
            for m in _STATUS.finditer(norm):
                status = m.group(1) or m.group(2)
                if not re.search(rf"\b{status}\b", line) and not _negated_before(norm, m.start()):
                    why = f"says {status!r} of a record whose line does not"
                    break
            for clause in _clauses(norm):
                if why is None and (_YOUR_RECORD.search(clause) or any(re.search(rf"\b{x}\b", clause) for x in ids)):
                    # "Yes, your order was over $50": a sum its line does not have (specvoice chat, shop).
                    wrong = [fig for fig in _MONEY.findall(clause) if not _has_figure(line, fig)]
                    if wrong:  # nothing to correct it with: the line does not know the sum
                        return Verdict(False, f"says {wrong[0]} of a record whose line does not")
            arrives = {m.group(1) or m.group(2) for m in _ARRIVAL_DAY.finditer(line)}
            said = [m.group(1) or m.group(2) for m in _ARRIVAL_DAY.finditer(norm)
                    if not _negated_before(norm, m.start())]
            wrong = [d for d in said if d not in arrives]
            if why is None and wrong:
                # "The rain jacket will arrive tomorrow." of an order that ships tomorrow (specvoice chat).
                why = (f"says it arrives {wrong[0]}, its line says {sorted(arrives)[0]}" if arrives else
                       f"says it arrives {wrong[0]}, its line gives no arrival")
            if why is None:
                # "It will use UPS." of order 48377, whose line names no carrier: UPS is 48213's.
                asserted = " ".join(c for c in _clauses(norm) if not _NEGATION.search(c))  # "no tracking number yet": none
                others = set().union(*self._other_records(i))
                foreign = sorted(w for w in topic_words(asserted) - topic_words(line)
                                 if w in others and w not in self._plain_topics)
                if foreign:
                    why = f"says {foreign[0]!r} of a record whose line does not (another record's)"
            if why is not None:
                return Verdict(False, why, _actually(self.book.said[i]))
        return _OK

    def _other_records(self, i: int) -> list[set[str]]:
        """The topic words of every record line (one that holds a record number) but line i."""
        return [t for j, (line, t) in enumerate(zip(self.book.lines, self.book.line_topics))
                if j != i and _RECORD_ID.search(line)]

    @functools.cached_property
    def _plain_topics(self) -> set[str]:
        """The topic words of the fact lines that are no record's: the business's own words."""
        return set().union(*(t for line, t in zip(self.book.lines, self.book.line_topics) if not _RECORD_ID.search(line)))

    def _callers_name(self, norm: str, s: Support) -> Verdict:
        """What the agent says of the caller's name is what the caller said it is. The 1.5B
        said "I'm sorry, but I don't have your name." to a caller who had given it."""
        if _NO_NAME.search(norm):
            if s.name:
                return Verdict(False, f"says it does not have the caller's name, but they said it: {s.name}",
                               f"Your name is {s.name}.")
            return _OK
        m = _YOUR_NAME_IS.search(norm)
        if not m:
            return _OK
        said = []
        for w in m.group(1).split()[:2]:
            if w in NOT_NAME:  # "your name is on the booking": no name
                break
            said.append(w)
        if not said:
            return _OK
        # Any name the caller said counts: "Actually, it's Rob, not Robert." is theirs to give.
        if all(w in s.caller_words for w in said):
            return _OK
        if s.name:
            return Verdict(False, f"calls the caller {' '.join(said).title()}, but they said {s.name}",
                           f"Your name is {s.name}.")
        return Verdict(False, f"calls the caller {' '.join(said).title()}, a name they did not give",
                       "I don't think you've told me your name yet.")

    def _callers_number(self, norm: str, s: Support) -> Verdict:
        """"What's my phone number on file?" got "555-0142", the business's own (specvoice
        chat): a number said as the caller's is one the caller gave."""
        if not _MY_NUMBER.search(s.question):
            return _OK
        for fig in _PHONE.findall(norm):
            if fig.replace("-", "") not in s.caller_digits:
                return Verdict(False, f"gives {fig} as the caller's number",
                               f"The number you gave me is {s.phone}." if s.phone else
                               "I don't think you've given me your number yet.")
        return _OK

    def _callers_booking(self, norm: str, s: Support) -> Verdict:
        """What the agent says the caller has booked is a booking the database holds for them
        (made on this call, under their name, or from their line). The 1.5B told a caller
        whose booking had failed (the slot was taken) "Your appointment is scheduled for
        Tuesday 10:30 a.m. with Dr. Patel." (specvoice chat)."""
        if s.booked is None:
            return _OK
        for clause in _clauses(norm):
            m = _YOUR_BOOKING.search(clause)
            if not m or _NEGATION.search(clause) or _CANCELLED.search(clause) or _fits_a_booking(clause, s.booked):
                continue  # "your booking was cancelled" claims none: the action rule judges it
            if _OFFERS_TO.search(clause[:m.start()]):
                continue  # "I can book your appointment for Tuesday": an offer, not a booking
            if s.booked:
                return Verdict(False, "says the caller has a booking the database does not hold for them",
                               ("Your booking is for " if len(s.booked) == 1 else "Your bookings are for ")
                               + " and ".join(s.booked) + ".")
            return Verdict(False, "says the caller has a booking, but the database holds none for them",
                           f"I don't see a booking under {s.name}." if s.name else "I don't see a booking for you.")
        return _OK

    def _names(self, norm: str, s: Support) -> Verdict:
        for name in _DOCTOR.findall(norm):
            if name not in self.book.people and not any(f"dr {name}" in r for r in s.results):
                return Verdict(False, f"Dr. {name.title()} is not in the facts")
        return _OK

    def _offers(self, norm: str, s: Support) -> Verdict:
        if _HEDGE.search(norm):
            return _OK
        known = self._known_topics(s)
        for clause in _clauses(norm):
            m = _NOT_OFFERED.search(clause)
            if m:
                unknown = sorted(_object_words(clause[m.end():]) - known)
                if unknown:  # "We don't offer TV packages": the facts do not say that either
                    return Verdict(False, "denies what the facts do not mention: " + _as_said(unknown, clause))
                continue
            m = _OFFER.search(clause)
            if not m:
                continue
            if _NEGATION.search(clause):
                continue
            offered = _object_words(clause[m.end():])
            unknown = sorted(offered - known)
            if unknown and 2 * len(unknown) > len(offered):  # "free tables": one known word carries it
                return Verdict(False, f"offers what the facts do not name: {_as_said(unknown, clause)}")
        return _OK

    def _actions(self, norm: str, s: Support) -> Verdict:
        for tool, pattern in _ACTIONS.items():
            m = pattern.search(norm)
            if m and tool == "book_slot" and s.booked and _fits_a_booking(norm, s.booked):
                continue  # "You're booked for Tuesday at 10:30", said a turn after it was booked
            if m and tool not in s.done and not _negated_before(norm, m.start()):
                return Verdict(False, f"claims {_ACTION_WHAT[tool]}, but no {tool} succeeded this turn")
        m = _SLOT_TAKEN.search(norm)
        if m and not _negated_before(norm, m.start()) and not any("booked" in r or "taken" in r for r in s.results):
            return Verdict(False, "says a slot is taken, but no tool said so this turn")
        return _OK

    def _echo(self, norm: str, s: Support) -> Verdict:
        """The caller's words said back as the agent's own claim (module doc, "echo")."""
        words = _WORD.findall(norm)
        if len(words) < ECHO_WORDS or not s.said_lines:
            return _OK
        runs = {tuple(words[i:i + ECHO_WORDS]) for i in range(len(words) - ECHO_WORDS + 1)}
        for line in s.said_lines:
            for i in range(len(line) - ECHO_WORDS + 1):
                if tuple(line[i:i + ECHO_WORDS]) in runs:
                    known = topic_words(norm) & (self.book.vocab | s.topics)  # topics: results' and slots'
                    if len(known) > 1:
                        return _OK  # about the business: a confirmation ("... a cleaning for Tuesday")
                    return Verdict(False, f"says the caller's words back as its own: "
                                          f"\"{' '.join(line[i:i + ECHO_WORDS])} ...\"")
        return _OK

    def _agreement(self, norm: str, s: Support) -> Verdict:
        """"Yes" to a claim or a yes-no question agrees with what the caller said."""
        if not _AGREE.match(norm) or not s.caller:
            return _OK
        said = _said_sentences(s.caller)
        tagged = [i for i, x in enumerate(said) if _TAG.search(x)]
        if tagged:
            # "I'd like Monday morning. You have that open, right?": the claim and what it points at.
            i = tagged[-1]
            claim = " ".join(said[max(0, i - 1):i] + [_TAG.sub("", said[i]).rstrip(" ?")])
        elif said and said[-1].endswith("?") and _YES_NO.match(said[-1]):
            claim = said[-1].rstrip(" ?")
        else:
            return _OK
        v = self._claims(claim, s)
        if not v.ok:
            # The caller's claim is wrong: say the fact it is about ("Actually, returns are
            # free within 30 days."), which is true whatever else the claim got wrong.
            fact = v.correction or _actually(self.book.closest(claim))
            return Verdict(False, f"agrees with the caller's claim: {v.why}", fact)
        if _EXISTS.search(claim):
            # "Do you do braces?" / "Is there parking?": what is asked after must be in the facts.
            # "Do you have anything on Tuesday morning?": the day and its part are the slot
            # rule's to judge, not things the facts must name (held back, specvoice chat).
            asked = _object_words(claim[_EXISTS.search(claim).end():]) - _NOT_A_SUBJECT
            unknown = sorted(asked - self._known_topics(s))
            if unknown:
                return Verdict(False, f"agrees to what the facts do not say: {_as_said(unknown, claim)}")
        return _OK

    def _unknown_subject(self, norm: str, s: Support) -> Verdict:
        """The caller asked whether something is so ("Do you have a kids' menu?", "Can I get
        a static IP address?") and the facts never mention it: they support neither a yes
        nor a no, so only a sentence that says we do not know may be said. The 1.5B
        answered "No, we don't have a kids' menu" (and "Dr. Patel does implants") to eight
        of bench quality's twenty such questions."""
        if not s.caller or _HEDGE.search(norm):
            return _OK
        if s.asked is None:  # once per turn state, not per sentence
            s.asked = self._asked_unknown(s)
        unknown = s.asked
        if unknown:
            return Verdict(False, f"answers what the facts do not say: {unknown}")
        return _OK

    def _asked_unknown(self, s: Support) -> str:
        """What the caller's last yes-no question asks about, as they said it, when most of
        its words are in no fact (nor tool result, nor open slot); "" otherwise."""
        questions = [x for x in _said_sentences(s.caller) if x.endswith("?")]
        if not questions:
            return ""
        q = questions[-1].rstrip(" ?")
        m = _ASKS_WHETHER.search(q)
        if not m:
            return ""
        end = _ASKED_END.search(q, m.end() + 1)
        phrase = q[m.end():end.start() if end else len(q)]
        asked = topic_words(phrase) - _CALLER_WORDS - _NOT_A_SUBJECT
        if re.search(r"\bmy (?:full )?name\b", phrase):
            asked -= {"name"}  # the caller's own: what is said of it is the caller-name rule's
        unknown = sorted(asked - self._known_topics(s))
        return _as_said(unknown, phrase) if unknown and 2 * len(unknown) >= len(asked) else ""

    def _known_topics(self, s: Support) -> set[str]:
        return self.book.vocab | s.topics if s.topics else self.book.vocab


_DAY_WORDS_RE = {i: re.compile(rf"\b{d.lower()}s?\b") for i, d in enumerate(DAYS)}
# A sentence that points back at what the agent just named: "Is that with Dr. Patel?",
# "That's on Wednesday", "Is it at 2:15?" ("it" only as a question's subject: "It's 6 pm on
# Friday" answers the caller's own question more often than it points back).
_POINTS_BACK = re.compile(r"\b(?:that|this)(?: ones?| slot| appointment| booking| time)?(?:'s| is| was| will be)\b|"
                          r"^(?:(?:so|and|but|ok|okay|yes|yeah|oh|wait)[ ,]+)*(?:is|was|will) (?:that|this|it)\b")
# A caller's line about what the agent just said: "Is that with Dr. Patel?", "Who is that
# with?", "When's it?", "That's on Tuesday, right?".
_ASKS_BACK = re.compile(r"\b(?:is|was|'s) (?:that|this|it)\b|\b(?:that|this)(?:'s| is| was| ones?)\b")
_OFFER_VERBS = ("offer", "have", "provide", "sell", "carry", "serve", "accept", "take", "support", "available",
                "order", "use")
# Words a caller's yes-no question is made of that name nothing ("can I come in", "is there").
_CALLER_WORDS = {_stem(w) for w in """visit person book booking appointment come able possible maybe think tell
    remember recall forget spell confirm check thinking heard told someone friend said""".split()}
# Questions whether something exists or is offered: a "yes" to them claims it.
_EXISTS = re.compile(r"^(?:\w+ )?(?:do|does|can|will) (?:you|we|dr \w+|the \w+|it|they|he|she) (?:also )?(?:have|offer|do|sell|"
                     r"take|accept|carry|provide|serve|speak|support|ship|deliver|include|give|make|fix|repair)\b|"
                     r"^(?:\w+ )?(?:is|are) there\b|^(?:\w+ )?can (?:i|we) (?:get|have|order|pay|use)\b")


_OBJECT_END = re.compile(r"\b(?:if|when|because|for|with|to|that|which|who|i|we|you|so|since|after|"
                         r"before|from|by|and|or|but|too|here|there|anymore)\b|[.?!]")


def _object_words(text: str) -> set[str]:
    """The thing a question or an offer is about: the words up to its first preposition or
    pronoun ("a store I can visit in person" -> store)."""
    m = _EXAMPLES.search(text)
    if m:  # "a wide range of services including cleaning": the cleaning is what is offered
        text = text[m.end():]
    m = _OBJECT_END.search(text, 1)
    return topic_words(text[: m.start()] if m else text) - _CALLER_WORDS - _GENERIC - {_stem(w) for w in _OFFER_VERBS}


_EXAMPLES = re.compile(r"\b(?:including|such as|namely|for example)\b")
# Words of an offer that name no thing of their own ("a wide range of services").
_GENERIC = {_stem(w) for w in """range ranges variety selection kind kinds type types sort sorts lot lots number service
    services option options wide full""".split()}


# A doctor said to be at work ("is in", "works", "sees patients"), in a statement or a
# question ("is dr moreno in on fridays"): the days it names are the doctor's days.
_PRESENT = re.compile(r"\b(?:is|are|'s|be)(?:n't| not)?(?: dr \w+)? (?:in|there|here|around|working|on duty)\b|"
                      r"\bworks?\b|\bsees? patients\b|\bcomes? in\b")


def _slot_time(slot: str) -> str:
    """A slot as said of its doctor: "Wednesday 2:15 p.m. with Dr. Moreno" -> "Wednesday 2:15 p.m."."""
    return re.sub(r"\s*,?\s*with Dr\.? \w+(?: \w+)?$", "", slot, flags=re.IGNORECASE).strip() or slot


_YOUR = re.compile(r"\byour\b")
_MY_NUMBER = re.compile(r"\bmy (?:phone |cell |mobile |contact |callback )?number\b")
_FREE_OVER = re.compile(r"\bfree (?:on orders )?(?:over|above) (\$\d+(?:\.\d\d)?)")
_EXACT = re.compile(r"\b(?:exact|exactly|fixed|flat|final)\b(?: \w+)?(?: price| cost| fee| rate|$)|\bprecisely\b")
# The caller's record, unnumbered ("your order was over $50"): the one they named in the call.
_IT = re.compile(r"\b(?:it|it's|its)\b")
_YOUR_RECORD = re.compile(r"\b(?:your|my) (?:order|package|parcel|delivery|shipment|account|ticket)\b")
# A record's number ("order 48213"): five digits or more, standing alone.
_RECORD_ID = re.compile(r"(?<![\w.-])(\d{5,})(?![\w-]|\.\d)")
# A status said as done or under way ("has shipped", "being packed"), not as to come ("will be shipped").
_STATUS = re.compile(r"\b(?:(?:has|have|had|is|are|was|were|already|got)(?: been| already)? (shipped|delivered|arrived|dispatched|"
                     r"refunded|returned|packed|processed)|being (packed|processed))\b")
_ARRIVAL_DAY = re.compile(r"\b(?:arriv\w*|deliver\w*|get there|reach you)\b(?: \w+){0,2}? (?:on |by )?(?:"
                          + _DAY_NAME + r"|(today|tonight|tomorrow))\b")
# A caller's yes-no question, up to what it asks about ("do you have", "can I", "is there").
_ASKS_WHETHER = re.compile(
    r"^(?:(?:so|and|but|also|um|hmm|great|ok|okay|well|oh|hi|hello|sorry)[ ,]+)*(?:do|does|can|could|will|would|is|are)"
    r" (?:you|we|i|they|there|it|dr \w+|the \w+)(?: (?:still|also|ever|currently|even))?\b")
# Where the thing asked about ends ("a fee if we bring our own wine": a fee). Not at "who",
# "that": "a dentist who does implants" asks about implants.
_ASKED_END = re.compile(r"\b(?:if|when|because|so|since|after|before|while|i|i'm|we|you)\b|[,.?!]")
# Words of a question that are no subject the facts would have to name.
_NOT_A_SUBJECT = {_stem(w) for w in _OFFER_VERBS} | {_stem(w) for w in """morning afternoon evening night week weekend
    month year near nearby soon later""".split()}
_NOT_OFFERED = re.compile(r"\bwe (?:do not|don't|does not|doesn't) (?:currently )?(?:offer|have|provide|sell|carry|"
                          r"serve|accept|take|do)\b|\bthere (?:is|are) no\b")


# "No fee", "you won't pay", "doesn't cost anything": said of a priced item, a claim it is free
# (bench quality: "No, there is no corkage fee" where corkage is $15).
_NO_FEE = re.compile(r"\bno (?:\w+ )?(?:fee|charge|cost)s?\b|\b(?:don't|do not|won't|will not|doesn't|does not|didn't)"
                     r" (?:have to |need to )?(?:pay|cost|charge)\b|\bnothing to pay\b")
_CONDITIONAL = re.compile(r"\b(?:waived|free)\b")


def _said_sentences(text: str) -> list[str]:
    """A caller's line (normalised) cut after each full stop, question or exclamation mark."""
    return [x for x in re.split(r"(?<=[.!?])\s+", text) if x]


def _condition_said(value: str, sentence: str) -> bool:
    """A price with a condition ("$49, waived for Plus and Gigabit customers"; "free over $50,
    otherwise $6.95") is said with it: the sentence says "waived" / "free", or names the
    condition ("Plus", "over $50")."""
    m = _CONDITIONAL.search(value)
    if not m:
        return True
    if _CONDITIONAL.search(sentence) or re.search(r"\b(?:no charge|unless|except|otherwise)\b", sentence):
        return True
    return _names_condition(value[m.end():].split(",")[0], sentence)


# One figure for several items together ("a cleaning and a whitening together is $249").
_TOGETHER = re.compile(r"\b(?:together|combined|in total|total|altogether|both|for the two|for the pair)\b")
# A lowest price said as one ("from $120", "starting at $120", "at least $120").
_AT_LEAST = re.compile(r"\b(?:from|start\w*|at least|minimum|upwards?|or more|and up|lowest|as little as)\b")


def _sum(items: list[Price]) -> str | None:
    """The items' prices added up, as "$N" (None: a price that is not one plain sum)."""
    values = [re.fullmatch(r"\$(\d+(?:\.\d\d)?)", p.norm_value.strip().rstrip(".")) for p in items]
    if not all(values):
        return None
    total = sum(float(m.group(1)) for m in values)
    return f"${total:.2f}".removesuffix(".00")


def _difference(items: list[Price]) -> str | None:
    """Two items' prices apart, as "$N" (None: not two plain prices, or two per different units)."""
    values = [re.fullmatch(r"\$(\d+(?:\.\d\d)?)((?: a| per) \w+)?", p.norm_value.strip().rstrip(".")) for p in items]
    if len(values) != 2 or not all(values) or values[0].group(2) != values[1].group(2):
        return None  # "a month" against "a month" only
    a, b = (float(m.group(1)) for m in values)
    return f"${abs(a - b):.2f}".removesuffix(".00")


_MORE_THAN = re.compile(r"\b(?:more|less|cheaper|pricier|dearer|difference|than|extra)\b")
_WHO = {_stem(w) for w in "customer customers member members client clients user users people person".split()}


def _waived_said_as_paid(value: str, clause: str) -> bool:
    """A price "waived for X" said, in one clause, as the price for X: the clause names X
    and says nothing of the waiver (nor "except", "unless", "only", "not")."""
    m = re.search(r"\bwaived for (.*)", value)
    if not m or not topic_words(m.group(1).split(",")[0]) - _WHO & topic_words(clause):
        return False
    return not re.search(r"\b(?:waiv\w*|free|no charge|except|unless|other than|only|not|non|without)\b|n't\b", clause)


def _free(value: str, clause: str) -> bool:
    """A price that is free: "free" or "$0", or "waived for X"; when the value makes it
    free only under a condition ("free over $50", "waived for Plus customers"), the clause
    must name the condition too ("always free" is a false claim)."""
    m = re.search(r"\b(?:free|waived)\b(.*)|\$0\b(.*)", value)
    if not m:
        return False
    condition = (m.group(1) or m.group(2) or "").split(",")[0]
    if not re.search(r"\b(?:over|above|for|with|when|if|on orders|from)\b", condition):
        return True
    return _names_condition(condition, clause)


def _names_condition(condition: str, text: str) -> bool:
    """`text` names a price's condition ("Plus and Gigabit customers", "over $50"): a word
    or a figure of it."""
    return bool(topic_words(condition) & topic_words(text) or set(figures(condition)) & set(figures(text)))


def _as_said(stems: list[str], text: str) -> str:
    """Stemmed words back as the text spelled them, for a reason a person reads."""
    spelled = {_stem(w): w.strip("'") for w in _WORD.findall(text)}
    return ", ".join(spelled.get(w, w) for w in stems[:3])


def _actually(fact: str | None) -> str | None:
    if not fact:
        return None
    first = fact.split()[0]
    keep = first == "I" or any(c.isupper() for c in first[1:])  # "UPS", "iPhone"
    return "Actually, " + (fact if keep else fact[0].lower() + fact[1:])


def _end(text: str) -> str:
    """A fact as the end of a sentence: one full stop ("6 p.m." keeps its own)."""
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def _in_part_of_day(label: str, part: str) -> bool:
    """A slot's label (normalised) is in the morning / afternoon / evening: its time is, or
    it names that part itself."""
    lo, hi = _PART_HOURS[part]
    for t in _TIME.findall(label):
        hour, _, rest = t.partition(" ")[0].partition(":")
        h = int(hour) % 12 + (12 if t.endswith("pm") else 0)
        if lo <= h + (int(rest) / 60 if rest else 0) < hi:
            return True
    return part in label


def _per_time(clause: str) -> list[str]:
    """A clause cut after each time it names, the tail joined to the last part."""
    ends = [m.end() for m in _TIME.finditer(clause)]
    if len(ends) <= 1:
        return [clause]
    parts = [clause[a:b] for a, b in zip([0] + ends[:-1], ends)]
    parts[-1] += clause[ends[-1]:]
    return parts


def claimed_actions(text: str) -> list[str]:
    """The tools whose action `text` claims ("You're booked" -> book_slot), for the
    benchmarks: a claim no successful call of that tool backs is a false one."""
    norm = normalize(text)
    return [tool for tool, pattern in _ACTIONS.items()
            if (m := pattern.search(norm)) and not _negated_before(norm, m.start())]


# The agent telling the caller what they have booked ("Your appointment is scheduled for
# Tuesday", "You have a booking on Friday", "You're down for 9 a.m.").
_YOUR_BOOKING = re.compile(
    r"\byour (?:\w+ )?(?:appointment|booking|reservation)s? (?:is|was|are|has been|have been|for|on|at|with)\b|"
    r"\byou (?:have|'ve got|have got|still have) (?:a|an|your|one) (?:\w+ )?(?:appointment|booking|reservation)\b|"
    r"\byou(?:'re| are) (?:all )?(?:booked|scheduled|down|set) (?:for|on|at|in|with)\b|"
    # "Your check-up is scheduled for Wednesday" (a caller with no booking, specvoice chat)
    r"\byour (?:\w+ ){1,3}(?:is|was|has been) (?:scheduled|booked|set|confirmed|reserved) (?:for|on|at|with)\b")


_OFFERS_TO = re.compile(r"\b(?:can|could|will|would|i'll|let me|to|shall|want|like)\b")
_CANCELLED = re.compile(r"\bcancel+(?:ed|led|ing)?\b")


def _fits_a_booking(clause: str, booked: Sequence[str]) -> bool:
    """A booked slot has every day, time and doctor the clause names (a clause naming none
    fits any booking)."""
    times, days, doctors = _TIME.findall(clause), _days_in(clause), _DOCTOR.findall(clause)
    labels = [normalize(x) for x in booked]
    return any(all(_has_figure(label, t) for t in times) and all(_DAY_WORDS_RE[d].search(label) for d in days)
               and all(f"dr {d}" in label for d in doctors) for label in labels)


def _negated_before(norm: str, at: int) -> bool:
    """A negation in the same clause before `at`: "I haven't booked", "nothing was cancelled"."""
    start = max(norm.rfind(c, 0, at) for c in ",;.")
    return bool(_NEGATION.search(norm[start + 1:at]))


def _split_fixed(text: str) -> list[str]:
    from pipeline.sentences import split_sentences

    return split_sentences(text) + [text]


# ---------------------------------------------------------------- one turn


_DENIES = re.compile(r"^(?:no|nope|not quite|not really|that's not|that is not|actually|unfortunately|sorry)\b")


class TurnGuard:
    """The guard over one turn's sentences, as they come: `sentence -> what to say` (the
    sentence, a correction, the fallback, or None: nothing, when a correction or the
    fallback was said already this turn). `guarded` records every sentence held back."""

    def __init__(self, guard: FactGuard, caller: str = "", tool_calls: list[dict] | None = None,
                 slots: Callable[[], Sequence[str] | None] | None = None, earlier: Sequence[str] = (),
                 bookings: Callable[[str | None], Sequence[str]] | None = None, agent_before: str = ""):
        self.guard = guard
        self.caller = caller
        self.tool_calls = tool_calls if tool_calls is not None else []  # live: filled by the tool step
        self.slots = slots or (lambda: None)
        self.bookings = bookings  # the caller's name -> their booked slots (None: no database)
        self.earlier = list(earlier)
        self.agent_before = agent_before
        self.guarded: list[dict] = []
        self.said: list[str] = []  # our replacements spoken this turn
        self._spoke = False
        self._support: Support | None = None
        self._seen = -1

    def support(self) -> Support:
        if self._support is None or self._seen != len(self.tool_calls):
            self._seen = len(self.tool_calls)
            try:
                slots = self.slots()
            except Exception:  # the database is down: judge against the configured slots
                slots = None
            name = caller_name([*self.earlier, self.caller])
            try:
                booked = None if self.bookings is None else self.bookings(name)
            except Exception:  # ... and say nothing of the caller's bookings
                booked = None
            self._support = Support.of(self.tool_calls, slots, self.caller, self.earlier, booked, name,
                                       self.agent_before)
        return self._support

    def __call__(self, sentence: str) -> str | None:
        v = self.guard.check(sentence, self.support())
        first = not self.guarded and not self._spoke
        self._spoke = True
        if v.ok and first and self.guard.is_fallback(sentence):
            # "I'm not sure" to a caller's claim the facts contradict ("You're open Sundays,
            # right?"): the fact that contradicts it is the better answer, and it is true.
            premise = self.guard.check("yes", self.support())
            if not premise.ok and premise.correction:
                v = Verdict(False, f"the caller's claim is wrong ({premise.why.removeprefix('agrees with ')}): "
                                   "correct it rather than say the fallback", premise.correction)
        if v.ok and first and _DENIES.match(normalize(sentence)):
            # "No, Dr. Moreno has no slot on Thursday." is true, and the caller still does not
            # know what there is: the fact that contradicts their claim follows it (bench
            # quality: the Wednesday slot, the back room for twelve).
            premise = self.guard.check("yes", self.support())
            fact = premise.correction
            if not premise.ok and fact and not topic_words(normalize(fact)) <= topic_words(normalize(sentence)):
                self.said.append(fact)
                return f"{sentence} {fact}"
        if v.ok:
            if self.guard.is_fallback(sentence) and self.guard.book.fallback not in self.said:
                # The model said the fallback itself: a sentence held back later in the turn
                # is not answered with it a second time (specvoice chat, isp).
                self.said.append(self.guard.book.fallback)
            return sentence
        correction = v.correction
        if correction is None:
            # Nothing to correct the sentence from; if the caller's own claim is wrong, its
            # correction still beats the fallback ("Express shipping takes one day, right?").
            premise = self.guard.check("yes", self.support())
            correction = premise.correction if not premise.ok else None
        say = correction or self.guard.book.fallback
        if say in self.said or self.said and say == self.guard.book.fallback:
            say_now = None  # one correction or fallback a turn is enough
        else:
            say_now = say
            self.said.append(say)
        self.guarded.append({"sentence": sentence, "why": v.why, "said": say_now})
        return say_now


def turn_guard(guard: FactGuard | None, caller: str, result: Any, toolbox: ToolRunner | None = None,
               exchanges: Sequence[tuple[str, str]] = ()) -> TurnGuard | None:
    """The guard of one turn (None without a guard): the caller's words, the turn's tool
    results as they come (`result.tool_calls`, filled by the tool step), the database's
    open slots at each look (the tool box's store), the call's earlier (caller, agent)
    exchanges. `result.guarded` becomes its record."""
    if guard is None:
        return None
    turn = TurnGuard(guard, caller, result.tool_calls, toolbox.open_slots if toolbox is not None else None,
                     [user for user, _ in exchanges if user], getattr(toolbox, "callers_bookings", None),
                     exchanges[-1][1] if exchanges else "")
    result.guarded = turn.guarded  # the same list: filled as the turn is spoken
    return turn
