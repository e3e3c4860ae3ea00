"""The turn plan (pipeline/receptionist/plan.py, pipeline/stages/plan_step.py): its grammar, parsing,
acting through the real ToolBox on SQLite, and a whole plan turn through the respond
stage with a scripted backend (what the model writes is scripted; what the database and
the turn do with it is real). A slot taken between the plan and the booking is refused
by the database and the caller is offered another."""

from __future__ import annotations

import asyncio
import json

import pytest

from callfakes import ScriptedBackend
from llm.types import SamplingParams
from pipeline.receptionist.bookings import open_store
from pipeline.receptionist.plan import (ANSWER_ONLY_GRAMMAR, OTHER_SLOT, Plan, _party, act, allowed_acts, parse_plan,
                                        plan_grammar)
from pipeline.stages.plan_step import PlanFilter
from pipeline.stages.respond import respond
from pipeline.timeline import TurnTimeline
from pipeline.receptionist.tools import ToolBox
from pipeline.turn import LLMResult, Reply

SLOTS = ["Tuesday 10:30 a.m. with Dr. Patel", "Wednesday 2:15 p.m. with Dr. Moreno", "Friday 9:00 a.m. with Dr. Patel"]


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "b.sqlite", open_slots=SLOTS)
    yield s
    s.close()


def plan_line(act_: str, **fields) -> str:
    return json.dumps({"act": act_, **fields})


def slot_rule(grammar: str) -> list[str]:
    """The slot values the grammar allows, in order."""
    rule = next(line for line in grammar.splitlines() if line.startswith("SLOT:"))
    return [json.loads(json.loads(alt)) for alt in rule.removeprefix("SLOT:").split(" | ")]


def test_grammar_slots_are_the_databases_open_ones_first_then_another_time():
    assert slot_rule(plan_grammar(SLOTS[1:], SLOTS)) == [SLOTS[1], SLOTS[2], SLOTS[0], OTHER_SLOT]
    assert slot_rule(plan_grammar([], [])) == [OTHER_SLOT]


@pytest.mark.parametrize("text, plan, answer", [
    ('{"act": "answer"}\nWe open at 8 a.m.', Plan("answer"), "We open at 8 a.m."),
    (plan_line("book", slot=SLOTS[0], name="Ann Lee"), Plan("book", SLOTS[0], "Ann Lee"), ""),
    (plan_line("cancel", slot=SLOTS[2], name=" Bo "), Plan("cancel", SLOTS[2], "Bo"), ""),
    (plan_line("message", name="Cy", message="Call me back"), Plan("message", name="Cy", message="Call me back"), ""),
    (plan_line("transfer"), Plan("transfer"), ""),
    (plan_line("end_call"), Plan("end_call"), ""),
])
def test_parse_plan(text, plan, answer):
    parse = parse_plan(text)
    assert parse.plan == plan and parse.answer == answer and parse.error is None


@pytest.mark.parametrize("text", ["We open at 8.", '{"act": "dance"}', '{"act": "book", "slot": 3}', "[1]"])
def test_output_without_a_plan_is_all_answer(text):
    parse = parse_plan(text)
    assert parse.plan is None and parse.answer == text and parse.error


def test_plan_filter_speaks_only_the_answer_however_it_is_split():
    text = '{"act": "answer"}\nWe open at 8. Bye.'
    for step in (1, 2, 5, len(text)):
        f = PlanFilter()
        said = "".join(f.feed(text[i:i + step]) for i in range(0, len(text), step)) + f.finish()[0]
        assert said == "We open at 8. Bye." and f.act == "answer" and not f.holding
    f = PlanFilter()
    assert f.feed('{"act": "bo') == "" and not f.holding
    assert f.feed('ok", "slot": "Tue') == "" and f.holding and f.act == "book"
    assert f.feed('sday"}') == "" and f.finish()[0] == ""
    f = PlanFilter()  # ending the call: no hold line ("One moment, please. Goodbye.", specvoice chat)
    assert f.feed('{"act": "end_call"') == "" and f.act == "end_call" and not f.holding
    f = PlanFilter()  # a backend that ignored the constraint: all of it is the answer
    assert f.feed("We open ") + f.feed("at 8.") + f.finish()[0] == "We open at 8."
    # A plan line the model began after its answer ends the answer: "UPS" was held back whole
    # as markup with it, and the caller heard the fallback (specvoice chat, shop).
    text = '{"act": "answer"}\nUPS\n\n{"act": "end_call"}'
    for step in (1, 3, len(text)):
        f = PlanFilter()
        said = "".join(f.feed(text[i:i + step]) for i in range(0, len(text), step)) + f.finish()[0]
        assert said.strip() == "UPS", step


CALLER = "Hi, this is Ann Lee: Tuesday at 10:30, please, and my friend Cy wants to leave a message."


def test_act_books_cancels_takes_messages(store):
    box = ToolBox(store, "call-p")
    o = act(Plan("book", SLOTS[0], "Ann Lee"), box, CALLER)
    assert o.line == f"You're booked for {SLOTS[0]}, under the name Ann Lee." and o.calls[0].ok
    assert [(b.slot, b.name) for b in store.bookings()] == [(SLOTS[0], "Ann Lee")]
    o = act(Plan("cancel", SLOTS[0], "ann lee"), box, CALLER)
    assert o.line == f"Your booking for {SLOTS[0]} is cancelled." and store.bookings(include_cancelled=False) == []
    o = act(Plan("cancel", SLOTS[1], "Ann Lee"), box, CALLER)
    assert not o.calls[0].ok and o.line.startswith("I couldn't find a booking")
    o = act(Plan("message", name="Cy", message="Call me about my filling"), box, CALLER)
    assert o.line.startswith("I've taken your message") and store.messages()[0].text == "Call me about my filling"
    o = act(Plan("book", SLOTS[0], ""), box, CALLER)  # no name yet: ask, book nothing
    assert o.calls == [] and "name" in o.line and store.bookings(include_cancelled=False) == []


@pytest.mark.parametrize("name", ["John Doe", "<the caller's name>", "Ann Smith"])
def test_a_name_the_caller_never_said_is_asked_for_not_booked(store, name):
    o = act(Plan("book", SLOTS[1], name), ToolBox(store, "c"), "The Wednesday one please.",
            ["Hello, I need an appointment. I'm Ann.", "The Wednesday one please."])
    assert o.calls == [] and o.line.endswith("May I have your name?") and store.bookings() == []
    o = act(Plan("book", SLOTS[1], "Ann"), ToolBox(store, "c"), "The Wednesday one please.",
            ["Hello, I need an appointment. I'm Ann.", "The Wednesday one please."])
    assert o.calls[0].ok  # a name from an earlier line of the call counts


def test_act_transfer_and_end_call(store):
    box = ToolBox(store, "call-p")
    o = act(Plan("transfer"), box, "It's Marcus Brown.")  # nobody was asked for: ask, do not hang up
    assert o.calls == [] and o.action is None and o.line == "Would you like me to put you through to a person?"
    for question in ("Which dentists work at the clinic?", "Is the doctor in on Friday?", "Who is your manager?"):
        o = act(Plan("transfer"), box, question)  # a question about the staff, not a request for them
        assert o.calls == [] and o.action is None, question
    for request in ("Can I speak to Dr. Moreno?", "Put me through to the manager", "Get me a human, please"):
        assert act(Plan("transfer"), ToolBox(store, f"t-{request}"), request).action == "transfer", request
    o = act(Plan("transfer"), box, "I want a person")
    assert (o.action, o.line) == ("transfer", "Let me transfer you now.") and o.reason == "I want a person"
    o = act(Plan("end_call"), box)
    assert (o.action, o.line) == ("end_call", "Goodbye.")


def test_only_an_act_that_changed_something_stays_done(store):
    """What a turn that acted may not take back (pipeline/stages/take_back.py): a booking,
    a cancellation, a message, a transfer or hang-up to come; not a question or a refusal."""
    box = ToolBox(store, "c")
    said = ["I'm Ann Lee."]
    assert not act(Plan("book", SLOTS[1], ""), box, "The Wednesday one.").stays_done  # asks the name
    assert not act(Plan("message"), box, "What time is it?").stays_done  # asks whether to take one
    assert not act(Plan("cancel", SLOTS[1], "Ann Lee"), box, "Cancel it.", said).stays_done  # none held
    assert act(Plan("book", SLOTS[1], "Ann Lee"), box, "Book Wednesday.", said).stays_done
    assert act(Plan("cancel", SLOTS[1], "Ann Lee"), box, "Cancel it.", said).stays_done
    assert act(Plan("end_call"), box).stays_done


async def test_a_plan_turn_that_only_asked_is_not_marked_acted_one_that_booked_is(store):
    result, spoken = await turn(Recording([plan_line("book", slot=SLOTS[1], name="")]), ToolBox(store, "c"),
                                caller="Can I book the Wednesday slot?")
    assert spoken[-1].endswith("May I have your name?")
    assert result.acted_t is None and store.bookings() == []
    result, _ = await turn(Recording([plan_line("book", slot=SLOTS[1], name="Ann Lee")]), ToolBox(store, "c"))
    assert result.acted_t is not None and len(store.bookings()) == 1


def test_a_slot_taken_between_plan_and_booking_is_refused_and_another_offered(store):
    ToolBox(store, "other-call").run("book_slot", {"slot": SLOTS[0], "name": "Someone Else"})
    o = act(Plan("book", SLOTS[0], "Ann Lee"), ToolBox(store, "call-p"), CALLER)
    assert not o.calls[0].ok
    assert o.line == f"Sorry, {SLOTS[0]} was just taken. I can offer {SLOTS[1]}, or {SLOTS[2]}. Which would you like?"
    assert [(b.slot, b.name) for b in store.bookings()] == [(SLOTS[0], "Someone Else")]



def test_move_books_the_new_slot_then_cancels_the_one_this_call_made(store):
    box = ToolBox(store, "call-m")
    act(Plan("book", SLOTS[0], "Leo Martin"), box, "Tuesday please, for Leo Martin.")
    o = act(Plan("move", SLOTS[2], "Leo Martin"), box, "Can you change it to Friday?", ["Leo Martin", "Friday"])
    assert [c.name for c in o.calls] == ["book_slot", "cancel_booking"] and all(c.ok for c in o.calls)
    assert o.line == f"Your booking for {SLOTS[0]} is cancelled, and you're booked for {SLOTS[2]}, under the name Leo Martin."
    assert [(b.slot, b.name) for b in store.bookings(include_cancelled=False)] == [(SLOTS[2], "Leo Martin")]


def test_a_book_plan_said_with_change_words_moves_and_a_plain_second_one_adds(store):
    box = ToolBox(store, "call-m")
    act(Plan("book", SLOTS[0], "Leo Martin"), box, "Tuesday, Leo Martin")
    act(Plan("book", SLOTS[1], "Leo Martin"), box, "And Wednesday too, please.", ["Leo Martin"])
    assert {b.slot for b in store.bookings(include_cancelled=False)} == {SLOTS[0], SLOTS[1]}
    # Two bookings under the name: which one to drop is the caller's to say.
    o = act(Plan("book", SLOTS[2], "Leo Martin"), box, "Actually, Friday would be better.", ["Leo Martin"])
    assert [c.name for c in o.calls] == ["book_slot"] and len(store.bookings(include_cancelled=False)) == 3


def test_cancel_of_a_slot_not_held_said_with_a_preference_is_a_move(store):
    box = ToolBox(store, "call-m")
    act(Plan("book", SLOTS[0], "Ines Park"), box, "Tuesday please, I'm Ines Park.")
    o = act(Plan("cancel", SLOTS[2], "Ines Park"), box, "Actually, can you cancel that? Friday at 9 would suit me better.",
            ["Ines Park"])
    assert [(b.slot, b.name) for b in store.bookings(include_cancelled=False)] == [(SLOTS[2], "Ines Park")]
    assert o.line.startswith(f"Your booking for {SLOTS[0]} is cancelled, and you're booked for {SLOTS[2]}")
    # Without words of a change of mind, a cancel of a slot not held books nothing.
    o = act(Plan("cancel", SLOTS[0], "Ines Park"), box, "Cancel the Tuesday one.", ["Ines Park"])
    assert not o.calls[0].ok and store.bookings(include_cancelled=False)[0].slot == SLOTS[2]


def test_a_refused_move_keeps_the_booking_the_caller_had(store):
    box = ToolBox(store, "call-m")
    act(Plan("book", SLOTS[0], "Leo Martin"), box, "Tuesday, Leo Martin")
    ToolBox(store, "other").run("book_slot", {"slot": SLOTS[2], "name": "Someone Else"})
    o = act(Plan("move", SLOTS[2], "Leo Martin"), box, "Move me to Friday.", ["Leo Martin"])
    assert [c.name for c in o.calls] == ["book_slot"] and not o.calls[0].ok and o.line.startswith("Sorry,")
    assert {(b.slot, b.name) for b in store.bookings(include_cancelled=False)} == {
        (SLOTS[0], "Leo Martin"), (SLOTS[2], "Someone Else")}


def test_booking_a_slot_the_caller_already_holds_books_nothing_again(store):
    box = ToolBox(store, "call-m")
    act(Plan("book", SLOTS[2], "Ines Park"), box, "Friday, Ines Park")
    o = act(Plan("book", SLOTS[2], "Ines Park"), box, "Yes, Friday at 9 please, under Ines Park.")
    assert o.calls == [] and o.line == f"You have {SLOTS[2]} already, under the name Ines Park."
    assert len(store.bookings()) == 1


def test_a_slot_the_caller_booked_on_an_earlier_call_is_theirs_not_taken(store):
    """ "It's under Sam Reed, on Friday." (cancelling), planned as a move to Friday, was told
    Friday "is no longer available" (specvoice chat): it is the caller's own booking."""
    act(Plan("book", SLOTS[2], "Sam Reed"), ToolBox(store, "call-1"), "Book me Friday at 9, I'm Sam Reed.")
    o = act(Plan("move", SLOTS[2], "Sam Reed"), ToolBox(store, "call-2"), "It's under Sam Reed, on Friday.",
            ["I'd like to cancel my booking.", "It's under Sam Reed, on Friday."])
    assert o.calls == [] and o.line == f"You have {SLOTS[2]} already, under the name Sam Reed."
    assert [(b.slot, b.name) for b in store.bookings(include_cancelled=False)] == [(SLOTS[2], "Sam Reed")]


@pytest.mark.parametrize("written, clean", [
    ("J O N N Y, Smythe, S M Y T H E", "Jonny Smythe"),
    ("Jonny, J-O-N-N-Y", "Jonny"),
    ("J. O. Smith", "J. O. Smith"),  # initials, not a spelled name
    ("Ann Lee", "Ann Lee"),
    ("Mary O'Neil", "Mary O'Neil"),
])
def test_a_spelled_name_is_written_as_words(written, clean):
    from pipeline.receptionist.plan import clean_name

    assert clean_name(written) == clean


def test_a_spelled_name_is_booked_as_the_name_spelled(store):
    said = "Tuesday at 10:30, please. The name is Jonny, that's J O N N Y, Smythe, S M Y T H E."
    o = act(Plan("book", SLOTS[0], "J O N N Y, Smythe, S M Y T H E"), ToolBox(store, "c"), said)
    assert o.calls[0].ok and store.bookings()[0].name == "Jonny Smythe"
    o = act(Plan("book", SLOTS[1], "Kai Barr"), ToolBox(store, "c"), "Wednesday. It's K A I, B A R R.")  # only spelled
    assert o.calls[0].ok and store.bookings()[1].name == "Kai Barr"



def test_a_message_is_taken_only_when_the_caller_asks_for_one(store):
    box = ToolBox(store, "call-m")
    o = act(Plan("message", name="Omar Haddad", message="I'll call back next week."), box,
            "No, the other times don't work for me. I'll call back next week. Thanks.", ["I'm Omar Haddad."])
    assert o.calls == [] and o.line == "Would you like me to take a message?" and store.messages() == []
    lines = ["Can I leave a message for Dr. Moreno?", "It's Jo Kim, my number is 555-0123."]
    o = act(Plan("message", name="Jo Kim", message="Call me about my crown"), box, lines[-1], lines)
    assert o.calls[0].ok and (store.messages()[0].name, store.messages()[0].callback) == ("Jo Kim", "555-0123")


@pytest.mark.parametrize("lines, phone", [
    (["Friday at 9. I'm Rita Gomez, my number is 555-0199."], "555-0199"),
    (["Call me on (617) 555 0199.", "Friday at 9 please."], "(617) 555 0199"),
    (["+44 20 7946 0958"], "+44 20 7946 0958"),
    (["Tuesday at 10:30 for 2 people, on the 12th."], None),
])
def test_caller_phone(lines, phone):
    from pipeline.receptionist.caller import caller_phone

    assert caller_phone(lines) == phone


def test_a_booking_keeps_the_phone_number_the_caller_gave(store):
    said = "Can you book me in for Friday at 9? I'm Rita Gomez, my number is 555-0199."
    o = act(Plan("book", SLOTS[2], "Rita Gomez"), ToolBox(store, "c"), said)
    assert o.calls[0].ok and store.bookings()[0].phone == "555-0199"


async def turn(backend, box, caller="Can I book the Wednesday slot? I'm Ann Lee.", hold_line=""):
    sentences: asyncio.Queue = asyncio.Queue()
    result, events = LLMResult(), []
    await respond(backend, [{"role": "user", "content": caller}],
                  Reply(TurnTimeline(), llm=result, sentences=sentences, emit=lambda e: events.append((e.kind, e.as_dict())),
                        toolbox=box, hold_line=hold_line, plan=True, caller_text=caller))
    spoken = []
    while (s := sentences.get_nowait()) is not None:
        spoken.append(s)
    return result, spoken


class Recording(ScriptedBackend):
    """Records the sampling params of each stream (the constraint the turn asked for)."""

    def __init__(self, groups, before_stream=None):
        super().__init__(groups)
        self.params: list[SamplingParams] = []
        self.before_stream = before_stream

    async def stream(self, messages, params, cancel=None):
        self.params.append(params)
        if self.before_stream is not None:
            self.before_stream()
        async for g in super().stream(messages, params, cancel):
            yield g


async def test_an_answer_plan_speaks_the_answer_only(store):
    backend = Recording(['{"act": "ans', 'wer"}\nWe open', " at 8 a.m. on Tuesday."])
    result, spoken = await turn(backend, ToolBox(store, "c"), caller="When do you open Tuesday?")
    assert spoken == ["We open at 8 a.m. on Tuesday."]
    assert result.plan["act"] == "answer" and result.tool_calls == []
    assert backend.params[0].constraint.kind == "grammar"


async def test_a_plain_question_has_its_answer_plan_forced_and_reads_no_slots(store):
    """Nothing in "What time do you open on Saturday?" asks for an action: the grammar
    forces the answer plan's line whole (the engine computes it with the prompt), and the
    database is not read."""
    backend = Recording(['{"act": "answer"}\nWe open', " at 9 a.m. on Saturday."])
    reads = []
    store_slots = store.open_slots
    store.open_slots = lambda: reads.append(1) or store_slots()
    result, spoken = await turn(backend, ToolBox(store, "c"), caller="What time do you open on Saturday?")
    assert spoken == ["We open at 9 a.m. on Saturday."] and reads == []
    assert backend.params[0].constraint.text == ANSWER_ONLY_GRAMMAR
    assert result.plan["act"] == "answer" and result.plan["acts"] == ["answer"] and result.plan["open_slots"] is None
    assert result.written == '{"act": "answer"}\nWe open at 9 a.m. on Saturday.'


async def test_a_backend_that_prefills_gets_the_answer_line_as_the_start_of_the_reply(store):
    """The in-process engine starts the reply with the plan line itself: the prompt ends
    with it and the model writes free text after it (no grammar, nothing masked)."""
    from pipeline.receptionist.plan import ANSWER_LINE

    backend = Recording(["We open", " at 9 a.m. on Saturday."])
    backend.prefills = True
    seen: list[list[dict]] = []
    real = backend.stream

    def stream(messages, params, cancel=None):
        seen.append(messages)
        return real(messages, params, cancel)

    backend.stream = stream
    result, spoken = await turn(backend, ToolBox(store, "c"), caller="What time do you open on Saturday?")
    assert spoken == ["We open at 9 a.m. on Saturday."] and backend.params[0].constraint is None
    assert seen[0][-1] == {"role": "assistant", "content": ANSWER_LINE, "prefix": True}
    assert result.plan["act"] == "answer" and result.plan["error"] is None
    assert result.written == ANSWER_LINE + "We open at 9 a.m. on Saturday."


def test_the_engine_ends_the_prompt_with_a_replys_given_start(tiny_models):
    from llm.engine import SpeculativeEngine
    from pipeline.receptionist.plan import ANSWER_LINE

    eng = SpeculativeEngine.load(tiny_models["target"], None, drafter="none", gamma=0, dtype="float32")
    messages = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "Open Saturday?"}]
    start = {"role": "assistant", "content": ANSWER_LINE, "prefix": True}
    assert eng.chat_prompt([*messages, start]) == eng.chat_prompt(messages) + eng.encode(ANSWER_LINE)


async def test_a_backend_that_ignores_the_grammar_does_no_act_the_turn_does_not_allow(store):
    from pipeline.stages.plan_step import PLAN_FAILED

    backend = Recording([plan_line("book", slot=SLOTS[1], name="Ann Lee")])
    result, spoken = await turn(backend, ToolBox(store, "c"), caller="Is the Tuesday slot still free? I'm Ann Lee.")
    assert spoken == [PLAN_FAILED] and store.bookings() == [] and result.tool_calls == []


async def test_an_answer_plan_keeps_its_line_for_the_history(store):
    """The answer after a plan line is spoken alone, but the history gets the turn as the
    model wrote it (so that the next turn's prompt starts with the tokens in the KV cache),
    unless the caller heard something else."""
    from pipeline.turn import History

    line = '{"act": "answer"}\nWe open at 9 a.m. on Saturday.'
    result, spoken = await turn(Recording([line]), ToolBox(store, "c"), caller="Can I come in Saturday? When do you open?")
    assert spoken == ["We open at 9 a.m. on Saturday."] and result.written == line
    history = History("sys", 10_000, lambda msgs: sum(len(m["content"]) for m in msgs))
    history.add("Can I come in Saturday?", spoken[0], result.tool_messages, result.written_if_heard(spoken[0]))
    history.add("And Sunday?", "We open", (), result.written_if_heard("We open"))  # cut short by a barge-in
    assistant = [m for m in history.messages("Thanks.") if m["role"] == "assistant"]
    assert assistant[0] == {"role": "assistant", "content": spoken[0], "as_written": line}
    assert assistant[1] == {"role": "assistant", "content": "We open"}
    result.guarded.append({"sentence": "x", "why": "y"})
    assert result.written_if_heard(spoken[0]) == ""


@pytest.mark.parametrize("caller, agent_before, acts", [
    # Questions, a caller's claim to check: the answer only (bench quality's plan misroutes).
    ("Yes, what times do you have?", "", ("answer",)),
    ("So you have a table for two tonight at 7 p.m., right?", "", ("answer",)),
    ("We'll be twelve people. Is there a deposit?", "", ("answer",)),
    ("When will it be fixed?", "", ("answer",)),
    ("Once you get it back, when do I get my money?", "", ("answer",)),
    ("Is the Friday 9 a.m. slot still free?", "Which would you like?", ("answer",)),
    # Asked in words, agreed to, or a bare answer to the agent's question.
    ("Can I get an appointment on Monday at 9 a.m.? I'm Sara Lind.", "", ("answer", "book", "move", "cancel")),
    ("Do you have a table for four tonight?", "", ("answer", "book", "move", "cancel")),
    ("Sorry, could we reschedule that to the Friday morning slot?", "", ("answer", "book", "move", "cancel")),
    ("Okay, the Tuesday one then.", "", ("answer", "book", "move", "cancel")),
    ("It's Marcus Brown.", "I can book Wednesday 2:15 p.m. for you. May I have your name?",
     ("answer", "book", "move", "cancel")),
    ("It's Marcus Brown.", "", ("answer",)),
    # A misheard question (no question mark) is not a goodbye: the call goes on.
    ("Which then this is where Captain O'Clute.", "", ("answer",)),
    ("Okay, thanks, bye.", "", ("answer", "book", "move", "cancel", "end_call")),
    ("No, that's everything.", "", ("answer", "end_call")),
    ("Can someone call me back? It's Robert King.", "", ("answer", "message")),
    ("Can I talk to a real person, please?", "", ("answer", "transfer")),
    ("That's all, thank you. Bye!", "", ("answer", "end_call")),
])
def test_an_action_is_possible_only_when_the_caller_asks_for_it(caller, agent_before, acts):
    assert allowed_acts(caller, [caller], agent_before) == acts


@pytest.mark.parametrize("earlier, caller, acts", [
    # Choosing or naming the booking, turns after asking to book or cancel (specvoice chat:
    # both were answered, with the services and with "the next available slot").
    (["Hi, I'm Bo Chen. Can I book the Tuesday slot?", "Okay, what else do you have?"], "Wednesday then.",
     ("answer", "book", "move", "cancel")),
    (["Hello, this is Sam.", "I'd like to cancel my booking."], "It's under Sam Reed, on Friday.",
     ("answer", "book", "move", "cancel")),
    (["Can I book a cleaning?"], "The 9 a.m. one.", ("answer", "book", "move", "cancel")),
    # Only a name, after asking to book (specvoice chat: "Sam Reed." after "What about Friday
    # then?" was answered "Sam Reed, please call back when you're ready.").
    (["I'd like a cleaning. Saturday afternoon at 3?", "What about Friday then?"], "Sam Reed.",
     ("answer", "book", "move", "cancel")),
    (["Can I book a cleaning?"], "It's Ann Lee.", ("answer", "book", "move", "cancel")),
    # ... but not a short reply, and not a name in a call that asked for nothing.
    (["Can I book a cleaning?"], "Perfect.", ("answer", "book", "move", "cancel")),  # agrees (_AGREES)
    (["Can I book a cleaning?"], "Thanks!", ("answer", "end_call")),
    (["Can I book a cleaning?"], "Hello.", ("answer",)),
    (["Can I book a cleaning?"], "Riverside Dental?", ("answer",)),
    (["Are you open on Saturday?"], "Sam Reed.", ("answer",)),
    # A day named in a call that asked for nothing, or asked as a question: a question.
    (["Are you open on Saturday?"], "And on Sunday.", ("answer",)),
    (["Can I book a cleaning?"], "Are you open on Wednesday?", ("answer",)),
])
def test_a_day_or_time_named_after_asking_to_book_may_act(earlier, caller, acts):
    assert allowed_acts(caller, [*earlier, caller], "I can help with cleaning, check-ups, whitening, and filling.") == acts


def test_the_grammar_holds_only_the_acts_allowed():
    from llm.constrain import check_text
    from llm.types import Constraint

    grammar = Constraint.grammar(plan_grammar(SLOTS, SLOTS, ("answer", "message")))
    assert check_text(grammar, plan_line("message", name="Jo Kim", message="Call me")) is None
    assert check_text(grammar, '{"act": "answer"}\nWe open at 9.') is None
    assert check_text(grammar, plan_line("book", slot=SLOTS[0], name="Jo Kim")) is not None
    assert check_text(grammar, plan_line("transfer")) is not None
    answer_only = Constraint.grammar(ANSWER_ONLY_GRAMMAR)
    assert check_text(answer_only, '{"act": "answer"}\nWe open at 9 a.m.\nOn Sundays we are closed.') is None
    assert check_text(answer_only, "We open at 9.") is not None
    assert check_text(answer_only, plan_line("book", slot=SLOTS[0], name="Jo Kim")) is not None
    with pytest.raises(ValueError):
        plan_grammar(SLOTS, SLOTS, ("book",))


async def test_a_book_plan_books_and_says_what_the_database_did(store):
    backend = Recording([plan_line("book", slot=SLOTS[1], name="Ann Lee")])
    result, spoken = await turn(backend, ToolBox(store, "c"), hold_line="One moment, please.")
    assert spoken == ["One moment, please.", f"You're booked for {SLOTS[1]}, under the name Ann Lee."]
    assert result.tool_calls[0]["name"] == "book_slot" and result.tool_calls[0]["ok"]
    assert result.plan == {"act": "book", "slot": SLOTS[1], "name": "Ann Lee", "open_slots": 3, "error": None,
                           "acts": ["answer", "book", "move", "cancel"],
                           "plan_ms": result.plan["plan_ms"], "line": plan_line("book", slot=SLOTS[1], name="Ann Lee")}
    # The history gets the plan as the model wrote it and the database's result.
    assert result.tool_messages[0]["as_written"] == plan_line("book", slot=SLOTS[1], name="Ann Lee")
    assert json.loads(result.tool_messages[1]["content"])["booked"] is True


async def test_a_plan_books_through_the_phone_bridges_tools_without_a_transfer_line(store):
    """A phone call with no transfer number gets its tools wrapped (NoTransferLine): the plan
    still reads the database's slots and books through it (it once failed every turn)."""
    from pipeline.transports.telephony.adapter import NoTransferLine

    box = NoTransferLine(ToolBox(store, "c"))
    result, spoken = await turn(Recording([plan_line("book", slot=SLOTS[1], name="Ann Lee")]), box)
    assert result.error is None and spoken == [f"You're booked for {SLOTS[1]}, under the name Ann Lee."]
    assert [(b.slot, b.name, b.call_id) for b in store.bookings()] == [(SLOTS[1], "Ann Lee", "c")]
    assert box.open_slots() == [SLOTS[0], SLOTS[2]]


async def test_the_grammar_names_the_databases_slots_at_the_start_of_the_turn(store):
    ToolBox(store, "other").run("book_slot", {"slot": SLOTS[0], "name": "Someone"})
    backend = Recording(['{"act": "answer"}\nSure.'])
    await turn(backend, ToolBox(store, "c"))
    # The open ones first; the taken one stays nameable (the database refuses it: the
    # model is not forced onto another slot the caller never asked for).
    assert slot_rule(backend.params[0].constraint.text) == [SLOTS[1], SLOTS[2], SLOTS[0], OTHER_SLOT]


async def test_a_time_the_database_does_not_have_books_nothing_and_offers_the_open_ones(store):
    result, spoken = await turn(Recording([plan_line("book", slot=OTHER_SLOT, name="Ann Lee")]), ToolBox(store, "c"),
                                caller="Can I come Monday at 9? I'm Ann Lee.")
    assert spoken == ["Sorry, we don't have that time. The open slots are: " + "; ".join(SLOTS) + "."]
    assert result.tool_calls == [] and store.bookings() == []


async def test_a_taken_slot_named_in_the_plan_is_refused_by_the_database(store):
    ToolBox(store, "other").run("book_slot", {"slot": SLOTS[0], "name": "Someone"})
    result, spoken = await turn(Recording([plan_line("book", slot=SLOTS[0], name="Ann Lee")]), ToolBox(store, "c"),
                                caller="Can I book the Tuesday slot? I'm Ann Lee.")
    assert not result.tool_calls[0]["ok"]
    assert spoken == [f"Sorry, {SLOTS[0]} was just taken. I can offer {SLOTS[1]}, or {SLOTS[2]}. Which would you like?"]
    assert [(b.slot, b.name) for b in store.bookings()] == [(SLOTS[0], "Someone")]


async def test_slot_taken_while_the_plan_is_written(store):
    """Another caller books the slot after this turn's grammar was built (it was open
    then): the database refuses this booking, and the caller hears so, with other slots."""
    other = ToolBox(store, "other-call")
    backend = Recording([plan_line("book", slot=SLOTS[0], name="Ann Lee")],
                        before_stream=lambda: other.run("book_slot", {"slot": SLOTS[0], "name": "Quick Caller"}))
    result, spoken = await turn(backend, ToolBox(store, "c"), caller="Can I book the Tuesday slot? I'm Ann Lee.")
    assert SLOTS[0] == slot_rule(backend.params[0].constraint.text)[0]  # open when the turn began
    assert not result.tool_calls[0]["ok"] and "already booked" in result.tool_calls[0]["error"]
    assert spoken == [f"Sorry, {SLOTS[0]} was just taken. I can offer {SLOTS[1]}, or {SLOTS[2]}. Which would you like?"]
    assert [(b.slot, b.name) for b in store.bookings()] == [(SLOTS[0], "Quick Caller")]


async def test_a_transfer_plan_ends_the_call_after_the_turn(store):
    result, spoken = await turn(Recording([plan_line("transfer")]), ToolBox(store, "c"), caller="A person please")
    assert result.action == "transfer" and spoken == ["Let me transfer you now."]


# ---------------------------------------------------------------- the real engine (a tiny random model)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", range(6))
async def test_constrained_plan_is_valid_by_construction_and_names_only_open_slots(tiny_models, store, seed):
    """Whatever the model (here random weights, sampled at temperature 1.5), the turn's
    first line is a plan the grammar allows: an act of ACTS, a slot of the database's (or
    "another time"), and nothing is booked on the slot taken before the turn."""
    import torch

    from llm.backend import SpeculativeBackend
    from llm.constrain import check_text
    from llm.engine import SpeculativeEngine
    from llm.types import Constraint
    from pipeline.receptionist.plan import ACTS
    from pipeline.stages.plan_step import PLAN_FAILED

    torch.set_num_threads(1)
    ToolBox(store, "other").run("book_slot", {"slot": SLOTS[0], "name": "Taken Already"})
    engine = SpeculativeEngine.load(tiny_models["target"], None, drafter="ngram", gamma=4, dtype="float32")
    backend = SpeculativeBackend(engine)
    params = SamplingParams(max_new_tokens=400, temperature=1.5, seed=seed)
    sentences: asyncio.Queue = asyncio.Queue()
    result = LLMResult()
    grammars = []
    real_stream = backend.stream

    def stream(messages, p, cancel=None):
        grammars.append(p.constraint)
        return real_stream(messages, p, cancel)

    backend.stream = stream
    await respond(backend, [{"role": "user", "content": "Book me Tuesday please, I'm Ann."}],
                  Reply(TurnTimeline(), llm=result, params=params, sentences=sentences, toolbox=ToolBox(store, "c"),
                        plan=True, caller_text="Book me Tuesday please, I'm Ann."))
    assert result.error is None and grammars[0].kind == "grammar"
    if result.plan["error"] is not None:
        # Random weights may write a name until the token budget runs out: what was written
        # is still a prefix the grammar allows, and the caller is asked again.
        assert result.finish_reason == "length"
        assert "ends before" in check_text(Constraint.grammar(grammars[0].text), result.plan["line"])
        assert result.sentences == [PLAN_FAILED] and store.bookings(include_cancelled=False)[0].name == "Taken Already"
        return
    assert result.plan["act"] in ACTS
    if result.plan["act"] in ("book", "cancel"):
        assert result.plan["slot"] in [*SLOTS, OTHER_SLOT]
    booked = [b for b in store.bookings(include_cancelled=False) if b.name != "Taken Already"]
    assert all(b.slot in SLOTS[1:] for b in booked)
    assert check_text(Constraint.grammar(grammars[0].text), _written(result)) is None


def _written(result: LLMResult) -> str:
    """The round's text as the model wrote it: the plan line (kept in the history for an
    action) or the plan line and the answer."""
    return '{"act": "answer"}\n' + result.text if result.plan["act"] == "answer" else result.plan["line"]


async def test_a_plan_that_fails_midway_asks_the_caller_again(store):
    from pipeline.stages.plan_step import PLAN_FAILED

    backend = ScriptedBackend(['{"act": "book", "slot": "', "Tuesday"], fail_after=1)
    result, spoken = await turn(backend, ToolBox(store, "c"))
    assert spoken == [PLAN_FAILED] and result.finish_reason == "error" and "model exploded" in result.error
    assert result.tool_calls == [] and store.bookings() == []


def test_warming_the_models_compiles_the_plan_grammar_of_todays_slots(tiny_models, store):
    """AgentModels.warm builds the plan's constraint (llguidance's tokenizer and today's
    grammar) at load, so the first caller's plan does not wait for it; the turn's own
    grammar is then a cache hit."""
    from llm.types import Constraint
    from pipeline.agent import AgentModels, load_engine
    from pipeline.config import load_config

    cfg = load_config("test")
    cfg = cfg.model_copy(update={
        "llm": cfg.llm.model_copy(update={"target": tiny_models["target"], "draft": tiny_models["target"]}),
        "tools": cfg.tools.model_copy(update={"enabled": True, "plan": True}),
        "business": cfg.business.model_copy(update={"open_slots": SLOTS}),
    })
    engine = load_engine(cfg.llm)
    models = AgentModels(cfg, None, None, None, engine, bookings=store)
    models.warm()
    grammars = [Constraint.grammar(plan_grammar(store.open_slots(), SLOTS))]
    assert list(engine.grammars.compile_s) == grammars  # compiled once, at warm-up
    engine.grammars.start(grammars[0])
    assert list(engine.grammars.compile_s) == grammars


def test_a_slot_on_another_day_than_the_one_asked_for_is_offered_not_booked(store):
    box = ToolBox(store, "c")
    o = act(Plan("book", SLOTS[0], "Sara Lind"), box, "Can I get an appointment on Monday at 9 a.m.? I'm Sara Lind.")
    assert o.calls == [] and store.bookings() == []
    assert o.line == "Sorry, we don't have that time. The open slots are: " + "; ".join(SLOTS) + "."
    # The day asked for, or no day at all, or a move naming both days: booked.
    friday = next(s for s in SLOTS if s.startswith("Friday"))
    said = ["Can I get an appointment on Monday at 9 a.m.? I'm Sara Lind."]
    assert act(Plan("book", friday, "Sara Lind"), box, "Alright, Friday at 9 then.", said + ["Alright, Friday at 9 then."]).calls[0].ok
    offered = "The open slots are: " + "; ".join(SLOTS) + ". Which would you like?"
    assert act(Plan("book", SLOTS[0], "Ann Lee"), ToolBox(store, "d"), "The first one, please. I'm Ann Lee.",
               agent_line=offered).calls[0].ok


def test_a_slot_nobody_named_is_offered_not_booked(store):
    """ "I'd like to book a cleaning." was booked into the first slot, and "Tell him I need to
    move my appointment." (a message being given) into another (specvoice chat)."""
    box = ToolBox(store, "c")
    offer = "The open slots are: " + "; ".join(SLOTS) + ". Which would you like?"
    o = act(Plan("book", SLOTS[0], "Ann Lee"), box, "Hi, I'm Ann Lee. I'd like to book a cleaning.")
    assert o.calls == [] and o.line == offer and store.bookings() == []
    o = act(Plan("move", SLOTS[1], "Carl"), box, "Tell him I need to move my appointment. My number is 555 0199.",
            ["Hi, my name's Carl. I'd like to leave a message for Dr. Moreno."])
    assert o.calls == [] and o.line == offer and store.bookings() == []
    # Named by the caller (its day or its time), or offered in the agent's line they answer: booked.
    assert act(Plan("book", SLOTS[0], "Ann Lee"), box, "The 10:30 one, please. I'm Ann Lee.").calls[0].ok
    asked = f"I can book {SLOTS[1]} for you. May I have your name?"
    assert act(Plan("book", SLOTS[1], "Bo Chen"), box, "Bo Chen.", ["Bo Chen."], agent_line=asked).calls[0].ok


@pytest.mark.parametrize("caller", ["Hello, I booked a check-up last week under Nora Bell. When is it?",
                                    "When is my appointment?", "Is my booking still on for Friday?"])
def test_naming_a_booking_the_caller_has_is_a_question_not_a_request(caller):
    assert allowed_acts(caller, [caller]) == ("answer",)  # the first was planned as a booking, and booked


@pytest.mark.parametrize("caller", ["Can you cancel my appointment?", "I'd like to move my booking to Friday.",
                                    "I want to book an appointment."])
def test_asking_to_change_a_booking_still_may_act(caller):
    assert "book" in allowed_acts(caller, [caller])


def test_a_business_without_slots_plans_no_booking(tmp_path, store):
    """An online shop has no slots: "Can I change the delivery address of order 48213?" was
    planned as a move and answered "Sorry, we don't have that time, and no slot is open
    right now." (specvoice chat, shop). With no slot at all, no booking act is planned; the
    same line on a business with slots may act."""
    from pipeline.stages.plan_step import plan_request

    line = "Can I change the delivery address of order 48213?"
    messages = [{"role": "user", "content": line}]
    shop = open_store(tmp_path / "shop.sqlite", open_slots=[])
    try:
        request = plan_request(messages, line, shop, prefills=True)
    finally:
        shop.close()
    assert request.acts == ("answer",) and request.constraint is None and request.given
    assert {"book", "move", "cancel"} <= set(plan_request(messages, line, store, prefills=True).acts)


def test_a_table_too_small_for_the_party_is_offered_away_not_booked(tmp_path):
    """ "Do you have a table for four tomorrow?" was offered, then booked, "tomorrow 9:00
    p.m., a table for 2" (specvoice chat, bistro). A slot that says how many it seats is
    booked only for a party that fits; the caller hears the open tables that seat them."""
    tables = ["tonight 6:30 p.m., a table for 2", "tonight 7:45 p.m., a table for 4", "tomorrow 9:00 p.m., a table for 2",
              "tomorrow 6:00 p.m., a table for 4"]
    s = open_store(tmp_path / "bistro.sqlite", open_slots=tables)
    try:
        box = ToolBox(s, "c")
        asked = ["Do you have a table for four tomorrow?"]
        o = act(Plan("book", tables[2], None), box, asked[0], asked)
        # On the day they asked for (tomorrow), when a table that seats them is open then.
        assert o.calls == [] and o.line == "For 4, the open slots are: tomorrow 6:00 p.m., a table for 4. Which would you like?"
        o = act(Plan("book", tables[0], None), box, "A table for 4, please.", ["A table for 4, please."])
        assert o.line == ("For 4, the open slots are: tonight 7:45 p.m., a table for 4; tomorrow 6:00 p.m., a table for 4. "
                          "Which would you like?")
        o = act(Plan("book", tables[2], "Joe Park"), box, "Great, name is Joe Park.", [*asked, "Great, name is Joe Park."])
        assert o.calls == [] and s.bookings() == []
        # A table that seats them (or more) is booked; so is any table when no party size was said.
        assert act(Plan("book", tables[1], "Joe Park"), box, "The 7:45 then. Joe Park.",
                   [*asked, "The 7:45 then. Joe Park."]).calls[0].ok
        assert act(Plan("book", tables[0], "Ann Lee"), box, "Tonight at 6:30, I'm Ann Lee.",
                   ["We'll be two.", "Tonight at 6:30, I'm Ann Lee."]).calls[0].ok
        assert act(Plan("book", tables[2], "Bo Wu"), box, "Tomorrow at 9 please, I'm Bo Wu.",
                   ["Tomorrow at 9 please, I'm Bo Wu."]).calls[0].ok
        # Nothing open seats them: a message instead.
        assert act(Plan("book", tables[3], "Cy Li"), box, "Tomorrow at 6 for four, I'm Cy Li.",
                   ["Tomorrow at 6 for four, I'm Cy Li."]).calls[0].ok
        o = act(Plan("book", tables[2], None), box, "A table for six tomorrow?", ["A table for six tomorrow?"])
        assert o.line == "Sorry, no open slot has room for 6. I can take a message instead."
        # A time is no party size.
        for line in ("Do you have something for 8 pm?", "A table for 7:30, please.", "Anything for 8 o'clock?"):
            assert _party([line]) is None, line
        assert _party(["A table for four at 8 pm.", "We'll be five actually."]) == 5
    finally:
        s.close()


def test_the_doctor_the_caller_asks_for_is_not_swapped_for_another(tmp_path):
    """ "I'd like to book with Dr. Moreno on Tuesday." was offered "Tuesday 10:30 a.m. with
    Dr. Patel" (specvoice chat): the caller hears Dr. Moreno's open slots instead."""
    slots = ["Tuesday 10:30 a.m. with Dr. Patel", "Wednesday 2:15 p.m. with Dr. Moreno", "Friday 9:00 a.m. with Dr. Patel"]
    s = open_store(tmp_path / "dental.sqlite", open_slots=slots)
    try:
        box = ToolBox(s, "c")
        line = "I'd like to book with Dr. Moreno on Tuesday."
        o = act(Plan("book", slots[0], None), box, line, [line])
        assert o.calls == [] and o.line == ("Dr. Moreno has these open slots: Wednesday 2:15 p.m. with Dr. Moreno. "
                                            "Which would you like?")
        o = act(Plan("book", slots[0], "Sam Ortiz"), box, "With Doctor Moreno, please. I'm Sam Ortiz.",
                ["With Doctor Moreno, please. I'm Sam Ortiz."])
        assert o.calls == [] and s.bookings() == []
        # The doctor the caller named, or none named: booked as before.
        line = "Tuesday with Dr. Patel, please. I'm Sam Ortiz."
        assert act(Plan("book", slots[0], "Sam Ortiz"), box, line, [line]).calls[0].ok
        box.run("book_slot", {"slot": slots[1], "name": "Ann Lee"})
        line = "Can I see Dr. Moreno? I'm Bo Wu."
        o = act(Plan("book", slots[2], "Bo Wu"), box, line, [line])
        assert o.line == "Sorry, Dr. Moreno has no open slot right now. I can take a message instead."
    finally:
        s.close()
