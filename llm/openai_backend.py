"""LLM backend for any OpenAI-compatible streaming server (vLLM, SGLang, llama.cpp, ...).

This is how the agent scales past one machine: the server runs its own speculative
decoding and we only stream its deltas. Each streamed chunk becomes one TokenGroup; the
server's passes are invisible here, so `drafted`/`accepted` are 0 and `token_ids` is
empty unless the server sends ids.

Tools: `OpenAIChatBackend(..., tools=TOOL_SCHEMAS)` sends OpenAI's `tools` with every
request. A server that parses the model's call (llama.cpp with its jinja templates, vLLM
with a tool parser) streams it as `delta.tool_calls` pieces, keyed by `index`; they are
put together here and, once the answer finishes, left in `last_tool_parse` (a
`ToolCallParse`, as the text filter of llm/tool_calls.py gives) for the turn's tool loop
(pipeline/stages/tools_step.py). A server that writes the call into the content instead
is handled by that text filter, as for the in-process engine. Arguments that are not a
JSON object make the parse an error, the same path as a bad `<tool_call>` block: an
assistant message whose arguments a server cannot parse would fail the next request.

Constraints (`SamplingParams.constraint`, llm/constrain.py) go to the server as its
dialect says (`dialect=`):
    "openai"     a JSON schema as `response_format` {"type": "json_schema", strict}; a regex
                 or a grammar has no place in OpenAI's API and is refused before sending
    "llama.cpp"  a JSON schema as `response_format`; a regex or a Lark grammar as
                 `grammar` with llama.cpp's `%llguidance` header (its llguidance build:
                 the same grammar language the in-process engine reads)
    "vllm"       `structured_outputs` {"json" | "regex" | "grammar"} (vLLM, SGLang-style)
The server's whole answer is then checked against the constraint (llguidance over its
bytes): a server that ignored it (lmdeploy did, silently, until 2026) is an error that
says so, not a wrong answer passed on.

Cancellation (barge-in) is checked while waiting for every chunk, not only between them,
so a server stalled in prefill does not delay it: the HTTP stream is closed and a final
group with finish_reason "cancelled" is yielded.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from llm.tool_calls import CLOSE, OPEN, ToolCall, ToolCallParse
from llm.types import Constraint, FinishReason, GenerationStats, SamplingParams, TokenGroup

__all__ = ["OpenAIBackendError", "OpenAIChatBackend", "streamed_tool_parse", "wire_messages"]

CancelEvent = asyncio.Event | threading.Event

DIALECTS = ("openai", "llama.cpp", "vllm")

_POLL_S = 0.02  # how often a threading.Event cancel is checked while a chunk is awaited


class OpenAIBackendError(RuntimeError):
    """The server could not be reached, refused the request or broke the stream."""


class OpenAIChatBackend:
    """`stream(messages, params, cancel)` over `POST {base_url}/chat/completions`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        *,
        extra_body: dict[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        tools: list[dict] | None = None,
        dialect: str = "openai",
    ) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"unknown server dialect {dialect!r}; choose one of {', '.join(DIALECTS)}")
        self.dialect = dialect
        self.base_url = base_url.rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.extra_body = dict(extra_body or {})
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self.last_stats: GenerationStats | None = None  # of the latest stream()
        # OpenAI "tools" entries sent with every request (pipeline.receptionist.tools.TOOL_SCHEMAS).
        self.tools = list(tools) if tools else None
        # The latest stream()'s tool calls from `delta.tool_calls`, once it finished; None
        # when the server sent none (or the stream was cancelled before the end).
        self.last_tool_parse: ToolCallParse | None = None
        # A reply's start is not sent as a prefill (servers differ: vLLM's continue_final_message,
        # llama.cpp's trailing assistant message); a turn plan forces it with a grammar instead.
        self.prefills = False

    def _http(self) -> httpx.AsyncClient:
        if self._client is None or self._client.is_closed:
            headers = {"Accept": "text/event-stream"}
            if self.api_key:
                headers["Authorization"] = f"Bearer {self.api_key}"
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 10.0)),
                headers=headers,
                transport=self._transport,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> "OpenAIChatBackend":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def request_body(self, messages: list[dict[str, Any]], params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": wire_messages(messages),
            "stream": True,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_new_tokens,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed
        if params.top_k > 0:  # not in OpenAI's API; vLLM and SGLang accept it
            body["top_k"] = params.top_k
        if self.tools:
            body["tools"] = self.tools
        if params.constraint is not None:
            body.update(constraint_fields(params.constraint, self.dialect))
        body.update(self.extra_body)
        return body

    async def stream(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams,
        cancel: CancelEvent | None = None,
    ) -> AsyncIterator[TokenGroup]:
        stats = GenerationStats()
        self.last_stats = stats
        self.last_tool_parse = None
        calls: dict[int, _CallPieces] = {}  # the streamed tool calls, by index
        started = time.monotonic()
        if cancel is not None and cancel.is_set():
            yield TokenGroup((), "", 0, 0, finish_reason="cancelled")
            return
        body = self.request_body(messages, params)  # a constraint the dialect cannot carry fails here
        written: list[str] = []  # the answer's text, checked against a constraint at the end
        try:
            async with self._http().stream("POST", self.url, json=body) as response:
                if response.status_code >= 400:
                    raise OpenAIBackendError(await self._http_error(response))
                events = _sse_events(response.aiter_lines())
                try:
                    while True:
                        event = await _next_or_cancel(events, cancel)
                        if event is _CANCELLED:
                            stats.total_s = time.monotonic() - started
                            yield TokenGroup((), "", 0, 0, finish_reason="cancelled")
                            return
                        if event is _END:
                            raise OpenAIBackendError(
                                f"the LLM server at {self.url} closed the stream before it finished"
                            )
                        if event == "[DONE]":
                            # A server that ends without a finish_reason: the model stopped.
                            stats.total_s = time.monotonic() - started
                            self.last_tool_parse = streamed_tool_parse(calls)
                            yield TokenGroup((), "", 0, 0, finish_reason="eos")
                            return
                        group = self._group(event, stats, started, calls)
                        if group is not None:
                            written.append(group.text)
                            if group.finish_reason in ("eos", "stop", "length") and params.constraint is not None:
                                # Cut by its length, the text must still begin a matching one.
                                self._check_constraint(params.constraint, "".join(written), group.finish_reason != "length")
                            if group.finish_reason is not None:
                                # Before the final group: the turn reads it once the stream ends.
                                self.last_tool_parse = streamed_tool_parse(calls)
                                if self._wants_usage():
                                    # The usage chunk comes after the finish chunk (OpenAI, vLLM,
                                    # SGLang, llama.cpp): read it so last_stats has the counts.
                                    await self._read_usage(events, cancel, stats, started)
                            yield group
                            if group.finish_reason is not None:
                                return
                finally:
                    await events.aclose()
        except httpx.ConnectError as exc:
            raise OpenAIBackendError(
                f"cannot connect to the LLM server at {self.url} ({exc}). Check that an "
                "OpenAI-compatible server (vLLM, SGLang, llama.cpp server, ...) is running there "
                "and that llm.openai.base_url is right (it usually ends in /v1)."
            ) from exc
        except httpx.TimeoutException as exc:
            raise OpenAIBackendError(
                f"the LLM server at {self.url} did not answer within {self.timeout_s:g} s "
                f"({type(exc).__name__}); raise llm.openai.timeout_s or check the server's load"
            ) from exc
        except httpx.HTTPError as exc:
            raise OpenAIBackendError(f"HTTP error talking to the LLM server at {self.url}: {exc}") from exc

    def _check_constraint(self, constraint: Constraint, text: str, complete: bool) -> None:
        from llm.constrain import check_text

        problem = check_text(constraint, text, complete)
        if problem is not None:
            raise OpenAIBackendError(
                f"the LLM server at {self.url} did not keep to the {constraint.kind} constraint ({problem}); "
                f"it may ignore the fields of dialect {self.dialect!r}: set llm.openai.dialect to the server's "
                f"({', '.join(DIALECTS)})"
            )

    def _wants_usage(self) -> bool:
        options = self.extra_body.get("stream_options")
        return isinstance(options, dict) and bool(options.get("include_usage"))

    async def _read_usage(self, events: AsyncIterator[str], cancel: CancelEvent | None,
                          stats: GenerationStats, started: float) -> None:
        """After the finish chunk: read on to [DONE] for the usage chunk. The answer is
        complete, so a cancel, a broken stream or a bad chunk here only ends the wait."""
        total_s = stats.total_s
        try:
            while True:
                event = await _next_or_cancel(events, cancel)
                if event is _CANCELLED or event is _END or event == "[DONE]":
                    break
                self._group(event, stats, started)
        except (httpx.HTTPError, OpenAIBackendError):
            pass
        stats.total_s = total_s  # the answer's time, not the trailer's

    def _group(self, data: str, stats: GenerationStats, started: float,
               calls: dict[int, _CallPieces] | None = None) -> TokenGroup | None:
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as exc:
            raise OpenAIBackendError(f"the LLM server at {self.url} sent invalid JSON: {data[:200]!r}") from exc
        if not isinstance(chunk, dict):
            raise OpenAIBackendError(f"the LLM server at {self.url} sent an unexpected event: {data[:200]!r}")
        if "error" in chunk:
            raise OpenAIBackendError(f"the LLM server at {self.url} reported an error: {_error_text(chunk)}")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            stats.prompt_tokens = int(usage.get("prompt_tokens") or stats.prompt_tokens)
            stats.new_tokens = int(usage.get("completion_tokens") or stats.new_tokens)
        choices = chunk.get("choices") or []
        if not choices:
            return None  # e.g. a usage-only chunk
        choice = choices[0]
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        ids = choice.get("token_ids") or delta.get("token_ids") or ()
        token_ids = tuple(int(i) for i in ids) if isinstance(ids, list) else ()
        finish = _finish_reason(choice)
        called = calls is not None and _add_call_deltas(calls, delta.get("tool_calls"))
        if not text and not token_ids and not called and finish is None:
            return None  # role-only or empty delta
        now = time.monotonic()
        # A piece of a tool call is generated text too (unheard): it counts as the engine's
        # tool-call tokens do, and the turn sees the model at work (an empty group).
        if text or token_ids or called:
            stats.passes += 1
            if stats.ttft_s is None:
                stats.ttft_s = now - started
            if not isinstance(usage, dict):
                stats.new_tokens += len(token_ids) or 1  # without usage: one chunk ~ one token
        stats.total_s = now - started
        return TokenGroup(token_ids, text, 0, 0, timestamp=now, finish_reason=finish)

    async def _http_error(self, response: httpx.Response) -> str:
        try:
            raw = (await response.aread()).decode("utf-8", "replace")
        except httpx.HTTPError:
            raw = ""
        try:
            message = _error_text(json.loads(raw))
        except (json.JSONDecodeError, TypeError, AttributeError):
            message = raw.strip()[:500] or response.reason_phrase
        return f"the LLM server at {self.url} answered HTTP {response.status_code}: {message}"


def constraint_fields(c: Constraint, dialect: str) -> dict[str, Any]:
    """The request fields that carry constraint `c` to a server of `dialect` (module doc)."""
    from llm.constrain import ConstraintError, validate

    validate(c, compact=False)  # a constraint that does not compile is refused here, not by the server
    if c.kind == "json_schema":
        schema = json.loads(c.text)
        if dialect == "vllm":
            return {"structured_outputs": {"json": schema}}
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "answer", "schema": schema, "strict": True}}}
    if dialect == "vllm":
        return {"structured_outputs": {c.kind: c.text}}
    if dialect == "llama.cpp":
        if c.kind == "regex":
            import llguidance

            return {"grammar": "%llguidance {}\nstart: /" + llguidance.regex_to_lark(c.text, "") + "/\n"}
        return {"grammar": "%llguidance {}\n" + c.text}
    raise ConstraintError(
        f"OpenAI's API carries JSON schemas only, not a {c.kind}: send a JSON schema, or set "
        "llm.openai.dialect to \"llama.cpp\" or \"vllm\" for a server that takes grammars"
    )


def _error_text(payload: Any) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}} and variants)."""
    err = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)
    if isinstance(payload, dict) and "detail" in payload:
        return str(payload["detail"])
    return str(err)


def _finish_reason(choice: dict[str, Any]) -> FinishReason | None:
    reason = choice.get("finish_reason")
    if reason is None:
        return None
    if reason == "length":
        return "length"
    if reason == "stop":
        # vLLM/SGLang name the stop string (or stop token id) that ended the turn; plain
        # OpenAI does not, and then an end-of-sequence is the best reading.
        return "stop" if isinstance(choice.get("stop_reason") or choice.get("matched_stop"), str) else "eos"
    if reason in ("abort", "cancelled"):
        return "cancelled"
    if reason == "error":
        return "error"
    return "stop"  # tool_calls, content_filter, ...: the server ended the answer


@dataclass
class _CallPieces:
    """One streamed tool call being put together (OpenAI sends the name, then the
    arguments in pieces; `id` comes with the first piece)."""

    id: str = ""
    name: str = ""
    arguments: str = ""

    def as_text(self) -> str:
        """The call as the Hermes/Qwen format writes it (what the model wrote before the
        server parsed it): quoted back to the model when the call cannot be run."""
        args = self.arguments.strip() or "{}"
        return f"{OPEN}\n{{\"name\": {json.dumps(self.name, ensure_ascii=False)}, \"arguments\": {args}}}\n{CLOSE}"


def _add_call_deltas(calls: dict[int, _CallPieces], deltas: Any) -> bool:
    """Add one chunk's `delta.tool_calls` to `calls`; True when it held any."""
    if not isinstance(deltas, list) or not deltas:
        return False
    for position, d in enumerate(deltas):
        if not isinstance(d, dict):
            continue
        index = d.get("index")
        piece = calls.setdefault(index if isinstance(index, int) else position, _CallPieces())
        if isinstance(d.get("id"), str) and d["id"] and not piece.id:
            piece.id = d["id"]  # some servers repeat it on every piece
        fn = d.get("function") or {}
        if isinstance(fn.get("name"), str):
            piece.name += fn["name"]
        args = fn.get("arguments")
        if isinstance(args, str):
            piece.arguments += args
        elif isinstance(args, dict):  # a server that sends the object whole
            piece.arguments = json.dumps(args, ensure_ascii=False)
    return True


def streamed_tool_parse(calls: dict[int, _CallPieces]) -> ToolCallParse | None:
    """The finished stream's tool calls, in index order, as the turn's tool loop takes them
    (llm.tool_calls.ToolCallParse): the calls with the server's ids, or one error naming
    what is wrong (no name; arguments not a JSON object). None when there were none."""
    if not calls:
        return None
    ordered = [calls[i] for i in sorted(calls)]
    raw = "\n".join(p.as_text() for p in ordered)
    out = []
    for n, p in enumerate(ordered, 1):
        problem = _call_problem(p)
        if problem is not None:
            return ToolCallParse((), f"tool call {n}: {problem}; the call was: {p.as_text()[:200]}", raw)
        out.append(ToolCall(p.name, p.arguments.strip() or "{}", id=p.id or None))
    return ToolCallParse(tuple(out), None, raw)


def _call_problem(p: _CallPieces) -> str | None:
    if not p.name.strip():
        return 'no "name" in the call'
    if not p.arguments.strip():
        return None  # no arguments: {}
    try:
        value = json.loads(p.arguments)
    except json.JSONDecodeError as exc:
        return f"the arguments are not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(value, dict):
        return f'"arguments" must be a JSON object, got {type(value).__name__}'
    return None


def wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as an OpenAI server takes it. The tool loop already appends
    OpenAI-shaped messages; this makes sure of what a server parses: every `tool_calls`
    entry has an id, the type, and its arguments as a string of JSON (a mapping is
    encoded; text that is not JSON, e.g. a model's double-encoded arguments, is sent as a
    JSON string, since llama.cpp parses the arguments of a past call and fails the request
    on bad JSON). Our `as_written` key is dropped. Other messages pass as they are."""
    out = []
    for m in messages:
        if "as_written" in m:  # ours, for the in-process engine's prompt (llm.engine.template_messages)
            m = {k: v for k, v in m.items() if k != "as_written"}
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if calls:
            m = {**m, "tool_calls": [_wire_call(c, k) for k, c in enumerate(calls)]}
        out.append(m)
    return out


def _wire_call(call: dict[str, Any], k: int) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if args is None:
        args = "{}"
    elif not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    else:
        try:
            json.loads(args)
        except json.JSONDecodeError:
            args = json.dumps(args, ensure_ascii=False)
    fn["arguments"] = args
    return {**call, "id": call.get("id") or f"call_{k}", "type": call.get("type") or "function", "function": fn}


_CANCELLED = object()
_END = object()


async def _sse_events(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data of each server-sent event (multi-line data joined with newlines)."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
        # event:, id:, retry: carry nothing we need
    if data:
        yield "\n".join(data)


async def _next_or_cancel(events: AsyncIterator[str], cancel: CancelEvent | None) -> Any:
    """The next event, `_END` at the end of the stream, or `_CANCELLED` once cancel is set."""
    if cancel is not None and cancel.is_set():
        return _CANCELLED
    if cancel is None:
        try:
            return await anext(events)
        except StopAsyncIteration:
            return _END
    read = asyncio.ensure_future(anext(events))
    watch = asyncio.ensure_future(_wait_set(cancel))
    try:
        await asyncio.wait({read, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not read.done():
            read.cancel()
            # Let the read unwind before the caller closes the generator it was running.
            await asyncio.wait({read}, timeout=1.0)
    if cancel.is_set():
        if read.done() and not read.cancelled():
            read.exception()  # the stream is abandoned either way; mark it retrieved
        return _CANCELLED
    try:
        return read.result()
    except StopAsyncIteration:
        return _END


async def _wait_set(cancel: CancelEvent) -> None:
    if isinstance(cancel, asyncio.Event):
        await cancel.wait()
        return
    while not cancel.is_set():  # a threading.Event cannot be awaited; poll it cheaply
        await asyncio.sleep(_POLL_S)
