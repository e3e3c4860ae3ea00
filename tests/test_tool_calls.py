"""llm/tool_calls.py: the streaming filter never lets a tool call's text through, whatever
the chunking, and the parser turns what it held into calls or a clear error."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llm.tool_calls import BARE_STARTS, CLOSE, OPEN, ToolCall, ToolCallFilter, parse_tool_calls

BOOK = '{"name": "book_slot", "arguments": {"slot": "tue-0900", "name": "Ann Lee"}}'
CHECK = '{"name": "check_slots", "arguments": {"day": "Tuesday"}}'


def run(chunks: list[str]) -> tuple[str, object]:
    f = ToolCallFilter()
    spoken = "".join(f.feed(c) for c in chunks)
    tail, parse = f.finish()
    return spoken + tail, parse


def split_at(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


STREAMS = [
    # (model output, speakable text, calls)
    ("Sure, Tuesday at nine works.", "Sure, Tuesday at nine works.", ()),
    (f"{OPEN}\n{BOOK}\n{CLOSE}", "", (ToolCall("book_slot", '{"slot": "tue-0900", "name": "Ann Lee"}'),)),
    (f"Let me check.\n{OPEN}\n{CHECK}\n{CLOSE}", "Let me check.\n",
     (ToolCall("check_slots", '{"day": "Tuesday"}'),)),
    (f"{OPEN}\n{CHECK}\n{CLOSE}\n{OPEN}\n{BOOK}\n{CLOSE}", "",
     (ToolCall("check_slots", '{"day": "Tuesday"}'),
      ToolCall("book_slot", '{"slot": "tue-0900", "name": "Ann Lee"}'))),
    # Text that looks like the start of the tag but is not: spoken in full.
    ("Use <tool or <tool_c> freely, a < b.", "Use <tool or <tool_c> freely, a < b.", ()),
    ("It ends on <tool_c", "It ends on <tool_c", ()),
    # No closing tag before the end: still the call the model meant.
    (f"{OPEN}\n{BOOK}", "", (ToolCall("book_slot", '{"slot": "tue-0900", "name": "Ann Lee"}'),)),
]


@given(st.sampled_from(STREAMS), st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_any_split_gives_the_same_speech_and_calls(case, cuts):
    text, spoken, calls = case
    out, parse = run(split_at(text, cuts))
    assert out == spoken
    assert parse.calls == calls and parse.error is None
    assert OPEN not in out


@given(st.text(alphabet="ab<>/_ltoc{}\"", max_size=40),
       st.text(alphabet="ab<>/_ltoc{}\" ", max_size=40),
       st.lists(st.integers(min_value=0, max_value=200), max_size=10))
def test_nothing_from_the_tag_on_is_spoken(before, after, cuts):
    """Arbitrary text around a tag, arbitrary chunking: what is spoken is exactly the text
    before the first tag, so no token of a call (nor of a half tag) reaches the caller."""
    text = before + OPEN + after
    first = text.find(OPEN)
    if text.lstrip().startswith(BARE_STARTS):  # a bare call: held from its start
        first = len(text) - len(text.lstrip())
    out, parse = run(split_at(text, cuts))
    assert out == text[:first]
    assert parse.found and parse.raw == text[first:]


@given(st.text(max_size=60), st.lists(st.integers(min_value=0, max_value=200), max_size=10))
def test_text_without_a_tag_passes_whole(text, cuts):
    if OPEN in text or text.lstrip().startswith(BARE_STARTS) or re.search(r'\{\s*"name"\s*:', text):
        return
    out, parse = run(split_at(text, cuts))
    assert out == text and not parse.found and parse.error is None


def test_partial_prefix_is_held_until_proven():
    f = ToolCallFilter()
    assert f.feed("Okay <tool") == "Okay "
    assert f.feed("_c") == ""
    assert f.feed("all>{") == ""  # became a tag: held from here on
    assert f.feed("Okay") == ""
    f2 = ToolCallFilter()
    assert f2.feed("a <tool") == "a "
    assert f2.feed("box") == "<toolbox"  # was not a tag after all


@given(st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_bare_call_with_the_templates_doubled_braces_is_held_and_parsed(cuts):
    # Qwen2.5-Coder-1.5B answered a booking request with exactly this (no tags).
    text = '{{"name": "book_slot", "arguments": {"slot": "Wednesday 2:15 p.m. with Dr. Moreno", "name": "Ann Lee"}}}}'
    out, parse = run(split_at(" " + text, cuts))
    assert out.strip() == ""
    assert parse.calls == (ToolCall("book_slot", '{"slot": "Wednesday 2:15 p.m. with Dr. Moreno", "name": "Ann Lee"}'),)


@pytest.mark.parametrize("text", [
    # Seen from Qwen2.5-Coder-1.5B with small changes to the system prompt.
    '```json\n{"name": "book_slot", "arguments": {"slot": "Wed", "name": "Ann Lee"}}\n```',
    '<tools>\n{"name": "book_slot", "arguments": {"slot": "Wed", "name": "Ann Lee"}}\n</tools>',
    '{{"name": "book_slot", "arguments": {"slot": "Wed", "name": "Ann Lee"}}}',
])
def test_wrapped_bare_calls(text):
    for cuts in ([], [1], [2, 3], list(range(len(text)))):
        out, parse = run(split_at(text, cuts))
        assert out == "" and parse.calls == (ToolCall("book_slot", '{"slot": "Wed", "name": "Ann Lee"}'),)


def test_a_start_that_only_looks_like_a_wrapper_is_spoken():
    assert run(["<", "to", "day is fine."]) == ("<today is fine.", parse_tool_calls(""))
    assert run(["`"]) == ("`", parse_tool_calls(""))


def test_brace_after_speech_is_spoken_and_bare_junk_is_an_error():
    assert run(["It costs {about} $89."]) == ("It costs {about} $89.", parse_tool_calls(""))
    out, parse = run(['{"total": 89}'])
    assert out == "" and parse.found and '"name"' in parse.error and "<tool_call>" in parse.error


# ---- calls written as prose: a tool name, then a JSON object (no tags) ----

NAMES = frozenset({"check_slots", "book_slot", "cancel_booking", "take_message", "transfer_to_human", "end_call"})
MESSAGE = ToolCall("take_message", '{"name": "Ann", "text": "call me back"}')
BOOKED = ToolCall("book_slot", '{"slot": "Tuesday 10:30", "name": "Ann Lee"}')
PROSE = [
    # (model output, speakable text, the call): forms Qwen2.5-Coder-1.5B wrote with tools on.
    ('Take_message, {"name": "Ann", "text": "call me back"}', "", MESSAGE),
    ('Sure. take_message({"name": "Ann", "text": "call me back"})', "Sure. ", MESSAGE),
    ('I\'ll book it: book_slot {"slot": "Tuesday 10:30", "name": "Ann Lee"}', "I'll book it: ", BOOKED),
    # The JSON a whole call, not only the arguments.
    ('Okay. Book_slot: {"name": "book_slot", "arguments": {"slot": "Tuesday 10:30", "name": "Ann Lee"}}',
     "Okay. ", BOOKED),
    # A call object after speech, with no name before it.
    ('One moment. {"name": "take_message", "arguments": {"name": "Ann", "text": "call me back"}}',
     "One moment. ", MESSAGE),
]


def run_named(chunks: list[str]) -> tuple[list[str], str, object]:
    f = ToolCallFilter(tool_names=NAMES)
    outs = [f.feed(c) for c in chunks]
    tail, parse = f.finish()
    return outs, tail, parse


def small_deltas(text: str, sizes: tuple[int, ...]) -> list[str]:
    out, i, k = [], 0, 0
    while i < len(text):
        out.append(text[i:i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    return out


@pytest.mark.parametrize("sizes", [(1,), (2,), (3,), (1, 3, 2), (2, 1)])
@pytest.mark.parametrize("text,spoken,call", PROSE)
def test_prose_call_is_held_and_parsed(text, spoken, call, sizes):
    outs, tail, parse = run_named(small_deltas(text, sizes))
    heard = "".join(outs) + tail
    assert heard == spoken  # the text before the name, and nothing of the name or the JSON
    assert "{" not in heard and call.name not in heard.lower()
    assert parse.error is None and parse.calls == (call,)
    # The speech before the call went out before the call was complete, not at the end.
    if spoken:
        assert "".join(outs[:-1]).startswith(spoken.rstrip())


@given(st.sampled_from(PROSE), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_prose_call_any_split(case, cuts):
    text, spoken, call = case
    outs, tail, parse = run_named(split_at(text, cuts))
    assert "".join(outs) + tail == spoken and parse.calls == (call,)


@pytest.mark.parametrize("text", [
    "I can take a message for you.",
    "Booking is easy, just tell me the day.",
    "Let me check the book_slot list. Facebook_slot {x} is not a tool.",
    "Take it easy. End call? No.",
])
@pytest.mark.parametrize("sizes", [(1,), (2,), (3,), (1, 3, 2)])
def test_speech_with_tool_like_words_passes_without_delay(text, sizes):
    chunks = small_deltas(text, sizes)
    outs, tail, parse = run_named(chunks)
    assert "".join(outs) + tail == text and not parse.found
    # Nothing waits for the end of the answer: what ends on the last delta was already spoken
    # by then unless it could still begin a call (a bounded window, no more).
    assert tail == "" or len(tail) <= max(map(len, NAMES)) + 9
    if text.endswith("."):
        assert tail == ""


def test_a_partial_name_waits_only_until_decided():
    f = ToolCallFilter(tool_names=NAMES)
    assert f.feed("Let me b") == "Let me "
    assert f.feed("oo") == ""
    assert f.feed("k it") == "book it"  # not a name after all: spoken at once
    assert f.feed(" take_mes") == " "
    assert f.feed("sage, ") == ""  # a whole name and separators: the brace may still come
    assert f.feed("{") == ""  # it came: held from the name on
    f2 = ToolCallFilter(tool_names=NAMES)
    assert f2.feed("Use take_message, ") == "Use "
    assert f2.feed("then hang up.") == "take_message, then hang up."


def test_prose_call_shapes_that_are_not_a_call_are_errors():
    for text in ['take_message, {"name": "Ann", ', 'book_slot({"name": "book_slot", "arguments": [1]})',
                 'end_call {"name": 7, "arguments": {}}']:
        outs, tail, parse = run_named(small_deltas(text, (2,)))
        assert "".join(outs) + tail == "" and parse.found and not parse.calls
        assert parse.error.startswith("tool call 1:") and "<tool_call>" in parse.error


def test_prose_parse_needs_a_known_name():
    assert parse_tool_calls('Okay, {"a": 1}', NAMES) == parse_tool_calls("")
    assert parse_tool_calls('take_message, {"text": "hi"}') == parse_tool_calls("")  # no names given
    p = parse_tool_calls('END_CALL {{"name": "end_call"}}', NAMES)
    assert p.calls == (ToolCall("end_call", "{}"),)


def test_bad_json_is_an_error_quoting_the_call():
    p = parse_tool_calls(f'{OPEN}\n{{"name": "book_slot", "arguments": {{"slot": }}\n{CLOSE}')
    assert p.found and not p.calls
    assert "not valid JSON" in p.error and "book_slot" in p.error


def test_shapes_that_are_not_a_call():
    assert "empty" in parse_tool_calls(f"{OPEN}\n{CLOSE}").error
    assert "JSON object" in parse_tool_calls(f"{OPEN}[1, 2]{CLOSE}").error
    assert '"name"' in parse_tool_calls(f'{OPEN}{{"arguments": {{}}}}{CLOSE}').error
    assert "arguments" in parse_tool_calls(f'{OPEN}{{"name": "x", "arguments": [1]}}{CLOSE}').error


def test_one_bad_block_fails_the_round():
    p = parse_tool_calls(f"{OPEN}{CHECK}{CLOSE}{OPEN}{{oops{CLOSE}")
    assert p.calls == () and p.error.startswith("tool call 2:")


def test_arguments_kept_raw():
    # Double-encoded arguments pass through as text (the tool box validates them).
    p = parse_tool_calls(f'{OPEN}{{"name": "end_call", "arguments": "{{}}"}}{CLOSE}')
    assert p.calls == (ToolCall("end_call", "{}"),)
    p = parse_tool_calls(f'{OPEN}{{"name": "end_call"}}{CLOSE}')
    assert p.calls == (ToolCall("end_call", "{}"),)
    # Non-ASCII names survive as heard.
    p = parse_tool_calls(f'{OPEN}{{"name": "book_slot", "arguments": {{"name": "Zoë Ó Briain"}}}}{CLOSE}')
    assert json.loads(p.calls[0].arguments) == {"name": "Zoë Ó Briain"}


def test_message_is_openai_shaped():
    call = ToolCall("check_slots", '{"day": "Tuesday"}')
    assert call.message() == {"type": "function", "function": {"name": "check_slots", "arguments": '{"day": "Tuesday"}'}}


# ---- the engine: tools through the chat template, speculation exact on tool-call tokens ----

# Qwen2.5's chat template (tool calling included), as shipped with Qwen2.5-Coder-1.5B-Instruct.
QWEN25_TEMPLATE = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
'''

TOOLS = [
    {"type": "function", "function": {
        "name": "check_slots", "description": "List the open appointment slots, optionally for one day.",
        "parameters": {"type": "object", "properties": {"day": {"type": "string"}}, "required": []}}},
    {"type": "function", "function": {
        "name": "book_slot", "description": "Book an open slot for a caller.",
        "parameters": {"type": "object", "properties": {"slot": {"type": "string"}, "name": {"type": "string"}},
                       "required": ["slot", "name"]}}},
]
TOOL_DIALOGUE = [
    {"role": "system", "content": "You are the receptionist of Riverside Dental."},
    {"role": "user", "content": "Can I book the Tuesday morning slot? My name is Ann Lee."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "book_slot", "arguments": '{"slot": "tue-0900", "name": "Ann Lee"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "name": "book_slot",
     "content": '{"booked": true, "slot": "tue-0900", "name": "Ann Lee"}'},
]


@pytest.fixture(scope="module")
def qwen_chat_model(tiny_models, tmp_path_factory):
    """The tiny random Qwen2 target with a tokenizer that carries Qwen2.5's chat template."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    # The tests' byte-level tokenizer spells the template out in ~1000 tokens: more positions
    # than tinymodels' 1024.
    path = tmp_path_factory.mktemp("qwenchat") / "model"
    cfg = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      initializer_range=0.3, tie_word_embeddings=False, eos_token_id=0, bos_token_id=0,
                      pad_token_id=0)
    torch.manual_seed(1)
    Qwen2ForCausalLM(cfg).eval().save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(tiny_models["target"])
    tok.chat_template = QWEN25_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


def _engine(path, drafter="none", gamma=0, draft=None):
    from llm.engine import SpeculativeEngine

    return SpeculativeEngine.load(path, draft, drafter=drafter, gamma=gamma, dtype="float32", calibrate=False)


def test_chat_prompt_renders_tools_and_tool_messages(qwen_chat_model):
    eng = _engine(qwen_chat_model)
    tok = eng.target.tokenizer
    text = tok.decode(eng.chat_prompt(TOOL_DIALOGUE, tools=TOOLS))
    assert "# Tools" in text and '"name": "book_slot"' in text
    # The call as the model writes it: arguments a JSON object, not a quoted string.
    assert '<tool_call>\n{"name": "book_slot", "arguments": {"slot": "tue-0900", "name": "Ann Lee"}}\n</tool_call>' in text
    assert '<tool_response>\n{"booked": true' in text
    assert text.endswith("<|im_start|>assistant\n")
    # Without tools nothing of them is rendered (the default prompt is unchanged).
    assert "# Tools" not in tok.decode(eng.chat_prompt(TOOL_DIALOGUE[:2]))


def test_warm_system_prefix_with_tools_is_a_prefix_of_every_turn(qwen_chat_model):
    """The system block's K/V is computed once per process (warm_prefix): with tools in the
    prompt it must still be a token prefix of each turn's prompt, tool rounds included."""
    eng = _engine(qwen_chat_model)
    system = eng.chat_prompt(TOOL_DIALOGUE[:1], add_generation_prompt=False, tools=TOOLS)
    for n in (2, 4):
        full = eng.chat_prompt(TOOL_DIALOGUE[:n], tools=TOOLS)
        assert full[: len(system)] == system


# Mid-call prompts: after the tool result, and inside a call the model is writing (JSON
# the n-gram drafter can copy from the schemas and the earlier call).
def _prompts(eng):
    after_result = eng.chat_prompt(TOOL_DIALOGUE, tools=TOOLS)
    mid_call = eng.chat_prompt(TOOL_DIALOGUE[:2], tools=TOOLS) + eng.encode('<tool_call>\n{"name": "book_slot", "arguments": {"')
    return [after_result, mid_call]


@pytest.mark.parametrize("drafter,gamma", [("ngram", 4), ("model", 3), ("hybrid", 5)])
def test_speculation_on_tool_call_prompts_is_exact(qwen_chat_model, drafter, gamma):
    from llm.types import SamplingParams

    params = SamplingParams(max_new_tokens=40)
    base = _engine(qwen_chat_model)
    spec = _engine(qwen_chat_model, drafter, gamma, qwen_chat_model if drafter != "ngram" else None)
    accepted = 0
    for prompt in _prompts(base):
        want, _, _ = base.generate(prompt, params)
        got, groups, stats = spec.generate(prompt, params)
        assert got == want
        accepted += stats.accepted
    if drafter != "ngram":  # the draft is the target itself: its drafts are all kept
        assert accepted > 0


@pytest.mark.parametrize("drafter,gamma", [("ngram", 4), ("ngram", "auto"), ("model", 3)])
def test_drafting_calls_from_the_schemas_is_exact(qwen_chat_model, drafter, gamma):
    """The call drafter (llm/call_drafter.py) ahead of the conversation's own drafters: the
    same tokens as the target alone, and it was asked for drafts."""
    from llm.backend import SpeculativeBackend
    from llm.call_drafter import CallDrafter
    from llm.types import SamplingParams

    params = SamplingParams(max_new_tokens=40)
    base = _engine(qwen_chat_model)
    spec = _engine(qwen_chat_model, drafter, gamma, qwen_chat_model if drafter == "model" else None)
    offered = []
    for prompt in _prompts(base):
        conv = SpeculativeBackend(spec, tools=TOOLS, tool_values={"slot": ["tue-0900", "wed-1415"]}).conversation
        call_drafter = conv.drafters[0]
        assert isinstance(call_drafter, CallDrafter) and len(conv.drafters) == 2
        offers = []
        propose = call_drafter.propose
        call_drafter.propose = lambda *a: offers.append(propose(*a)) or offers[-1]
        want, _, _ = base.generate(prompt, params)
        got, _, _ = spec.generate(prompt, params, conv)
        assert got == want
        offered.append(len(offers))
    # Asked on every drafting pass. (What it offers is tests/test_call_drafter.py's: a random
    # target's first token leaves the call, so its offers here are few; bench tools measures
    # them on the real pair, answers identical.)
    assert all(offered)
    # Speculation off: nothing to draft with; asked twice: one call drafter.
    assert SpeculativeBackend(base, tools=TOOLS).conversation.drafters == []
    conv = spec.new_conversation()
    spec.draft_calls(conv, TOOLS)
    spec.draft_calls(conv, TOOLS)
    assert sum(isinstance(d, CallDrafter) for d in conv.drafters) == 1


def test_a_call_kept_as_written_extends_the_prompt_the_model_read(qwen_chat_model):
    """The 1.5B writes calls as `{{"name": ...}}}}` (from the braces of Qwen2.5's tool
    instructions). Re-rendered from the parsed call, the next round's prompt diverged from
    the KV cache at the call's first token; kept `as_written` it begins with the prompt the
    model read plus what it wrote, so only the tool's result is prefilled."""
    from llm.openai_backend import wire_messages

    eng = _engine(qwen_chat_model)
    written = '{{"name": "book_slot", "arguments": {"slot": "tue-0900", "name": "Ann Lee"}}}}'
    read = eng.chat_prompt(TOOL_DIALOGUE[:2], tools=TOOLS)
    cached = read + eng.encode(written)
    assistant, result = dict(TOOL_DIALOGUE[2]), TOOL_DIALOGUE[3]
    assert assistant["tool_calls"]
    kept = eng.chat_prompt(TOOL_DIALOGUE[:2] + [{**assistant, "as_written": written}, result], tools=TOOLS)
    assert kept[: len(cached)] == cached
    assert '<tool_response>\n{"booked": true' in eng.target.tokenizer.decode(kept[len(cached):])
    rerendered = eng.chat_prompt(TOOL_DIALOGUE[:2] + [assistant, result], tools=TOOLS)
    assert rerendered[: len(cached)] != cached  # what the as_written key is for
    # An OpenAI server never sees the key: it renders calls from `tool_calls` itself.
    assert all("as_written" not in m for m in wire_messages([{**assistant, "as_written": written}, result]))


def test_backend_tool_round_reuses_the_conversation_cache_and_stays_exact(qwen_chat_model):
    """Round 2 of a tool turn (the call and its result appended) prefills only what is new,
    and gives what a fresh engine gives on the same prompt."""
    import asyncio

    from llm.backend import SpeculativeBackend
    from llm.types import SamplingParams

    params = SamplingParams(max_new_tokens=12)
    eng = _engine(qwen_chat_model, "ngram", 4)
    backend = SpeculativeBackend(eng, tools=TOOLS)

    async def stream(messages):
        return [g async for g in backend.stream(messages, params)]

    asyncio.run(stream(TOOL_DIALOGUE[:2]))
    groups = asyncio.run(stream(TOOL_DIALOGUE))
    stats = backend.last_stats
    assert stats.prefilled_tokens < stats.prompt_tokens
    want, _, _ = _engine(qwen_chat_model).generate(eng.chat_prompt(TOOL_DIALOGUE, tools=TOOLS), params)
    assert [t for g in groups for t in g.token_ids] == want
