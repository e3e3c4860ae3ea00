"""Drafts the structure of a tool call from the tools' schemas.

Inside a call the target writes JSON whose skeleton is known before it is written: after
`{"name": "bo` comes `ok_slot", "arguments": {"slot": "`; after a value's `",` comes the
next argument's name; an open slot's label is one of a few strings. Prompt lookup (the
n-gram drafter) misses most of these: the nearest earlier `"name": "` in the context is a
schema's or the instructions' `<function-name>`, and a name the caller said is written
without the space before it, so its tokens differ (bench tools: the calls' 715 tokens took
347 target passes with n-gram drafts alone). This drafter reads the call written so far
(the decoded tail of the context), finds where it stands in the call, and proposes the
text that the schema says comes next, as tokens. It only proposes; the target decides, so
greedy output stays identical and sampled output keeps the target's distribution (a
proposal is a point mass, as the n-gram drafter's are).

What it proposes, by where the call stands:
    just opened (`<tool_call>`, `{{`)  `{"name": "`
    in the tool's name         the rest of the one tool name it can be, then `", "arguments": {"<first>": "`
    in an argument's name      the rest of the one unused argument it can be (the next in the
                               schema's order when none of it is written yet), then `": "`
    in a string value          the rest of the one listed value it can be (e.g. an open slot), or
                               of the caller's phrase it began copying (a name), then
                               `", "<next unused argument>": "`, or the call's end if none is left
    after a value's `",`       ` "<next unused argument>": "`
    after the last value       the call's end: `}}` and the opener's own (`}}`, `</tool_call>`)
Elsewhere (free text the caller said, a number, outside a call) it proposes nothing and the
n-gram drafter's offer stands.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from llm.drafters import Proposal
from llm.types import SamplingParams

__all__ = ["CallDrafter", "call_skeleton"]

# Where a call's JSON begins: Qwen2.5's `{"name": "` after a <tool_call> tag, or, as the
# 1.5B writes it, with a doubled brace, or at a line's start.
_CALL_START = re.compile(r'(<tool_call>\s*|\{|^|\n)\{"name":\s*"')  # not `"arguments": {"name": "`
# A call just opened: the tag (Qwen2.5's format) or the doubled brace the 1.5B copies from
# the template's instructions, at the start of a line.
_OPENING = re.compile(r'(<tool_call>\n?|(^|\n)\{\{)\s*$')
_TAIL_TOKENS = 160  # the call so far and the caller's line before it
_SEAM = 3  # tokens re-encoded with a proposal (CallDrafter.tokens_after)
# Where a value the caller said ends in their words (a name before "and", a period...).
_PHRASE_END = re.compile(r'[.,;:!?"<\n]| and | my | at | on ')
_ARGUMENTS = ', "arguments": {'  # between the tool's name and its arguments, as Qwen2.5 writes it


@dataclass
class _Where:
    """Where a call written so far stands."""

    tool: str | None = None  # the tool's name, once closed
    partial: str = ""  # what is written of the string being written
    key: str | None = None  # the argument whose value is being written (None: in a key)
    used: list[str] = field(default_factory=list)  # arguments written so far
    state: str = "name"  # opening | name | after_name | key_start | key | value | after_value | closing | other
    closer: str = "}}"  # what ends the call after its last value's quote (by how it opened)
    before: str = ""  # the text before the call: the caller's words are in it


def call_skeleton(text: str) -> _Where | None:
    """Where the last call in `text` stands, or None if `text` does not end inside one."""
    if (opening := _OPENING.search(text)) is not None:
        return _Where(state="opening", partial=opening.group(0))
    starts = list(_CALL_START.finditer(text))
    if not starts:
        return None
    m = starts[-1]
    rest = text[m.end():]
    opened = m.group(1)
    w = _Where(closer="}}" + ("}}" if opened == "{" else "\n</tool_call>" if opened.startswith("<") else ""),
               before=text[:m.start()])
    # The tool's name: up to its closing quote.
    q = rest.find('"')
    if q < 0:
        w.partial = rest
        return w
    w.tool = rest[:q]
    rest = rest[q + 1:]
    a = re.match(r'\s*,\s*"arguments"\s*:\s*\{', rest)
    if a is None:
        w.state = "after_name" if _ARGUMENTS.startswith(rest) else "other"
        w.partial = rest
        return w
    rest = rest[a.end():]
    # The arguments object: "key": "value" pairs with plain string values (what the tools
    # take); anything else (a nested object, a number) is "other" from there on.
    while True:
        k = re.match(r'\s*"', rest)
        if k is None:
            w.state = "other" if rest.strip() else "key_start"
            return w
        rest = rest[k.end():]
        q = rest.find('"')
        if q < 0:
            w.state, w.partial = "key", rest
            return w
        key = rest[:q]
        rest = rest[q + 1:]
        c = re.match(r'\s*:\s*"', rest)
        if c is None:
            w.state = "other"
            return w
        rest = rest[c.end():]
        w.key = key
        value_end = _string_end(rest)
        if value_end < 0:
            w.state, w.partial = "value", rest
            return w
        w.used.append(key)
        w.key = None
        rest = rest[value_end + 1:]
        sep = re.match(r'\s*,', rest)
        if sep is None:
            # The object closes (`}}`, then the opener's own end), or something we do not follow.
            w.state, w.partial = ("closing", rest) if w.closer.startswith(rest) else ("other", "")
            return w
        rest = rest[sep.end():]
        if not rest.strip():
            w.state = "after_value"
            return w


def _string_end(s: str) -> int:
    """Index of the quote that closes a JSON string body `s`, or -1 if it is still open."""
    i = 0
    while i < len(s):
        if s[i] == "\\":
            i += 2
            continue
        if s[i] == '"':
            return i
        i += 1
    return -1


def _one(partial: str, options: list[str]) -> str | None:
    """The one option `partial` can still become (by prefix), or None."""
    fits = [o for o in options if o.startswith(partial) and o != partial]
    return fits[0] if len(fits) == 1 else None


@dataclass
class CallDrafter:
    """Proposes the next tokens of a tool call from the schemas (module docstring).

    `tools`: OpenAI "tools" entries; `values`: for an argument name, the strings it takes
    (an open slot's labels, say); `encode`/`decode`: the target's tokenizer."""

    tools: list[dict]
    encode: Any  # str -> list[int]
    decode: Any  # list[int] -> str
    values: dict[str, list[str]] = field(default_factory=dict)
    name: str = "call"

    def __post_init__(self) -> None:
        # tool -> its arguments in schema order (the order models write them in), and for
        # each argument what opens its value: a quote for a string, nothing otherwise.
        self._args: dict[str, list[str]] = {}
        self._opens: dict[str, str] = {}
        for t in self.tools:
            fn = t.get("function", t) if isinstance(t, dict) else {}
            if isinstance(fn.get("name"), str):
                props = (fn.get("parameters") or {}).get("properties") or {}
                self._args[fn["name"]] = list(props)
                for p, spec in props.items():
                    self._opens.setdefault(p, '"' if '"string"' in json.dumps(spec) else "")

    def text(self, context: list[int]) -> str | None:
        """What the call needs next, as text ("" or None: nothing to propose)."""
        where = call_skeleton(self.decode(context[-_TAIL_TOKENS:]))
        if where is None:
            return None
        if where.state == "opening":  # after `{{` the object has begun; after the tag it has not
            return '"name": "' if where.partial.rstrip().endswith("{") else '{"name": "'
        if where.state == "name":
            tool = _one(where.partial, list(self._args))
            return None if tool is None else tool[len(where.partial):] + '"' + _ARGUMENTS + self._key(self._args[tool])
        if where.state == "after_name":
            return _ARGUMENTS[len(where.partial):] + self._key(self._args.get(where.tool or "", []))
        left = [a for a in self._args.get(where.tool or "", []) if a not in where.used]  # arguments not written yet
        if where.state == "key_start":
            return self._key(left) or None
        if where.state == "key":
            key = _one(where.partial, left) if where.partial else (left[0] if left else None)
            return None if key is None else key[len(where.partial):] + '": ' + self._opens.get(key, "")
        if where.state == "value":
            value = self._value(where)
            if value is None:
                return None
            # Then the next argument, as the model writes it (`",` is one token), or the end.
            after = [a for a in left if a != where.key]
            return value + ('", ' + self._key(after) if after else '"' + where.closer)
        if where.state == "after_value":
            return (" " + self._key(left)) if left else None
        if where.state == "closing":
            return where.closer[len(where.partial):] or None
        return None

    def _value(self, where: _Where) -> str | None:
        """The rest of the value being written: the one listed value it can be, else the
        rest of the caller's phrase that it began copying ("Al" -> "ma Ruiz" from "my name
        is Alma Ruiz."). The model writes a name without the space before it, so the n-gram
        drafter, which matches tokens, does not find it."""
        if not where.partial:
            return None
        value = _one(where.partial, self.values.get(where.key or "", []))
        if value is not None:
            return value[len(where.partial):]
        at = max((m.start() for m in re.finditer(r'\b' + re.escape(where.partial), where.before)), default=-1)
        if at < 0:
            return None
        tail = where.before[at + len(where.partial):]
        end = _PHRASE_END.search(tail)
        rest = tail[: end.start() if end else len(tail)].rstrip()
        return rest or None

    def _key(self, args: list[str]) -> str:
        """`"<argument>": "` (or without the quote for a number) for the first of `args`; "" if none."""
        return f'"{args[0]}": {self._opens.get(args[0], "")}' if args else ""

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        t0 = time.perf_counter()
        text = self.text(context) if k > 0 else None
        tokens = self.tokens_after(context, text)[:k] if text else []
        return Proposal(tokens, None, self.name, time.perf_counter() - t0)

    def tokens_after(self, context: list[int], text: str) -> list[int]:
        """`text` as tokens where it follows `context`: encoded together with the last few
        tokens, since BPE splits at the seam differently than alone (`{{` then `"` then
        `name`, where `"name": "` alone is `"name`); alone if the seam tokens change."""
        seam = context[-_SEAM:]
        ids = self.encode(self.decode(seam) + text)
        return ids[len(seam):] if ids[: len(seam)] == seam else self.encode(text)

    def accepted(self, n: int) -> None:
        pass
