"""End to end over a real WebSocket: the simulated caller dials the bridge (bearer token)
exactly as Twilio would; the agent (real Whisper tiny.en, SmolLM2-135M greedy, Piper)
answers. Models load once for the module."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from callfakes import wait_for
from conftest import require_models
from pipeline.config import load_config
from pipeline.report import load_report

SMALL = "smollm2-135m-instruct"
REPO = Path(__file__).resolve().parents[1]


def _present() -> bool:
    from modelstore import is_present

    return all(is_present(n) for n in (SMALL, "whisper-tiny.en", "piper-joe-medium"))


needs_models = pytest.mark.skipif(not require_models() and not _present(),
                                  reason="needs smollm2-135m-instruct, whisper-tiny.en, piper-joe-medium")


def e2e_config(tmp_path: Path, max_new_tokens: int = 40):
    cfg = load_config("test")
    return cfg.model_copy(update={
        "llm": cfg.llm.model_copy(update={"target": SMALL, "draft": None, "drafter": "ngram", "dtype": "int8",
                                          "gamma": 4, "max_new_tokens": max_new_tokens, "threads": 1,
                                          "temperature": 0.0}),
        "report": cfg.report.model_copy(update={"dir": str(tmp_path / "reports")}),
    })


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not require_models() and not _present():
        pytest.skip("models not pulled")
    from pipeline.agent import AgentModels

    return AgentModels.load(e2e_config(tmp_path_factory.mktemp("cfg")), threads=1)


def _similarity(a: str, b: str) -> float:
    """How alike two texts read, 0..1 (difflib ratio over lower-case letters, digits, spaces)."""
    import difflib
    import re

    def norm(t: str) -> str:
        return " ".join(re.sub(r"[^a-z0-9 ]", " ", t.lower()).split())

    return difflib.SequenceMatcher(None, norm(a), norm(b)).ratio()


def _words(text: str) -> set[str]:
    """The words of more than two letters, lower case, a plural's s dropped (Whisper heard
    "Who are the dentists?" as "who were the dentist?" with three calls on two cores)."""
    words = (w.strip(".,!?$'\"").lower() for w in text.split())
    return {w.removesuffix("s") for w in words if len(w) > 2}


@pytest.mark.models
@pytest.mark.timeout(240)
@needs_models
async def test_call_through_bridge_audio_marks_clear_and_report(models, tmp_path):
    from demo.caller import call_in_process, prepare_lines
    from voice.audio import resample, to_float32
    from voice import mulaw

    cfg = e2e_config(tmp_path)
    lines = prepare_lines([
        {"text": "Please describe the clinic."},  # SmolLM2 talks on: long enough to interrupt
        # Long enough that the agent must go quiet while it is still being said.
        {"text": "Sorry to interrupt, but where exactly are you located?", "barge_in_after_s": 2.5},
        {"text": "How much does a cleaning cost?"},
    ], models.tts)
    server_turns = []
    # The caller takes a reply as finished after `silence_s` without agent audio. A slow
    # machine pauses between sentences while it computes the next one: a caller waiting only
    # the default 1.2 s would talk over such a pause (a second barge-in). 5 s is generous.
    result, call = await call_in_process(cfg, lines, models=models, report_dir=tmp_path / "reports",
                                         greeting="Riverside Dental, hello.", silence_s=5.0,
                                         on_server_turn=lambda cid, entry: server_turns.append(entry))
    assert call is not None and call.report_path is not None
    data = load_report(call.report_path)
    assert data["call_id"] == result.call_sid and data["end_reason"] == "caller_hangup"
    assert [t["index"] for t in data["turns"]] == [0, 1, 2] == [t["index"] for t in server_turns]

    # Audio came back: 20 ms mu-law frames (the last of a sentence may be shorter) at 8 kHz.
    assert result.bad_messages == []
    assert result.media_in > 100 and result.greeting_audio_s > 0.5
    assert result.payload_bytes == len(result.agent_payload)
    frames_full = result.payload_bytes / 160
    assert result.media_in <= frames_full + len(result.marks_received) + 1
    pcm = to_float32(mulaw.decode(bytes(result.agent_payload)))
    assert 0.01 < float(np.sqrt(np.mean(pcm ** 2))) < 0.9  # speech level, not noise or silence

    # ... and it is speech saying the agent's words: transcribe the last answer as heard.
    last = result.turns[2]
    assert last.first_agent_audio_t is not None
    t0 = int((last.first_agent_audio_t - result.t0) * 8000)
    answer = result.agent_track[t0:t0 + int(last.agent_audio_s * 8000) + 8000]
    heard_text = models.stt.transcribe(resample(to_float32(answer), 8000, 16000))
    agent_text = data["turns"][2]["agent_text_heard"]
    # Judged by spelling, not whole words: a short answer heard through mu-law by a small
    # Whisper may lose a word ("The claiming is $89." for "The cleaning is $89.": one word
    # of three in common) yet read almost letter for letter; silence or other speech does not.
    assert _similarity(heard_text, agent_text) >= 0.6, (heard_text, agent_text)

    # Marks: one per sentence, each echoed back once played; the bridge saw the echoes.
    assert result.marks_received and sorted(result.marks_echoed) == sorted(result.marks_received)
    spoken = sum(len(t.sentences) for t in call.turns) + 1  # + the greeting
    assert len(result.marks_received) <= spoken

    # Barge-in: line 1 was spoken over answer 0; the agent sent `clear` once, while the
    # caller was still saying it (at speech onset: the end of the utterance is only
    # declared 0.5 s of silence after the line), and nothing of the old answer came after it.
    t_barge = result.turns[1]
    assert len(result.clears) == 1
    assert t_barge.start_t < result.clears[0] < t_barge.end_t, (t_barge.start_t, result.clears, t_barge.end_t)
    cut = int((result.clears[0] - result.t0) * 8000) + 8  # at most one 1 ms rounding
    gap = result.agent_track[cut:int((t_barge.first_agent_audio_t - result.t0) * 8000)]
    assert not np.any(gap), "agent audio continued after the clear"
    turn0 = data["turns"][0]
    assert turn0["interrupted"] is True and data["turns"][1]["interrupted"] is False
    assert len(turn0["agent_text_heard"]) < len(turn0["agent_text"])
    assert call.history.exchanges[1][1] == turn0["agent_text_heard"]  # [0] is the greeting

    # Caller-side voice-to-voice is measured and plausible against the server's: the same
    # span seen from the other end of the socket, so close to it however long it took (how
    # long is for `specvoice bench`, not a test).
    for ct, st in zip(result.turns[1:], data["turns"][1:]):
        assert ct.voice_to_voice is not None and ct.voice_to_voice > 0
        assert st["metrics"]["voice_to_voice"] - 0.3 < ct.voice_to_voice < st["metrics"]["voice_to_voice"] + 2.0

    wav = result.write_wav(tmp_path / "call.wav")
    from voice.wav import read_wav

    stereo, rate = read_wav(wav, sample_rate=None, mono=False)
    assert rate == 8000 and stereo.shape[1] == 2


@pytest.mark.models
@pytest.mark.timeout(240)
@needs_models
async def test_three_calls_at_once_each_get_their_own_answers_and_report(models, tmp_path):
    from pipeline.transports.telephony.auth import BridgeTokens
    from pipeline.transports.web.server import Bridge
    from demo.caller import SimulatedCaller, prepare_lines
    from pipeline.transports.telephony.adapter import make_call_handler

    cfg = e2e_config(tmp_path, max_new_tokens=24)
    questions = ["Who are the dentists?", "How much does a cleaning cost?", "What is your phone number?"]
    token = secrets.token_urlsafe(16)
    handler = make_call_handler(cfg, models, report_dir=tmp_path / "reports", greeting=False)
    bridge = Bridge(cfg.bridge.model_copy(update={"host": "127.0.0.1", "port": 0}), handler,
                    BridgeTokens.of(bearer_token=token))
    port = await bridge.start()
    try:
        callers = [SimulatedCaller(f"ws://127.0.0.1:{port}/media-stream", prepare_lines([{"text": q}], models.tts),
                                   token=token, expect_greeting=False, silence_s=1.0) for q in questions]
        results = await asyncio.wait_for(asyncio.gather(*(c.run() for c in callers)), 200)
        await wait_for(lambda: len(handler.calls) == 3 and all(c.report_path for c in handler.calls), 30,
                       "the three reports")
    finally:
        await bridge.stop()

    by_id = {c.call_id: c for c in handler.calls}
    assert len(by_id) == 3
    answers = []
    for q, result in zip(questions, results):
        call = by_id[result.call_sid]
        data = load_report(call.report_path)
        assert data["call_id"] == result.call_sid
        (turn,) = data["turns"]
        # Its own question (Whisper may vary case, punctuation, a plural), its own answer:
        # most of its words are heard, and it matches no other caller's question as well.
        heard = _words(turn["user_text"])
        overlap = {other: len(_words(other) & heard) / len(_words(other)) for other in questions}
        assert overlap[q] >= 0.6, (q, turn["user_text"])
        assert max(overlap, key=overlap.get) == q, (q, turn["user_text"], overlap)
        assert turn["agent_text"] and result.media_in > 20
        assert result.turns[0].voice_to_voice is not None
        answers.append(turn["agent_text"])
    assert len(set(answers)) == 3, answers
    assert len({c.report_path for c in handler.calls}) == 3


@pytest.mark.models
@needs_models
async def test_wrong_token_is_refused_at_handshake(models, tmp_path):
    from websockets.exceptions import InvalidStatus

    from pipeline.transports.telephony.auth import BridgeTokens
    from pipeline.transports.web.server import Bridge
    from demo.caller import Line, SimulatedCaller
    from pipeline.transports.telephony.adapter import make_call_handler

    cfg = e2e_config(tmp_path)
    handler = make_call_handler(cfg, models, report_dir=tmp_path / "reports")
    bridge = Bridge(cfg.bridge.model_copy(update={"host": "127.0.0.1", "port": 0}), handler,
                    BridgeTokens.of(bearer_token="right-token"))
    port = await bridge.start()
    try:
        caller = SimulatedCaller(f"ws://127.0.0.1:{port}/media-stream", [Line("x", np.zeros(800, np.float32))],
                                 token="wrong-token")
        with pytest.raises(InvalidStatus) as info:
            await caller.run()
        assert info.value.response.status_code == 403
    finally:
        await bridge.stop()
    assert handler.calls == []


def test_mic_without_device_exits_nonzero_with_message():
    proc = subprocess.run([sys.executable, "-m", "demo.cli", "mic"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    try:
        from voice.devices import check_device

        check_device("input")
        check_device("output")
        pytest.skip("this machine has sound devices")
    except Exception:
        pass
    assert proc.returncode != 0
    assert "specvoice call" in proc.stderr and "specvoice mic:" in proc.stderr, proc.stderr
