"""Helpers for the reliability tests: the real bridge, the real telephony adapter and the
real pipeline Call, with cheap stand-ins for the models (an energy VAD, a scripted STT,
a tone TTS, a scripted LLM backend) so that faults can be placed exactly and every test
runs in seconds. Also a raw Twilio-speaking client that can misbehave on purpose, and a
check that a call left nothing running behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from pipeline.transports.telephony.auth import BridgeTokens
from pipeline.transports.web.server import Bridge
from pipeline.transports.telephony.protocol import Clear, Media, OutboundMark, OutboundMedia, Start, Stop, encode_event, parse_outbound
from llm.types import TokenGroup
from pipeline.config import load_config
from voice import mulaw
from voice.endpointer import EndpointConfig, Endpointer
from voice.tts import AudioChunk

TOKEN = "reliability-" + secrets.token_hex(8)


# ---------------------------------------------------------------- model stand-ins


class _Work:
    """How many STT / TTS stand-in calls are running right now, in any thread: a call that
    ended must leave none behind (checked by `assert_released`)."""

    def __init__(self) -> None:
        self.active = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(self):
        with self._lock:
            self.active += 1
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1


VOICE_WORK = _Work()


class EnergyVAD:
    """P(speech) from loudness: a tone is speech, digital silence is not."""

    chunk_samples = 512

    def __call__(self, chunk: np.ndarray) -> float:
        return 0.95 if float(np.sqrt(np.mean(np.square(chunk)))) > 0.02 else 0.0

    def reset(self) -> None:
        pass


class ScriptedSTT:
    """Returns `text` (or the result of calling it with the audio); may raise or block."""

    def __init__(self, text: str | Callable[[np.ndarray], str] = "What are your hours?", *,
                 delay_s: float = 0.0, error: Exception | None = None):
        self.text, self.delay_s, self.error = text, delay_s, error
        self.calls = 0

    def transcribe(self, audio: np.ndarray, sample_rate: int = 16000) -> str:
        with VOICE_WORK.running():
            self.calls += 1
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.error is not None:
                raise self.error
            return self.text(audio) if callable(self.text) else self.text


class ToneTTS:
    """`chunk_s` of a 440 Hz tone per chunk, `chunks` per sentence, `delay_s` of work per chunk."""

    def __init__(self, chunks: int = 3, chunk_s: float = 0.1, delay_s: float = 0.0):
        self.chunks, self.chunk_s, self.delay_s = chunks, chunk_s, delay_s
        self.active = 0
        self.started = threading.Event()
        self._lock = threading.Lock()

    def synthesize(self, text: str):
        with self._lock:
            self.active += 1
        self.started.set()
        try:
            with VOICE_WORK.running():
                n = int(16000 * self.chunk_s)
                tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / 16000)).astype(np.float32)
                for _ in range(self.chunks):
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    yield AudioChunk(tone, 16000)
        finally:
            with self._lock:
                self.active -= 1


class ConversationState:
    """What a backend holds for its call (a KV cache in the real one)."""


class ScriptedBackend:
    """An LLM backend: `groups` text deltas, `delay_s` apart; optionally raises after
    `fail_after` groups; the last group's finish reason is `finish` ("length": the token
    limit ended it). Records whether each stream was closed (cancelled or done)."""

    def __init__(self, groups: list[str] | None = None, *, delay_s: float = 0.0, fail_after: int | None = None,
                 reply: Callable[[list[dict]], list[str]] | None = None, finish: str = "eos"):
        self.groups = groups if groups is not None else ["Hello. ", "We are open ", "nine to five."]
        self.delay_s, self.fail_after, self.reply, self.finish = delay_s, fail_after, reply, finish
        self.started = asyncio.Event()
        self.opened = 0
        self.closed = 0
        self.last_stats = None  # a script has no passes to count
        self.tools = None  # no tool schemas in its prompts
        self.last_tool_parse = None  # calls, if any, are written as text
        self.prefills = False  # a plan's answer line comes as a grammar (the script writes it)
        self.state: ConversationState | None = ConversationState()  # stands for a conversation's KV cache

    async def aclose(self) -> None:
        self.state = None  # as SpeculativeBackend drops its conversation

    async def stream(self, messages, params, cancel=None):
        self.opened += 1
        self.started.set()
        try:
            groups = self.reply(messages) if self.reply is not None else self.groups
            for i, text in enumerate(groups):
                if self.fail_after is not None and i >= self.fail_after:
                    raise RuntimeError("model exploded")
                if cancel is not None and cancel.is_set():
                    yield TokenGroup((0,), "", 0, 0, finish_reason="cancelled")
                    return
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield TokenGroup((i,), text, 0, 0, finish_reason=self.finish if i == len(groups) - 1 else None)
        finally:
            self.closed += 1


class WrappedBackend:
    """A test's LLM backend around another (`inner`): what it does not override (the stats,
    the tools, closing) is the inner backend's."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def tools(self):
        return self.inner.tools

    @property
    def last_tool_parse(self):
        return self.inner.last_tool_parse

    @property
    def prefills(self):
        return self.inner.prefills

    @property
    def last_stats(self):
        return self.inner.last_stats

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class FakeModels:
    """Duck-typed pipeline.agent.AgentModels."""

    stt: Any = field(default_factory=ScriptedSTT)
    tts: Any = field(default_factory=ToneTTS)
    backend: Callable[[], Any] = field(default_factory=lambda: ScriptedBackend)
    backends: list = field(default_factory=list)
    state_refs: list = field(default_factory=list)  # weak references to each backend's state

    def new_backend(self, config=None):
        b = self.backend()
        self.backends.append(b)
        if getattr(b, "state", None) is not None:
            self.state_refs.append(weakref.ref(b.state))
        return b

    def new_endpointer(self) -> Endpointer:
        return Endpointer(EnergyVAD(), EndpointConfig(min_speech_ms=64, min_silence_ms=200, pre_roll_ms=64,
                                                      post_roll_ms=32))

    def new_turn_taker(self, executor=None):
        from pipeline.agent import turn_taker

        return turn_taker(load_config("test"), None, executor)

    def new_toolbox(self, call_id: str, caller: str | None = None):
        return None  # no tools, as AgentModels with [tools] off

    @staticmethod
    def count_tokens(messages: list[dict]) -> int:
        return sum(len(m.get("content", "")) // 4 + 4 for m in messages)


def rel_config(tmp_path: Path, **bridge: Any):
    cfg = load_config("test")
    settings = dict(host="127.0.0.1", port=0, max_calls=4, idle_timeout_s=5.0, handshake_timeout_s=2.0,
                    end_grace_s=3.0)
    settings.update(bridge)
    return cfg.model_copy(update={
        "report": cfg.report.model_copy(update={"dir": str(tmp_path / "reports")}),
        "bridge": cfg.bridge.model_copy(update=settings),
    })


@contextlib.asynccontextmanager
async def agent_bridge(cfg, models: Any, *, greeting: bool | str = False, tokens: BridgeTokens | None = None,
                       **bridge_kw: Any):
    """The real bridge + make_call_handler(cfg, models); yields (bridge, port, handler)."""
    from pipeline.transports.telephony.adapter import make_call_handler

    handler = make_call_handler(cfg, models, report_dir=cfg.report.dir, greeting=greeting, preload=False)
    bridge = Bridge(cfg.bridge, handler, tokens or BridgeTokens.of(bearer_token=TOKEN), **bridge_kw)
    port = await bridge.start()
    try:
        yield bridge, port, handler
    finally:
        await asyncio.wait_for(bridge.stop(), 20)


def url(port: int) -> str:
    return f"ws://127.0.0.1:{port}/media-stream"


def auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


# ---------------------------------------------------------------- audio


def tone_mulaw(seconds: float, amplitude: float = 0.3) -> bytes:
    n = int(8000 * seconds)
    pcm = amplitude * np.sin(2 * np.pi * 300 * np.arange(n) / 8000)
    return mulaw.encode_bytes((pcm * 32767).astype(np.int16))


def silence_mulaw(seconds: float) -> bytes:
    return bytes([0xFF]) * int(8000 * seconds)


# ---------------------------------------------------------------- a Twilio-speaking client


class RawCaller:
    """A call on the wire, step by step: `await c.open()`, `await c.say(0.4)`, `await c.abort()`...

    A background reader collects agent audio and echoes marks (unless `echo_marks=False`
    or reading was paused with `stop_reading()`)."""

    def __init__(self, port: int, sid: str | None = None, call_sid: str | None = None, *,
                 echo_marks: bool = True, headers: dict | None = None, custom: dict | None = None):
        self.port = port
        self.sid = sid or "MZ" + secrets.token_hex(8)
        self.call_sid = call_sid or "CA" + secrets.token_hex(8)
        self.echo_marks = echo_marks
        self.headers = auth() if headers is None else headers
        self.custom = custom or {}
        self.ws = None
        self.media_in = 0
        self.marks: list[str] = []
        self.clears = 0
        self.first_audio_t: float | None = None
        self.last_audio_t = 0.0
        self._reader: asyncio.Task | None = None
        self._chunk = 0
        self._said_at = 0

    async def open(self, start: bool = True, read: bool = True, **connect_kw: Any) -> "RawCaller":
        self.ws = await connect(url(self.port), additional_headers=self.headers, max_size=2 ** 22, **connect_kw)
        if start:
            await self.ws.send(encode_event(Start(self.sid, self.call_sid, "AC1", self.custom)))
        if read:
            self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in self.ws:
                msg = parse_outbound(raw)
                if isinstance(msg, OutboundMedia):
                    self.media_in += 1
                    self.last_audio_t = time.monotonic()
                    if self.first_audio_t is None:
                        self.first_audio_t = self.last_audio_t
                elif isinstance(msg, OutboundMark):
                    self.marks.append(msg.name)
                    if self.echo_marks:
                        await self.ws.send(json.dumps({"event": "mark", "streamSid": self.sid,
                                                       "mark": {"name": msg.name}}))
                elif isinstance(msg, Clear):
                    self.clears += 1

    def stop_reading(self) -> None:
        """Stop reading the socket entirely: a stalled peer whose buffers fill up."""
        if self._reader is not None:
            self._reader.cancel()
        self.ws.transport.pause_reading()

    async def send_audio(self, data: bytes, realtime: bool = True, frame_bytes: int = 800) -> None:
        """Media messages of `frame_bytes` (100 ms by default), paced in real time."""
        t0 = time.monotonic()
        for i in range(0, len(data), frame_bytes):
            self._chunk += 1
            await self.ws.send(encode_event(Media(self.sid, data[i:i + frame_bytes], chunk=self._chunk)))
            if realtime:
                due = t0 + (i + frame_bytes) / 8000
                await asyncio.sleep(max(0.0, due - time.monotonic()))

    async def say(self, speech_s: float = 0.4, then_silence_s: float = 0.5) -> None:
        """An utterance the energy endpointer hears, then enough silence to end it."""
        self._said_at = self.media_in
        await self.send_audio(tone_mulaw(speech_s))
        await self.send_audio(silence_mulaw(then_silence_s))

    async def wait_reply(self, timeout: float = 10.0, quiet_s: float = 0.5) -> bool:
        """Agent audio started (since the last `say`) and then stayed quiet for `quiet_s`
        (keeps sending silence meanwhile, as a phone line does)."""
        start = self._said_at
        deadline = time.monotonic() + timeout
        while self.media_in == start:
            if time.monotonic() > deadline:
                return False
            await self.send_audio(silence_mulaw(0.1))
        while time.monotonic() - self.last_audio_t < quiet_s:
            if time.monotonic() > deadline:
                return False
            await self.send_audio(silence_mulaw(0.1))
        return True

    async def stop(self) -> None:
        await self.ws.send(encode_event(Stop(self.sid, self.call_sid, "AC1")))

    async def wait_closed(self, timeout: float = 15.0) -> int | None:
        with contextlib.suppress(ConnectionClosed, TimeoutError):
            async with asyncio.timeout(timeout):
                await self.ws.wait_closed()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        return self.ws.close_code

    async def close(self) -> None:
        """A clean WebSocket close, without `stop`."""
        await self.ws.close()
        await self.wait_closed()

    async def abort(self) -> None:
        """The network drops: no stop, no close frame, the TCP connection just goes."""
        self.ws.transport.abort()
        await self.wait_closed(5)


# ---------------------------------------------------------------- leak checks


def voice_pool_idle() -> bool:
    """No STT or TTS stand-in is running in any thread."""
    return VOICE_WORK.active == 0


def snapshot() -> tuple[set, set]:
    current = asyncio.current_task()
    return ({t for t in asyncio.all_tasks() if not t.done() and t is not current},
            {t for t in threading.enumerate() if t.is_alive()})


async def assert_released(before: tuple[set, set], timeout: float = 8.0, allow_threads: tuple[str, ...] = ()) -> None:
    """No task or thread left running that was not there before (voice-pool workers may
    have been created, but no STT or TTS work may still be running on them)."""
    tasks0, threads0 = before
    deadline = time.monotonic() + timeout
    while True:
        tasks, threads = snapshot()
        new_tasks = tasks - tasks0
        new_threads = {t for t in threads - threads0
                       if not t.name.startswith(("specvoice-voice", "asyncio_") + allow_threads)}
        if not new_tasks and not new_threads and voice_pool_idle():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left running: tasks {new_tasks}, threads {new_threads}, "
                                 f"voice pool idle {voice_pool_idle()}")
        await asyncio.sleep(0.05)


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def reports(cfg) -> dict[str, dict]:
    """call_id -> report, for every report in the config's folder."""
    from pipeline.report import load_report

    folder = Path(cfg.report.dir)
    out = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        data = load_report(path)
        out[data["call_id"]] = data
    return out


async def report_of(cfg, call_id: str, timeout: float = 10.0) -> dict:
    await wait_for(lambda: call_id in reports(cfg), timeout, f"the report of {call_id}")
    return reports(cfg)[call_id]


async def a_good_call(port: int, cfg, timeout: float = 15.0) -> dict:
    """A normal call after a fault: one question answered, stop, report completed."""
    c = await RawCaller(port).open()
    await c.say()
    assert await c.wait_reply(timeout), "no reply in the call after the fault"
    await c.stop()
    await c.wait_closed()
    data = await report_of(cfg, c.call_sid)
    assert len(data["turns"]) == 1 and data["turns"][0]["agent_text"], data["turns"]
    assert data["error"] is None, data["error"]
    return data
