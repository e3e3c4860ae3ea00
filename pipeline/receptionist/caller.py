"""What the caller has told us about themselves, read from their own words: their name,
and whether a line only greets us.

The 1.5B model does not keep either. Told "Hi, my name is Robert." it read out every fact
of the business until its token limit, cut mid-word; asked two turns later "Can you tell
me my name, please?", it said "I'm sorry, but I don't have your name." (specvoice chat,
README "What the agent knows about the caller"). A system note with the name, placed in
the conversation, made it answer the next question with the fallback. So the call keeps
these facts in code: the fact guard knows the caller's name (guard.py, "caller's name"),
and a line that only greets, and answers no question of the agent's, is greeted back
without the model (stages/respond.py).
"""

from __future__ import annotations

import re

__all__ = ["NOT_NAME", "agent_asked", "agent_before", "asks_own_name", "caller_lines", "caller_name", "caller_phone",
           "greeting_reply", "greets_only", "only_greets", "own_reply"]

_NAME_WORD = r"[^\W\d_][\w'’-]*"
# "My name is Robert", "the name's Ann Lee", "call me Jo": what follows is the name,
# whatever its case (an STT may write it in lower case).
_NAME_IS = re.compile(rf"(?i:\b(?:my name is|my name's|the name is|the name's|name is|call me))\s+"
                      rf"(?P<name>{_NAME_WORD}(?:\s+{_NAME_WORD})?)")
# "This is Maria Lopez", "I'm Dana", "(booked) under Nora Bell": only a capitalised word is a
# name ("this is about my bill", "I'm calling about", "under my name").
_THIS_IS = re.compile(rf"(?i:\b(?:this is|i'm|i am|i’m|under(?: the name)?))\s+"
                      rf"(?P<name>[A-Z][a-z'’-]+(?:\s+[A-Z][a-z'’-]+)?)")
# Words that end a name said in lower case, or that are no name at all when capitalised; also
# what ends the name the agent says after "your name is" (guard.py: "your name is on the
# booking" names no one).
NOT_NAME = frozenset("""
and or but so i i'm calling call from with here speaking again please the a an by how what can could do does
is are was were not just looking wondering interested sorry fine good okay ok well new sure trying hoping
glad happy still also actually only going phone number at for to on in about regarding yes no my your dr
monday tuesday wednesday thursday friday saturday sunday today tomorrow under if that which as of
""".split())


_GREETING = re.compile(r"(?i:\b(?:hi|hello|hey|hiya|howdy|good (?:morning|afternoon|evening|day)|greetings)\b)")
# "Hi, it's Tom.": a name only beside a greeting ("It's Aetna." answers which insurance).
_ITS = re.compile(rf"(?i:\b(?:it's|it is|it’s))\s+(?P<name>[A-Z][a-z'’-]+(?:\s+[A-Z][a-z'’-]+)?)")


def _names_in(line: str) -> list[tuple[int, int, str]]:
    """(start, end, name) of each name given in `line`: the phrase that gives it up to the
    name's last word, and the name capitalised."""
    out = []
    for pattern in (_NAME_IS, _THIS_IS, *((_ITS,) if _GREETING.search(line) else ())):
        for m in pattern.finditer(line):
            words, end = [], m.start("name")
            for w in re.finditer(r"\S+", m.group("name")):
                if w.group().casefold().strip("'’") in NOT_NAME or re.search(r"['’]s$", w.group()):
                    break  # a possessive is no name given: "this is Tuesday's slot"
                words.append(w.group()[:1].upper() + w.group()[1:])
                end = m.start("name") + w.end()
            if words:
                out.append((m.start(), end, " ".join(words)))
    return sorted(out)


def caller_name(lines: list[str]) -> str | None:
    """The name the caller last gave in `lines` (their lines of the call, oldest first), or
    None: "my name is X" / "call me X" in any case, "this is X" / "I'm X" when X is
    capitalised; at most two words."""
    for line in reversed(lines):
        found = _names_in(line or "")
        if found:
            return found[-1][2]
    return None


# Words a greeting may come with that say nothing ("Oh hi there, Robert here", "Thanks. My
# name is Ella, by the way.": answered with the fallback by the 1.5B, specvoice chat).
_FILLER = re.compile(r"(?i:\b(?:there|again|everyone|um|uh|er|oh|well|so|speaking|here|calling|thanks|thank you|"
                     r"by the way|nice to meet you)\b)")


def only_greets(text: str) -> bool:
    """The line is a greeting, an introduction, or both, and asks or says nothing else
    ("Hi.", "Hello, this is Maria Lopez.", "Hi, my name is Robert."): there is nothing for
    the model to answer. "Yes." is no greeting: it answers the agent."""
    text = text or ""
    rest, at = "", 0
    for start, end, _ in _names_in(text):
        if start >= at:
            rest, at = rest + text[at:start] + " ", end
    rest += text[at:]
    greeted = rest != text
    rest, n = _GREETING.subn(" ", rest)
    return (greeted or n > 0) and not re.search(r"[^\W_]", _FILLER.sub(" ", rest))


# "Can you tell me my name, please?", "Do you remember my name?", "What's my name again?":
# a line that only asks for the caller's own name.
_ASKS_OWN_NAME = re.compile(
    r"\s*(?:(?:hi|hello|hey|so|okay|ok|um|uh|and)\b,?\s*)*"
    r"(?:can you tell me|could you tell me|would you tell me|tell me|do you (?:still )?(?:know|remember|have)|"
    r"what(?:'s|’s| is| was)|say|repeat)\s+(?:what\s+)?my (?:full )?name(?:\s+(?:is|was))?"
    r"(?:\s+again)?(?:,?\s*please)?\s*[?.!]*\s*", re.IGNORECASE)


def asks_own_name(text: str) -> bool:
    """The line only asks for the caller's own name."""
    return bool(_ASKS_OWN_NAME.fullmatch(text or ""))


def own_reply(text: str, messages: list[dict]) -> str | None:
    """What the agent says to `text` in its own words, without the model, or None: a
    greeting is greeted back ("Hi Robert, how can I help you today?"), and a caller who
    asks for their own name, having given it, is told it ("Your name is Robert."; the 1.5B
    said "I'm sorry, but I don't have your name.", and "I remember your name."). A name
    never given is the model's to answer (the guard lets it make none up)."""
    if greets_only(text, messages):
        return greeting_reply(caller_name([text]))
    if asks_own_name(text):
        name = caller_name(caller_lines(messages) or [text])
        if name:
            return f"Your name is {name}."
    return None


def caller_lines(messages: list[dict]) -> list[str]:
    """The caller's lines in `messages`, oldest first."""
    return [m["content"] for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]


def agent_before(messages: list[dict]) -> str:
    """The agent's last line before the caller's (what a bare "It's Marcus Brown." answers)."""
    for m in reversed(messages[:-1]):
        if m.get("role") == "user":
            return ""
        if m.get("role") == "assistant" and isinstance(m.get("content"), str) and m["content"].strip():
            return m["content"]
    return ""


# The agent's line asked the caller to choose or to give a name ("May I have your name?",
# "Which would you like?"): the caller's next line answers it.
_AGENT_ASKED = re.compile(r"\b(?:name|which|would you like|book|slot)\b[^.!]*\?", re.IGNORECASE)


def agent_asked(agent_line: str) -> bool:
    """The agent's line asked for a name or a choice."""
    return bool(_AGENT_ASKED.search(agent_line))


def greets_only(text: str, messages: list[dict]) -> bool:
    """The turn's line only greets (`only_greets`) and answers no question of the agent's:
    "My name is Leo Hart." after "May I have your name?" completes a booking (it was greeted
    back, specvoice chat with the bistro)."""
    return only_greets(text) and not agent_asked(agent_before(messages))


def greeting_reply(name: str | None) -> str:
    """What the agent says back to a line that only greets: by first name when one was given."""
    return f"Hi {name.split()[0]}, how can I help you today?" if name else "Hi, how can I help you today?"


# A phone number: 7 or more digits, with the spaces, dots, dashes and brackets people say
# or the STT writes ("555-0199", "(617) 555 0199", "+44 20 7946 0958").
_PHONE = re.compile(r"(?<![\w:(])\+?\(?\d[\d ().-]{5,}\d(?![\w:])")


def caller_phone(caller_lines: list[str]) -> str | None:
    """The last phone number the caller said in this call: the plan leaves numbers out (its
    grammar has no phone), so a booking takes it from the caller's own words, and the guard
    what the agent says the caller's number is."""
    for line in reversed(caller_lines):
        found = [m.group(0).strip() for m in _PHONE.finditer(line) if len(re.sub(r"\D", "", m.group(0))) >= 7]
        if found:
            return found[-1]
    return None
