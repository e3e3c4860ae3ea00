"""The call pipeline in-process: real Whisper (tiny.en), a real small LLM (SmolLM2-135M,
n-gram drafter), real Piper, real Silero; a real-time PushSource and PacedSink.

Models load once per module; utterances are short Piper-spoken questions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import require_models, speech_clips
from pipeline.call import Call, History
from pipeline.config import load_config
from pipeline.io import PushSource, PacedSink
from pipeline.report import load_report
from pipeline.timeline import V2V_PARTS, validate_order

SMALL = "smollm2-135m-instruct"


def _present(*names: str) -> bool:
    from pipeline.models import is_present

    return all(is_present(n) for n in names)


needs_models = pytest.mark.skipif(
    not require_models() and not _present(SMALL, "whisper-tiny.en", "piper-joe-medium"),
    reason="needs smollm2-135m-instruct, whisper-tiny.en, piper-joe-medium (specvoice models pull)",
)
pytestmark = [pytest.mark.models, pytest.mark.timeout(240)]


def small_config(tmp_path: Path, **mqtt):
    cfg = load_config("test")
    return cfg.model_copy(update={
        "llm": cfg.llm.model_copy(update={"target": SMALL, "draft": None, "drafter": "ngram", "dtype": "int8",
                                          "gamma": 4, "max_new_tokens": 24, "threads": 1}),
        "report": cfg.report.model_copy(update={"dir": str(tmp_path / "reports")}),
        "mqtt": cfg.mqtt.model_copy(update=mqtt) if mqtt else cfg.mqtt,
    })


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not require_models() and not _present(SMALL, "whisper-tiny.en", "piper-joe-medium"):
        pytest.skip("models not pulled")
    from pipeline.agent import AgentModels

    cfg = small_config(tmp_path_factory.mktemp("cfg"))
    # One thread each: torch, CTranslate2 and onnxruntime share two cores.
    return AgentModels.load(cfg, threads=1)


@pytest.fixture(scope="module")
def speech(models):
    """Questions spoken by Piper, 16 kHz float32."""
    from voice.audio import resample

    out = {}
    for key, text in {
        "hours": "What are your opening hours on Saturday?",
        "price": "How much does a cleaning cost?",
        "describe": "Please describe the clinic.",
        "stop": "Wait, stop. Where are you located?",
    }.items():
        chunks = list(models.tts.synthesize(text))
        out[key] = resample(np.concatenate([c.pcm for c in chunks]), chunks[0].sample_rate, 16000)
    return out


async def _ticker(stop: asyncio.Event, lags: list[float], period: float = 0.01) -> None:
    """The loop's responsiveness: how late a 10 ms sleep wakes up."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - t - period)


async def _converse(call: Call, source: PushSource, utterances: list[np.ndarray], timeout: float = 60) -> None:
    for i, pcm in enumerate(utterances):
        source.push(pcm)
        assert await call.wait_turns(i + 1, timeout), f"turn {i} did not finish within {timeout} s"
    source.close()


# ---------------------------------------------------------------- unit: history


def test_history_drops_oldest_exchanges_to_fit_budget():
    count = lambda msgs: sum(len(m["content"].split()) + 1 for m in msgs)  # noqa: E731
    h = History("sys prompt here", budget_tokens=12, count_tokens=count)
    h.add("one two three", "four five six")  # 8 tokens
    h.add("seven eight", "nine ten")  # 6 tokens
    msgs = h.messages("new question")  # 3 tokens: 8 + 6 + 3 > 12 -> drop the oldest
    assert [m["content"] for m in msgs] == ["sys prompt here", "seven eight", "nine ten", "new question"]
    assert h.dropped == 1
    h2 = History("s", budget_tokens=2, count_tokens=count)
    h2.add("a b c", "d")
    assert [m["role"] for m in h2.messages("x")] == ["system", "user"]  # newest message always kept


# ---------------------------------------------------------------- the call, end to end in-process


@needs_models
async def test_call_from_speech_timeline_metrics_mqtt_and_loop_lag(models, speech, tmp_path):
    from test_mqtt import MOSQUITTO, Broker, collect, free_port

    broker = None
    mqtt = {}
    if MOSQUITTO is not None:
        broker = Broker(tmp_path, free_port())
        broker.start()
        mqtt = {"enabled": True, "port": broker.port, "topic_prefix": "svtest", "retry_s": 0.05}
    cfg = small_config(tmp_path, **mqtt)
    try:
        sub = None
        if broker is not None:
            ready = asyncio.Event()
            sub = asyncio.create_task(collect("127.0.0.1", broker.port, "svtest/calls/+/#", 3, timeout=90,
                                              ready=ready))
            await ready.wait()
        source, sink = PushSource(), PacedSink()
        voice_pool = ThreadPoolExecutor(4, thread_name_prefix="test-voice")
        call = Call(cfg, models, source, sink, call_id="call-main", executor=voice_pool)
        stop, lags = asyncio.Event(), []
        ticker = asyncio.create_task(_ticker(stop, lags))
        task = asyncio.create_task(call.run())
        await _converse(call, source, [speech["hours"], speech["price"]])
        report = await asyncio.wait_for(task, 30)
        stop.set()
        await ticker

        # Audio came out for both turns, after each turn's first_audio_out.
        assert len(call.turns) == 2
        for turn in call.turns:
            t0 = turn.timeline.get("first_audio_out")
            assert t0 is not None, f"turn {turn.index}: no audio out"
            assert len(sink.recording.audio(t0, turn.timeline.get("playback_done"))) > 16000 * 0.5
        assert "saturday" in call.turns[0].user_text.lower()
        assert "clean" in call.turns[1].user_text.lower()

        data = load_report(call.report_path)
        assert data["end_reason"] == "completed" and data["error"] is None
        assert [t["user_text"] for t in data["turns"]] == [t.user_text for t in call.turns]
        for turn in call.turns:
            assert validate_order(turn.timeline) == [], validate_order(turn.timeline)
        for entry in data["turns"]:
            m = entry["metrics"]
            tl = entry["timeline"]
            assert tl["first_sentence"] >= tl["first_token"]
            assert m["first_sentence_latency"] >= m["ttft"]
            parts = sum(m[p] for p in V2V_PARTS)
            assert abs(parts - m["voice_to_voice"]) < 1e-3, (parts, m["voice_to_voice"])
            assert 0 < m["voice_to_voice"] < 10
            assert entry["llm"]["new_tokens"] > 0 and entry["agent_text"]
            assert entry["agent_text_heard"] == entry["agent_text"].strip() or entry["agent_text_heard"]
        # History holds both exchanges, the agent side as heard.
        assert [u for u, _ in call.history.exchanges] == [t.user_text for t in call.turns]

        # The loop stayed responsive while Whisper, the LLM and Piper worked.
        assert max(lags) < 0.050, f"event loop stalled {max(lags) * 1e3:.1f} ms"
        # Nothing left running: no task but ours, no worker busy with this call.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()
                  and t is not sub]
        assert others == [], others
        # ...and no STT/TTS worker still busy: shutting its pool down waits for nothing.
        t = time.perf_counter()
        voice_pool.shutdown(wait=True)
        assert time.perf_counter() - t < 0.05, "a voice worker was still running after the call"

        if sub is not None:
            msgs = await sub
            turns = [json.loads(m.payload) for m in msgs if str(m.topic).endswith("/turns")]
            assert [t["index"] for t in turns] == [0, 1]
            assert turns[0]["call_id"] == "call-main" and "voice_to_voice" in turns[0]["metrics"]
            assert str(msgs[-1].topic).endswith("/summary") and json.loads(msgs[-1].payload)["turns"] == 2
    finally:
        if broker is not None:
            broker.stop()
    if broker is None:
        pytest.skip("mosquitto not installed: the MQTT part was not checked")


class SlowLock:
    """The engine's pass lock, made to take >= 120 ms a pass (about the default 1.5B's pace on this CPU): the answer is still being
    generated when the caller barges in, so cancellation is really exercised."""

    def __init__(self, inner, delay=0.12):
        self.inner, self.delay = inner, delay

    def __enter__(self):
        time.sleep(self.delay)
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


@needs_models
async def test_barge_in_stops_output_and_llm_and_keeps_only_heard(models, speech, tmp_path):
    from llm.backend import SpeculativeBackend

    cfg = small_config(tmp_path)
    cfg = cfg.model_copy(update={"llm": cfg.llm.model_copy(update={"max_new_tokens": 96})})
    slow = dataclasses.replace(models.engine, lock=SlowLock(models.engine.lock))
    backend = SpeculativeBackend(slow)
    source, sink = PushSource(), PacedSink()
    call = Call(cfg, models, source, sink, backend=backend, call_id="call-barge")
    task = asyncio.create_task(call.run())
    source.push(speech["describe"])  # a long answer (SmolLM2 talks on)
    # Wait until the agent has said a whole sentence (its mark confirmed), then talk over it.
    deadline = time.monotonic() + 60
    while not (call._active is not None and call._active.heard):
        assert time.monotonic() < deadline, "the agent never finished a sentence"
        await asyncio.sleep(0.01)
    turn0 = call._active
    assert turn0.timeline.get("llm_done") is None, "the LLM finished before the barge-in: nothing to cancel"
    source.push(speech["stop"])
    assert await call.wait_turns(2, 60)
    source.close()
    await asyncio.wait_for(task, 30)

    t0, t1 = call.turns
    assert t0.interrupted and not t1.interrupted and call.barge_ins == 1
    declared = t0.barge_in_declared_t
    assert declared is not None and sink.clears
    # Output stopped within 100 ms of the endpointer declaring speech: no agent frame
    # after that until the next turn's answer.
    next_audio = t1.timeline.get("first_audio_out")
    late = [t for t in sink.recording.times() if declared + 0.100 < t < next_audio]
    assert late == [], f"{len(late)} frames played after the barge-in, the last {late[-1] - declared:.3f} s after it"
    # The LLM stopped within one target pass of the barge-in.
    assert t0.llm_passes_after_barge_in is not None and t0.llm_passes_after_barge_in <= 1, \
        (t0.llm_passes_at_barge_in, t0.stats.passes)
    assert t0.finish_reason in ("cancelled", None)
    # History holds what was played: whole sentences confirmed by marks, a prefix of what was said.
    assert t0.heard and t0.heard == t0.sentences[: len(t0.heard)]
    assert len(" ".join(t0.heard)) < len(t0.agent_text.strip()) or len(t0.heard) < len(t0.sentences)
    assert call.history.exchanges[0] == (t0.user_text, " ".join(t0.heard))
    data = load_report(call.report_path)
    assert data["turns"][0]["interrupted"] is True
    assert data["turns"][0]["agent_text_heard"] == " ".join(t0.heard)
    assert "barge_in" in data["turns"][0]["timeline"]
    assert validate_order(t0.timeline) == []


@needs_models
async def test_broker_stopped_mid_call_call_completes_and_report_written(models, speech, tmp_path):
    from test_mqtt import MOSQUITTO, Broker, free_port

    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed")
    broker = Broker(tmp_path, free_port())
    broker.start()
    cfg = small_config(tmp_path, enabled=True, port=broker.port, topic_prefix="svtest", retry_s=0.05)
    source, sink = PushSource(), PacedSink()
    call = Call(cfg, models, source, sink, call_id="call-outage")
    task = asyncio.create_task(call.run())
    try:
        source.push(speech["price"])
        assert await call.wait_turns(1, 60)
        deadline = time.monotonic() + 10
        while call.mqtt.sent < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert call.mqtt.sent == 1, "turn 0 was not delivered while the broker was up"
        broker.stop()
        source.push(speech["hours"])
        assert await call.wait_turns(2, 60)
        source.close()
        t = time.monotonic()
        await asyncio.wait_for(task, 30)
        assert time.monotonic() - t < 6, "closing the call waited on the dead broker"
    finally:
        broker.stop()
    data = load_report(call.report_path)
    assert data["end_reason"] == "completed" and len(data["turns"]) == 2
    assert call.mqtt.sent == 1 and not call.mqtt.connected  # turn 1 and the summary could not go out


# ---------------------------------------------------------------- stubs: empty utterance, failing LLM


class SpyBackend:
    def __init__(self, fail_after: int | None = None):
        self.calls = 0
        self.fail_after = fail_after
        self.last_stats = None

    async def stream(self, messages, params, cancel=None):
        from llm.types import TokenGroup

        self.calls += 1
        yield TokenGroup((1,), "Sure, one moment. ", 0, 0)
        if self.fail_after is not None:
            raise RuntimeError("model exploded")


class FixedSTT:
    def __init__(self, text: str):
        self.text = text

    def transcribe(self, audio, sample_rate=16000):
        return self.text


@needs_models
async def test_silent_utterance_makes_no_llm_call(models, speech, tmp_path):
    backend = SpyBackend()
    source, sink = PushSource(realtime=False, tail_s=1.0), PacedSink()
    call = Call(small_config(tmp_path), models, source, sink, backend=backend, stt=FixedSTT(""),
                call_id="call-silent")
    source.push(speech["price"])
    source.close()
    report = await asyncio.wait_for(call.run(), 30)
    assert call.skipped_utterances == 1
    assert backend.calls == 0 and call.llm_calls == 0
    assert report.turns == [] and load_report(call.report_path)["end_reason"] == "completed"


@needs_models
async def test_llm_raising_ends_turn_and_report_records_error(models, speech, tmp_path):
    backend = SpyBackend(fail_after=1)
    source, sink = PushSource(realtime=False, tail_s=1.0), PacedSink()
    call = Call(small_config(tmp_path), models, source, sink, backend=backend, stt=FixedSTT("Hello there."),
                call_id="call-llm-error")
    source.push(speech["price"])
    source.close()
    await asyncio.wait_for(call.run(), 30)
    assert backend.calls == 1
    data = load_report(call.report_path)
    assert data["end_reason"] == "completed"
    assert "model exploded" in data["error"]
    (turn,) = data["turns"]
    assert "RuntimeError: model exploded" in turn["error"] and turn["finish_reason"] == "error"
    # What the model said before failing was still spoken.
    assert turn["agent_text"].startswith("Sure") and "first_audio_out" in turn["timeline"]


@needs_models
async def test_wav_files_through_real_stt_make_turns(models, tmp_path):
    """LJ Speech clips said by `wav_source` (real time), heard by the real endpointer and
    Whisper; a stub LLM keeps it quick. The agent's reply is written out as a WAV file."""
    from pipeline.io import wav_source

    clips = {path.name: (path, transcript) for path, transcript in speech_clips()}
    names = ["LJ001-0002.wav", "LJ001-0008.wav"]
    backend = SpyBackend()
    sink = PacedSink()
    call = Call(small_config(tmp_path), models, wav_source([clips[n][0] for n in names], gap_s=1.5), sink,
                backend=backend, call_id="call-wav")
    await asyncio.wait_for(call.run(), 60)
    assert backend.calls == 2 and len(call.turns) == 2
    for name, turn in zip(names, call.turns):
        want = {w.strip(",.").lower() for w in clips[name][1].split()}
        got = {w.strip(",.").lower() for w in turn.user_text.split()}
        assert len(want & got) >= len(want) // 2, (clips[name][1], turn.user_text)
        assert turn.timeline.get("first_audio_out") is not None
    out = sink.recording.write(tmp_path / "agent.wav", call.turns[0].timeline.get("speech_start"))
    from voice.wav import read_wav

    pcm, rate = read_wav(out, sample_rate=None)
    assert rate == 16000 and np.abs(pcm).max() > 0.05
