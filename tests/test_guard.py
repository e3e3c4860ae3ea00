"""The fact guard (pipeline/receptionist/guard.py): each rule with a true and a false sentence, agreement
with a false premise, the corrections, one turn's record, the guard inside a turn (the
respond stage, the call's report), and no false positive on any answer `bench quality`
scored correct (the saved answers of bench/results/quality-*.json)."""

from __future__ import annotations

import asyncio
import glob
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from bench import QUALITY, RESULTS
from callfakes import FakeModels, ScriptedBackend, ScriptedSTT, ToneTTS
from demo import BUSINESSES
from pipeline.config import ToolsConfig
from pipeline.receptionist.bookings import open_store
from pipeline.receptionist.business import FALLBACK, BusinessConfig, default_business
from pipeline.receptionist.guard import FactGuard, Support, TurnGuard, normalize, topic_words
from pipeline.sentences import split_sentences
from pipeline.stages.respond import respond
from pipeline.timeline import TurnTimeline
from pipeline.receptionist.tools import ToolBox
from pipeline.turn import LLMResult, Reply



def business(key: str) -> BusinessConfig:
    text = (BUSINESSES / f"{key}.toml").read_text(encoding="utf-8")
    return BusinessConfig.model_validate(tomllib.loads(text)["business"])


@pytest.fixture(scope="module")
def dental() -> FactGuard:
    return FactGuard(default_business())


@pytest.fixture(scope="module")
def guards() -> dict[str, FactGuard]:
    return {k: FactGuard(business(k)) for k in ("dental", "bistro", "isp", "shop")}


def ok(guard: FactGuard, sentence: str, caller: str = "", **support) -> bool:
    return guard.check(sentence, Support.of(caller=caller, **support)).ok


def test_normalize_spells_figures_one_way():
    assert normalize("Nine A.M. on Friday") == "9 am on friday"
    assert normalize("It's eighty-nine dollars.") == "it's $89."
    assert normalize("10:00 p.m., check-up, Dr. Patel") == "10 pm, check up, dr patel"
    assert normalize("gluten-free pasta") == "glutenfree pasta"


@pytest.mark.parametrize("true, false", [
    ("A cleaning is $89.", "A cleaning is $95."),  # a price
    ("Whitening costs $249.", "The price of a root canal is $120."),  # $120 is the filling's, not a root canal's
    ("We close at 6 p.m. on Friday.", "We close at 7 p.m. on Friday."),  # a time
    ("You can reach us at 555-0142.", "You can reach us at 555-0199."),  # a phone number
])
def test_figures(dental, true, false):
    assert ok(dental, true)
    assert not ok(dental, false)


def test_figures_with_units_and_counts(guards):
    shop, isp = guards["shop"], guards["isp"]
    assert ok(shop, "Refunds take 5 to 7 business days.")
    assert not ok(shop, "Refunds take about 2 weeks.")
    assert ok(isp, "Unplug it for 30 seconds and plug it back in.")
    assert not ok(isp, "Unplug it for 5 minutes.")
    assert ok(shop, "Your order 48213 arrives Thursday by 8 p.m.")
    assert not ok(shop, "Your order 48214 arrives Thursday by 8 p.m.")


def test_a_count_the_caller_said_is_not_a_fact(guards):
    bistro = guards["bistro"]
    assert ok(bistro, "Tables seat up to 8 people.")
    assert not ok(bistro, "Our big table seats 12 people.", caller="Your big table seats twelve, right?")


def test_prices_of_named_items(guards):
    isp, shop = guards["isp"], guards["shop"]
    assert ok(isp, "The Gigabit plan is $79.99 a month.")
    v = isp.check("The Gigabit plan is $59.99 a month.", Support())
    assert not v.ok and "Gigabit plan" in v.why
    assert v.correction == "Actually, the Gigabit plan is $79.99 a month."
    assert ok(shop, "Standard shipping is free over $50, otherwise $6.95.")
    assert not ok(shop, "Express shipping is free.")
    assert ok(isp, "The technician visit is $49, waived for Plus and Gigabit customers.")
    assert not ok(isp, "Technician visits are always free.")


def test_a_figure_of_another_items_line_is_not_the_named_items(guards):
    """The Plus plan's "500 Mbps" said of the Gigabit plan (specvoice chat, isp); the Plus
    plan's own figure, and a figure of no item, pass."""
    isp = guards["isp"]
    v = isp.check("The Gigabit plan offers 500 Mbps speed.", Support.of(caller="And how fast is the Gigabit one?"))
    assert not v.ok and v.why == "'500 mbps' is the Plus plan's, not the Gigabit plan's"
    assert v.correction == "The Gigabit plan is $79.99 a month."
    assert ok(isp, "The Plus plan offers 500 Mbps.")
    assert ok(isp, "The Basic plan is 100 Mbps for $39.99 a month.")
    assert not ok(isp, "The Basic plan gives you 500 Mbps.")
    assert ok(isp, "Unplug the router for 30 seconds.")  # a figure of a fact, no item named


def test_hours_of_every_day_without_day_labels(guards):
    """"Phone support": "24 hours a day, every day": no label names a day, and every day is
    open (specvoice chat: "No, phone support is not open on Sunday night." passed)."""
    isp = guards["isp"]
    assert not ok(isp, "No, phone support is not open on Sunday night.", caller="Is phone support open on Sunday night?")
    assert not ok(isp, "Phone support is closed on Saturday.")
    assert not ok(isp, "Phone support is open from 8 a.m. to 8 p.m. on Sunday.")
    assert ok(isp, "Yes, phone support is open 24 hours a day, every day.", caller="Is phone support open on Sunday night?")
    assert ok(isp, "Phone support is open on Sunday.")


def test_a_days_opening_and_closing(dental, guards):
    assert ok(dental, "We're closed on Sunday.")
    v = dental.check("We're open on Sunday.", Support())
    assert not v.ok and v.correction == "Actually, we're closed on Sunday."
    assert ok(dental, "Yes, we're open on Saturday from 9 a.m. to 1 p.m.")
    v = dental.check("Friday is closed.", Support())
    assert not v.ok and v.correction == "Actually, on Friday we're open 8 a.m. to 6 p.m."
    assert not ok(dental, "On Saturday we're open until 5 p.m.")
    assert ok(guards["bistro"], "We're closed on Mondays.")
    assert not ok(guards["bistro"], "We're open on Monday from 5 p.m.")
    # A day no fact names (the shop has no hours): "arriving Wednesday" is made up.
    assert not ok(guards["shop"], "Your order 48213 is arriving Wednesday.")


def test_slots_come_from_the_database_at_that_moment(dental):
    assert ok(dental, "Dr. Moreno has an open slot on Wednesday at 2:15 p.m.")
    assert not ok(dental, "Dr. Moreno has a slot on Thursday.")
    assert not ok(dental, "We have an opening on Tuesday at 5 p.m.")
    # The database says the Wednesday slot was just taken: it may no longer be offered.
    now = ["Tuesday 10:30 a.m. with Dr. Patel", "Friday 9:00 a.m. with Dr. Patel"]
    assert ok(dental, "Dr. Patel has a slot on Friday at 9 a.m.", slots=now)
    v = dental.check("Dr. Moreno has an open slot on Wednesday at 2:15 p.m.", Support.of(slots=now))
    assert not v.ok and v.correction == "The open slots are: " + "; ".join(now) + "."


def test_a_person_and_a_part_of_the_day_must_fit_one_open_slot(dental):
    """"Dr. Patel is free on Wednesday afternoon": Wednesday's one slot is Dr. Moreno's
    (bench pipeline's line p3, passed by the guard before this rule)."""
    assert ok(dental, "Dr. Moreno is free on Wednesday afternoon.")
    assert not ok(dental, "Dr. Patel is free on Wednesday afternoon.")
    assert not ok(dental, "Dr. Moreno is free on Wednesday morning.")  # 2:15 p.m. is the afternoon
    assert ok(dental, "Dr. Patel can see you on Friday morning.")
    assert not ok(dental, "Dr. Patel can see you on Friday afternoon.")
    # Each day is a claim: both days have a morning slot, Wednesday has none.
    assert ok(dental, "Dr. Patel has openings in the morning on Tuesday and Friday.")
    assert not ok(dental, "There are openings in the morning on Tuesday and Wednesday.")
    assert ok(dental, "The consultation is free.")  # a price, not a slot


def test_two_slots_in_one_clause_are_two_claims(guards):
    bistro = guards["bistro"]
    assert ok(bistro, "Tomorrow, we have a table for 4 at 6:00 p.m. and a table for 2 at 9:00 p.m.")
    assert not ok(bistro, "Tomorrow, we have a table for 4 at 9:00 p.m.")


def test_names_of_people_and_services(dental, guards):
    assert ok(dental, "Dr. Priya Patel and Dr. Luis Moreno are our dentists.")
    assert not ok(dental, "Dr. Smith can see you.")
    assert ok(dental, "We accept Delta Dental and Aetna.")
    assert not ok(dental, "We offer braces and implants.")
    assert not ok(guards["bistro"], "Yes, there is parking available near the restaurant.")
    assert ok(guards["bistro"], "Yes, gluten-free pasta is available.")
    # Denying what the facts never mention is a claim too.
    assert not ok(guards["bistro"], "No, we do not have a kids' menu.")


@pytest.mark.parametrize("sentence, tool", [
    ("You're booked for Tuesday at 10:30 a.m.", "book_slot"),
    ("I've cancelled your booking.", "cancel_booking"),
    ("I've taken your message and someone will call you back.", "take_message"),
    ("I'm transferring you to a colleague now.", "transfer_to_human"),
])
def test_claims_of_an_action_need_the_tool(dental, sentence, tool):
    assert not ok(dental, sentence)
    done = [{"name": tool, "ok": True, "arguments": {}, "result": {"slot": "Tuesday 10:30 a.m. with Dr. Patel"}}]
    assert ok(dental, sentence, tool_calls=done)
    failed = [{**done[0], "ok": False, "result": None, "error": "slot is already booked"}]
    assert not ok(dental, sentence, tool_calls=failed)


def test_offers_and_questions_are_not_action_claims(dental):
    assert ok(dental, FALLBACK)
    assert ok(dental, "Would you like me to book the Tuesday slot?")
    assert ok(dental, "I can take a message and have someone call you back.")


@pytest.mark.parametrize("caller, why", [
    ("You're open on Sundays, right?", "Sunday"),
    ("I heard a check-up is free. Is that right?", "check-up"),
    ("Dr. Moreno has a slot on Thursday, right?", "slot"),
    ("I'd like to book for Monday morning. You have that open, right?", "slot"),
    ("Does Dr. Patel speak Spanish?", "spanish"),
    ("Do you do braces?", "brace"),
])
def test_agreeing_with_a_false_premise_is_caught(dental, caller, why):
    for answer in ("Yes.", "That's right.", "Sure, we are.", "Yes, that's correct."):
        v = dental.check(answer, Support.of(caller=caller))
        assert not v.ok and why in v.why, (caller, answer, v)
    # "No" to a claim the facts contradict is true; to one they never mention it is made up
    # too (test_a_yes_or_no_about_what_the_facts_never_mention_is_not_said).
    assert ok(dental, "No, sorry.", caller=caller) is (why not in ("spanish", "brace"))


@pytest.mark.parametrize("caller, answer", [
    ("Do you have a kids' menu?", "No, Luigi's Bistro does not offer a kids' menu."),
    ("Do you have a vegetarian lasagna?", "No, I don't have a vegetarian lasagna."),
    ("Is there parking near the restaurant?", "No parking is available near the restaurant."),
    ("Do you have a kids' menu?", "Yes, kids love our menu."),
])
def test_a_yes_or_no_about_what_the_facts_never_mention_is_not_said(guards, caller, answer):
    bistro = guards["bistro"]
    v = bistro.check(answer, Support.of(caller=caller))
    assert not v.ok and "facts do not say" in v.why, v
    # Saying we do not know is true, and so is a fact about something the facts do name.
    assert bistro.check("I'm not sure about that. I can take a message.", Support.of(caller=caller)).ok
    assert bistro.check("Yes, the tiramisu is $9.", Support.of(caller="Do you have tiramisu?")).ok


def test_dental_implants_asked_after_a_person_are_still_the_subject(dental):
    v = dental.check("Dr. Priya Patel does implants.", Support.of(caller="Do you have a dentist who does implants?"))
    assert not v.ok and "implants" in v.why
    assert ok(dental, "Dr. Priya Patel and Dr. Luis Moreno.", caller="Which dentists do you have?")


def test_agreeing_with_a_true_premise_passes(dental):
    assert ok(dental, "Yes, we're open Saturday from 9 a.m. to 1 p.m.", caller="You're open on Saturdays, right?")
    assert ok(dental, "Yes, we accept Aetna.", caller="Do you take Aetna insurance?")
    assert ok(dental, "Yes.", caller="Is there parking?")


def test_a_false_premise_gets_the_correction(dental):
    v = dental.check("Yes, we are.", Support.of(caller="You're open on Sundays, right?"))
    assert v.correction == "Actually, we're closed on Sunday."


def test_turn_guard_says_one_replacement_and_records_each_sentence(dental):
    turn = TurnGuard(dental, caller="How much is a root canal?")
    assert turn("A root canal is $120.") == dental.book.fallback
    assert turn("It takes 2 hours.") is None  # the fallback was said this turn already
    assert turn("Is there anything else?") == "Is there anything else?"
    assert [g["sentence"] for g in turn.guarded] == ["A root canal is $120.", "It takes 2 hours."]
    assert turn.guarded[0]["why"] and turn.guarded[0]["said"] == dental.book.fallback
    assert turn.guarded[1]["said"] is None


def test_turn_guard_sees_tool_results_as_they_arrive(dental):
    calls: list[dict] = []
    turn = TurnGuard(dental, caller="Book me Tuesday, I'm Ann.", tool_calls=calls)
    assert turn("You're booked for Tuesday at 10:30 a.m.") != "You're booked for Tuesday at 10:30 a.m."
    calls.append({"name": "book_slot", "ok": True, "arguments": {"slot": "Tuesday", "name": "Ann"},
                  "result": {"booked": True, "slot": "Tuesday 10:30 a.m. with Dr. Patel", "name": "Ann"}})
    turn.said.clear()
    assert turn("You're booked for Tuesday at 10:30 a.m., Ann.") == "You're booked for Tuesday at 10:30 a.m., Ann."


HOLD_LINE = ToolsConfig().hold_line  # what a run with tools on says while a plan acts


def _saved_answers():
    """Every answer of the saved bench quality runs, scored again by today's question set
    (a must_not added since catches what an old run let through: "being packed" of an
    order that shipped)."""
    from bench.quality import check, load_questions

    questions = {q["id"]: q for q in json.loads(QUALITY.read_text(encoding="utf-8"))["questions"]}
    rules = {q.id: q.rules for q in load_questions(QUALITY)[0]}
    seen = set()
    for path in sorted(glob.glob(str(RESULTS / "quality-*.json"))):
        for entry in json.loads(Path(path).read_text(encoding="utf-8"))["variants"].values():
            for row in entry["questions"]:
                q = questions.get(row["id"])
                if q is not None and (row["id"], row["answer"]) not in seen:
                    seen.add((row["id"], row["answer"]))
                    v = check(row["answer"], rules[row["id"]])
                    yield q, {**row, "correct": v.correct, "false_claim": v.false_claim}


def test_no_false_positive_on_the_right_answers_of_bench_quality(guards):
    """Every answer bench quality scored correct (all prompt variants ever saved) is let
    through whole; the false claims it scored are mostly caught."""
    right = caught = false = 0
    blocked = []
    for q, row in _saved_answers():
        users = [m["content"] for m in q["messages"] if m["role"] == "user"]
        turn = TurnGuard(guards[q["business"]], users[-1], earlier=users[:-1])
        for sentence in split_sentences(row["answer"]):
            if sentence.strip() != HOLD_LINE:  # our own line (said while the plan acts): never guarded
                turn(sentence)
        if row["correct"]:
            right += 1
            if turn.guarded:
                blocked.append((q["id"], row["answer"], turn.guarded))
        elif row["false_claim"]:
            false += 1
            caught += bool(turn.guarded)
    assert right >= 100 and false >= 80  # the saved runs are there
    assert blocked == []
    assert caught / false >= 0.8


async def test_respond_speaks_what_the_guard_lets_through(dental):
    backend = ScriptedBackend(["A cleaning is $89. ", "A root canal is ", "$120. ", "Anything else?"])
    turn = TurnGuard(dental, caller="What do a cleaning and a root canal cost?")
    sentences: asyncio.Queue = asyncio.Queue()
    result, events = LLMResult(), []
    await respond(backend, [{"role": "user", "content": "x"}],
                  Reply(TurnTimeline(), llm=result, sentences=sentences, emit=lambda e: events.append((e.kind, e.as_dict())),
                        guard=turn))
    spoken = []
    while (s := sentences.get_nowait()) is not None:
        spoken.append(s)
    assert spoken == ["A cleaning is $89.", dental.book.fallback, "Anything else?"]
    assert result.sentences == spoken
    assert [g["sentence"] for g in turn.guarded] == ["A root canal is $120."]
    assert ("guarded", {"turn": 0, "sentence": "A root canal is $120.", "said": dental.book.fallback}) in events


def _tone(seconds: float) -> np.ndarray:
    n = int(16000 * seconds)
    return (0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / 16000)).astype(np.float32)


async def test_a_call_reports_what_the_guard_held_back(tmp_path):
    """A whole call with [agent] guard on: the model claims a booking it never made; the
    caller hears the fallback, the history keeps what was heard, and the report says why."""
    from pipeline.call import Call
    from pipeline.config import load_config
    from pipeline.io import PacedSink, PushSource

    cfg = load_config("test")
    cfg = cfg.model_copy(update={"report": cfg.report.model_copy(update={"dir": str(tmp_path / "reports")}),
                                 "agent": cfg.agent.model_copy(update={"guard": True})})
    store = open_store(tmp_path / "b.sqlite", open_slots=default_business().open_slots)
    stt = ScriptedSTT(lambda audio: "Book me the Tuesday slot please, I'm Ann.")
    backend = ScriptedBackend(["Sure, ", "you're booked for Tuesday at 10:30 a.m."])
    source, sink = PushSource(), PacedSink()
    turns: list[dict] = []
    c = Call.from_models(cfg, FakeModels(stt=stt, tts=ToneTTS(chunks=1, chunk_s=0.05)), source, sink,
                         backend=backend, mqtt=None, toolbox=ToolBox(store, "call-g"), on_turn=turns.append)
    run = asyncio.create_task(c.run())
    source.push(_tone(0.4))
    source.push(np.zeros(16000 // 2, np.float32))
    await c.wait_turns(1)
    source.close()
    report = (await run).to_dict()
    entry = report["turns"][0]
    assert entry["guarded"][0]["sentence"] == "Sure, you're booked for Tuesday at 10:30 a.m."
    assert "book_slot" in entry["guarded"][0]["why"]
    assert entry["agent_text_heard"] == FALLBACK  # the default business has no fallback of its own
    assert c.history.exchanges[0][1] == FALLBACK
    assert store.bookings() == []
    store.close()


def test_not_sure_to_a_false_premise_becomes_the_correction(dental, guards):
    turn = TurnGuard(dental, caller="You're open on Sundays, right?")
    assert turn("I'm not sure about that.") == "Actually, we're closed on Sunday."
    assert "caller's claim is wrong" in turn.guarded[0]["why"]
    # A question the facts do not answer keeps the fallback: nothing to correct.
    turn = TurnGuard(dental, caller="Do you do braces?")
    assert turn("I'm not sure about that.") == "I'm not sure about that." and turn.guarded == []


def test_agreeing_with_a_wrong_figure_gets_the_fact_it_is_about(guards):
    v = guards["shop"].check("Yes, you do.", Support.of(caller="I have 60 days to return things, right?"))
    assert not v.ok and v.correction == "Actually, returns are free within 30 days."
    v = guards["isp"].check("Yes.", Support.of(caller="The Maple Heights outage will be fixed by noon, right?"))
    assert not v.ok and "3 p.m." in v.correction


def test_bench_quality_rescore_with_the_guard(tmp_path, capsys):
    from demo.cli import main

    out = tmp_path / "q.json"
    assert main(["bench", "quality", "--rescore", str(RESULTS / "quality-prompts.json"),
                 "--guard", "--out", str(out)]) == 0
    variants = json.loads(out.read_text())["variants"]
    before, after = variants["config"], variants["config+guard"]
    assert after["false_claim"] < before["false_claim"] and after["correct"] > before["correct"]
    assert after["guarded_sentences"] > 0 and after["guard_ms_per_sentence"]["sentences"] > 80
    assert "the guard held back" in capsys.readouterr().out


def test_a_price_with_a_condition_is_said_with_it(guards):
    isp, shop = guards["isp"], guards["shop"]
    v = isp.check("The technician visit costs $49.", Support.of(caller="How much will the visit cost me?"))
    assert not v.ok and v.correction == "The technician visit is $49, waived for Plus and Gigabit customers."
    assert ok(isp, "The technician visit is $49, but it's waived for Plus and Gigabit customers.")
    assert ok(isp, "The technician visit is $49 unless you have the Plus plan.")
    assert not ok(shop, "Standard shipping is $6.95.")
    assert ok(shop, "Standard shipping is $6.95, or free on orders over $50.")
    assert ok(shop, "Express shipping is $14.95.")  # no condition to say


def test_a_list_on_several_lines_is_checked_line_by_line(guards):
    plans = "Basic plan: $39.99 a month\nPlus plan: $59.99 a month\nGigabit plan: $79.99 a month"
    assert ok(guards["isp"], plans, caller="What internet plans do you have?")
    assert not ok(guards["isp"], plans.replace("$59.99", "$49.99"), caller="What internet plans do you have?")


def test_a_wrong_figure_is_corrected_by_the_fact_with_that_kind_of_figure(guards):
    """"Takes one day, right?" is answered with how many days, not with the price."""
    v = guards["shop"].check("Yes.", Support.of(caller="Express shipping takes one day, right?"))
    assert not v.ok and v.correction == "Actually, express shipping takes 2 days."


@pytest.mark.parametrize("business_key, caller, answer, why, fact", [
    ("bistro", "Is there a fee if we bring our own bottle of wine?", "No, there is no corkage fee for that.",
     "not free", "$15"),
    ("shop", "Will I pay for standard shipping on that?", "No, you won't pay for standard shipping.", "not free", "$6.95"),
])
def test_no_fee_said_of_a_priced_item_is_a_claim_that_it_is_free(guards, business_key, caller, answer, why, fact):
    v = guards[business_key].check(answer, Support.of(caller=caller))
    assert not v.ok and why in v.why and fact in v.correction
    assert ok(guards["bistro"], "The corkage fee is $15.", caller="Is there a corkage fee?")


@pytest.mark.parametrize("caller, false, true", [
    ("I ordered a rain jacket, order 48377. Has it shipped?", "Yes, the rain jacket has shipped.",
     "No, it hasn't shipped yet; it ships tomorrow."),
    ("Hi, where is my order 48213?", "Order 48213 is currently being packed.",
     "Order 48213 has shipped with UPS and arrives Thursday by 8 p.m."),
    ("And when will order 48213 arrive?", "The boots will arrive on Monday with UPS.", "It will arrive on Thursday by 8 p.m."),
])
def test_a_record_is_said_as_its_line_says(guards, caller, false, true):
    shop = guards["shop"]
    v = shop.check(false, Support.of(caller=caller))
    assert not v.ok and v.correction.startswith("Actually, order 4"), v
    assert ok(shop, true, caller=caller)
    assert ok(shop, "Order 48213 is being delivered by UPS.", caller="Which carrier is delivering order 48213?")


def test_a_no_to_a_wrong_claim_is_followed_by_the_fact(dental, guards):
    turn = TurnGuard(dental, "Dr. Moreno has a slot on Thursday, right?")
    said = turn("No, Dr. Moreno does not have a slot on Thursday.")
    assert said.startswith("No, Dr. Moreno does not have a slot on Thursday. The open slots are:") and "Wednesday" in said
    turn = TurnGuard(guards["bistro"], "Your big table seats twelve, right? We're a party of twelve.")
    assert "back room" in turn("No, the big table seats up to 8 people.")
    # A no to a right claim, or one that already says the fact, is said as it is.
    turn = TurnGuard(dental, "You're closed on Sundays, right?")
    assert turn("No, we're not open on Sundays.") == "No, we're not open on Sundays."


def test_the_callers_words_said_back_as_the_agents_claim_are_held_back(dental):
    """echo: a statement that repeats six or more of a caller's words in a row, about
    nothing the facts name, is the caller's claim in the agent's voice (the 1.5B said an LJ
    reading back, then said it again to the next readings): the fallback is said instead.
    A confirmation about the business ("... a cleaning for next Tuesday"), a question back,
    or five words in a row are spoken."""
    reading = "Produced the block books, which were the immediate predecessors of the troop printed book."
    echo = "The block-books were the immediate predecessors of the troop printed book."
    turn = TurnGuard(dental, caller=reading)
    assert turn(echo) == FALLBACK
    assert "caller's words back" in turn.guarded[0]["why"]
    later = TurnGuard(dental, caller="And it is worth mention in passing that.", earlier=[reading])
    assert later(echo) == FALLBACK  # said again to a later, unrelated turn
    booking = "I would like to book a cleaning for next Tuesday morning."
    turn = TurnGuard(dental, caller=booking)
    assert turn("You'd like to book a cleaning for next Tuesday morning.") is not None
    assert turn.guarded == []
    turn = TurnGuard(dental, caller=reading)
    assert turn("You read that the block books were the immediate predecessors of the troop printed book?") is not None
    assert turn("The immediate predecessors of the book were block books.") is not None  # five in a row at most
    assert turn.guarded == []
    assert dental.check(echo, Support.of(caller="What are your opening hours?")).ok  # not the caller's words


# ---------------------------------------------------------------- the caller's name and question


def check(guard: FactGuard, sentence: str, caller: str, earlier: tuple[str, ...] = ()):
    return guard.check(sentence, Support.of(caller=caller, earlier=earlier))


def test_saying_the_callers_name_rests_on_the_name_they_gave(dental):
    said = ("Hi, my name is Robert.", "Are you open on Saturday?")
    assert check(dental, "Your name is Robert.", "Can you tell me my name, please?", said).ok
    assert check(dental, "Yes, Robert.", "Do you remember my name?", said).ok
    # Seen with the 1.5B: the name was given two turns before.
    v = check(dental, "I'm sorry, but I don't have your name.", "Can you tell me my name, please?", said)
    assert not v.ok and v.correction == "Your name is Robert."
    v = check(dental, "Your name is John.", "What's my name?", said)
    assert not v.ok and "John" in v.why and v.correction == "Your name is Robert."
    v = check(dental, "Your name is Robert Smith.", "What's my name?", said)  # more than was given
    assert not v.ok and v.correction == "Your name is Robert."


def test_with_no_name_given_none_is_said_and_not_having_it_is_true(dental):
    said = ("Hi there.",)
    assert check(dental, "I'm sorry, but I don't have your name.", "What's my name?", said).ok
    v = check(dental, "Your name is John.", "What's my name?", said)
    assert not v.ok and v.correction == "I don't think you've told me your name yet."
    assert check(dental, "Your name is on the booking.", "Is my booking there?").ok  # no name said


def test_a_bare_price_is_about_the_callers_question_not_their_introduction(dental):
    caller = "Good morning, my name is Tom Baker. How much is a check-up?"
    assert check(dental, "$59", caller).ok  # was held back: "not about baker, morn, name"
    v = check(dental, "$89", caller)  # the cleaning's price, said for the check-up
    assert not v.ok and v.correction == "Actually, the check-up is $59."
    v = check(dental, "It's $89.", "How much is a check-up?")
    assert not v.ok and v.correction == "Actually, the check-up is $59."
    # A sentence that names its item is judged on it, whatever the caller asked.
    assert not check(dental, "A root canal is $120.", "What do a cleaning and a root canal cost?").ok
    assert check(dental, "A cleaning is $89.", "How much is a check-up?").ok


def test_an_offer_is_judged_by_the_things_it_names_not_its_generic_words(dental):
    caller = "Tell me everything about your practice."
    # Held back before, and the fallback said in the middle of the answer.
    assert check(dental, "We offer a wide range of services including cleaning, check-ups, whitening, and filling.",
                 caller).ok
    assert not check(dental, "We offer a wide range of services including braces.", caller).ok
    v = check(dental, "We offer delivery services.", caller)
    assert not v.ok and "delivery" in v.why and "services" not in v.why


def test_what_the_caller_has_booked_is_what_the_database_holds_for_them(dental, tmp_path):
    """The 1.5B told Ann Lee, whose booking had failed, "Your appointment is scheduled for
    Tuesday 10:30 a.m. with Dr. Patel." (specvoice chat; the slot was Anne Lee's)."""
    tuesday, friday = "Tuesday 10:30 a.m. with Dr. Patel", "Friday 9:00 a.m. with Dr. Patel"
    store = open_store(tmp_path / "b.sqlite", open_slots=default_business().open_slots)
    try:
        store.book(tuesday, "Anne Lee", None, call_id="call-other")
        box = ToolBox(store, "call-a")
        said = ["Hi, I'm Ann Lee. I'd like to book a cleaning."]

        def turn(caller: str) -> TurnGuard:
            return TurnGuard(dental, caller, [], box.open_slots, said, box.callers_bookings)

        claim = f"Your appointment is scheduled for {tuesday}."
        assert turn("What time is my appointment?")(claim) == "I don't see a booking under Ann Lee."
        assert box.run("book_slot", {"slot": friday, "name": "Ann Lee"}).ok
        t = turn("What time is my appointment?")
        assert t(claim) == f"Your booking is for {friday}."
        t.said.clear()
        assert t("Your appointment is on Friday at 9 a.m.") == "Your appointment is on Friday at 9 a.m."
        assert t("You're booked for Friday at 9 a.m.") == "You're booked for Friday at 9 a.m."  # a turn later
        # Under the caller's name from another call, any case: theirs too.
        other = TurnGuard(dental, "Is my booking still on?", [], box.open_slots, ["my name is anne lee"],
                          ToolBox(store, "call-b").callers_bookings)
        assert other(f"Yes, your booking is for {tuesday}.") == f"Yes, your booking is for {tuesday}."
        # A cancelled booking is none.
        store.cancel("Ann Lee", slot=friday)
        assert turn("Is it still on?")("Your appointment is on Friday at 9 a.m.") == "I don't see a booking under Ann Lee."
        # No database behind the turn: nothing to judge it by.
        assert TurnGuard(dental, "When is it?", [], None, said)(claim) == claim
    finally:
        store.close()


def test_a_waived_price_is_not_given_as_the_price_of_those_it_is_waived_for():
    isp = FactGuard(business("isp"))
    said = ("Hi, this is Priya. My internet is down.", "Can a technician come out? I'm on the Plus plan.")
    # Seen with the 1.5B (specvoice chat): the visit is waived for Plus customers.
    v = check(isp, "Priya, the cost of a technician visit for Plus and Gigabit customers is $49.",
              "How much would that cost me?", said)
    assert not v.ok and v.correction == "The technician visit is $49, waived for Plus and Gigabit customers."
    assert check(isp, "A technician visit is $49, but it's waived for Plus and Gigabit customers.",
                 "How much would that cost me?", said).ok
    assert check(isp, "A technician visit is free for Plus and Gigabit customers.", "How much is a visit?").ok
    assert check(isp, "For Basic customers a technician visit is $49.", "How much is a technician visit?").ok


def test_a_sum_said_of_the_callers_record_must_be_on_its_line():
    shop = FactGuard(business("shop"))
    said = ("Hi, my name is Omar. Where is my order 48213?",)
    # "Your order" is the one the caller named earlier; its line has no sum (specvoice chat).
    v = check(shop, "Yes, your order was over $50, so shipping is free.", "My order was over 50 dollars, right?", said)
    assert not v.ok and "$50" in v.why
    assert check(shop, "Yes, shipping is free on orders over $50.", "Is shipping free?", said).ok
    assert check(shop, "Your order shipped on Monday with UPS.", "Where is it?", said).ok


def test_one_price_for_items_together_must_be_their_sum(dental):
    caller = "How much is a cleaning and a whitening together?"
    v = check(dental, "The price of a cleaning and a whitening together is $249.", caller)  # seen: the whitening's
    assert not v.ok and v.correction == "The cleaning is $89, and the whitening is $249."
    assert check(dental, "A cleaning and a whitening together come to $338.", caller).ok
    assert check(dental, "A cleaning is $89 and a whitening is $249.", caller).ok


def test_a_lowest_price_is_said_as_one(dental):
    v = check(dental, "The cost of a filling is $120.", "I need a filling. How much is it exactly?")  # seen
    assert not v.ok and v.correction == "The filling is from $120."
    assert check(dental, "A filling starts at $120.", "How much is a filling?").ok
    assert check(dental, "Fillings are from $120.", "How much is a filling?").ok  # a plural was no topic before


@pytest.mark.parametrize("words", [("fillings", "filling", "fill"), ("services", "service"),
                                   ("closes", "closed", "closing", "close"), ("deliveries", "delivery"),
                                   ("boxes", "box"), ("prices", "price")])
def test_a_words_forms_are_one_topic(words):
    assert len({topic_words(w) for w in words}) == 1


def test_a_booking_told_in_other_words_is_judged_too(dental):
    """ "Your check-up is scheduled for Wednesday at 2:15 p.m." to a caller with no booking
    (specvoice chat): their name came from "under Nora Bell"."""
    caller = "Hello, I booked a check-up last week under Nora Bell. When is it?"
    v = dental.check("Your check-up is scheduled for Wednesday at 2:15 p.m. with Dr. Moreno.",
                     Support.of(caller=caller, booked=[]))
    assert not v.ok and v.correction == "I don't see a booking under Nora Bell."
    assert dental.check("Your check-up is scheduled for Wednesday at 2:15 p.m. with Dr. Moreno.",
                        Support.of(caller=caller, booked=["Wednesday 2:15 p.m. with Dr. Moreno"])).ok


def test_a_name_the_caller_corrected_is_theirs(dental):
    said = ("Hi, my name is Robert.", "Actually, it's Rob, not Robert.")
    assert check(dental, "Your name is Rob.", "What's my name?", said).ok
    assert not check(dental, "Your name is Bob.", "What's my name?", said).ok


def test_a_confirmed_booking_is_said_when_the_database_holds_it(dental):
    """ "Can you confirm my booking?" got the fallback for "confirm" (specvoice chat)."""
    wednesday = "Wednesday 2:15 p.m. with Dr. Moreno"
    claim = f"Yes, your booking for {wednesday} is confirmed."
    said = ("My name is Lena Ortiz.",)
    assert dental.check(claim, Support.of(caller="Can you confirm my booking?", earlier=said, booked=[wednesday])).ok
    v = dental.check(claim, Support.of(caller="Can you confirm my booking?", earlier=said, booked=[]))
    assert not v.ok and v.correction == "I don't see a booking under Lena Ortiz."
    # An offer or a question about a booking claims none.
    assert dental.check("I can book your appointment for Tuesday at 10:30 a.m.", Support.of(booked=[])).ok
    assert dental.check("Would you like your appointment on Tuesday?", Support.of(booked=[])).ok


def test_a_yes_to_a_slot_asked_by_its_part_of_the_day_is_the_slot_rules(dental):
    caller = "Do you have anything on Tuesday morning?"  # "morning" was held back as no fact
    assert check(dental, "Yes, Dr. Patel is available on Tuesday morning at 10:30 a.m.", caller).ok
    assert not check(dental, "Yes, Dr. Patel is available on Tuesday afternoon at 3 p.m.", caller).ok


OFFERED = "One moment, please. I can book Wednesday 2:15 p.m. with Dr. Moreno for you. May I have your name?"


def test_that_is_the_slot_the_agent_just_named(dental):
    """ "Is that with Dr. Patel?" after the Wednesday slot with Dr. Moreno was offered got
    "Yes, that's with Dr. Patel." (specvoice chat): "that" is the slot just named, and what
    is said of it must fit it: its doctor, day and time."""
    turn = TurnGuard(dental, "Is that with Dr. Patel?", agent_before=OFFERED)
    assert turn("Yes, that's with Dr. Patel.") == "Actually, that's Wednesday 2:15 p.m. with Dr. Moreno."
    assert "slot just named" in turn.guarded[0]["why"]
    for caller, sentence in [("Is that with Dr. Moreno?", "Yes, that's with Dr. Moreno."),
                             ("Is it on Wednesday?", "Yes, it's on Wednesday at 2:15 p.m."),
                             ("Who is that with?", "That's with Dr. Moreno."),
                             ("Which doctor is that one with?", "That one is with Dr. Moreno.")]:
        assert TurnGuard(dental, caller, agent_before=OFFERED)(sentence) == sentence
    assert TurnGuard(dental, "Who is that with?", agent_before=OFFERED)("That's with Dr. Patel.") != "That's with Dr. Patel."
    assert TurnGuard(dental, "Is it on Tuesday?", agent_before=OFFERED)("Yes.") != "Yes."
    assert TurnGuard(dental, "Which doctor is that one with?", agent_before=OFFERED)(
        "That one is with Dr. Patel.") != "That one is with Dr. Patel."
    # A caller who asks about something else: "that" is not the slot.
    assert TurnGuard(dental, "What time do you close on Friday?", agent_before=OFFERED)(
        "That is 6 p.m. on Friday.") == "That is 6 p.m. on Friday."
    # As a call builds it: from the history's (caller, agent) exchanges.
    from pipeline.receptionist.guard import turn_guard

    result = LLMResult()
    turn = turn_guard(dental, "Is that with Dr. Patel?", result, None, [("Can I get Wednesday?", OFFERED)])
    assert turn("Yes, that's with Dr. Patel.") != "Yes, that's with Dr. Patel." and result.guarded
    # Nothing named before: no rule to apply.
    assert TurnGuard(dental, "Is that with Dr. Patel?")("Yes, that's with Dr. Patel.") == "Yes, that's with Dr. Patel."


def test_a_question_ending_in_a_name_is_not_cut_at_a_tag(dental):
    """ "Is that with Dr. Moreno?" was read as "is that with dr more" + the tag "no?", and
    its yes held back for a dentist the facts do not have."""
    assert check(dental, "Yes, that's with Dr. Moreno.", "Is that with Dr. Moreno?").ok
    assert not check(dental, "Yes.", "You're open on Sundays, no?").ok  # a real tag still is one


def test_a_sum_alone_answers_a_question_about_two_prices(dental):
    """ "$148." to "How much for a cleaning and a check-up together?" ($89 + $59) was held
    back as not the cleaning's price (specvoice chat). Another figure still is."""
    for caller in ("How much for a cleaning and a check-up together?", "How much for a cleaning and a check-up?"):
        assert check(dental, "$148.", caller).ok
        assert not check(dental, "$150.", caller).ok
    assert not check(dental, "$148.", "How much is a cleaning?").ok


def test_the_friday_one_is_a_slot_not_the_figure_one(dental):
    """ "Is the Friday one free again now?" was judged as claiming the figure 1, and its true
    yes replaced with the opening hours (specvoice chat)."""
    assert "friday ones" in normalize("Is the Friday one free again now?")
    assert normalize("A table for one at one pm.") == "a table for 1 at 1 pm."
    friday = "Friday 9:00 a.m. with Dr. Patel"
    yes = f"Yes, the {friday} slot is now free."
    assert dental.check(yes, Support.of(caller="Is the Friday one free again now?", slots=[friday])).ok
    assert not dental.check(yes, Support.of(caller="Is the Friday one free again now?", slots=[])).ok


def test_a_slot_claim_is_judged_by_its_doctor_however_named(dental):
    """ "Yes, Dr. Priya Patel will be available on Tuesday at 10:30 a.m." (true) was held back:
    the slot says "Dr. Patel", and "priya" is not in it. And "Dr. Moreno is available on
    Friday at 9:00 a.m. with Dr. Patel." (Friday is Dr. Patel's) passed: with two doctors
    named, none was checked (specvoice chat)."""
    tuesday = "Do you have anything on Tuesday?"
    assert check(dental, "Yes, Dr. Priya Patel will be available on Tuesday at 10:30 a.m.", tuesday).ok
    assert not check(dental, "Yes, Dr. Luis Moreno will be available on Tuesday at 10:30 a.m.", tuesday).ok
    assert not check(dental, "Dr. Moreno is available on Friday at 9:00 a.m. with Dr. Patel.", "What about Friday?").ok
    assert not check(dental, "Dr. Patel and Dr. Moreno are available on Friday.", "Who is free on Friday?").ok
    # A list of days and doctors is several slots: each as it is.
    assert check(dental, "Dr. Patel is available on Tuesday and Friday, and Dr. Moreno on Wednesday.", "Who is free?").ok
    assert check(dental, "We have slots available on Tuesday 10:30 a.m. with Dr. Patel and Wednesday 2:15 p.m. with "
                         "Dr. Moreno.", "What times do you have this week?").ok  # bench tools
    turn = TurnGuard(dental, "Is that with Dr. Priya?", agent_before="I can book Tuesday 10:30 a.m. with Dr. Patel for you.")
    assert turn("Yes, that's with Dr. Priya Patel.") == "Yes, that's with Dr. Priya Patel."


def test_it_asked_of_a_record_named_earlier_is_that_record():
    """ "What's the status of order 48377?" (still being packed, ships tomorrow), then "Is it
    shipped?" got "Yes, it is shipped." (specvoice chat, shop): "it" is the order named
    earlier in the call, and "is shipped" a status its line must have."""
    shop = FactGuard(business("shop"))
    said = ("What's the status of order 48377?",)
    v = check(shop, "Yes, it is shipped.", "Is it shipped?", said)
    assert not v.ok and "shipped" in v.why and v.correction and "48377" in v.correction
    assert check(shop, "No, it ships tomorrow.", "Is it shipped?", said).ok
    assert check(shop, "Yes, it is shipped.", "Is it shipped?", ("Where is my order 48213?",)).ok  # 48213 shipped


def test_a_doctors_days_must_be_in_the_facts_or_the_slots(dental):
    """ "Is Dr. Moreno in on Fridays?" got "Yes, Dr. Moreno is in on Fridays." (specvoice
    chat): the facts name the dentists, not their days, and Friday's slot is Dr. Patel's."""
    fridays = "Is Dr. Moreno in on Fridays?"
    for said in ("Yes, Dr. Moreno is in on Fridays.", "Yes.", "Dr. Luis Moreno is in on Friday."):
        v = check(dental, said, fridays)
        assert not v.ok and "Moreno" in v.why
        assert v.correction == "I can't confirm which days Dr. Moreno is in; Dr. Moreno's open slot is Wednesday 2:15 p.m."
    # A day one of the doctor's slots is on backs it; saying it is not is what is wrong then.
    assert check(dental, "Yes, Dr. Priya Patel is in on Friday.", "Is Dr. Patel in on Fridays?").ok
    v = check(dental, "No, Dr. Patel isn't in on Fridays.", "Is Dr. Patel in on Fridays?")
    assert not v.ok and v.correction == "Actually, Dr. Patel has an open slot on Friday 9:00 a.m."
    assert check(dental, "No, Dr. Moreno is not in on Fridays.", fridays).ok
    # Days from the database's slots at that moment, and from the facts when they say them.
    thursday = Support.of(caller="Is Dr. Moreno in on Thursday?", slots=["Thursday 4:00 p.m. with Dr. Moreno"])
    assert dental.check("Dr. Moreno is in on Thursday.", thursday).ok
    days = default_business().model_copy(update={"facts": ["Dr. Luis Moreno works Mondays and Fridays"]})
    assert check(FactGuard(days), "Yes, Dr. Moreno is in on Fridays.", fridays).ok


def test_your_figure_is_of_the_item_the_caller_said_is_theirs(guards):
    """ "Your internet speed is currently 500 Mbps" was said to a caller on the Gigabit plan
    (specvoice chat, isp): the sentence names no plan, but "your" is the one the caller named."""
    isp = guards["isp"]
    gigabit = ("Hi, I'm on the Gigabit plan and my internet is slow.",)
    v = check(isp, "Your internet speed is currently 500 Mbps.", "What speed should I get?", gigabit)
    assert not v.ok and "Plus" in v.why and v.correction == "The Gigabit plan is $79.99 a month."
    plus = ("Hi, I'm on the Plus plan and my internet is slow.",)
    assert check(isp, "Your internet speed should be 500 Mbps.", "What speed should I get?", plus).ok
    assert not check(isp, "Your plan gives you 500 Mbps.", "What speed do I get?", ("I'm on the Basic plan.",)).ok
    # Two plans named, or none: whose figure it is cannot be told, so it is not judged this way.
    assert check(isp, "Your speed is 500 Mbps.", "What speed do I have?", ("I'm on Plus. Is Gigabit faster?",)).ok
    assert check(isp, "Your speed is 500 Mbps.", "What speed do I have?").ok


def test_a_lowest_price_is_not_called_exact(dental):
    """ "The filling is from $120." then "Is that the exact price?" got "Yes, that is the exact
    price." (specvoice chat): "from $120" is where the price starts."""
    before = "The filling is from $120."
    for said in ("Yes, that is the exact price.", "Yes."):
        v = dental.check(said, Support.of(caller="Is that the exact price?", agent_before=before))
        assert not v.ok and v.correction == "The filling is from $120: that is where its price starts."
    assert not ok(dental, "The exact price of a filling is $120.", "How much is a filling exactly?")
    # A price that is a price may be called exact.
    assert dental.check("Yes, that is the exact price.",
                        Support.of(caller="Is that the exact price?", agent_before="A cleaning is $89.")).ok


def test_a_slot_named_by_day_and_time_has_only_its_own_doctor(dental):
    """ "Dr. Moreno will be performing a check-up on Tuesday 10:30 a.m. with Dr. Patel." was
    said of Dr. Patel's slot (specvoice chat): no "available", so the slot rule did not look."""
    v = check(dental, "Dr. Moreno will be performing a check-up on Tuesday 10:30 a.m. with Dr. Patel.",
              "What does he have then?")
    assert not v.ok and v.why == "names Dr. Moreno on Tuesday 10:30 a.m. with Dr. Patel"
    assert v.correction == "Actually, that slot is Tuesday 10:30 a.m. with Dr. Patel."
    assert check(dental, "Your appointment on Tuesday at 10:30 a.m. is with Dr. Patel.", "With whom?").ok
    assert check(dental, "Dr. Patel on Tuesday at 10:30 a.m. and Dr. Moreno on Wednesday at 2:15 p.m.", "Who?").ok


def test_a_figure_on_another_items_fact_line_is_not_the_asked_items(guards):
    """ "How long does standard shipping take?" got "2 days" (specvoice chat, shop): the facts
    say express shipping takes 2 days, and nothing of standard shipping's time."""
    shop = guards["shop"]
    for said in ("2 days", "Standard shipping takes 2 days."):
        v = check(shop, said, "How long does standard shipping take?")
        assert not v.ok and "express shipping" in v.why
        assert v.correction == "The standard shipping is free over $50, otherwise $6.95."
    assert check(shop, "2 days", "How long does express shipping take?").ok
    assert check(shop, "Express shipping takes 2 days.", "How long does standard shipping take?").ok


def test_a_price_waived_for_the_callers_plan_is_free_for_them(guards):
    """ "No, you do not pay for a technician visit." to "I'm on the Plus plan. Do I pay for a
    technician visit?" was held back as a claim that the visit is free (specvoice chat, isp):
    it is waived for Plus and Gigabit customers, and the caller said they are one."""
    isp = guards["isp"]
    no = "No, you do not pay for a technician visit."
    assert check(isp, no, "I'm on the Plus plan. Do I pay for a technician visit?").ok
    assert not check(isp, no, "Do I pay for a technician visit?", ("I'm on the Basic plan.",)).ok
    assert not check(isp, no, "Do I pay for a technician visit?").ok


def test_the_fallback_the_model_said_is_not_said_again(guards):
    """The model said the fallback, then "Please try again later.", held back and replaced by
    the fallback: the caller heard it twice in one answer (specvoice chat, isp)."""
    turn = TurnGuard(guards["isp"], "Can you send a technician? I'm on the Basic plan.")
    said = [turn(x) for x in ("I'm not sure about that.", "I can take a message and have someone call you back.",
                              "Please try again later.")]
    assert said == ["I'm not sure about that.", "I can take a message and have someone call you back.", None]
    assert turn.guarded[0]["sentence"] == "Please try again later." and turn.guarded[0]["said"] is None


def test_the_price_below_a_limit_is_not_the_price_over_it(guards):
    """ "How much is shipping on a $60 order?" got "$6.95" (specvoice chat, shop): standard
    shipping is free over $50; $6.95 is what a smaller order pays."""
    shop = guards["shop"]
    v = check(shop, "$6.95", "How much is shipping on a $60 order?")
    assert not v.ok and v.correction == "The standard shipping is free on orders over $50."
    assert check(shop, "$6.95", "How much is shipping on a $40 order?").ok
    assert check(shop, "It's free, since your order is over $50.", "How much is shipping on a $60 order?").ok
    assert check(shop, "Express shipping is $14.95.", "How much is shipping on a $60 order?").ok


def test_the_callers_number_is_the_one_they_gave(dental):
    """ "Hi, I'm Leo Grant, 555-0199. Book me Friday at 9." then "What's my phone number on
    file?" got "555-0142", the practice's own number (specvoice chat)."""
    gave = ("Hi, I'm Leo Grant, 555-0199. Book me Friday at 9.",)
    v = check(dental, "555-0142", "What's my phone number on file?", gave)
    assert not v.ok and v.correction == "The number you gave me is 555-0199."
    assert check(dental, "Your number is 555-0199.", "What's my phone number on file?", gave).ok
    v = check(dental, "Your number is 555-0142.", "What's my number?")
    assert not v.ok and v.correction == "I don't think you've given me your number yet."
    assert check(dental, "Our number is 555-0142.", "What's your phone number?", gave).ok


def test_two_prices_apart_are_the_difference_of_the_two(dental):
    """ "The price of whitening is $249, which is $160 more than the price of a cleaning." was
    held back (specvoice chat): $249 - $89 is $160."""
    said = "The price of whitening is $249, which is $160 more than the price of a cleaning."
    assert check(dental, said, "How much more is a whitening than a cleaning?").ok
    assert not check(dental, said.replace("$160", "$150"), "How much more is a whitening than a cleaning?").ok
    assert check(dental, "A whitening is $160 more than a cleaning.", "How much more is a whitening?").ok


def test_an_orders_arrival_and_carrier_are_its_own_lines(guards):
    """ "When will order 48377 arrive?" got "The rain jacket will arrive tomorrow." (it ships
    tomorrow), then "Which carrier will it use?" "It will use UPS." (UPS is order 48213's):
    specvoice chat, shop."""
    shop = guards["shop"]
    v = check(shop, "The rain jacket will arrive tomorrow.", "When will order 48377 arrive?")
    assert not v.ok and "no arrival" in v.why and "48377" in v.correction
    said = ("When will order 48377 arrive?",)
    v = check(shop, "It will use UPS.", "Which carrier will it use?", said)
    assert not v.ok and "ups" in v.why
    assert check(shop, "It ships tomorrow.", "When will it arrive?", said).ok
    assert check(shop, "It has no tracking number yet.", "What's the tracking number?", said).ok
    assert check(shop, "It ships with UPS and arrives Thursday by 8 p.m.", "Which carrier?", ("Where is order 48213?",)).ok
    assert check(shop, "Order 48213 will arrive on Thursday by 8 p.m.", "When will order 48213 arrive?").ok


def test_two_monthly_prices_apart(guards):
    """ "The price difference between the Basic and Gigabit plans is $40 per month." (true:
    $79.99 - $39.99) was held back (specvoice chat, isp)."""
    isp = guards["isp"]
    q = "What's the price difference between Basic and Gigabit?"
    assert check(isp, "The price difference between the Basic and Gigabit plans is $40 per month.", q).ok
    assert not check(isp, "The price difference between the Basic and Gigabit plans is $30 per month.", q).ok
