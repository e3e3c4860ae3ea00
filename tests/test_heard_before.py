"""Moonshine's decoder drafts from the transcript of the audio's beginning (voice/heard_before.py):
which earlier transcript is a draft for which audio, what a draft guesses, and on real
speech that a turn transcribed as it grows gets the same words in fewer decoder forwards."""

from __future__ import annotations

import numpy as np
import pytest

from voice.heard_before import HEAD, HeardBefore, next_guess


def _audio(seconds: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.1, int(seconds * 16000)).astype(np.float32)


# ---------------------------------------------------------------- which audio drafts which


def test_the_longest_remembered_beginning_is_the_draft():
    audio = _audio(3.0, 1)
    heard = HeardBefore()
    heard.remember(audio[:12800], [5, 6])
    heard.remember(audio[:25600], [5, 6, 7, 8])
    heard.remember(_audio(2.0, 2), [9, 9])  # another caller
    assert heard.draft_for(audio) == ([5, 6, 7, 8], False)
    assert heard.draft_for(audio[:20000]) == ([5, 6], False)


def test_the_very_same_audio_is_told_apart_from_a_longer_one():
    audio = _audio(2.0, 3)
    heard = HeardBefore()
    heard.remember(audio, [4, 5, 6])
    assert heard.draft_for(audio.copy()) == ([4, 5, 6], True)
    assert heard.draft_for(np.concatenate([audio, _audio(0.5, 4)])) == ([4, 5, 6], False)


def test_audio_that_differs_anywhere_is_no_draft():
    audio = _audio(2.0, 5)
    heard = HeardBefore()
    heard.remember(audio[:16000], [1, 2])
    changed = audio.copy()
    changed[8000] += 0.01  # the same first 10 ms, one sample different further on
    assert heard.draft_for(changed) == ([], False)
    assert heard.draft_for(audio[:8000]) == ([], False)  # shorter than what was heard
    assert heard.draft_for(audio[:HEAD - 1]) == ([], False)


def test_only_the_last_utterances_are_kept_and_zero_keeps_none():
    heard = HeardBefore(size=2)
    clips = [_audio(1.0, 10 + i) for i in range(3)]
    for i, clip in enumerate(clips):
        heard.remember(clip, [i])
    assert heard.draft_for(clips[0]) == ([], False)
    assert heard.draft_for(clips[2]) == ([2], True)
    off = HeardBefore(size=0)
    off.remember(clips[0], [1])
    assert off.draft_for(clips[0]) == ([], False)


# ---------------------------------------------------------------- what a draft guesses


def test_guess_follows_the_earlier_transcript_while_it_agrees():
    source = [10, 11, 12, 13, 14]
    assert next_guess(source, [], 3) == [10, 11, 12]
    assert next_guess(source, [10, 11], 8) == [12, 13, 14]
    assert next_guess(source, [10, 11, 12, 13, 14], 4) == []  # the new words are the decoder's
    assert next_guess(source, [10], 0) == []


def test_after_a_word_heard_differently_the_guess_picks_up_where_they_agree_again():
    source = [10, 11, 12, 13, 14, 15]  # "... 12 ..." was cut or misheard the first time
    assert next_guess(source, [10, 11, 40, 13], 2) == [14, 15]  # the last token found again
    assert next_guess(source, [10, 11, 40, 12, 13], 2) == [14, 15]  # the last two, found
    assert next_guess(source, [10, 11, 40], 2) == []  # nothing of it in the source
    assert next_guess([7, 8, 7, 9], [1, 7], 1) == [9]  # the latest occurrence with a continuation


# ---------------------------------------------------------------- on real speech


def _engines():
    from conftest import require_model
    from voice.moonshine import MoonshineSTT

    path = require_model("moonshine-base-en")
    return MoonshineSTT(path, remember=32), MoonshineSTT(path, remember=0)


def _count_forwards(stt) -> list[int]:
    calls = [0]
    run = stt.with_past.run

    def counted(*args, **kwargs):
        calls[0] += 1
        return run(*args, **kwargs)

    stt.with_past.run = counted
    return calls


@pytest.mark.models
def test_a_turn_transcribed_as_it_grows_gets_the_same_words_in_fewer_forwards():
    """Each LJ clip as a call's turn is heard: its first 0.8, 1.6, ... s, then all of it.
    The whole clip's transcript drafted from its beginning's has the words of one decoded
    without drafts (WER within a point over the clips), in fewer decoder forwards."""
    import jiwer

    from bench.voice import wer_words
    from conftest import speech_clips
    from voice.wav import read_wav

    drafted_stt, plain_stt = _engines()
    drafted_forwards, plain_forwards = _count_forwards(drafted_stt), _count_forwards(plain_stt)
    refs, drafted, plain, taken = [], [], [], 0
    for path, ref in speech_clips():
        audio = read_wav(path)[0]
        for n in range(12800, len(audio), 12800):
            drafted_stt.transcribe(audio[:n])
        before = drafted_forwards[0], plain_forwards[0]
        whole = drafted_stt.transcribe_full(audio)
        drafted.append(whole.text)
        taken += whole.drafted_tokens
        plain.append(plain_stt.transcribe(audio))
        refs.append(ref)
        print(f"\n  {whole.drafted_tokens} drafted; forwards {drafted_forwards[0] - before[0]} "
              f"against {plain_forwards[0] - before[1]}: {whole.text}")
    score = lambda hyps: jiwer.wer([wer_words(r) for r in refs], [wer_words(h) for h in hyps])  # noqa: E731
    assert taken > 0
    assert abs(score(drafted) - score(plain)) <= 0.01, (drafted, plain)
    # The last whole clip alone: drafted, it took fewer forwards than decoding it token by token.
    assert drafted_forwards[0] - before[0] < plain_forwards[0] - before[1]


@pytest.mark.models
def test_a_wrong_draft_leaves_the_words_as_they_were():
    """Another clip's transcript as the draft: the decoder refuses its tokens and writes its
    own (WER within a point of decoding without a draft over the clips)."""
    import jiwer

    from bench.voice import wer_words
    from conftest import speech_clips
    from voice.decode_guard import max_new_tokens
    from voice.wav import read_wav

    stt, _ = _engines()
    clips = [(read_wav(path)[0], ref) for path, ref in speech_clips()]
    own, crossed = [], []
    for i, (audio, _ref) in enumerate(clips):
        hidden = stt.encoder.run(None, {"input_values": audio[None, :]})[0]
        limit = max_new_tokens(len(audio) / 16000)
        other = clips[(i + 1) % len(clips)][0]
        wrong, _ = stt.generate(stt.encoder.run(None, {"input_values": other[None, :]})[0], 64)
        own.append(stt.tokenizer.decode(stt.generate(hidden, limit)[0]))
        crossed.append(stt.tokenizer.decode(stt.generate(hidden, limit, draft=wrong)[0]))
    refs = [wer_words(r) for _, r in clips]
    assert abs(jiwer.wer(refs, [wer_words(h) for h in crossed]) - jiwer.wer(refs, [wer_words(h) for h in own])) <= 0.01


@pytest.mark.models
def test_the_same_audio_again_gets_its_transcript_without_a_forward():
    from conftest import speech_clips
    from voice.wav import read_wav

    stt, _ = _engines()
    forwards = _count_forwards(stt)
    audio = read_wav(speech_clips()[0][0])[0]
    first = stt.transcribe_full(audio)
    done = forwards[0]
    again = stt.transcribe_full(audio.copy())
    assert again.text == first.text and forwards[0] == done and first.text
