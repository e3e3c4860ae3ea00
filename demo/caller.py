"""A simulated phone caller: dials the bridge exactly as Twilio would and plays a script.

    lines = prepare_lines(script_lines, tts)               # text via Piper, or WAV files
    result = await SimulatedCaller(url, lines, token=...).run()

On the wire it is Twilio: `connected`, `start` (mu-law 8 kHz mono), then a `media`
message every 20 ms, paced on an absolute clock, for the whole call (silence between
lines, as a phone line carries), `mark` echoed once the agent audio queued before it has
"played" on our side, and `stop` at the end. Agent audio is "played" in real time as it
arrives (a jitter buffer of what has been received); `clear` drops what is still
queued and echoes the pending marks at once, as Twilio does.

Turn-taking: after a line, the caller waits for the agent's reply to start and then to
finish (all marks echoed and no agent audio for `silence_s`). A line with
`barge_in_after_s` is spoken that long after the agent's reply to the previous line
began, over the agent. Both sides are recorded on one clock (stereo: caller left,
agent right, 8 kHz). Voice-to-voice from the caller's side: end of the line's audio ->
first agent audio frame received after it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pipeline.transports.telephony.far_end import FarEnd
from pipeline.transports.telephony.protocol import FRAME_BYTES, SAMPLE_RATE
from voice import mulaw
from voice.audio import resample, to_float32, to_int16

log = logging.getLogger(__name__)

FRAME_S = FRAME_BYTES / SAMPLE_RATE  # 20 ms
SILENCE = bytes([0xFF]) * FRAME_BYTES  # mu-law zero

DEFAULT_SCRIPT: list[dict[str, Any]] = [
    {"text": "Hi, what are your opening hours on Saturday?"},
    {"text": "How much does a cleaning cost?"},
    {"text": "Can I book the Tuesday morning slot? My name is Ann Lee."},
]


@dataclass
class Line:
    label: str  # the text, or the WAV file name
    audio: np.ndarray  # float32 8 kHz, leading/trailing silence trimmed
    barge_in_after_s: float | None = None
    text: str | None = None


@dataclass
class CallerTurn:
    index: int
    label: str
    start_t: float = 0.0  # first frame of the line sent
    end_t: float = 0.0  # end of the line's audio (last frame's end)
    first_agent_audio_t: float | None = None
    agent_audio_s: float = 0.0
    barged_in: bool = False  # this line was spoken over the agent

    @property
    def voice_to_voice(self) -> float | None:
        if self.first_agent_audio_t is None:
            return None
        return self.first_agent_audio_t - self.end_t


@dataclass
class CallerResult:
    stream_sid: str
    call_sid: str
    turns: list[CallerTurn] = field(default_factory=list)
    media_in: int = 0  # agent media messages received
    payload_bytes: int = 0
    marks_received: list[str] = field(default_factory=list)
    marks_echoed: list[str] = field(default_factory=list)
    clears: list[float] = field(default_factory=list)  # times a `clear` arrived
    greeting_audio_s: float = 0.0
    caller_track: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16), repr=False)
    agent_track: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16), repr=False)
    agent_payload: bytearray = field(default_factory=bytearray, repr=False)  # every mu-law byte received
    bad_messages: list[str] = field(default_factory=list)
    t0: float = 0.0

    def stereo(self) -> np.ndarray:
        n = max(len(self.caller_track), len(self.agent_track))
        out = np.zeros((n, 2), np.int16)
        out[: len(self.caller_track), 0] = self.caller_track
        out[: len(self.agent_track), 1] = self.agent_track
        return out

    def write_wav(self, path: str | Path) -> Path:
        from voice.wav import write_wav

        return write_wav(path, self.stereo(), SAMPLE_RATE)


# ---------------------------------------------------------------- scripts


def load_script(path: str | Path) -> list[dict[str, Any]]:
    """A script file: JSON list, or TOML with [[line]] tables. Each line is a string (text
    to speak) or {text | wav, barge_in_after_s}; relative WAV paths are from the file."""
    path = Path(path)
    raw = path.read_text(encoding="utf-8")
    data = tomllib.loads(raw).get("line") if path.suffix == ".toml" else json.loads(raw)
    if isinstance(data, dict):
        data = data.get("lines")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: a script is a non-empty list of lines (JSON list, or TOML [[line]] tables)")
    lines = []
    for i, item in enumerate(data):
        if isinstance(item, str):
            item = {"text": item}
        if not isinstance(item, dict) or not (item.get("text") or item.get("wav")):
            raise ValueError(f"{path}: line {i + 1} needs 'text' or 'wav'")
        unknown = set(item) - {"text", "wav", "barge_in_after_s"}
        if unknown:
            raise ValueError(f"{path}: line {i + 1}: unknown keys {sorted(unknown)}")
        if item.get("wav") and not Path(item["wav"]).is_absolute():
            item = {**item, "wav": str(path.parent / item["wav"])}
        lines.append(item)
    return lines


def trim_silence(pcm: np.ndarray, sample_rate: int, threshold_db: float = -45.0, pad_s: float = 0.03) -> np.ndarray:
    """Cut leading and trailing silence (10 ms windows under `threshold_db`), so that a
    line's end is its last voiced audio: what voice-to-voice is measured from."""
    win = max(1, sample_rate // 100)
    n = len(pcm) // win
    if n == 0:
        return pcm
    frames = pcm[: n * win].reshape(n, win).astype(np.float64)
    level = 10 * np.log10(np.mean(frames ** 2, axis=1) + 1e-12)
    voiced = np.flatnonzero(level > threshold_db)
    if len(voiced) == 0:
        return pcm[:0]
    pad = int(pad_s * sample_rate)
    return pcm[max(0, voiced[0] * win - pad): min(len(pcm), (voiced[-1] + 1) * win + pad)]


def prepare_lines(script: list[dict[str, Any]], tts: Any = None) -> list[Line]:
    """Script items -> Lines of 8 kHz audio. Text is spoken by `tts` (a voice.tts engine)."""
    from voice.wav import read_wav

    lines = []
    for item in script:
        if item.get("wav"):
            pcm, rate = read_wav(item["wav"], sample_rate=None)
            label = Path(item["wav"]).name
        else:
            if tts is None:
                raise ValueError("a text line needs a TTS engine to speak it")
            chunks = list(tts.synthesize(item["text"]))
            rate = chunks[0].sample_rate
            pcm = np.concatenate([c.pcm for c in chunks])
            label = item["text"]
        pcm8 = resample(to_float32(pcm), rate, SAMPLE_RATE)
        lines.append(Line(label, trim_silence(pcm8, SAMPLE_RATE), item.get("barge_in_after_s"), item.get("text")))
    return lines


# ---------------------------------------------------------------- the caller


class SimulatedCaller:
    def __init__(
        self,
        url: str,
        lines: list[Line],
        *,
        token: str | None = None,
        headers: dict[str, str] | None = None,
        expect_greeting: bool = True,
        silence_s: float = 1.2,
        reply_timeout_s: float = 90.0,
        greeting_timeout_s: float = 30.0,
        custom_parameters: dict[str, str] | None = None,
        on_turn: Callable[[CallerTurn], None] | None = None,
    ):
        self.url = url
        self.lines = lines
        self.headers = dict(headers or {})
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.expect_greeting = expect_greeting
        self.silence_s = silence_s
        self.reply_timeout_s = reply_timeout_s
        self.greeting_timeout_s = greeting_timeout_s
        self.custom_parameters = custom_parameters or {}
        self.on_turn = on_turn
        sid = uuid.uuid4().hex
        self.result = CallerResult(stream_sid=f"MZ{sid}", call_sid=f"CA{secrets.token_hex(16)}")
        self._out: list[bytes] = []  # frames of the line being spoken
        self._line_sent = asyncio.Event()
        self._play_end = 0.0  # when the agent audio received so far will have played
        self._last_audio = 0.0  # when the last agent frame arrived
        self._pending_marks: list[tuple[float, str]] = []
        self._agent_chunks: list[tuple[int, np.ndarray]] = []  # (sample position, int16)
        self._caller_chunks: list[np.ndarray] = []
        self._current: CallerTurn | None = None
        self._line_turn: CallerTurn | None = None
        self._audio_event = asyncio.Event()
        self._ws = None
        self._far: FarEnd | None = None

    # -------------------------------------------------------- run

    async def run(self) -> CallerResult:
        from websockets.asyncio.client import connect

        r = self.result
        async with connect(self.url, additional_headers=self.headers, max_size=2 ** 22,
                           open_timeout=10) as ws:
            self._ws = ws
            self._far = FarEnd(ws, r.stream_sid, r.call_sid)
            await self._far.open(self.custom_parameters)
            r.t0 = time.monotonic()
            sender = asyncio.create_task(self._sender())
            receiver = asyncio.create_task(self._receiver())
            marker = asyncio.create_task(self._mark_echoer())
            try:
                await self._script()
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)
                await self._far.stop()
                # The bridge hangs up once the agent has wrapped up (its report written).
                try:
                    async with asyncio.timeout(15):
                        await receiver
                except TimeoutError:
                    pass
            finally:
                for task in (sender, receiver, marker):
                    task.cancel()
                await asyncio.gather(sender, receiver, marker, return_exceptions=True)
        self._finish_tracks()
        return r

    async def _script(self) -> None:
        if self.expect_greeting:
            got = await self._wait_agent(self.greeting_timeout_s, since=self.result.t0)
            self.result.greeting_audio_s = got
        for i, line in enumerate(self.lines):
            turn = CallerTurn(i, line.label, barged_in=line.barge_in_after_s is not None and i > 0)
            self.result.turns.append(turn)
            await self._speak(line, turn)
            nxt = self.lines[i + 1] if i + 1 < len(self.lines) else None
            if nxt is not None and nxt.barge_in_after_s is not None:
                # Talk over the agent: wait for its reply to start, then interrupt.
                await self._wait_first_audio(turn, self.reply_timeout_s)
                await asyncio.sleep(nxt.barge_in_after_s)
            else:
                await self._wait_agent(self.reply_timeout_s, since=turn.end_t)
            if self.on_turn is not None:
                self.on_turn(turn)

    async def _speak(self, line: Line, turn: CallerTurn) -> None:
        data = mulaw.encode_bytes(to_int16(line.audio))
        frames = [data[i:i + FRAME_BYTES] for i in range(0, len(data), FRAME_BYTES)]
        if frames and len(frames[-1]) < FRAME_BYTES:
            frames[-1] = frames[-1] + SILENCE[: FRAME_BYTES - len(frames[-1])]
        self._line_sent.clear()
        self._current = turn
        turn.start_t = 0.0
        self._out = frames
        self._line_turn = turn
        await self._line_sent.wait()

    async def _wait_first_audio(self, turn: CallerTurn, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while turn.first_agent_audio_t is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return turn.first_agent_audio_t is not None

    async def _wait_agent(self, timeout: float, since: float) -> float:
        """Wait for agent audio after `since`, then for it to finish. Returns seconds heard."""
        deadline = time.monotonic() + timeout
        while self._last_audio <= since:
            if time.monotonic() > deadline:
                log.warning("caller: no agent audio within %.0f s", timeout)
                return 0.0
            await asyncio.sleep(0.01)
        first = self._last_audio
        while True:
            now = time.monotonic()
            quiet = now - self._last_audio >= self.silence_s and self._play_end <= now and not self._pending_marks
            if quiet or now > deadline:
                return max(0.0, self._play_end - first)
            await asyncio.sleep(0.02)

    # -------------------------------------------------------- wire

    async def _sender(self) -> None:
        """One media message per 20 ms, on an absolute clock, for the whole call."""
        r = self.result
        k = 0
        while True:
            due = r.t0 + k * FRAME_S
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if self._out:
                frame = self._out.pop(0)
                turn = self._line_turn
                if not turn.start_t:
                    turn.start_t = due
                if not self._out:
                    turn.end_t = due + FRAME_S
                    self._line_sent.set()
            else:
                frame = SILENCE
            self._caller_chunks.append(np.frombuffer(frame, np.uint8))
            await self._far.send_audio(frame, k)
            k += 1

    async def _receiver(self) -> None:
        from websockets.exceptions import ConnectionClosed

        r = self.result
        try:
            async for raw in self._ws:
                now = time.monotonic()
                try:
                    msg = FarEnd.read(raw)
                except Exception as exc:
                    r.bad_messages.append(f"{exc}: {str(raw)[:80]}")
                    continue
                if msg.stream_sid != r.stream_sid:
                    r.bad_messages.append(f"wrong streamSid {msg.stream_sid}")
                if msg.kind == "audio":
                    self._on_media(msg.payload, now)
                elif msg.kind == "mark":
                    r.marks_received.append(msg.name)
                    self._pending_marks.append((max(self._play_end, now), msg.name))
                elif msg.kind == "clear":
                    self._on_clear(now)
        except ConnectionClosed:
            pass

    def _on_media(self, payload: bytes, now: float) -> None:
        r = self.result
        r.media_in += 1
        r.payload_bytes += len(payload)
        r.agent_payload += payload
        start = max(self._play_end, now)
        pos = int(round((start - r.t0) * SAMPLE_RATE))
        self._agent_chunks.append((pos, mulaw.decode(payload)))
        self._play_end = start + len(payload) / SAMPLE_RATE
        self._last_audio = now
        turn = self._current
        if turn is not None and turn.end_t and now >= turn.end_t:
            if turn.first_agent_audio_t is None:
                turn.first_agent_audio_t = now
            turn.agent_audio_s += len(payload) / SAMPLE_RATE

    def _on_clear(self, now: float) -> None:
        """Drop agent audio not yet played, echo pending marks now (as Twilio does)."""
        r = self.result
        r.clears.append(now)
        cut = int(round((now - r.t0) * SAMPLE_RATE))
        kept = []
        for pos, pcm in self._agent_chunks:
            if pos >= cut:
                continue
            kept.append((pos, pcm[: max(0, cut - pos)]))
        self._agent_chunks = kept
        self._play_end = now
        pending, self._pending_marks = self._pending_marks, []
        for _, name in pending:
            asyncio.create_task(self._echo(name))

    async def _echo(self, name: str) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            await self._far.echo_mark(name)
            self.result.marks_echoed.append(name)
        except ConnectionClosed:
            pass

    async def _mark_echoer(self) -> None:
        """Echo each mark once the audio received before it has played."""
        while True:
            now = time.monotonic()
            while self._pending_marks and self._pending_marks[0][0] <= now:
                _, name = self._pending_marks.pop(0)
                await self._echo(name)
            await asyncio.sleep(0.005)

    def _finish_tracks(self) -> None:
        r = self.result
        caller = mulaw.decode(b"".join(c.tobytes() for c in self._caller_chunks)) if self._caller_chunks else \
            np.zeros(0, np.int16)
        end = max([len(caller)] + [pos + len(p) for pos, p in self._agent_chunks])
        agent = np.zeros(end, np.int16)
        for pos, pcm in self._agent_chunks:
            if pos >= 0:
                agent[pos:pos + len(pcm)] = pcm
        r.caller_track, r.agent_track = caller, agent


# ---------------------------------------------------------------- in-process bridge


async def call_in_process(
    config: Any,
    lines: list[Line],
    *,
    models: Any = None,
    report_dir: str | Path | None = None,
    greeting: bool = True,
    on_server_turn: Callable[[str, dict], None] | None = None,
    on_caller_turn: Callable[[CallerTurn], None] | None = None,
    silence_s: float = 1.2,
) -> tuple[CallerResult, Any]:
    """Start a bridge on 127.0.0.1 (random port, a bearer token made here), place one
    simulated call through it, and return (caller result, the pipeline Call)."""
    from pipeline.transports.telephony.auth import BridgeTokens
    from pipeline.transports.web.server import Bridge
    from pipeline.transports.telephony.adapter import make_call_handler

    token = secrets.token_urlsafe(24)
    handler = make_call_handler(config, models, report_dir=report_dir, greeting=greeting,
                                on_turn=on_server_turn)
    bridge = Bridge(config.bridge.model_copy(update={"host": "127.0.0.1", "port": 0}), handler,
                    BridgeTokens.of(bearer_token=token))
    port = await bridge.start()
    try:
        caller = SimulatedCaller(f"ws://127.0.0.1:{port}/media-stream", lines, token=token,
                                 expect_greeting=bool(greeting), silence_s=silence_s, on_turn=on_caller_turn)
        result = await caller.run()
        # The bridge gives the pipeline end_grace_s to write its report after the hang-up.
        deadline = time.monotonic() + config.bridge.end_grace_s + 5
        while time.monotonic() < deadline and not (handler.calls and handler.calls[-1].report_path):
            await asyncio.sleep(0.05)
    finally:
        await bridge.stop()
    return result, (handler.calls[-1] if handler.calls else None)
