"""The tool loop of a turn (pipeline/stages/tools_step.py) with the real ToolBox over a
SQLite file: the LLM is a scripted backend (the port, pipeline/ports.py: a tiny random
model cannot be made to call tools), except in the last test, where the default 1.5B
target books a slot from a caller's request.

What is checked: the caller hears nothing of a tool call; the tool runs and its result
goes back to the model; a malformed call gets its error back once, then the fixed
fallback; barge-in stops the loop; transfer/end_call end the call after the turn; the
report has each tool call and voice-to-voice apart for tool turns.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from callfakes import FakeModels, ScriptedBackend, ScriptedSTT, ToneTTS
from pipeline.receptionist.bookings import open_store
from pipeline.stages.respond import respond
from pipeline.stages.tools_step import FALLBACK, MAX_ROUNDS
from pipeline.timeline import TurnTimeline
from pipeline.receptionist.tools import ToolBox
from pipeline.turn import BargeIn, LLMResult, Reply

pytestmark = pytest.mark.timeout(120)

SLOTS = ["Tuesday 10:30 a.m. with Dr. Patel", "Wednesday 2:15 p.m. with Dr. Moreno"]
SYSTEM = {"role": "system", "content": "You are the receptionist."}
USER = {"role": "user", "content": "Can I book the Tuesday slot? I'm Ann Lee."}


def call(tool: str, /, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def pieces(text: str, n: int = 3) -> list[str]:
    """Small uneven deltas, so tags are split across groups as a real stream splits them."""
    out, i, k = [], 0, 0
    while i < len(text):
        step = 1 + (k * 7) % n
        out.append(text[i:i + step])
        i, k = i + step, k + 1
    return out


def rounds(*answers: str):
    """A backend reply: round r (counted by the tool messages so far) gets answers[r]."""
    def reply(messages: list[dict]) -> list[str]:
        return pieces(answers[min(_round(messages), len(answers) - 1)])
    return reply


def _round(messages: list[dict]) -> int:
    # Each round appends one assistant message (the call) then its tool messages.
    after_user = messages[max(i for i, m in enumerate(messages) if m["role"] == "user") + 1:]
    return sum(1 for m in after_user if m["role"] == "assistant")


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "bookings.sqlite", open_slots=SLOTS)
    yield s
    s.close()


class Box:
    """The real ToolBox, recording what it was asked and what had been spoken by then."""

    def __init__(self, store, sentences: asyncio.Queue | None = None, raise_on: str | None = None):
        self.box = ToolBox(store, "call-test")
        self.sentences, self.raise_on = sentences, raise_on
        self.calls: list[tuple[str, object]] = []
        self.spoken_before: list[list[str]] = []
        self.started, self.release = threading.Event(), None

    def open_slots(self):
        return self.box.open_slots()

    def run(self, name, arguments):
        self.calls.append((name, arguments))
        if self.sentences is not None:
            self.spoken_before.append(list(self.sentences._queue))
        self.started.set()
        if self.release is not None:
            self.release.wait()
        if name == self.raise_on:
            raise RuntimeError("the database went away")
        return self.box.run(name, arguments)


async def turn(backend, box, barge_in: BargeIn | None = None, sentences: asyncio.Queue | None = None,
               hold_line: str = ""):
    sentences = sentences if sentences is not None else asyncio.Queue()
    result, tl = LLMResult(), TurnTimeline()
    events = []
    await respond(backend, [SYSTEM, USER], Reply(tl, barge_in or BargeIn(), result, sentences=sentences,
                                                 emit=lambda e: events.append((e.kind, e.as_dict())),
                                                 toolbox=box, hold_line=hold_line))
    spoken = []
    while (s := sentences.get_nowait()) is not None:
        spoken.append(s)
    return result, spoken, events


async def test_booking_round_trip_hears_no_tool_tokens(store):
    backend = ScriptedBackend(reply=rounds(
        "Let me book that for you.\n" + call("book_slot", slot="Tuesday 10:30", name="Ann Lee"),
        "You're booked for Tuesday at 10:30 with Dr. Patel, Ann."))
    sentences: asyncio.Queue = asyncio.Queue()
    box = Box(store, sentences)
    result, spoken, events = await turn(backend, box, sentences=sentences)

    assert spoken == ["Let me book that for you.", "You're booked for Tuesday at 10:30 with Dr. Patel, Ann."]
    assert not any("tool" in s or "{" in s for s in spoken) and "<tool" not in result.text
    # The sentence before the call was handed to TTS before the tool ran.
    assert box.spoken_before == [["Let me book that for you."]]
    assert [b.label for b in store.slots()] == [SLOTS[1]]
    (booking,) = store.bookings()
    assert booking.name == "Ann Lee" and booking.slot == SLOTS[0] and booking.call_id == "call-test"

    (entry,) = result.tool_calls
    assert entry["name"] == "book_slot" and entry["ok"] and entry["error"] is None
    assert entry["arguments"] == {"slot": "Tuesday 10:30", "name": "Ann Lee"}
    assert entry["result"]["booked"] is True and entry["elapsed_ms"] >= 0 and entry["end"] >= entry["start"]
    assert not result.fallback and result.action is None
    # The model's second round saw its call and the result, as OpenAI-shaped messages.
    assistant, tool = result.tool_messages
    assert assistant["role"] == "assistant" and assistant["content"] == "Let me book that for you."
    assert assistant["tool_calls"][0]["function"] == {"name": "book_slot",
                                                      "arguments": '{"slot": "Tuesday 10:30", "name": "Ann Lee"}'}
    assert tool["role"] == "tool" and tool["tool_call_id"] == assistant["tool_calls"][0]["id"]
    assert json.loads(tool["content"])["booked"] is True
    # ... and the round exactly as written, for the engine's prompt (its KV cache holds it).
    assert assistant["as_written"] == "Let me book that for you.\n" + call("book_slot", slot="Tuesday 10:30", name="Ann Lee")
    assert backend.opened == 2
    assert [k for k, _ in events if k.startswith("tool")] == ["tool_call", "tool_result"]


@pytest.mark.parametrize("first", [
    # Calls the 1.5B wrote as prose, no tags: the caller must hear neither name nor JSON.
    'Sure, I\'ll book it: book_slot {"slot": "Tuesday 10:30", "name": "Ann Lee"}',
    'Sure, I\'ll book it. Book_slot({"name": "book_slot", "arguments": {"slot": "Tuesday 10:30", "name": "Ann Lee"}})',
])
async def test_prose_call_runs_and_is_not_heard(store, first):
    backend = ScriptedBackend(reply=rounds(first, "You're booked for Tuesday at 10:30, Ann."))
    box = Box(store)
    result, spoken, _ = await turn(backend, box)
    assert spoken[-1] == "You're booked for Tuesday at 10:30, Ann."
    assert spoken[0].startswith("Sure, I'll book it")
    assert not any("{" in s or "book_slot" in s.lower() for s in spoken)
    assert box.calls == [("book_slot", '{"slot": "Tuesday 10:30", "name": "Ann Lee"}')]
    (entry,) = result.tool_calls
    assert entry["ok"] and entry["result"]["booked"] is True
    (booking,) = store.bookings()
    assert booking.name == "Ann Lee" and booking.slot == SLOTS[0]
    assert not result.fallback


async def test_malformed_call_gets_its_error_back_once_then_succeeds(store):
    seen = []

    def reply(messages):
        seen.append(messages)
        r = _round(messages)
        return pieces(['<tool_call>\n{"name": "check_slots", "arguments": {"day": }\n</tool_call>',
                       call("check_slots", day="Wednesday"),
                       "Wednesday at 2:15 with Dr. Moreno is open."][r])

    result, spoken, _ = await turn(ScriptedBackend(reply=reply), Box(store))
    assert spoken == ["Wednesday at 2:15 with Dr. Moreno is open."]
    bad, good = result.tool_calls
    assert not bad["ok"] and "not valid JSON" in bad["error"] and bad["name"] is None
    assert good["ok"] and good["result"]["open_slots"] == [SLOTS[1]]
    # Round 2 was told what was wrong, in a tool message.
    assert "not valid JSON" in json.loads(seen[1][-1]["content"])["error"]
    assert not result.fallback


@pytest.mark.parametrize("bad", [
    call("book_a_table", party=4),  # unknown tool
    call("book_slot", slot=["Tuesday"], name=7),  # wrong argument types
    '<tool_call>\n{"name": "book_slot", "arguments": {"slot": "Tuesday"\n',  # bad JSON, cut off
])
async def test_failing_twice_speaks_the_fallback(store, bad):
    backend = ScriptedBackend(reply=rounds(bad, bad, "I booked it!"))
    result, spoken, _ = await turn(backend, Box(store))
    assert spoken == [FALLBACK] and result.fallback
    assert len(result.tool_calls) == 2 and not any(c["ok"] for c in result.tool_calls)
    assert all(c["error"] for c in result.tool_calls)
    assert backend.opened == 2  # never a third round claiming success
    assert store.bookings() == []


async def test_a_tool_that_raises_is_an_error_not_a_crash(store):
    backend = ScriptedBackend(reply=rounds(call("take_message", name="Bo", text="Call me"),
                                           call("take_message", name="Bo", text="Call me")))
    result, spoken, _ = await turn(backend, Box(store, raise_on="take_message"))
    assert spoken == [FALLBACK]
    assert all("the database went away" in c["error"] for c in result.tool_calls)
    assert result.error is None


async def test_business_refusal_is_fed_back_and_the_model_recovers(store):
    store.book(SLOTS[0], "Someone Else")
    backend = ScriptedBackend(reply=rounds(call("book_slot", slot=SLOTS[0], name="Ann Lee"),
                                           "That slot was just taken. Wednesday at 2:15 is open, shall I book it?"))
    result, spoken, _ = await turn(backend, Box(store))
    (entry,) = result.tool_calls
    assert not entry["ok"] and "already booked" in entry["error"]
    assert spoken[0] == "That slot was just taken." and not result.fallback


async def test_a_turn_whose_tools_ran_never_ends_silent(store):
    """The 1.5B booked, called again, was refused, then wrote nothing (bench tools): the
    caller hears what the database did, from the successful booking's result."""
    booking = call("book_slot", slot=SLOTS[0], name="Zoë Ng")
    backend = ScriptedBackend(reply=rounds(booking, booking, ""))
    result, spoken, _ = await turn(backend, Box(store))
    assert [c["ok"] for c in result.tool_calls] == [True, False]  # the repeat was refused: already booked
    assert spoken == [f"You're booked for {SLOTS[0]}, under the name Zoë Ng."] and not result.fallback
    assert [(b.slot, b.name) for b in store.bookings()] == [(SLOTS[0], "Zoë Ng")]


async def test_a_silent_turn_after_only_failed_tools_speaks_the_fallback(store):
    backend = ScriptedBackend(reply=rounds(call("cancel_booking", name="Nobody", slot=SLOTS[1]), ""))
    result, spoken, _ = await turn(backend, Box(store))
    assert [c["ok"] for c in result.tool_calls] == [False]
    assert spoken == [FALLBACK] and result.fallback


async def test_a_model_that_keeps_calling_tools_is_stopped(store):
    backend = ScriptedBackend(reply=rounds(call("check_slots")))
    result, spoken, _ = await turn(backend, Box(store))
    assert backend.opened == MAX_ROUNDS + 1
    assert spoken == [FALLBACK] and result.fallback
    assert [c["ok"] for c in result.tool_calls] == [True] * MAX_ROUNDS + [False]


async def test_barge_in_mid_call_text_runs_no_tool(store):
    barge_in = BargeIn()
    text = call("book_slot", slot=SLOTS[0], name="Ann Lee")

    def reply(messages):
        return pieces(text, 2)

    class Interrupting(ScriptedBackend):
        async def stream(self, messages, params, cancel=None):
            n = 0
            async for g in super().stream(messages, params, cancel):
                n += 1
                if n == 5:
                    barge_in.fire(time.monotonic())
                yield g

    backend = Interrupting(reply=reply)
    box = Box(store)
    result, spoken, _ = await turn(backend, box, barge_in)
    assert box.calls == [] and result.tool_calls == [] and spoken == []
    assert result.finish_reason == "cancelled" and store.bookings() == []


async def test_barge_in_while_the_tool_runs_keeps_the_booking_and_stops(store):
    barge_in = BargeIn()
    backend = ScriptedBackend(reply=rounds(call("book_slot", slot=SLOTS[0], name="Ann Lee"), "Booked."))
    box = Box(store)
    box.release = threading.Event()
    task = asyncio.create_task(turn(backend, box, barge_in))
    await asyncio.to_thread(box.started.wait)
    barge_in.fire(time.monotonic())
    box.release.set()
    result, spoken, _ = await task
    assert backend.opened == 1 and spoken == []
    (entry,) = result.tool_calls
    assert entry["ok"] and len(store.bookings()) == 1  # done whole, recorded
    assert len(result.tool_messages) == 2  # the history will know


async def test_transfer_is_an_action_on_the_turn(store):
    backend = ScriptedBackend(reply=rounds(call("transfer_to_human", reason="billing question"), "Billing."))
    result, spoken, _ = await turn(backend, Box(store))
    assert result.action == "transfer" and result.action_reason == "billing question"
    assert spoken == ["Let me transfer you now."] and backend.opened == 1  # a fixed line, no second round


async def test_end_call_after_a_goodbye_adds_nothing(store):
    backend = ScriptedBackend(reply=rounds("Thanks for calling, goodbye! " + call("end_call"), "Bye."))
    result, spoken, _ = await turn(backend, Box(store))
    assert result.action == "end_call" and spoken == ["Thanks for calling, goodbye!"] and backend.opened == 1


# ---------------------------------------------------------------- the hold line

HOLD = "One moment, please."


async def test_a_turn_that_begins_with_a_tool_call_says_the_hold_line_before_the_tool_runs(store):
    backend = ScriptedBackend(reply=rounds(call("book_slot", slot=SLOTS[0], name="Ann Lee"),
                                           "You're booked for Tuesday at 10:30, Ann."))
    sentences: asyncio.Queue = asyncio.Queue()
    box = Box(store, sentences)
    result, spoken, events = await turn(backend, box, sentences=sentences, hold_line=HOLD)
    assert spoken == [HOLD, "You're booked for Tuesday at 10:30, Ann."]
    assert box.spoken_before == [[HOLD]]  # heard while the call was being written and run
    assert result.hold_line_t is not None and ("hold_line", {"turn": 0, "text": HOLD}) in events
    # Not the model's words: its next round does not see them.
    assert result.tool_messages[0]["role"] == "assistant" and result.tool_messages[0]["content"] == ""
    assert len(store.bookings()) == 1


async def test_no_hold_line_when_the_model_speaks_before_its_call(store):
    backend = ScriptedBackend(reply=rounds("Let me book that.\n" + call("book_slot", slot=SLOTS[0], name="Ann Lee"),
                                           "Done, Ann."))
    result, spoken, _ = await turn(backend, Box(store), hold_line=HOLD)
    assert spoken == ["Let me book that.", "Done, Ann."] and result.hold_line_t is None


async def test_the_hold_line_does_not_count_as_the_answer(store):
    # The model went quiet after the tool: the caller still hears what the database did.
    backend = ScriptedBackend(reply=rounds(call("book_slot", slot=SLOTS[0], name="Ann Lee"), ""))
    result, spoken, _ = await turn(backend, Box(store), hold_line=HOLD)
    assert spoken == [HOLD, f"You're booked for {SLOTS[0]}, under the name Ann Lee."] and not result.fallback
    # A transfer still says its line.
    backend = ScriptedBackend(reply=rounds(call("transfer_to_human", reason="billing question")))
    result, spoken, _ = await turn(backend, Box(store), hold_line=HOLD)
    assert spoken == [HOLD, "Let me transfer you now."] and result.action == "transfer"


# ---------------------------------------------------------------- the call


def _tone(seconds: float) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


async def _call(tmp_path, store, reply, texts):
    from pipeline.call import Call
    from pipeline.config import load_config
    from pipeline.io import PacedSink, PushSource

    cfg = load_config("test")
    cfg = cfg.model_copy(update={"report": cfg.report.model_copy(update={"dir": str(tmp_path / "reports")})})
    stt = ScriptedSTT(lambda audio, it=iter(texts): next(it))
    backend = ScriptedBackend(reply=reply)
    events: list[tuple[str, dict]] = []
    source, sink = PushSource(), PacedSink()
    models = FakeModels(stt=stt, tts=ToneTTS(chunks=1, chunk_s=0.05))
    c = Call.from_models(cfg, models, source, sink, backend=backend, mqtt=None, toolbox=ToolBox(store, "call-t"),
                         on_event=lambda kind, data: events.append((kind, data)))
    return c, source, backend, events


async def _say_and_wait(c, source, n: int) -> None:
    source.push(_tone(0.4))
    source.push(np.zeros(16000 // 2, np.float32))
    await c.wait_turns(n)


async def test_call_records_tool_calls_in_report_and_history_then_transfers(tmp_path, store):
    def reply(messages):
        users = sum(1 for m in messages if m["role"] == "user")
        r = _round(messages)
        if users == 1:
            return pieces([call("book_slot", slot="Tuesday", name="Zoë Ó Briain"), "Booked for Tuesday."][r])
        return pieces([call("transfer_to_human", reason="wants a dentist"), "Transferring you now."][r])

    c, source, backend, events = await _call(tmp_path, store, reply, ["Book Tuesday for Zoë", "A person please"])
    run = asyncio.create_task(c.run())
    await _say_and_wait(c, source, 1)
    await _say_and_wait(c, source, 2)
    report = await run  # ends by itself: the transfer, not the source
    data = report.to_dict()
    assert data["end_reason"] == "transfer" and data["error"] is None
    assert ("transfer", {"turn": 1, "reason": "wants a dentist"}) in events
    t0, t1 = data["turns"]
    assert t0["tool_calls"][0]["name"] == "book_slot" and t0["tool_calls"][0]["ok"]
    assert t0["tool_calls"][0]["arguments"]["name"] == "Zoë Ó Briain"  # stored and reported as heard
    assert 0 <= t0["tool_calls"][0]["start"] <= t0["tool_calls"][0]["end"]
    assert t1["action"] == {"action": "transfer", "reason": "wants a dentist"}
    # Both turns began with a call: the caller heard [tools] hold_line first, while it ran.
    assert t0["hold_line"] is True and t0["agent_text"] == "One moment, please. Booked for Tuesday."
    assert t1["agent_text"] == "One moment, please. Let me transfer you now."
    assert store.bookings()[0].name == "Zoë Ó Briain"
    tools = data["summary"]["tools"]
    assert tools["calls"] == 2 and tools["failed"] == 0 and tools["turns"] == 2
    assert tools["voice_to_voice"]["with_tools"]["n"] == 2 and tools["voice_to_voice"]["without_tools"]["n"] == 0
    # Turn 2's prompt carried turn 1's call and result (the model knows what it booked).
    second = [m for m in c.history.messages("x") if m["role"] in ("tool",) or m.get("tool_calls")]
    assert len(second) == 4 and "<tool_call>" not in " ".join(t.agent_text for t in c.turns)
    source.close()


async def test_call_without_tool_turns_reports_plain_voice_to_voice(tmp_path, store):
    c, source, backend, events = await _call(tmp_path, store, lambda m: ["We open at nine."], ["When do you open?"])
    run = asyncio.create_task(c.run())
    await _say_and_wait(c, source, 1)
    source.close()
    data = (await run).to_dict()
    assert data["end_reason"] == "completed" and "tool_calls" not in data["turns"][0]
    assert data["summary"]["tools"]["voice_to_voice"]["without_tools"]["n"] == 1


def _tools_config(tmp_path, enabled=True, **agent):
    from pipeline.config import Config, load_config

    data = load_config("default").model_dump()
    data["agent"].update(agent)
    if agent:
        data["agent"]["system_prompt"] = ""  # rebuilt from [business] with the new options
    data["tools"] = {"enabled": enabled, "database": str(tmp_path / "bookings.sqlite")}
    return Config.model_validate(data)


def test_system_prompt_with_tools(tmp_path):
    from pipeline.receptionist.prompt import system_prompt, tool_schemas

    off = _tools_config(tmp_path, enabled=False)
    assert system_prompt(off) == off.agent.system_prompt and tool_schemas(off) is None
    on = _tools_config(tmp_path)
    prompt = system_prompt(on)
    assert "Open slot: Tuesday 10:30 a.m. with Dr. Patel" in prompt
    # The rules come after the tools paragraph, as rules for questions (measured: README).
    facts, tools, rules = prompt.split("\n\n")[-3:]
    assert tools.startswith("Tools:") and tools.endswith("tell the caller in one short sentence what it says.")
    assert rules.startswith("Rules for questions:\n- Use only these facts.") and "Rules:" not in prompt
    assert prompt.count("I'm not sure about that.") == 1
    no_rules = system_prompt(_tools_config(tmp_path, prompt_rules=False))
    assert "Rules" not in no_rules and no_rules.endswith("what it says.")
    assert {t["function"]["name"] for t in tool_schemas(on)} >= {"book_slot", "check_slots", "transfer_to_human"}
    # A prompt the user wrote is not rebuilt, only given the tools paragraph.
    from pipeline.config import load_config

    data = load_config("default").model_dump()
    del data["business"]
    data["agent"].update(system_prompt="You answer for Joe's Garage.")
    data["tools"] = {"enabled": True}
    from pipeline.config import Config

    own = Config.model_validate(data)
    assert system_prompt(own).startswith("You answer for Joe's Garage.\n\nTools:")


async def test_from_models_gives_each_call_its_toolbox(tmp_path, store):
    from pipeline.call import Call
    from pipeline.io import PacedSink, PushSource

    class WithTools(FakeModels):
        def new_toolbox(self, call_id, caller=None):
            return ToolBox(store, call_id, caller)

    cfg = _tools_config(tmp_path)
    c = Call.from_models(cfg, WithTools(), PushSource(), PacedSink(), call_id="call-7", mqtt=None)
    assert isinstance(c.toolbox, ToolBox) and c.toolbox.call_id == "call-7" and c.call_id == "call-7"
    assert "Tools:" in c.history.system_prompt
    plain = Call.from_models(cfg, FakeModels(), PushSource(), PacedSink(), mqtt=None)
    assert plain.toolbox is None


# ---------------------------------------------------------------- the real default target


@pytest.mark.models
@pytest.mark.timeout(900)
async def test_default_target_books_the_slot_the_caller_asks_for(tmp_path):
    """Config "default" (Qwen2.5-Coder-1.5B, greedy, n-gram drafts) with [tools] on: a
    caller asks for the Wednesday slot; the call books it in the SQLite file through the
    model's own tool call, and nothing of the call is spoken."""
    import torch

    from conftest import require_model
    from llm.backend import SpeculativeBackend
    from llm.engine import SpeculativeEngine
    from pipeline.receptionist.prompt import system_prompt, tool_schemas
    from pipeline.call import Call
    from pipeline.config import Config, load_config
    from pipeline.io import PacedSink, PushSource

    data = load_config("default").model_dump()
    data["tools"] = {"enabled": True, "database": str(tmp_path / "bookings.sqlite")}
    data["report"]["dir"] = str(tmp_path / "reports")
    data["mqtt"]["enabled"] = False
    cfg = Config.model_validate(data)
    assert cfg.llm.drafter == "ngram" and cfg.llm.temperature == 0
    # With tools the built prompt drops its rules (pipeline.receptionist.prompt.system_prompt) and says
    # when to call them.
    assert "Rules:" in cfg.agent.system_prompt and "Rules:" not in system_prompt(cfg)
    assert "<tool_call>" in system_prompt(cfg)

    torch.set_num_threads(2)
    engine = SpeculativeEngine.load(str(require_model(cfg.llm.target)), None, drafter="ngram", gamma=cfg.llm.gamma,
                                    max_gamma=cfg.llm.max_gamma, dtype=cfg.llm.dtype, calibrate=False)
    store = open_store(cfg.tools.database, open_slots=cfg.business.open_slots)
    models = FakeModels(stt=ScriptedSTT("Hi, this is Ann Lee. Please book the Wednesday 2:15 p.m. slot with "
                                        "Dr. Moreno for me."), tts=ToneTTS(chunks=1, chunk_s=0.05))
    source, sink = PushSource(), PacedSink()
    c = Call.from_models(cfg, models, source, sink, backend=SpeculativeBackend(engine, tools=tool_schemas(cfg)),
                         toolbox=ToolBox(store, "call-real"), mqtt=None)
    run = asyncio.create_task(c.run())
    await _say_and_wait(c, source, 1)
    source.close()
    report = (await run).to_dict()

    (turn,) = c.turns
    print("tool calls:", json.dumps(turn.llm.tool_calls, default=str))
    print("spoken:", turn.sentences, "stats:", turn.stats.as_dict())
    print("metrics:", report["turns"][0]["metrics"], "summary tools:", report["summary"]["tools"])
    booked = [(b.slot, b.name) for b in store.bookings() if b.cancelled_at is None]
    assert booked == [("Wednesday 2:15 p.m. with Dr. Moreno", "Ann Lee")]
    assert turn.llm.tool_calls[0]["name"] == "book_slot" and turn.llm.tool_calls[0]["ok"]
    assert turn.sentences and not turn.llm.fallback
    assert not any("<tool" in s or "{" in s or "</" in s for s in turn.sentences)
    assert report["turns"][0]["tool_calls"][0]["result"]["booked"] is True
    store.close()


def test_merge_stats_adds_counters_and_joins_lists():
    from llm.types import GenerationStats
    from pipeline.stages.respond import merge_stats

    a = GenerationStats(new_tokens=3, passes=2, ttft_s=0.5, gammas=[4, 4], trace=[{"pass": 1}])
    b = GenerationStats(new_tokens=5, passes=3, ttft_s=0.9, gammas=[2], trace=[{"pass": 2}, {"pass": 3}])
    total = merge_stats([a, b])
    assert (total.new_tokens, total.passes, total.ttft_s) == (8, 5, 0.5)
    assert total.gammas == [4, 4, 2] and total.trace == [{"pass": 1}, {"pass": 2}, {"pass": 3}]
