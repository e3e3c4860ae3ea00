"""The turn-taking stage: pauses -> caller turns, with and without an end-of-turn model,
as a unit (scripted pauses and probabilities) and through a whole Call (a tone caller who
pauses mid-sentence)."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from callfakes import EnergyVAD, ScriptedBackend, ScriptedSTT, ToneTTS
from pipeline.agent import load_end_of_turn
from pipeline.call import Call
from pipeline.report import load_report
from pipeline.config import load_config
from pipeline.io import PacedSink, PushSource
from pipeline.events import TurnEnd
from pipeline.stages.turn_taking import TurnTaker
from voice.endpointer import EndpointConfig, Endpointer, SpeechEnded, SpeechStarted
from voice.turn_detector import TurnPolicy

RATE = 16000


def pause(start: float, end: float, declared_after: float = 0.2, reason: str = "silence") -> SpeechEnded:
    """An utterance voiced from `start` to `end` (seconds), declared `declared_after` later."""
    return SpeechEnded(np.ones(int((end - start) * RATE), np.float32) * 0.1, start, end, end + declared_after, reason,
                       start)


class ScriptedModel:
    """P(turn complete) from a script, one answer per question; records the audio it saw."""

    def __init__(self, answers: list[float]):
        self.answers = list(answers)
        self.heard: list[float] = []

    def probability(self, audio: np.ndarray) -> float:
        self.heard.append(len(audio) / RATE)
        return self.answers.pop(0)


def taker(model, **policy) -> TurnTaker:
    return TurnTaker(model, TurnPolicy(**{"check_silence_s": 0.2, "max_silence_s": 1.5, **policy}),
                     clock=lambda: 0.0)


async def test_without_a_model_every_pause_is_a_turn():
    t = taker(None)
    (end,) = await t.on_event(pause(0.0, 1.0, 0.5))
    assert isinstance(end, TurnEnd) and end.reason == "silence" and end.probability is None
    (started,) = await t.on_event(SpeechStarted(2.0, 2.2))
    assert isinstance(started, SpeechStarted)


async def test_an_incomplete_pause_waits_and_the_next_one_ends_the_whole_turn():
    model = ScriptedModel([0.1, 0.9])
    t = taker(model)
    assert await t.on_event(pause(0.0, 1.0)) == [] and t.pending
    assert t.on_time(1.0 + 1.0) is None  # 1 s of silence: still waiting (max 1.5 s)
    assert await t.on_event(SpeechStarted(1.8, 2.0)) == [SpeechStarted(1.8, 2.0)]
    assert t.on_time(2.9) is None  # speaking again: no timeout, however long since the pause
    (end,) = await t.on_event(pause(1.8, 3.0))
    assert end.reason == "model" and end.probability == 0.9 and end.pauses == 2
    u = end.utterance
    assert u.start_t == 0.0 and u.last_voiced_t == 3.0 and u.declared_t == pytest.approx(3.2)
    assert len(u.audio) == int(1.0 * RATE) + int(1.2 * RATE)
    # The model was asked on the turn's audio so far: first the first piece, then both.
    assert model.heard == [1.0, 2.2] and not t.pending


async def test_a_waiting_turn_ends_at_the_maximum_silence():
    t = taker(ScriptedModel([0.2]))
    assert await t.on_event(pause(0.0, 1.0)) == []
    assert t.on_time(2.4) is None
    end = t.on_time(2.5)
    assert end is not None and end.reason == "timeout" and end.probability == 0.2
    assert end.utterance.declared_t == 2.5 and not t.pending


async def test_a_cut_utterance_the_stream_end_and_a_long_turn_end_at_once():
    model = ScriptedModel([])
    t = taker(model)
    (end,) = await t.on_event(pause(0.0, 20.0, 0.0, reason="max_length"))
    assert end.reason == "max_length" and model.heard == []  # not asked
    (end,) = await t.on_event(pause(0.0, 1.0, reason="flush"))
    assert end.reason == "flush"
    t = TurnTaker(ScriptedModel([0.1]), TurnPolicy(), max_turn_s=5.0, clock=lambda: 0.0)
    assert await t.on_event(pause(0.0, 4.0)) == []
    (end,) = await t.on_event(pause(4.5, 6.0))  # a caller who never stops: 5.5 s > 5 s
    assert end.reason == "max_length" and end.pauses == 2
    t = taker(ScriptedModel([0.1]))
    await t.on_event(pause(0.0, 1.0))
    end = t.flush()
    assert end is not None and end.reason == "flush" and t.flush() is None


def test_missing_model_is_a_clear_error_or_a_warned_fallback(tmp_path, caplog):
    cfg = load_config("test")
    missing = str(tmp_path / "nowhere" / "smart-turn-v3.2-cpu.onnx")
    smart = cfg.model_copy(update={"turn": cfg.turn.model_copy(update={"mode": "smart_turn", "model": missing})})
    with pytest.raises(FileNotFoundError) as info:
        load_end_of_turn(smart)
    assert "specvoice models pull smart-turn-v3.2" in str(info.value)
    fallback = smart.model_copy(update={"turn": smart.turn.model_copy(update={"fallback_to_silence": True})})
    with caplog.at_level(logging.WARNING):
        assert load_end_of_turn(fallback) is None
    assert "falling back to silence endpointing" in caplog.text
    assert load_end_of_turn(cfg) is None  # silence mode asks for no model


def tone(seconds: float) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 300 * np.arange(int(seconds * RATE)) / RATE)).astype(np.float32)


class LengthModel:
    """Complete once the turn holds more than `seconds` of audio (a stand-in for Smart Turn
    that is sure the first half of the sentence is not the end)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.asked = 0

    def probability(self, audio: np.ndarray) -> float:
        self.asked += 1
        return 0.95 if len(audio) / RATE > self.seconds else 0.05


async def _call_turns(tmp_path, model, take_back_ms: int = 0) -> tuple[Call, list[str]]:
    """A caller says half a sentence, pauses 0.7 s, says the rest: which turns does the agent
    take? By the turn-taker alone, unless `take_back_ms` (the call takes a turn back when the
    caller goes on before its answer is heard: pipeline/stages/take_back.py)."""
    cfg = load_config("test")
    cfg = cfg.model_copy(update={"report": cfg.report.model_copy(update={"dir": str(tmp_path / "reports")}),
                                 "turn": cfg.turn.model_copy(update={"take_back_ms": take_back_ms})})
    heard = []
    stt = ScriptedSTT(lambda audio: heard.append(len(audio) / RATE) or f"{len(audio) / RATE:.1f} seconds")
    source = PushSource(realtime=False, tail_s=2.5)
    endpointer = Endpointer(EnergyVAD(), EndpointConfig(min_speech_ms=64, min_silence_ms=200, pre_roll_ms=64,
                                                        post_roll_ms=32))
    # The turn-taker's clock is the audio's own (the source runs faster than real time), so
    # the decision time does not depend on how fast this machine processes the frames.
    turns = TurnTaker(model, TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0)
    call = Call(cfg, source, PacedSink(), stt=stt, tts=ToneTTS(chunks=1), backend=ScriptedBackend(["Sure. "]),
                endpointer=endpointer, turns=turns, mqtt=None)
    source.push(np.zeros(int(0.3 * RATE), np.float32))
    source.push(tone(1.0))
    source.push(np.zeros(int(0.7 * RATE), np.float32))  # a mid-sentence pause
    source.push(tone(1.0))
    source.close()
    await asyncio.wait_for(call.run(), 60)
    return call, heard


async def test_a_mid_sentence_pause_is_one_turn_with_the_model_and_two_without(tmp_path):
    silence_call, _ = await _call_turns(tmp_path / "silence", None)
    assert len(silence_call.turns) == 2  # silence endpointing answers the fragment
    # ... unless the call takes the fragment's turn back when the caller goes on before its
    # answer is heard (the 0.7 s pause ends the turn after 0.2 s: the caller goes on 0.5 s later).
    joined, heard = await _call_turns(tmp_path / "taken", None, take_back_ms=700)
    assert len(joined.turns) == 1 and joined.turns[0].user_text == f"{heard[-1]:.1f} seconds" and heard[-1] > 2.0
    assert len(load_report(joined.report_path)["taken_back"]) == 1
    model = LengthModel(1.5)
    call, heard = await _call_turns(tmp_path / "model", model)
    assert len(call.turns) == 1 and model.asked == 2
    # STT heard both halves as one utterance (the turn's is the last transcription; the one
    # before it, on the first half alone, was the preemptive start at the pause, discarded).
    assert heard[-1] > 2.0 and call.turns[0].user_text == f"{heard[-1]:.1f} seconds"
    (entry,) = load_report(call.report_path)["turns"]
    assert entry["end_of_turn"] == {"reason": "model", "probability": 0.95, "pauses": 2}
    # endpoint_delay is last voiced audio -> end of turn declared: the pause check, not 0.7 s.
    assert entry["metrics"]["endpoint_delay"] < 0.5


class PauseTranscripts:
    """`transcribe_pause` from a script: one transcript per pause; records the audio it saw."""

    def __init__(self, *texts: str | None):
        self.texts = list(texts)
        self.heard: list[float] = []

    async def __call__(self, audio: np.ndarray) -> str | None:
        self.heard.append(len(audio) / RATE)
        return self.texts.pop(0)


async def test_a_complete_pause_ending_on_a_dangling_word_waits_and_keeps_its_transcript():
    transcripts = PauseTranscripts("I would like to book a cleaning for the", "I would like to book a cleaning for the Friday.")
    t = TurnTaker(ScriptedModel([0.95, 0.95]), TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0,
                  transcribe_pause=transcripts)
    assert await t.on_event(pause(0.0, 2.0)) == []  # "complete", but "... for": wait
    assert t.decisions == [("wait", 0.95)]
    assert t.on_time(2.0 + 1.0) is None  # the wait is not undone by the next frame
    await t.on_event(SpeechStarted(3.0, 3.2))
    (end,) = await t.on_event(pause(3.0, 3.6))
    assert end.reason == "model" and end.pauses == 2
    assert await end.transcript == "I would like to book a cleaning for the Friday."  # of the whole turn
    assert transcripts.heard == pytest.approx([2.0, 2.0 + 0.6])  # the turn so far, at each pause


async def test_a_pause_transcript_reaches_the_turn_that_times_out_on_it_but_not_a_cut_one():
    t = TurnTaker(ScriptedModel([0.2]), TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0,
                  transcribe_pause=PauseTranscripts("So the cleaning, and"))
    assert await t.on_event(pause(0.0, 1.0)) == []
    end = t.on_time(2.5)
    assert end.reason == "timeout" and await end.transcript == "So the cleaning, and"
    t = TurnTaker(ScriptedModel([0.2]), TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0,
                  transcribe_pause=PauseTranscripts("Hello"))
    assert await t.on_event(pause(0.0, 1.0)) == []
    (end,) = await t.on_event(pause(1.2, 21.0, 0.0, reason="max_length"))  # a piece the pause never heard
    assert end.reason == "max_length" and end.transcript is None


async def test_a_failed_pause_transcript_is_no_transcript():
    async def broken(audio):
        raise RuntimeError("whisper fell over")

    t = TurnTaker(ScriptedModel([0.9]), TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0,
                  transcribe_pause=broken)
    (end,) = await t.on_event(pause(0.0, 1.0, 0.3))
    assert end.reason == "model" and await end.transcript is None
