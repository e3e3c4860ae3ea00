"""Hostile input on the bridge's WebSocket, with the real telephony adapter and pipeline
behind it (models stood in by callfakes). Each case gets a clear log line and a closed
or ignored connection; never a crash, never a leak (tasks, threads, call slots), and
the bridge answers the next call normally. Reports never land outside their folder.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import time
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from callfakes import (
    FakeModels,
    RawCaller,
    a_good_call,
    agent_bridge,
    assert_released,
    auth,
    rel_config,
    report_of,
    reports,
    snapshot,
    tone_mulaw,
    url,
    wait_for,
)
from callsteps import answered_then_hung_up
from pipeline.transports.telephony.protocol import Media, Start, encode_event

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def served(tmp_path, caplog):
    """(cfg, bridge, port, models) with a leak check and a good call at the end."""
    caplog.set_level(logging.INFO)
    cfg = rel_config(tmp_path, max_message_bytes=64 * 1024, idle_timeout_s=3.0)
    models = FakeModels()
    async with agent_bridge(cfg, models) as (bridge, port, handler):
        before = snapshot()
        yield cfg, bridge, port, models
        await a_good_call(port, cfg)
        await assert_released(before)
        await wait_for(lambda: bridge.active_calls == 0 and not bridge.calls, 5, "all calls to end")


async def closed_with(ws, timeout: float = 5.0) -> int | None:
    try:
        async with asyncio.timeout(timeout):
            async for _ in ws:
                pass
    except (ConnectionClosed, TimeoutError):
        pass
    return ws.close_code


async def closed_as_protocol_error(cfg, c: RawCaller, code: int, case: object = None) -> dict:
    """The bridge closed the call with `code`, and the call's report (returned) says it
    ended on a protocol error. `case`: what a failure names."""
    assert await c.wait_closed() == code, case
    data = await report_of(cfg, c.call_sid)
    assert data["end_reason"] == "protocol_error"
    return data


def start_msg(sid: str = "MZhostile", call_sid: str = "CAhostile", custom: dict | None = None) -> str:
    return encode_event(Start(sid, call_sid, "AC1", custom or {}))


async def test_malformed_json_closes_1007(served, caplog):
    cfg, bridge, port, _ = served
    for junk in ["{not json", "", "[1, 2", "\x00\x01", '{"event": "media"' + "}" * 3, "null", "[]", '"start"']:
        async with connect(url(port), additional_headers=auth()) as ws:
            await ws.send(junk)
            code = await closed_with(ws)
            assert code in (1007, 1008), (junk, code)
    assert "protocol error (json)" in caplog.text and "protocol error (type)" in caplog.text


async def test_malformed_json_mid_call_ends_call_with_report(served, caplog):
    cfg, bridge, port, _ = served
    c = await RawCaller(port).open()
    await c.say()
    assert await c.wait_reply()
    await c.ws.send('{"event": "media", "media": {"payload": ')
    data = await closed_as_protocol_error(cfg, c, 1007)
    assert len(data["turns"]) == 1
    assert f"call {c.sid}: protocol error (json)" in caplog.text


async def test_unknown_events_are_ignored_and_logged(served, caplog):
    cfg, bridge, port, _ = served
    c = await RawCaller(port).open()
    for event in ["telepathy", "clear", "START", "x" * 500]:
        await c.ws.send(json.dumps({"event": event, "streamSid": c.sid}))
    await answered_then_hung_up(c)  # the call went on
    assert "ignoring unknown event 'telepathy'" in caplog.text
    assert "x" * 100 not in caplog.text  # logged names are bounded


async def test_media_before_start_is_ignored_with_one_log_line(served, caplog):
    cfg, bridge, port, models = served
    c = await RawCaller(port).open(start=False)
    for _ in range(50):
        await c.ws.send(encode_event(Media(c.sid, tone_mulaw(0.02))))
    await c.ws.send(start_msg(c.sid, c.call_sid))
    await answered_then_hung_up(c)
    lines = [r for r in caplog.records if "media before start, ignored" in r.getMessage()]
    assert len(lines) == 1  # one line, not fifty
    assert models.stt.calls == 1  # the audio before start was not heard as speech


async def test_second_start_closes_1008_and_report_written(served, caplog):
    cfg, bridge, port, _ = served
    c = await RawCaller(port).open()
    await c.ws.send(start_msg("MZother", "CAother"))
    await closed_as_protocol_error(cfg, c, 1008)
    assert "CAother" not in reports(cfg)  # the second start never became a call
    assert "second start message, closing" in caplog.text


BASE64_CASES = [
    ("***not base64***", 1007, "base64"),
    ("QUJD\nREVG", 1007, "base64"),  # whitespace inside
    ("QUJ", 1007, "base64"),  # bad padding
    ("é" * 8, 1007, "base64"),  # not ASCII
    (12345, 1008, "field"),
    (None, 1008, "field"),
    ({"a": 1}, 1008, "field"),
]


async def test_wrong_base64_payloads(served, caplog):
    cfg, bridge, port, _ = served
    for payload, code, kind in BASE64_CASES:
        caplog.clear()
        c = await RawCaller(port).open()
        await c.ws.send(json.dumps({"event": "media", "streamSid": c.sid, "media": {"payload": payload}}))
        await closed_as_protocol_error(cfg, c, code, payload)
        assert f"protocol error ({kind})" in caplog.text, payload
    # Valid base64 of any length is fine: 60 bytes of 0xff.
    c = await RawCaller(port).open()
    await c.ws.send(json.dumps({"event": "media", "streamSid": c.sid, "media": {"payload": "////" * 20}}))
    assert await answered_then_hung_up(c) == 1000


async def test_oversized_base64_refused_before_decoding(served, caplog):
    cfg, bridge, port, _ = served
    c = await RawCaller(port).open()
    big = base64.b64encode(b"\xff" * (40 * 1024)).decode()  # 40 KB decoded > 16 KB media limit, < 64 KB message
    await c.ws.send(json.dumps({"event": "media", "streamSid": c.sid, "media": {"payload": big}}))
    assert await c.wait_closed() == 1008
    assert "protocol error (oversized)" in caplog.text


async def test_odd_length_payloads_are_decoded(served):
    """mu-law is one byte a sample: odd lengths are legal and must not break the resampler."""
    cfg, bridge, port, models = served
    c = await RawCaller(port).open()
    speech = tone_mulaw(0.5)
    await c.send_audio(speech, frame_bytes=161)
    await c.send_audio(b"\xff" * 6001, frame_bytes=333)
    await c.ws.send(json.dumps({"event": "media", "streamSid": c.sid, "media": {"payload": ""}}))  # empty
    await c.ws.send(encode_event(Media(c.sid, b"\x00")))  # one sample
    assert await c.wait_reply()
    await c.stop()
    await c.wait_closed()
    data = await report_of(cfg, c.call_sid)
    assert len(data["turns"]) == 1 and data["error"] is None


async def test_message_of_several_megabytes_closes_1009(served, caplog):
    cfg, bridge, port, _ = served
    c = await RawCaller(port).open()
    await c.say()
    assert await c.wait_reply()
    blob = json.dumps({"event": "media", "streamSid": c.sid, "media": {"payload": "A" * (4 * 2 ** 20)}})
    try:
        await c.ws.send(blob)
    except ConnectionClosed:
        pass
    data = await closed_as_protocol_error(cfg, c, 1009)  # message too big
    assert len(data["turns"]) == 1
    assert f"call {c.sid}: connection closed with 1009 (frame exceeds limit of 65536 bytes)" in caplog.text


async def test_binary_frame_closes_1003(served, caplog):
    cfg, bridge, port, _ = served
    c = await RawCaller(port).open()
    await c.ws.send(b"\x00" * 100)
    assert await c.wait_closed() == 1003
    assert "binary frame, closing" in caplog.text


async def test_flood_of_messages_is_bounded(served, caplog):
    """Thousands of messages as fast as the socket takes them: inbound is bounded (oldest
    dropped), memory does not grow with the flood, the call and the bridge survive."""
    import psutil

    cfg, bridge, port, _ = served
    c = await RawCaller(port).open()
    rss0 = psutil.Process().memory_info().rss
    frame = encode_event(Media(c.sid, b"\xff" * 160))
    t = time.monotonic()
    for i in range(20000):
        await c.ws.send(frame)
        if i % 2000 == 0:
            await c.ws.send(json.dumps({"event": "dtmf", "streamSid": c.sid, "dtmf": {"digit": "5"}}))
        if i % 100 == 0:
            # This client shares the bridge's event loop, and send() does not yield while the
            # socket takes data: let the bridge run now and then, as it would against a peer
            # elsewhere; else a slow machine starves it past its idle timeout.
            await asyncio.sleep(0)
    flood_s = time.monotonic() - t
    await answered_then_hung_up(c, 20)
    grown = (psutil.Process().memory_info().rss - rss0) / 2 ** 20
    assert grown < 150, f"RSS grew {grown:.0f} MB during a flood of 20000 messages ({flood_s:.1f} s)"
    data = await report_of(cfg, c.call_sid)
    assert len(data["turns"]) >= 1


async def test_slowloris_handshake_is_cut_off(served, caplog):
    """Half an HTTP upgrade request, a byte at a time: the handshake timeout closes it and
    it never holds a call slot."""
    cfg, bridge, port, _ = served
    loop = asyncio.get_running_loop()

    async def slow_peer(s: socket.socket) -> bool:
        """Trickles a byte every 0.1 s until the server answers or hangs up: True if it
        did, False if the peer was still connected long after the handshake timeout
        (2 s here; 10 s more only bounds a peer that is never cut off)."""
        deadline = time.monotonic() + cfg.bridge.handshake_timeout_s + 10
        try:
            while time.monotonic() < deadline:
                await loop.sock_sendall(s, b"X")
                try:
                    data = await asyncio.wait_for(loop.sock_recv(s, 1024), 0.1)
                except TimeoutError:
                    continue  # no answer yet: the next byte
                return data == b"" or data.startswith(b"HTTP/1.1 4")
            return False
        except (ConnectionError, OSError):
            return True
        finally:
            s.close()

    peers = []
    for _ in range(5):  # more slow peers than max_calls would allow if they held slots
        s = socket.create_connection(("127.0.0.1", port))
        s.setblocking(False)
        await loop.sock_sendall(s, b"GET /media-stream HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        peers.append(asyncio.create_task(slow_peer(s)))
    # Meanwhile a real call is served.
    c = await RawCaller(port).open()
    await answered_then_hung_up(c)
    assert await asyncio.gather(*peers) == [True] * len(peers)
    assert bridge.active_calls == 0


async def test_upgrade_then_silence_does_not_hold_a_slot_forever(served, caplog):
    """Upgraded, but never a `start`: the idle timeout closes it."""
    cfg, bridge, port, _ = served
    ws = await connect(url(port), additional_headers=auth())
    assert bridge.active_calls == 1
    assert await closed_with(ws, cfg.bridge.idle_timeout_s + 5) == 1000
    await wait_for(lambda: bridge.active_calls == 0, 5, "the slot to free")
    assert "no message for" in caplog.text


HOSTILE_IDS = ["../../etc/passwd", "a/b", "..\\x", "bad\x00id", "/abs/path", "..", ".", "", "CA" + "9" * 1000,
               "con", "~root", "%2e%2e%2fescape", "x" * 1025]


async def test_call_ids_with_path_characters_stay_in_the_report_folder(served, tmp_path, caplog):
    cfg, bridge, port, _ = served
    folder = Path(cfg.report.dir).resolve()
    outside_before = sorted(p for p in tmp_path.rglob("*") if folder not in p.resolve().parents and p.resolve() != folder)
    placed = 0
    for hostile in HOSTILE_IDS:
        for field in ("callSid", "streamSid", "customParameters"):
            sid, call_sid, custom = "MZok", "CAok" + field, {}
            if field == "callSid":
                call_sid = hostile
            elif field == "streamSid":
                sid, call_sid = hostile, ""  # the call id then falls back to the stream id
            else:
                custom = {hostile[:1024] or "k": hostile[:1024], "CallSid": hostile[:1024]}
            ws = await connect(url(port), additional_headers=auth())
            await ws.send(start_msg(sid, call_sid, custom))
            await ws.send(encode_event(Media(sid, tone_mulaw(0.1))))
            await ws.send(json.dumps({"event": "stop", "streamSid": sid}))
            code = await closed_with(ws)
            assert code in (1000, 1008), (hostile, field, code)  # a call, or refused (too long, missing)
            placed += code == 1000
    await wait_for(lambda: bridge.active_calls == 0 and not bridge.calls, 10, "calls to end")
    await wait_for(lambda: len(list(folder.glob("*.json"))) >= placed, 10, "reports")
    # Nothing was written anywhere but directly inside the report folder...
    outside_after = sorted(p for p in tmp_path.rglob("*") if folder not in p.resolve().parents
                           and p.resolve() != folder)
    assert outside_after == outside_before
    names = sorted(p.name for p in folder.iterdir())
    for name in names:
        p = folder / name
        assert p.is_file() and not p.is_symlink() and not name.startswith("."), name  # no temp file left
        assert all(ch.isalnum() or ch in "_.-" for ch in name), name
    # ... every call that was placed has its own report, its id kept verbatim inside.
    ids = {d["call_id"] for d in reports(cfg).values()}
    assert len(names) == placed
    assert "../../etc/passwd" in ids and "a/b" in ids and "bad\x00id" in ids
    assert "protocol error" in caplog.text  # the over-long ids were refused with a reason
