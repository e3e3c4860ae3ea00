"""TTS: Piper speaks audibly, for a plausible time, and Whisper hears the sentence back."""

from __future__ import annotations

import asyncio
import re
import shutil
import threading

import numpy as np
import pytest

from conftest import require_model
from voice.audio import STT_RATE, resample, rms_dbfs
from voice.errors import EngineNotInstalledError, ModelFileMissingError, ModelLoadError
from voice.tts import AudioChunk, CoquiTTS, PiperTTS, TTSEngine, load_tts, split_clauses, synthesize_async

pytestmark = pytest.mark.models

SENTENCES = [
    "Thank you for calling, how can I help you today?",
    "Your appointment is on Tuesday at ten thirty in the morning.",
    "We are open from nine until five, Monday to Friday.",
]


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


@pytest.fixture(scope="module")
def piper():
    return PiperTTS(require_model("piper-joe-medium") / "en_US-joe-medium.onnx")


@pytest.fixture(scope="module")
def whisper():
    from voice.stt import WhisperSTT

    return WhisperSTT(require_model("whisper-base"))


def speak(engine, text: str) -> tuple[np.ndarray, int]:
    chunks = list(engine.synthesize(text))
    assert chunks, "no audio"
    rates = {c.sample_rate for c in chunks}
    assert len(rates) == 1
    return np.concatenate([c.pcm for c in chunks]), rates.pop()


def test_piper_is_a_tts_engine(piper):
    assert isinstance(piper, TTSEngine)
    assert piper.sample_rate == 22050


@pytest.mark.parametrize("text", SENTENCES)
def test_piper_produces_audible_speech_of_plausible_length(piper, text):
    audio, rate = speak(piper, text)
    assert audio.dtype == np.float32 and np.all(np.abs(audio) <= 1.0)
    seconds = len(audio) / rate
    n_words = len(text.split())
    # Conversational English runs about 2-5 words a second (this voice is brisk: ~4.5).
    assert n_words / 6.0 < seconds < n_words / 1.5, seconds
    assert rms_dbfs(audio) > -30  # audible, not near-silent
    # Speech has pauses and loud parts: 50 ms windows span a wide range of levels.
    win = rate // 20
    levels = [rms_dbfs(audio[i:i + win]) for i in range(0, len(audio) - win, win)]
    assert max(levels) - np.median(levels) < 20 and max(levels) - min(levels) > 20


def test_whisper_hears_what_piper_said(piper, whisper):
    import jiwer

    refs, hyps = [], []
    for text in SENTENCES:
        audio, rate = speak(piper, text)
        refs.append(" ".join(words(text)))
        hyps.append(" ".join(words(whisper.transcribe(resample(audio, rate, STT_RATE)))))
    score = jiwer.wer(refs, hyps)
    print(f"\nPiper -> Whisper base WER {score:.1%}: {hyps}")
    assert score < 0.20


def test_numbers_are_normalised_before_synthesis(piper, whisper):
    audio, rate = speak(piper, "It costs $29.99.")
    heard = whisper.transcribe(resample(audio, rate, STT_RATE)).lower()
    assert "29" in heard or "twenty" in heard, heard
    assert "dollar" in heard or "$" in heard, heard


def test_empty_text_gives_no_audio(piper):
    assert list(piper.synthesize("")) == []
    assert list(piper.synthesize("   ")) == []


def test_without_noise_the_same_text_gives_the_same_samples():
    """noise_scale = noise_w_scale = 0 turns off Piper's sampling: tests that score speech
    (Smart Turn) need one figure, not a draw."""
    engine = PiperTTS(require_model("piper-joe-medium") / "en_US-joe-medium.onnx", noise_scale=0.0, noise_w_scale=0.0)
    first, rate = speak(engine, "I would like to book a cleaning and a checkup.")
    second, _ = speak(engine, "I would like to book a cleaning and a checkup.")
    assert first.size > rate  # over a second of speech
    np.testing.assert_array_equal(first, second)


def test_split_clauses_streams_earlier_chunks(piper):
    text = "Thank you for waiting on the line, your table for four is booked for Friday at eight in the evening."
    assert len(split_clauses(text)) == 2
    piper.split_clauses = True
    try:
        chunks = list(piper.synthesize(text))
    finally:
        piper.split_clauses = False
    assert len(chunks) == 2
    total = sum(c.duration for c in chunks)
    assert chunks[0].duration < 0.7 * total


async def test_synthesize_async_streams_chunks_in_order(piper):
    piper.split_clauses = True
    try:
        sync = [c.pcm for c in piper.synthesize(SENTENCES[2])]
        got = []
        async for chunk in synthesize_async(piper, SENTENCES[2]):
            assert isinstance(chunk, AudioChunk)
            got.append(chunk.pcm)
    finally:
        piper.split_clauses = False
    assert len(got) == len(sync) == 2
    # Piper samples noise, so lengths vary a little from run to run; clause by clause they match.
    for a, b in zip(got, sync):
        assert abs(len(a) - len(b)) < 0.2 * len(b)


async def test_synthesize_async_propagates_engine_errors():
    class Broken:
        sample_rate = 16000

        def synthesize(self, text):
            yield AudioChunk(np.zeros(10, np.float32), 16000)
            raise RuntimeError("engine fell over")

    got = []
    with pytest.raises(RuntimeError, match="fell over"):
        async for chunk in synthesize_async(Broken(), "x"):
            got.append(chunk)
    assert len(got) == 1


async def test_synthesize_async_does_not_block_the_loop():
    """A blocking engine that only goes on once the event loop has run something else
    meanwhile: were it run on the loop (or the loop waited for it), it would wait in vain."""
    ticked = threading.Event()
    waits: list[bool] = []

    class Slow:
        sample_rate = 16000

        def synthesize(self, text):
            for _ in range(3):
                ticked.clear()
                waits.append(ticked.wait(10))  # blocks until the loop ticked
                if not waits[-1]:
                    return
                yield AudioChunk(np.zeros(160, np.float32), 16000)

    async def ticker():
        while True:
            await asyncio.sleep(0.01)
            ticked.set()

    task = asyncio.create_task(ticker())
    n = 0
    try:
        async for _ in synthesize_async(Slow(), "x"):
            n += 1
    finally:
        task.cancel()
    assert waits == [True] * 3 and n == 3


# ---------------------------------------------------------------- bad models and engines


def _pulled_folder(folder):
    """A folder as the model store leaves it: its manifest names the catalog model."""
    import json

    from voice.errors import STORE_MANIFEST

    folder.mkdir(parents=True)
    (folder / STORE_MANIFEST).write_text(json.dumps({"name": "piper-joe-medium", "files": {}}))
    return folder


def test_missing_piper_voice_names_it_and_the_fix(tmp_path):
    missing = _pulled_folder(tmp_path / "piper-joe-medium") / "en_US-joe-medium.onnx"
    with pytest.raises(ModelFileMissingError) as info:
        PiperTTS(missing)
    assert str(missing) in str(info.value)
    assert "specvoice models pull piper-joe-medium" in str(info.value)
    # A voice given by hand gets no pull of a name the catalog does not have.
    with pytest.raises(ModelFileMissingError) as info:
        PiperTTS(tmp_path / "my-voices" / "me.onnx")
    assert "models pull me" not in str(info.value) and "Piper voice (.onnx" in str(info.value)


def test_missing_piper_config_names_it(tmp_path):
    folder = tmp_path / "piper-joe-medium"
    folder.mkdir()
    (folder / "v.onnx").write_bytes(b"onnx")
    with pytest.raises(ModelFileMissingError, match=r"v\.onnx\.json"):
        PiperTTS(folder / "v.onnx")


def test_corrupted_piper_voice_names_it_and_the_fix(tmp_path):
    src = require_model("piper-joe-medium")
    folder = _pulled_folder(tmp_path / "piper-joe-medium")
    shutil.copy(src / "en_US-joe-medium.onnx.json", folder / "en_US-joe-medium.onnx.json")
    with open(src / "en_US-joe-medium.onnx", "rb") as f:
        (folder / "en_US-joe-medium.onnx").write_bytes(f.read(1 << 16))  # truncated
    with pytest.raises(ModelLoadError) as info:
        PiperTTS(folder / "en_US-joe-medium.onnx")
    assert str(folder / "en_US-joe-medium.onnx") in str(info.value)
    assert "specvoice models pull piper-joe-medium" in str(info.value)


def test_coqui_without_its_package_says_how_to_install(tmp_path):
    try:
        import TTS  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("coqui-tts is installed here; this test covers its absence")
    with pytest.raises(EngineNotInstalledError, match=r"specvoice\[coqui\]"):
        CoquiTTS(tmp_path)


def test_unknown_engine_is_refused(tmp_path):
    with pytest.raises(ValueError, match="piper"):
        load_tts("festival", tmp_path)
