"""Streaming STT: LocalAgreement-2 on scripted hypotheses, the stream's schedule and tail on
a scripted recognizer, and one real run with whisper-tiny.en on an LJ Speech clip."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples, require_model, speech_clips
from voice.audio import STT_RATE
from voice.errors import AudioFormatError
from voice.streaming_stt import LocalAgreement, StreamingTranscriber, TranscriptEvent, Word, word_key

STEP = 0.3  # scripted words are 0.3 s each


def hyp(text: str, start: float = 0.0, step: float = STEP) -> list[Word]:
    """Words at fixed times: word i spans [start + i*step, start + (i+1)*step]."""
    return [Word(round(start + i * step, 3), round(start + (i + 1) * step, 3), w) for i, w in enumerate(text.split())]


def texts(words: list[Word]) -> str:
    return " ".join(w.text for w in words)


# ---------------------------------------------------------------- the policy


def test_two_agreeing_hypotheses_commit_their_common_prefix():
    la = LocalAgreement()
    assert la.insert(hyp("I would like")) == []  # one hypothesis confirms nothing
    assert la.tail_text == "I would like" and la.stable_text == ""
    assert texts(la.insert(hyp("I would like to book"))) == "I would like"
    assert la.stable_text == "I would like" and la.tail_text == "to book"
    assert la.last_end == pytest.approx(0.9)
    # A revision of the tail: only the agreed "to" is committed.
    assert texts(la.insert(hyp("I would like to look at"))) == "to"
    assert la.tail_text == "look at" and la.text == "I would like to look at"
    # A third hypothesis that agrees with the second's tail commits it.
    assert texts(la.insert(hyp("I would like to look at the"))) == "look at"
    assert la.stable_text == "I would like to look at" and la.tail_text == "the"


def test_a_disagreeing_first_word_commits_nothing():
    la = LocalAgreement()
    la.insert(hyp("then in the"))
    assert la.insert(hyp("than in the same")) == []
    assert la.tail_text == "than in the same"  # the newest hypothesis is the tail
    assert texts(la.insert(hyp("than in the same operations"))) == "than in the same"


def test_committed_words_are_never_revised():
    la = LocalAgreement()
    la.insert(hyp("book a cleaning"))
    la.insert(hyp("book a cleaning for"))
    assert la.stable_text == "book a cleaning"
    # Whisper changes its mind about committed audio: ignored, by time.
    assert texts(la.insert(hyp("look a cleaning for next"))) == "for"
    assert la.stable_text == "book a cleaning for" and la.tail_text == "next"


def test_case_and_punctuation_do_not_block_agreement():
    la = LocalAgreement()
    la.insert(hyp("on tuesday"))
    assert texts(la.insert(hyp("On Tuesday?"))) == "On Tuesday?"  # the newer spelling is kept
    assert word_key("Tuesday?") == word_key("tuesday") == "tuesday"
    assert word_key("don't,") == "don't" and word_key("...") == ""


def test_repeated_committed_words_at_the_boundary_are_dropped():
    """Timestamps drift between passes: a committed word can come back starting after the
    commit; the 1..5-word overlap at the head of the new words removes it."""
    la = LocalAgreement()
    la.insert(hyp("the true printed"))
    la.insert(hyp("the true printed book"))
    assert la.stable_text == "the true printed" and la.last_end == pytest.approx(0.9)
    drifted = [Word(0.0, 0.3, "the"), Word(0.3, 0.6, "true"), Word(0.85, 1.1, "printed"),
               Word(1.1, 1.4, "book"), Word(1.4, 1.7, "which")]
    assert texts(la.insert(drifted)) == "book"
    assert la.stable_text == "the true printed book" and la.tail_text == "which"


def test_finish_commits_the_last_hypothesis_after_the_stable_prefix():
    la = LocalAgreement()
    la.insert(hyp("has never"))
    la.insert(hyp("has never been"))
    assert la.stable_text == "has never"
    # The tail transcription, from 0.3 s on: "never" is re-heard, then the new words.
    assert texts(la.finish(hyp("never been surpassed.", start=0.3))) == "been surpassed."
    assert la.stable_text == "has never been surpassed." and la.tail == []


def test_empty_and_punctuation_only_hypotheses():
    la = LocalAgreement()
    assert la.insert([]) == [] and la.insert(hyp(". ...")) == []
    assert la.finish([]) == [] and la.stable_text == ""


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.lists(st.sampled_from(["a", "b", "c", "the", "book"]), max_size=8), min_size=1, max_size=8))
def test_stable_prefix_only_grows(hypotheses):
    la = LocalAgreement()
    before = ""
    for words in hypotheses:
        la.insert(hyp(" ".join(words)))
        assert la.stable_text.startswith(before)
        assert la.text.startswith(la.stable_text)
        before = la.stable_text
    la.finish(hyp(" ".join(hypotheses[-1])))
    assert la.stable_text.startswith(before)


# ---------------------------------------------------------------- the stream, scripted


class Scripted:
    """A recognizer that answers with the next scripted hypothesis and records its calls."""

    def __init__(self, *hypotheses: str, tail: str = ""):
        self.hypotheses = list(hypotheses)
        self.tail = tail
        self.calls: list[tuple[float, str | None]] = []  # (seconds of audio, prompt)

    def words(self, audio, prompt=None):
        self.calls.append((audio.size / STT_RATE, prompt))
        if len(self.calls) <= len(self.hypotheses):
            return hyp(self.hypotheses[len(self.calls) - 1])
        return hyp(self.tail)


def chunks(seconds: float, step: float = 0.1):
    """(pcm, t) pairs of quiet noise in simulated time, `step` seconds each."""
    rng = np.random.default_rng(0)
    n = int(round(seconds / step))
    for i in range(n):
        yield (rng.standard_normal(int(step * STT_RATE)) * 0.01).astype(np.float32), round((i + 1) * step, 3)


def test_passes_run_on_the_stream_clock_and_emit_events():
    rec = Scripted("I would", "I would like to", "I would like to book a")
    stream = StreamingTranscriber(recognizer=rec, interval_s=0.5, min_audio_s=0.5)
    events: list[TranscriptEvent] = []
    for pcm, t in chunks(1.5):
        events.extend(stream.feed(pcm, t))
    # First chunk at t=0.1: passes at 0.6 (0.5 after the first feed), 1.1; 1.5 is not due yet.
    assert [round(a, 1) for a, _ in rec.calls] == [0.6, 1.1]
    assert [(e.kind, e.text, e.new, e.at) for e in events] == [
        ("interim", "I would", "I would", 0.6),
        ("stable", "I would", "I would", 1.1),
        ("interim", "I would like to", "like to", 1.1),
    ]
    assert events[1].start == 0.0 and events[1].end == pytest.approx(0.6)
    assert stream.stable_text == "I would" and stream.text == "I would like to"


def test_finish_transcribes_only_the_tail_with_the_stable_text_as_prompt():
    rec = Scripted("has never been", "has never been surpassed", tail="been surpassed.")
    stream = StreamingTranscriber(recognizer=rec, interval_s=0.5, finish_overlap_s=0.0)
    for pcm, t in chunks(1.5):
        stream.feed(pcm, t)
    assert stream.stable_text == "has never been"  # ends at 0.9 s
    # The scripted tail's times count from the cut (0.9 s): "been" is at 0.9-1.2, after the
    # commit by time, and removed as a repeat of the last committed word.
    assert stream.finish() == "has never been surpassed."
    assert rec.calls[-1] == (pytest.approx(1.5 - 0.9), "has never been")
    stats = stream.stats
    assert stats.tail_s == pytest.approx(0.6) and stats.utterance_s == pytest.approx(1.5) and stats.passes == 2
    assert stream.stable_text == "" and stream.audio_s == 0  # ready for the next utterance


def test_finish_overlap_starts_the_tail_earlier_and_prompts_only_what_precedes_it():
    rec = Scripted("a b c d", "a b c d e", tail="c d e f")
    stream = StreamingTranscriber(recognizer=rec, interval_s=0.5, finish_overlap_s=0.5)
    for pcm, t in chunks(2.0):
        stream.feed(pcm, t)
    assert stream.stable_text == "a b c d"  # last_end 1.2 s; the cut is at 0.7 s
    assert stream.finish() == "a b c d e f"
    seconds, prompt = rec.calls[-1]
    assert seconds == pytest.approx(2.0 - 0.7) and prompt == "a b"


def test_finish_without_any_pass_transcribes_everything():
    rec = Scripted(tail="hello there")
    stream = StreamingTranscriber(recognizer=rec, interval_s=5.0)
    for pcm, t in chunks(1.0):
        assert stream.feed(pcm, t) == []
    assert stream.finish() == "hello there"
    assert rec.calls == [(pytest.approx(1.0), None)]
    assert stream.finish() == "hello there"  # an empty utterance still asks (the recognizer decides)


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        StreamingTranscriber()
    with pytest.raises(ValueError):
        StreamingTranscriber(recognizer=Scripted(), interval_s=0)
    with pytest.raises(AudioFormatError):
        StreamingTranscriber(recognizer=Scripted()).feed(np.zeros((2, 10), np.float32), 0.0)


async def test_async_feed_and_finish():
    rec = Scripted("one two", "one two three", tail="one two three four")  # the cut is at 0 s
    stream = StreamingTranscriber(recognizer=rec, interval_s=0.5)
    events = []
    for pcm, t in chunks(1.2):
        events += await stream.feed_async((pcm * 32767).astype(np.int16), t)  # int16 is accepted too
    assert [e.kind for e in events] == ["interim", "stable", "interim"]
    assert await stream.finish_async() == "one two three four"


# ---------------------------------------------------------------- real speech


@pytest.mark.models
def test_streaming_whisper_matches_the_whole_utterance_on_real_speech():
    import jiwer

    from test_voice_stt import words
    from voice.stt import WhisperSTT
    from voice.wav import read_wav

    stt = WhisperSTT(require_model("whisper-tiny.en"))
    clips = {path.name: (path, text) for path, text in speech_clips()}
    path, reference = clips["LJ001-0006.wav"]  # 5.7 s, the longest clip
    audio, _ = read_wav(path)
    whole = stt.transcribe(audio)

    stream = StreamingTranscriber(stt, interval_s=1.0)  # 5 passes: keeps the test under 10 s
    step = int(0.1 * STT_RATE)
    stables: list[str] = []
    for i in range(0, audio.size, step):
        for event in stream.feed(audio[i:i + step], (i + step) / STT_RATE):
            if event.kind == "stable":
                stables.append(event.text)
    final = stream.finish()

    assert len(stables) >= 2, stables  # words became stable while "speaking"
    for before, after in zip(stables, stables[1:]):
        assert after.startswith(before) and len(after) > len(before)
    assert final.startswith(stables[-1])
    wer_whole = jiwer.wer(words(reference), words(whole))
    wer_stream = jiwer.wer(words(reference), words(final))
    assert wer_stream <= wer_whole + 0.08, (final, whole)  # at most one more error in 13 words
    assert stream.stats.tail_s < stream.stats.utterance_s / 2


async def test_async_passes_never_overlap_and_finish_waits_for_the_pass():
    import asyncio
    import threading

    go = threading.Event()

    class Blocking(Scripted):
        def words(self, audio, prompt=None):
            go.wait(5)
            return super().words(audio, prompt)

    rec = Blocking("one two", tail="one two three")
    stream = StreamingTranscriber(recognizer=rec, interval_s=0.5)
    feeds = []
    for pcm, t in chunks(1.2):  # a pass is due at 0.6 s and again at 1.1 s, while the first runs
        feeds.append(asyncio.ensure_future(stream.feed_async(pcm, t)))
        await asyncio.sleep(0)
    finished = asyncio.ensure_future(stream.finish_async())
    await asyncio.sleep(0.05)
    assert not finished.done()  # waits for the running pass
    go.set()
    results = await asyncio.gather(*feeds)
    assert [[e.kind for e in events] for events in results] == [[]] * 5 + [["interim"]] + [[]] * 6
    assert await finished == "one two three"
    assert [round(seconds, 1) for seconds, _ in rec.calls] == [0.6, 1.2]  # one pass, then the whole tail


def test_reset_discards_a_running_pass():
    rec = Scripted("one two", "one two three")
    stream = StreamingTranscriber(recognizer=rec, interval_s=0.5)
    for pcm, t in chunks(0.5):
        stream.feed(pcm, t)
    generation = stream._generation
    stream.reset()
    assert stream._pass(np.zeros(STT_RATE, np.float32), 1.0, generation) == []
    assert stream.text == "" and rec.calls  # the recognizer ran; its answer was dropped


def test_a_long_utterance_restarts_the_buffer_at_the_last_committed_word():
    rec = Scripted("a b c", "a b c d", "d e f", "d e f g")  # after the trim, times count from the cut
    stream = StreamingTranscriber(recognizer=rec, interval_s=0.5, max_buffer_s=1.0)
    for pcm, t in chunks(2.1):
        stream.feed(pcm, t)
    # Passes at 0.6 and 1.1 s commit "a b c" (ends 0.9 s). At 1.6 s the buffer is over 1 s
    # long: the pass hears the audio from 0.9 s on, with the words before it as the prompt,
    # and commits "d" (ends 1.2 s); at 2.1 s it restarts at 1.2 s, where the re-heard "d"
    # is dropped as a repeat and "e f" is confirmed.
    assert [(round(s, 1), p) for s, p in rec.calls] == [(0.6, None), (1.1, None), (0.7, "a b c"), (0.9, "a b c d")]
    assert stream.stable_text == "a b c d e f"


async def test_a_pass_on_all_the_audio_is_the_final_transcript_without_another_run():
    recognizer = Scripted("one two", "one two three", tail="never asked")
    stream = StreamingTranscriber(recognizer=recognizer, interval_s=0.5)
    for pcm, t in chunks(1.0):
        await stream.feed_async(pcm, t)
    assert len(recognizer.calls) == 1 and not stream.heard_all  # audio came after that pass
    await stream.pass_now_async(1.0)  # the caller fell silent: a pass on all of it
    assert stream.heard_all and len(recognizer.calls) == 2
    assert await stream.pass_now_async(1.1) == []  # nothing new to hear: no pass
    assert await stream.peek_async() == ("one two three", 0.0, 0.0)
    assert await stream.finish_async() == "one two three"
    assert len(recognizer.calls) == 2 and stream.stats.tail_s == 0.0


async def test_the_silence_pass_runs_beside_a_slow_interval_pass_which_then_counts_for_nothing():
    import asyncio
    import threading

    release, started = threading.Event(), threading.Event()

    class FirstBlocks(Scripted):
        def words(self, audio, prompt=None):
            if not self.calls:  # the interval pass: held until the silence pass is done
                self.calls.append((audio.size / STT_RATE, prompt))
                started.set()
                release.wait(30)
                return hyp("one")
            return super().words(audio, prompt)

    recognizer = FirstBlocks("placeholder", "one two three")
    stream = StreamingTranscriber(recognizer=recognizer, interval_s=0.5)
    chunk = list(chunks(1.0))
    for pcm, t in chunk[:5]:
        assert await stream.feed_async(pcm, t) == []  # not due yet
    interval = asyncio.ensure_future(stream.feed_async(*chunk[5]))  # due: the interval pass
    assert await asyncio.to_thread(started.wait, 30)  # the interval pass is running (and blocked)
    for pcm, t in chunk[6:]:
        stream.append(pcm)
    await stream.pass_now_async(1.0)  # not queued behind the blocked pass
    assert stream.heard_all and stream.text == "one two three"
    release.set()
    assert await interval == []  # it heard less and finished later: stale, not committed
    assert stream.heard_all and stream.text == "one two three" and stream.snapshot().passes == 1
    assert await stream.finish_async() == "one two three"
