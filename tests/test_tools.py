"""The receptionist's tools (pipeline/receptionist/tools.py): schemas from the argument models, each
tool's effect on the database, and every malformed call answered with ok=False and a
sentence the model can act on, never an exception."""

from __future__ import annotations

import json
import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from pipeline.receptionist.bookings import DatabaseError, open_store
from pipeline.receptionist.tools import TOOL_SCHEMAS, TOOLS, ToolBox, ToolOutcome
from threadrace import race

SLOTS = ["Tuesday 10:30 a.m. with Dr. Patel", "Wednesday 2:15 p.m. with Dr. Moreno", "Friday 9:00 a.m. with Dr. Patel"]
TUESDAY, WEDNESDAY, FRIDAY = SLOTS
NAMES = ["check_slots", "book_slot", "cancel_booking", "take_message", "transfer_to_human", "end_call"]


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "bookings.sqlite", open_slots=SLOTS) as opened:
        yield opened


@pytest.fixture
def box(store):
    return ToolBox(store, call_id="call-1", caller="+15550100")


# ---------------------------------------------------------------- schemas


def test_schemas_are_the_argument_models():
    assert [s["function"]["name"] for s in TOOL_SCHEMAS] == NAMES == list(TOOLS)
    for schema in TOOL_SCHEMAS:
        assert schema["type"] == "function"
        function = schema["function"]
        model = TOOLS[function["name"]].arguments
        params = function["parameters"]
        assert function["description"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert list(params["properties"]) == list(model.model_fields)
        assert sorted(params.get("required", [])) == sorted(n for n, f in model.model_fields.items() if f.is_required())
        for prop in params["properties"].values():
            assert prop["type"] in ("string", "integer") and prop["description"]  # no anyOf-null noise
        assert "title" not in json.dumps(schema)
    by_name = {s["function"]["name"]: s["function"]["parameters"] for s in TOOL_SCHEMAS}
    assert by_name["book_slot"]["required"] == ["slot", "name"]
    assert by_name["end_call"]["properties"] == {}


# ---------------------------------------------------------------- what the tools do


def test_check_book_cancel_message_round_trip(box, store):
    slots = box.run("check_slots", "{}")
    assert slots.ok and slots.result == {"open_slots": SLOTS} and slots.action is None
    tuesday = box.run("check_slots", {"day": "Tuesday"})
    assert tuesday.result["open_slots"] == [TUESDAY]

    name = "Siobhán  Ó Fearghaíl"  # spelled as heard, two spaces and all
    booked = box.run("book_slot", json.dumps({"slot": "Friday 9 a.m.", "name": name, "phone": "555 0101"}))
    assert booked.ok and booked.error is None
    assert booked.result == {"booked": True, "booking_id": booked.result["booking_id"], "slot": FRIDAY,
                             "name": name, "phone": "555 0101"}
    [row] = store.bookings()
    assert (row.name, row.phone, row.call_id, row.caller) == (name, "555 0101", "call-1", "+15550100")
    assert box.run("check_slots", "").result["open_slots"] == [TUESDAY, WEDNESDAY]

    cancelled = box.run("cancel_booking", {"name": "siobhán ó fearghaíl", "slot": FRIDAY})
    assert cancelled.ok and cancelled.result["slot_open_again"] and cancelled.result["name"] == name
    assert store.bookings()[0].cancelled_at

    message = box.run("take_message", {"name": name, "text": "Please call about a crown", "callback": "after 5"})
    assert message.ok and message.result["message_taken"]
    [stored] = store.messages()
    assert (stored.name, stored.text, stored.callback, stored.call_id) == (
        name, "Please call about a crown", "after 5", "call-1")


def test_transfer_and_end_call_set_the_action(box):
    transfer = box.run("transfer_to_human", '{"reason": "billing dispute"}')
    assert transfer.ok and transfer.action == "transfer" and transfer.reason == "billing dispute"
    end = box.run("end_call", "")
    assert end.ok and end.action == "end_call" and end.reason is None
    assert box.run("end_call", None).ok and box.run("end_call", {}).ok


def test_a_taken_slot_is_an_error_offering_the_others(box):
    assert box.run("book_slot", {"slot": TUESDAY, "name": "Ann"}).ok
    second = box.run("book_slot", {"slot": TUESDAY, "name": "Bob"})
    assert not second.ok and second.result is None
    assert f"slot '{TUESDAY}' is already booked" in second.error
    assert WEDNESDAY in second.error and FRIDAY in second.error
    missing = box.run("book_slot", {"slot": "Friday 9 p.m.", "name": "Bob"})
    assert not missing.ok and "does not exist" in missing.error and WEDNESDAY in missing.error


def test_outcome_as_dict_and_content_are_json(box):
    outcome = box.run("book_slot", {"slot": WEDNESDAY, "name": "Ann"})
    report = outcome.as_dict()
    assert set(report) == {"name", "arguments", "ok", "result", "error", "elapsed_ms", "action", "reason"}
    assert json.loads(json.dumps(report))["result"]["slot"] == WEDNESDAY
    assert report["elapsed_ms"] >= 0.0
    assert json.loads(outcome.content()) == outcome.result
    failed = box.run("nope", "{}")
    assert json.loads(failed.content()) == {"error": failed.error}


def test_concurrent_calls_booking_one_slot_one_wins(store):
    """Calls in their own threads (as the turn runs tools): one gets the slot, every other
    is told it is taken and offered the slots still open."""
    calls = 8
    outcomes: list[ToolOutcome] = list(race(
        calls, lambda i: ToolBox(store, call_id=f"call-{i}").run("book_slot", {"slot": WEDNESDAY, "name": f"caller {i}"}),
    ).values())
    assert len(outcomes) == calls
    winners = [o for o in outcomes if o.ok]
    assert len(winners) == 1
    for loser in (o for o in outcomes if not o.ok):
        assert WEDNESDAY in loser.error and f"open slots: {TUESDAY}; {FRIDAY}" in loser.error
    [booking] = store.bookings()
    assert booking.call_id == f"call-{winners[0].result['name'].split()[-1]}"


# ---------------------------------------------------------------- malformed calls


MALFORMED = [
    ("book_slot", '{"slot": "Friday", "name": ', "not valid JSON"),
    ("book_slot", "[1, 2]", "must be a JSON object, got list"),
    ("book_slot", '"Friday"', "must be a JSON object, got str"),
    ("book_slot", 42, "must be a JSON object, got int"),
    ("book_a_table", '{"party": 4}', "unknown tool 'book_a_table'; the tools are: check_slots, book_slot"),
    ("", "{}", "unknown tool ''"),
    (None, "{}", "unknown tool 'None'"),
    ("book_slot", '{"slot": "Friday 9:00 a.m."}', "'name' is missing"),
    ("book_slot", "{}", "'slot' is missing"),
    ("book_slot", {"slot": 9, "name": "Ann"}, "'slot': Input should be a valid string (got 9)"),
    ("book_slot", {"slot": FRIDAY, "name": ["Ann"]}, "'name': Input should be a valid string"),
    ("book_slot", {"slot": FRIDAY, "name": "   "}, "name is empty"),
    ("book_slot", {"slot": FRIDAY, "name": "Ann", "phone_number": "5"}, "'phone_number' is not an argument"),
    ("check_slots", {"day": 3}, "'day': Input should be a valid string"),
    ("cancel_booking", {"name": "Ann"}, "give the slot or the booking_id"),
    ("cancel_booking", {"name": "Ann", "booking_id": "first"}, "'booking_id': Input should be a valid integer"),
    ("take_message", {"name": "Ann"}, "'text' is missing"),
    ("transfer_to_human", "{}", "'reason' is missing"),
    ("end_call", {"now": True}, "'now' is not an argument of end_call"),
]


def test_a_blank_optional_argument_is_left_out_not_refused(box, store):
    """A model writing "phone": "" for a number the caller never gave books the slot without one."""
    outcome = box.run("book_slot", {"slot": FRIDAY, "name": "Ann", "phone": " "})
    assert outcome.ok, outcome.error
    assert [(b.name, b.phone) for b in store.bookings()] == [("Ann", None)]
    assert box.run("take_message", {"name": "Ann", "text": "call me", "callback": ""}).ok
    assert box.run("check_slots", {"day": ""}).ok


@pytest.mark.parametrize("name, arguments, expected", MALFORMED, ids=[f"{i}-{m[0]}" for i, m in enumerate(MALFORMED)])
def test_a_malformed_call_is_a_clear_error(box, store, name, arguments, expected):
    outcome = box.run(name, arguments)
    assert outcome.ok is False and outcome.result is None and outcome.action is None
    assert expected in outcome.error, outcome.error
    assert store.bookings() == [] and store.messages() == []  # nothing half done
    json.dumps(outcome.as_dict())  # reportable as is


def test_bad_arguments_name_what_the_tool_takes(box):
    outcome = box.run("take_message", {"text": 5})
    assert "Its arguments: name (required), text (required), callback (optional)" in outcome.error
    assert "'name' is missing" in outcome.error and "'text': Input should be a valid string (got 5)" in outcome.error


class _BrokenStore:
    """A store whose every operation fails as a broken database would."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise self.exc
        return fail


@pytest.mark.parametrize("exc", [sqlite3.OperationalError("disk I/O error"), DatabaseError("server went away"),
                                 RuntimeError("bug in a tool")], ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("name, arguments", [
    ("check_slots", {}), ("book_slot", {"slot": FRIDAY, "name": "Ann"}),
    ("cancel_booking", {"name": "Ann", "slot": FRIDAY}), ("take_message", {"name": "Ann", "text": "hi"})])
def test_a_tool_whose_store_raises_is_an_error_not_a_crash(name, arguments, exc):
    outcome = ToolBox(_BrokenStore(exc), call_id="c").run(name, arguments)
    assert outcome.ok is False and outcome.result is None
    assert outcome.error.startswith(f"{name} could not be done ({type(exc).__name__}: {exc})")
    assert "offer to take a message" in outcome.error
    assert outcome.arguments == arguments


def test_a_real_database_failure_mid_call(store):
    """The database closes under a live call (the file is fine, the connection is gone)."""
    box = ToolBox(store, call_id="c")
    store._conn().close()  # this thread's connection, as a dropped one
    outcome = box.run("book_slot", {"slot": FRIDAY, "name": "Ann"})
    assert outcome.ok is False and "could not be done (ProgrammingError" in outcome.error


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                     max_leaves=10)


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory):
    """One store for every fuzz example (a function-scoped fixture is not reset between examples)."""
    with open_store(tmp_path_factory.mktemp("fuzz") / "b.sqlite", open_slots=SLOTS) as opened:
        yield opened


@settings(max_examples=examples(60), deadline=None)
@given(name=st.sampled_from(NAMES + ["", "x", "book_slot "]) | st.text(max_size=15),
       arguments=st.text(max_size=60) | _json.map(json.dumps) | st.dictionaries(
           st.sampled_from(["slot", "name", "phone", "day", "text", "reason", "booking_id", "callback", "x"]),
           _json, max_size=4))
def test_run_never_raises(fuzz_store, name, arguments):
    outcome = ToolBox(fuzz_store, call_id="fuzz").run(name, arguments)
    assert isinstance(outcome, ToolOutcome) and isinstance(outcome.arguments, dict)
    assert outcome.ok == (outcome.error is None) and (outcome.result is not None) == outcome.ok
    if not outcome.ok:
        assert outcome.error.strip()
    json.dumps(outcome.as_dict())
