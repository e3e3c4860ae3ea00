"""Preemptive generation (pipeline/stages/preempt.py) through whole calls: a scripted caller
(tone bursts and silences, on the audio's own clock), a scripted end-of-turn model, a
scripted STT, and either the real in-process engine on a tiny random Qwen2 or a scripted
backend. Every wait is on an event (the source holds its next frame until the preemptive
generation reached a point); nothing asserts on wall-clock time."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from callfakes import EnergyVAD, ScriptedBackend, ScriptedSTT, ToneTTS, WrappedBackend, assert_released, snapshot
from pipeline.call import Call
from pipeline.config import load_config
from pipeline.ports import AudioFrame
from pipeline.report import load_report
from pipeline.events import KeyPress, event_callback
from pipeline.stages.preempt import MAX_STARTS_PER_TURN
from pipeline.stages.turn_taking import TurnTaker
from voice.endpointer import EndpointConfig, Endpointer
from voice.turn_detector import TurnPolicy

RATE = 16000
FRAME = 320  # 20 ms


def tone(seconds: float) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 300 * np.arange(int(seconds * RATE)) / RATE)).astype(np.float32)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.float32)


class ScriptSource:
    """Caller audio from a script: arrays are spoken (20 ms frames, stamped on the audio's
    own clock), an async callable is awaited before the next frame (the caller "waits for"
    something the test names), "hangup" ends the call as a hang-up. Faster than real time."""

    def __init__(self, steps: list):
        self.steps = steps
        self.hangup = False
        self.end_reason = None
        self.frames = 0

    def __aiter__(self):
        return self._frames()

    async def _frames(self):
        for step in self.steps:
            if isinstance(step, str) and step == "hangup":
                self.hangup = True
                return
            if callable(step):
                await step()
                continue
            if isinstance(step, KeyPress):
                yield step
                continue
            for i in range(0, len(step), FRAME):
                pcm = np.zeros(FRAME, np.float32)
                chunk = step[i:i + FRAME]
                pcm[:len(chunk)] = chunk
                yield AudioFrame(pcm, 100.0 + self.frames * FRAME / RATE)
                self.frames += 1
                await asyncio.sleep(0)


class LogSink:
    """Records each play into the call's ordered log (with the end-of-turn events), so the
    test can tell what came before what."""

    def __init__(self, log: list):
        self.log = log
        self.played = 0
        self.playing = asyncio.Event()

    def play(self, chunk):
        self.played += 1
        self.playing.set()
        self.log.append(("play", self.played))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    def mark(self, name):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(True)
        return fut

    async def clear(self):
        pass

    async def aclose(self):
        pass


class LengthModel:
    """Smart Turn stand-in: incomplete until the turn holds more than `seconds` of audio
    (None: never complete, every pause waits for the maximum silence)."""

    def __init__(self, seconds: float | None = None):
        self.seconds = seconds

    def probability(self, audio: np.ndarray) -> float:
        return 0.95 if self.seconds is not None and len(audio) / RATE > self.seconds else 0.05


class SpyBackend(WrappedBackend):
    """Wraps a backend: records every stream's token ids and finish, counts streams running
    at once, and sets `reached` once the first stream yielded `after` groups."""

    def __init__(self, inner, after: int = 2):
        self.inner, self.after = inner, after
        self.streams: list[dict] = []
        self.active = self.max_active = 0
        self.reached = asyncio.Event()
        self.changed = asyncio.Event()  # set at every group and every stream's end

    async def stream(self, messages, params, cancel=None):
        rec = {"messages": messages, "tokens": [], "text": "", "finish": None, "closed": False}
        self.streams.append(rec)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            async for group in self.inner.stream(messages, params, cancel):
                rec["tokens"] += list(group.token_ids)
                rec["text"] += group.text
                rec["finish"] = group.finish_reason or rec["finish"]
                if len(self.streams) == 1 and len(rec["tokens"]) >= self.after:
                    self.reached.set()
                self.changed.set()
                yield group
        finally:
            rec["closed"] = True
            self.active -= 1
            self.changed.set()

    async def wait_finished(self, n: int) -> None:
        """Until the n-th stream has yielded its last group (its generation finished)."""
        while not (len(self.streams) >= n and self.streams[n - 1]["finish"] is not None):
            self.changed.clear()
            await self.changed.wait()


def config(tmp_path, preemptive: bool = True, mode: str = "smart_turn", plan: bool = False):
    cfg = load_config("test")
    return cfg.model_copy(update={
        "report": cfg.report.model_copy(update={"dir": str(tmp_path / "reports")}),
        "turn": cfg.turn.model_copy(update={"mode": mode, "preemptive": preemptive}),
        "agent": cfg.agent.model_copy(update={"system_prompt": "You answer the phone."}),
        "tools": cfg.tools.model_copy(update={"enabled": plan, "plan": plan}),
    })


def make_call(cfg, steps, backend, stt, model, log: list | None = None,
              end_silence_s: float | None = None, tts=None, greeting: str = "",
              words_end_threshold: float = 0.0,
              words_done_silence_s: float | None = None) -> tuple[Call, ScriptSource, LogSink]:
    """A call on the script. `model` None and `end_silence_s`: silence mode with pauses
    (200 ms, the turn ends at `end_silence_s`); `model` None alone: plain silence mode, the
    endpointer's 500 ms end the turn."""
    log = log if log is not None else []
    source, sink = ScriptSource(steps), LogSink(log)
    plain_silence = model is None and end_silence_s is None
    endpointer = Endpointer(EnergyVAD(), EndpointConfig(min_speech_ms=64, min_silence_ms=500 if plain_silence else 200,
                                                        pre_roll_ms=64, post_roll_ms=32))
    # The audio's own clock decides (clock 0): the same turns whatever this machine's speed.
    turns = TurnTaker(model, TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0,
                      end_silence_s=end_silence_s, words_end_threshold=words_end_threshold,
                      words_done_threshold=0.5, words_done_silence_s=words_done_silence_s)
    call = Call(cfg, source, sink, stt=stt, tts=tts or ToneTTS(chunks=1, chunk_s=0.02), backend=backend,
                endpointer=endpointer, turns=turns, mqtt=None, greeting=greeting,
                on_event=lambda kind, data: log.append((kind, data)))
    return call, source, sink


def seconds_stt(audio: np.ndarray) -> str:
    """A transcript that names the audio's length: other audio, other words."""
    return f"I would like {len(audio) / RATE:.1f} seconds of cleaning"


@pytest.fixture(scope="module")
def tiny_engine(tiny_models):
    from llm.engine import SpeculativeEngine

    return SpeculativeEngine.load(tiny_models["target"], None, drafter="ngram", gamma=4, dtype="float32",
                                  calibrate=False)


def engine_backend(engine):
    from llm.backend import SpeculativeBackend

    return SpeculativeBackend(engine)


def events(log, kind):
    return [data for k, data in log if k == kind]


# ---------------------------------------------------------------- the turn-taker's pending pauses


async def test_a_waiting_pause_is_announced_with_the_audio_its_turn_end_will_carry():
    from pipeline.stages.preempt import same_audio
    from pipeline.events import TurnPending
    from voice.endpointer import SpeechEnded, SpeechStarted

    def piece(start, end):
        return SpeechEnded(tone(end - start), start, end, end + 0.2, "silence", start)

    quiet = TurnTaker(LengthModel(None), TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0)
    assert await quiet.on_event(piece(0.0, 1.0)) == []  # not asked to announce: as before
    t = TurnTaker(LengthModel(None), TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0,
                  announce_pauses=True)
    (first,) = await t.on_event(piece(0.0, 1.0))
    assert isinstance(first, TurnPending) and first.pauses == 1 and len(first.audio) == RATE
    await t.on_event(SpeechStarted(1.5, 1.6))
    (second,) = await t.on_event(piece(1.5, 2.0))
    assert second.pauses == 2 and len(second.audio) == int(1.5 * RATE)
    end = t.on_time(2.0 + 1.5)
    assert end is not None and end.reason == "timeout"
    assert same_audio(second, end) and not same_audio(first, end)


async def test_silence_mode_with_pauses_announces_each_pause_and_ends_at_the_full_silence():
    """No end-of-turn model: the endpointer's 200 ms pauses are announced (the answer can
    start there) and the turn ends at the endpoint silence (0.5 s) on the last pause's audio."""
    from pipeline.events import TurnPending
    from pipeline.stages.preempt import same_audio
    from voice.endpointer import SpeechEnded, SpeechStarted

    def piece(start, end):
        return SpeechEnded(tone(end - start), start, end, end + 0.2, "silence", start)

    policy = TurnPolicy(check_silence_s=0.2, max_silence_s=1.5)
    t = TurnTaker(None, policy, clock=lambda: 0.0, announce_pauses=True, end_silence_s=0.5)
    (first,) = await t.on_event(piece(0.0, 1.0))
    assert isinstance(first, TurnPending) and first.probability is None and t.pending
    assert t.on_time(1.0 + 0.45) is None  # 450 ms of silence: still the caller's turn
    await t.on_event(SpeechStarted(1.45, 1.5))
    assert t.on_time(1.0 + 0.6) is None  # speaking again
    (second,) = await t.on_event(piece(1.45, 2.0))
    end = t.on_time(2.0 + 0.5)
    assert end is not None and end.reason == "silence" and end.pauses == 2
    assert end.utterance.declared_t == 2.5 and end.utterance.last_voiced_t == 2.0
    assert same_audio(second, end) and not same_audio(first, end)
    # With on_pause set, the pause goes there instead of out.
    seen = []
    t.on_pause = seen.append
    assert await t.on_event(piece(3.0, 4.0)) == [] and [p.pauses for p in seen] == [1]
    # Without end_silence_s: every end of speech ends the turn, as always.
    plain = TurnTaker(None, policy, clock=lambda: 0.0, announce_pauses=True)
    (ended,) = await plain.on_event(piece(0.0, 1.0))
    assert ended.reason == "silence" and not plain.pending


async def _turn_ends(steps: list, end_silence_s: float = 1.0) -> list:
    """The TurnEnds of `steps` through the endpointer (200 ms pauses, EnergyVAD) and a
    silence-mode turn-taker that ends a turn at `end_silence_s`."""
    from pipeline.events import TurnEnd
    from pipeline.stages.listen import listen

    endpointer = Endpointer(EnergyVAD(), EndpointConfig(min_silence_ms=200, min_speech_ms=200))
    turns = TurnTaker(None, TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), announce_pauses=True,
                      end_silence_s=end_silence_s)
    return [e async for e in listen(ScriptSource(steps), endpointer, turns) if isinstance(e, TurnEnd)]


async def test_a_turn_does_not_end_while_the_callers_next_words_are_starting():
    """The silence runs out 60 ms after the caller went on: the endpointer needs 200 ms of
    voice to call it speech, and the turn waits for that instead of ending (as espeak-ng's
    "a cleaning for | next Tuesday" was cut in two: a 0.75 s gap the VAD heard as 0.99 s)."""
    ends = await _turn_ends([silence(0.3), tone(1.0), silence(0.95), tone(1.0), silence(1.5)])
    assert len(ends) == 1
    (end,) = ends
    assert end.pauses == 2 and end.reason == "silence"
    assert end.utterance.duration > 2.0  # both pieces of speech, one turn


async def test_a_syllable_that_broke_off_then_words_just_after_the_silence_ran_out_are_one_turn():
    """The espeak-ng line as the VAD heard it: a first syllable of 100 ms (not speech: under
    min_speech_ms) 0.7 s into the pause, and the words themselves from 10 ms before the
    silence runs out, their first chunk complete only after it: the turn waits on the voice
    it heard since the pause and the caller's words join it."""
    ends = await _turn_ends([silence(0.3), tone(1.0), silence(0.7), tone(0.1), silence(0.21), tone(1.0),
                             silence(1.5)])
    assert len(ends) == 1
    assert ends[0].pauses == 2 and ends[0].utterance.duration > 2.0


async def test_a_click_at_the_end_of_the_silence_delays_the_end_a_moment_and_is_no_turn():
    ends = await _turn_ends([silence(0.3), tone(1.0), silence(0.95), tone(0.05), silence(1.5)])
    assert len(ends) == 1  # the click is not speech: no second turn, nothing of it in the turn
    (end,) = ends
    u = end.utterance
    assert end.pauses == 1 and end.reason == "silence"
    # Held voice_hold_s (0.3 s) past the click's last chunk, which ends just before the
    # silence runs out; at most onset_wait_s (0.4 s) past it. Without the hold: ~1.01 s.
    assert 1.0 + 0.2 < u.declared_t - u.last_voiced_t <= 1.0 + 0.4


async def test_voice_since_the_pause_holds_a_silence_that_ran_out_while_it_lasts_and_no_longer():
    from voice.endpointer import SpeechEnded

    def waiting() -> TurnTaker:
        return TurnTaker(None, TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), announce_pauses=True,
                         end_silence_s=1.0, voice_hold_s=0.3, onset_wait_s=0.4)

    t = waiting()
    await t.on_event(SpeechEnded(tone(1.0), 0.0, 1.0, 1.2, "silence", 0.0))
    assert t.on_time(1.5, voice_t=1.45) is None  # the silence has not run out
    assert t.on_time(2.0, voice_t=1.9) is None  # it ran out 0.1 s after voice
    end = t.on_time(2.25, voice_t=1.9)  # the voice stopped 0.35 s ago: a click, the turn ends
    assert end is not None and end.reason == "silence" and end.utterance.declared_t == 2.25

    t = waiting()
    await t.on_event(SpeechEnded(tone(1.0), 0.0, 1.0, 1.2, "silence", 0.0))
    assert t.on_time(2.0, voice_t=1.98) is None
    assert t.on_time(2.2, voice_t=2.18) is None  # voice goes on, not yet speech
    assert t.on_time(2.36, voice_t=2.34) is None
    end = t.on_time(2.42, voice_t=2.4)  # held 0.42 s: past onset_wait_s, voice or not
    assert end is not None and end.utterance.declared_t == 2.42
    assert t.on_time(2.42, voice_t=None) is None  # nothing left waiting
    # Without voice since the pause the silence ends the turn at once, as before.
    t = waiting()
    await t.on_event(SpeechEnded(tone(1.0), 0.0, 1.0, 1.2, "silence", 0.0))
    assert t.on_time(2.0).utterance.declared_t == 2.0


async def test_silence_mode_waits_longer_when_the_pause_words_leave_the_sentence_open():
    """Silence mode with pauses: at the full silence the turn ends, unless the words heard
    at the pause (heard(), from the preemptive start's STT) end on "for next": then it
    waits up to max_silence_s; so do words that end on a comma. Words of other audio (the
    caller spoke since) do not count."""
    from voice.endpointer import SpeechEnded, SpeechStarted

    def piece(start, end):
        return SpeechEnded(tone(end - start), start, end, end + 0.2, "silence", start)

    def taker():
        return TurnTaker(None, TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0,
                         announce_pauses=True, end_silence_s=0.5)

    t = taker()
    await t.on_event(piece(0.0, 1.0))
    t.heard(RATE, "I would like a cleaning for next")
    assert t.on_time(1.0 + 0.5) is None and t.on_time(1.0 + 1.4) is None  # "next ...": still theirs
    end = t.on_time(1.0 + 1.5)
    assert end is not None and end.reason == "timeout"
    t = taker()
    await t.on_event(piece(0.0, 1.0))
    t.heard(RATE, "And it is worth mention in passing,")  # a comma where the voice went on
    assert t.on_time(1.0 + 1.4) is None
    assert t.on_time(1.0 + 1.5).reason == "timeout"
    t = taker()
    await t.on_event(piece(0.0, 1.0))
    t.heard(RATE, "I would like a cleaning on Tuesday.")
    end = t.on_time(1.0 + 0.5)
    assert end is not None and end.reason == "silence"
    t = taker()
    await t.on_event(piece(0.0, 1.0))
    t.heard(RATE // 2, "I would like a cleaning for next")  # of half the audio: not these words
    assert t.on_time(1.0 + 0.5) is not None
    t = taker()
    await t.on_event(piece(0.0, 1.0))
    await t.on_event(SpeechStarted(1.3, 1.35))
    t.heard(RATE, "I would like a cleaning for next")  # the caller speaks again: too late
    await t.on_event(piece(1.3, 2.0))
    assert t.on_time(2.0 + 0.5) is not None


async def test_silence_mode_waits_longer_when_the_llm_scores_the_pause_words_as_unfinished():
    """Silence mode with pauses: a pause whose words the LLM scores below the threshold
    (words_ended: "Do you accept?" from a caller who stopped after "accept") waits up to
    max_silence_s; a score above it, one of other audio, or no threshold, does not."""
    from voice.endpointer import SpeechEnded

    def taker(threshold=0.005):
        return TurnTaker(None, TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0,
                         announce_pauses=True, end_silence_s=0.5, words_end_threshold=threshold)

    async def pending(t):
        await t.on_event(SpeechEnded(tone(1.0), 0.0, 1.0, 1.2, "silence", 0.0))
        t.heard(RATE, "Do you accept?")
        return t

    t = await pending(taker())
    t.words_ended(RATE, 0.0002)
    assert t.on_time(1.0 + 0.5) is None and t.on_time(1.0 + 1.4) is None
    end = t.on_time(1.0 + 1.5)
    assert end.reason == "timeout" and end.words_end == 0.0002
    t = await pending(taker())
    t.words_ended(RATE, 0.9)
    end = t.on_time(1.0 + 0.5)
    assert end.reason == "silence" and end.words_end == 0.9
    t = await pending(taker())
    t.words_ended(RATE // 2, 0.0002)  # of half the audio: not these words
    assert t.on_time(1.0 + 0.5).words_end is None
    t = await pending(taker(0.0))  # off
    t.words_ended(RATE, 0.0002)
    assert t.on_time(1.0 + 0.5).reason == "silence"


async def test_silence_mode_ends_sooner_when_the_llm_scores_the_pause_words_as_the_end():
    """Silence mode with pauses: a pause whose words close the sentence and that the LLM
    scores at least words_done_threshold ("What is your address?") ends the turn at
    words_done_silence_s (reason "words_end"), not end_silence_s; a score below it, words
    that leave the sentence open, a score of other audio, or the early end off, wait the
    whole silence."""
    from voice.endpointer import SpeechEnded

    def taker(done_s=0.3):
        return TurnTaker(None, TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0,
                         announce_pauses=True, end_silence_s=0.5, words_end_threshold=0.005,
                         words_done_threshold=0.5, words_done_silence_s=done_s)

    async def pending(t, words="What is your address?"):
        await t.on_event(SpeechEnded(tone(1.0), 0.0, 1.0, 1.2, "silence", 0.0))
        t.heard(RATE, words)
        return t

    t = await pending(taker())
    t.words_ended(RATE, 0.88)
    assert t.on_time(1.0 + 0.28) is None  # not before words_done_silence_s
    end = t.on_time(1.0 + 0.3)
    assert end.reason == "words_end" and end.words_end == 0.88 and not t.pending
    assert end.utterance.declared_t == 1.3
    t = await pending(taker())
    t.words_ended(RATE, 0.3)  # a closed sentence the LLM doubts: the whole silence
    assert t.on_time(1.0 + 0.3) is None and t.on_time(1.0 + 0.49) is None
    assert t.on_time(1.0 + 0.5).reason == "silence"
    t = await pending(taker(), "I would like a cleaning for next")  # open: never scored so high, but
    t.words_ended(RATE, 0.9)                                          # the words decide first
    assert t.on_time(1.0 + 0.3) is None and t.on_time(1.0 + 1.4) is None
    t = await pending(taker())
    t.words_ended(RATE // 2, 0.9)  # of half the audio: not these words
    assert t.on_time(1.0 + 0.3) is None and t.on_time(1.0 + 0.5).reason == "silence"
    t = await pending(taker(None))  # off
    t.words_ended(RATE, 0.9)
    assert t.on_time(1.0 + 0.3) is None and t.on_time(1.0 + 0.5).reason == "silence"


def test_the_early_end_must_come_before_the_end_of_turn_and_after_a_pause(tmp_path):
    """turn.words_done_silence_ms: 0 is off (the default); otherwise between turn.pause_ms
    and vad.end_silence_ms, else a config error naming the keys (not a setting that
    silently never acts); in range, the turn-taker gets it in seconds."""
    from pipeline.agent import turn_taker
    from pipeline.config import ConfigError

    def write(early_ms: int):
        path = tmp_path / f"early-{early_ms}.toml"
        path.write_text(f'base = "default"\n[vad]\nend_silence_ms = 1000\n[turn]\nwords_done_silence_ms = {early_ms}\n')
        return path

    assert load_config("default").turn.words_done_silence_ms == 0
    assert turn_taker(load_config("default"), None).words_done_silence_s is None
    assert turn_taker(load_config(write(600)), None).words_done_silence_s == 0.6
    with pytest.raises(ConfigError, match=r"turn.words_done_silence_ms \(1000\) must be shorter than vad.end_silence_ms"):
        load_config(write(1000))
    with pytest.raises(ConfigError, match="at least turn.pause_ms"):
        load_config(write(100))


class EndScoringBackend(ScriptedBackend):
    """A scripted backend that scores the caller's words as SpeculativeBackend does, from
    the stream's cancel (`words_end`), from a table; it records what it was asked."""

    scores_words_end = True

    def __init__(self, scores: dict[str, float], groups: list[str]):
        super().__init__(groups)
        self.scores, self.scored = scores, []
        self.reported = asyncio.Event()

    async def wait_scored(self, n: int) -> None:
        while len(self.scored) < n:
            self.reported.clear()
            await self.reported.wait()

    async def stream(self, messages, params, cancel=None):
        request = getattr(cancel, "words_end", None)
        if request is not None:
            words = request.messages[-1]["content"]
            assert request.messages[:-1] == messages[:len(request.messages) - 1]  # the stream's own history
            reporter = threading.Thread(target=request.report, args=(self.scores[words],))  # the engine's thread
            reporter.start()
            reporter.join()
            self.scored.append(words)  # the turn-taker is told before anyone waiting on this
            self.reported.set()
        async for group in super().stream(messages, params, cancel):
            yield group


@pytest.mark.parametrize("score, turns", [(0.0002, 1), (0.9, 2)])
async def test_a_call_in_silence_mode_keeps_words_the_llm_scores_unfinished_in_one_turn(tmp_path, score, turns):
    """The call wires the LLM's score of the pause's words to the turn-taker: "Do you
    accept?" at a 0.9 s pause (longer than the 0.5 s end of turn), scored as unlikely to
    end the message, then "Aetna": one turn with all the words. Scored as an end: two
    turns. The LLM scores the words without their final mark; the turn's report has it."""
    whole = "Do you accept Aetna?"
    stt = ScriptedSTT(lambda audio: "Do you accept?" if len(audio) < 1.5 * RATE else whole)
    backend = EndScoringBackend({"Do you accept": score, "Do you accept Aetna": 0.9}, ["Yes."])

    async def first_scored() -> None:
        await backend.wait_scored(1)

    async def second_scored() -> None:  # the last pause's: "... Aetna"
        await backend.wait_scored(2)

    async def answered() -> None:  # two turns: the caller hears the first answer out, then speaks
        await call.wait_turns(1)

    cfg = config(tmp_path, True, "silence")
    cfg = cfg.model_copy(update={"turn": cfg.turn.model_copy(update={"words_end_threshold": 0.005})})
    then = [tone(0.8), silence(0.25), second_scored, silence(2.0)] if turns == 1 else [answered, tone(0.8), silence(2.0)]
    call, _, _ = make_call(cfg, [silence(0.3), tone(1.0), silence(0.25), first_scored, silence(0.65), *then],
                           backend, stt, None, end_silence_s=0.5, words_end_threshold=0.005)
    await asyncio.wait_for(call.run(), 120)
    assert backend.scored[0] == "Do you accept"
    assert len(call.turns) == turns
    (first, *_) = load_report(call.report_path)["turns"]
    if turns == 1:
        assert call.turns[0].user_text == whole
        assert first["end_of_turn"]["words_end"] == 0.9  # the last pause's words: "... Aetna"
    else:
        assert call.turns[0].user_text == "Do you accept?" and first["end_of_turn"]["words_end"] == 0.9


@pytest.mark.parametrize("score, reason", [(0.9, "words_end"), (0.1, "silence")])
async def test_a_call_in_silence_mode_ends_the_turn_sooner_on_words_the_llm_scores_as_the_end(tmp_path, score,
                                                                                               reason):
    """The call wires the LLM's score to the early end: "What is your address?" scored 0.9
    ends the turn at words_done_silence_s (0.35 s of silence, on the audio's own clock), one
    scored 0.1 at end_silence_s (0.5 s); the preemptive answer is kept either way, and the
    report says how the turn ended and with what score."""
    stt = ScriptedSTT(lambda audio: "What is your address?")
    backend = EndScoringBackend({"What is your address": score}, ["42 Harbor Street."])

    async def scored() -> None:
        await backend.wait_scored(1)

    cfg = config(tmp_path, True, "silence")
    call, _, _ = make_call(cfg, [silence(0.3), tone(1.0), silence(0.25), scored, silence(1.0)],
                           backend, stt, None, end_silence_s=0.5, words_end_threshold=0.005,
                           words_done_silence_s=0.35)
    await asyncio.wait_for(call.run(), 120)
    assert backend.scored == ["What is your address"]
    assert [t.user_text for t in call.turns] == ["What is your address?"]
    (turn,) = load_report(call.report_path)["turns"]
    assert turn["end_of_turn"]["reason"] == reason and turn["end_of_turn"]["words_end"] == score
    assert turn["preemptive_hit"] is True
    delay = turn["metrics"]["eot_delay"]
    assert (0.35 <= delay < 0.45) if reason == "words_end" else (0.5 <= delay < 0.6)


@pytest.mark.parametrize("first_words, turns", [("I would like a cleaning for next", 1),
                                                ("I would like a cleaning.", 2)])
async def test_a_call_in_silence_mode_keeps_a_sentence_open_at_the_pause_in_one_turn(tmp_path, first_words, turns):
    """The call wires the preemptive start's transcript to the turn-taker: "... for next",
    a 0.9 s pause (longer than the 0.5 s end of turn), "Tuesday morning": one turn, whose
    words are all of it. Words that close the sentence: the pause ends the turn (two)."""
    whole = "I would like a cleaning for next Tuesday morning."
    stt = ScriptedSTT(lambda audio: first_words if len(audio) < 1.5 * RATE else whole)

    async def pause_heard() -> None:
        await asyncio.shield(call.transcripts.preemptor.current.transcript)

    cfg = config(tmp_path, True, "silence")  # the turn-taker's decision alone: no take-back of a turn
    cfg = cfg.model_copy(update={"turn": cfg.turn.model_copy(update={"take_back_ms": 0})})  # (test_take_back.py)
    call, _, _ = make_call(cfg,
                           [silence(0.3), tone(1.0), silence(0.25), pause_heard, silence(0.65), tone(0.8), silence(2.0)],
                           ScriptedBackend(["Sure."]), stt, None, end_silence_s=0.5)
    await asyncio.wait_for(call.run(), 120)
    assert len(call.turns) == turns
    if turns == 1:
        assert call.turns[0].user_text == whole and call.turns[0].end_of_turn.reason == "silence"


async def test_with_on_pause_the_answer_starts_before_the_model_is_asked():
    """Smart Turn mode: the pause is handed to on_pause first, the model asked after it, and
    a "complete" ends the turn on the very audio the pause carried."""
    from pipeline.events import TurnEnd
    from pipeline.stages.preempt import same_audio
    from voice.endpointer import SpeechEnded

    order = []

    class Complete:
        def probability(self, audio):
            order.append("model")
            return 0.95

    t = TurnTaker(Complete(), TurnPolicy(check_silence_s=0.2, max_silence_s=1.5), clock=lambda: 0.0,
                  announce_pauses=True)
    pauses = []
    t.on_pause = lambda p: (order.append("pause"), pauses.append(p))
    (end,) = await t.on_event(SpeechEnded(tone(1.0), 0.0, 1.0, 1.25, "silence", 0.0))
    assert order == ["pause", "model"] and isinstance(end, TurnEnd) and end.reason == "model"
    assert same_audio(pauses[0], end)


# ---------------------------------------------------------------- (1) kept == not preempted


async def test_kept_preemption_is_token_identical_and_nothing_plays_before_the_turn_ends(tmp_path, tiny_engine):
    """Two turns, each a pause the model calls incomplete, then the maximum silence: with
    preemption the answers are generated while the caller is silent and kept; without,
    generated after the turn ends. Same text, same tokens; and no audio before each end."""

    calls: list[Call] = []

    async def first_turn_done() -> None:
        # The next line comes once the first answer was given (not over it: no barge-in).
        await calls[-1].wait_turns(1)
        if (task := calls[-1]._turn_task) is not None:
            await asyncio.wait({task})

    def caller(wait):
        return [silence(0.3), tone(1.0), silence(0.4), wait, silence(1.6), first_turn_done,
                tone(0.8), silence(0.4), wait, silence(1.6)]

    spy_log: list = []
    spy = SpyBackend(engine_backend(tiny_engine), after=1)
    waits = []

    async def buffered_whole_answer() -> None:
        # The preemptive generation of this pause has finished: the whole answer is ready,
        # and still nothing of it has been played.
        n, since = len(waits), len(spy_log)
        waits.append(n)
        await spy.wait_finished(n + 1)
        assert not any(k == "play" for k, _ in spy_log[since:]), spy_log[since:]

    call, _, sink = make_call(config(tmp_path / "pre"), caller(buffered_whole_answer), spy, ScriptedSTT(seconds_stt),
                              LengthModel(None), spy_log)
    calls.append(call)
    await asyncio.wait_for(call.run(), 120)

    async def no_wait() -> None:
        pass

    base = SpyBackend(engine_backend(tiny_engine))
    plain, _, _ = make_call(config(tmp_path / "plain", preemptive=False), caller(no_wait), base,
                            ScriptedSTT(seconds_stt), LengthModel(None))
    calls.append(plain)
    await asyncio.wait_for(plain.run(), 120)

    assert [t.user_text for t in call.turns] == [t.user_text for t in plain.turns]
    assert len(call.turns) == 2 and call.turns[0].user_text != call.turns[1].user_text
    assert [t.agent_text for t in call.turns] == [t.agent_text for t in plain.turns]
    assert all(t.agent_text for t in call.turns)
    # One generation per turn in both calls (the preemptive ones were kept, none redone).
    assert len(spy.streams) == len(base.streams) == 2 and spy.max_active == 1
    assert [s["tokens"] for s in spy.streams] == [s["tokens"] for s in base.streams]
    assert [s["messages"] for s in spy.streams] == [s["messages"] for s in base.streams]
    assert [e["why"] for e in events(spy_log, "preemptive_discarded")] == []
    assert len(events(spy_log, "preemptive_kept")) == 2
    # STT ran once per turn: the turn reused the pause's transcript.
    assert call.stt.calls == 2
    # (5) nothing was played before each turn's end.
    ends = [i for i, (k, _) in enumerate(spy_log) if k == "end_of_turn"]
    plays = [i for i, (k, _) in enumerate(spy_log) if k == "play"]
    starts = [i for i, (k, _) in enumerate(spy_log) if k == "preemptive_start"]
    assert len(ends) == 2 and len(starts) == 2 and plays and plays[0] > ends[0]
    assert not [i for i in plays if starts[1] < i < ends[1]]  # turn 2: nothing between its start and its end
    assert [i for i in plays if ends[0] < i < starts[1]] and [i for i in plays if i > ends[1]]
    report = load_report(call.report_path)
    assert [t["preemptive_hit"] for t in report["turns"]] == [True, True]
    assert [e["event"] for e in report["turns"][0]["preemptive"]["events"]] == ["start", "llm_start", "kept"]
    assert report["summary"]["preemptive"] == {"turns": 2, "starts": 2, "hits": 2, "hit_rate": 1.0, "discarded": {}}
    assert report["turns"][0]["metrics"]["eot_delay"] == report["turns"][0]["metrics"]["endpoint_delay"]
    assert "preemptive_hit" not in load_report(plain.report_path)["turns"][0]


# ---------------------------------------------------------------- (2) discarded, then the real answer


class HoldAfter:
    """The engine's pass lock: the first `passes` acquisitions go through, later ones wait
    for `release` (a threading.Event the test sets)."""

    def __init__(self, inner, passes: int):
        self.inner, self.passes = inner, passes
        self.release = threading.Event()
        self.taken = 0

    def __enter__(self):
        self.taken += 1
        if self.taken > self.passes:
            self.release.wait(60)
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


async def test_discarded_start_then_the_final_answer_equals_a_plain_turn(tmp_path, tiny_engine):
    """The caller pauses (incomplete: a preemptive generation starts and produces tokens),
    speaks on (discarded), and ends with a complete turn (a second start, at that last
    pause, beside the model's "complete": kept): the answer on the final transcript is
    token-identical to a call without preemption, although the engine reused the
    discarded generation's K/V for the common prefix."""
    # The engine runs the prefill and one pass, then waits until the start is discarded: the
    # caller speaks on while the generation is still going, on any CPU.
    lock = HoldAfter(tiny_engine.lock, passes=2)
    spy = SpyBackend(engine_backend(dataclasses.replace(tiny_engine, lock=lock)), after=2)

    async def some_tokens() -> None:
        await spy.reached.wait()

    steps = [silence(0.3), tone(1.0), silence(0.4), some_tokens, tone(0.8), silence(0.6)]
    log: list = []

    def on_log(kind: str) -> None:
        if kind == "preemptive_discarded":
            lock.release.set()

    call, _, _ = make_call(config(tmp_path / "pre"), steps, spy, ScriptedSTT(seconds_stt), LengthModel(1.5), log)
    call.events.subscribe(event_callback(lambda kind, data: on_log(kind)))  # beside make_call's log
    await asyncio.wait_for(call.run(), 120)

    async def no_wait() -> None:
        pass

    base = SpyBackend(engine_backend(tiny_engine))
    plain, _, _ = make_call(config(tmp_path / "plain", preemptive=False),
                            [silence(0.3), tone(1.0), silence(0.4), no_wait, tone(0.8), silence(0.6)], base,
                            ScriptedSTT(seconds_stt), LengthModel(1.5))
    await asyncio.wait_for(plain.run(), 120)

    (turn,) = call.turns
    (plain_turn,) = plain.turns
    discarded, final = spy.streams
    # Stopped mid-answer by the cancel (between passes), not run to its end.
    assert len(discarded["tokens"]) >= 2 and discarded["finish"] == "cancelled" and discarded["closed"]
    assert [e["why"] for e in events(log, "preemptive_discarded")] == ["caller_resumed"]
    assert turn.user_text == plain_turn.user_text and discarded["messages"][-1]["content"] != turn.user_text
    assert final["messages"] == base.streams[0]["messages"]
    assert final["tokens"] == base.streams[0]["tokens"] and turn.agent_text == plain_turn.agent_text
    # The final prompt's prefill reused the discarded generation's K/V (its common prefix).
    assert turn.stats.prefilled_tokens < plain_turn.stats.prefilled_tokens
    entry = load_report(call.report_path)["turns"][0]
    assert entry["preemptive_hit"] is True
    assert [e["event"] for e in entry["preemptive"]["events"]] == ["start", "llm_start", "discarded", "start",
                                                                   "llm_start", "kept"]

    # And the conversation stays exact afterwards: a next generation on it equals a fresh one.
    from llm.types import SamplingParams

    params = SamplingParams(max_new_tokens=12)
    msgs = final["messages"] + [{"role": "assistant", "content": turn.agent_text},
                                {"role": "user", "content": "And on Friday?"}]
    conv = spy.inner.conversation
    prompt = tiny_engine.chat_prompt(msgs)
    reused = [t for g in tiny_engine.stream(prompt, params, conv) for t in g.token_ids]
    fresh = [t for g in tiny_engine.stream(prompt, params, tiny_engine.new_conversation()) for t in g.token_ids]
    assert reused == fresh


async def test_silence_mode_answers_at_the_pause_and_keeps_it_token_identical(tmp_path, tiny_engine, monkeypatch):
    """The default turn ending (silence) with preemption: the answer starts at the 200 ms
    pause, is finished before the 500 ms end of turn, kept, and token for token the answer
    of a call that waits for the end; nothing is played before the end. Its passes went to
    the engine as background work until the turn ended (llm/scheduler.py priority)."""
    stt = ScriptedSTT("What time do you open on Saturday?")
    log: list = []
    spy = SpyBackend(engine_backend(tiny_engine))
    flags: list[bool] = []
    sched = tiny_engine.scheduler
    run = sched.run

    def recording_run(prepare, finish, hint=None, background=False, **kw):
        flags.append(background() if callable(background) else background)  # as it is at submission
        return run(prepare, finish, hint, background, **kw)

    monkeypatch.setattr(sched, "run", recording_run)
    held = []

    async def answer_buffered() -> None:
        await spy.wait_finished(1)
        assert not any(k in ("play", "end_of_turn") for k, _ in log)
        held.append(call.transcripts.preemptor.current)
        assert held[0].stop.background and flags and all(flags)

    call, _, _ = make_call(config(tmp_path / "pre", True, "silence"), [silence(0.3), tone(1.0), silence(0.3),
                           answer_buffered, silence(0.6)], spy, stt, None, log, end_silence_s=0.5)
    await asyncio.wait_for(call.run(), 120)
    pre_flags = list(flags)
    flags.clear()

    async def no_wait() -> None:
        pass

    base = SpyBackend(engine_backend(tiny_engine))
    plain, _, _ = make_call(config(tmp_path / "plain", False, "silence"),
                            [silence(0.3), tone(1.0), silence(0.3), no_wait, silence(0.6)], base, stt, None)
    await asyncio.wait_for(plain.run(), 120)
    assert held[0].kept and not held[0].stop.background  # foreground once the turn ended
    assert pre_flags and all(pre_flags)  # every pass of the answer ran before the end: background
    assert flags and not any(flags)  # the plain call's passes: foreground
    (turn,), (plain_turn,) = call.turns, plain.turns
    assert len(spy.streams) == 1 and spy.streams[0]["tokens"] == base.streams[0]["tokens"]
    assert turn.agent_text == plain_turn.agent_text and turn.agent_text
    entry = load_report(call.report_path)["turns"][0]
    assert entry["preemptive_hit"] is True and entry["end_of_turn"]["reason"] == "silence"
    kinds = [k for k, _ in log]
    assert kinds.index("end_of_turn") < kinds.index("preemptive_kept") < kinds.index("play")
    assert "preemptive_hit" not in load_report(plain.report_path)["turns"][0]  # no preemption in that call


async def test_words_prefilled_while_the_caller_speaks_leave_the_answer_token_identical(tmp_path, tiny_engine):
    """Speech prefill: while the caller speaks, their words so far (less the last) are
    prefilled into the K/V; the turn's answer then prefills fewer tokens, and is token for
    token the answer of a call that did nothing before the turn ended."""
    words = "please tell me when the clinic opens on saturday morning for a cleaning".split()

    def growing(audio: np.ndarray) -> str:  # more speech, more words (silence adds none)
        # 8 words a second: the first prefill (at 0.6 s of speech) has words to prefill. Only
        # it is sure to run: the script may deliver the rest of the tone before it finishes,
        # and a prefill is not started while another runs.
        return " ".join(words[:max(1, int(np.count_nonzero(np.abs(audio) > 0.01) / RATE * 8))])

    class PrefillSpy(SpyBackend):
        def __init__(self, inner):
            super().__init__(inner)
            self.prefilled, self.opened = asyncio.Event(), asyncio.Event()
            self.prefill_messages = []

        async def prefill(self, messages, cancel=None):
            n = await self.inner.prefill(messages, cancel)
            if messages[-1]["content"]:  # the caller's words
                self.prefill_messages.append(messages)
                self.prefilled.set()
            else:  # the history, at the call's start (the script runs faster than a caller speaks)
                self.opened.set()
            return n

    spy = PrefillSpy(engine_backend(tiny_engine))

    async def prefilled() -> None:
        await spy.prefilled.wait()

    async def answered() -> None:
        await spy.wait_finished(1)

    cfg = config(tmp_path / "pre", True, "silence")
    cfg = cfg.model_copy(update={"turn": cfg.turn.model_copy(update={"speech_prefill_ms": 600})})
    call, _, _ = make_call(cfg, [spy.opened.wait, silence(0.3), tone(1.3), prefilled, tone(0.6), silence(0.3), answered,
                                 silence(0.6)], spy, ScriptedSTT(growing), None, end_silence_s=0.5)
    await asyncio.wait_for(call.run(), 120)

    async def no_wait() -> None:
        pass

    base = SpyBackend(engine_backend(tiny_engine))
    plain, _, _ = make_call(config(tmp_path / "plain", False, "silence"),
                            [silence(0.3), tone(1.3), no_wait, tone(0.6), silence(0.3), no_wait, silence(0.6)], base,
                            ScriptedSTT(growing), None)
    await asyncio.wait_for(plain.run(), 120)
    (turn,), (plain_turn,) = call.turns, plain.turns
    assert turn.user_text == plain_turn.user_text and len(turn.user_text.split()) > 4
    partial = spy.prefill_messages[0][-1]["content"]
    assert turn.user_text.startswith(partial) and len(partial.split()) < len(turn.user_text.split())
    assert call.transcripts.preemptor.prefilled and call.transcripts.preemptor.prefilled[0] > 0
    assert spy.streams[0]["tokens"] == base.streams[0]["tokens"] and turn.agent_text == plain_turn.agent_text
    assert turn.stats.prefilled_tokens < plain_turn.stats.prefilled_tokens  # the words were in the cache
    assert load_report(call.report_path)["turns"][0]["preemptive_hit"] is True


async def test_a_pause_is_transcribed_beside_a_running_prefill_and_its_llm_waits_for_it(tmp_path, tiny_engine):
    """A start's STT does not queue behind work on the conversation (a prefill's pass may
    take seconds on a slow CPU): it runs at once, and only the LLM waits for that work."""
    stt_called = threading.Event()

    class BlockedPrefill(SpyBackend):
        def __init__(self, inner):
            super().__init__(inner)
            self.entered, self.release = asyncio.Event(), asyncio.Event()

        async def prefill(self, messages, cancel=None):
            self.entered.set()
            await self.release.wait()
            return await self.inner.prefill(messages, cancel)

    def hours(audio: np.ndarray) -> str:
        stt_called.set()
        return "What are your hours on Saturday?"

    spy = BlockedPrefill(engine_backend(tiny_engine))
    seen: dict = {}

    async def prefill_running() -> None:
        await spy.entered.wait()

    async def pause_transcribed_then_release() -> None:
        seen["stt_during_prefill"] = await asyncio.to_thread(stt_called.wait, 60)
        seen["streams_before_release"] = len(spy.streams)
        spy.release.set()

    async def answered() -> None:
        await spy.wait_finished(1)

    call, _, _ = make_call(config(tmp_path, True, "silence"),
                           [silence(0.3), prefill_running, tone(1.0), silence(0.3), pause_transcribed_then_release,
                            silence(0.6), answered, silence(0.3)], spy, ScriptedSTT(hours), None, end_silence_s=0.5)
    await asyncio.wait_for(call.run(), 120)
    assert seen == {"stt_during_prefill": True, "streams_before_release": 0}
    (turn,) = call.turns
    assert turn.user_text == "What are your hours on Saturday?" and turn.agent_text
    assert load_report(call.report_path)["turns"][0]["preemptive_hit"] is True


async def test_when_the_turn_ends_the_prefill_its_answer_waits_for_stops_yielding_to_other_calls(tmp_path,
                                                                                              tiny_engine):
    """A speech prefill runs on the conversation as background work (other calls' ended
    turns go first). When this turn ends, its answer waits for that prefill, so from then on
    the prefill is foreground too: its cancel's flag turns, which the engine's scheduler
    reads when it chooses a round (a pass already queued included). Under load, left
    background, such a pass waited seconds behind three other calls' answers."""
    class BlockedPrefill(SpyBackend):
        def __init__(self, inner):
            super().__init__(inner)
            self.entered, self.release = asyncio.Event(), asyncio.Event()
            self.cancels: list = []

        async def prefill(self, messages, cancel=None):
            self.cancels.append(cancel)
            self.entered.set()
            await self.release.wait()
            return await self.inner.prefill(messages, cancel)

    spy = BlockedPrefill(engine_backend(tiny_engine))
    log: list = []
    seen: dict = {}

    async def prefill_running() -> None:
        await spy.entered.wait()
        seen["background_while_listening"] = spy.cancels[0].background

    async def turn_ended_then_release() -> None:
        async def ended() -> None:
            while not any(kind == "end_of_turn" for kind, _ in log):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(ended(), 60)
        seen["background_after_the_end"] = spy.cancels[0].background
        spy.release.set()

    call, _, _ = make_call(config(tmp_path, True, "silence"),
                           [silence(0.3), prefill_running, tone(1.0), silence(0.8), turn_ended_then_release,
                            silence(0.3)], spy, ScriptedSTT("What are your hours on Saturday?"), None, log,
                           end_silence_s=0.5)
    await asyncio.wait_for(call.run(), 120)
    assert seen == {"background_while_listening": True, "background_after_the_end": False}
    (turn,) = call.turns
    assert turn.agent_text and load_report(call.report_path)["turns"][0]["preemptive_hit"] is True


async def test_a_speech_prefill_stopped_in_its_stt_is_not_waited_for(tmp_path, tiny_engine):
    """A pause stops a speech prefill still transcribing (it will prefill nothing now): the
    pause's answer starts, and its turn is answered, while that transcription still runs."""
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def stt(audio: np.ndarray) -> str:
        calls.append(len(audio))
        if len(calls) == 1:  # the speech prefill's, held until the turn was answered
            entered.set()
            release.wait(120)
        return "What are your hours on Saturday?"

    class OpenedSpy(SpyBackend):
        def __init__(self, inner):
            super().__init__(inner)
            self.opened = asyncio.Event()

        async def prefill(self, messages, cancel=None):
            n = await self.inner.prefill(messages, cancel)
            self.opened.set()  # the history's, at the call's start (words never get this far)
            return n

    spy, calls_ = OpenedSpy(engine_backend(tiny_engine)), []
    seen: dict = {}

    async def prefill_transcribing() -> None:
        seen["entered"] = await asyncio.to_thread(entered.wait, 60)

    async def answered_then_release() -> None:
        seen["answered"] = await calls_[0].wait_turns(1, 60)
        seen["prefill_stt_still_running"] = not release.is_set()
        release.set()

    cfg = config(tmp_path, True, "silence")
    cfg = cfg.model_copy(update={"turn": cfg.turn.model_copy(update={"speech_prefill_ms": 600})})
    call, _, _ = make_call(cfg, [spy.opened.wait, silence(0.3), tone(1.0), prefill_transcribing, silence(0.8),
                                 answered_then_release, silence(0.3)], spy, ScriptedSTT(stt), None, end_silence_s=0.5)
    calls_.append(call)
    try:
        await asyncio.wait_for(call.run(), 120)
    finally:
        release.set()
    assert seen == {"entered": True, "answered": True, "prefill_stt_still_running": True}
    assert len(calls) == 2 and calls[1] > calls[0]  # the pause transcribed all its audio itself
    assert call.turns[0].agent_text and load_report(call.report_path)["turns"][0]["preemptive_hit"] is True


async def test_after_each_turn_the_history_is_prefilled_before_the_callers_next_words(tmp_path, tiny_engine):
    """Once a turn is over, the history as the next prompt renders it (the reply the caller
    heard, not what the model wrote) is computed into the K/V up to the caller's next
    words: the next turn prefills only those words, and its answer is token for token the
    one a call without any prefill gives."""
    lines = iter(["What are your hours on Saturday?", "And how much is a cleaning?"])

    def caller(audio: np.ndarray) -> str:
        return lines_by_length.setdefault(len(audio), next(lines))

    lines_by_length: dict[int, str] = {}  # every transcription of the same audio, the same words

    class PrefillSpy(SpyBackend):
        def __init__(self, inner):
            super().__init__(inner)
            self.prefill_log: list[tuple[list[dict], int]] = []
            self.prefilled = asyncio.Event()

        async def prefill(self, messages, cancel=None):
            n = await self.inner.prefill(messages, cancel)
            self.prefill_log.append((messages, n))
            self.prefilled.set()
            return n

    spy = PrefillSpy(engine_backend(tiny_engine))
    calls: list[Call] = []

    async def first_turn_over() -> None:  # the caller speaks again once the agent is done
        await calls[-1].wait_turns(1)

    async def history_prefilled() -> None:
        while True:
            spy.prefilled.clear()
            if any(len(m) > 2 for m, _ in spy.prefill_log):  # the opening after a turn, not the call's start
                return
            await spy.prefilled.wait()

    cfg = config(tmp_path / "pre", True, "silence")
    cfg = cfg.model_copy(update={"turn": cfg.turn.model_copy(update={"speech_prefill_ms": 60000})})  # words: never
    steps = [silence(0.3), tone(1.0), silence(0.8), first_turn_over, history_prefilled, tone(1.2), silence(0.8)]
    call, _, _ = make_call(cfg, steps, spy, ScriptedSTT(caller), None, end_silence_s=0.5)
    calls.append(call)
    await asyncio.wait_for(call.run(), 120)

    lines = iter(["What are your hours on Saturday?", "And how much is a cleaning?"])
    lines_by_length.clear()
    base = SpyBackend(engine_backend(tiny_engine))
    plain, _, _ = make_call(config(tmp_path / "plain", False, "silence"), steps[:4] + steps[5:], base,
                            ScriptedSTT(caller), None)
    calls.append(plain)
    await asyncio.wait_for(plain.run(), 120)

    assert [t.user_text for t in call.turns] == [t.user_text for t in plain.turns] == [
        "What are your hours on Saturday?", "And how much is a cleaning?"]
    assert [s["tokens"] for s in spy.streams] == [s["tokens"] for s in base.streams]
    # After the first turn: the history up to the caller's next message, which has no words yet.
    after_first = [m for m, _ in spy.prefill_log if len(m) > 2 and m[-1] == {"role": "user", "content": ""}]
    assert after_first and after_first[0][:-1] == spy.streams[1]["messages"][:-1]
    assert call.turns[1].stats.prefilled_tokens < plain.turns[1].stats.prefilled_tokens


@pytest.mark.parametrize("question, kept", [("What time do you open on Saturday?", True),
                                            ("Can I book the Tuesday slot, I'm Ann?", True)])
async def test_with_an_answer_plan_the_kept_generation_is_the_plans_own_round(tmp_path, tiny_engine, question, kept):
    """Tools with a plan: the preemptive start sends what the plan step would (a question's
    answer line prefilled; a booking's grammar of the open slots), so the turn keeps it:
    one stream, the same tokens and words as a call without preemption."""
    from pipeline.receptionist.bookings import open_store
    from pipeline.receptionist.tools import ToolBox

    slots = ["Tuesday 10:30 a.m. with Dr. Patel", "Friday 9:00 a.m. with Dr. Patel"]
    results = {}
    for preemptive in (True, False):
        store = open_store(tmp_path / f"b{preemptive}.sqlite", open_slots=slots)
        spy = SpyBackend(engine_backend(tiny_engine))
        params = []
        inner_stream = spy.stream

        def stream(messages, p, cancel=None, inner_stream=inner_stream, params=params):
            params.append(p)
            return inner_stream(messages, p, cancel)

        spy.stream = stream

        async def buffered(spy=spy, preemptive=preemptive) -> None:
            if preemptive:
                await spy.wait_finished(1)

        call, _, _ = make_call(config(tmp_path / str(preemptive), preemptive, "silence", plan=True),
                               [silence(0.3), tone(1.0), silence(0.3), buffered, silence(0.6)], spy,
                               ScriptedSTT(question), None, end_silence_s=0.5 if preemptive else None)
        call.toolbox = ToolBox(store, f"call-{preemptive}")
        await asyncio.wait_for(call.run(), 120)
        results[preemptive] = (call, spy, params)
        store.close()
    (pre, pre_spy, pre_params), (plain, plain_spy, plain_params) = results[True], results[False]
    assert load_report(pre.report_path)["turns"][0]["preemptive_hit"] is kept
    assert pre_spy.streams[0]["messages"] == plain_spy.streams[0]["messages"]
    assert pre_params[0] == plain_params[0]  # the same constraint (none, or the same slots' grammar)
    if "book" in question:
        assert pre_params[0].constraint is not None and slots[0] in pre_params[0].constraint.text
    else:
        assert pre_spy.streams[0]["messages"][-1].get("prefix") is True
    assert pre_spy.streams[0]["tokens"] == plain_spy.streams[0]["tokens"]
    assert pre.turns[0].agent_text == plain.turns[0].agent_text
    assert pre.turns[0].llm.plan["act"] == plain.turns[0].llm.plan["act"]


async def test_a_slot_taken_after_the_start_is_not_kept_the_turn_plans_on_todays_slots(tmp_path):
    """The preemptive plan's grammar names the slots open at the pause; another caller books
    one before the turn ends: the turn's plan is built again from the database, differs, and
    the buffered generation is not replayed (a live stream on the new grammar instead)."""
    from pipeline.receptionist.bookings import open_store
    from pipeline.receptionist.tools import ToolBox

    slots = ["Tuesday 10:30 a.m. with Dr. Patel", "Friday 9:00 a.m. with Dr. Patel"]
    store = open_store(tmp_path / "b.sqlite", open_slots=slots)
    grammars = []

    def reply(messages):
        return ['{"act": "answer"}\n', "Friday is open."]

    spy = SpyBackend(ScriptedBackend(reply=reply))
    inner_stream = spy.stream

    def stream(messages, p, cancel=None):
        grammars.append(p.constraint.text if p.constraint else None)
        return inner_stream(messages, p, cancel)

    spy.stream = stream

    async def taken_meanwhile() -> None:
        await spy.wait_finished(1)
        ToolBox(store, "other").run("book_slot", {"slot": slots[0], "name": "Quick Caller"})

    call, _, _ = make_call(config(tmp_path / "c", True, "silence", plan=True),
                           [silence(0.3), tone(1.0), silence(0.3), taken_meanwhile, silence(0.6)], spy,
                           ScriptedSTT("Can I book the Tuesday slot, I'm Ann?"), None, end_silence_s=0.5)
    call.toolbox = ToolBox(store, "call-c")
    await asyncio.wait_for(call.run(), 60)
    assert len(grammars) == 2 and slots[0] in grammars[0] and grammars[0] != grammars[1]
    assert call.turns[0].agent_text == "Friday is open."
    store.close()


# ---------------------------------------------------------------- (3) noise


async def test_noise_with_an_empty_transcript_starts_no_llm(tmp_path):
    backend = ScriptedBackend()
    stt = ScriptedSTT("")
    log: list = []
    call, _, _ = make_call(config(tmp_path), [silence(0.3), tone(0.6), silence(2.0)], backend, stt,
                           LengthModel(None), log)
    await asyncio.wait_for(call.run(), 60)
    assert backend.opened == 0 and call.transcripts.preemptor.llm_starts == 0
    assert [e["why"] for e in events(log, "preemptive_discarded")] == ["empty_transcript"]
    assert call.skipped_utterances == 1 and call.turns == []
    assert stt.calls == 1  # the turn reused the pause's (empty) transcript


async def test_a_line_that_only_greets_starts_no_llm_and_is_greeted_back(tmp_path):
    backend = ScriptedBackend(["Riverside Dental is at 42 Harbor Street."])
    log: list = []
    call, _, _ = make_call(config(tmp_path), [silence(0.3), tone(0.6), silence(2.0)], backend,
                           ScriptedSTT("Hi, my name is Robert."), LengthModel(None), log)
    await asyncio.wait_for(call.run(), 60)
    assert [e["why"] for e in events(log, "preemptive_discarded")] == ["no_llm"]
    assert backend.opened == 0 and call.transcripts.preemptor.llm_starts == 0
    assert [t.agent_text for t in call.turns] == ["Hi Robert, how can I help you today?"]


async def test_with_greet_back_off_a_greeting_is_the_models_to_answer(tmp_path):
    cfg = config(tmp_path)
    cfg = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"greet_back": False})})
    backend = ScriptedBackend(["Hello Robert."])
    call, _, _ = make_call(cfg, [silence(0.3), tone(0.6), silence(2.0)], backend,
                           ScriptedSTT("Hi, my name is Robert."), LengthModel(None))
    await asyncio.wait_for(call.run(), 60)
    assert call.transcripts.preemptor.llm_starts == 1
    assert [t.agent_text for t in call.turns] == ["Hello Robert."]


# ---------------------------------------------------------------- (4) bounded restarts


class CountingSTT(ScriptedSTT):
    def __init__(self, text):
        super().__init__(text)
        self.active = self.max_active = 0
        self._lock = threading.Lock()

    def transcribe(self, audio, sample_rate=16000):
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            return super().transcribe(audio, sample_rate)
        finally:
            with self._lock:
                self.active -= 1


async def test_restarts_are_bounded_per_turn_and_never_overlap(tmp_path):
    """A caller who pauses six times in one turn: one start per pause up to the cap, each
    discarded when they speak on, never two at once."""
    backend = SpyBackend(ScriptedBackend(["One. ", "Two. ", "Three."]))
    stt = CountingSTT(seconds_stt)
    steps = [silence(0.3)]
    for _ in range(6):
        steps += [tone(0.5), silence(0.4)]
    steps += [silence(1.5)]
    log: list = []
    call, _, _ = make_call(config(tmp_path), steps, backend, stt, LengthModel(None), log)
    await asyncio.wait_for(call.run(), 60)
    starts = events(log, "preemptive_start")
    assert len(starts) == MAX_STARTS_PER_TURN
    assert [s["pause"] for s in starts] == [1, 2, 3]  # one start per pause, the first pauses
    assert backend.max_active <= 1 and stt.max_active <= 1
    (entry,) = load_report(call.report_path)["turns"]
    assert entry["preemptive"]["starts"] == MAX_STARTS_PER_TURN and entry["preemptive_hit"] is False
    assert entry["end_of_turn"]["pauses"] == 6


# ---------------------------------------------------------------- (6) hang-up


class HeldBackend(ScriptedBackend):
    """Yields one group, then holds until cancelled (or closed)."""

    def __init__(self):
        super().__init__(["Let me see. "])
        self.first = asyncio.Event()

    async def stream(self, messages, params, cancel=None):
        self.opened += 1
        try:
            yield _group("Let me see. ")
            self.first.set()
            await asyncio.Event().wait()  # a generation that only the end of the call stops
        finally:
            self.closed += 1


def _group(text, finish=None):
    from llm.types import TokenGroup

    return TokenGroup((1,), text, 0, 0, finish_reason=finish)


async def test_hang_up_during_a_preemptive_generation_ends_cleanly(tmp_path):
    backend = HeldBackend()

    async def generating() -> None:
        await backend.first.wait()

    before = snapshot()
    log: list = []
    call, _, sink = make_call(config(tmp_path), [silence(0.3), tone(1.0), silence(0.4), generating, "hangup"],
                              backend, ScriptedSTT(seconds_stt), LengthModel(None), log)
    report = await asyncio.wait_for(call.run(), 60)
    assert report.end_reason == "caller_hangup" and call.report_path.exists()
    assert backend.opened == backend.closed == 1 and sink.played == 0 and call.turns == []
    assert [e["why"] for e in events(log, "preemptive_discarded")] == ["call_ended"]
    assert not call.transcripts.preemptor.busy
    await assert_released(before)


# ---------------------------------------------------------------- tools: only the first round is preempted


class StubTools:
    """A tool box with one tool; records each run with what had happened before it."""

    def __init__(self, log: list):
        self.log = log
        self.runs = 0

    def open_slots(self):
        return None  # no booking store behind this one

    def run(self, name, arguments):
        from pipeline.receptionist.tools import ToolOutcome

        self.runs += 1
        return ToolOutcome(name, {}, True, {"free": ["Tuesday 10:30"]}, None, 0.1)


def tool_reply(messages):
    if messages[-1]["role"] == "tool":
        return ["Tuesday at ten thirty is free. ", "Shall I book it?"]
    return ["Let me check. ", '<tool_call>\n{"name": "check_slots", "arguments": {}}\n</tool_call>']


async def test_with_tools_the_kept_generation_is_the_first_round_and_the_tool_runs_after_the_turn_end(tmp_path):
    async def no_wait() -> None:
        pass

    results = {}
    for preemptive in (True, False):
        log: list = []
        spy = SpyBackend(ScriptedBackend(reply=tool_reply))

        async def first_round_done() -> None:
            if preemptive:
                await spy.wait_finished(1)  # the whole first round (with its tool call) is buffered

        steps = [silence(0.3), tone(1.0), silence(0.4), first_round_done if preemptive else no_wait, silence(1.6)]
        call, _, _ = make_call(config(tmp_path / str(preemptive), preemptive), steps, spy, ScriptedSTT(seconds_stt),
                               LengthModel(None), log)
        tools = StubTools(log)
        call.toolbox = tools
        await asyncio.wait_for(call.run(), 60)
        results[preemptive] = (call, spy, tools, log)
    (pre, pre_spy, pre_tools, pre_log), (plain, plain_spy, plain_tools, _) = results[True], results[False]
    assert pre.turns[0].agent_text == plain.turns[0].agent_text == "Let me check. Tuesday at ten thirty is free. Shall I book it?"
    assert [s["messages"] for s in pre_spy.streams] == [s["messages"] for s in plain_spy.streams]
    assert len(pre_spy.streams) == 2 and pre_tools.runs == plain_tools.runs == 1
    kinds = [k for k, _ in pre_log]
    assert kinds.index("preemptive_kept") > kinds.index("end_of_turn")
    assert kinds.index("tool_call") > kinds.index("end_of_turn")  # the tool never runs on a guess
    assert load_report(pre.report_path)["turns"][0]["preemptive_hit"] is True


# ---------------------------------------------------------------- barge-in on a kept answer


class HeldAfterFirstGroup(ScriptedBackend):
    """Says one sentence, then waits for the test's `proceed` and ends as the cancel says."""

    def __init__(self):
        super().__init__()
        self.proceed = asyncio.Event()
        self.saw_cancel: list[bool] = []  # per stream: was it cancelled when told to proceed

    async def stream(self, messages, params, cancel=None):
        self.opened += 1
        try:
            yield _group("Let me see. ")
            yield _group("We")  # proves the sentence before it complete
            await self.proceed.wait()
            self.saw_cancel.append(cancel is not None and cancel.is_set())
            yield _group("", "cancelled") if self.saw_cancel[-1] else _group(" open at nine.", "eos")
        finally:
            self.closed += 1


async def test_a_barge_in_stops_a_kept_preemptive_generation(tmp_path):
    backend = HeldAfterFirstGroup()
    sinks = []

    async def agent_speaking() -> None:
        await sinks[0].playing.wait()

    log: list = []
    async def first_turn_over() -> None:
        # The interrupted turn has ended before the caller's next pause: a preemption starts
        # only while no turn runs (this source runs faster than real time).
        await call.wait_turns(1)
        while call._turn_task is not None:
            await asyncio.sleep(0)

    steps = [silence(0.3), tone(1.0), silence(0.4), silence(1.6), agent_speaking, tone(0.5), first_turn_over,
             silence(0.3)]
    call, _, sink = make_call(config(tmp_path), steps, backend, ScriptedSTT(seconds_stt), LengthModel(2.0), log)
    sinks.append(sink)
    call.events.subscribe(event_callback(lambda kind, data: kind == "barge_in" and backend.proceed.set()))
    await asyncio.wait_for(call.run(), 60)
    first = call.turns[0]
    # The turn's barge-in reached the kept generation; the caller's new words are a new
    # turn, answered (preemptively too) in full.
    assert first.interrupted and backend.saw_cancel == [True, False]
    assert first.sentences == ["Let me see."] and first.finish_reason == "cancelled"
    assert backend.opened == backend.closed
    assert [t["preemptive_hit"] for t in load_report(call.report_path)["turns"]] == [True, True]
    assert call.turns[1].agent_text == "Let me see. We open at nine."


async def test_hang_up_while_a_kept_generation_is_being_spoken_ends_cleanly(tmp_path):
    """The turn kept the preemptive generation and is speaking it; the backend is stuck
    (it would wait for `proceed` forever): the hang-up still ends the call at once."""
    backend = HeldAfterFirstGroup()
    sinks = []

    async def agent_speaking() -> None:
        await sinks[0].playing.wait()

    before = snapshot()
    call, _, sink = make_call(config(tmp_path), [silence(0.3), tone(1.0), silence(2.0), agent_speaking, "hangup"],
                              backend, ScriptedSTT(seconds_stt), LengthModel(2.0))
    sinks.append(sink)
    report = await asyncio.wait_for(call.run(), 60)
    assert report.end_reason == "caller_hangup" and call.report_path.exists()
    assert backend.opened == backend.closed == 1 and backend.saw_cancel == []
    entry = load_report(call.report_path)["turns"][0]
    assert entry["preemptive_hit"] is True and entry["agent_text"].startswith("Let me see.")
    assert not call.transcripts.preemptor.busy
    await assert_released(before)


# ---------------------------------------------------------------- a keypad turn in the middle


async def test_a_keypad_turn_during_a_pause_discards_the_preemption_and_never_shares_the_model(tmp_path):
    """Keys pressed while a voice turn is pending are answered first: that answer changes
    the history the preemptive generation started on, so it is stopped before the keypad
    turn generates, and the voice turn then generates on the new history."""
    spy = SpyBackend(ScriptedBackend(reply=lambda m: [f"Answer {len(m)}. ", "Done."]), after=1)

    async def generating() -> None:
        await spy.reached.wait()

    log: list = []
    # The caller stays quiet until the keypad turn has answered (its make_way stopped the
    # preemption): this source runs faster than real time, and the voice turn's end by
    # silence must not overtake the keypad turn's start.
    steps = [silence(0.3), tone(1.0), silence(0.4), generating, KeyPress("1", 0.0), KeyPress("#", 0.0),
             lambda: spy.wait_finished(2), silence(1.6)]
    call, _, _ = make_call(config(tmp_path), steps, spy, ScriptedSTT(seconds_stt), LengthModel(None), log)
    await asyncio.wait_for(call.run(), 60)
    keypad, voice = call.turns
    assert keypad.user_text == "[keypad] 1" and voice.user_text.startswith("I would like")
    assert [e["why"] for e in events(log, "preemptive_discarded")] == ["another_turn"]
    assert spy.max_active == 1 and len(spy.streams) == 3  # preemptive, keypad, voice: one at a time
    # The voice turn's answer was generated on the history with the keypad exchange in it.
    assert spy.streams[2]["messages"][-3]["content"] == "[keypad] 1"
    assert voice.agent_text == f"Answer {len(spy.streams[2]['messages'])}. Done."
    entry = load_report(call.report_path)["turns"][1]
    assert entry["preemptive_hit"] is False
