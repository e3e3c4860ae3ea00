"""LLM backend for any OpenAI-compatible streaming server (vLLM, SGLang, llama.cpp, ...).

This is how the agent scales past one machine: the server runs its own speculative
decoding and we only stream its deltas. Each streamed chunk becomes one TokenGroup; the
server's passes are invisible here, so `drafted`/`accepted` are 0 and `token_ids` is
empty unless the server sends ids.

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
from typing import Any

import httpx

from llm.types import FinishReason, GenerationStats, SamplingParams, TokenGroup

__all__ = ["OpenAIBackendError", "OpenAIChatBackend"]

CancelEvent = asyncio.Event | threading.Event

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
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.extra_body = dict(extra_body or {})
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self.last_stats: GenerationStats | None = None  # of the latest stream()

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
            "messages": messages,
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
        started = time.monotonic()
        if cancel is not None and cancel.is_set():
            yield TokenGroup((), "", 0, 0, finish_reason="cancelled")
            return
        body = self.request_body(messages, params)
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
                            yield TokenGroup((), "", 0, 0, finish_reason="eos")
                            return
                        group = self._group(event, stats, started)
                        if group is not None:
                            if group.finish_reason is not None and self._wants_usage():
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

    def _group(self, data: str, stats: GenerationStats, started: float) -> TokenGroup | None:
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
        if not text and not token_ids and finish is None:
            return None  # role-only or empty delta
        now = time.monotonic()
        if text or token_ids:
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
