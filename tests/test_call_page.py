"""The call page in real headless Chromium against the real server and real models.

Chromium's microphone is a WAV file (a question spoken by Piper after a few seconds of
silence: `--use-file-for-fake-audio-capture`); the test presses Call with a real mouse event
over the DevTools protocol, and waits on what the page itself saw: the agent's greeting
and answer played by its AudioWorklet (each sentence's mark echoed only once the page's
player has output the audio before it, so the server's "heard" events prove playback in
the page), the caller's transcript, the agent's sentences, the turn's latency bars. Then
it hangs up and checks that the server wrote the call's report and stereo recording,
that the page links the report page (which plays the recording), and that /metrics
counted the turn. Waits are on events; timeouts only guard against hangs.

SPECVOICE_SCREENSHOT=docs/call-page.png keeps the screenshot taken during the call.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.chromium import CDP, CHROMIUM, chromium, open_page
from conftest import require_model
from pipeline.transports.telephony.auth import BridgeTokens
from test_report_html import png_pixels

pytestmark = [pytest.mark.models, pytest.mark.slow, pytest.mark.timeout(600)]

SMALL = "smollm2-135m-instruct"
QUESTION = "What time do you open on Saturday?"
LEAD_S = 6.0  # silence before the question: the greeting plays meanwhile
TAIL_S = 90.0  # silence after it (the file is read once): the answer plays meanwhile


def page_config(tmp_path: Path):
    from pipeline.config import load_config

    cfg = load_config("test")
    return cfg.model_copy(update={
        "llm": cfg.llm.model_copy(update={"target": SMALL, "draft": None, "drafter": "ngram", "dtype": "int8",
                                          "gamma": 4, "max_new_tokens": 40, "threads": 1, "temperature": 0.0}),
        "report": cfg.report.model_copy(update={"dir": str(tmp_path / "reports")}),
        "bridge": cfg.bridge.model_copy(update={"host": "127.0.0.1", "port": 0, "idle_timeout_s": 60.0}),
        "mqtt": cfg.mqtt.model_copy(update={"enabled": False}),
    })


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    for name in (SMALL, "whisper-tiny.en", "piper-joe-medium"):
        require_model(name)
    if CHROMIUM is None:
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    from pipeline.agent import AgentModels

    return AgentModels.load(page_config(tmp_path_factory.mktemp("cfg")), threads=1)


def spoken_wav(models, path: Path) -> Path:
    """The caller's microphone: silence, the question in Piper's voice, a long silence."""
    from voice.audio import resample, to_float32
    from voice.wav import write_wav

    chunks = list(models.tts.synthesize(QUESTION))
    pcm = np.concatenate([to_float32(c.pcm) for c in chunks])
    pcm = resample(pcm, chunks[0].sample_rate, 16000)
    silence = lambda s: np.zeros(int(16000 * s), np.float32)  # noqa: E731
    return write_wav(path, np.concatenate([silence(LEAD_S), 0.8 * pcm, silence(TAIL_S)]), 16000)


async def until(cdp: CDP, condition: str, what: str, timeout_s: float = 240) -> None:
    """Wait, inside the page, until the JS `condition` holds; fails with `what` if the hang
    guard runs out."""
    assert await cdp.until(condition, timeout_s) is True, what


async def state(cdp: CDP) -> dict:
    return json.loads(await cdp.evaluate("JSON.stringify(window.specvoice)"))


async def test_call_from_the_page_in_headless_chromium(models, tmp_path):
    from demo.report_html import render_html
    from pipeline.transports.web.agent_server import agent_server

    cfg = page_config(tmp_path)
    server = agent_server(cfg, BridgeTokens.of(bearer_token="page-test-token"), models=models,
                          render_report=render_html, greeting=True)
    port = await server.start()
    wav = spoken_wav(models, tmp_path / "question.wav")
    base = f"http://127.0.0.1:{port}"
    try:
        async with chromium(wav, profile=tmp_path / "profile") as devtools, open_page(devtools, base + "/") as cdp:
            assert (await state(cdp))["state"] == "idle"
            await cdp.click("#call")
            await until(cdp, "window.specvoice.state === 'in-call'", "the call to be answered")
            ev = "window.specvoice.events"
            # The greeting played in the page (its mark came back from the page's player), unless
            # the question came while it was still playing: then the agent stopped it (a clear
            # reached the page). Either way its audio arrived and was played.
            await until(cdp, f"{ev}.some(e => e.kind === 'heard' && e.turn === -1) || "
                             f"{ev}.some(e => e.kind === 'barge_in' && e.turn === -1)", "the greeting to play")
            await until(cdp, f"{ev}.some(e => e.kind === 'transcript' && e.turn === 0)", "the caller's transcript")
            await until(cdp, f"{ev}.some(e => e.kind === 'heard' && e.turn === 0)", "the answer to play in the page")
            await until(cdp, "document.querySelector('#turns .turn[data-turn=\"0\"][data-final=\"1\"]')",
                        "the turn's figures")
            s = await state(cdp)
            dom = json.loads(await cdp.evaluate("""JSON.stringify({
                caller: [...document.querySelectorAll('#transcript li.caller')].map(e => e.textContent),
                agent: [...document.querySelectorAll('#transcript li.agent')].map(e => e.textContent),
                heard: [...document.querySelectorAll('#transcript li.agent .s.heard')].map(e => e.textContent),
                bars: Object.fromEntries([...document.querySelectorAll('#turns .turn[data-turn="0"] .bar')].map(b =>
                    [b.dataset.metric, [b.dataset.value, b.dataset.exact, b.querySelector('.fill').getBoundingClientRect().width]])),
            })"""))
            shot = base64.b64decode((await cdp.call("Page.captureScreenshot", format="png"))["data"])
            await cdp.click("#hangup")
            await until(cdp, "window.specvoice.state === 'ended' && window.specvoice.report", "the report link")
            end = await state(cdp)
            link = json.loads(await cdp.evaluate(
                "JSON.stringify([document.querySelector('#report-link').getAttribute('href'), "
                "document.querySelector('#report').hidden])"))
            errors = cdp.errors()
        async with httpx.AsyncClient(base_url=base) as client:
            report_page = await client.get(end["report"])
            recording = await client.get(end["report"] + "/recording.wav")
            scraped = (await client.get("/metrics")).text
    finally:
        await asyncio.wait_for(server.stop(), 60)

    # The page heard the agent: audio arrived, its player output audible samples, marks came back.
    assert s["audio"]["received"] > 16000 and s["audio"]["audible"] > 8000, s["audio"]
    assert s["marksPlayed"] >= 2
    # The page's own voice to voice (last voiced microphone frame -> first agent sample out of
    # its player) was taken for the answer, and not for the greeting (no one had spoken yet).
    assert len(s["pageV2V"]) == 1 and s["pageV2V"][0] > 0, s["pageV2V"]
    # What the page showed: the caller's words, the agent's answer, the turn's bars.
    words = {w.strip("?.,!").lower() for w in dom["caller"][0].split()}
    assert {"saturday", "open"} <= words, dom["caller"]
    answer = [e for e in s["events"] if e["kind"] == "sentence" and e["turn"] == 0]
    assert answer and dom["heard"], dom
    assert any(e["text"] in " ".join(dom["agent"]) for e in answer)
    for metric in ("stt_latency", "ttft", "first_sentence_latency", "voice_to_voice"):
        value, exact, width = dom["bars"][metric]
        assert exact == "1" and float(value) > 0 and width > 0, (metric, dom["bars"][metric])
    width, height, pixels = png_pixels(shot)
    assert width > 500 and height > 500 and len(set(pixels)) > 20
    if os.environ.get("SPECVOICE_SCREENSHOT"):
        Path(os.environ["SPECVOICE_SCREENSHOT"]).write_bytes(shot)
    assert errors == [], errors

    # The server wrote the call's report, with the page's figures in it, and its recording.
    reports = list((tmp_path / "reports").glob("*.json"))
    assert len(reports) == 1
    report = json.loads(reports[0].read_text())
    assert report["call_id"] == end["callId"] and report["end_reason"] == "caller_hangup"
    turn0 = report["turns"][0]
    assert turn0["user_text"] == dom["caller"][0]
    assert float(dom["bars"]["voice_to_voice"][0]) == turn0["metrics"]["voice_to_voice"]
    assert link == [end["report"], False] and end["report"] == f"/calls/{reports[0].stem}"
    assert report_page.status_code == 200 and "<audio" in report_page.text
    assert f'src="{end["report"]}/recording.wav"' in report_page.text and "data-seek=" in report_page.text
    assert recording.status_code == 200 and recording.headers["content-type"] == "audio/wav"
    from voice.wav import read_wav

    stereo, rate = read_wav(reports[0].with_suffix(".wav"), sample_rate=None, mono=False)
    assert rate == 16000 and stereo.shape[1] == 2
    caller_rms, agent_rms = np.sqrt(np.mean(stereo.astype(np.float64) ** 2, axis=0))
    assert caller_rms > 0.001 and agent_rms > 0.001, (caller_rms, agent_rms)
    # The recording starts at the report's clock: the caller's question is where the turn says.
    start = turn0["timeline"]["speech_start"]
    around = stereo[int(16000 * start): int(16000 * (start + 1.0)), 0]
    assert np.abs(around).max() > 0.05

    # /metrics counted the browser turn, with the real engine's LLM figures.
    families = {f.name: f for f in text_string_to_metric_families(scraped)}

    def value(family: str, name: str, **labels) -> float:
        return next(x.value for x in families[family].samples
                    if x.name == name and all(x.labels.get(k) == v for k, v in labels.items()))

    assert value("specvoice_turns", "specvoice_turns_total", transport="browser") == len(report["turns"])
    assert value("specvoice_calls", "specvoice_calls_total", transport="browser") == 1
    assert value("specvoice_llm_tokens_per_pass", "specvoice_llm_tokens_per_pass_count") == len(report["turns"])
    assert value("specvoice_llm_tokens_per_pass", "specvoice_llm_tokens_per_pass_sum") == pytest.approx(
        sum(t["llm"]["tokens_per_pass"] for t in report["turns"]))
    assert value("specvoice_voice_to_voice_seconds", "specvoice_voice_to_voice_seconds_count") == len(report["turns"])


async def test_talking_over_the_agent_stops_its_audio_in_the_page(models, tmp_path):
    """Barge-in through the page, with cheap stand-ins behind the server (an energy VAD, a
    scripted answer spoken as 20 s of tone) and a microphone that says a phrase every 4 s
    (Chromium loops the file): whatever the machine's speed, a phrase comes while the long
    answer plays. The server's clear reaches the page, which had received only part of
    the answer, and the call reports the turn as interrupted."""
    from callfakes import FakeModels, ToneTTS
    from demo.report_html import render_html
    from pipeline.transports.web.agent_server import agent_server
    from voice.audio import resample, to_float32
    from voice.wav import write_wav

    chunks = list(models.tts.synthesize("Excuse me, one question."))
    phrase = resample(np.concatenate([to_float32(c.pcm) for c in chunks]), chunks[0].sample_rate, 16000)
    gap = np.zeros(int(16000 * max(0.5, 4.0 - len(phrase) / 16000)), np.float32)
    wav = write_wav(tmp_path / "again-and-again.wav", np.concatenate([0.8 * phrase, gap]), 16000)

    answer_s = 20.0  # two sentences of 10 s of tone
    fakes = FakeModels(tts=ToneTTS(chunks=100, chunk_s=0.1))
    cfg = page_config(tmp_path)
    server = agent_server(cfg, BridgeTokens.of(bearer_token="page-test-token"), models=fakes,
                          render_report=render_html, greeting=False, preload=False)
    port = await server.start()
    try:
        async with chromium(wav, loop=True, profile=tmp_path / "profile") as devtools, \
                open_page(devtools, f"http://127.0.0.1:{port}/") as cdp:
            await cdp.click("#call")
            ev = "window.specvoice.events"
            await until(cdp, f"{ev}.some(e => e.kind === 'barge_in' && e.turn === 0) && window.specvoice.clears >= 1",
                        "the caller to talk over the first answer")
            s = await state(cdp)
            await cdp.click("#hangup")
            await until(cdp, "window.specvoice.state === 'ended' && window.specvoice.report", "the report link")
            errors = cdp.errors()
    finally:
        await asyncio.wait_for(server.stop(), 60)
    assert errors == [], errors
    first_clear = s["clearLog"][0]
    # Some of the answer had come and been played, and it stopped far short of its 20 s.
    assert 0 < first_clear["received"] < 0.5 * answer_s * 16000, first_clear
    heard = [e["text"] for e in s["events"] if e["kind"] == "heard" and e["turn"] == 0]
    report = json.loads(next((tmp_path / "reports").glob("*.json")).read_text())
    turn0 = report["turns"][0]
    assert turn0["interrupted"] is True and turn0["agent_text"] == "Hello. We are open nine to five."
    assert "We are open nine to five." not in heard and turn0["agent_text_heard"] != turn0["agent_text"]
