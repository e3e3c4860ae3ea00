"""`specvoice serve`'s HTTP side on the real server (uvicorn, real sockets): Twilio's form POST
webhook and its signature, /metrics parsed by prometheus-client's own parser after a call,
who may open the page, /calls and the report pages. Cheap model stand-ins (callfakes); the
page with real models in real Chromium is tests/test_call_page.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
from urllib.parse import urlencode

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import InvalidStatus

from callfakes import TOKEN, FakeModels, RawCaller, rel_config, report_of, wait_for
from callsteps import answered_then_hung_up, one_answered_call
from pipeline.transports.telephony.auth import BridgeTokens
from pipeline.transports.web.agent_server import agent_server

pytestmark = pytest.mark.timeout(60)

TWILIO_TOKEN = "twilio-web-" + "z" * 20


def twilio_docs_signature(token: str, url: str, params: dict[str, str]) -> str:
    """As Twilio's documentation describes it, written out here (not the server's code): the
    full URL, then each POST parameter's name and value, sorted by name, concatenated; HMAC-
    SHA1 with the auth token as key; base64."""
    data = url + "".join(name + params[name] for name in sorted(params))
    return base64.b64encode(hmac.new(token.encode(), data.encode(), hashlib.sha1).digest()).decode()


@contextlib.asynccontextmanager
async def served(tmp_path, tokens=BridgeTokens.of(TWILIO_TOKEN, TOKEN), models=None, **bridge):
    from demo.report_html import render_html

    cfg = rel_config(tmp_path, **bridge)
    server = agent_server(cfg, tokens, models=models or FakeModels(), render_report=render_html, greeting=False,
                          preload=False)
    port = await server.start()
    try:
        yield cfg, server, port
    finally:
        await asyncio.wait_for(server.stop(), 20)


WEBHOOK = {"AccountSid": "AC0123", "ApiVersion": "2010-04-01", "CallSid": "CA77", "CallStatus": "ringing",
           "Called": "+15550199", "Caller": "+15550100", "Direction": "inbound", "From": "+15550100",
           "To": "+15550199"}


async def test_post_webhook_signed_as_twilio_documents_wrong_and_missing(tmp_path):
    async with served(tmp_path) as (_, server, port):
        base = f"http://127.0.0.1:{port}"
        signed_url = f"https://127.0.0.1:{port}/voice"  # what Twilio signs: the public URL it posted to
        body = urlencode(WEBHOOK)
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        good = twilio_docs_signature(TWILIO_TOKEN, signed_url, WEBHOOK)
        async with httpx.AsyncClient() as client:
            r = await client.post(base + "/voice", content=body, headers={**form, "X-Twilio-Signature": good})
            assert r.status_code == 200, r.text
            assert r.headers["content-type"].startswith("text/xml")
            # The TwiML connects the call to the stream, passing the form's CallSid and From on.
            assert f'<Stream url="wss://127.0.0.1:{port}/media-stream">' in r.text
            assert '<Parameter name="CallSid" value="CA77"/>' in r.text
            assert '<Parameter name="From" value="+15550100"/>' in r.text

            refused = {
                "wrong token": twilio_docs_signature("not-the-token", signed_url, WEBHOOK),
                # The parameters are signed: the same signature over a changed body is wrong...
                "tampered body": good,
                # ... and so is a signature over the URL alone.
                "URL only": twilio_docs_signature(TWILIO_TOKEN, signed_url, {}),
            }
            for why, signature in refused.items():
                sent = urlencode({**WEBHOOK, "From": "+15559999"}) if why == "tampered body" else body
                r = await client.post(base + "/voice", content=sent, headers={**form, "X-Twilio-Signature": signature})
                assert r.status_code == 403, (why, r.status_code)
                assert "<Connect>" not in r.text
            r = await client.post(base + "/voice", content=body, headers=form)
            assert r.status_code == 401 and "<Connect>" not in r.text
            # A query string is signed as part of the URL, with the POST parameters after it.
            good_q = twilio_docs_signature(TWILIO_TOKEN, signed_url + "?tenant=a", WEBHOOK)
            r = await client.post(base + "/voice?tenant=a", content=body, headers={**form, "X-Twilio-Signature": good_q})
            assert r.status_code == 200
            r = await client.post(base + "/voice?tenant=b", content=body, headers={**form, "X-Twilio-Signature": good_q})
            assert r.status_code == 403
            # The stream-ended action (POST too) is signed the same way.
            ended = {"CallSid": "CA77", "CallStatus": "in-progress"}
            sig = twilio_docs_signature(TWILIO_TOKEN, f"https://127.0.0.1:{port}/stream-ended", ended)
            r = await client.post(base + "/stream-ended", content=urlencode(ended),
                                  headers={**form, "X-Twilio-Signature": sig})
            assert r.status_code == 200 and "<Hangup/>" in r.text
            r = await client.post(base + "/stream-ended", content=urlencode(ended), headers=form)
            assert r.status_code == 401
    assert server.calls_total == 0  # a webhook answers with TwiML; it does not start a call


def sample(families: dict, family: str, sample_name: str, **labels) -> float:
    for s in families[family].samples:
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((family, sample_name, labels))


async def scrape(port: int, headers: dict | None = None) -> dict:
    async with httpx.AsyncClient() as client:
        r = await client.get(f"http://127.0.0.1:{port}/metrics", headers=headers or {})
    assert r.status_code == 200, r.status_code
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


async def test_metrics_after_a_call_parsed_by_prometheus_client(tmp_path):
    async with served(tmp_path, max_calls=1) as (cfg, server, port):
        before = await scrape(port)
        assert sample(before, "specvoice_turns", "specvoice_turns_total", transport="twilio") == 0
        c = await RawCaller(port).open()
        await wait_for(lambda: server.calls_total == 1, 10, "the call to start")
        live = await scrape(port)
        assert sample(live, "specvoice_calls_in_progress", "specvoice_calls_in_progress") == 1
        # A second caller while the one slot is taken: refused (503), and counted.
        with pytest.raises(InvalidStatus) as refused:
            await RawCaller(port).open()
        assert refused.value.response.status_code == 503
        await answered_then_hung_up(c)
        report = await report_of(cfg, c.call_sid)
        await wait_for(lambda: server.active_calls == 0, 10, "the slot to free")
        after = await scrape(port)
    turn = report["turns"][0]
    assert sample(after, "specvoice_calls", "specvoice_calls_total", transport="twilio") == 1
    assert sample(after, "specvoice_calls_refused", "specvoice_calls_refused_total", reason="busy") == 1
    assert sample(after, "specvoice_calls_in_progress", "specvoice_calls_in_progress") == 0
    assert sample(after, "specvoice_turns", "specvoice_turns_total", transport="twilio") == len(report["turns"]) == 1
    # Each histogram holds the turn's own figure from its report.
    for family, key in (("specvoice_voice_to_voice_seconds", "voice_to_voice"),
                        ("specvoice_first_sentence_seconds", "first_sentence_latency"),
                        ("specvoice_ttft_seconds", "ttft"), ("specvoice_stt_seconds", "stt_latency")):
        assert sample(after, family, family + "_count") == 1, family
        assert sample(after, family, family + "_sum") == pytest.approx(turn["metrics"][key], abs=1e-6), family
    # The scripted backend reports no LLM passes, so the LLM histograms stay empty (a turn
    # without figures adds no zero); the real engine's are checked in test_call_page.py.
    assert not (turn.get("llm") or {}).get("passes")
    assert sample(after, "specvoice_llm_tokens_per_pass", "specvoice_llm_tokens_per_pass_count") == 0
    assert sample(after, "specvoice_llm_tokens_per_second", "specvoice_llm_tokens_per_second_count") == 0


async def test_people_paths_need_the_token_off_loopback_and_never_show_it(tmp_path):
    # Behind a public URL (a proxy or tunnel in front), the page is reachable from anywhere.
    async with served(tmp_path, public_url="https://voice.example.com") as (_, server, port):
        base = f"http://127.0.0.1:{port}"
        basic = "Basic " + base64.b64encode(f"me:{TOKEN}".encode()).decode()
        async with httpx.AsyncClient() as client:
            for path in ("/", "/calls", "/metrics"):
                r = await client.get(base + path)
                assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic"), path
                r = await client.get(base + path, headers={"Authorization": "Basic " + base64.b64encode(
                    b"me:wrong").decode()})
                assert r.status_code == 401, path
                for good in (basic, f"Bearer {TOKEN}"):
                    r = await client.get(base + path, headers={"Authorization": good})
                    assert r.status_code == 200, (path, good[:6])
                    assert TOKEN not in r.text and TWILIO_TOKEN not in r.text
            # The page's call socket too: refused without credentials, before any call starts.
            from websockets.asyncio.client import connect

            with pytest.raises(InvalidStatus) as info:
                async with connect(f"ws://127.0.0.1:{port}/call"):
                    pass
            assert info.value.response.status_code == 401
            assert (await client.get(base + "/health")).status_code == 200  # health stays open
    assert server.calls_total == 0 and server.active_calls == 0
    # On loopback with no public URL, a laptop's own browser needs nothing.
    async with served(tmp_path) as (_, _, port):
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{port}/")
            assert r.status_code == 200 and 'id="call"' in r.text
            assert "default-src 'none'" in r.headers["content-security-policy"]


async def raw_get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_calls_page_lists_the_call_and_links_its_report(tmp_path):
    async with served(tmp_path) as (cfg, _, port):
        c, _ = await one_answered_call(port, cfg)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            listing = (await client.get("/calls", headers={"Accept": "application/json"})).json()["calls"]
            assert [x["call_id"] for x in listing] == [c.call_sid]
            name = listing[0]["name"]
            assert listing[0]["turns"] == 1 and listing[0]["recording"] is False
            page = await client.get("/calls")
            assert f'href="/calls/{name}"' in page.text
            report = await client.get(f"/calls/{name}")
            assert report.status_code == 200 and c.call_sid in report.text and 'class="waterfall"' in report.text
            assert "<audio" not in report.text  # a phone call has no recording here
            assert json.loads((await client.get(f"/calls/{name}.json")).text)["call_id"] == c.call_sid
            for bad in ("..", "%2e%2e", "..%2Freports", "%2e%2e%2f%2e%2e%2fetc%2fpasswd", "nope", ".hidden"):
                # Sent raw: httpx would resolve "/calls/.." to "/" itself.
                assert (await raw_get(port, f"/calls/{bad}")).startswith(b"HTTP/1.1 404"), bad
            assert (await client.get(f"/calls/{name}/recording.wav")).status_code == 404


async def test_browser_call_protocol_and_hostile_messages(tmp_path):
    """The page's WebSocket (/call) spoken by a plain client: ready, PCM in, the agent's PCM
    and marks out (echoed back as played), the call's events and turn figures, hang-up, the
    report link; junk and oversized messages never take the server down."""
    import numpy as np
    from websockets.asyncio.client import connect

    tone = (0.3 * np.sin(2 * np.pi * 300 * np.arange(16000) / 16000) * 32767).astype("<i2")
    silence = np.zeros(320, "<i2").tobytes()
    async with served(tmp_path) as (cfg, server, port):
        async with connect(f"ws://127.0.0.1:{port}/call", max_size=None) as ws:
            ready = json.loads(await ws.recv())
            assert ready["type"] == "ready" and ready["sample_rate"] == 16000
            for junk in ("{not json", json.dumps({"type": "played"}), json.dumps([1, 2]), json.dumps({"type": 7})):
                await ws.send(junk)
            for i in range(0, len(tone) // 2, 320):  # half a second of tone, 20 ms at a time
                await ws.send(tone[i:i + 320].tobytes())
            seen: dict[str, list] = {"audio": [], "event": [], "turn": [], "mark": []}

            async def feed_silence_until(done) -> None:
                while not done():
                    await ws.send(silence)
                    with contextlib.suppress(TimeoutError):
                        raw = await asyncio.wait_for(ws.recv(), 0.02)
                        if isinstance(raw, bytes):
                            seen["audio"].append(len(raw))
                            continue
                        message = json.loads(raw)
                        seen.setdefault(message["type"], []).append(message)
                        if message["type"] == "mark":  # "played" at once: this client has no speaker
                            await ws.send(json.dumps({"type": "played", "mark": message["name"]}))

            await asyncio.wait_for(feed_silence_until(lambda: seen["turn"]), 30)
            await ws.send(json.dumps({"type": "hangup"}))
            ended = None
            async for raw in ws:
                if isinstance(raw, str) and json.loads(raw)["type"] == "ended":
                    ended = json.loads(raw)
        kinds = [e["kind"] for e in seen["event"]]
        assert "transcript" in kinds and "sentence" in kinds and "heard" in kinds, kinds
        assert sum(seen["audio"]) > 0 and all(n % 2 == 0 for n in seen["audio"])
        entry = seen["turn"][0]["entry"]
        assert entry["user_text"] == "What are your hours?" and "voice_to_voice" in entry["metrics"]
        assert ended is not None and ended["report"].startswith("/calls/")
        name = ended["report"].removeprefix("/calls/")
        assert (tmp_path / "reports" / f"{name}.json").is_file()
        assert (tmp_path / "reports" / f"{name}.wav").is_file()
        # An audio message over a second long ends that call as a protocol error; the server goes on.
        async with connect(f"ws://127.0.0.1:{port}/call", max_size=None) as ws:
            await ws.recv()
            await ws.send(b"\x00" * (16000 * 2 + 2))
            with contextlib.suppress(Exception):
                async for _ in ws:
                    pass
            assert ws.close_code == 1008
        await wait_for(lambda: server.active_calls == 0, 10, "both calls to end")
        reasons = sorted(json.loads(p.read_text())["end_reason"] for p in (tmp_path / "reports").glob("*.json"))
        assert reasons == ["caller_hangup", "protocol_error"], reasons
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/health")).json()["calls_active"] == 0


def test_recording_places_each_side_by_its_clock():
    """Both sides on one clock: a piece goes where its time says, a piece that would overlap
    the one before on its track (clock jitter) follows it instead, and the file starts at
    the report's t0, so a timeline time is a place in the recording."""
    import numpy as np

    from pipeline.transports.recording import CallRecording

    rec = CallRecording(16000, t0=100.0)
    rec.caller(np.full(320, 1000, np.int16), 100.0)
    rec.caller(np.full(320, 2000, np.int16), 100.015)  # 5 ms early: follows the first piece
    rec.caller(np.full(320, 3000, np.int16), 101.0)  # after a gap: where its time says
    rec.agent(np.full(320, 4000, np.int16), 100.5)
    out = rec.stereo()
    assert out.shape == (16000 + 320, 2)
    assert (out[:320, 0] == 1000).all() and (out[320:640, 0] == 2000).all() and (out[640:16000, 0] == 0).all()
    assert (out[16000:, 0] == 3000).all()
    assert (out[8000:8320, 1] == 4000).all() and np.count_nonzero(out[:, 1]) == 320
    # From the report's t0, 0.5 s later: everything moves 8000 samples earlier.
    assert (rec.stereo(start_t=100.5)[:320, 1] == 4000).all()


async def test_phone_calls_are_recorded_only_when_the_config_says_all(tmp_path):
    """[report] record: "browser" (the default) records the page's calls, not phone calls;
    "all" records phone calls too, beside their reports, and the report page plays them."""
    for record, expected in (("browser", False), ("all", True)):
        folder = tmp_path / record
        cfg = rel_config(folder)
        cfg = cfg.model_copy(update={"report": cfg.report.model_copy(update={"record": record})})
        from demo.report_html import render_html

        server = agent_server(cfg, BridgeTokens.of(bearer_token=TOKEN), models=FakeModels(),
                              render_report=render_html, greeting=False, preload=False)
        port = await server.start()
        try:
            c, _ = await one_answered_call(port, cfg)
            await wait_for(lambda: server.active_calls == 0, 10, "the call to end")
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                name = (await client.get("/calls", headers={"Accept": "application/json"})).json()["calls"][0]["name"]
                page = (await client.get(f"/calls/{name}")).text
        finally:
            await asyncio.wait_for(server.stop(), 20)
        wav = folder / "reports" / f"{name}.wav"
        assert wav.is_file() is expected and ("<audio" in page) is expected, record
        if expected:
            import numpy as np

            from voice.wav import read_wav

            stereo, rate = read_wav(wav, sample_rate=None, mono=False)
            assert rate == 8000 and stereo.shape[1] == 2
            assert np.abs(stereo[:, 0]).max() > 0.05 and np.abs(stereo[:, 1]).max() > 0.05  # the tone, both ways
