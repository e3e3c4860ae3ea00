"""`specvoice chat` and the text turn loop behind it (pipeline/conversation.py).

The CLI runs a business file written here against a tiny random model (the real engine,
its prompt K/V warmed as on a call) with tools on a SQLite file; the turn loop's tools and
guard are checked with a scripted backend (a tiny random model cannot be made to call a
tool) and the real ToolBox."""

from __future__ import annotations

import json
import sqlite3

import pytest

from callfakes import ScriptedBackend
from demo.cli import main
from pipeline.receptionist.bookings import open_store
from pipeline.config import load_config
from pipeline.conversation import TextConversation
from pipeline.receptionist.guard import FactGuard
from pipeline.receptionist.tools import ToolBox

pytestmark = pytest.mark.timeout(300)

SLOTS = ["Monday 9:00 a.m. repair", "Tuesday 3:00 p.m. repair"]


def business_file(tmp_path, target: str, greeting: str = "Alpine Bikes, hello!") -> str:
    path = tmp_path / "alpine.toml"
    path.write_text(f"""\
base = "default"

[llm]
target = "{target}"
dtype = "float32"
max_new_tokens = 12

[tools]
enabled = true
database = "{(tmp_path / 'bookings.sqlite').as_posix()}"

[business]
name = "Alpine Bikes"
role = "shop assistant"
greeting = "{greeting}"
open_slots = {json.dumps(SLOTS)}

[business.prices]
"tune-up" = "$49"
""", encoding="utf-8")
    return str(path)


def test_chat_script_json_one_object_per_turn(tiny_models, tmp_path, capsys):
    config = business_file(tmp_path, tiny_models["target"])
    script = tmp_path / "calls.json"
    script.write_text(json.dumps([["How much is a tune-up?", "And on Monday?"], ["How much is a tune-up?"]]))
    assert main(["chat", "--config", config, "--script", str(script), "--json"]) == 0
    out = capsys.readouterr().out
    turns = [json.loads(line) for line in out.splitlines()]  # nothing but JSON objects on stdout
    assert [(t["conversation"], t["turn"], t["caller"]) for t in turns] == [
        (0, 0, "How much is a tune-up?"), (0, 1, "And on Monday?"), (1, 0, "How much is a tune-up?")]
    for t in turns:
        assert {"conversation", "turn", "caller", "agent", "tools", "guarded", "first_sentence_ms"} <= set(t)
        assert isinstance(t["tools"], list) and isinstance(t["guarded"], list)
        assert t["agent"] and t["first_sentence_ms"] > 0
        for g in t["guarded"]:
            assert set(g) == {"sentence", "why", "said"}
    # A fresh history per conversation: the same first line gets the same greedy answer.
    assert turns[2]["agent"] == turns[0]["agent"] and turns[2]["guarded"] == turns[0]["guarded"]
    # The config's database was opened and seeded with the business's slots.
    with sqlite3.connect(tmp_path / "bookings.sqlite") as db:
        assert sorted(r[0] for r in db.execute("SELECT label FROM slots")) == sorted(SLOTS)


def test_chat_names_the_field_a_business_file_gets_wrong(tmp_path, capsys):
    config = business_file(tmp_path, "unused", greeting="")
    script = tmp_path / "s.json"
    script.write_text('["Hi"]')
    with pytest.raises(SystemExit) as exit:
        main(["chat", "--config", config, "--script", str(script), "--json"])
    assert exit.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "business.greeting" in captured.err and "empty" in captured.err


@pytest.mark.parametrize("text, says", [
    ("[[]]", "expected a list of conversations"),
    ('{"lines": ["Hi"]}', "expected a list of conversations"),
    ("[1, 2]", "expected a list of conversations"),
    ("not json", "is not JSON"),
])
def test_chat_refuses_a_bad_script(tmp_path, capsys, text, says):
    config = business_file(tmp_path, "unused")
    script = tmp_path / "s.json"
    script.write_text(text)
    assert main(["chat", "--config", config, "--script", str(script)]) == 2
    assert says in capsys.readouterr().err


def call(tool: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}) + "\n</tool_call>"


def by_round(*answers: str):
    """Round r of a turn (counted by the assistant messages after the last user one) says answers[r]."""
    def reply(messages):
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        r = sum(1 for m in messages[last_user + 1:] if m["role"] == "assistant")
        return [answers[min(r, len(answers) - 1)]]
    return reply


@pytest.fixture
def setup(tmp_path):
    data = load_config("default").model_dump()
    data["tools"] = {"enabled": True, "database": str(tmp_path / "b.sqlite")}
    data["business"]["open_slots"] = SLOTS
    data["agent"]["system_prompt"] = ""  # built again from this business
    from pipeline.config import Config

    config = Config.model_validate(data)
    store = open_store(config.tools.database, open_slots=SLOTS)
    yield config, store, FactGuard(config.business)
    store.close()


def conversation(config, store, guard, reply, name: str) -> TextConversation:
    return TextConversation(config, ScriptedBackend(reply=reply), lambda m: 10 * len(m),
                            toolbox=ToolBox(store, name), guard=guard, greeting=config.agent.greeting)


async def test_a_booking_said_after_the_tool_did_it_is_spoken(setup):
    config, store, guard = setup
    conv = conversation(config, store, guard, by_round(
        call("book_slot", slot="Monday 9", name="Ann Lee"), "You're booked for Monday at 9 a.m., Ann Lee."), "c1")
    turn = await conv.turn("Can I have the Monday slot? I'm Ann Lee.")
    assert turn.agent.endswith("You're booked for Monday at 9 a.m., Ann Lee.")
    assert turn.result.guarded == []
    d = turn.as_dict()
    assert d["tools"] == [{"name": "book_slot", "arguments": {"slot": "Monday 9", "name": "Ann Lee"},
                           "result": {"booked": True, "booking_id": 1, "slot": SLOTS[0], "name": "Ann Lee",
                                      "phone": None}}]
    assert [b.slot for b in store.bookings()] == [SLOTS[0]]


async def test_a_booking_claimed_without_the_tool_is_not_spoken(setup):
    config, store, guard = setup
    conv = conversation(config, store, guard, lambda m: ["Sure, you're booked for Monday at 9 a.m."], "c2")
    turn = await conv.turn("Book me Monday at 9, I'm Bo.")
    assert "booked" not in turn.agent
    assert turn.agent == guard.book.fallback
    assert "book_slot" in turn.result.guarded[0]["why"]
    assert store.bookings() == []
    # The history keeps what the caller heard, not what was held back.
    assert conv.history.exchanges[-1] == ("Book me Monday at 9, I'm Bo.", guard.book.fallback)


async def test_conversations_share_the_database_not_the_history(setup):
    config, store, guard = setup
    first = conversation(config, store, guard, by_round(call("book_slot", slot="Monday 9", name="Ann"), "Booked."),
                         "c3")
    await first.turn("Monday at 9 please, I'm Ann.")
    seen = []

    def second_reply(messages):
        seen.append(messages)
        return by_round(call("book_slot", slot="Monday 9", name="Bo"), "You're booked for Monday at 9 a.m.")(messages)

    second = conversation(config, store, guard, second_reply, "c4")
    turn = await second.turn("Monday at 9 please, I'm Bo.")
    assert all("Ann" not in json.dumps(m) for m in seen[0])  # a fresh history
    assert not turn.result.tool_calls[0]["ok"] and "already booked" in turn.result.tool_calls[0]["error"]
    # The model claimed the booking the database refused: the guard did not let it through.
    assert "booked for Monday" not in turn.agent and turn.result.guarded
    assert [(b.slot, b.name) for b in store.bookings()] == [(SLOTS[0], "Ann")]
