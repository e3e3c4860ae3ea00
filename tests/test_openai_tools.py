"""OpenAI `tools` / `tool_calls` for the OpenAI-compatible backend (issue 15), without an
engine: httpx.MockTransport plays the server. What is checked: the request body (tools,
the loop's tool messages as a server parses them), streamed `delta.tool_calls` put
together over arbitrary chunk splits, and the one tool loop (pipeline/stages/tools_step.py)
running the server's calls against the real ToolBox on SQLite, malformed arguments
included. The real llama.cpp server is in tests/test_openai_real_server.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm.openai_backend import OpenAIChatBackend, streamed_tool_parse, wire_messages
from llm.tool_calls import ToolCall
from llm.types import SamplingParams
from pipeline.receptionist.bookings import open_store
from pipeline.stages.respond import respond
from pipeline.stages.tools_step import FALLBACK
from pipeline.timeline import TurnTimeline
from pipeline.receptionist.tools import TOOL_SCHEMAS, ToolBox
from pipeline.turn import LLMResult, Reply

pytestmark = pytest.mark.timeout(120)

SLOTS = ["Tuesday 10:30 a.m. with Dr. Patel", "Wednesday 2:15 p.m. with Dr. Moreno"]
SYSTEM = {"role": "system", "content": "You are the receptionist."}
USER = {"role": "user", "content": "Please book the Wednesday slot for Ann Lee."}
BOOK_ARGS = json.dumps({"slot": SLOTS[1], "name": "Ann Lee"})


# ---------------------------------------------------------------- a scripted server


def sse(events: list) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def content(text: str | None = None, finish: str | None = None) -> dict:
    delta = {} if text is None else {"content": text}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def calls_chunk(*deltas: dict, finish: str | None = None) -> dict:
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"tool_calls": list(deltas)}, "finish_reason": finish}]}


def call_events(name: str, arguments: str, call_id: str = "call_srv1", index: int = 0, size: int = 5) -> list[dict]:
    """A call as OpenAI streams it: id, type and name first, then the arguments in pieces."""
    first = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
    rest = [{"index": index, "function": {"arguments": arguments[i:i + size]}} for i in range(0, len(arguments), size)]
    return [calls_chunk(first)] + [calls_chunk(d) for d in rest]


class Server:
    """The replies of successive requests (the last one repeats); records each request body."""

    def __init__(self, *replies: list) -> None:
        self.replies = replies
        self.bodies: list[dict] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        events = self.replies[min(len(self.bodies) - 1, len(self.replies) - 1)]
        return httpx.Response(200, content=sse(events + ["[DONE]"]), headers={"Content-Type": "text/event-stream"})

    def backend(self, tools=TOOL_SCHEMAS, **kw) -> OpenAIChatBackend:
        return OpenAIChatBackend("http://engine.test/v1", "m", transport=httpx.MockTransport(self.handle),
                                 tools=tools, **kw)


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "bookings.sqlite", open_slots=SLOTS)
    yield s
    s.close()


async def turn(backend, store):
    sentences: asyncio.Queue = asyncio.Queue()
    result = LLMResult()
    await respond(backend, [SYSTEM, USER], Reply(TurnTimeline(), llm=result, params=SamplingParams(max_new_tokens=64),
                                                 sentences=sentences, toolbox=ToolBox(store, "call-openai")))
    spoken = []
    while (s := sentences.get_nowait()) is not None:
        spoken.append(s)
    return result, spoken


def active(store) -> list[tuple[str, str]]:
    return [(b.slot, b.name) for b in store.bookings() if b.cancelled_at is None]


# ---------------------------------------------------------------- the request


async def test_tools_are_sent_only_when_the_backend_has_them():
    server = Server([content("Hi.", "stop")])
    async with server.backend() as b:
        [g async for g in b.stream([SYSTEM, USER], SamplingParams())]
    async with server.backend(tools=None) as b:
        [g async for g in b.stream([SYSTEM, USER], SamplingParams())]
    with_tools, without = server.bodies
    assert with_tools["tools"] == TOOL_SCHEMAS and "tools" not in without
    assert [t["function"]["name"] for t in with_tools["tools"]] == [
        "check_slots", "book_slot", "cancel_booking", "take_message", "transfer_to_human", "end_call"]
    assert with_tools["messages"] == [SYSTEM, USER] == without["messages"]


def test_wire_messages_make_past_calls_parseable():
    messages = [SYSTEM, USER,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "book_slot", "arguments": BOOK_ARGS}},
                    {"function": {"name": "check_slots", "arguments": {"day": "Tuesday"}}},  # no id, a mapping
                    {"id": "x", "type": "function", "function": {"name": "end_call", "arguments": '{"a": '}},
                ]},
                {"role": "tool", "tool_call_id": "call_0", "name": "book_slot", "content": '{"booked": true}'}]
    wired = wire_messages(messages)
    calls = wired[2]["tool_calls"]
    assert [c["id"] for c in calls] == ["call_0", "call_1", "x"]
    assert all(c["type"] == "function" and isinstance(c["function"]["arguments"], str) for c in calls)
    assert calls[0]["function"]["arguments"] == BOOK_ARGS  # valid JSON passes unchanged
    assert json.loads(calls[1]["function"]["arguments"]) == {"day": "Tuesday"}
    # Text that is not JSON travels as a JSON string: the server can parse it, nothing is lost.
    assert json.loads(calls[2]["function"]["arguments"]) == '{"a": '
    assert wired[3] == messages[3] and wired[:2] == messages[:2]
    assert messages[2]["tool_calls"][1]["function"]["arguments"] == {"day": "Tuesday"}  # the input is untouched


# ---------------------------------------------------------------- streamed tool_calls


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name_cuts=st.lists(st.integers(0, 20), max_size=4), arg_cuts=st.lists(st.integers(0, 200), max_size=12),
       other_cuts=st.lists(st.integers(0, 40), max_size=4), interleave=st.booleans())
def test_deltas_accumulate_by_index_over_any_split(name_cuts, arg_cuts, other_cuts, interleave):
    other_args = json.dumps({"day": "Tuesday"})
    first = [{"index": 0, "id": "call_a", "type": "function", "function": {"name": piece}}
             for piece in split_at("book_slot", name_cuts) if piece]
    first += [{"index": 0, "function": {"arguments": piece}} for piece in split_at(BOOK_ARGS, arg_cuts) if piece]
    second = [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "check_slots"}}]
    second += [{"index": 1, "id": "call_b", "function": {"arguments": piece}}  # an id repeated on every piece
               for piece in split_at(other_args, other_cuts) if piece]
    if interleave:  # pieces of the two calls alternate; the index says whose each is
        order = [d for pair in zip(first, second) for d in pair] + first[len(second):] + second[len(first):]
    else:
        order = first + second
    events = [content(None)] + [calls_chunk(d) for d in order] + [content(None, "tool_calls")]

    async def run():
        async with Server(events).backend() as b:
            groups = [g async for g in b.stream([SYSTEM, USER], SamplingParams())]
            return groups, b.last_tool_parse, b.last_stats

    groups, parse, stats = asyncio.run(run())
    assert parse.error is None and parse.found
    assert parse.calls == (ToolCall("book_slot", BOOK_ARGS, id="call_a"),
                           ToolCall("check_slots", other_args, id="call_b"))
    assert "".join(g.text for g in groups) == ""  # nothing of a call is text
    assert groups[-1].finish_reason == "stop" and all(g.finish_reason is None for g in groups[:-1])
    assert stats.passes == len(order) and stats.ttft_s is not None  # each piece is the model at work


async def test_finish_in_the_last_piece_and_no_index():
    # A server may end the answer in the chunk with the last piece, and one without
    # `index` numbers its calls by position in the list.
    events = [calls_chunk({"id": "a", "function": {"name": "check_slots", "arguments": '{"day": '}},
                          {"id": "b", "function": {"name": "end_call", "arguments": "{}"}}),
              calls_chunk({"function": {"arguments": '"Tuesday"}'}}, finish="tool_calls")]
    async with Server(events).backend() as b:
        groups = [g async for g in b.stream([SYSTEM, USER], SamplingParams())]
    assert groups[-1].finish_reason == "stop"
    assert b.last_tool_parse.calls == (ToolCall("check_slots", '{"day": "Tuesday"}', id="a"),
                                       ToolCall("end_call", "{}", id="b"))


async def test_the_parse_of_one_stream_does_not_leak_into_the_next():
    server = Server(call_events("end_call", "{}") + [content(None, "tool_calls")], [content("Bye.", "stop")])
    async with server.backend() as b:
        [g async for g in b.stream([SYSTEM, USER], SamplingParams())]
        assert b.last_tool_parse.calls == (ToolCall("end_call", "{}", id="call_srv1"),)
        [g async for g in b.stream([SYSTEM, USER], SamplingParams())]
        assert b.last_tool_parse is None


async def test_a_cancel_mid_call_leaves_no_call():
    cancel = asyncio.Event()
    async with Server(call_events("book_slot", BOOK_ARGS) + [content(None, "tool_calls")]).backend() as b:
        groups = []
        async for g in b.stream([SYSTEM, USER], SamplingParams(), cancel):
            groups.append(g)
            if len(groups) == 2:
                cancel.set()
        assert groups[-1].finish_reason == "cancelled" and b.last_tool_parse is None


@pytest.mark.parametrize("arguments, problem", [
    ('{"slot": "Wednesday 2:15 p.m. with Dr. Moreno", "name": ', "not valid JSON"),
    ('["Ann Lee"]', "must be a JSON object, got list"),
])
def test_malformed_arguments_are_a_parse_error_quoting_the_call(arguments, problem):
    from llm.openai_backend import _CallPieces

    parse = streamed_tool_parse({0: _CallPieces("c1", "book_slot", arguments)})
    assert parse.calls == () and parse.found and problem in parse.error
    assert "book_slot" in parse.error and parse.raw.startswith("<tool_call>\n{\"name\": \"book_slot\"")
    assert streamed_tool_parse({0: _CallPieces("c1", "", "{}")}).error.startswith('tool call 1: no "name"')
    assert streamed_tool_parse({}) is None
    # No arguments at all is a call with none.
    assert streamed_tool_parse({0: _CallPieces("c1", "end_call", "")}).calls == (ToolCall("end_call", "{}", id="c1"),)


# ---------------------------------------------------------------- the tool loop over the server's calls


async def test_the_loop_books_from_the_servers_tool_calls(store):
    server = Server([content(None)] + call_events("book_slot", BOOK_ARGS, "call_9f2") + [content(None, "tool_calls")],
                    [content("You're booked for Wednesday at 2:15."), content(None, "stop")])
    async with server.backend() as b:
        result, spoken = await turn(b, store)
    assert active(store) == [(SLOTS[1], "Ann Lee")]
    assert spoken == ["You're booked for Wednesday at 2:15."] and not result.fallback
    (entry,) = result.tool_calls
    assert entry["name"] == "book_slot" and entry["ok"] and entry["result"]["booked"] is True

    # The second request carries the call and its result in OpenAI's shape, the server's id kept.
    first, second = server.bodies
    assert second["tools"] == TOOL_SCHEMAS and second["messages"][:2] == [SYSTEM, USER]
    assistant, tool = second["messages"][2:]
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9f2", "type": "function", "function": {"name": "book_slot", "arguments": BOOK_ARGS}}]}
    assert tool["role"] == "tool" and tool["tool_call_id"] == "call_9f2" and tool["name"] == "book_slot"
    assert json.loads(tool["content"])["booked"] is True
    assert result.tool_messages == second["messages"][2:]  # what History keeps for later turns


async def test_text_before_the_call_is_spoken_first(store):
    server = Server([content("Let me book that."), *call_events("book_slot", BOOK_ARGS), content(None, "tool_calls")],
                    [content("Done.", "stop")])
    async with server.backend() as b:
        result, spoken = await turn(b, store)
    assert spoken == ["Let me book that.", "Done."] and active(store) == [(SLOTS[1], "Ann Lee")]
    assert server.bodies[1]["messages"][2]["content"] == "Let me book that."


async def test_malformed_arguments_are_fed_back_once_then_the_fixed_call_runs(store):
    bad = '{"slot": "Wednesday 2:15 p.m. with Dr. Moreno", "name": "Ann'  # cut short
    server = Server(call_events("book_slot", bad, "call_1") + [content(None, "tool_calls")],
                    call_events("book_slot", BOOK_ARGS, "call_2") + [content(None, "tool_calls")],
                    [content("Booked.", "stop")])
    async with server.backend() as b:
        result, spoken = await turn(b, store)
    assert active(store) == [(SLOTS[1], "Ann Lee")] and spoken == ["Booked."] and not result.fallback
    assert [e["ok"] for e in result.tool_calls] == [False, True]
    assert "not valid JSON" in result.tool_calls[0]["error"]
    # The model saw its bad call (as text: arguments a server cannot parse are not sent as
    # a call) and what was wrong with it.
    said, error = server.bodies[1]["messages"][2:4]
    assert said["role"] == "assistant" and "tool_calls" not in said and bad in said["content"]
    assert error["role"] == "tool" and "not valid JSON" in json.loads(error["content"])["error"]


async def test_malformed_twice_speaks_the_fallback_and_books_nothing(store):
    server = Server(call_events("book_slot", '{"slot": ') + [content(None, "tool_calls")])
    async with server.backend() as b:
        result, spoken = await turn(b, store)
    assert result.fallback and spoken == [FALLBACK] and active(store) == []
    assert len(server.bodies) == 2  # fed back once, not again


async def test_wrong_argument_types_are_the_tool_boxs_error(store):
    server = Server(call_events("book_slot", json.dumps({"slot": 3, "name": "Ann Lee"})) + [content(None, "tool_calls")],
                    [content("Which slot would you like?", "stop")])
    async with server.backend() as b:
        result, spoken = await turn(b, store)
    (entry,) = result.tool_calls
    assert not entry["ok"] and "bad arguments for book_slot" in entry["error"] and active(store) == []
    tool = server.bodies[1]["messages"][3]
    assert tool["tool_call_id"] == "call_srv1" and "bad arguments" in json.loads(tool["content"])["error"]
    assert spoken == ["Which slot would you like?"]


async def test_a_call_written_as_text_still_goes_through_the_filter(store):
    text = "<tool_call>\n" + json.dumps({"name": "book_slot", "arguments": json.loads(BOOK_ARGS)}) + "\n</tool_call>"
    server = Server([content(text[i:i + 3]) for i in range(0, len(text), 3)] + [content(None, "stop")],
                    [content("All set.", "stop")])
    async with server.backend() as b:
        result, spoken = await turn(b, store)
    assert active(store) == [(SLOTS[1], "Ann Lee")] and spoken == ["All set."]
    assistant = server.bodies[1]["messages"][2]
    assert assistant["tool_calls"][0]["id"] == "call_0"  # numbered by the turn
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == json.loads(BOOK_ARGS)


def test_agent_gives_the_openai_backend_the_tool_schemas(tmp_path):
    from pipeline.agent import AgentModels
    from pipeline.config import Config, load_config

    data = load_config("default").model_dump()
    data["llm"]["backend"] = "openai"
    data["tools"] = {"enabled": True, "database": str(tmp_path / "b.sqlite")}
    on = Config.model_validate(data)
    data["tools"]["enabled"] = False
    off = Config.model_validate(data)
    models = AgentModels(on, None, None, None)
    assert models.new_backend(on).tools == TOOL_SCHEMAS
    assert models.new_backend(off).tools is None


# ---------------------------------------------------------------- a real llama.cpp server (real_engine)
#
# Qwen2.5-Coder-1.5B-Instruct's GGUF (the default target) behind llama.cpp's server, which
# renders the `tools` through the GGUF's own chat template (jinja mode, xllamacpp's
# default). Measured here (greedy): the 1.5B writes its call as a bare JSON object (or in a
# ```json fence), without the <tool_call> tags llama.cpp's parser looks for, so the server
# streams it as content and the turn's text filter parses it; the tests below assert what
# that makes certain (the booking in the database) and that the server takes the loop's
# OpenAI-shaped tool messages back.

TARGET = "qwen2.5-coder-1.5b-instruct"
CALLER = "Hi, this is Ann Lee. Please book the Wednesday 2:15 p.m. slot with Dr. Moreno for me."


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from realengine import running_server

    yield from running_server(TARGET, tmp_path_factory.mktemp("llama"), threads=2, ctx=4096, alias="qwen")


def tools_config(tmp_path):
    from pipeline.config import Config, load_config

    data = load_config("default").model_dump()
    data["tools"] = {"enabled": True, "database": str(tmp_path / "bookings.sqlite")}
    return Config.model_validate(data)


@pytest.mark.real_engine
@pytest.mark.slow
@pytest.mark.timeout(1500)
async def test_real_server_turn_books_the_slot_in_sqlite(qwen, tmp_path):
    """The whole tool loop against the real server: the caller's request, the 1.5B's call,
    book_slot on SQLite, the result sent back, the model's answer."""
    import time

    from pipeline.receptionist.prompt import system_prompt, tool_schemas

    cfg = tools_config(tmp_path)
    store = open_store(cfg.tools.database, open_slots=cfg.business.open_slots)
    sentences: asyncio.Queue = asyncio.Queue()
    result, events = LLMResult(), []
    backend = OpenAIChatBackend(qwen.base_url, "qwen", timeout_s=900, tools=tool_schemas(cfg),
                                extra_body={"stream_options": {"include_usage": True}})
    params = SamplingParams(max_new_tokens=cfg.llm.max_new_tokens, temperature=0.0, seed=0)
    started = time.monotonic()
    async with backend:
        await respond(backend, [{"role": "system", "content": system_prompt(cfg)}, {"role": "user", "content": CALLER}],
                      Reply(TurnTimeline(), llm=result, params=params, sentences=sentences,
                            emit=lambda e: events.append((round(time.monotonic() - started, 2), e.kind, e.as_dict())),
                            toolbox=ToolBox(store, "call-real-openai")))
    spoken = []
    while (s := sentences.get_nowait()) is not None:
        spoken.append(s)
    print("tool calls:", json.dumps(result.tool_calls, default=str))
    print("events:", [e for e in events if e[1] != "llm_text"])
    print("spoken:", spoken, "stats:", result.stats, "total_s:", round(time.monotonic() - started, 1))
    booked = active(store)
    store.close()
    assert result.error is None, result.error
    assert booked == [("Wednesday 2:15 p.m. with Dr. Moreno", "Ann Lee")]
    assert result.tool_calls[-1]["name"] == "book_slot" and result.tool_calls[-1]["ok"] and not result.fallback
    # The round after the tool ran: the server took the tool messages and the model spoke.
    assert spoken and not any("{" in s or "<tool" in s or "```" in s for s in spoken)
    assert result.tool_messages[-1]["role"] == "tool" and json.loads(result.tool_messages[-1]["content"])["booked"]


@pytest.mark.real_engine
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_real_server_takes_the_loops_tool_messages(qwen):
    """Deterministic whatever the model writes: the assistant tool_calls and tool messages
    the loop appends (OpenAI's shape, through wire_messages) are accepted by the server and
    rendered by the model's template as its own <tool_call> / <tool_response> blocks; so is
    the shape of a call that could not be parsed (assistant text, then the error)."""
    args = {"slot": "Wednesday 2:15 p.m. with Dr. Moreno", "name": "Ann Lee"}
    ok_round = [{"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "book_slot", "arguments": json.dumps(args)}}]},
                {"role": "tool", "tool_call_id": "call_0", "name": "book_slot", "content": '{"booked": true}'}]
    bad_round = [{"role": "assistant", "content": '<tool_call>\n{"name": "book_slot", "arguments": {"slot": \n</tool_call>'},
                 {"role": "tool", "content": json.dumps({"error": "tool call 1: not valid JSON"})}]
    for step in (ok_round, bad_round):
        messages = wire_messages([SYSTEM, {"role": "user", "content": CALLER}, *step])
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.post(f"{qwen.root_url}/apply-template", json={"messages": messages, "tools": TOOL_SCHEMAS})
        assert r.status_code == 200, r.text
        prompt = r.json()["prompt"]
        assert "<tool_response>" in prompt and step[1]["content"] in prompt
        if step is ok_round:
            call = prompt[prompt.index("<tool_call>", prompt.index("<|im_start|>assistant")):]
            assert '"name": "book_slot"' in call and '"Ann Lee"' in call
        # ... and a generation over it (a few tokens: the request is what is tested).
        async with OpenAIChatBackend(qwen.base_url, "qwen", timeout_s=600, tools=TOOL_SCHEMAS) as b:
            groups = [g async for g in b.stream(messages, SamplingParams(max_new_tokens=3, temperature=0.0))]
        assert groups[-1].finish_reason in ("length", "eos", "stop")
