"""Streaming STT as a stage of the call (pipeline/stages/live_stt.py): the audio it
streams is exactly the turn's, stable words exist before the turn ends, and after the
end only the tail is transcribed."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from callfakes import EnergyVAD, FakeModels, ScriptedBackend, ScriptedSTT
from pipeline.agent import turn_taker
from pipeline.call import Call
from pipeline.config import load_config
from pipeline.io import PacedSink, PushSource
from pipeline.stages.listen import listen
from pipeline.stages.live_stt import LiveTranscript
from pipeline.events import TurnEnd, TurnPending
from pipeline.stages.turn_taking import TurnTaker
from test_streaming_stt import Scripted
from voice.endpointer import EndpointConfig, Endpointer, SpeechEnded
from voice.streaming_stt import StreamingTranscriber
from voice.turn_detector import TurnPolicy

RATE = 16000


def tone(seconds: float, amplitude: float = 0.3) -> np.ndarray:
    n = int(seconds * RATE)
    return (amplitude * np.sin(2 * np.pi * 220 * np.arange(n) / RATE)).astype(np.float32)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.float32)


@pytest.mark.parametrize("seed", range(6))
def test_voiced_audio_streams_exactly_the_audio_each_speech_ended_keeps(seed):
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(4):
        parts += [silence(rng.uniform(0.3, 0.6)), tone(rng.uniform(0.2, 1.5), rng.uniform(0.05, 0.5))]
    parts.append(silence(0.6))
    audio = np.concatenate(parts)
    ep = Endpointer(EnergyVAD(), EndpointConfig(min_speech_ms=64, min_silence_ms=200, pre_roll_ms=96,
                                                post_roll_ms=64))
    streamed, fed, ended = [], 0, 0
    i = 0
    while i < audio.size:
        n = int(rng.integers(100, 900))  # frames of any size, as telephony delivers them
        for event in ep.feed(audio[i:i + n], i / RATE):
            if isinstance(event, SpeechEnded):
                got = np.concatenate(streamed) if streamed else np.zeros(0, np.float32)
                # What was streamed is a prefix of what the endpointer kept; the rest follows.
                assert np.array_equal(got, event.audio[:fed])
                assert np.array_equal(np.concatenate([got, event.audio[fed:]]), event.audio)
                streamed, fed, ended = [], 0, ended + 1
        new = ep.voiced_audio(fed)
        streamed.append(new)
        fed += new.size
        i += n
    assert ended == 4
    assert not ep.in_speech and ep.voiced_audio(0).size == 0


class Probability:
    """An end-of-turn model answering from a list (the last answer repeats)."""

    def __init__(self, *answers: float):
        self.answers = list(answers)
        self.asked = 0

    def probability(self, audio) -> float:
        self.asked += 1
        return self.answers[min(self.asked, len(self.answers)) - 1]


async def test_a_turn_of_several_pieces_is_streamed_whole_and_transcribed_from_its_tail():
    source = PushSource(realtime=False, tail_s=2.0)
    source.push(np.concatenate([tone(1.2), silence(0.4), tone(0.9)]))
    source.close()
    endpointer = Endpointer(EnergyVAD(), EndpointConfig(min_speech_ms=64, min_silence_ms=200, pre_roll_ms=64,
                                                        post_roll_ms=32))
    turns = TurnTaker(Probability(0.1, 0.9), TurnPolicy(check_silence_s=0.2, max_silence_s=1.0),
                      announce_pauses=True)
    recognizer = Scripted("I would like", "I would like to book", tail="to book a cleaning")
    live = LiveTranscript(lambda: StreamingTranscriber(recognizer=recognizer, interval_s=0.3, min_audio_s=0.3,
                                                       finish_overlap_s=0.0))
    ends, pendings = [], []
    async for event in listen(source, endpointer, turns, live):
        if isinstance(event, TurnPending):
            pendings.append(event)
        elif isinstance(event, TurnEnd):
            ends.append((event, live.claim(event)))
        await live.settle()  # passes keep up with this faster-than-real-time source
    assert len(pendings) == 1 and len(ends) == 1
    end, claimed = ends[0]
    assert end.pauses == 2
    assert claimed.mismatch is None  # both pieces, sample for sample
    assert np.array_equal(claimed.transcriber.buffered_audio(), end.utterance.audio)
    text = await claimed.finish()
    stable = [e["text"] for e in claimed.report["events"] if e["kind"] == "stable"]
    assert stable and text.startswith(stable[-1]) and text.endswith("cleaning")
    report = claimed.report
    assert report["used"] and report["passes"] >= 2
    assert [e["kind"] for e in report["events"]].count("stable") >= 1
    seconds, _ = recognizer.calls[-1]
    if report["tail_s"] == 0:
        # A pass ran on all the audio when the caller fell silent: it is the transcript, and
        # the end of the turn needed no Whisper run.
        assert seconds == pytest.approx(len(end.utterance.audio) / RATE)
        assert report["finish_compute_s"] == 0  # (a pass overtaken by this one is not counted)
    else:
        # A pass was still running then: after the end, only the tail was transcribed.
        assert seconds == pytest.approx(report["tail_s"]) and report["tail_s"] < report["utterance_s"]


async def test_a_claim_on_other_audio_falls_back_to_the_whole_utterance():
    live = LiveTranscript(lambda: StreamingTranscriber(recognizer=Scripted("x"), interval_s=0.3))
    heard = tone(0.5)
    live.piece_ended(SpeechEnded(heard, 0.0, 0.5, 0.7))
    other = heard.copy()
    other[100] += 0.01
    claimed = live.claim(TurnEnd(SpeechEnded(other, 0.0, 0.5, 0.7), "silence"))
    assert claimed.transcriber is None and "differs" in claimed.mismatch
    assert await claimed.finish() is None
    assert claimed.report == {"used": False, "why": claimed.mismatch}
    # The next turn starts from nothing.
    assert live.transcriber.buffered_audio().size == 0


def streaming_config():
    cfg = load_config("test")
    return cfg.model_copy(update={"stt": cfg.stt.model_copy(update={"streaming": True, "stream_interval_ms": 200})})


async def test_a_call_streams_stt_emits_stable_words_before_the_turn_ends_and_reports_it(tmp_path):
    recognizer = Scripted("What are", "What are your", "What are your hours", tail="your hours on Saturday?")
    stt = ScriptedSTT("the whole utterance")  # must not be needed
    events: list[tuple[str, dict]] = []
    source, sink = PushSource(), PacedSink()
    call = Call(streaming_config(), source, sink, stt=stt, tts=FakeModels().tts,
                backend=ScriptedBackend(["We are open ", "nine to one on Saturday."]),
                endpointer=FakeModels().new_endpointer(), turns=turn_taker(load_config("test"), None),
                mqtt=None, report_dir=tmp_path, on_event=lambda kind, data: events.append((kind, data)),
                new_transcriber=lambda: StreamingTranscriber(recognizer=recognizer, interval_s=0.2,
                                                             min_audio_s=0.2))
    task = asyncio.create_task(call.run())
    source.push(np.concatenate([tone(2.0), silence(0.1)]))
    assert await call.wait_turns(1, 60)
    source.close()
    report = (await task).to_dict()

    kinds = [k for k, _ in events]
    assert "transcript_stable" in kinds and "transcript_interim" in kinds
    assert kinds.index("transcript_stable") < kinds.index("end_of_turn")  # stable while speaking
    assert stt.calls == 0  # no whole-utterance transcription
    turn = report["turns"][0]
    stable = [e["text"] for e in turn["stt_stream"]["events"] if e["kind"] == "stable"]
    # The stable words, then the tail transcribed after the end (this recognizer's script).
    assert turn["user_text"].startswith(stable[-1]) and turn["user_text"].endswith("Saturday?")
    assert turn["stt_stream"]["used"] is True and turn["stt_stream"]["passes"] >= 2
    assert turn["metrics"]["stt_after_endpoint"] is not None
    assert turn["metrics"]["stt_after_endpoint"] == turn["metrics"]["stt_latency"]


async def test_silence_and_noise_start_no_stream_pass_and_no_turn(tmp_path):
    recognizer = Scripted("should not be asked")
    source, sink = PushSource(realtime=False, tail_s=0.5), PacedSink()
    backend = ScriptedBackend()
    call = Call(streaming_config(), source, sink, stt=ScriptedSTT(), tts=FakeModels().tts, backend=backend,
                endpointer=FakeModels().new_endpointer(), turns=turn_taker(load_config("test"), None),
                mqtt=None, report_dir=tmp_path,
                new_transcriber=lambda: StreamingTranscriber(recognizer=recognizer, interval_s=0.2))
    rng = np.random.default_rng(0)
    source.push((rng.standard_normal(3 * RATE) * 0.005).astype(np.float32))  # below the VAD: not speech
    source.close()
    report = (await call.run()).to_dict()
    assert recognizer.calls == [] and backend.opened == 0 and report["turns"] == []


def test_streaming_needs_whisper_or_a_transcriber(tmp_path):
    with pytest.raises(ValueError, match="stt.streaming"):
        Call(streaming_config(), PushSource(), PacedSink(), stt=ScriptedSTT(), tts=FakeModels().tts,
             backend=ScriptedBackend(), endpointer=FakeModels().new_endpointer(), mqtt=None, report_dir=tmp_path)


async def test_the_html_report_shows_the_streamed_transcripts(tmp_path):
    from demo.report_html import render_html

    recognizer = Scripted("What are", "What are your", tail="your hours?")
    source, sink = PushSource(), PacedSink()
    call = Call(streaming_config(), source, sink, stt=ScriptedSTT(), tts=FakeModels().tts,
                backend=ScriptedBackend(["Nine to five."]), endpointer=FakeModels().new_endpointer(),
                turns=turn_taker(load_config("test"), None), mqtt=None, report_dir=tmp_path,
                new_transcriber=lambda: StreamingTranscriber(recognizer=recognizer, interval_s=0.2, min_audio_s=0.2))
    task = asyncio.create_task(call.run())
    source.push(np.concatenate([tone(1.5), silence(0.1)]))
    assert await call.wait_turns(1, 60)
    source.close()
    report = (await task).to_dict()
    events = report["turns"][0]["stt_stream"]["events"]
    speech_start = report["turns"][0]["timeline"]["speech_start"]
    assert events and all(speech_start <= e["at"] <= report["turns"][0]["timeline"]["end_of_speech"] for e in events)
    html = render_html(report)
    assert 'data-field="stt_passes"' in html and 'data-field="stt_after_endpoint"' in html
    assert html.count('<li data-kind="stable">') == sum(1 for e in events if e["kind"] == "stable") >= 1


class ByLength:
    """A recognizer whose words depend on how much audio it hears (the caller says more)."""

    def __init__(self, *texts: tuple[float, str]):
        self.texts = texts  # (up to seconds, text), ascending
        self.calls: list[float] = []

    def words(self, audio, prompt=None):
        seconds = audio.size / RATE
        self.calls.append(seconds)
        from test_streaming_stt import hyp

        return hyp(next(text for upto, text in self.texts if seconds <= upto))  # each word at its own time


def smart_streaming_config():
    cfg = streaming_config()
    return cfg.model_copy(update={"turn": cfg.turn.model_copy(update={"mode": "smart_turn", "preemptive": False})})


async def test_with_smart_turn_a_pause_ending_on_a_dangling_word_waits_and_the_turn_reuses_the_pause_transcript(
        tmp_path):
    """Smart Turn calls both pauses complete; the first one's transcript ends on "for the",
    so the turn waits, and the caller's next words join the same turn. That turn ends at the
    second pause, whose transcript it uses: no STT after the end."""
    recognizer = ByLength((1.6, "I would like to book a cleaning for the"), (60.0, "I would like to book a cleaning for the Friday slot."))
    stt = ScriptedSTT("whole utterance")
    events: list[tuple[str, dict]] = []
    source, sink = PushSource(realtime=False, tail_s=2.0), PacedSink()
    endpointer = Endpointer(EnergyVAD(), EndpointConfig(min_speech_ms=64, min_silence_ms=200, pre_roll_ms=64,
                                                        post_roll_ms=32))
    turns = TurnTaker(Probability(0.95), TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0)
    call = Call(smart_streaming_config(), source, sink, stt=stt, tts=FakeModels().tts,
                backend=ScriptedBackend(["Friday it is."]), endpointer=endpointer, turns=turns, mqtt=None,
                report_dir=tmp_path, on_event=lambda kind, data: events.append((kind, data)),
                new_transcriber=lambda: StreamingTranscriber(recognizer=recognizer, interval_s=30.0))
    source.push(np.concatenate([tone(1.2), silence(0.6), tone(0.8)]))
    source.close()
    report = (await call.run()).to_dict()

    assert len(report["turns"]) == 1  # not cut in two at "for the"
    turn = report["turns"][0]
    assert turn["user_text"] == "I would like to book a cleaning for the Friday slot."
    assert turn["end_of_turn"]["reason"] == "model" and turn["end_of_turn"]["pauses"] == 2
    assert turns.decisions == [("wait", 0.95), ("end", 0.95)]
    assert stt.calls == 0 and turn["stt_stream"]["used"] and turn["stt_stream"]["final"] == "pause"
    assert [k for k, _ in events].count("transcript_pause") == 2
