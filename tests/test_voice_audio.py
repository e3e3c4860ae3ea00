"""Audio utilities: G.711 mu-law against the stdlib reference, resampling, framing, WAV files."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import soundfile as sf
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from voice import mulaw
from voice.audio import Rebuffer, frames, resample, rms_dbfs, to_float32, to_int16
from voice.errors import AudioFormatError
from voice.wav import read_wav, write_wav

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import audioop  # stdlib up to 3.12: the reference implementation
    except ImportError:  # Python >= 3.13
        audioop = pytest.importorskip("audioop_lts", reason="no audioop reference (pip install audioop-lts)")

ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16)
ALL_CODES = np.arange(256, dtype=np.uint8)


# ---------------------------------------------------------------- mu-law vs reference


def test_mulaw_encode_is_bit_exact_with_audioop_for_every_int16():
    ref = np.frombuffer(audioop.lin2ulaw(ALL_INT16.tobytes(), 2), dtype=np.uint8)
    ours = mulaw.encode(ALL_INT16)
    assert ours.dtype == np.uint8
    mismatches = np.flatnonzero(ours != ref)
    assert mismatches.size == 0, f"first mismatch at sample {ALL_INT16[mismatches[0]]}"


def test_mulaw_decode_is_bit_exact_with_audioop_for_every_code():
    ref = np.frombuffer(audioop.ulaw2lin(ALL_CODES.tobytes(), 2), dtype=np.int16)
    assert np.array_equal(mulaw.decode(ALL_CODES), ref)
    assert np.array_equal(mulaw.decode(ALL_CODES.tobytes()), ref)  # bytes input too


def test_mulaw_decode_rejects_non_uint8():
    with pytest.raises(TypeError):
        mulaw.decode(np.zeros(4, dtype=np.int16))


def test_mulaw_sine_snr_is_telephone_quality():
    t = np.arange(8000) / 8000
    x = to_int16(0.3 * np.sin(2 * np.pi * 440 * t))
    y = mulaw.decode(mulaw.encode(x)).astype(np.float64)
    noise = y - x
    snr = 10 * np.log10(np.sum(x.astype(np.float64) ** 2) / np.sum(noise**2))
    assert snr > 35.0, snr  # G.711 gives ~38 dB over most of its range


# ---------------------------------------------------------------- mu-law properties

int16_arrays = arrays(np.int16, st.integers(0, 400), elements=st.integers(-32768, 32767))


@settings(max_examples=examples(200), deadline=None)
@given(int16_arrays)
def test_mulaw_roundtrip_error_is_bounded(x):
    y = mulaw.decode(mulaw.encode(x)).astype(np.int64)
    xi = x.astype(np.int64)
    err = np.abs(y - xi)
    # Logarithmic quantiser: at most 8 LSB near zero, and about 1/10 of the level above
    # (8 bits: 3 of segment, 4 of mantissa, sign), including the clip at +-32124.
    small = np.abs(xi) < 64
    assert np.all(err[small] <= 8)
    assert np.all(err[~small] <= 0.11 * np.abs(xi[~small]))
    assert np.all(np.sign(y[np.abs(xi) > 8]) == np.sign(xi[np.abs(xi) > 8]))


@settings(max_examples=examples(200), deadline=None)
@given(int16_arrays)
def test_mulaw_decode_encode_is_idempotent(x):
    once = mulaw.decode(mulaw.encode(x))
    twice = mulaw.decode(mulaw.encode(once))
    assert np.array_equal(once, twice)


@settings(max_examples=examples(100), deadline=None)
@given(arrays(np.uint8, st.integers(0, 300)))
def test_mulaw_codes_survive_decode_encode(codes):
    # Every code except the "negative zero" 0x7F decodes to a value that encodes back to itself.
    back = mulaw.encode(mulaw.decode(codes))
    keep = codes != 0x7F
    assert np.array_equal(back[keep], codes[keep])


# ---------------------------------------------------------------- sample formats


def test_int16_float_conversion_round_trips_and_clips():
    assert np.array_equal(to_int16(to_float32(ALL_INT16)), ALL_INT16)
    assert to_int16(np.array([1.5, -1.5, 1.0], dtype=np.float32)).tolist() == [32767, -32768, 32767]
    assert to_float32(np.array([-32768], dtype=np.int16))[0] == -1.0
    assert rms_dbfs(np.zeros(10, np.float32)) == float("-inf")


# ---------------------------------------------------------------- resampling


def _dominant_frequency(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / rate)[np.argmax(spectrum)])


@pytest.mark.parametrize("src,dst", [(22050, 16000), (48000, 16000), (16000, 8000), (8000, 16000), (44100, 22050)])
def test_resampled_sine_keeps_frequency_and_amplitude(src, dst):
    freq, amp = 440.0, 0.5
    t = np.arange(src) / src  # one second
    x = (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    y = resample(x, src, dst)
    assert y.dtype == np.float32
    assert abs(len(y) - dst) <= 1
    assert abs(_dominant_frequency(y, dst) - freq) <= 1.0
    core = y[dst // 10: -dst // 10]  # skip filter edges
    assert abs(np.max(np.abs(core)) - amp) < 0.01
    assert abs(np.sqrt(np.mean(core**2)) - amp / np.sqrt(2)) < 0.01


def test_resample_removes_content_above_new_nyquist():
    t = np.arange(16000) / 16000
    x = (0.5 * np.sin(2 * np.pi * 6000 * t)).astype(np.float32)  # above 4 kHz
    y = resample(x, 16000, 8000)
    assert rms_dbfs(y[800:-800]) < -40  # filtered out, not aliased down to 2 kHz


def test_resample_int16_stays_int16_and_same_rate_is_identity():
    x = to_int16(np.sin(np.arange(1000) / 5) * 0.5)
    assert resample(x, 16000, 8000).dtype == np.int16
    assert resample(x, 16000, 16000) is x
    with pytest.raises(AudioFormatError):
        resample(x, 0, 8000)


# ---------------------------------------------------------------- framing


@pytest.mark.parametrize("ms,size", [(20, 320), (30, 480)])
def test_frames_are_fixed_size_and_pad_the_tail(ms, size):
    x = np.arange(1000, dtype=np.float32)
    out = list(frames(x, 16000, ms))
    assert all(len(f) == size for f in out)
    assert len(out) == -(-1000 // size)
    assert np.array_equal(np.concatenate(out)[:1000], x)
    assert np.all(np.concatenate(out)[1000:] == 0)
    assert len(list(frames(x, 16000, ms, pad=False))) == 1000 // size


def test_frames_reject_fractional_sizes():
    with pytest.raises(AudioFormatError):
        list(frames(np.zeros(10), 8000, 0.01))


def test_rebuffer_turns_arbitrary_blocks_into_exact_frames():
    rng = np.random.default_rng(1)
    x = rng.normal(size=5000).astype(np.float32)
    rb, out, i = Rebuffer(512), [], 0
    for size in rng.integers(1, 700, size=100):
        out += rb.push(x[i:i + size])
        i += size
        if i >= len(x):
            break
    assert all(len(f) == 512 for f in out)
    tail = rb.flush()
    joined = np.concatenate(out + ([tail] if tail is not None else []))
    assert np.array_equal(joined[:min(i, len(x))], x[:min(i, len(x))])


# ---------------------------------------------------------------- phone round trip


def test_phone_roundtrip_keeps_length_and_speech_band():
    t = np.arange(16000) / 16000
    x = (0.3 * np.sin(2 * np.pi * 1000 * t) + 0.3 * np.sin(2 * np.pi * 6000 * t)).astype(np.float32)
    y = mulaw.phone_roundtrip(x, 16000)
    assert abs(len(y) - len(x)) <= 2
    spectrum = np.abs(np.fft.rfft(y[1600:-1600]))
    freqs = np.fft.rfftfreq(len(y) - 3200, 1 / 16000)
    assert spectrum[np.argmin(np.abs(freqs - 1000))] > 100 * spectrum[np.argmin(np.abs(freqs - 6000))]


# ---------------------------------------------------------------- WAV files


def test_wav_write_read_round_trip(tmp_path):
    x = (0.5 * np.sin(np.arange(16000) / 7)).astype(np.float32)
    path = write_wav(tmp_path / "sub" / "a.wav", x, 16000)
    y, rate = read_wav(path)
    assert rate == 16000 and y.dtype == np.float32
    assert np.max(np.abs(y - x)) < 1e-4  # 16-bit quantisation only


def test_wav_empty_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "empty.wav"
    path.write_bytes(b"")
    with pytest.raises(AudioFormatError, match="empty.wav"):
        read_wav(path)


def test_wav_with_broken_header_is_refused_naming_it(tmp_path):
    path = tmp_path / "broken.wav"
    path.write_bytes(b"RIFF\x00\x00\x00\x00WAVEfmt garbage" * 4)
    with pytest.raises(AudioFormatError, match="broken.wav"):
        read_wav(path)
    text = tmp_path / "notes.wav"
    text.write_text("this is not audio at all\n" * 20)
    with pytest.raises(AudioFormatError, match="notes.wav"):
        read_wav(text)


def test_wav_missing_file_is_refused(tmp_path):
    with pytest.raises(AudioFormatError, match="nope.wav"):
        read_wav(tmp_path / "nope.wav")


def test_wav_with_header_but_no_samples_reads_as_empty(tmp_path):
    path = tmp_path / "zero.wav"
    sf.write(path, np.zeros(0), 16000, subtype="PCM_16")
    y, rate = read_wav(path)
    assert y.size == 0 and rate == 16000


def test_wav_8bit_unsigned_is_converted(tmp_path):
    path = tmp_path / "u8.wav"
    x = 0.5 * np.sin(2 * np.pi * 200 * np.arange(8000) / 8000)
    sf.write(path, x, 8000, subtype="PCM_U8")
    y, rate = read_wav(path, sample_rate=None)
    assert rate == 8000
    assert abs(np.max(y) - 0.5) < 0.02 and abs(np.min(y) + 0.5) < 0.02  # centred, not offset by 128
    assert abs(_dominant_frequency(y, 8000) - 200) <= 1.0


def test_wav_stereo_is_mixed_down(tmp_path):
    path = tmp_path / "stereo.wav"
    left = 0.4 * np.sin(2 * np.pi * 300 * np.arange(16000) / 16000)
    stereo = np.stack([left, np.zeros_like(left)], axis=1)
    sf.write(path, stereo, 16000, subtype="PCM_16")
    y, _ = read_wav(path)
    assert y.ndim == 1 and len(y) == 16000
    assert abs(np.max(np.abs(y)) - 0.2) < 0.01  # the mean of the two channels
    both, _ = read_wav(path, mono=False)
    assert both.shape == (16000, 2)


def test_wav_48k_is_resampled_to_16k(tmp_path):
    path = tmp_path / "hi.wav"
    x = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(48000) / 48000)
    sf.write(path, x, 48000, subtype="PCM_16")
    y, rate = read_wav(path)
    assert rate == 16000 and abs(len(y) - 16000) <= 1
    assert abs(_dominant_frequency(y, 16000) - 1000) <= 1.0
    native, native_rate = read_wav(path, sample_rate=None)
    assert native_rate == 48000 and len(native) == 48000
