"""The telephony bridge over real WebSocket connections on 127.0.0.1 (ephemeral ports)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import statistics
import time

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from callfakes import wait_for
from pipeline.transports.telephony.auth import BridgeTokens, twilio_signature
from pipeline.playout import LATE_GAP_S, wait_confirmed
from pipeline.transports.telephony.call import TelephonyCall
from pipeline.transports.web.server import Bridge, BridgeAuthError
from pipeline.transports.telephony.protocol import (Clear, Dtmf, Mark, Media, OutboundMark, OutboundMedia, Start, Stop,
                                                   encode_event, parse_outbound)
from pipeline.config import BridgeConfig
from voice import mulaw
from voice.tts import AudioChunk

pytestmark = pytest.mark.timeout(30)

TWILIO_TOKEN = "twilio-test-token"
BEARER = "bearer-test-token"
SID = "MZ0001"


def frame(i: int) -> bytes:
    return bytes([i % 256]) * 160


def mulaw_chunk(payload: bytes) -> AudioChunk:
    """mu-law bytes as audio for a call's output (which encodes it back, code for code)."""
    return AudioChunk(mulaw.decode(payload), 8000)


class Echo:
    """Test-only on_call: echoes audio; DTMF digits drive marks and clear."""

    def __init__(self):
        self.calls: list[TelephonyCall] = []
        self.events: list = []
        self.marks: dict[str, asyncio.Future] = {}
        self.done = asyncio.Event()

    async def __call__(self, call: TelephonyCall) -> None:
        self.calls.append(call)
        try:
            async for event in call:
                self.events.append(event)
                if isinstance(event, Media):
                    call.output.play(mulaw_chunk(event.payload))
                elif isinstance(event, Dtmf) and event.digit in "AB":
                    self.marks[event.digit] = call.output.mark(event.digit)
                elif isinstance(event, Dtmf) and event.digit == "9":
                    call.output.play(mulaw_chunk(b"\xff" * 8000 * 2))  # two seconds
                    await asyncio.sleep(0.1)  # the caller talks over the agent 0.1 s in
                    await call.output.clear()
                elif isinstance(event, Dtmf) and event.digit == "0":
                    raise RuntimeError("handler bug")
        finally:
            self.done.set()


@contextlib.asynccontextmanager
async def running_bridge(on_call=None, tokens=BridgeTokens.of(TWILIO_TOKEN, BEARER), **overrides):
    settings = dict(host="127.0.0.1", port=0, max_calls=2, idle_timeout_s=5.0, max_message_bytes=64 * 1024,
                    handshake_timeout_s=2.0)
    bridge_kw = {k: overrides.pop(k) for k in ("insecure", "send_ahead_s", "end_grace_s") if k in overrides}
    settings.update(overrides)
    bridge = Bridge(BridgeConfig(**settings), on_call or Echo(), tokens, **bridge_kw)
    port = await bridge.start()
    try:
        yield bridge, port
    finally:
        await asyncio.wait_for(bridge.stop(), 10)


def stream_url(port: int) -> str:
    return f"ws://127.0.0.1:{port}/media-stream"


def bearer() -> dict:
    return {"Authorization": f"Bearer {BEARER}"}


async def call_in_progress(port: int):
    """A call the bridge has started and answered once (its first audio echoed back)."""
    ws = await connect(stream_url(port), additional_headers=bearer())
    await ws.send(start_msg())
    await ws.send(encode_event(Media(SID, frame(1))))
    await recv_outbound(ws)
    return ws


def start_msg(sid: str = SID) -> str:
    return encode_event(Start(sid, "CA0001", "AC0001", {"From": "+15550100"}))


async def recv_outbound(ws, timeout: float = 3.0):
    return parse_outbound(await asyncio.wait_for(ws.recv(), timeout))


async def wait_closed(ws, timeout: float = 3.0) -> int | None:
    await read_until_closed(ws, timeout)
    return ws.close_code


async def read_until_closed(ws, timeout: float = 3.0) -> list:
    """Everything the server still sends, up to its close."""
    rest = []
    with contextlib.suppress(ConnectionClosed):
        while True:
            rest.append(parse_outbound(await asyncio.wait_for(ws.recv(), timeout)))
    return rest


async def simple_echo_works(port: int, sid: str = "MZok") -> None:
    async with connect(stream_url(port), additional_headers=bearer()) as ws:
        await ws.send(start_msg(sid))
        await ws.send(encode_event(Media(sid, frame(7))))
        msg = await recv_outbound(ws)
        assert msg == OutboundMedia(sid, frame(7))


async def test_echo_pacing_marks_and_clear():
    echo = Echo()
    async with running_bridge(echo, send_ahead_s=0.0) as (bridge, port):
        async with connect(stream_url(port), additional_headers=bearer()) as ws:
            await ws.send('{"event": "connected", "protocol": "Call", "version": "1.0.0"}')
            await ws.send(start_msg())
            loop = asyncio.get_running_loop()
            t_first = loop.time()  # no echo can leave the server before its media was sent
            for i in range(5):
                await ws.send(encode_event(Media(SID, frame(i), chunk=i + 1, timestamp=20 * i)))
            await ws.send(encode_event(Dtmf(SID, "A")))
            for i in range(5, 10):
                await ws.send(encode_event(Media(SID, frame(i), chunk=i + 1, timestamp=20 * i)))
            await ws.send(encode_event(Dtmf(SID, "B")))

            received, arrivals = [], []
            while len(received) < 12:
                msg = await recv_outbound(ws)
                received.append(msg)
                if isinstance(msg, OutboundMedia):
                    arrivals.append(loop.time())
                else:
                    await ws.send(encode_event(Mark(SID, msg.name)))  # played: echo it
            # Audio comes back in order, with each mark right after the audio queued before it.
            expected = [OutboundMedia(SID, frame(i)) for i in range(5)] + [OutboundMark(SID, "A")]
            expected += [OutboundMedia(SID, frame(i)) for i in range(5, 10)] + [OutboundMark(SID, "B")]
            assert received == expected
            # Paced in real time, not as fast as they came in: frame k goes out no earlier
            # than 20 ms * k after the first one could. Only lower bounds: a slow or busy
            # machine only makes frames later (gaps between arrivals are not checked: after
            # a stall the sender catches up with frames back to back). The exact rate and
            # the absence of drift are checked on TelephonyCall alone below.
            early = [(k, round(t - t_first, 4)) for k, t in enumerate(arrivals) if t - t_first < 0.02 * k - 0.001]
            assert not early, early
            assert arrivals[-1] - t_first >= 0.18 - 0.001

            call = echo.calls[0]
            assert await wait_confirmed(echo.marks["A"], 2) and await wait_confirmed(echo.marks["B"], 2)
            assert call.played_marks == ["A", "B"]
            assert call.start.custom_parameters == {"From": "+15550100"}
            assert call.stats.frames_sent == 10 and call.stats.marks_sent == 2

            # Barge-in: two seconds queued, then clear after 0.1 s -> a `clear` arrives,
            # fewer than the 100 queued frames were sent, and none after the clear.
            await ws.send(encode_event(Dtmf(SID, "9")))
            media_after = 0
            while True:
                msg = await recv_outbound(ws)
                if isinstance(msg, Clear):
                    break
                assert isinstance(msg, OutboundMedia), msg
                media_after += 1
            # Frame 0 goes out at once, before the clear 0.1 s later, however late the loop
            # runs (its write may still wait on the socket: later frames need not make it).
            assert 1 <= media_after < 100, media_after
            await wait_for(lambda: call.stats.clears_sent == 1, 5, "the server to count its clear")
            assert call.output.queued_s == 0
            await ws.send(encode_event(Stop(SID, "CA0001", "AC0001")))
            rest = await read_until_closed(ws)  # the close is the barrier: nothing of the old audio came
            assert not [m for m in rest if isinstance(m, OutboundMedia)], rest
            assert ws.close_code == 1000
        await asyncio.wait_for(echo.done.wait(), 3)
        assert isinstance(echo.events[-1], Stop)
        assert bridge.active_calls == 0


async def test_send_ahead_sends_a_few_frames_at_once():
    """The first `send_ahead_s` of audio goes out at once, the rest in real time. Half a
    second ahead (the default is 40 ms) so the burst cannot be mistaken for pacing on a
    slow machine: 26 frames are 0.5 s of audio, and without send-ahead they could not
    arrive in less than 0.5 s."""
    echo = Echo()
    async with running_bridge(echo, send_ahead_s=0.5) as (bridge, port):
        async with connect(stream_url(port), additional_headers=bearer()) as ws:
            await ws.send(start_msg())
            loop = asyncio.get_running_loop()
            t_sent = loop.time()
            await ws.send(encode_event(Media(SID, frame(1) * 50)))  # 1 s in one message
            arrivals = []
            for _ in range(50):
                msg = await recv_outbound(ws)
                assert isinstance(msg, OutboundMedia) and len(msg.payload) == 160
                arrivals.append(loop.time())
            # Frames 0..25 are due at once (frame k at 20 ms * k - 0.5 s): 26 back to back.
            # 0.25 s is half of what pacing would take; a busy loop needs milliseconds.
            assert arrivals[25] - arrivals[0] < 0.25, arrivals[25] - arrivals[0]
            # ... and the rest are paced: frame 49 is not due before 0.98 - 0.5 s.
            assert arrivals[-1] - t_sent >= 0.48 - 0.001


async def test_twilio_signature_accepted_wrong_or_missing_refused(caplog):
    caplog.set_level(logging.DEBUG)
    echo = Echo()
    async with running_bridge(echo) as (bridge, port):
        url = f"wss://127.0.0.1:{port}/media-stream?tenant=a"
        good = twilio_signature(TWILIO_TOKEN, url)
        async with connect(stream_url(port) + "?tenant=a", additional_headers={"X-Twilio-Signature": good}) as ws:
            await ws.send(start_msg())
            await ws.send(encode_event(Media(SID, frame(3))))
            assert await recv_outbound(ws) == OutboundMedia(SID, frame(3))
        refusals = [
            ({"X-Twilio-Signature": twilio_signature("wrong-token", url)}, "?tenant=a", 403),
            ({"X-Twilio-Signature": good}, "?tenant=b", 403),  # the query string is signed too
            ({"Authorization": "Bearer nope"}, "", 403),
            ({}, "", 401),
        ]
        for headers, query, status in refusals:
            with pytest.raises(InvalidStatus) as info:
                async with connect(stream_url(port) + query, additional_headers=headers):
                    pass
            assert info.value.response.status_code == status
        assert len(echo.calls) == 1  # refused connections never reached on_call
        assert bridge.calls_total == 1
        # ... not even later: a call admitted after them is the second one, not the sixth.
        await simple_echo_works(port)
        assert len(echo.calls) == 2 and bridge.calls_total == 2
    assert "refused (403)" in caplog.text and "refused (401)" in caplog.text
    # Credentials never reach the server's log, even at DEBUG (the test's own client logs
    # its request headers; that is not the server).
    server_log = "\n".join(r.getMessage()
                           for r in caplog.records if not r.name.startswith("websockets.client"))
    for secret in (TWILIO_TOKEN, BEARER, good, "nope"):
        assert secret not in server_log


async def test_public_url_is_what_twilio_signs():
    async with running_bridge(public_url="wss://voice.example.com/media-stream") as (_, port):
        sig = twilio_signature(TWILIO_TOKEN, "wss://voice.example.com/media-stream")
        async with connect(stream_url(port), additional_headers={"X-Twilio-Signature": sig}):
            pass
        local = twilio_signature(TWILIO_TOKEN, f"wss://127.0.0.1:{port}/media-stream")
        with pytest.raises(InvalidStatus):
            async with connect(stream_url(port), additional_headers={"X-Twilio-Signature": local}):
                pass


async def test_refuses_to_start_without_tokens_unless_insecure():
    with pytest.raises(BridgeAuthError, match="--insecure"):
        Bridge(BridgeConfig(port=0), Echo(), BridgeTokens())
    async with running_bridge(tokens=BridgeTokens(), insecure=True) as (_, port):
        await simple_echo_works(port)
    async with running_bridge(tokens=BridgeTokens(), require_auth=False) as (_, port):
        async with connect(stream_url(port)) as ws:  # no credentials needed in dev mode
            await ws.send(start_msg())


async def test_max_calls_refused_with_503_at_handshake():
    echo = Echo()
    async with running_bridge(echo, max_calls=1) as (bridge, port):
        async with connect(stream_url(port), additional_headers=bearer()) as first:
            await first.send(start_msg("MZfirst"))
            with pytest.raises(InvalidStatus) as info:
                async with connect(stream_url(port), additional_headers=bearer()):
                    pass
            assert info.value.response.status_code == 503
            async with httpx.AsyncClient() as client:
                health = (await client.get(f"http://127.0.0.1:{port}/health")).json()
            assert health == {"ok": True, "draining": False, "calls_active": 1, "max_calls": 1, "calls_total": 1}
        # The slot frees once the first call's handler finished.
        await wait_for(lambda: bridge.active_calls == 0, 10, "the first call's slot to free")
        await simple_echo_works(port)


async def test_drain_refuses_new_calls_and_lets_the_call_in_progress_finish():
    """SIGTERM's drain: the webhook, new streams and /health answer 503 (a load balancer
    moves on); the call in progress goes on, and the drain ends when it does."""
    echo = Echo()
    async with running_bridge(echo) as (bridge, port):
        async with await call_in_progress(port) as ws:
            draining = asyncio.create_task(bridge.drain(30.0))
            await wait_for(lambda: bridge.draining, 5, "the drain to start")
            async with httpx.AsyncClient() as client:
                r = await client.get(f"http://127.0.0.1:{port}/health")
                assert r.status_code == 503 and r.json()["draining"] is True and r.json()["calls_active"] == 1
                r = await client.post(f"http://127.0.0.1:{port}/voice", headers=bearer())
                assert r.status_code == 503 and r.headers["Retry-After"] == "5"
            with pytest.raises(InvalidStatus) as info:
                async with connect(stream_url(port), additional_headers=bearer()):
                    pass
            assert info.value.response.status_code == 503
            # The call in progress is still served.
            await ws.send(encode_event(Media(SID, frame(2))))
            assert await recv_outbound(ws) is not None
            assert not draining.done()
            await ws.send(encode_event(Stop(SID, "CA0001", "AC0001")))
            assert await asyncio.wait_for(draining, 10) == 0  # its end ended the drain
        assert [c.end_reason for c in echo.calls] != ["server_shutdown"]


async def test_a_drain_that_runs_out_leaves_the_call_to_stop():
    echo = Echo()
    async with running_bridge(echo, end_grace_s=0.5) as (bridge, port):
        ws = await call_in_progress(port)
        assert await asyncio.wait_for(bridge.drain(0.2), 10) == 1  # still in progress at the deadline
        await asyncio.wait_for(bridge.stop(), 5)
        assert await wait_closed(ws) == 1001
        await asyncio.wait_for(echo.done.wait(), 2)
        assert [c.end_reason for c in echo.calls] == ["server_shutdown"]


async def test_idle_timeout_closes_the_call():
    echo = Echo()
    async with running_bridge(echo, idle_timeout_s=0.3) as (_, port):
        async with connect(stream_url(port), additional_headers=bearer()) as ws:
            await ws.send(start_msg())
            t0 = asyncio.get_running_loop().time()
            assert await wait_closed(ws) == 1000
            assert ws.close_reason == "idle timeout"
            # The behaviour is a timeout: not before 0.3 s of silence (the server's clock
            # starts after our start message); 2 s is a generous bound for a 0.3 s timer.
            elapsed = asyncio.get_running_loop().time() - t0
            assert 0.3 <= elapsed < 2.0, elapsed
        await asyncio.wait_for(echo.done.wait(), 3)  # the handler's iterator ended


async def test_twiml_and_health_endpoints():
    async with running_bridge() as (_, port):
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as client:
            r = await client.get(base + "/health")
            assert r.status_code == 200 and r.json()["ok"] is True and r.json()["max_calls"] == 2
            # Twilio's voice webhook (GET), signed over the public URL with its query string.
            query = "?CallSid=CA1&From=%2B15550100&To=%2B15550199"
            signed = f"https://127.0.0.1:{port}/voice{query}"
            r = await client.get(base + "/voice" + query,
                                 headers={"X-Twilio-Signature": twilio_signature(TWILIO_TOKEN, signed)})
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/xml")
            assert r.text.startswith('<?xml version="1.0" encoding="UTF-8"?><Response><Connect>')
            assert f'<Stream url="wss://127.0.0.1:{port}/media-stream">' in r.text
            assert '<Parameter name="From" value="+15550100"/>' in r.text
            r = await client.post(base + "/voice", headers=bearer())  # body-less POST
            assert r.status_code == 200
            assert r.text.endswith(f'<Stream url="wss://127.0.0.1:{port}/media-stream"/></Connect></Response>')
            assert (await client.get(base + "/voice")).status_code == 401
            bad = twilio_signature("wrong", signed)
            assert (await client.get(base + "/voice" + query, headers={"X-Twilio-Signature": bad})).status_code == 403
            assert (await client.get(base + "/nope")).status_code == 404


async def test_bad_input_does_not_take_the_server_down():
    echo = Echo()
    async with running_bridge(echo, max_message_bytes=4096) as (bridge, port):
        # Malformed JSON -> 1007.
        async with connect(stream_url(port), additional_headers=bearer()) as ws:
            await ws.send("{this is not json")
            assert await wait_closed(ws) == 1007
        # Media before start is ignored; the call then works.
        async with connect(stream_url(port), additional_headers=bearer()) as ws:
            await ws.send(encode_event(Media(SID, frame(1))))
            await ws.send('{"event": "telepathy"}')  # unknown events are ignored too
            await ws.send(start_msg())
            await ws.send(encode_event(Media(SID, frame(2))))
            assert await recv_outbound(ws) == OutboundMedia(SID, frame(2))
            # A second start -> 1008.
            await ws.send(start_msg())
            assert await wait_closed(ws) == 1008
        # Oversized message -> closed by the size limit (1009).
        async with connect(stream_url(port), additional_headers=bearer()) as ws:
            await ws.send(start_msg())
            await ws.send(json.dumps({"event": "media", "streamSid": SID, "media": {"payload": "A" * 8000}}))
            assert await wait_closed(ws) == 1009
        # Bad base64 -> 1007; wrong media format -> 1008.
        async with connect(stream_url(port), additional_headers=bearer()) as ws:
            await ws.send(start_msg())
            await ws.send(json.dumps({"event": "media", "streamSid": SID, "media": {"payload": "***"}}))
            assert await wait_closed(ws) == 1007
        async with connect(stream_url(port), additional_headers=bearer()) as ws:
            bad = json.loads(start_msg())
            bad["start"]["mediaFormat"]["sampleRate"] = 16000
            await ws.send(json.dumps(bad))
            assert await wait_closed(ws) == 1008
        # A handler that raises -> 1011 for that call only.
        async with connect(stream_url(port), additional_headers=bearer()) as ws:
            await ws.send(start_msg())
            await ws.send(encode_event(Dtmf(SID, "0")))
            assert await wait_closed(ws) == 1011
        await simple_echo_works(port)
        await wait_for(lambda: bridge.active_calls == 0 and not bridge.calls, 10, "every call to end")


async def test_disconnect_cancels_a_stuck_handler():
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def stuck(call: TelephonyCall) -> None:
        entered.set()
        try:
            await asyncio.sleep(3600)  # ignores the inbound stream entirely
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with running_bridge(stuck, end_grace_s=0.1) as (bridge, port):
        async with connect(stream_url(port), additional_headers=bearer()) as ws:
            await ws.send(start_msg())
            await asyncio.wait_for(entered.wait(), 10)  # the handler is running
        await asyncio.wait_for(cancelled.wait(), 10)
        await wait_for(lambda: not bridge.calls, 10, "the call to be dropped")


async def test_handler_ending_hangs_up_after_audio_drained(caplog):
    caplog.set_level(logging.INFO)

    async def greeter(call: TelephonyCall) -> None:
        call.output.play(mulaw_chunk(b"\xff" * 800))  # 100 ms
        call.output.mark("bye")

    async with running_bridge(greeter, send_ahead_s=0.0) as (_, port):
        async with connect(stream_url(port), additional_headers=bearer()) as ws:
            await ws.send(start_msg())
            kinds = []
            with contextlib.suppress(ConnectionClosed):
                while True:
                    kinds.append(type(await recv_outbound(ws)).__name__)
            assert kinds == ["OutboundMedia"] * 5 + ["OutboundMark"]
            assert ws.close_code == 1000 and ws.close_reason == "call ended"
    # The server has stopped (its handlers finished): the call's closing line was logged,
    # and nothing after the hang-up failed (a stats field read at the end once raised there).
    assert re.search(r"call \S+ ended: \d+ media in, 5 frames out, \d+ late, \d+ marks echoed", caplog.text)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


# ---------------------------------------------------------------- TelephonyCall alone

class Recorder:
    """A `send` that records (the time the write began, message). Optionally each send
    blocks the event loop for `send_s` (a slow write), or the loop stalls once, in message
    `stall_at`. `wait_sent(n)` waits until n messages went out."""

    def __init__(self, stall_at: int | None = None, stall_s: float = 0.0, send_s: float = 0.0):
        self.sent: list[tuple[float, object]] = []
        self.stall_at, self.stall_s, self.send_s = stall_at, stall_s, send_s
        self.changed = asyncio.Event()

    async def __call__(self, text: str) -> None:
        began = asyncio.get_running_loop().time()  # the call stamps its frames when the write begins too
        if self.stall_at is not None and len(self.sent) == self.stall_at:
            time.sleep(self.stall_s)  # a blocked event loop (a model step on the loop thread)
        if self.send_s:
            time.sleep(self.send_s)  # a slow write (the loop is blocked meanwhile)
        self.sent.append((began, parse_outbound(text)))
        self.changed.set()

    async def wait_sent(self, n: int, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.sent) < n:
                self.changed.clear()
                await self.changed.wait()


def late_gap_bounds(times: list[float]) -> tuple[int, int]:
    """How many gaps between consecutive sends exceed LATE_GAP_S, counted from our own
    clock readings: (at least, at most), give or take 5 ms, since the call reads the clock
    a moment before our `send` does. On a quiet machine both are 0; a busy one may really
    send a frame late, and then the call must have counted exactly that."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return sum(g > LATE_GAP_S + 0.005 for g in gaps), sum(g > LATE_GAP_S - 0.005 for g in gaps)


async def test_pacing_has_no_drift_over_a_second():
    """Frames go out on an absolute clock, 40 ms ahead (the default). Each send here takes
    10 ms (a slow write): a sender that slept 20 ms after each frame would add those up
    (0.5 s late by the last frame); on the absolute clock they never accumulate, nor does a
    busy loop's sleep overshoot (up to the 40 ms ahead)."""
    rec = Recorder(send_s=0.01)
    call = TelephonyCall(Start(SID, "CA", "AC"), rec, send_ahead_s=0.04)
    t_start = asyncio.get_running_loop().time()
    for _ in range(10):  # 1 s of audio in uneven chunks
        call.output.play(mulaw_chunk(b"\xff" * 799))
    call.output.play(mulaw_chunk(b"\xff" * 10))
    assert await call.output.drain(timeout=30)
    times = [t for t, m in rec.sent]
    assert len(times) == 50 and all(len(m.payload) == 160 for _, m in rec.sent)
    # Frame k is due at start + k * 20 ms - 40 ms: never earlier.
    late = [t - t_start - 0.02 * k for k, t in enumerate(times)]
    assert min(late) >= -0.04 - 0.001, late
    # No drift: the last frames are no later than the first ones. A slow machine makes every
    # frame late by about as much, so only the difference is checked (drift would be 0.4 s).
    drift = statistics.median(late[-10:]) - statistics.median(late[:10])
    assert drift < 0.2, (drift, late)
    lo, hi = late_gap_bounds(times)
    assert lo <= call.output.stats.late_frames <= hi and call.stats.frames_sent == 50
    await call.close()


async def test_late_frames_are_counted_when_the_loop_stalls():
    rec = Recorder(stall_at=5, stall_s=0.08)
    call = TelephonyCall(Start(SID, "CA", "AC"), rec, send_ahead_s=0.0)
    call.output.play(mulaw_chunk(b"\xff" * 1600))
    assert await call.output.drain(timeout=10)
    # The stall is one late frame (a 100 ms gap); the frames due meanwhile then go out at
    # once and are not late. A busy machine may add late frames of its own: they must be
    # counted too, and only they.
    lo, hi = late_gap_bounds([t for t, m in rec.sent])
    assert call.output.stats.late_frames >= 1 and lo <= call.output.stats.late_frames <= hi
    assert call.output.stats.max_gap_s >= 0.08
    await call.close()


async def test_clear_drops_unsent_audio_and_marks():
    rec = Recorder()
    call = TelephonyCall(Start(SID, "CA", "AC"), rec, send_ahead_s=0.0)
    call.output.play(mulaw_chunk(b"\xff" * 8000))
    end = call.output.mark("end")
    await rec.wait_sent(3)  # some of it has gone out
    n_before = len(rec.sent)
    await call.output.clear()
    assert await wait_confirmed(end, 1) is False  # never sent: cleared
    # Audio after a clear plays again from a fresh clock.
    call.output.play(mulaw_chunk(b"\xff" * 320))
    again = call.output.mark("again")
    assert await call.output.drain(timeout=5)
    # Nothing of the cleared audio, nor its mark, went out after the clear: the new audio
    # and its mark come right after it.
    kinds = [type(m).__name__ for _, m in rec.sent]
    assert kinds == ["OutboundMedia"] * n_before + ["Clear", "OutboundMedia", "OutboundMedia", "OutboundMark"], kinds
    assert rec.sent[-1][1].name == "again"
    call.deliver(Mark(SID, "again"))
    assert await wait_confirmed(again, 1) is True
    await call.close()
    assert await wait_confirmed(call.output.mark("never"), 0.1) is False


async def test_stop_with_a_call_in_progress():
    echo = Echo()
    async with running_bridge(echo, end_grace_s=0.5) as (bridge, port):
        ws = await call_in_progress(port)
        await asyncio.wait_for(bridge.stop(), 5)
        assert await wait_closed(ws) == 1001  # going away
        await asyncio.wait_for(echo.done.wait(), 2)


async def test_cancelled_serve_forever_ends_calls_as_server_shutdown():
    """SIGINT cancels `specvoice serve`'s serve_forever: a call in progress must end as
    server_shutdown (it once read caller_hangup: the connections were closed before the
    bridge knew it was stopping)."""
    echo = Echo()
    bridge = Bridge(BridgeConfig(host="127.0.0.1", port=0, max_calls=2, idle_timeout_s=5.0), echo,
                    BridgeTokens.of(TWILIO_TOKEN, BEARER), end_grace_s=0.5)
    port = await bridge.start()
    serving = asyncio.create_task(bridge.serve_forever())
    ws = await call_in_progress(port)
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)
    assert await wait_closed(ws) == 1001
    await asyncio.wait_for(echo.done.wait(), 2)
    assert [c.end_reason for c in echo.calls] == ["server_shutdown"]


def test_serve_refuses_to_start_without_credentials(monkeypatch, capsys):
    from demo.cli import main

    monkeypatch.delenv("TWILIO_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("SPECVOICE_BRIDGE_TOKEN", raising=False)
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "no token is configured" in err and "--insecure" in err
