"""The tool-call drafter (llm/call_drafter.py): where a call being written stands, what the
schema says comes next, and that drafting with it keeps the target's output exactly."""

from __future__ import annotations

import pytest

from llm.call_drafter import CallDrafter, call_skeleton
from llm.types import SamplingParams

TOOLS = [
    {"type": "function", "function": {"name": "book_slot", "parameters": {"type": "object", "properties": {
        "slot": {"type": "string"}, "name": {"type": "string"},
        "phone": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}},
    {"type": "function", "function": {"name": "cancel_booking", "parameters": {"type": "object", "properties": {
        "name": {"type": "string"}, "booking_id": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "check_slots", "parameters": {"type": "object", "properties": {
        "day": {"type": "string"}}}}},
]
SLOTS = ["Tuesday 10:30 a.m. with Dr. Patel", "Wednesday 2:15 p.m. with Dr. Moreno"]
CALL = '{{"name": "book_slot", "arguments": {'


@pytest.mark.parametrize("text,state,detail", [
    ("Sure, let me check.", None, None),
    ("<tool_call>\n", "opening", None),
    ("{{", "opening", None),
    ('{{"name": "bo', "name", {"partial": "bo"}),
    ('{{"name": "book_slot"', "after_name", {"tool": "book_slot"}),
    ('{{"name": "book_slot", "argu', "after_name", {"partial": ', "argu'}),
    (CALL, "key_start", {"tool": "book_slot"}),
    (CALL + '"sl', "key", {"partial": "sl"}),
    (CALL + '"slot": "Tue', "value", {"key": "slot", "partial": "Tue"}),
    (CALL + '"slot": "Tuesday 10:30 a.m. with Dr. Patel",', "after_value", {"used": ["slot"]}),
    (CALL + '"slot": "a \\" quote", "name": "Al', "value", {"key": "name", "used": ["slot"]}),
    (CALL + '"slot": "X"}}}}', "closing", {"partial": "}}}}"}),
    (CALL + '"slot": "X"}', "closing", {"partial": "}", "closer": "}}}}"}),
    ('<tool_call>\n{"name": "check_slots", "arguments": {"day": "Friday"}', "closing",
     {"closer": "}}\n</tool_call>"}),
    (CALL + '"slot": "X"] ', "other", None),
    # A schema in the system block starts like a call but is not one.
    ('{"name": "book_slot", "description": "Book', "other", None),
])
def test_where_a_call_stands(text, state, detail):
    where = call_skeleton(text)
    if state is None:
        assert where is None
        return
    assert where.state == state
    for key, value in (detail or {}).items():
        assert getattr(where, key) == value


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["target"])


def _drafter(tok) -> CallDrafter:
    return CallDrafter(TOOLS, lambda s: tok.encode(s, add_special_tokens=False), tok.decode, {"slot": SLOTS})


@pytest.mark.parametrize("written,expected", [
    ("<tool_call>\n", '{"name": "'),
    ("{{", '"name": "'),
    ('{{"name": "bo', 'ok_slot", "arguments": {"slot": "'),
    ('{{"name": "c', None),  # cancel_booking or check_slots: no guess
    ('{{"name": "cancel_booking"', ', "arguments": {"name": "'),
    (CALL + '"slot": "Wed', 'nesday 2:15 p.m. with Dr. Moreno", "name": "'),
    (CALL + '"slot": "Tuesday 10:30 a.m. with Dr. Patel", "name": "Ann Lee",', ' "phone": "'),
    (CALL + '"slot": "Tuesday 10:30 a.m. with Dr. Patel", "n', 'ame": "'),
    ('{{"name": "cancel_booking", "arguments": {"name": "Ann", "b', 'ooking_id": '),  # an integer: no quote
    (CALL + '"slot": "Tuesday 10:30 a.m. with Dr. Patel", "name": "An', None),  # the caller's words: n-gram's
    ("The Tuesday slot is open.", None),
    # The end of the call, by how it opened.
    (CALL + '"slot": "Tuesday 10:30 a.m. with Dr. Patel", "name": "Ann Lee", "phone": "555"}', "}}}"),
    ('<tool_call>\n{"name": "check_slots", "arguments": {"day": "Friday"', '}}\n</tool_call>'),
])
def test_what_the_schema_says_comes_next(tokenizer, written, expected):
    d = _drafter(tokenizer)
    context = tokenizer.encode("<|im_start|>assistant\n" + written, add_special_tokens=False)
    assert d.text(context) == (expected or None)
    proposal = d.propose(context, 64, SamplingParams())
    if expected is None:
        assert proposal.tokens == []
    else:
        assert proposal.source == "call" and proposal.probs is None
        assert tokenizer.decode(context + proposal.tokens).endswith(written + expected)
        assert len(d.propose(context, 2, SamplingParams()).tokens) == min(2, len(proposal.tokens))


def test_a_value_copies_the_rest_of_what_the_caller_said(tokenizer):
    """A name the caller gave: written without the space before it, so token lookup misses
    it; the drafter finds the words it began with and proposes the rest of the phrase."""
    d = _drafter(tokenizer)
    said = "<|im_start|>user\nPlease book Tuesday for me, my name is Alma Ruiz.<|im_end|>\n<|im_start|>assistant\n"
    call = CALL + '"slot": "Tuesday 10:30 a.m. with Dr. Patel", "name": "Al'
    context = tokenizer.encode(said + call, add_special_tokens=False)
    assert d.text(context) == 'ma Ruiz", "phone": "'
    # The last argument: then the call's end.
    cancel = '{{"name": "cancel_booking", "arguments": {"booking_id": 3, "name": "Al'
    assert call_skeleton(said + cancel).state == "other"  # a number: not followed further
    asked = said.replace("Please book Tuesday for me, my name is Alma Ruiz.", "Is anything open on Tuesday?")
    context = tokenizer.encode(asked + '{{"name": "check_slots", "arguments": {"day": "Tue', add_special_tokens=False)
    assert d.text(context) == 'sday"}}}}'  # "Tue" -> "Tuesday" from the caller's words, then the end
    # Nothing the caller said begins so: nothing proposed.
    context = tokenizer.encode(said + call[:-2] + 'Zed', add_special_tokens=False)
    assert d.text(context) is None
