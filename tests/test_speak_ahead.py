"""Speaking ahead (pipeline/stages/speak_ahead.py): a preemptive answer's first sentence is
synthesised while the caller's silence runs out, and played only when the turn says that
very sentence. Real Piper where the audio matters; a gated engine where the test must
hold a synthesis half-way (threading events, no sleeps)."""

from __future__ import annotations

import asyncio
import collections
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from llm.types import TokenGroup
from pipeline.sentences import SentenceSplitter
from pipeline.stages.speak_ahead import FirstSentence, PrimedSpeech
from voice.tts import AudioChunk


def group(text: str, finish: str | None = None) -> TokenGroup:
    return TokenGroup((0,), text, 0, 0, finish_reason=finish)


class CountingTTS:
    """Wraps an engine: which texts it was asked to synthesise, in order."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []
        self.began = threading.Event()

    def synthesize(self, text):
        self.asked.append(text)
        self.began.set()
        yield from self.inner.synthesize(text)


class GatedTTS:
    """Two chunks a sentence; the second waits for `gate` (a synthesis held half-way)."""

    def __init__(self):
        self.gate, self.first_out = threading.Event(), threading.Event()
        self.asked: list[str] = []
        self.began: dict[str, threading.Event] = collections.defaultdict(threading.Event)
        self.fail = False

    def synthesize(self, text):
        self.asked.append(text)
        self.began[text].set()
        if self.fail:
            raise RuntimeError("voice broke")
        yield AudioChunk(np.full(160, 0.1, np.float32), 16000)
        self.first_out.set()
        assert self.gate.wait(30)
        yield AudioChunk(np.full(160, 0.2, np.float32), 16000)


@pytest.fixture(scope="module")
def piper():
    from conftest import require_model
    from voice.tts import PiperTTS

    return PiperTTS(require_model("piper-joe-medium") / "en_US-joe-medium.onnx")


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as executor:
        yield executor


@pytest.mark.models
def test_a_primed_sentence_is_played_from_the_audio_made_ahead(piper, pool):
    """Piper is asked once for the primed sentence: the speak stage's request gets the very
    chunks made ahead; any other text is synthesised as usual."""
    tts = CountingTTS(piper)
    speech = PrimedSpeech(tts, pool)
    speech.prime("We're open until six.")
    assert tts.began.wait(30)  # made ahead, not by the reader
    played = list(speech.synthesize("We're open until six."))
    assert tts.asked == ["We're open until six."] and speech.used == 1
    assert played and sum(len(c.pcm) for c in played) > 0.3 * piper.sample_rate
    list(speech.synthesize("We're open until six."))  # used once: a second request synthesises
    other = list(speech.synthesize("Goodbye."))
    assert tts.asked == ["We're open until six.", "We're open until six.", "Goodbye."] and speech.used == 1
    assert other and PrimedSpeech(piper, pool).sample_rate == piper.sample_rate  # the engine's attributes


def test_a_sentence_still_being_made_streams_its_chunks_as_they_come(pool):
    engine = GatedTTS()
    speech = PrimedSpeech(engine, pool)
    speech.prime("Sure.")
    assert engine.first_out.wait(30)
    chunks = speech.synthesize("Sure.")
    first = next(chunks)  # out before the synthesis has finished
    assert float(first.pcm[0]) == pytest.approx(0.1) and not engine.gate.is_set()
    engine.gate.set()
    assert [float(c.pcm[0]) for c in chunks] == [pytest.approx(0.2)]
    assert engine.asked == ["Sure."] and speech.used == 1


def test_a_primed_sentence_not_yet_started_is_synthesised_by_its_reader():
    """The executor is busy: the reader does not wait on its queue, it synthesises itself."""
    engine = GatedTTS()
    engine.gate.set()
    with ThreadPoolExecutor(1) as one:
        blocker = threading.Event()
        one.submit(blocker.wait, 30)
        speech = PrimedSpeech(engine, one)
        speech.prime("Sure.")
        assert len(list(speech.synthesize("Sure."))) == 2 and speech.used == 0
        blocker.set()
    assert engine.asked == ["Sure."]  # the queued one never ran


def test_a_failed_synthesis_ahead_is_done_again_by_the_reader(pool):
    engine = GatedTTS()
    engine.fail = True
    speech = PrimedSpeech(engine, pool)
    speech.prime("Sure.")
    assert engine.began["Sure."].wait(30)
    with pytest.raises(RuntimeError):  # the reader's own attempt fails the same way
        list(speech.synthesize("Sure."))
    assert engine.asked == ["Sure.", "Sure."]
    engine.fail, engine.asked = False, []
    engine.gate.set()
    assert len(list(speech.synthesize("Sure."))) == 2


def test_only_the_last_few_primed_sentences_are_kept(pool):
    engine = GatedTTS()
    engine.gate.set()
    speech = PrimedSpeech(engine, pool, keep=2)
    for text in ("One.", "Two.", "Three."):
        speech.prime(text)
    assert engine.began["Three."].wait(30)
    list(speech.synthesize("One."))  # forgotten: made again
    list(speech.synthesize("Three."))
    assert speech.used == 1 and speech.primed == 3


def test_the_fixed_lines_are_made_once_and_said_every_time_from_that_audio(pool):
    """The hold line and the fallback (`fixed`) are pinned once (the call's start), sentence
    by sentence; each turn that says one plays the audio made then, whether the guard says
    the whole fallback or the model writes it and the splitter hands it over sentence by
    sentence; the preemptive hook makes no copy."""
    from pipeline.stages.speak_ahead import speak_ahead

    engine = GatedTTS()
    engine.gate.set()
    hold, unsure, message = "One moment, please.", "I'm not sure about that.", "I can take a message."
    fixed = (hold, f"{unsure} {message}")
    speech = PrimedSpeech(engine, pool, fixed=fixed + ("  ",))
    assert speech.fixed == fixed
    speech.pin_fixed()
    hook = speak_ahead(speech, SentenceSplitter)
    hook(object(), group('{"act": "book", "slot": "Tue 10:30"'))  # an action: nothing to prime
    assert all(engine.began[sentence].wait(30) for sentence in (hold, unsure, message))
    speech.pin_fixed()  # already pinned: nothing new
    for _ in range(3):  # the first may find it half made: it reads the chunks as they come
        assert len(list(speech.synthesize(hold))) == 2
        assert len(list(speech.synthesize(fixed[1]))) == 4  # the guard's: the whole fallback
        assert [len(list(speech.synthesize(s))) for s in (unsure, message)] == [2, 2]  # the model's
    assert sorted(engine.asked) == sorted([hold, unsure, message]) and speech.used == 15
    assert len(list(speech.synthesize(f"{unsure} Call us back."))) == 2 and engine.asked[-1] == f"{unsure} Call us back."


def test_calls_on_one_engine_share_its_fixed_lines(pool):
    """A server's calls speak through one engine: the second call's fixed lines are the
    first call's audio (nothing made again); another engine makes its own."""
    engine, other = GatedTTS(), GatedTTS()
    engine.gate.set(), other.gate.set()
    first, second = PrimedSpeech(engine, pool, fixed=("One moment.",)), PrimedSpeech(engine, pool, fixed=("One moment.",))
    first.pin_fixed()
    assert engine.began["One moment."].wait(30)
    second.pin_fixed()
    assert len(list(second.synthesize("One moment."))) == 2 and second.used == 1
    third = PrimedSpeech(other, pool, fixed=("One moment.",))
    third.pin_fixed()
    assert len(list(third.synthesize("One moment."))) == 2
    assert engine.asked == ["One moment."] and other.asked == ["One moment."]


def test_a_fixed_line_that_failed_is_made_again_at_the_next_pin(pool):
    engine = GatedTTS()
    engine.fail = True
    speech = PrimedSpeech(engine, pool, fixed=("One moment.",))
    speech.pin_fixed()
    assert engine.began["One moment."].wait(30)
    with pytest.raises(RuntimeError):  # its reader tried once more, and failed the same way
        list(speech.synthesize("One moment."))
    engine.fail, engine.began = False, collections.defaultdict(threading.Event)
    engine.gate.set()
    PrimedSpeech(engine, pool, fixed=("One moment.",)).pin_fixed()  # the next call
    assert engine.began["One moment."].wait(30)
    assert len(list(speech.synthesize("One moment."))) == 2 and speech.used == 1


@pytest.mark.parametrize("groups, first", [
    (["We're open ", "until six. ", "On Saturday"], "We're open until six."),  # free text
    (['{"act": "answer"}\n', "Yes, ", "we do. ", "Anything else?"], "Yes, we do."),  # plan line held back
    (['{"act": "book", "slot": "Tue 10:30"', ', "name": "Ann"}\n'], None),  # an action: the database speaks
    (["Goodbye"], "Goodbye"),  # the last words, at the generation's end
])
def test_first_sentence_is_what_the_turn_would_hand_to_tts(groups, first):
    reader = FirstSentence(SentenceSplitter())
    found = [s for i, text in enumerate(groups)
             if (s := reader.feed(group(text, "stop" if i == len(groups) - 1 else None))) is not None]
    assert found == ([first] if first else [])


class ClauseTTS:
    """Cuts at commas like Piper with split_clauses (the attribute speak_ahead reads): one
    chunk a text, remembered with the text it was made for."""

    split_clauses = True

    def __init__(self):
        self.asked: list[str] = []
        self.made: dict[str, threading.Event] = collections.defaultdict(threading.Event)
        self.text_of: dict[int, str] = {}

    def synthesize(self, text):
        self.asked.append(text)
        chunk = AudioChunk(np.full(len(text), 0.1, np.float32), 16000)
        self.text_of[id(chunk)] = text
        yield chunk
        self.made[text].set()


ADDRESS = ['{"act": "answer"}\n', "Our address is 42 Harbor", " Street, Spring", "field, next to",
           " the public library. ", "Anything else?"]


def test_the_first_clause_is_given_once_nothing_more_can_change_it():
    reader = FirstSentence(SentenceSplitter())
    clauses = []
    for i, text in enumerate(ADDRESS):
        reader.feed(group(text, "stop" if i == len(ADDRESS) - 1 else None))
        clauses.append(reader.first_clause())
    # "..., Spring": Piper would still fold a piece that short into the clause before it.
    assert clauses == [None, None, None, "Our address is 42 Harbor Street,", None, None]


def test_a_first_clause_made_while_the_sentence_is_written_is_played_then_the_rest(pool):
    """While the model still writes the first sentence, its first clause is synthesised;
    the rest once the sentence is whole. The speak stage's request for the sentence plays
    both from that audio: the same words, and the voice asked for nothing more."""
    from pipeline.stages.speak_ahead import speak_ahead

    tts = ClauseTTS()
    speech = PrimedSpeech(tts, pool)
    hook, preemption = speak_ahead(speech, SentenceSplitter), object()
    for text in ADDRESS[:4]:
        hook(preemption, group(text))
    assert tts.made["Our address is 42 Harbor Street,"].wait(30)  # before the sentence was complete
    for text in ADDRESS[4:]:  # "Anything" proves the first sentence whole
        hook(preemption, group(text))
    assert tts.made["Springfield, next to the public library."].wait(30)
    played = [tts.text_of[id(c)] for c in speech.synthesize("Our address is 42 Harbor Street, Springfield, "
                                                            "next to the public library.")]
    assert played == ["Our address is 42 Harbor Street,", "Springfield, next to the public library."]
    assert len(tts.asked) == 2 and speech.used == 2
    # Another sentence is not cut at a clause it does not start with.
    assert [tts.text_of[id(c)] for c in speech.synthesize("Our office is on Harbor Street, Springfield.")] == [
        "Our office is on Harbor Street, Springfield."]


def test_a_voice_that_does_not_cut_at_commas_gets_the_whole_first_sentence(pool):
    from pipeline.stages.speak_ahead import speak_ahead

    tts = ClauseTTS()
    tts.split_clauses = False
    speech = PrimedSpeech(tts, pool)
    hook, preemption = speak_ahead(speech, SentenceSplitter), object()
    for text in ADDRESS:
        hook(preemption, group(text))
    sentence = "Our address is 42 Harbor Street, Springfield, next to the public library."
    assert tts.made[sentence].wait(30)
    assert tts.asked == [sentence]


async def test_a_kept_preemptive_answer_is_heard_from_audio_made_before_the_turn_ended(tmp_path):
    """Silence mode, 0.5 s end of turn: the answer starts at the 200 ms pause and its first
    sentence is synthesised before the turn ends; the turn plays that audio (the engine is
    asked once per sentence). With [turn] speak_ahead = false it is made after the end."""
    from callfakes import ScriptedBackend, ScriptedSTT, ToneTTS
    from test_preemptive import config, make_call, silence, tone

    for ahead in (True, False):
        log: list = []
        made = threading.Event()

        class LoggedTTS(ToneTTS):
            def synthesize(self, text):
                log.append(("synthesize", text))
                yield from super().synthesize(text)
                made.set()

        async def first_made() -> None:  # the caller stays silent until a sentence is made ahead
            if ahead:
                assert await asyncio.to_thread(made.wait, 60)

        cfg = config(tmp_path, True, "silence")
        cfg = cfg.model_copy(update={"turn": cfg.turn.model_copy(update={"speak_ahead": ahead})})
        call, _, _ = make_call(cfg, [silence(0.3), tone(1.0), silence(0.25), first_made, silence(1.0)],
                               ScriptedBackend(["Sure. ", "We open at nine."]), ScriptedSTT("Are you open?"),
                               None, log, end_silence_s=0.5, tts=LoggedTTS(chunks=1, chunk_s=0.02))
        await asyncio.wait_for(call.run(), 120)
        assert [t.user_text for t in call.turns] == ["Are you open?"]
        assert call.turns[0].heard_text == "Sure. We open at nine."
        order = [e[1] if e[0] == "synthesize" else e[0] for e in log if e[0] in ("synthesize", "end_of_turn")]
        if ahead:
            assert order == ["Sure.", "end_of_turn", "We open at nine."] and call.tts.used == 1
        else:
            assert order == ["end_of_turn", "Sure.", "We open at nine."] and isinstance(call.tts, LoggedTTS)


@pytest.mark.parametrize("answer", [["A cleaning costs ", "$5000 with Dr. Smith."], None])
async def test_a_call_makes_its_fallback_after_the_greeting_and_says_it_from_that_audio(tmp_path, answer):
    """With the fact guard on, the fallback is made once the greeting is out, before the
    caller's turn ends; a turn says it from that audio, whether the guard stopped the
    model's sentence (said whole) or the model wrote the fallback itself (said sentence by
    sentence, and not made again ahead)."""
    from callfakes import ScriptedBackend, ScriptedSTT, ToneTTS
    from pipeline.receptionist.business import FALLBACK
    from pipeline.sentences import split_sentences
    from test_preemptive import config, make_call, silence, tone

    log: list = []

    class LoggedTTS(ToneTTS):
        def synthesize(self, text):
            log.append(("synthesize", text))
            yield from super().synthesize(text)

    cfg = config(tmp_path, True, "silence")
    cfg = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"guard": True})})
    call, _, _ = make_call(cfg, [silence(0.3), tone(1.0), silence(1.0)],
                           ScriptedBackend(answer or [FALLBACK[:20], FALLBACK[20:]]),
                           ScriptedSTT("How much is a cleaning with Dr. Smith?"), None, log, end_silence_s=0.5,
                           tts=LoggedTTS(chunks=1, chunk_s=0.02), greeting="Hello, Riverside Dental.")
    await asyncio.wait_for(call.run(), 120)
    assert call.turns[0].heard_text == FALLBACK
    said = [e[1] for e in log if e[0] == "synthesize"]
    sentences = split_sentences(FALLBACK)
    assert len(sentences) == 2 and said[0] == "Hello, Riverside Dental." and sorted(said[1:3]) == sorted(sentences)
    assert all(said.count(sentence) == 1 for sentence in sentences)
    assert call.tts.used == 2  # both of the fallback's sentences, from the audio made after the greeting
