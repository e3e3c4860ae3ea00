"""Transfer and DTMF over the real bridge (issue 15): real WebSocket connections and real
HTTP requests to a running bridge, the real telephony adapter and pipeline Call, the real
ToolBox on SQLite, and scripted stand-ins for the models (tests/callfakes.py).

Transfer: a turn whose tool asks for a transfer is spoken to the end (its mark echoed),
then the bridge closes the stream and answers Twilio's request to the <Connect> action URL
with a <Dial> to bridge.transfer_to; other calls get <Hangup/>; without transfer_to the
tool fails with a sentence the model turns into an offer to take a message.
DTMF: keys become one turn's text ("[keypad] 1"), ended by '#' or a pause, answered
without STT, and marked "dtmf" in the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from callfakes import (
    TOKEN,
    FakeModels,
    RawCaller,
    ScriptedBackend,
    ScriptedSTT,
    ToneTTS,
    agent_bridge,
    auth,
    rel_config,
    report_of,
    wait_for,
)
from pipeline.receptionist.bookings import open_store
from pipeline.config import BridgeConfig, PipelineConfig
from pipeline.events import KeyPress, KeypadEntry
from pipeline.stages.listen import MAX_KEYS, Keypad
from pipeline.stages.tools_step import ACTION_LINES
from pipeline.receptionist.tools import ToolBox
from pipeline.transports.telephony.adapter import NoTransferLine
from pipeline.transports.telephony.auth import BridgeTokens, twilio_signature
from pipeline.transports.telephony.protocol import Dtmf, encode_event
from pipeline.transports.telephony.call import TelephonyCall
from pipeline.transports.telephony.twiml import NO_TRANSFER_LINE

pytestmark = pytest.mark.timeout(60)

NUMBER = "+15550100"
TWILIO_TOKEN = "twilio-transfer-test"
SLOTS = ["Tuesday 10:30 a.m. with Dr. Patel"]


def tool_call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ToolModels(FakeModels):
    """FakeModels with the real ToolBox, one per call (as AgentModels.new_toolbox)."""

    def __init__(self, store, **kw):
        super().__init__(**kw)
        self.store = store

    def new_toolbox(self, call_id: str, caller: str | None = None) -> ToolBox:
        return ToolBox(self.store, call_id, caller)


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "bookings.sqlite", open_slots=SLOTS)
    yield s
    s.close()


def recording_backend(reply, seen: list[list[dict]]):
    """A scripted backend per call that keeps every prompt it was given."""
    def make() -> ScriptedBackend:
        def recorded(messages: list[dict]) -> list[str]:
            seen.append(list(messages))
            return reply(messages)
        return ScriptedBackend(reply=recorded)
    return make


def tool_round(messages: list[dict]) -> int:
    """Tool rounds so far in this turn (an assistant message after the last user one)."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return sum(1 for m in messages[last_user + 1:] if m["role"] == "assistant")


async def say_once(c: RawCaller) -> None:
    """An utterance and the silence after it; the agent may end the call before all the
    silence is sent (a fast tool turn), which is no error of the caller's."""
    with contextlib.suppress(ConnectionClosed):
        await c.say()


async def get(port: int, path: str, headers: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(f"http://127.0.0.1:{port}{path}", headers=headers)


# ---------------------------------------------------------------- config


def test_transfer_to_must_be_an_e164_number_or_empty():
    assert BridgeConfig().transfer_to == ""
    assert BridgeConfig(transfer_to=" +15550100 ").transfer_to == NUMBER
    for bad in ("555-0100", "15550100", "+0555", "+1555010012345678", "sip:desk@example.com"):
        with pytest.raises(ValueError, match="E.164"):
            BridgeConfig(transfer_to=bad)
    with pytest.raises(ValueError):
        PipelineConfig(keypad_timeout_ms=0)


# ---------------------------------------------------------------- the keypad alone


async def test_keypad_entry_ends_at_hash_at_max_keys_or_after_a_pause():
    entries: list[KeypadEntry] = []
    got = asyncio.Event()

    def on_entry(entry: KeypadEntry) -> None:
        entries.append(entry)
        got.set()

    keypad = Keypad(on_entry, timeout_s=0.05)
    for i, digit in enumerate("12#"):
        keypad.press(KeyPress(digit, 10.0 + i))
    assert [(e.digits, e.ended_by, e.first_t, e.ended_t) for e in entries] == [("12", "#", 10.0, 12.0)]
    assert entries[0].text == "[keypad] 12" and not keypad.pending

    keypad.press(KeyPress("#", 20.0))  # '#' alone still says something
    assert (entries[-1].digits, entries[-1].ended_by) == ("#", "#")

    for i in range(MAX_KEYS):
        keypad.press(KeyPress("9", 30.0 + i))
    assert (entries[-1].digits, entries[-1].ended_by) == ("9" * MAX_KEYS, "max_keys")

    # No '#': the pause ends it. Both keys are pressed before the loop runs again, so the
    # timer cannot fire between them, whatever the machine's speed.
    got.clear()
    keypad.press(KeyPress("4", 40.0))
    keypad.press(KeyPress("2", 40.1))
    assert keypad.pending
    await asyncio.wait_for(got.wait(), 5)
    assert (entries[-1].digits, entries[-1].ended_by) == ("42", "timeout")

    # Closed (the caller hung up): keys waiting are dropped, and no timer fires later.
    keypad.press(KeyPress("5", 50.0))
    keypad.close()
    keypad.press(KeyPress("6", 50.1))
    keypad.flush()
    assert not keypad.pending and entries[-1].digits == "42"


# ---------------------------------------------------------------- the bridge's HTTP side


async def test_connect_names_the_action_url_only_with_a_transfer_number(tmp_path):
    tokens = BridgeTokens.of(TWILIO_TOKEN, TOKEN)
    async with agent_bridge(rel_config(tmp_path), FakeModels(), tokens=tokens) as (_, port, _h):
        r = await get(port, "/voice", auth())
        assert r.status_code == 200 and "<Connect>" in r.text and "action=" not in r.text
    async with agent_bridge(rel_config(tmp_path, transfer_to=NUMBER), FakeModels(), tokens=tokens) as (_, port, _h):
        r = await get(port, "/voice", auth())
        assert r.status_code == 200
        assert f'<Connect action="https://127.0.0.1:{port}/stream-ended" method="GET">' in r.text
        # The action URL goes through the same checks as /voice: Twilio's signature over
        # the URL with its query string, or the bearer token.
        query = "/stream-ended?CallSid=CAnobody&CallStatus=in-progress"
        signed = twilio_signature(TWILIO_TOKEN, f"https://127.0.0.1:{port}{query}")
        ok = await get(port, query, {"X-Twilio-Signature": signed})
        assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/xml")
        assert ok.text == '<?xml version="1.0" encoding="UTF-8"?><Response><Hangup/></Response>'
        assert (await get(port, query)).status_code == 401
        wrong = twilio_signature("not-the-token", f"https://127.0.0.1:{port}{query}")
        assert (await get(port, query, {"X-Twilio-Signature": wrong})).status_code == 403
        other_query = twilio_signature(TWILIO_TOKEN, f"https://127.0.0.1:{port}/stream-ended?CallSid=CAother")
        assert (await get(port, query, {"X-Twilio-Signature": other_query})).status_code == 403


async def test_public_url_gives_the_action_url_twilio_signs(tmp_path):
    cfg = rel_config(tmp_path, transfer_to=NUMBER, public_url="wss://voice.example.com/media-stream")
    async with agent_bridge(cfg, FakeModels(), tokens=BridgeTokens.of(TWILIO_TOKEN)) as (_, port, _h):
        voice = twilio_signature(TWILIO_TOKEN, "https://voice.example.com/voice")
        r = await get(port, "/voice", {"X-Twilio-Signature": voice})
        assert '<Connect action="https://voice.example.com/stream-ended" method="GET">' in r.text
        action = twilio_signature(TWILIO_TOKEN, "https://voice.example.com/stream-ended?CallSid=CA1")
        assert (await get(port, "/stream-ended?CallSid=CA1", {"X-Twilio-Signature": action})).status_code == 200


async def test_a_handler_asking_for_transfer_without_a_number_gets_an_apology_and_hangup(tmp_path):
    """The bridge alone: a handler (not the adapter, which makes the tool fail first) that
    sets agent_action "transfer" with no number configured: the caller hears why."""
    async def transferring(call: TelephonyCall) -> None:
        call.agent_action = "transfer"

    from pipeline.transports.web.server import Bridge

    bridge = Bridge(rel_config(tmp_path).bridge, transferring, BridgeTokens.of(bearer_token=TOKEN))
    port = await bridge.start()
    try:
        c = await RawCaller(port, call_sid="CAlonely").open()
        assert await c.wait_closed() == 1000 and c.ws.close_reason == "transfer"
        r = await get(port, "/stream-ended?CallSid=CAlonely", auth())
        assert r.text == (f'<?xml version="1.0" encoding="UTF-8"?><Response><Say>{NO_TRANSFER_LINE}</Say>'
                          "<Hangup/></Response>")
    finally:
        await asyncio.wait_for(bridge.stop(), 20)


# ---------------------------------------------------------------- transfer through a whole call


async def test_transfer_speaks_its_line_then_closes_and_the_action_url_dials(tmp_path, store):
    def reply(messages):
        return [tool_call("transfer_to_human", reason="billing question"), "Transferring."][tool_round(messages)]

    cfg = rel_config(tmp_path, transfer_to=NUMBER)
    models = ToolModels(store, stt=ScriptedSTT("I want to talk to a person"), tts=ToneTTS(chunks=2, chunk_s=0.1),
                        backend=recording_backend(reply, []))
    async with agent_bridge(cfg, models) as (bridge, port, handler):
        c = await RawCaller(port).open()  # echoes each mark once it arrives: the audio "played"
        await say_once(c)
        # The call ends by itself: the agent transferred, the caller did not hang up.
        assert await c.wait_closed(20) == 1000 and c.ws.close_reason == "transfer"
        assert c.media_in > 0 and c.marks, "the transfer line was not sent"
        data = await report_of(cfg, c.call_sid)
        assert data["end_reason"] == "transfer" and data["error"] is None
        (turn,) = data["turns"]
        assert turn["action"] == {"action": "transfer", "reason": "billing question"}
        # Spoken to the end before the close: its mark came back (echoed by us) and counted
        # it as heard; a stream closed early would have left it unheard. (The model began
        # with the call: the hold line came first.)
        hold = cfg.tools.hold_line
        assert turn["agent_text"] == turn["agent_text_heard"] == f"{hold} {ACTION_LINES['transfer']}"
        assert handler.calls[0].turns[0].speech.heard == [hold, ACTION_LINES["transfer"]]

        # Twilio now asks the <Connect> action URL what to do with this call: dial.
        r = await get(port, f"/stream-ended?CallSid={c.call_sid}&CallStatus=in-progress", auth())
        assert r.status_code == 200
        assert r.text == f'<?xml version="1.0" encoding="UTF-8"?><Response><Dial>{NUMBER}</Dial></Response>'
        assert (await get(port, f"/stream-ended?CallSid={c.call_sid}", auth())).text == r.text  # a retry too
        assert "<Hangup/>" in (await get(port, "/stream-ended?CallSid=CAsomeoneelse", auth())).text


async def test_end_call_closes_and_the_action_url_hangs_up(tmp_path, store):
    def reply(messages):
        return ["Thanks for calling, goodbye! " + tool_call("end_call"), "Bye."][tool_round(messages)]

    cfg = rel_config(tmp_path, transfer_to=NUMBER)
    models = ToolModels(store, stt=ScriptedSTT("That's all, thanks"), tts=ToneTTS(chunks=1, chunk_s=0.1),
                        backend=recording_backend(reply, []))
    async with agent_bridge(cfg, models) as (_, port, _h):
        c = await RawCaller(port).open()
        await say_once(c)
        assert await c.wait_closed(20) == 1000 and c.ws.close_reason == "call ended"
        assert (await report_of(cfg, c.call_sid))["end_reason"] == "end_call"
        r = await get(port, f"/stream-ended?CallSid={c.call_sid}", auth())
        assert r.text == '<?xml version="1.0" encoding="UTF-8"?><Response><Hangup/></Response>'


async def test_without_a_transfer_number_the_tool_says_so_and_the_call_goes_on(tmp_path, store):
    def reply(messages):
        if tool_round(messages) == 0:
            return [tool_call("transfer_to_human", reason="billing question")]
        return ["Nobody is free right now. Can I take a message?"]

    seen: list[list[dict]] = []
    cfg = rel_config(tmp_path)  # no transfer_to
    models = ToolModels(store, stt=ScriptedSTT("I want to talk to a person"), tts=ToneTTS(chunks=1, chunk_s=0.1),
                        backend=recording_backend(reply, seen))
    async with agent_bridge(cfg, models) as (_, port, handler):
        c = await RawCaller(port).open()
        await c.say()
        await wait_for(lambda: handler.calls, 10, "the call to start")
        assert await handler.calls[0].wait_turns(1, 20)
        turn = handler.calls[0].turns[0]
        assert turn.agent_text == f"{cfg.tools.hold_line} Nobody is free right now. Can I take a message?"
        assert handler.calls[0].ended_by is None and not c.ws.close_code  # still on the line
        (tool,) = turn.llm.tool_calls
        assert tool["name"] == "transfer_to_human" and not tool["ok"] and tool["error"] == NoTransferLine.UNAVAILABLE
        # What the model read back in its second round is that error, so it could offer a message.
        assert seen[1][-1]["role"] == "tool" and json.loads(seen[1][-1]["content"]) == {"error": tool["error"]}
        await c.stop()
        await c.wait_closed()
        data = await report_of(cfg, c.call_sid)
        assert data["end_reason"] == "caller_hangup" and "action" not in data["turns"][0]


# ---------------------------------------------------------------- DTMF through a whole call


async def send_keys(c: RawCaller, keys: str) -> None:
    for key in keys:
        await c.ws.send(encode_event(Dtmf(c.sid, key)))


async def test_keys_become_a_turn_without_stt(tmp_path, store):
    seen: list[list[dict]] = []

    def reply(messages):
        return ["Your booking is confirmed."] if messages[-1]["content"] == "[keypad] 1" else ["Sorry?"]

    cfg = rel_config(tmp_path)
    stt = ScriptedSTT("should not be asked")
    models = ToolModels(store, stt=stt, tts=ToneTTS(chunks=1, chunk_s=0.1), backend=recording_backend(reply, seen))
    async with agent_bridge(cfg, models) as (_, port, handler):
        c = await RawCaller(port).open()
        await send_keys(c, "1#")  # "press 1 to confirm", then '#': answered at once
        await wait_for(lambda: handler.calls, 10, "the call to start")
        call = handler.calls[0]
        assert await call.wait_turns(1, 20)
        assert call.turns[0].user_text == "[keypad] 1"
        assert call.turns[0].agent_text == "Your booking is confirmed."
        assert stt.calls == 0  # no STT for keys
        assert seen[0][-1] == {"role": "user", "content": "[keypad] 1"}
        await c.stop()
        await c.wait_closed()
        data = await report_of(cfg, c.call_sid)
        (turn,) = data["turns"]
        assert turn["input"] == "dtmf" and turn["keypad"] == {"digits": "1", "ended_by": "#"}
        assert turn["user_text"] == "[keypad] 1"
        assert {"speech_start", "end_of_speech", "transcript", "llm_request", "first_audio_out"} <= set(turn["timeline"])
        assert turn["metrics"]["voice_to_voice"] is None  # nothing was voiced: kept out of those figures
        # The history has it as the caller's words for the next turn.
        assert {"role": "user", "content": "[keypad] 1"} in call.history.messages("next")


async def test_keys_without_hash_end_after_the_configured_pause(tmp_path, store):
    seen: list[list[dict]] = []
    cfg = rel_config(tmp_path)
    cfg = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"keypad_timeout_ms": 300})})
    models = ToolModels(store, tts=ToneTTS(chunks=1, chunk_s=0.1),
                        backend=recording_backend(lambda m: ["Got it."], seen))
    async with agent_bridge(cfg, models) as (_, port, handler):
        c = await RawCaller(port).open()
        await send_keys(c, "42")
        await wait_for(lambda: handler.calls, 10, "the call to start")
        assert await handler.calls[0].wait_turns(1, 20)
        await c.stop()
        await c.wait_closed()
        (turn,) = (await report_of(cfg, c.call_sid))["turns"]
        assert turn["keypad"] == {"digits": "42", "ended_by": "timeout"}
        assert seen[0][-1]["content"] == "[keypad] 42"
        # Not before the pause: the timer starts at the last key, after the first arrived.
        assert turn["timeline"]["end_of_speech"] - turn["timeline"]["speech_start"] >= 0.29


async def test_keys_and_speech_are_answered_in_the_order_they_came(tmp_path, store):
    seen: list[list[dict]] = []
    cfg = rel_config(tmp_path)
    models = ToolModels(store, stt=ScriptedSTT("Can I book Tuesday?"), tts=ToneTTS(chunks=1, chunk_s=0.1),
                        backend=recording_backend(lambda m: ["Okay."], seen))
    async with agent_bridge(cfg, models) as (_, port, handler):
        c = await RawCaller(port).open()
        await c.say()
        await wait_for(lambda: handler.calls, 10, "the call to start")
        assert await handler.calls[0].wait_turns(1, 20)
        await send_keys(c, "2#")
        assert await handler.calls[0].wait_turns(2, 20)
        await c.stop()
        await c.wait_closed()
        data = await report_of(cfg, c.call_sid)
        assert [t["user_text"] for t in data["turns"]] == ["Can I book Tuesday?", "[keypad] 2"]
        assert "input" not in data["turns"][0] and data["turns"][1]["input"] == "dtmf"
