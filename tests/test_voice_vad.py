"""VAD and endpointing: scripted VAD for the state machine, Silero on built signals with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import speech_clips
from voice.audio import frames
from voice.endpointer import EndpointConfig, Endpointer, SpeechEnded, SpeechStarted
from voice.vad import CHUNK, SileroModel, SileroVAD

SR = 16000
CHUNK_S = CHUNK / SR  # 0.032 s


class ScriptedVAD:
    """A fake VAD: P(speech) is 1 when the chunk's mean is positive (tests write 1.0 or 0.0)."""

    chunk_samples = CHUNK

    def __init__(self):
        self.resets = 0

    def __call__(self, chunk):
        return 0.9 if float(np.mean(chunk)) > 0.5 else 0.05

    def reset(self):
        self.resets += 1


def pattern(*segments: tuple[float, float]) -> np.ndarray:
    """(seconds, level) pieces -> a signal the ScriptedVAD reads as voiced where level is 1."""
    return np.concatenate([np.full(int(round(s * SR)), lvl, dtype=np.float32) for s, lvl in segments])


def run(ep: Endpointer, x: np.ndarray, t0: float = 0.0, frame_ms: float = 20) -> list:
    n = int(SR * frame_ms / 1000)
    events = []
    for i, f in enumerate(frames(x, SR, frame_ms)):
        events += ep.feed(f, t0 + i * n / SR)
    return events


# ---------------------------------------------------------------- state machine (scripted VAD)


def test_start_needs_min_speech_and_end_needs_min_silence():
    ep = Endpointer(ScriptedVAD(), EndpointConfig(min_speech_ms=200, min_silence_ms=500))
    x = pattern((1.024, 0), (1.024, 1), (1.024, 0))  # chunk-aligned: speech from 1.024 s to 2.048 s
    events = run(ep, x, t0=100.0)
    assert [type(e) for e in events] == [SpeechStarted, SpeechEnded]
    start, end = events
    assert start.start_t == pytest.approx(101.024)
    # 200 ms of speech needs 7 chunks of 32 ms (224 ms) before the start is declared.
    assert start.declared_t == pytest.approx(101.024 + 7 * CHUNK_S)
    assert end.last_voiced_t == pytest.approx(102.048)
    # 500 ms of silence needs 16 chunks (512 ms).
    assert end.declared_t == pytest.approx(102.048 + 16 * CHUNK_S)
    assert end.endpoint_delay == pytest.approx(16 * CHUNK_S)
    assert end.reason == "silence"


def test_short_blips_do_not_start_an_utterance():
    ep = Endpointer(ScriptedVAD(), EndpointConfig(min_speech_ms=200))
    x = pattern((0.512, 0), (0.128, 1), (0.512, 0), (0.160, 1), (1.0, 0))
    assert run(ep, x) == []


def test_short_pauses_inside_speech_do_not_end_it():
    ep = Endpointer(ScriptedVAD(), EndpointConfig(min_silence_ms=500))
    x = pattern((0.512, 0), (0.512, 1), (0.384, 0), (0.512, 1), (1.024, 0))
    events = run(ep, x)
    assert [type(e) for e in events] == [SpeechStarted, SpeechEnded]
    assert events[1].last_voiced_t == pytest.approx(0.512 + 0.512 + 0.384 + 0.512)


def test_configurable_silence_changes_the_endpoint():
    x = pattern((0.512, 0), (0.512, 1), (0.800, 0), (0.512, 1), (1.5, 0))
    long = run(Endpointer(ScriptedVAD(), EndpointConfig(min_silence_ms=1000)), x)
    short = run(Endpointer(ScriptedVAD(), EndpointConfig(min_silence_ms=300)), x)
    assert sum(isinstance(e, SpeechEnded) for e in long) == 1
    assert sum(isinstance(e, SpeechEnded) for e in short) == 2
    assert [e for e in short if isinstance(e, SpeechEnded)][0].endpoint_delay == pytest.approx(10 * CHUNK_S)


def test_pre_roll_keeps_audio_before_the_start_and_post_roll_trims_the_tail():
    cfg = EndpointConfig(pre_roll_ms=300, post_roll_ms=150, min_silence_ms=500)
    ep = Endpointer(ScriptedVAD(), cfg)
    x = pattern((1.024, 0), (0.512, 1), (1.024, 0))
    end = [e for e in run(ep, x) if isinstance(e, SpeechEnded)][0]
    # Audio starts at least 300 ms before the first voiced sample ...
    assert end.start_t - end.audio_start_t >= 0.300 - 1e-9
    assert end.start_t - end.audio_start_t < 0.300 + CHUNK_S
    # ... and the voiced samples are all inside it, followed by 150 ms of tail.
    lead = int(round((end.start_t - end.audio_start_t) * SR))
    voiced = end.audio[lead:lead + int(0.512 * SR)]
    assert np.all(voiced == 1.0) and np.all(end.audio[:lead] == 0.0)
    assert end.duration == pytest.approx((end.start_t - end.audio_start_t) + 0.512 + 0.150, abs=1e-3)


def test_max_utterance_forces_an_end():
    ep = Endpointer(ScriptedVAD(), EndpointConfig(max_utterance_s=2.0))
    events = run(ep, pattern((0.512, 0), (5.0, 1)))
    ends = [e for e in events if isinstance(e, SpeechEnded)]
    assert ends and ends[0].reason == "max_length"
    assert ends[0].declared_t - ends[0].start_t == pytest.approx(2.0, abs=CHUNK_S)
    assert ep.in_speech  # the speaker kept talking: a new utterance started


def test_flush_closes_an_open_utterance():
    ep = Endpointer(ScriptedVAD())
    run(ep, pattern((0.5, 0), (1.0, 1)))
    assert ep.in_speech
    (end,) = ep.flush()
    assert end.reason == "flush"
    assert ep.flush() == []


def test_frame_size_does_not_change_the_answer():
    x = pattern((0.7, 0), (0.9, 1), (0.3, 0), (0.4, 1), (1.2, 0))
    a = run(Endpointer(ScriptedVAD()), x, frame_ms=20)
    b = run(Endpointer(ScriptedVAD()), x, frame_ms=30)
    c = run(Endpointer(ScriptedVAD()), x, frame_ms=32)
    key = lambda ev: [(type(e).__name__, round(getattr(e, "start_t", 0), 6), round(getattr(e, "last_voiced_t", 0), 6)) for e in ev]
    assert key(a) == key(b) == key(c) and len(a) == 2


def test_vad_state_is_reset_after_each_utterance():
    vad = ScriptedVAD()
    ep = Endpointer(vad)
    resets = vad.resets
    run(ep, pattern((0.5, 0), (0.5, 1), (1.0, 0)))
    assert vad.resets == resets + 1


def test_wrong_sample_rate_is_refused():
    with pytest.raises(ValueError, match="16000"):
        Endpointer(ScriptedVAD(), sample_rate=8000)


# ---------------------------------------------------------------- Silero on built signals


@pytest.fixture(scope="module")
def silero():
    return SileroModel()


@pytest.fixture(scope="module")
def clips():
    from voice.wav import read_wav

    return [read_wav(path)[0] for path, _ in speech_clips()]


def test_silero_stream_rejects_wrong_chunk_and_shares_the_model(silero):
    a, b = SileroVAD(silero), SileroVAD(silero)
    assert a.model is b.model
    with pytest.raises(ValueError, match="512"):
        a(np.zeros(480, np.float32))


def test_silero_segments_match_known_boundaries(silero, clips):
    # The LJ Speech clips are trimmed to the speech, so where each one is placed in the
    # signal is where speech starts and ends (within a few tens of ms of breath).
    gaps = [1.0, 1.2, 0.9, 1.5, 1.0]
    t0 = 5000.0
    parts, truth, t = [np.zeros(SR, np.float32)], [], 1.0
    for clip, gap in zip(clips, gaps):
        truth.append((t0 + t, t0 + t + len(clip) / SR))
        parts += [clip, np.zeros(int(gap * SR), np.float32)]
        t += len(clip) / SR + gap
    ep = Endpointer(SileroVAD(silero), EndpointConfig(min_silence_ms=500))
    events = run(ep, np.concatenate(parts), t0=t0, frame_ms=20)
    starts = [e for e in events if isinstance(e, SpeechStarted)]
    ends = [e for e in events if isinstance(e, SpeechEnded)]
    assert len(starts) == len(ends) == len(clips), events
    for (a, b), s, e in zip(truth, starts, ends):
        print(f"start {s.start_t - a:+.3f}s  end {e.last_voiced_t - b:+.3f}s  endpoint_delay {e.endpoint_delay:.3f}s")
        assert abs(s.start_t - a) <= 0.100
        assert abs(e.last_voiced_t - b) <= 0.100
        assert e.start_t == s.start_t
        assert 0.5 <= e.endpoint_delay <= 0.5 + 2 * CHUNK_S
        assert e.declared_t > e.last_voiced_t
        assert e.audio_start_t <= a  # pre-roll: nothing of the first syllable is cut


def _pink_noise(n: int, rng) -> np.ndarray:
    # 1/f power: shape white noise's spectrum by 1/sqrt(f).
    spectrum = np.fft.rfft(rng.normal(size=n))
    f = np.fft.rfftfreq(n)
    f[0] = f[1]
    x = np.fft.irfft(spectrum / np.sqrt(f), n)
    return x / np.max(np.abs(x))


@pytest.mark.parametrize("kind", ["silence", "white", "pink", "white_loud"])
def test_silence_and_noise_produce_no_utterance(silero, kind):
    rng = np.random.default_rng(7)
    n = 6 * SR
    x = {
        "silence": np.zeros(n),
        "white": rng.normal(0, 0.05, n),  # about -26 dBFS
        "pink": 0.3 * _pink_noise(n, rng),
        "white_loud": np.clip(rng.normal(0, 0.3, n), -1, 1),
    }[kind].astype(np.float32)
    ep = Endpointer(SileroVAD(silero))
    assert run(ep, x) == []
    assert ep.flush() == []
