"""No double booking through the bridge, and the caller's number reaching the tools (issue 15).

N simulated callers ring a running bridge at once, over real WebSocket connections: the
real telephony adapter, real pipeline Calls, the real ToolBox over ONE shared SQLite file,
scripted STT/TTS/LLM (tests/callfakes.py). Every caller asks for the same slot; each
call's scripted model waits (an asyncio.Barrier) until all N calls have reached their
tool round, then all of them call book_slot for that slot. Exactly one booking may exist
afterwards; every other call's tool result is the "already booked" refusal, whose note
lists the slots still open, and that call's next round offers one of them, which the
caller hears. Each call's report records its tool call with ok true or false.

`gate=True` makes the race reach the database's unique index every time: the first
booking to take SQLite's write lock holds it, before its commit, until all N callers have
read the slot as open (BookingStore.before_commit, its test seam), so no refusal can come
from book()'s early "is already booked" check, and the N tool runs must be in N worker
threads at once (a ToolBox run on the event loop would hang the gate). `gate=False` is the
race as it comes.

Caller ID: /voice's TwiML passes Twilio's `From` as a <Parameter> (escaped), Twilio sends
it back in the stream's `start` customParameters, and the adapter gives it to the call's
ToolBox: bookings and messages record who called.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlencode

import httpx
import pytest

from callfakes import (FakeModels, RawCaller, ScriptedBackend, ScriptedSTT, ToneTTS, agent_bridge, auth, rel_config,
                       report_of, wait_for)
from pipeline.receptionist.bookings import open_store
from pipeline.receptionist.tools import ToolBox
from pipeline.transports.telephony.adapter import caller_id
from pipeline.transports.telephony.protocol import Start

pytestmark = pytest.mark.timeout(90)

CONTESTED = "Tuesday 10:30 a.m. with Dr. Patel"
SLOTS = [CONTESTED, "Wednesday 2:15 p.m. with Dr. Moreno", "Friday 9:00 a.m. with Dr. Patel"]
REFUSAL = re.compile(rf"^slot '{re.escape(CONTESTED)}' (is already booked|was just booked by another caller); "
                     r"open slots: (.+)$")


def tool_call(tool: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}) + "\n</tool_call>"


def tool_round(messages: list[dict]) -> int:
    """Tool rounds so far in this turn (assistant messages after the last user one)."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return sum(1 for m in messages[last_user + 1:] if m["role"] == "assistant")


def offered_slot(refusal: str) -> str | None:
    """The first open slot a refusal's note lists (what the model reads back), or None."""
    m = REFUSAL.match(refusal)
    if m is None or m.group(2).startswith("none"):
        return None
    return m.group(2).split("; ")[0]


class RacingBackend(ScriptedBackend):
    """One caller's model: books CONTESTED under its own name once every call in the race
    has reached its tool round; then says what the tool result says: the booking, or the
    first other open slot the refusal lists."""

    def __init__(self, name: str, barrier: asyncio.Barrier):
        super().__init__(reply=self._reply)
        self.name, self.barrier = name, barrier
        self.tool_messages: list[dict] = []  # the tool message each later round read

    async def stream(self, messages, params, cancel=None):
        if tool_round(messages) == 0:
            async with asyncio.timeout(30):  # a call that never gets here fails the test, not hangs it
                await self.barrier.wait()
        async for group in super().stream(messages, params, cancel):
            yield group

    def _reply(self, messages: list[dict]) -> list[str]:
        if tool_round(messages) == 0:
            return [tool_call("book_slot", slot=CONTESTED, name=self.name)]
        self.tool_messages.append(messages[-1])
        outcome = json.loads(messages[-1]["content"])
        if outcome.get("booked"):
            return [f"You're booked for {outcome['slot']}, {outcome['name']}."]
        offer = offered_slot(outcome.get("error", ""))
        return [f"Sorry, that one was just taken. I can offer {offer} instead." if offer
                else "Sorry, that slot is taken."]


class RaceModels(FakeModels):
    """FakeModels with the real ToolBox over the shared store, one per call (as
    AgentModels.new_toolbox), and one RacingBackend per call."""

    def __init__(self, store, barrier: asyncio.Barrier, **kw):
        self.store, self.barrier = store, barrier
        self.callers: dict[str, str | None] = {}  # call_id -> the caller ID its ToolBox got
        self.racers: list[RacingBackend] = []
        super().__init__(backend=self._racer, **kw)

    def _racer(self) -> RacingBackend:
        racer = RacingBackend(f"Caller {len(self.racers) + 1}", self.barrier)
        self.racers.append(racer)
        return racer

    def new_toolbox(self, call_id: str, caller: str | None = None) -> ToolBox:
        self.callers[call_id] = caller
        return ToolBox(self.store, call_id, caller)


class RaceGate:
    """Watches the store's bookings: which threads ran them, and (hold=True) keeps the
    first transaction's write lock, before its commit, until all `n` bookings have read
    the slot as open."""

    def __init__(self, store, n: int, hold: bool):
        self.n = n
        self.threads: set[int] = set()
        self.reads = 0
        self.all_read = threading.Event()
        self.commits_held = 0
        self._lock = threading.Lock()
        find_slot = store.find_slot

        def counting_find_slot(text: str):
            found = find_slot(text)
            with self._lock:
                self.threads.add(threading.get_ident())
                self.reads += 1
                if self.reads >= n:
                    self.all_read.set()
            return found

        store.find_slot = counting_find_slot  # the instance's own: book() calls self.find_slot
        if hold:
            store.before_commit = self._hold

    def _hold(self) -> None:
        self.commits_held += 1
        if not self.all_read.wait(30):
            raise RuntimeError(f"only {self.reads} of {self.n} bookings ran while the first held the write lock")


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "bookings.sqlite", open_slots=SLOTS)
    yield s
    s.close()


@pytest.fixture
async def worker_threads():
    """A default executor with room for every racing tool run at once: asyncio's own has
    min(32, cores + 4) threads, 6 on a 2-core machine, and the gate needs all N runs in
    threads together. (Production needs no such room: the runs would only queue.)"""
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="asyncio_race")
    loop.set_default_executor(executor)
    yield
    executor.shutdown(wait=True)


def number(i: int) -> str:
    return f"+1555010{i:02d}"


async def place_call(port: int, i: int) -> RawCaller:
    c = await RawCaller(port, custom={"From": number(i)}).open()  # echoes marks: the audio "played"
    await c.say()  # a tone; the scripted STT hears the request
    return c


@pytest.mark.parametrize("n, gate", [(2, True), (6, True), (6, False)], ids=["2-at-the-index", "6-at-the-index",
                                                                             "6-as-it-comes"])
async def test_concurrent_callers_for_one_slot_one_booking_others_offered_another(
        tmp_path, store, worker_threads, n, gate):
    race = RaceGate(store, n, hold=gate)
    barrier = asyncio.Barrier(n)
    cfg = rel_config(tmp_path, max_calls=n, idle_timeout_s=30.0)  # a loaded machine may be slow to answer
    models = RaceModels(store, barrier, stt=ScriptedSTT(f"Can I book {CONTESTED}?"),
                        tts=ToneTTS(chunks=1, chunk_s=0.05))
    async with agent_bridge(cfg, models) as (_, port, handler):
        callers = await asyncio.gather(*(place_call(port, i) for i in range(n)))
        await wait_for(lambda: len(handler.calls) == n, 20, "all calls to start")
        for call in handler.calls:
            assert await call.wait_turns(1, 30), f"call {call.call_id} did not finish its turn"
        for call in handler.calls:  # the reply played to the end: its marks came back
            turn = call.turns[0]
            await wait_for(lambda: turn.sentences and turn.heard == turn.sentences, 20, "the reply to be heard")
        for c in callers:
            await c.stop()
        for c in callers:
            assert await c.wait_closed() == 1000
        reports = {c.call_sid: await report_of(cfg, c.call_sid) for c in callers}

    # The database: exactly one booking of the slot, made by one of the calls, with its
    # caller's number; the other slots are untouched.
    bookings = store.bookings()
    assert len(bookings) == 1, [b.as_dict() for b in bookings]
    (booking,) = bookings
    assert booking.slot == CONTESTED and booking.cancelled_at is None
    by_sid = {c.call_sid: i for i, c in enumerate(callers)}
    assert booking.call_id in by_sid
    assert booking.caller == number(by_sid[booking.call_id])
    assert models.callers == {c.call_sid: number(i) for i, c in enumerate(callers)}
    still_open = store.open_slots()
    assert still_open == SLOTS[1:]

    # It was a race: every call's model waited for the others before booking, and the
    # bookings ran in worker threads, not on the event loop.
    assert len(models.racers) == n and all(r.opened == 2 for r in models.racers)
    assert race.reads == n and threading.get_ident() not in race.threads
    if gate:
        # All N at once (the first held the write lock until every other had read the slot
        # as open), so every refusal came from the database's unique index.
        assert len(race.threads) == n and race.commits_held == 1

    winners, losers = [], []
    for sid, data in reports.items():
        assert data["error"] is None and data["end_reason"] == "caller_hangup"
        (turn,) = data["turns"]
        (tool,) = turn["tool_calls"]
        assert tool["name"] == "book_slot" and tool["round"] == 0
        assert tool["arguments"]["slot"] == CONTESTED
        (winners if tool["ok"] else losers).append((sid, turn, tool))
        assert turn["agent_text_heard"] == turn["agent_text"]  # the caller heard all of it
    assert len(winners) == 1 and len(losers) == n - 1

    sid, turn, tool = winners[0]
    assert sid == booking.call_id and tool["error"] is None
    assert tool["result"] == {"booked": True, "booking_id": booking.id, "slot": CONTESTED,
                              "name": booking.name, "phone": None}
    # Every model began with the call: the caller heard the hold line first.
    hold = cfg.tools.hold_line
    assert turn["agent_text"] == f"{hold} You're booked for {CONTESTED}, {booking.name}."

    for sid, turn, tool in losers:
        assert tool["result"] is None
        m = REFUSAL.match(tool["error"] or "")
        assert m, tool["error"]  # the "already booked" refusal, not "database is locked" or any other error
        if gate:
            assert m.group(1) == "was just booked by another caller"
        assert m.group(2).split("; ") == still_open  # the note lists exactly the slots still open
        # The next round read that refusal and offered another slot, which the caller heard.
        offer = still_open[0]
        assert turn["agent_text_heard"] == f"{hold} Sorry, that one was just taken. I can offer {offer} instead."
    losing_racers = [r for r in models.racers if r.name != booking.name]
    assert len(losing_racers) == n - 1
    for racer in losing_racers:
        (read,) = racer.tool_messages
        assert read["role"] == "tool" and json.loads(read["content"])["error"].startswith(f"slot '{CONTESTED}'")


# ---------------------------------------------------------------- caller ID


def test_caller_id_comes_from_the_start_messages_from_parameter():
    assert caller_id(Start("MZ1", "CA1", "AC1", {"From": "+15550100", "To": "+15550199"})) == "+15550100"
    assert caller_id(Start("MZ1", "CA1", "AC1", {"From": " anonymous "})) == "anonymous"
    assert caller_id(Start("MZ1", "CA1", "AC1", {"From": "  "})) is None
    assert caller_id(Start("MZ1", "CA1", "AC1", {"To": "+15550199"})) is None
    assert caller_id(Start("MZ1", "CA1", "AC1")) is None


def stream_parameters(twiml: str) -> dict[str, str]:
    """The <Parameter>s of the TwiML's <Stream>, as Twilio reads them (an XML parser)."""
    stream = ET.fromstring(twiml).find("./Connect/Stream")
    assert stream is not None, twiml
    return {p.get("name"): p.get("value") for p in stream.findall("Parameter")}


async def test_webhook_to_booking_the_callers_number_travels_escaped_and_is_stored(tmp_path, store):
    """Twilio asks /voice (with From), the TwiML passes it as a <Parameter>, Twilio's start
    message carries it back: the booking and the message record it. A number full of XML
    specials is escaped in the TwiML and stored exactly as Twilio sent it."""
    odd = 'sip:"Jo" <jo&co@example.com> \'x\''

    def reply(messages):
        if tool_round(messages) == 0:
            return [tool_call("book_slot", slot=CONTESTED, name="Jo Park")
                    + tool_call("take_message", name="Jo Park", text="Please call me back")]
        return ["Done."]

    cfg = rel_config(tmp_path, idle_timeout_s=30.0)
    models = RaceModels(store, asyncio.Barrier(1), stt=ScriptedSTT("Book me and take a message"),
                        tts=ToneTTS(chunks=1, chunk_s=0.05))
    models.backend = lambda: ScriptedBackend(reply=reply)
    async with agent_bridge(cfg, models) as (_, port, handler):
        async with httpx.AsyncClient() as client:
            query = urlencode({"CallSid": "CAescaped", "From": odd, "To": "+15550199"})
            r = await client.get(f"http://127.0.0.1:{port}/voice?{query}", headers=auth())
        assert r.status_code == 200
        params = stream_parameters(r.text)  # well-formed XML: the value did not break out
        assert params == {"CallSid": "CAescaped", "From": odd, "To": "+15550199"}
        assert "<jo&co" not in r.text and "&lt;jo&amp;co@example.com&gt;" in r.text

        c = await RawCaller(port, call_sid=params["CallSid"], custom=params).open()  # as Twilio would
        await c.say()
        await wait_for(lambda: handler.calls, 10, "the call to start")
        assert await handler.calls[0].wait_turns(1, 30)
        await c.stop()
        assert await c.wait_closed() == 1000
        data = await report_of(cfg, "CAescaped")

    assert [t["ok"] for t in data["turns"][0]["tool_calls"]] == [True, True]
    (booking,) = store.bookings()
    assert (booking.call_id, booking.caller, booking.name) == ("CAescaped", odd, "Jo Park")
    (message,) = store.messages()
    assert (message.call_id, message.caller, message.text) == ("CAescaped", odd, "Please call me back")


async def test_a_stream_without_the_parameter_books_with_no_caller(tmp_path, store):
    def reply(messages):
        return [tool_call("book_slot", slot=CONTESTED, name="Jo Park"), "Done."][tool_round(messages)]

    cfg = rel_config(tmp_path, idle_timeout_s=30.0)
    models = RaceModels(store, asyncio.Barrier(1), stt=ScriptedSTT("Book me"), tts=ToneTTS(chunks=1, chunk_s=0.05))
    models.backend = lambda: ScriptedBackend(reply=reply)
    async with agent_bridge(cfg, models) as (_, port, handler):
        c = await RawCaller(port).open()  # no customParameters
        await c.say()
        await wait_for(lambda: handler.calls, 10, "the call to start")
        assert await handler.calls[0].wait_turns(1, 30)
        await c.stop()
        assert await c.wait_closed() == 1000
    (booking,) = store.bookings()
    assert booking.call_id == c.call_sid and booking.caller is None
    assert models.callers == {c.call_sid: None}
