"""The OpenAI-compatible streaming backend against a real local HTTP server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from llm.openai_backend import OpenAIBackendError, OpenAIChatBackend
from llm.types import SamplingParams

TEXT = "Hello there. We open at 8 a.m.; how can I help you today? ü ✓"


def chunk(content=None, finish=None, role=None, **extra):
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
    return {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}


def pieces(text, size=4):
    return [text[i : i + size] for i in range(0, len(text), size)]


class FakeOpenAIServer:
    """A tiny HTTP/1.1 server speaking the OpenAI streaming protocol; the model name picks
    the behaviour. Records every request (headers and JSON body)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.disconnected = asyncio.Event()
        self.stalled = threading.Event()  # a "stall" response has sent all it ever will
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:] if l)}
            body = json.loads(await reader.readexactly(int(headers.get("content-length", 0))) or b"{}")
            self.requests.append({"method": method, "path": path, "headers": headers, "body": body})
            await self._respond(reader, writer, path, body)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _status(self, writer, code, reason, payload):
        data = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()

    async def _sse(self, writer, events, *, done=True, gap=0.0):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Connection: close\r\n\r\n")
        for event in events:
            if isinstance(event, str):
                writer.write(event.encode())  # raw SSE text (comments, event: lines)
            else:
                writer.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await writer.drain()
            if gap:
                await asyncio.sleep(gap)
        if done:
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()

    async def _respond(self, reader, writer, path, body):
        model = body.get("model")
        if path != "/v1/chat/completions":
            return await self._status(writer, 404, "Not Found", {"detail": f"no route {path}"})
        if model == "overloaded":
            return await self._status(writer, 503, "Service Unavailable",
                                      {"error": {"message": "model is overloaded, try later", "type": "server_error"}})
        if model == "missing":
            return await self._status(writer, 404, "Not Found",
                                      {"error": {"message": "The model `missing` does not exist."}})
        content = [chunk(role="assistant", content="")] + [chunk(p) for p in pieces(TEXT)]
        if model == "eos":
            await self._sse(writer, content + [chunk(finish="stop")], gap=0.001)
        elif model == "length":
            await self._sse(writer, content[:-1] + [chunk(pieces(TEXT)[-1], finish="length")])
        elif model == "stopstr":
            await self._sse(writer, content + [chunk(finish="stop", stop_reason="\n\n")])
        elif model == "ids":
            await self._sse(writer, [chunk(p, token_ids=[i, i + 1]) for i, p in enumerate(["ab", "cd"])]
                            + [chunk(finish="stop", stop_reason=None)])
        elif model == "chatty":  # comments, event names, multi-line data, usage-only chunk
            await self._sse(writer, [": keep-alive\n\n", "event: message\n", chunk("one "),
                                     'data: {"choices": [{"index": 0,\ndata: "delta": {"content": "two"}}]}\n\n',
                                     {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}},
                                     chunk(finish="stop")])
        elif model == "no_finish":
            await self._sse(writer, content)
        elif model == "truncated":
            await self._sse(writer, content, done=False)
        elif model == "midstream_error":
            await self._sse(writer, content[:3] + [{"error": {"message": "CUDA out of memory"}}], done=False)
        elif model == "stall":
            await self._sse(writer, content[:3], done=False)
            self.stalled.set()
            try:
                while await reader.read(4096):  # nothing more is sent; wait for the client to go
                    pass
            except (ConnectionError, OSError):
                pass
            finally:
                self.disconnected.set()
        else:
            await self._status(writer, 400, "Bad Request", {"error": {"message": f"unknown model {model}"}})


@pytest.fixture
async def server():
    async with FakeOpenAIServer() as srv:
        yield srv


async def run(backend, params=SamplingParams(), cancel=None):
    return [g async for g in backend.stream([{"role": "user", "content": "hi"}], params, cancel)]


async def test_groups_concatenate_to_text_and_request_fields(server):
    async with OpenAIChatBackend(server.base_url + "/", "eos", api_key="sk-test") as backend:
        params = SamplingParams(max_new_tokens=50, temperature=0.7, top_p=0.9, seed=3, stop=("\n\n",))
        groups = await run(backend, params)
    assert "".join(g.text for g in groups) == TEXT
    assert [g.finish_reason for g in groups[:-1]] == [None] * (len(groups) - 1)
    assert groups[-1].finish_reason == "eos"
    assert all(g.token_ids == () and g.drafted == 0 and g.accepted == 0 for g in groups)
    assert all(a.timestamp <= b.timestamp for a, b in zip(groups, groups[1:]))
    req = server.requests[0]
    assert req["method"] == "POST" and req["path"] == "/v1/chat/completions"
    assert req["headers"]["authorization"] == "Bearer sk-test"
    assert req["body"] == {"model": "eos", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                           "temperature": 0.7, "top_p": 0.9, "max_tokens": 50, "stop": ["\n\n"], "seed": 3}
    stats = backend.last_stats
    assert stats.passes == len(pieces(TEXT)) and stats.ttft_s is not None and stats.total_s >= stats.ttft_s


@pytest.mark.parametrize("model,reason", [("length", "length"), ("stopstr", "stop"), ("no_finish", "eos")])
async def test_finish_reasons(server, model, reason):
    async with OpenAIChatBackend(server.base_url, model) as backend:
        groups = await run(backend)
    assert "".join(g.text for g in groups) == TEXT
    assert groups[-1].finish_reason == reason
    assert sum(g.finish_reason is not None for g in groups) == 1
    assert "stop" not in server.requests[0]["body"] and "seed" not in server.requests[0]["body"]


async def test_token_ids_and_sse_details(server):
    async with OpenAIChatBackend(server.base_url, "ids") as backend:
        groups = await run(backend)
        assert [g.token_ids for g in groups] == [(0, 1), (1, 2), ()]
        assert groups[-1].finish_reason == "eos"
        chatty = await run(OpenAIChatBackend(server.base_url, "chatty"))
    assert "".join(g.text for g in chatty) == "one two"
    assert chatty[-1].finish_reason == "eos"


async def test_cancel_mid_stream_asyncio_event(server):
    cancel = asyncio.Event()
    async with OpenAIChatBackend(server.base_url, "stall") as backend:
        got = []
        t_cancel = None
        async for group in backend.stream([{"role": "user", "content": "hi"}], SamplingParams(), cancel):
            got.append(group)
            if len(got) == 2:  # the server now stalls: cancel must not wait for another chunk
                asyncio.get_running_loop().call_later(0.1, cancel.set)
                t_cancel = time.monotonic() + 0.1
    assert got[-1].finish_reason == "cancelled" and got[-1].text == ""
    # The server never sends another chunk (and the read timeout is 30 s): any bound tells
    # a cancel that works from one that waits for data; 5 s is not a latency check.
    assert time.monotonic() - t_cancel < 5
    assert "".join(g.text for g in got) == "".join(pieces(TEXT)[:2])
    await asyncio.wait_for(server.disconnected.wait(), 5)  # the HTTP stream was closed


async def test_cancel_threading_event_and_already_cancelled(server):
    cancel = threading.Event()

    def hang_up() -> None:  # another thread cancels once the server stalls mid-answer
        if server.stalled.wait(30):
            cancel.set()

    threading.Thread(target=hang_up, daemon=True).start()
    async with OpenAIChatBackend(server.base_url, "stall") as backend:
        t = time.monotonic()
        groups = await run(backend, cancel=cancel)
        assert groups[-1].finish_reason == "cancelled"
        # As above: the stall never ends, so 5 s only separates working from hanging.
        assert time.monotonic() - t < 5
        n_requests = len(server.requests)
        again = await run(backend, cancel=cancel)
        assert [(g.text, g.finish_reason) for g in again] == [("", "cancelled")]
        assert len(server.requests) == n_requests  # nothing sent when cancelled up front


async def test_consumer_stopping_early_closes_stream(server):
    async with OpenAIChatBackend(server.base_url, "stall") as backend:
        agen = backend.stream([{"role": "user", "content": "hi"}], SamplingParams())
        async for _ in agen:
            break
        await agen.aclose()
    await asyncio.wait_for(server.disconnected.wait(), 5)


@pytest.mark.parametrize("model,status,message", [
    ("overloaded", "503", "model is overloaded, try later"),
    ("missing", "404", "The model `missing` does not exist."),
])
async def test_http_errors_carry_server_message(server, model, status, message):
    async with OpenAIChatBackend(server.base_url, model) as backend:
        with pytest.raises(OpenAIBackendError) as info:
            await run(backend)
    text = str(info.value)
    assert f"HTTP {status}" in text and message in text and server.base_url in text


async def test_wrong_base_url_path(server):
    async with OpenAIChatBackend(f"http://127.0.0.1:{server.port}", "eos") as backend:
        with pytest.raises(OpenAIBackendError, match="HTTP 404: no route /chat/completions"):
            await run(backend)


async def test_broken_streams_raise(server):
    async with OpenAIChatBackend(server.base_url, "truncated") as backend:
        with pytest.raises(OpenAIBackendError, match="closed the stream before it finished"):
            await run(backend)
    async with OpenAIChatBackend(server.base_url, "midstream_error") as backend:
        with pytest.raises(OpenAIBackendError, match="CUDA out of memory"):
            await run(backend)


async def test_server_down_gives_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    async with OpenAIChatBackend(url, "m", timeout_s=30) as backend:
        t = time.monotonic()
        with pytest.raises(OpenAIBackendError) as info:
            await run(backend)
    # A refused connection fails at once, not after the 30 s timeout ("is running" below
    # is the refused-connection message, not the timeout's); 10 s separates the two.
    assert time.monotonic() - t < 10
    text = str(info.value)
    assert f"{url}/chat/completions" in text and "is running" in text and "base_url" in text


def test_llm_package_does_not_import_pipeline():
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parent.parent / "llm" / "openai_backend.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in ("pipeline", "voice", "demo")]
