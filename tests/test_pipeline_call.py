"""The call pipeline in-process: real Whisper (tiny.en), a real small LLM (SmolLM2-135M,
n-gram drafter), real Piper, real Silero; a real-time PushSource and PacedSink.

Models load once per module; utterances are short Piper-spoken questions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from callfakes import WrappedBackend
from conftest import require_models, speech_clips
from pipeline.call import Call, History
from pipeline.config import load_config
from pipeline.io import PushSource, PacedSink
from pipeline.report import load_report
from pipeline.timeline import V2V_PARTS, validate_order

SMALL = "smollm2-135m-instruct"


def _present(*names: str) -> bool:
    from modelstore import is_present

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


class WorkSpy:
    """Records which threads ran the model work, and how much of it is still running.

    Wraps the STT, the TTS and the engine's pass lock: a stage that ran Whisper, Piper or
    a target pass on the event loop's thread would show up in `threads`."""

    def __init__(self):
        self.threads: dict[str, set[int]] = {"stt": set(), "tts": set(), "llm": set()}
        self.active = 0
        self._lock = threading.Lock()

    def _enter(self, kind: str) -> None:
        with self._lock:
            self.threads[kind].add(threading.get_ident())
            self.active += 1

    def _exit(self) -> None:
        with self._lock:
            self.active -= 1

    def stt(self, inner):
        spy = self

        class SpiedSTT:
            def transcribe(self, audio, *args, **kwargs):
                spy._enter("stt")
                try:
                    return inner.transcribe(audio, *args, **kwargs)
                finally:
                    spy._exit()

        return SpiedSTT()

    def tts(self, inner):
        spy = self

        class SpiedTTS:
            def synthesize(self, text):
                chunks = inner.synthesize(text)
                while True:
                    spy._enter("tts")  # each chunk is made by whichever thread asks for it
                    try:
                        chunk = next(chunks, None)
                    finally:
                        spy._exit()
                    if chunk is None:
                        return
                    yield chunk

        return SpiedTTS()

    def lock(self, inner):
        spy = self

        class SpiedLock:
            def __enter__(self):
                spy._enter("llm")
                return inner.__enter__()

            def __exit__(self, *exc):
                try:
                    return inner.__exit__(*exc)
                finally:
                    spy._exit()

        return SpiedLock()


@needs_models
async def test_call_from_speech_timeline_metrics_mqtt_and_loop_lag(models, speech, tmp_path):
    from test_mqtt import MOSQUITTO, Broker, collect, free_port, not_events

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
                                              ready=ready, keep=not_events))
            await ready.wait()
        from llm.backend import SpeculativeBackend

        spy = WorkSpy()
        source, sink = PushSource(), PacedSink()
        voice_pool = ThreadPoolExecutor(4, thread_name_prefix="test-voice")
        backend = SpeculativeBackend(dataclasses.replace(models.engine, lock=spy.lock(models.engine.lock)))
        call = Call.from_models(cfg, models, source, sink, call_id="call-main", executor=voice_pool, backend=backend,
                    stt=spy.stt(models.stt), tts=spy.tts(models.tts))
        stop, lags = asyncio.Event(), []
        ticker = asyncio.create_task(_ticker(stop, lags))
        task = asyncio.create_task(call.run())
        await _converse(call, source, [speech["hours"], speech["price"]])
        await asyncio.wait_for(task, 30)
        stop.set()
        await ticker

        # Audio came out for both turns, after each turn's first_audio_out.
        assert len(call.turns) == 2
        for turn in call.turns:
            t0 = turn.timeline.get("first_audio_out")
            assert t0 is not None, f"turn {turn.index}: no audio out"
            assert len(sink.writer.recording.audio(t0, turn.timeline.get("playback_done"))) > 16000 * 0.5
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

        # Whisper, the LLM and Piper all worked off the event loop's thread, so the loop
        # stayed free for audio (the lag bound is only a generous sanity check: a model
        # step on the loop would stall it for far longer on any machine).
        loop_thread = threading.get_ident()
        assert all(spy.threads.values()), spy.threads
        assert not any(loop_thread in ids for ids in spy.threads.values()), spy.threads
        assert max(lags) < 1.0, f"event loop stalled {max(lags) * 1e3:.1f} ms"
        # Nothing left running: no task but ours, and no model work still in progress.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()
                  and t is not sub]
        assert others == [], others
        assert spy.active == 0, "a model call was still running after the call"
        voice_pool.shutdown(wait=True)

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


class PassGate:
    """The engine's pass lock, in lockstep with the call: a target pass may start only after
    the group of the pass before it has reached the call, and none starts while held.

    So the answer is still being generated when the caller barges in, on any CPU: the
    test holds the LLM after its first sentence and opens the gate at the barge-in."""

    def __init__(self, inner):
        self.inner = inner
        self._permits = threading.Semaphore(1)  # the prefill's pass
        self._free = False

    def step(self) -> None:
        """One more pass may run."""
        self._permits.release()

    def open(self) -> None:
        """No more lockstep: every pass may run (the cancel is checked between them)."""
        self._free = True
        self._permits.release()

    def __enter__(self):
        if not self._free:
            self._permits.acquire()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class HeldAfterFirstSentence(WrappedBackend):
    """An LLM backend around the real one: lets the engine run pass by pass until the text
    holds a complete sentence, then holds it until `gate.open()`."""

    def __init__(self, inner, gate: PassGate):
        self.inner, self.gate = inner, gate
        self.finished = False  # the inner stream ran to its end
        self.held = False

    async def stream(self, messages, params, cancel=None):
        from pipeline.sentences import SentenceSplitter

        splitter = SentenceSplitter()
        async for group in self.inner.stream(messages, params, cancel):
            if not self.held and splitter.feed(group.text):
                self.held = True  # a whole sentence is out: the next pass waits for the barge-in
            if not self.held:
                self.gate.step()
            yield group
        self.finished = True


@needs_models
async def test_barge_in_stops_output_and_llm_and_keeps_only_heard(models, speech, tmp_path):
    from llm.backend import SpeculativeBackend

    cfg = small_config(tmp_path)
    cfg = cfg.model_copy(update={"llm": cfg.llm.model_copy(update={"max_new_tokens": 96})})
    gate = PassGate(models.engine.lock)
    backend = HeldAfterFirstSentence(SpeculativeBackend(dataclasses.replace(models.engine, lock=gate)), gate)
    heard, barged = asyncio.Event(), asyncio.Event()

    def on_event(kind: str, data: dict) -> None:
        if kind == "heard" and data["turn"] == 0:
            heard.set()
        elif kind == "barge_in":
            gate.open()  # the LLM may run again: it must now stop within one pass
            barged.set()

    source, sink = PushSource(), PacedSink()
    call = Call.from_models(cfg, models, source, sink, backend=backend, call_id="call-barge", on_event=on_event)
    task = asyncio.create_task(call.run())
    try:
        source.push(speech["describe"])  # a long answer (SmolLM2 talks on)
        # Wait until the agent has said a whole sentence (its mark confirmed), then talk over it.
        await asyncio.wait_for(heard.wait(), 120)
        assert backend.held and not backend.finished, "the LLM finished before the barge-in: nothing to cancel"
        source.push(speech["stop"])
        await asyncio.wait_for(barged.wait(), 120)
        assert await call.wait_turns(2, 120)
    finally:
        gate.open()
        source.close()
    await asyncio.wait_for(task, 60)

    t0, t1 = call.turns
    assert t0.interrupted and not t1.interrupted and call.barge_ins == 1
    declared = t0.barge_in_declared_t
    assert declared is not None and sink.stats.clears
    # Output stopped at the barge-in: the sink was cleared when the endpointer declared the
    # caller's speech, and no agent frame played after the clear until the next answer.
    cleared = sink.stats.clears[0]
    assert cleared >= declared
    next_audio = t1.timeline.get("first_audio_out")
    late = [t for t in sink.writer.recording.times() if cleared < t < next_audio]
    assert late == [], f"{len(late)} frames played after the clear, the last {late[-1] - cleared:.3f} s after it"
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
    call = Call.from_models(cfg, models, source, sink, call_id="call-outage")
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
        self.tools = self.last_tool_parse = None
        self.prefills = False

    async def aclose(self) -> None:
        return None

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
    call = Call.from_models(small_config(tmp_path), models, source, sink, backend=backend, stt=FixedSTT(""),
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
    # A question: a line that only greets is greeted back without the model ([agent] greet_back).
    call = Call.from_models(small_config(tmp_path), models, source, sink, backend=backend,
                            stt=FixedSTT("Hello there, how much is a cleaning?"), call_id="call-llm-error")
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
    call = Call.from_models(small_config(tmp_path), models, wav_source([clips[n][0] for n in names], gap_s=1.5), sink,
                backend=backend, call_id="call-wav")
    await asyncio.wait_for(call.run(), 60)
    assert backend.calls == 2 and len(call.turns) == 2
    for name, turn in zip(names, call.turns):
        want = {w.strip(",.").lower() for w in clips[name][1].split()}
        got = {w.strip(",.").lower() for w in turn.user_text.split()}
        assert len(want & got) >= len(want) // 2, (clips[name][1], turn.user_text)
        assert turn.timeline.get("first_audio_out") is not None
    out = sink.writer.recording.write(tmp_path / "agent.wav", call.turns[0].timeline.get("speech_start"))
    from voice.wav import read_wav

    pcm, rate = read_wav(out, sample_rate=None)
    assert rate == 16000 and np.abs(pcm).max() > 0.05


async def test_streaming_stt_on_real_speech_has_stable_words_before_the_turn_ends(models, tmp_path, monkeypatch):
    """stt.streaming with real Whisper on a 5.7 s LJ Speech clip: words become stable while
    the reader is still speaking, and after the end of the turn only the tail is
    transcribed; the transcript is as good as the whole-utterance one.

    The reader waits, mid-sentence, for the streaming passes (three, at 40%, 65% and 90% of
    the clip), as if Whisper kept up with real time: in real time a slow machine finishes
    fewer passes before the end, and what is tested is the stream, not the machine."""
    import jiwer

    from test_preemptive import ScriptSource, silence
    from test_voice_stt import words
    from voice.audio import STT_RATE
    from voice.wav import read_wav

    clips = {path.name: (path, transcript) for path, transcript in speech_clips()}
    path, reference = clips["LJ001-0006.wav"]
    pcm, _ = read_wav(path, sample_rate=STT_RATE)
    loop, passes, done = asyncio.get_running_loop(), [0], asyncio.Event()
    whisper_segments = models.stt.segments

    def counted_segments(*args, **kwargs):  # a streaming pass (word timestamps) has heard its audio
        out = whisper_segments(*args, **kwargs)
        if kwargs.get("word_timestamps"):
            loop.call_soon_threadsafe(lambda: (passes.__setitem__(0, passes[0] + 1), done.set()))
        return out

    def passes_done(n: int):
        async def wait() -> None:
            while passes[0] < n:
                done.clear()
                await asyncio.wait_for(done.wait(), 120)
        return wait

    monkeypatch.setattr(models.stt, "segments", counted_segments)
    cut = [int(len(pcm) * f) for f in (0.4, 0.65, 0.9)]
    steps = [silence(0.5), pcm[:cut[0]], passes_done(1), pcm[cut[0]:cut[1]], passes_done(2),
             pcm[cut[1]:cut[2]], passes_done(3), pcm[cut[2]:], silence(1.5)]
    cfg = small_config(tmp_path)
    cfg = cfg.model_copy(update={"stt": cfg.stt.model_copy(update={"streaming": True, "stream_interval_ms": 700})})
    events: list[str] = []
    call = Call.from_models(cfg, models, ScriptSource(steps), PacedSink(), backend=SpyBackend(),
                            call_id="call-streaming", on_event=lambda kind, data: events.append(kind))
    report = (await asyncio.wait_for(call.run(), 300)).to_dict()

    assert len(report["turns"]) == 1, [t["user_text"] for t in report["turns"]]
    turn = report["turns"][0]
    assert "transcript_stable" in events and events.index("transcript_stable") < events.index("end_of_turn")
    stream = turn["stt_stream"]
    assert stream["used"] and stream["passes"] >= 3
    assert stream["tail_s"] < stream["utterance_s"]
    assert turn["metrics"]["stt_after_endpoint"] is not None
    whole = models.stt.transcribe(call.turns[0].end_of_turn.utterance.audio)
    assert jiwer.wer(words(reference), words(turn["user_text"])) <= jiwer.wer(words(reference), words(whole)) + 0.16, (
        turn["user_text"], whole)
