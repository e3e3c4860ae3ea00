"""The business the agent answers for, and the system prompt built from it.

The business is the user's to configure: a `[business]` TOML section (see configs/default.toml
and the README) holds its name, who the agent is, hours, prices, open slots, other facts
and the greeting. `facts_prompt(business, layout=..., rules=..., examples=...)` turns it
into the LLM's system prompt; it is a pure function so the quality benchmark
(`specvoice bench quality`) builds every business's prompt exactly as a call does.

Why this shape (measured with `specvoice bench quality`, see the README's "Answer quality"):
the 1.5B default model states a fact most reliably when each fact stands on its own short
labelled line, when every day has its own hours line (a range like "Monday to Friday" is
easily misread, and a missing "Sunday: closed" invites "yes, we're open Sundays"), and when
the prompt says in so many words what to do with a question the facts do not answer.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

__all__ = ["DAYS", "NUMBER_WORDS", "BusinessConfig", "Example", "Layout", "day_hours", "default_business",
           "facts_prompt"]

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
# The numbers a caller or the model says as words, zero to nineteen (the guard reads figures
# with them, the plan step a party's size).
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
Layout = Literal["paragraph", "lines"]
Persona = Literal["role", "checker"]


def _not_blank(value, info, required: bool = False):
    """A field that is given must say something: an empty string, list or table is a
    mistake (a half-filled config), not a request for a default."""
    field = f"business.{info.field_name}"
    fix = "it is required" if required else "give it a value or leave the key out"
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{field} is empty; {fix}")
    if isinstance(value, (list, dict)):
        if not value:
            raise ValueError(f"{field} is empty; list at least one entry or leave the key out")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(item, str) and not item.strip():
                raise ValueError(f"{field}[{key!r}] is empty")
    return value


class Example(BaseModel):
    """One worked exchange shown to the model: a caller line and the ideal answer."""

    model_config = ConfigDict(extra="forbid")
    caller: str
    agent: str

    @field_validator("caller", "agent")
    @classmethod
    def _given(cls, value, info):
        return _not_blank(value, info, required=True)


class BusinessConfig(BaseModel):
    """`[business]`: what the agent knows. name, role and greeting are required; every
    other field is optional but, when present, must not be empty."""

    model_config = ConfigDict(extra="forbid")

    name: str  # "Riverside Dental"
    role: str  # who the agent is: "phone receptionist", "support agent"
    greeting: str  # the first thing the agent says on a call
    about: str | None = None  # what the business is: "a family dental practice"
    address: str | None = None
    phone: str | None = None
    # Label -> opening times, in order: {"Monday to Friday" = "8 a.m. to 6 p.m.", "Sunday" = "closed"}.
    hours: dict[str, str] | None = None
    # Item -> price as said: {"cleaning" = "$89", "filling" = "from $120"}.
    prices: dict[str, str] | None = None
    # Bookable times; the agent offers no others.
    open_slots: list[str] | None = None
    # Anything else the agent may say, one fact a line.
    facts: list[str] | None = None
    # What to say when the facts do not answer (default: FALLBACK, offering to take a message).
    fallback: str | None = None
    # Worked exchanges specific to this business (added to the built-in ones when examples are on).
    examples: list[Example] | None = None

    @field_validator("name", "role", "greeting")
    @classmethod
    def _required(cls, value, info):
        return _not_blank(value, info, required=True)

    @field_validator("about", "address", "phone", "hours", "prices", "open_slots", "facts", "fallback", "examples")
    @classmethod
    def _optional(cls, value, info):
        return _not_blank(value, info)


# ---------------------------------------------------------------- hours


def _day_index(word: str) -> int | None:
    w = word.strip().lower().rstrip("s")
    for i, d in enumerate(DAYS):
        if w == d.lower() or (len(w) >= 3 and d.lower().startswith(w)):
            return i
    return None


def _label_days(label: str) -> list[int] | None:
    """The weekdays a label names: "Saturday", "Monday to Friday", "Tue-Sun", "Saturday and
    Sunday", "weekdays"; None when it names something else ("Support", "Holidays")."""
    text = label.strip().lower()
    if text in ("every day", "daily", "all week"):
        return list(range(7))
    if text in ("weekdays", "weekday"):
        return list(range(5))
    if text in ("weekends", "weekend"):
        return [5, 6]
    m = re.fullmatch(r"(\w+)\s*(?:to|through|thru|-|–)\s*(\w+)", text)
    if m:
        a, b = _day_index(m.group(1)), _day_index(m.group(2))
        if a is None or b is None:
            return None
        return [(a + i) % 7 for i in range((b - a) % 7 + 1)]
    parts = [p for p in re.split(r"\s*(?:,|and|&)\s*", text) if p]
    days = [_day_index(p) for p in parts]
    return None if not days or None in days else days


def day_hours(hours: dict[str, str]) -> list[tuple[str, str]] | None:
    """One (day, hours) per weekday, Monday first, when every label names days; days no label
    covers are closed. None when a label is not a day ("Support": "24 hours a day")."""
    per_day: dict[int, str] = {}
    for label, value in hours.items():
        days = _label_days(label)
        if days is None:
            return None
        for d in days:
            per_day[d] = value
    return [(DAYS[d], per_day.get(d, "closed")) for d in range(7)]


def _is_closed(value: str) -> bool:
    return value.strip().lower() in ("closed", "closed all day", "not open")


# ---------------------------------------------------------------- the prompt

STYLE = "Answer in one to three short spoken sentences, no lists or markdown."
# What the agent says when the facts do not answer (business.fallback overrides it).
FALLBACK = "I'm not sure about that. I can take a message and have someone call you back."
# The checker opening: measured to cut false claims further, at the cost of more fallbacks.
CHECKER = ("Callers often get facts wrong; compare what they say with the facts before you agree.")


def rules_block(b: BusinessConfig, questions_only: bool = False) -> str:
    """The rules. `questions_only`: headed as rules for questions, for a prompt whose tools
    paragraph comes before them (pipeline.receptionist.prompt.system_prompt), so that a booking request
    goes to the tools rather than to the fixed sentence."""
    # A sentence to say word for word works where "say you will check" did not: the 1.5B
    # model then stops inventing prices and services. It also over-uses it (see README).
    return (("Rules for questions:" if questions_only else "Rules:") + "\n- Use only these facts.\n"
            f"- If the facts do not answer {'a' if questions_only else 'the'} question, "
            f"say: \"{b.fallback or FALLBACK}\"\n"
            "- Never agree with something the facts do not say.")


def _builtin_examples(b: BusinessConfig) -> list[Example]:
    """Worked examples filled from the business's own facts (so they never teach a false
    one): answering a price, correcting a wrong price, a closed day, and a question the
    facts do not answer. They are not questions of the quality benchmark."""
    out: list[Example] = []
    if b.prices:
        item, price = list(b.prices.items())[-1]
        out.append(Example(caller=f"How much is {item}?", agent=f"{_cap(item)} is {price}."))
        item, price = next(iter(b.prices.items()))
        wrong = _wrong_price(price)
        if wrong:
            out.append(Example(caller=f"{_cap(item)} is {wrong}, right?", agent=f"Actually, {item} is {price}."))
    closed = [d for d, v in (day_hours(b.hours) or []) if _is_closed(v)] if b.hours else []
    if closed:
        out.append(Example(caller=f"Can I come by on {closed[0]}?", agent=f"Sorry, we're closed on {closed[0]}."))
    out.append(Example(caller="Do you sell gift cards?", agent=b.fallback or FALLBACK))
    return out


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _wrong_price(price: str) -> str | None:
    """The first dollar amount of `price` doubled, as a made-up wrong figure."""
    m = re.search(r"\$(\d+(?:\.\d\d)?)", price)
    if not m:
        return None
    value = float(m.group(1)) * 2
    return f"${value:.2f}" if "." in m.group(1) else f"${value:.0f}"


def _join(items: list[str]) -> str:
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text[-1] in ".!?" else text + "."


def _paragraph_facts(b: BusinessConfig) -> str:
    """The facts as one running paragraph: how the prompts were written before this module."""
    parts = []
    if b.address:
        parts.append(f"address {b.address}.")
    if b.hours:
        parts.append("Hours: " + ", ".join(f"{k} {v}" for k, v in b.hours.items()) + ".")
    if b.prices:
        parts.append("Prices: " + ", ".join(f"{k} {v}" for k, v in b.prices.items()) + ".")
    if b.open_slots:
        parts.append("Open slots: " + ", ".join(b.open_slots) + ".")
    parts += [_sentence(f) for f in b.facts or []]
    if b.phone:
        parts.append(f"Phone {b.phone}.")
    return "Facts: " + " ".join(parts)


def _line_facts(b: BusinessConfig) -> str:
    """One labelled fact a line. Hours stay on one line as the user wrote them (one line per
    day measured worse: "Tuesday: 8 a.m." next to "Open slot: Tuesday 10:30 a.m." made the
    model offer 8 a.m. slots); each open slot gets its own line."""
    lines = []
    if b.address:
        lines.append(f"Address: {b.address}")
    if b.phone:
        lines.append(f"Phone: {b.phone}")
    if b.hours:
        lines.append("Opening hours: " + "; ".join(f"{k} {v}" for k, v in b.hours.items()))
    if b.prices:
        lines += [f"Price of {k}: {v}" for k, v in b.prices.items()]
    lines += [f"Open slot: {s}" for s in b.open_slots or []]
    lines += [f.strip().rstrip(".") for f in b.facts or []]
    return "Facts:\n" + "\n".join(f"- {line}." for line in lines)


def facts_prompt(business: BusinessConfig, layout: Layout = "lines", rules: bool = True, examples: bool = False,
                  persona: Persona = "role") -> str:
    """The system prompt for `business`.

    layout: "lines" (one labelled fact a line) or "paragraph" (one running paragraph, the
    old style). rules: only the facts; a fixed sentence to say when they do not answer
    rather than guess; never agree with what they do not say. examples: a few worked
    exchanges (built-in ones filled from the facts, plus business.examples). persona:
    "role" (the business's receptionist, host, ...) or "checker" (told that callers get
    facts wrong and to compare before agreeing).
    """
    b = business
    about = f", {b.about}" if b.about else ""
    if persona == "checker":
        who = f"You are a fact checker answering phone calls for {b.name}{about}. {CHECKER}"
    else:
        who = f"You are the {b.role} of {b.name}{about}, speaking on the phone."
    parts = [f"{who} {STYLE}", _line_facts(b) if layout == "lines" else _paragraph_facts(b)]
    if examples:
        shown = _builtin_examples(b) + list(b.examples or [])
        parts.append("Examples:\n" + "\n".join(f'Caller: "{e.caller}"\nYou: "{e.agent}"' for e in shown))
    if rules:
        parts.append(rules_block(b))
    return "\n\n".join(parts)


def default_business() -> BusinessConfig:
    """Riverside Dental, the demo business of the default config (the same facts as
    demo/data/businesses/dental.toml and the dental turns of bench/data/dialogues.json)."""
    return BusinessConfig(
        name="Riverside Dental",
        role="phone receptionist",
        about="a dental practice",
        address="42 Harbor Street, Springfield, next to the public library",
        phone="555-0142",
        hours={"Monday to Friday": "8 a.m. to 6 p.m.", "Saturday": "9 a.m. to 1 p.m.", "Sunday": "closed"},
        prices={"cleaning": "$89", "check-up": "$59", "whitening": "$249", "filling": "from $120"},
        open_slots=["Tuesday 10:30 a.m. with Dr. Patel", "Wednesday 2:15 p.m. with Dr. Moreno",
                    "Friday 9:00 a.m. with Dr. Patel"],
        facts=["Dentists: Dr. Priya Patel and Dr. Luis Moreno", "Insurance: we accept Delta Dental and Aetna",
               "Parking is free behind the building"],
        greeting="Riverside Dental, how can I help you today?",
    )
