"""The turn plan: what the caller's turn asks for, decided as one constrained line before
the agent says anything, then acted on through the database.

A turn's one generation starts with the plan, then (for a question) the answer:

    {"act": "answer"}
    We're open Saturday from 9 a.m. to 1 p.m.

    {"act": "book", "slot": "Tuesday 10:30 a.m. with Dr. Patel", "name": "Ann Lee"}

    {"act": "move", "slot": "Friday 9:00 a.m. with Dr. Patel", "name": "Ann Lee"}

The grammar (`plan_grammar`, a Lark grammar for llm.types.Constraint.grammar) makes any
other first line impossible: the acts are an enum, a slot is one of the database's open
slots at that moment (cancel: one of its slots), a name and a message are short strings.
Everything but the act's first token, the slot's first token, a name and a message is
forced by the grammar, so the engine drafts it for free (llm/constrain.py). A question's
answer follows the plan in the same generation (no second prompt, no second prefill:
what the plan adds to a plain question is its few tokens); an action's plan ends the
generation, the database does it (`act`), and the caller hears a sentence built from the
database's result (`Outcome.line`), never a claim the database did not back: a slot
taken between the plan and the booking is refused by the database's unique index, and
the line says so and offers the slots that are open now.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pipeline.receptionist.business import DAYS, NUMBER_WORDS
from pipeline.receptionist.bookings import same_name
from pipeline.receptionist.caller import NOT_NAME, agent_asked, caller_phone
from pipeline.receptionist.tools import stays_done

__all__ = ["ACTS", "ANSWER_LINE", "ANSWER_ONLY_GRAMMAR", "OTHER_SLOT", "Outcome", "Plan", "PlanParse", "act", "allowed_acts", "clean_name",
           "parse_plan", "plan_grammar", "plan_prompt", "plan_slots"]

# The acts, in the order the prompt lists them. "answer": a question, answered from the facts.
# "move": a caller who changes their mind; the booking they made is cancelled once the new
# slot is booked (never before: a refused booking leaves them the one they had).
ACTS = ("answer", "book", "move", "cancel", "message", "transfer", "end_call")
OTHER_SLOT = "another time"  # the caller asked for a time the database does not have


@dataclass(frozen=True)
class Plan:
    act: str
    slot: str = ""
    name: str = ""
    message: str = ""


def _lark_string(value: str) -> str:
    """A Lark literal that matches `value` written as a JSON string (its quotes included)."""
    return json.dumps(json.dumps(value, ensure_ascii=False), ensure_ascii=False)


def _alternatives(values: list[str]) -> str:
    return " | ".join(_lark_string(v) for v in dict.fromkeys(values))


def plan_slots(store: Any) -> tuple[list[str], list[str]]:
    """What a plan may name, read from the database now: (the open slots, every active
    slot); `plan_grammar` takes both. Synchronous: run it in a thread on a call."""
    return store.open_slots(), [s.label for s in store.slots(only_open=False) if s.active]


# The answer plan's line, as a turn that may only answer starts (`allowed_acts`): the prompt
# ends with it where the backend can start a reply (LLMBackend.prefills), else the grammar
# below forces it.
ANSWER_LINE = '{"act": "answer"}\n'
_ANSWER_TEXT = 'ANSWER: /(.|\\n)+/'  # the answer after its line: free text

# Each act's line in the grammar (Lark): the plan as the model writes it.
_ACT_RULES = {
    "answer": json.dumps(ANSWER_LINE) + " ANSWER",
    "book": '"{\\"act\\": \\"book\\", \\"slot\\": " SLOT ", \\"name\\": " NAME "}"',
    "move": '"{\\"act\\": \\"move\\", \\"slot\\": " SLOT ", \\"name\\": " NAME "}"',
    "cancel": '"{\\"act\\": \\"cancel\\", \\"slot\\": " SLOT ", \\"name\\": " NAME "}"',
    "message": '"{\\"act\\": \\"message\\", \\"name\\": " NAME ", \\"message\\": " MESSAGE "}"',
    "transfer": '"{\\"act\\": \\"transfer\\"}"',
    "end_call": '"{\\"act\\": \\"end_call\\"}"',
}
ANSWER_ONLY_GRAMMAR = f"start: {_ACT_RULES['answer']}\n{_ANSWER_TEXT}\n"


def plan_grammar(open_slots: list[str], all_slots: list[str], acts: tuple[str, ...] = ACTS) -> str:
    """The Lark grammar of a turn's output: the plan line, then free text after an answer
    plan. `acts`: the acts this turn may take (`allowed_acts`); the others cannot be
    written. A slot is one of the database's slots (`all_slots`, the open ones first) or
    OTHER_SLOT, for a time it does not have. Why not only the open ones: with Tuesday
    taken, "the Tuesday slot please" had the 1.5B forced into Wednesday and booked it
    (`specvoice chat`, the default pair); with Tuesday in the enum the database refuses
    it and the caller is told so and offered the open ones (`act`)."""
    unknown = set(acts) - set(ACTS)
    if unknown or "answer" not in acts:
        raise ValueError(f"acts must include 'answer' and come from {ACTS}; got {acts}")
    slots = list(dict.fromkeys([*open_slots, *all_slots]))
    lines = ["start: " + "\n     | ".join(_ACT_RULES[a] for a in ACTS if a in acts),
             _ANSWER_TEXT,
             # No quote, backslash or control character: the value is a JSON string as written.
             # No length bound in the grammar: "{0,40}" made llguidance's lexer give up
             # (ParserTooComplex) mid-name on the 1.5B's vocabulary (bench tools); the
             # turn's token budget bounds it, and act() refuses a name the caller never said.
             'NAME: /"[^"\\\\\\x00-\\x1f]*"/',
             'MESSAGE: /"[^"\\\\\\x00-\\x1f]+"/']
    lines.append(f"SLOT: {_alternatives([*slots, OTHER_SLOT])}")
    return "\n".join(lines) + "\n"


def plan_prompt(open_slots: list[str]) -> str:
    """The system prompt's paragraph that says how a reply starts (the grammar makes it so;
    this tells the model what each act means, once, in the warmed prompt)."""
    slot = open_slots[0] if open_slots else "Monday 9:00 a.m."
    return ("Every reply starts with a plan on its own line, then the answer if there is one:\n"
            '- a question: {"act": "answer"} then the answer on the next line\n'
            f'- to book a slot: {{"act": "book", "slot": "{slot}", "name": "<the caller\'s name>"}}'
            f' (a time not among the slots: "slot": "{OTHER_SLOT}")\n'
            f'- to move the caller\'s booking to another slot: {{"act": "move", "slot": "<the new slot>", "name": "<the name it is under>"}}\n'
            f'- to cancel a booking: {{"act": "cancel", "slot": "{slot}", "name": "<the name it is under>"}}\n'
            '- to leave a message for the staff: {"act": "message", "name": "<name>", "message": "<the message>"}\n'
            '- to speak to a person: {"act": "transfer"}\n'
            '- when the caller says goodbye: {"act": "end_call"}\n'
            "Only book, cancel or take a message when the caller asks for it.")


@dataclass(frozen=True)
class PlanParse:
    plan: Plan | None  # None: no plan line (a backend that could not be constrained)
    answer: str  # the text after an answer plan's line
    error: str | None = None


def parse_plan(text: str) -> PlanParse:
    """A turn's output -> its plan and answer. Never raises: output without a valid plan
    line is all answer (a server that ignored the constraint), with the reason."""
    head, newline, rest = text.partition("\n")
    try:
        data = json.loads(head)
    except ValueError:
        return PlanParse(None, text, "no plan line")
    if not isinstance(data, dict) or data.get("act") not in ACTS:
        return PlanParse(None, text, f"not a plan: {head[:80]!r}")
    values = {k: data.get(k, "") for k in ("slot", "name", "message")}
    if not all(isinstance(v, str) for v in values.values()):
        return PlanParse(None, text, f"not a plan: {head[:80]!r}")
    plan = Plan(data["act"], **{k: v.strip() for k, v in values.items()})
    return PlanParse(plan, rest if plan.act == "answer" else "")


@dataclass
class Outcome:
    """What the database did for a plan, and the sentence the caller hears about it."""

    line: str  # built from the result, never from the model's words
    calls: list[Any] = field(default_factory=list)  # ToolOutcome of each tool run
    action: str | None = None  # "transfer" / "end_call": the call acts after this turn
    reason: str | None = None

    @property
    def stays_done(self) -> bool:
        """Whether it changed something the caller would have to undo: a booking, a
        cancellation or a message written, or a transfer or hang-up to come. Asking for a
        name, reading the slots or a refusal changes nothing."""
        return self.action is not None or any(stays_done(c.name, c.ok, c.action) for c in self.calls)


_WORD = r"[^\W\d_]+(?:['’-][^\W\d_]+)*"
# Letters said one by one: "J O N N Y", "S-M-Y-T-H-E", "J. O. N."
_SPELLED = re.compile(r"(?<![^\W\d_])(?<!['’])(?:[^\W\d_][.]?[\s-]+){2,}[^\W\d_]\.?(?![^\W\d_])")


def clean_name(name: str) -> str:
    """A name as the 1.5B writes it after a caller spelled it out ("J O N N Y, Smythe,
    S M Y T H E" -> "Jonny Smythe", bench tools): each letter-by-letter run becomes a word,
    and a word both said and spelled is kept once. A name with no spelled run is kept as
    written."""
    if not _SPELLED.search(name):
        return name
    joined = _SPELLED.sub(lambda m: re.sub(r"[\s.-]", "", m.group(0)).capitalize(), name)
    words: list[str] = []
    for w in re.findall(_WORD, joined):
        if not words or words[-1].casefold() != w.casefold():
            words.append(w)
    return " ".join(words)


def said_by_caller(name: str, caller_lines: list[str]) -> bool:
    """Every word of `name` is a word the caller said (or spelled). The 1.5B fills a name it
    was not given ("John Doe", "Jane Smith", the prompt's own "<the caller's name>": bench
    tools); such a name is asked for instead of booked."""
    spelled = [re.sub(r"[\s.-]", "", m.group(0)) for line in caller_lines for m in _SPELLED.finditer(line)]
    said = {w.lower() for line in [*caller_lines, *spelled] for w in re.findall(_WORD, line)}
    words = re.findall(_WORD, name)
    return bool(words) and all(w.lower() in said for w in words)


# A transfer the caller asked for: a request to speak to someone, or for a person ("It's
# Marcus Brown." planned as a transfer by the 1.5B hung up on a caller mid-booking: bench
# tools). Naming who works there is a question, not a request: "Which dentists work at
# the clinic" planned as a transfer ended a call (bench pipeline).
_ASKS_FOR_A_PERSON = re.compile(
    r"\b(?:transfer|put me through|connect me|speak (?:to|with)|talk (?:to|with)|get me (?:a|the|someone)|"
    r"(?:a|an|the) (?:real |live |actual )?(?:person|human|operator|receptionist|manager)|someone (?:real|there)|"
    r"somebody|real person)\b", re.IGNORECASE)


# A message the caller asked for ("I'll call back next week", planned as a message by the
# 1.5B, left the staff a note nobody wanted: bench tools).
_ASKS_FOR_A_MESSAGE = re.compile(
    r"\b(?:message|note|call me|ring me|get back to me|reach me|contact me|let (?:him|her|them|the \w+|dr\.? \w+) know|"
    r"tell (?:him|her|them|the|dr)|pass (?:it|this|that) on|have (?:him|her|them|someone|somebody|the \w+) call)\b",
    re.IGNORECASE)


# A booking, cancellation or move asked for in words ("I'd like to book", "can I come in",
# "cancel that", "actually, Friday").
_ASKS_TO_BOOK = re.compile(
    r"\b(?:(?:re)?book\w*|appointments?|reserv\w*|(?:re)?schedul\w*|come in|get (?:me )?in|fit me in|sign me up|put me down|"
    r"i'?d like|i would like|i want|i'?ll take|let'?s do|go with|(?:can|could|may) (?:i|we) (?:get|have|take|come)|"
    r"cancel\w*|move|change|switch|instead|actually|i meant)\b", re.IGNORECASE)
# A caller who agrees to or completes what the agent offered ("Yes, Friday please", "Okay,
# the Tuesday one then", "My name is Ivy Chen"): an action only when it is not a question.
_AGREES = re.compile(
    r"\b(?:yes|yeah|yep|sure|ok|okay|alright|all right|please|great|perfect|fine|sounds good|works|"
    r"my name|name is|name's|the name)\b", re.IGNORECASE)
# A booking the caller already has ("I booked a check-up last week", "When is my
# appointment?"): named to ask about it, not to ask for one. "Hello, I booked a check-up last
# week under Nora Bell. When is it?" was planned as a booking, and booked (specvoice chat).
_HAS_A_BOOKING = re.compile(
    r"\b(?:i|i've|i have|we|we've|we have|already)\s+(?:already\s+)?(?:booked|scheduled|reserved|made)\b|"
    r"\b(?:my|our|that|this)\s+(?:\w+\s+)?(?:booking|appointment|reservation)s?\b", re.IGNORECASE)


def _asks_to_book(text: str) -> bool:
    """A booking word in `text` that is not the caller naming a booking they have."""
    return bool(_ASKS_TO_BOOK.search(_HAS_A_BOOKING.sub(" ", text)))


# A day or a time of day, as a caller picks a slot ("Wednesday then", "the 9 a.m. one").
_NAMES_A_TIME = re.compile(r"\b(?:monday|tuesday|wednesday|thursday|friday|saturday|sunday|tomorrow|morning|afternoon|"
                           r"evening|\d{1,2}(?::\d\d)? ?(?:a\.?m\b\.?|p\.?m\b\.?|o'clock))", re.IGNORECASE)
# A line that is only a name ("Sam Reed.", "It's Sam Reed.", "Under Sam Reed."): capitalised,
# as an STT writes a name, one or two words that are none of the words a short reply is made
# of. Said after asking to book, it is the name to book under: "Sam Reed." after "What
# about Friday then?" was answered "Sam Reed, please call back when you're ready." (specvoice
# chat: the plan allowed no booking).
_ONLY_A_NAME = re.compile(r"\s*(?:(?:it's|it is|it’s|under|the name is|name's)\s+)?"
                          r"(?P<name>[A-Z][a-z'’-]+(?:\s+[A-Z][a-z'’-]+)?)\s*[.!]?\s*", re.IGNORECASE)
_NOT_A_NAME_REPLY = NOT_NAME | frozenset("""thanks thank you great perfect bye goodbye hello hi hey right alright cool
    nice done then that sounds works excellent wonderful lovely cheers""".split())


def _only_a_name(text: str) -> bool:
    m = _ONLY_A_NAME.fullmatch(text or "")
    return bool(m) and m.group("name")[:1].isupper() and not any(
        w.casefold() in _NOT_A_NAME_REPLY for w in m.group("name").split())


# "Do you have a table for four tonight?": asking for a table is asking to book one; "So you
# have a table for two at 7, right?" checks a claim (answered, bench quality).
_ASKS_FOR_A_TABLE = re.compile(r"\btable for\b", re.IGNORECASE)
_CHECKS_A_CLAIM = re.compile(r"\b(?:right|correct|true|isn't it|aren't you|don't you|didn't you)\s*\?", re.IGNORECASE)
_GOODBYE = re.compile(
    r"\b(?:bye|goodbye|good night|that'?s all|that is all|that'?s it|that'?s everything|nothing else|hang up|"
    r"thanks|thank you|call (?:back|again)|another time|have a (?:good|nice|great))\b", re.IGNORECASE)


def allowed_acts(caller_text: str, caller_lines: list[str] | None = None, agent_before: str = "") -> tuple[str, ...]:
    """The acts this turn may take, from what the caller said: an action only when their
    words ask for it. The plan's grammar holds only these (`plan_grammar`), so the 1.5B
    cannot book, take a message or transfer where the caller asked a question: it did,
    for "Yes, what times do you have?" (booked), "So you have a table for two at 7,
    right?" (booked 7:45), "When will it be fixed?" (a message), "Once you get it back,
    when do I get my money?" (a transfer), bench quality. A turn left with "answer" alone
    starts with the answer plan's line as given (ANSWER_LINE: in the prompt, or forced by
    ANSWER_ONLY_GRAMMAR), and no slot is read (stages/plan_step.py).

    Booking acts: a booking word, or (not a question) an agreement or a name, or a bare
    reply to the agent's question of a name or a choice, or a day or time named, or a line
    that is only a name, in a call whose caller asked to book, cancel or move before
    ("Wednesday then.", "It's under Sam Reed, on Friday.": answered with the services and
    with "the next available slot for Sam Reed", specvoice chat, where the caller was
    choosing and cancelling; "Sam Reed."). A message: asked
    for on this line or the one before (as `act` checks). A transfer: a person asked for. Ending the
    call: a goodbye ("That's all, thank you"). Not any line without a question mark: STT
    drops them, and a misheard "Which dentists work at the clinic?" ("Which then this is
    where Captain O'Clute.") ended a call of `bench pipeline` with lines still to say."""
    lines = caller_lines if caller_lines is not None else [caller_text]
    question = "?" in caller_text
    acts = ["answer"]
    if _asks_to_book(caller_text) or (_ASKS_FOR_A_TABLE.search(caller_text) and not _CHECKS_A_CLAIM.search(
            caller_text)) or (not question and (_AGREES.search(caller_text) or agent_asked(agent_before) or (
            (_NAMES_A_TIME.search(caller_text) or _only_a_name(caller_text))
            and any(_asks_to_book(x) for x in lines[:-1])))):
        acts += ["book", "move", "cancel"]
    if _ASKS_FOR_A_MESSAGE.search(" ".join([*lines[-2:], caller_text])):
        acts.append("message")
    if _ASKS_FOR_A_PERSON.search(caller_text):
        acts.append("transfer")
    if _GOODBYE.search(caller_text):
        acts.append("end_call")
    return tuple(acts)


def act(plan: Plan, toolbox: Any, caller_text: str = "", caller_lines: list[str] | None = None,
        agent_line: str = "") -> Outcome:
    """Do what `plan` asks through the call's ToolBox (pipeline/receptionist/tools.py; synchronous:
    run it in a thread) and say what the database did. Never raises. `caller_lines`: all
    the caller said in this call (this turn's last); a name must come from them, and a
    booked slot must be one the caller chose (named in them, or offered in `agent_line`,
    the agent's line before this turn)."""
    store = toolbox.store
    lines = caller_lines if caller_lines is not None else [caller_text]
    if plan.name:
        name = clean_name(plan.name)
        plan = Plan(plan.act, plan.slot, name if said_by_caller(name, lines) else "", plan.message)
    if plan.act in ("book", "move", "cancel") and plan.slot == OTHER_SLOT:
        return Outcome(_not_a_slot(store, "cancel" if plan.act == "cancel" else "book"))
    if plan.act in ("book", "move"):
        return _book(plan, toolbox, caller_text, lines, agent_line)
    if plan.act == "cancel":
        if not plan.name:
            return Outcome("What name is the booking under?")
        held = _held(toolbox, plan.name)
        if held and not any(_same_slot(b.slot, plan.slot) for b in held) and _CHANGE.search(caller_text):
            # "Can you cancel that? Friday would suit me better": the slot named is the one
            # wanted, not the one to cancel (bench tools, the 1.5B).
            return _book(Plan("move", plan.slot, plan.name), toolbox, caller_text, lines)
        o = toolbox.run("cancel_booking", {"slot": plan.slot, "name": plan.name})
        if o.ok:
            return Outcome(f"Your booking for {o.result['slot']} is cancelled.", [o])
        return Outcome(f"I couldn't find a booking for {plan.slot} under the name {plan.name}.", [o])
    if plan.act == "message":
        if not _ASKS_FOR_A_MESSAGE.search(" ".join([*lines[-2:], caller_text])):  # this line or the one before
            return Outcome("Would you like me to take a message?")
        if not plan.name:
            return Outcome("Sure, I can take a message. May I have your name?")
        arguments = {"name": plan.name, "text": plan.message or caller_text}
        phone = caller_phone(lines)
        if phone:
            arguments["callback"] = phone
        o = toolbox.run("take_message", arguments)
        if o.ok:
            return Outcome("I've taken your message, and someone will call you back.", [o])
        return Outcome("Sorry, I couldn't take the message just now. Please call again later.", [o])
    if plan.act == "transfer":
        if not _ASKS_FOR_A_PERSON.search(caller_text):
            return Outcome("Would you like me to put you through to a person?")
        o = toolbox.run("transfer_to_human", {"reason": (caller_text or "the caller asked for a person")[:200]})
        if o.ok:
            return Outcome("Let me transfer you now.", [o], o.action, o.reason)
        return Outcome("Sorry, nobody can take the call right now. I can take a message instead.", [o])
    if plan.act == "end_call":
        o = toolbox.run("end_call", {})
        return Outcome("Goodbye.", [o], o.action if o.ok else None)
    raise ValueError(f"act() is for actions; {plan.act!r} is answered by the model")


# Words of a caller who changes their mind ("Actually, Friday would be better").
_CHANGE = re.compile(r"\b(?:actually|instead|change|move|switch|rather|better|reschedule|prefer)\b", re.IGNORECASE)


def _same_slot(a: str, b: str) -> bool:
    return " ".join(a.casefold().split()) == " ".join(b.casefold().split())


def _held(toolbox: Any, name: str, any_call: bool = False) -> list[Any]:
    """This call's active bookings under `name`: what a caller who changes their mind means
    by "it" or "that". `any_call`: those made on earlier calls too."""
    try:
        rows, call_id = toolbox.store.bookings(include_cancelled=False), toolbox.call_id
    except Exception:  # the database is down: book_slot will say so
        return []
    return [b for b in rows if (any_call or b.call_id == call_id) and same_name(b.name, name)]


# A day a caller names: a weekday ("Tuesdays" too), or tonight / tomorrow (the bistro's slots).
_DAY_WORD = re.compile(r"\b(" + "|".join(DAYS) + r"|tonight|tomorrow)s?\b", re.IGNORECASE)


def _days_named(text: str) -> list[str]:
    """The days `text` names, in order, as the slots write them ("tuesdays" -> "Tuesday",
    "Tonight" -> "tonight")."""
    return [next((d for d in DAYS if d.casefold() == w.casefold()), w.casefold()) for w in _DAY_WORD.findall(text)]


def _book(plan: Plan, toolbox: Any, caller_text: str, lines: list[str], agent_line: str = "") -> Outcome:
    """Book `plan.slot`; for a move (or a second booking asked for with "actually",
    "instead"...), cancel the booking this call made under the name, after the new one
    succeeded, so that a refused slot leaves the caller what they had."""
    named = [d for d in _days_named(caller_text) if d in DAYS]
    day = next((d for d in DAYS if plan.slot.startswith(d)), None)
    if named and day is not None and day not in named:
        # The caller asked for a day the slot is not on ("Monday at 9", no Monday slot):
        # the 1.5B planned the nearest slot there is (bench tools); offer, do not book.
        return Outcome(_not_a_slot(toolbox.store, "book"))
    asked, doctor = _doctors_asked(caller_text, toolbox.store), _slot_doctor(plan.slot)
    if asked and doctor and doctor not in asked:
        # "I'd like to book with Dr. Moreno on Tuesday." was offered "Tuesday 10:30 a.m. with
        # Dr. Patel" (specvoice chat): the doctor the caller asked for is theirs to give up.
        return Outcome(_doctor_slots(toolbox.store, asked))
    party, seats = _party([*lines, caller_text]), _seats(plan.slot)
    if party and seats and party > seats:
        # "Do you have a table for four tomorrow?" was offered, then booked, "tomorrow 9:00
        # p.m., a table for 2" (specvoice chat, bistro): a table too small is offered away.
        return Outcome(_seating(toolbox.store, party, [*lines, caller_text]))
    if not _chosen(plan.slot, [*lines, caller_text], agent_line):
        # "I'd like to book a cleaning." was booked into the first slot, and "Tell him I need
        # to move my appointment." (a message) into another (specvoice chat): a slot the
        # caller did not name, nor was offered, is offered, not booked.
        return Outcome(_offer(toolbox.store))
    if not plan.name:
        return Outcome(f"I can book {plan.slot} for you. May I have your name?")
    held = _held(toolbox, plan.name)
    if any(_same_slot(b.slot, plan.slot) for b in _held(toolbox, plan.name, any_call=True)):
        # Theirs already, from this call or an earlier one ("It's under Sam Reed, on Friday",
        # planned as a move to Friday, was told Friday "is no longer available": specvoice chat).
        return Outcome(f"You have {plan.slot} already, under the name {plan.name}.")
    moving = held if plan.act == "move" or _CHANGE.search(caller_text) else []
    arguments = {"slot": plan.slot, "name": plan.name}
    phone = caller_phone(lines)
    if phone:
        arguments["phone"] = phone
    o = toolbox.run("book_slot", arguments)
    if not o.ok:
        return Outcome(_refused(plan.slot, toolbox.store), [o])
    booked = f"you're booked for {o.result['slot']}, under the name {o.result['name']}."
    if len(moving) != 1:  # none, or several: which one to drop is the caller's to say
        return Outcome(booked[0].upper() + booked[1:], [o])
    c = toolbox.run("cancel_booking", {"slot": moving[0].slot, "name": moving[0].name})
    if not c.ok:
        return Outcome(f"{booked[0].upper() + booked[1:]} Your booking for {moving[0].slot} is still there.", [o, c])
    return Outcome(f"Your booking for {c.result['slot']} is cancelled, and {booked}", [o, c])


def _chosen(slot: str, caller_lines: list[str], agent_line: str) -> bool:
    """The caller chose `slot`: its day or its time is in their words this call, or in the
    agent's line they answer ("I can book Wednesday 2:15 p.m. for you. May I have your name?")."""
    said = " ".join([*caller_lines, agent_line]).casefold()
    day = slot.split()[0].casefold() if slot.split() else ""
    time_ = re.search(r"\d{1,2}(?::\d\d)?", slot)
    hour = time_.group(0).removesuffix(":00") if time_ else None
    return bool(day and re.search(rf"\b{re.escape(day)}", said)) or bool(
        hour and re.search(rf"(?<![\d:]){re.escape(hour)}(?![\d])", said))


_COUNT_WORDS = {w: i for i, w in enumerate((*NUMBER_WORDS, "twenty"))}
# A count, not a time ("something for 8 pm", "a table for 7:30", "for 8 o'clock").
_COUNT = r"(\d{1,2}|" + "|".join(_COUNT_WORDS) + r")(?!\s*(?:[ap]\.?\s?m\b|:|o'?clock|in the|at night))"
# How many the caller books for: "a table for four", "for 6 people", "a party of twelve",
# "we'll be three", "there are 5 of us".
_PARTY = re.compile(rf"\b(?:(?:table|reservation|booking|room|party|something|anything) for {_COUNT}\b|"
                    rf"party of {_COUNT}\b|for {_COUNT} (?:people|persons|guests|adults|of us)\b|"
                    rf"(?:we(?:'re| are|'ll be| will be)|there(?:'re| are|'ll be| will be)) {_COUNT}\b)", re.IGNORECASE)


def _party(caller_lines: list[str]) -> int | None:
    """The party size the caller last named this call (None: none)."""
    found = [next(g for g in m.groups() if g) for line in caller_lines for m in _PARTY.finditer(line)]
    if not found:
        return None
    last = found[-1].casefold()
    return int(last) if last.isdigit() else _COUNT_WORDS[last]


def _seats(slot: str) -> int | None:
    """How many a slot is for, when its label says ("tonight 6:30 p.m., a table for 2")."""
    m = re.search(r"\bfor (\d{1,2})\b", slot)
    return int(m.group(1)) if m else None


def _seating(store: Any, party: int, caller_lines: list[str]) -> str:
    """The open slots that seat `party` (those that say how many they are for), to choose
    from: on the day the caller last named, when some are."""
    try:
        slots = [x for x in store.open_slots() if (_seats(x) or party) >= party]
    except Exception:  # the database is down: offer nothing we cannot stand behind
        slots = []
    if not slots:
        return f"Sorry, no open slot has room for {party}. I can take a message instead."
    days = [d for line in caller_lines for d in _days_named(line)]
    on_day = [x for x in slots if days and x.split()[0].casefold() == days[-1].casefold()]
    return f"For {party}, the open slots are: " + "; ".join(on_day or slots) + ". Which would you like?"


_SLOT_DOCTOR = re.compile(r"\bwith Dr\.? (\w+)", re.IGNORECASE)


def _slot_doctor(slot: str) -> str | None:
    m = _SLOT_DOCTOR.search(slot)
    return m.group(1).casefold() if m else None


def _doctors_asked(text: str, store: Any) -> set[str]:
    """The doctors `text` asks for by name ("with Dr. Moreno", "Doctor Patel"), of those the
    slots name (open or not); empty when it names none."""
    try:
        known = {d for x in store.slots(only_open=False) if x.active and (d := _slot_doctor(x.label))}
    except Exception:  # the database is down: book_slot will say so
        return set()
    return {m.casefold() for m in re.findall(r"\b(?:dr\.?|doctor) (\w+)", text, re.IGNORECASE)} & known


def _doctor_slots(store: Any, doctors: set[str]) -> str:
    """The open slots of the doctors the caller asked for, to choose from."""
    try:
        slots = [x for x in store.open_slots() if _slot_doctor(x) in doctors]
    except Exception:
        slots = []
    names = " or ".join(f"Dr. {d.capitalize()}" for d in sorted(doctors))
    if not slots:
        return f"Sorry, {names} has no open slot right now. I can take a message instead."
    return f"{names} has these open slots: " + "; ".join(slots) + ". Which would you like?"


def _offer(store: Any) -> str:
    """The open slots, to choose from (or a message, when none is open)."""
    try:
        slots = store.open_slots()
    except Exception:  # the database is down: book_slot would say so; offer nothing we cannot stand behind
        slots = []
    if not slots:
        return "Sorry, no slot is open right now. I can take a message instead."
    return "The open slots are: " + "; ".join(slots) + ". Which would you like?"


def _not_a_slot(store: Any, act_: str) -> str:
    try:
        others = store.open_slots()
    except Exception:
        others = []
    if act_ == "cancel":
        return "Which booking would you like to cancel? Please tell me its day and time."
    if not others:
        return "Sorry, we don't have that time, and no slot is open right now. I can take a message instead."
    return "Sorry, we don't have that time. The open slots are: " + "; ".join(others) + "."


def _refused(slot: str, store: Any) -> str:
    """The database refused the booking (taken a moment ago, by another caller perhaps):
    say so, and offer what is open now."""
    try:
        others = store.open_slots()
    except Exception:  # the database is down: no offer we could stand behind
        others = []
    if not others:
        return f"Sorry, {slot} is no longer available, and no other slot is open. I can take a message instead."
    offer = others[0] if len(others) == 1 else f"{others[0]}, or {others[1]}"
    return f"Sorry, {slot} was just taken. I can offer {offer}. Which would you like?"
