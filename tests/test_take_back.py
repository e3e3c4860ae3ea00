"""Taking back a turn that ended too soon (pipeline/stages/take_back.py): the caller goes on
speaking before the answer is heard, so their words are answered once, whole.

The call tests run on test_preemptive's script source (the audio's own clock, faster than
real time) with stand-ins for the models; each waits on the call's events, not on time.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from callfakes import ScriptedBackend, ScriptedSTT, assert_released, snapshot
from llm.types import TokenGroup
from pipeline.events import TurnEnd, event_callback
from pipeline.report import load_report
from pipeline.stages.take_back import takes_back
from pipeline.stages.turn_taking import TurnTaker
from pipeline.timeline import TurnTimeline
from pipeline.turn import Turn
from test_preemptive import RATE, StubTools, config, events, make_call, silence, tone
from voice.endpointer import SpeechEnded, SpeechStarted
from voice.turn_detector import TurnPolicy

# ---------------------------------------------------------------- the rule


def ended_turn(reason: str = "silence") -> Turn:
    utterance = SpeechEnded(np.zeros(RATE, np.float32), 1.0, 2.0, 3.0, "silence", 0.9)
    return Turn(index=0, timeline=TurnTimeline(index=0), end_of_turn=TurnEnd(utterance, reason))


def speech(start_t: float = 3.3, confirmed_after_s: float = 0.2) -> SpeechStarted:
    return SpeechStarted(start_t, start_t + confirmed_after_s)


def played(turn: Turn, out_t: float | None, audio_s: float = 0.5) -> Turn:
    turn.speech.audio_s = audio_s
    if out_t is not None:
        turn.timeline.mark("first_audio_out", out_t)
    return turn


def test_a_turn_whose_answer_nobody_heard_yet_is_taken_back():
    assert takes_back(ended_turn(), speech(), 0.5)
    assert takes_back(ended_turn("timeout"), speech(), 0.5)
    assert takes_back(ended_turn(), speech(2.99), 0.5)  # the next words began as the turn ended


def test_words_begun_long_after_the_end_are_a_turn_of_their_own():
    assert not takes_back(ended_turn(), speech(3.5), 0.5)  # the turn ended at 3.0 s
    assert takes_back(ended_turn(), speech(3.5), 0.6)


def test_an_answer_heard_for_less_than_the_window_before_the_caller_went_on_is_taken_back():
    # Out at 100.0; the caller's speech, 0.2 s long when declared at `now`, began at now - 0.2.
    assert takes_back(played(ended_turn(), 100.0), speech(), 0.5, now=100.6)  # heard 0.4 s before it
    assert not takes_back(played(ended_turn(), 100.0), speech(), 0.5, now=100.8)  # heard 0.6 s: a barge-in
    assert not takes_back(played(ended_turn(), 100.0), speech(confirmed_after_s=0.1), 0.5, now=100.7)


def test_played_audio_the_sink_did_not_stamp_counts_as_heard():
    assert not takes_back(played(ended_turn(), None), speech(), 0.5)


def test_a_turn_that_acted_a_window_of_zero_or_no_pause_is_never_taken_back():
    acted = ended_turn()
    acted.llm.acted_t = 5.0  # a booking made stays made: the turn is answered
    assert not takes_back(acted, speech(), 0.5)
    assert not takes_back(ended_turn(), speech(), 0.0)
    for reason in ("max_length", "flush"):  # the endpointer cut it or the stream ended: no pause
        assert not takes_back(ended_turn(reason), speech(), 0.5)
    once = ended_turn()
    once.taken_back_t = 9.0
    assert not takes_back(once, speech(), 0.5)


# ---------------------------------------------------------------- the turn-taker reopens it


def piece(start: float, seconds: float, value: float) -> SpeechEnded:
    audio = np.full(int(seconds * RATE), value, np.float32)
    return SpeechEnded(audio, start, start + seconds, start + seconds + 0.2, "silence", start)


@pytest.mark.parametrize("end_silence_s", [None, 1.0])
async def test_a_reopened_turn_ends_once_with_its_audio_then_the_new_words(end_silence_s):
    """Plain silence mode (every end of speech ends the turn) and silence mode with pauses."""
    turns = TurnTaker(None, TurnPolicy(), clock=lambda: 0.0, end_silence_s=end_silence_s)
    first = piece(1.0, 1.0, 0.1)
    (ended,) = await turns.on_event(first) if end_silence_s is None else [
        *(await turns.on_event(first)), turns.on_time(3.1)]
    assert isinstance(ended, TurnEnd) and not turns.pending
    await turns.on_event(SpeechStarted(3.3, 3.5))
    turns.reopen(ended)  # the caller went on before the answer was heard
    assert turns.pending
    second = piece(3.3, 0.5, 0.2)
    out = await turns.on_event(second)
    if end_silence_s is not None:
        assert out == [] and turns.on_time(4.0) is None  # a pause of the joined turn, not its end
        out = [turns.on_time(5.0)]
    (joined,) = out
    assert np.array_equal(joined.utterance.audio, np.concatenate([first.audio, second.audio]))
    assert joined.utterance.start_t == 1.0 and joined.utterance.last_voiced_t == second.last_voiced_t
    assert joined.pauses == 2 and not turns.pending


class SeenAudio:
    """Smart Turn stand-in: "complete" on any audio; records the length of each it was asked on."""

    def __init__(self):
        self.asked: list[int] = []

    def probability(self, audio: np.ndarray) -> float:
        self.asked.append(len(audio))
        return 0.95


async def test_with_an_end_of_turn_model_a_reopened_turn_is_asked_on_all_its_audio():
    model = SeenAudio()
    turns = TurnTaker(model, TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0)
    first = piece(1.0, 1.0, 0.1)
    (ended,) = await turns.on_event(first)
    assert ended.reason == "model"
    await turns.on_event(SpeechStarted(2.4, 2.6))
    turns.reopen(ended)
    second = piece(2.4, 0.5, 0.2)
    (joined,) = await turns.on_event(second)
    # The model's second answer was on both pieces, and the turn carries them both.
    assert model.asked == [len(first.audio), len(first.audio) + len(second.audio)]
    assert joined.reason == "model" and joined.pauses == 2 and joined.utterance.start_t == 1.0
    assert np.array_equal(joined.utterance.audio, np.concatenate([first.audio, second.audio]))


# ---------------------------------------------------------------- in a call


def length_stt(audio: np.ndarray) -> str:
    return f"Book {len(audio)} samples"


TOOL_CALL = '<tool_call>\n{"name": "book_slot", "arguments": {"slot": "Tuesday 10:30", "name": "Ann Lee"}}\n</tool_call>'
READ_CALL = '<tool_call>\n{"name": "check_slots", "arguments": {}}\n</tool_call>'


class PlannedBackend(ScriptedBackend):
    """Each generation does the next thing of `plan`: "wait" says nothing until it is
    cancelled (passes that do not finish before the caller goes on), "tool" books a slot
    before saying anything, "read" only reads the slots; past the plan, "We open at nine." Records each generation's
    messages and whether it ended cancelled."""

    def __init__(self, plan: list[str]):
        super().__init__()
        self.plan = list(plan)
        self.asked: list[list[dict]] = []
        self.cancelled: list[bool] = []

    async def stream(self, messages, params, cancel=None):
        self.opened += 1
        self.asked.append(messages)
        step = self.plan[len(self.asked) - 1] if len(self.asked) <= len(self.plan) else "answer"
        try:
            if step == "wait":
                while cancel is None or not cancel.is_set():
                    await asyncio.sleep(0)  # the cancel may be a preemption's Stop: read, not awaited
            self.cancelled.append(step == "wait")
            text = {"wait": "", "tool": TOOL_CALL, "read": READ_CALL}.get(step, "We open at nine.")
            yield TokenGroup((1,), text, 0, 0, finish_reason="cancelled" if step == "wait" else "eos")
        finally:
            self.closed += 1


def on_kind(call, kind: str) -> asyncio.Event:
    seen = asyncio.Event()
    call.events.subscribe(event_callback(lambda k, data: k == kind and seen.set()))
    return seen


@pytest.mark.parametrize("preemptive", [True, False])
async def test_a_caller_who_goes_on_before_the_answer_is_heard_is_answered_once_on_all_their_words(tmp_path,
                                                                                                 preemptive):
    backend, seen = PlannedBackend(["wait"]), {}
    before = snapshot()

    async def being_answered() -> None:
        await seen["transcript"].wait()  # the first part is transcribed and its answer begun

    log: list = []
    steps = [silence(0.3), tone(1.0), silence(1.3), being_answered, tone(0.6), silence(1.3)]
    call, _, sink = make_call(config(tmp_path, preemptive, mode="silence"), steps, backend, ScriptedSTT(length_stt),
                              None, log, end_silence_s=1.0)
    seen["transcript"] = on_kind(call, "transcript")
    report = await asyncio.wait_for(call.run(), 60)
    data = load_report(call.report_path)
    (taken,) = data["taken_back"]
    (turn,) = call.turns  # the line was answered once
    assert data["summary"]["taken_back"] == 1 and data["summary"]["turns"] == 1
    first_samples = int(taken["user_text"].split()[1])
    joined_samples = int(turn.user_text.split()[1])
    # The joined turn heard all of it: the first part's audio, then the second's.
    assert joined_samples > first_samples + int(0.6 * RATE)
    assert taken["before_turn"] == 0 and taken["agent_audio_s"] == 0 and taken["agent_text"] == ""
    assert taken["resumed_at"] is not None and taken["end_of_turn"]["reason"] == "silence"
    # Its answer stopped; the joined turn's was asked on the whole line, with nothing of
    # the taken-back turn in the history.
    assert backend.cancelled[0] is True and backend.cancelled[-1] is False
    assert backend.asked[-1][1:] == [{"role": "user", "content": turn.user_text}]
    assert call.history.exchanges == [(turn.user_text, "We open at nine.")]
    assert turn.heard_text == "We open at nine." and not turn.interrupted
    assert events(log, "turn_taken_back")[0]["user_text"] == taken["user_text"]
    assert events(log, "barge_in") == [] and call.barge_ins == 0
    assert report.end_reason == "completed" and backend.opened == backend.closed
    await assert_released(before)


async def test_with_take_back_off_the_caller_going_on_is_a_second_turn(tmp_path):
    backend, seen = PlannedBackend(["wait"]), {}

    async def being_answered() -> None:
        await seen["transcript"].wait()

    cfg = config(tmp_path, False, mode="silence")
    cfg = cfg.model_copy(update={"turn": cfg.turn.model_copy(update={"take_back_ms": 0})})
    steps = [silence(0.3), tone(1.0), silence(1.3), being_answered, tone(0.6), silence(1.3)]
    call, _, _ = make_call(cfg, steps, backend, ScriptedSTT(length_stt), None, end_silence_s=1.0)
    seen["transcript"] = on_kind(call, "transcript")
    await asyncio.wait_for(call.run(), 60)
    assert len(call.turns) == 2 and call.turns[0].interrupted and call.barge_ins == 1
    assert load_report(call.report_path)["taken_back"] == []


async def goes_on_after_a_tool(tmp_path, first: str):
    """A call whose first turn runs a tool (`first`: "tool" books, "read" reads the slots) and
    whose caller goes on once the tool's result is in; returns (call, backend, tools) after it."""
    backend, seen = PlannedBackend([first, "wait"]), {}

    async def tool_ran() -> None:
        await seen["tool_result"].wait()

    cfg = config(tmp_path, False, mode="silence")
    cfg = cfg.model_copy(update={"tools": cfg.tools.model_copy(update={"enabled": True, "hold_line": ""})})
    steps = [silence(0.3), tone(1.0), silence(1.3), tool_ran, tone(0.6), silence(1.3)]
    call, _, _ = make_call(cfg, steps, backend, ScriptedSTT(length_stt), None, end_silence_s=1.0)
    call.toolbox = tools = StubTools([])
    seen["tool_result"] = on_kind(call, "tool_result")
    await asyncio.wait_for(call.run(), 60)
    return call, backend, tools


async def test_a_turn_that_acted_is_answered_and_the_callers_words_are_a_barge_in(tmp_path):
    call, backend, tools = await goes_on_after_a_tool(tmp_path, "tool")
    assert tools.runs == 1 and call.turns[0].llm.acted_t is not None
    assert len(call.turns) == 2 and call.turns[0].interrupted and call.barge_ins == 1
    assert load_report(call.report_path)["taken_back"] == []
    # What the tool did stays known to the model: its round is in the history.
    assert any(m.get("role") == "tool" for m in backend.asked[-1])


async def test_a_turn_whose_tool_only_read_the_slots_is_still_taken_back(tmp_path):
    """Reading the slots changes nothing: the caller who goes on is answered once, whole."""
    call, _, tools = await goes_on_after_a_tool(tmp_path, "read")
    data = load_report(call.report_path)
    (turn,) = call.turns
    assert tools.runs == 1 and turn.llm.acted_t is None  # the read only; the joined turn ran none
    assert data["summary"]["taken_back"] == 1 and call.barge_ins == 0 and not turn.interrupted
    assert data["taken_back"][0]["before_turn"] == 0


class GateSTT(ScriptedSTT):
    """Its first transcription waits for the test's `release` (threads: STT runs in one)."""

    def __init__(self):
        super().__init__(length_stt)
        self.entered, self.release = threading.Event(), threading.Event()

    def transcribe(self, audio, *args, **kwargs):
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(60)
        return super().transcribe(audio, *args, **kwargs)


@pytest.mark.parametrize("preemptive", [True, False])
async def test_a_turn_taken_back_while_it_is_transcribed_never_reaches_the_llm(tmp_path, preemptive):
    backend, stt = PlannedBackend([]), GateSTT()

    async def transcribing() -> None:
        await asyncio.to_thread(stt.entered.wait, 60)

    async def release() -> None:
        stt.release.set()

    steps = [silence(0.3), tone(1.0), silence(1.3), transcribing, tone(0.6), release, silence(1.3)]
    call, _, _ = make_call(config(tmp_path, preemptive, mode="silence"), steps, backend, stt, None, end_silence_s=1.0)
    await asyncio.wait_for(call.run(), 60)
    data = load_report(call.report_path)
    (taken,) = data["taken_back"]
    (turn,) = call.turns
    assert taken["agent_text"] == "" and int(turn.user_text.split()[1]) > int(taken["user_text"].split()[1])
    # Only the joined turn was answered (a preemption the taken-back turn claimed was dropped).
    assert [m[1:] for m in backend.asked if m[-1]["content"] == turn.user_text] == [
        [{"role": "user", "content": turn.user_text}]]
    assert all(m[-1]["content"] == turn.user_text for m in backend.asked)
    assert backend.opened == backend.closed and not call.transcripts.busy
