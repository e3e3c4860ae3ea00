"""Tool calls in the target's own chat format (Qwen2.5 / Hermes style), kept out of the caller's ears.

The chat template renders the tools into the system prompt, and the model answers a call as

    <tool_call>
    {"name": "book_slot", "arguments": {"slot": "tue-0900", "name": "Ann"}}
    </tool_call>

possibly after some speakable text ("Let me check.") and possibly several blocks in a row.
`ToolCallFilter` is fed the stream's text deltas: it passes speakable text on at once and
holds back everything from `<tool_call>` on, including a partial `<tool_c` at the end of a
delta (the next delta may complete it). `finish()` releases a held partial prefix that never
became a tag, and parses what was held into `ToolCall`s or an error to feed back to the model.
Pure: no I/O, no model, no pipeline.

An answer that starts (after blanks) with "{", a code fence or "<tool" is held too, as a
bare call: Qwen2.5's template shows the format as `{{"name": ..., "arguments": ...}}`
(doubled braces, a quirk of the template), and Qwen2.5-Coder-1.5B was measured answering a
booking request with exactly that, and with the call in a ```json fence, and inside
<tools></tools>, depending on a newline in the system prompt. A spoken answer never starts
with any of these, so nothing speakable is lost, and JSON never reaches the caller's ears.

Given the tool names (`ToolCallFilter(tool_names=...)`), a call written as prose is held
too: a known name (any case, underscores as written) then `(`, `,`, `:` or blanks, then a
JSON object, e.g. `Take_message, {"name": "Ann", "text": "call me back"}`,
`take_message({"name": ...})`, `I'll book it: book_slot {"slot": ...}`: Qwen2.5-Coder-1.5B
was measured writing all three in calls with tools on, and TTS read the function name and
the JSON to the caller. The text before the name is spoken at once; at the end of a delta
only a suffix that could still become `<name><sep>{` waits (the longest name, `_SEPS`
separators and the brace at most), so a word like "book" waits for the next delta, nothing
more. The JSON is either the arguments themselves or `{"name": ..., "arguments": {...}}`.
A `{"name":` object after speakable text is held as well, with or without tool names: that
is never speech.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

__all__ = ["CLOSE", "OPEN", "ToolCall", "ToolCallFilter", "ToolCallParse", "parse_tool_calls"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
# A block runs to its closing tag, or to the end of the text: a model that stops (EOS)
# without the closing tag still meant the call.
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)
_SHOWN = 200  # characters of a bad block quoted back in the error
BARE_STARTS = ("{", "```", "<tool")  # how an answer that is a call without its tags begins
_WRAP_OPEN = re.compile(r"\A(?:```[A-Za-z]*|<[A-Za-z_]+>)\s*")
_WRAP_CLOSE = re.compile(r"\s*(?:```|</[A-Za-z_]+>)\s*\Z")
# A call object after speech: `{"name":` (the template's doubled braces included).
_NAME_OBJECT = re.compile(r'\{+\s*"name"\s*:')
_NAME_OBJECT_PART = re.compile(r'\{+\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?\Z')
# Between a prose call's name and its "{": bounded, so that what waits for the "{" is too
# (the longest name, these, the brace).
_SEPS = 8
_SEP = rf"[\s(,:]{{0,{_SEPS}}}"
_PROSE_HEAD = re.compile(r"([A-Za-z_][\w]*)[\s(,:]*(?=\{)")


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: the name, and the arguments as JSON text (raw: the
    tool box validates them, so a wrong type is its error, not the parser's)."""

    name: str
    arguments: str
    # The server's id for a call it parsed itself (OpenAI `tool_calls`); None for a call
    # parsed from text here (the turn numbers those).
    id: str | None = None

    def message(self) -> dict:
        """The OpenAI-shaped `tool_calls` entry (arguments as a JSON string)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallParse:
    """What the held-back text held: calls, or an error (then `calls` is empty). `raw` is
    the held text itself (from the first `<tool_call>`), empty when the model called nothing."""

    calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    raw: str = ""

    @property
    def found(self) -> bool:
        """The model tried to call a tool (well or badly)."""
        return bool(self.raw)


def _prose_patterns(names: frozenset[str]) -> tuple[re.Pattern, re.Pattern] | None:
    """(a whole prose call's start `<name><sep>{`, a name and separators still waiting for
    the `{`), case-insensitive, the name starting a word; None without names."""
    if not names:
        return None
    alt = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return (re.compile(rf"(?<!\w)(?:{alt}){_SEP}\{{", re.IGNORECASE),
            re.compile(rf"(?:{alt}){_SEP}\Z", re.IGNORECASE))


@dataclass
class ToolCallFilter:
    """Streaming split of a model's text into what may be spoken and what must not."""

    tool_names: frozenset[str] = frozenset()  # the tools the model was given: their prose calls are held
    pending: str = ""  # the end of the text so far that may be the start of a call
    held: list[str] = field(default_factory=list)  # everything from the call's start on
    holding: bool = False
    spoke: bool = False  # something other than blanks was let through
    last: str = ""  # the last character let through: a name must start a word

    def __post_init__(self) -> None:
        self.tool_names = frozenset(self.tool_names)
        self._lower = tuple(n.lower() for n in self.tool_names)
        self._prose = _prose_patterns(self.tool_names)
        self._window = max([len(OPEN) - 1, *(len(n) + _SEPS + 1 for n in self.tool_names)])

    def feed(self, delta: str) -> str:
        """The speakable part of `delta` (possibly empty): everything before a tool call."""
        if self.holding:
            self.held.append(delta)
            return ""
        text = self.pending + delta
        if not self.spoke:
            lead = text.lstrip()
            if lead.startswith(BARE_STARTS):
                return self._hold(text, len(text) - len(lead))
            if lead and any(m.startswith(lead) for m in BARE_STARTS):
                self.pending = text  # "`" or "<to": may still become one
                return ""
        at = self._call_start(text)
        if at >= 0:
            return self._hold(text, at)
        keep = self._undecided(text)
        self.pending = text[len(text) - keep:] if keep else ""
        out = text[: len(text) - keep]
        self.spoke = self.spoke or bool(out.strip())
        self.last = out[-1:] or self.last
        return out

    def _call_start(self, text: str) -> int:
        """Where the first whole call start in `text` is (-1: none)."""
        starts = [text.find(OPEN)]
        if m := _NAME_OBJECT.search(text):
            starts.append(m.start())
        if self._prose is not None and (m := self._prose[0].search(self.last + text, len(self.last))):
            starts.append(m.start() - len(self.last))
        starts = [a for a in starts if a >= 0]
        return min(starts) if starts else -1

    def _undecided(self, text: str) -> int:
        """Length of the longest suffix of `text` (within the window) that may still become
        a call's start: it waits for the next delta."""
        for p in range(max(0, len(text) - self._window), len(text)):
            tail = text[p:]
            if OPEN.startswith(tail) or _NAME_OBJECT_PART.match(tail):
                return len(tail)
            if self._prose is None or re.match(r"\w", text[p - 1] if p else self.last):
                continue  # mid-word ("Facebook"): not the start of a name
            low = tail.lower()
            if any(n.startswith(low) for n in self._lower) or self._prose[1].match(tail):
                return len(tail)
        return 0

    def _hold(self, text: str, at: int) -> str:
        self.holding, self.pending = True, ""
        self.held.append(text[at:])
        return text[:at]

    def finish(self) -> tuple[str, ToolCallParse]:
        """(speakable text still pending, what the held text parses to). A partial prefix
        the stream ended on was never a tag: it is speakable."""
        if not self.holding:
            tail, self.pending = self.pending, ""
            return tail, ToolCallParse()
        return "", parse_tool_calls("".join(self.held), self.tool_names)


def parse_tool_calls(text: str, tool_names: frozenset[str] | set[str] = frozenset()) -> ToolCallParse:
    """Parse every `<tool_call>` block of `text` (which starts at the first one), or a bare
    call (text starting with "{"), or a prose call (text starting with one of `tool_names`,
    then a JSON object). One bad block makes the whole parse an error: running half of
    what the model meant is worse than asking it again."""
    lead = text.lstrip()
    if lead.startswith(BARE_STARTS) and not lead.startswith(OPEN):
        return _parse_bare(lead)
    head = _PROSE_HEAD.match(lead)
    known = {n.lower(): n for n in tool_names}
    if head and head.group(1).lower() in known:
        return _parse_prose(lead, known[head.group(1).lower()], lead[head.end():], known)
    start = text.find(OPEN)
    if start < 0:
        return ToolCallParse()
    raw = text[start:]
    calls = []
    for n, match in enumerate(_BLOCK.finditer(raw), 1):
        call, error = _parse_block(match.group(1).strip())
        if error is not None:
            shown = match.group(1).strip()[:_SHOWN]
            return ToolCallParse((), f"tool call {n}: {error}; the call was: {shown}", raw)
        calls.append(call)
    return ToolCallParse(tuple(calls), None, raw)


def _parse_bare(raw: str) -> ToolCallParse:
    # The template's doubled braces, copied (and miscounted: the 1.5B closed one too many):
    # the call is the first JSON object from the last of the leading braces; what follows
    # it may only be closing braces.
    body = _WRAP_CLOSE.sub("", _WRAP_OPEN.sub("", raw.strip()))  # ```json ... ```, <tools> ... </tools>
    body = "{" + body.lstrip("{").lstrip()
    try:
        _, end = json.JSONDecoder().raw_decode(body)
        if not body[end:].strip().strip("}"):
            body = body[:end]
    except json.JSONDecodeError:
        pass  # _parse_block reports it
    call, error = _parse_block(body)
    if error is not None:
        return ToolCallParse((), f"tool call 1: {error}; write calls as {OPEN}{{\"name\": ..., \"arguments\": "
                                 f"{{...}}}}{CLOSE}; the call was: {body[:_SHOWN]}", raw)
    return ToolCallParse((call,), None, raw)


def _parse_prose(raw: str, name: str, body: str, known: dict[str, str]) -> ToolCallParse:
    # `name, {...}` / `name({...})` / `name: {...}`: the JSON is the arguments themselves, or
    # a whole call {"name": ..., "arguments": {...}}. What follows the object (a ")", more
    # words) is dropped: the round after the tool's result is what the caller hears.
    body = "{" + body.lstrip("{").lstrip() if body.startswith("{{") else body  # the doubled braces
    try:
        obj, _ = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as exc:
        error = f"not valid JSON ({exc.msg} at character {exc.pos})"
    else:
        if not isinstance(obj, dict):
            error = f"expected a JSON object, got {type(obj).__name__}"
        elif ("arguments" in obj and set(obj) <= {"name", "arguments"}) or (
                set(obj) == {"name"} and isinstance(obj["name"], str) and obj["name"].lower() == name.lower()):
            # A whole call; take_message's own "name" argument (the caller's) is not one.
            inner = obj.get("name", name)
            if isinstance(inner, str):
                obj = {**obj, "name": known.get(inner.lower(), inner)}
            call, error = _parse_block(json.dumps(obj, ensure_ascii=False))
            if error is None:
                return ToolCallParse((call,), None, raw)
        else:
            return ToolCallParse((ToolCall(name, json.dumps(obj, ensure_ascii=False)),), None, raw)
    return ToolCallParse((), f"tool call 1: {error}; write calls as {OPEN}{{\"name\": ..., \"arguments\": "
                             f"{{...}}}}{CLOSE}; the call was: {raw[:_SHOWN]}", raw)


def _parse_block(body: str) -> tuple[ToolCall | None, str | None]:
    if not body:
        return None, 'empty; write {"name": ..., "arguments": {...}} between the tags'
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, 'no "name" (a string) in the call'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        # Some models double-encode the arguments; pass the text on and let the tool box judge.
        return ToolCall(name, arguments), None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None, f'"arguments" must be a JSON object, got {type(arguments).__name__}'
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False)), None
