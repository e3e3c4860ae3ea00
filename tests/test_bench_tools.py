"""`specvoice bench tools`: the dialogue set fits the business config, and the scoring is
right. Dialogues are played through the real turn loop (respond + the tool step) with the
real ToolBox on a SQLite file; the LLM is a scripted backend writing the tool calls (a
tiny random model cannot be made to call tools). The real models run in the bench, not here."""

from __future__ import annotations

import json

import pytest

from callfakes import ScriptedBackend
from bench.tools import (
    DIALOGUES,
    KINDS,
    Dialogue,
    FinalState,
    Setup,
    dialogue_problems,
    load_dialogues,
    play,
    resolve_slot,
    score,
    seeded_store,
    summarize,
)
from llm.types import SamplingParams
from pipeline.config import load_config

pytestmark = pytest.mark.timeout(120)

LABELS = list(load_config("default").business.open_slots)
# A call that greets, the model writing its tool calls (no plan), no hold line, as the scripts expect.
_test = load_config("test")
SCRIPTED = _test.model_copy(update={
    "agent": _test.agent.model_copy(update={"greeting": "Hello."}),
    "tools": _test.tools.model_copy(update={"enabled": True, "plan": False, "hold_line": ""}),
    "pipeline": _test.pipeline.model_copy(update={"first_clause": False}),
})
T, W, F = LABELS


@pytest.fixture(scope="module")
def dialogues() -> dict[str, Dialogue]:
    return {d.id: d for d in load_dialogues()}


def call(tool: str, /, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def script(*turns: list[str]):
    """A backend reply: turn t (counted by the caller's lines), round r (the assistant
    messages after that line) -> turns[t][r], the last round repeated."""
    def reply(messages: list[dict]) -> list[str]:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        rounds = turns[len(users) - 1]
        r = sum(1 for m in messages[users[-1] + 1:] if m["role"] == "assistant")
        text = rounds[min(r, len(rounds) - 1)]
        return [text[i:i + 5] for i in range(0, len(text), 5)]
    return reply


async def played(d: Dialogue, tmp_path, *turns: list[str]) -> tuple[dict, dict]:
    # A fresh database each play, as the bench gives each dialogue.
    store = seeded_store(tmp_path / f"{d.id}-{len(list(tmp_path.glob('*.sqlite')))}.sqlite", d, LABELS)
    try:
        run = await play(d, ScriptedBackend(reply=script(*turns)), store,
                         Setup(SCRIPTED, LABELS, SamplingParams(), prompt="You are the receptionist."))
    finally:
        store.close()
    return run, score(d, run, LABELS)


# ---------------------------------------------------------------- the data file


def test_every_dialogue_fits_the_business_config(dialogues):
    assert dialogue_problems(list(dialogues.values()), LABELS) == []
    assert len(dialogues) >= 20
    kinds = {d.kind for d in dialogues.values()}
    assert kinds >= {"conflict", "nonexistent", "cancel", "change_mind", "message", "transfer", "strange_name"}
    assert kinds <= set(KINDS)
    for d in dialogues.values():
        if d.kind == "conflict":
            assert d.seed, d.id  # a conflict needs the slot taken before the call
        if d.kind == "nonexistent":
            assert d.nonexistent_slots and all(resolve_slot(s, LABELS) is None for s in d.nonexistent_slots), d.id
        if d.kind == "cancel":
            assert d.seed, d.id  # something to cancel
        # A seeded booking not cancelled by an expected call is still there at the end.
        cancelled = {c["args"]["slot"] for c in d.expect["calls"] if c["tool"] == "cancel_booking"}
        for s in d.seed:
            assert s["slot"] in cancelled or d.expect["bookings"].get(s["slot"]) == s["name"], d.id


def test_problems_are_found():
    bad = Dialogue("x", "book", ["Book Monday."], [{"slot": "Monday 9 a.m.", "name": "A"}],
                   {"calls": [{"tool": "book_slot", "args": {"slot": "Monday 9 a.m.", "day": "Monday"}},
                              {"tool": "book_table", "args": {}}],
                    "bookings": {"Monday 9 a.m.": "A"}, "messages": []},
                   nonexistent_slots=["Tuesday"])
    problems = " | ".join(dialogue_problems([bad, bad], LABELS))
    for expected in ("id used 2 times", "seed slot 'Monday 9 a.m.'", "expected booking at 'Monday 9 a.m.'",
                     "'day' is not an argument of book_slot", "unknown tool 'book_table'",
                     "expected call's slot 'Monday 9 a.m.'", "'non-existent' slot 'Tuesday' names"):
        assert expected in problems


def test_slots_are_read_as_the_database_reads_them():
    assert resolve_slot("tuesday 10:30 am with dr patel", LABELS) == T
    assert resolve_slot("Friday 9 a.m.", LABELS) == F and resolve_slot("Wednesday", LABELS) == W
    assert resolve_slot("Dr. Patel", LABELS) is None  # two slots: not the right one
    assert resolve_slot("Monday 9 a.m.", LABELS) is None and resolve_slot(None, LABELS) is None


# ---------------------------------------------------------------- scoring played dialogues


async def test_conflict_then_the_offered_slot_scores_right(dialogues, tmp_path):
    d = dialogues["conflict_tuesday_taken"]
    run, v = await played(d, tmp_path,
                          [call("book_slot", slot="Tuesday 10:30", name="Ben Carter"),
                           "Sorry, Tuesday is taken. Wednesday at 2:15 is open."],
                          [call("book_slot", slot="wednesday 2:15 pm", name="ben carter"), "You're booked, Ben."])
    assert v["state_ok"] and v["tools_ok"], v
    assert v["calls"] == 2 and v["failed_calls"] == 1 and v["malformed_calls"] == 0  # the refusal
    assert v["double_bookings"] == 0 and v["fallbacks"] == 0
    assert run["state"]["bookings"] == [{"slot": T, "name": "Priya Shah", "phone": None},
                                        {"slot": W, "name": "ben carter", "phone": None}]
    first, second = run["turns"]
    assert first["tool_calls"][0]["ok"] is False and "already booked" in first["tool_calls"][0]["error"]
    assert first["agent"] == "Sorry, Tuesday is taken. Wednesday at 2:15 is open."
    assert first["first_sentence_s"] is not None and first["answer_after_tool_s"] is not None


async def test_a_wrong_slot_scores_wrong(dialogues, tmp_path):
    d = dialogues["conflict_tuesday_taken"]
    _, v = await played(d, tmp_path, ["Which other day?"],
                        [call("book_slot", slot="Friday 9:00 a.m.", name="Ben Carter"), "Booked."])
    assert not v["state_ok"] and not v["tools_ok"]
    assert any("unexpected booking Friday" in p for p in v["state_problems"])
    assert any("missing booking Wednesday" in p for p in v["state_problems"])
    assert any(p.startswith("missing call book_slot") for p in v["tool_problems"])
    assert any(p.startswith("unexpected call book_slot") for p in v["tool_problems"])


async def test_a_wrong_name_scores_wrong(dialogues, tmp_path):
    d = dialogues["strange_name_irish"]
    _, v = await played(d, tmp_path, [call("book_slot", slot="Wednesday", name="Siobhan Ni Bhriain"), "Done."])
    assert not v["state_ok"] and not v["tools_ok"]  # stored as heard: the accents are the name
    _, v = await played(dialogues["strange_name_nahuatl"], tmp_path,
                        [call("book_slot", slot="Friday 9 am", name="xochitl  QUETZAL-yañez"), "Done."])
    assert v["state_ok"] and v["tools_ok"]  # case and spacing aside


async def test_booking_both_slots_when_the_caller_changed_their_mind_scores_wrong(dialogues, tmp_path):
    d = dialogues["change_mind_after_booking"]
    _, v = await played(d, tmp_path,
                        [call("book_slot", slot=T, name="Leo Martin"), "Booked."],
                        [call("book_slot", slot=F, name="Leo Martin"), "Friday it is."])
    assert not v["state_ok"] and not v["tools_ok"]
    assert v["tool_problems"] == ["missing call cancel_booking " + json.dumps({"slot": T, "name": "Leo Martin"})]
    _, v = await played(d, tmp_path,
                        [call("book_slot", slot=T, name="Leo Martin"), "Booked."],
                        [call("cancel_booking", slot="Tuesday", name="Leo Martin"),
                         call("book_slot", slot="Friday", name="Leo Martin"), "Friday it is."])
    assert v["state_ok"] and v["tools_ok"], v


async def test_the_right_call_refused_by_the_tool_box_scores_wrong(dialogues, tmp_path):
    """book_slot with the right slot and name but an argument the tool does not have
    (refused); the call booked nothing, so neither the state nor the tools are right."""
    _, v = await played(dialogues["book_tuesday"], tmp_path,
                        [call("book_slot", slot=T, name="Ann Lee", phone_number="555"),
                         "I'm sorry, I can't help you with that."])
    assert not v["state_ok"] and not v["tools_ok"] and v["matched_calls"] == 0 and v["malformed_calls"] == 1
    assert v["tool_problems"][0].startswith("call book_slot") and "not an argument" in v["tool_problems"][0]


def test_a_double_booking_is_counted_and_scores_wrong(dialogues):
    """The database's unique index forbids it; if a store ever let one through, the bench
    must say so, not pass it."""
    d = dialogues["book_tuesday"]
    state = FinalState([{"slot": T, "name": "Ann Lee", "phone": None}, {"slot": T, "name": "Bo Diaz", "phone": None}],
                       [], [])
    run = {"turns": [{"tool_calls": [{"name": "book_slot", "arguments": {"slot": T, "name": "Ann Lee"}, "ok": True,
                                      "error": None}], "fallback": False, "action": None}],
           "state": state.__dict__}
    v = score(d, run, LABELS)
    assert v["double_bookings"] == 1 and not v["state_ok"] and v["tools_ok"]


async def test_a_message_nobody_asked_for_and_a_fallback(dialogues, tmp_path):
    d = dialogues["hours_no_tool"]
    _, v = await played(d, tmp_path, [call("take_message", name="Caller", text="hours"), "Noted."])
    assert not v["state_ok"] and not v["tools_ok"]
    assert v["state_problems"] == ["unexpected message from Caller: hours"]
    _, v = await played(d, tmp_path, ['<tool_call>\n{"name": "check_slots", "arguments": {"day": }\n</tool_call>'])
    assert v["fallbacks"] == 1 and v["malformed_calls"] == 2 and v["state_ok"]


async def test_a_transfer_ends_the_dialogue(dialogues, tmp_path):
    d = dialogues["transfer_pain"]
    run, v = await played(d, tmp_path, [call("transfer_to_human", reason="pain after a filling")])
    assert v["state_ok"] and v["tools_ok"] and v["action"] == "transfer"
    assert run["turns"][0]["agent"] == "Let me transfer you now."
    # No transfer where one was expected: wrong tools.
    _, v = await played(d, tmp_path, ["I'm sorry to hear that. Please come in."])
    assert not v["tools_ok"] and "call action None (expected transfer)" in v["tool_problems"]


async def test_message_is_checked_by_its_words(dialogues, tmp_path):
    d = dialogues["message_crown"]
    _, v = await played(d, tmp_path, [call("take_message", name="Fatima Noor",
                                           text="Please call back about the Crown.", callback="555-0123"), "Done."])
    assert v["state_ok"] and v["tools_ok"]
    _, v = await played(d, tmp_path, [call("take_message", name="Fatima Noor", text="call back"), "Done."])
    assert not v["state_ok"] and not v["tools_ok"]


async def test_summary_and_rescore(dialogues, tmp_path, capsys):
    from demo.cli import main

    rows = []
    for did, turns in (("transfer_person", [[call("transfer_to_human", reason="wants a person")]]),
                       ("hours_no_tool", [["We open at 9 a.m. on Saturday."]])):
        run, v = await played(dialogues[did], tmp_path, *turns)
        rows.append({"id": did, "kind": dialogues[did].kind, "run": run, "verdict": v})
    s = summarize(rows)
    assert s["dialogues"] == 2 and s["state_ok"] == 1.0 and s["tools_ok"] == 1.0 and s["double_bookings"] == 0
    assert s["tool_turns"] == 1 and s["plain_turns"] == 1
    fs = s["latency"]["first_sentence_s"]
    assert fs["ratio"] == pytest.approx(fs["tool_turns"] / fs["plain_turns"])
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"models": {}, "slots": LABELS, "summary": s, "dialogues": rows}))
    out = tmp_path / "rescored.json"
    assert main(["bench", "tools", "--rescore", str(saved), "--out", str(out)]) == 0
    assert "right final state" in capsys.readouterr().out
    assert json.loads(out.read_text())["summary"]["state_ok"] == 1.0


def test_data_file_is_the_default():
    assert DIALOGUES.name == "booking_dialogues.json" and DIALOGUES.exists()
