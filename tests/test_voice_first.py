"""The caller's first audio goes before the rest of the answer (llm/voice_first.py): while
the speaker makes a reply's first chunk, the conversation's next LLM pass waits; later
sentences, made while audio plays, hold nothing; a hold never outlives its bound. Threads
and events, no sleeps; a tiny random model where the engine runs."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from llm.backend import SpeculativeBackend
from llm.engine import SpeculativeEngine
from llm.types import SamplingParams
from llm.voice_first import VoiceFirst
from pipeline.stages.speak import speak
from pipeline.timeline import TurnTimeline
from pipeline.turn import Reply
from voice.tts import AudioChunk

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something long."}]


def test_a_pass_waits_while_a_hold_is_on_and_goes_when_it_is_released():
    gate = VoiceFirst()
    hold = gate.hold()
    waited: list[float] = []
    waiter = threading.Thread(target=lambda: waited.append(gate.wait()))
    waiter.start()
    assert gate.wait_until_waiting(1)
    assert not waited  # still held
    hold.release()
    hold.release()  # idempotent
    waiter.join(10)
    assert not waiter.is_alive() and len(waited) == 1
    assert gate.waits == 1 and not gate.held
    assert gate.wait() == 0.0  # nothing held: no wait, not counted
    assert gate.waits == 1


def test_every_hold_must_be_released_before_the_pass_goes():
    gate = VoiceFirst()
    first, second = gate.hold(), gate.hold()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (gate.wait(), done.set()))
    waiter.start()
    assert gate.wait_until_waiting(1)
    first.release()
    assert gate.held and not done.is_set()  # the second hold still stands (nothing woke it yet)
    second.release()
    waiter.join(10)
    assert done.is_set()


def test_a_hold_never_released_stops_the_pass_at_most_max_hold_s():
    gate = VoiceFirst(max_hold_s=0.05)
    with gate.hold():
        t0 = time.monotonic()
        waited = gate.wait()  # returns although the hold stands: a voice that hangs cannot stop the model
        assert waited >= 0.04 and time.monotonic() - t0 >= 0.04
        assert gate.held
        assert gate.wait() == 0.0  # that hold has run out: it holds no later pass either
    assert not gate.held


@pytest.fixture(scope="module")
def engine(tiny_models):
    return SpeculativeEngine.load(tiny_models["target"], dtype="float32", drafter="ngram", gamma=2)


async def test_the_backend_starts_no_pass_while_the_first_audio_is_made_and_the_answer_is_unchanged(engine):
    params = SamplingParams(max_new_tokens=12)
    want, _, _ = engine.generate(engine.chat_prompt(MESSAGES), params)
    backend = SpeculativeBackend(engine, voice_first=True)
    passes = engine.scheduler.passes
    hold = backend.voice_first.hold()
    got: list = []

    async def read() -> None:
        async for group in backend.stream(MESSAGES, params):
            got.append(group)

    reader = asyncio.create_task(read())
    try:
        assert await asyncio.to_thread(backend.voice_first.wait_until_waiting, 1)
        assert not got and engine.scheduler.passes == passes  # not even the prefill ran
    finally:
        hold.release()
    await asyncio.wait_for(reader, 60)
    assert [t for g in got for t in g.token_ids] == want  # the same answer, token for token
    assert backend.voice_first.waits >= 1


class _Sink:
    """Where the agent's audio goes: a phone line or sound card (neither exists here), so it
    takes each chunk at once and confirms every mark."""

    def __init__(self) -> None:
        self.chunks: list[AudioChunk] = []
        self.first_played = asyncio.Event()

    def play(self, chunk: AudioChunk) -> asyncio.Future:
        self.chunks.append(chunk)
        self.first_played.set()
        done = asyncio.get_running_loop().create_future()
        done.set_result(time.monotonic())
        return done

    def mark(self, name: str) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        done.set_result(True)
        return done

    async def clear(self) -> None:
        self.chunks.clear()

    async def aclose(self) -> None:
        pass


class _SteppedTTS:
    """Two chunks a sentence, each let out by the test (`steps`); records whether the gate
    was held as each sentence began."""

    def __init__(self, gate: VoiceFirst):
        self.gate = gate
        self.steps = threading.Semaphore(0)
        self.began: list[tuple[str, bool]] = []
        self.at = threading.Condition()

    def synthesize(self, text: str):
        with self.at:
            self.began.append((text, self.gate.held))
            self.at.notify_all()
        for level in (0.1, 0.2):
            assert self.steps.acquire(timeout=30)
            yield AudioChunk(np.full(160, level, np.float32), 16000)

    def wait_began(self, n: int) -> bool:
        with self.at:
            return self.at.wait_for(lambda: len(self.began) >= n, 30)


async def test_the_speaker_holds_the_model_until_the_replys_first_chunk_only():
    gate = VoiceFirst()
    tts = _SteppedTTS(gate)
    reply = Reply(TurnTimeline(index=0), voice_first=gate)
    for sentence in ("Saturday 9 a.m. to 1 p.m.", "Anything else?"):
        reply.sentences.put_nowait(sentence)
    reply.sentences.put_nowait(None)
    sink = _Sink()
    speaker = asyncio.create_task(speak(tts, sink, reply, iter(["s1", "s2"])))
    assert await asyncio.to_thread(tts.wait_began, 1)
    assert tts.began[0] == ("Saturday 9 a.m. to 1 p.m.", True)  # the caller waits in silence: held
    tts.steps.release()  # its first chunk
    await asyncio.wait_for(sink.first_played.wait(), 30)
    # Released with the first chunk, while the sentence's second chunk is not made yet.
    assert not gate.held and len(sink.chunks) == 1
    for _ in range(3):
        tts.steps.release()
    await asyncio.wait_for(speaker, 30)
    assert tts.began[1] == ("Anything else?", False)  # made while the first plays: no hold
    assert not gate.held and reply.speech.heard == ["Saturday 9 a.m. to 1 p.m.", "Anything else?"]


async def test_a_failed_first_sentence_releases_the_hold():
    gate = VoiceFirst()

    class Broken:
        def synthesize(self, text):
            assert gate.held
            raise RuntimeError("voice broke")
            yield  # a generator, as engines are

    reply = Reply(TurnTimeline(index=0), voice_first=gate)
    reply.sentences.put_nowait("Hello.")
    reply.sentences.put_nowait(None)
    await asyncio.wait_for(speak(Broken(), _Sink(), reply, iter(["s1"])), 30)
    assert not gate.held and reply.speech.error and "voice broke" in reply.speech.error


def test_a_whole_first_sentence_made_ahead_holds_the_model_until_its_first_chunk_a_clause_does_not():
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.stages.speak_ahead import PrimedSpeech

    gate = VoiceFirst()
    tts = _SteppedTTS(gate)
    with ThreadPoolExecutor(2) as pool:
        speech = PrimedSpeech(tts, pool, voice_first=gate)
        speech.prime("42 Harbor Street,")  # a first clause: the model still writes the sentence
        assert tts.wait_began(1) and tts.began[0] == ("42 Harbor Street,", False)
        tts.steps.release()
        tts.steps.release()
        rest = "Springfield, next to the public library."
        speech.prime(rest, first=True)  # the sentence is whole: the caller will wait for its audio
        assert tts.wait_began(2) and tts.began[1] == (rest, True)
        tts.steps.release()
        heard = speech.synthesize(rest)
        next(heard)  # its first chunk, made ahead
        assert not gate.held
        tts.steps.release()
        assert len(list(heard)) == 1


def test_the_model_holds_for_the_voice_only_where_its_passes_take_every_core(engine, monkeypatch):
    """A model on fewer threads than the machine has cores leaves the voice a core: no gate."""
    import os

    threads = engine.scheduler.threads
    monkeypatch.setattr(os, "cpu_count", lambda: threads + 1)
    assert SpeculativeBackend(engine).voice_first is None
    monkeypatch.setattr(os, "cpu_count", lambda: threads)
    assert isinstance(SpeculativeBackend(engine).voice_first, VoiceFirst)
    assert SpeculativeBackend(engine, voice_first=False).voice_first is None
