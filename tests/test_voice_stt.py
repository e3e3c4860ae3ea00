"""Whisper STT on real speech (LJ Speech clips), over a phone line, and on bad input."""

from __future__ import annotations

import asyncio
import re
import shutil
import time

import numpy as np
import pytest

from conftest import require_model, speech_clips
from voice.errors import AudioFormatError, ModelFileMissingError, ModelLoadError
from voice.mulaw import phone_roundtrip
from voice.stt import WhisperSTT
from voice.wav import read_wav

pytestmark = pytest.mark.models

# WER ceilings across the clips, per model (base is the better model).
WER_LIMIT = {"whisper-tiny.en": 0.20, "whisper-base": 0.15}
PHONE_WER_LIMIT = 0.25


def words(text: str) -> str:
    """WER normalisation: lower case, punctuation stripped (apostrophes kept)."""
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


def wer(refs: list[str], hyps: list[str]) -> float:
    import jiwer

    return jiwer.wer([words(r) for r in refs], [words(h) for h in hyps])


@pytest.fixture(scope="module")
def clips():
    return [(read_wav(path)[0], transcript) for path, transcript in speech_clips()]


_loaded: dict[str, WhisperSTT] = {}


@pytest.fixture(scope="module", params=["whisper-tiny.en", "whisper-base"])
def stt(request):
    name = request.param
    path = require_model(name)
    if name not in _loaded:  # load each model once for the whole module
        _loaded[name] = WhisperSTT(path)
    return name, _loaded[name]


@pytest.fixture(scope="module")
def tiny():
    path = require_model("whisper-tiny.en")
    if "whisper-tiny.en" not in _loaded:
        _loaded["whisper-tiny.en"] = WhisperSTT(path)
    return _loaded["whisper-tiny.en"]


# ---------------------------------------------------------------- accuracy


def test_wer_on_clips_is_below_the_model_limit(stt, clips):
    name, model = stt
    hyps = [model.transcribe(audio) for audio, _ in clips]
    score = wer([t for _, t in clips], hyps)
    print(f"\n{name}: WER {score:.1%} on {len(clips)} clips")
    for (_, ref), hyp in zip(clips, hyps):
        print(f"  ref: {ref}\n  hyp: {hyp}")
    assert score < WER_LIMIT[name]


def test_wer_after_phone_line_is_below_limit(stt, clips):
    name, model = stt
    hyps = [model.transcribe(phone_roundtrip(audio, 16000)) for audio, _ in clips]
    score = wer([t for _, t in clips], hyps)
    print(f"\n{name} over 8 kHz mu-law: WER {score:.1%}")
    assert score < PHONE_WER_LIMIT


# ---------------------------------------------------------------- no hallucination


@pytest.mark.parametrize("kind", ["zeros", "very_quiet", "white_noise"])
def test_silence_and_noise_give_empty_text(tiny, kind):
    rng = np.random.default_rng(3)
    audio = {
        "zeros": np.zeros(3 * 16000),
        "very_quiet": rng.normal(0, 1e-4, 3 * 16000),
        "white_noise": rng.normal(0, 0.05, 3 * 16000),
    }[kind].astype(np.float32)
    t = time.perf_counter()
    assert tiny.transcribe(audio) == ""
    if kind != "white_noise":  # the level check answers without running the model
        assert time.perf_counter() - t < 0.05


def test_empty_audio_gives_empty_text(tiny):
    assert tiny.transcribe(np.zeros(0, np.float32)) == ""


# ---------------------------------------------------------------- input checks and async


def test_wrong_sample_rate_is_a_clear_error(tiny, clips):
    with pytest.raises(AudioFormatError, match="16000 Hz.*22050|22050.*16000"):
        tiny.transcribe(clips[0][0], sample_rate=22050)


def test_stereo_array_is_refused(tiny):
    with pytest.raises(AudioFormatError, match="mono"):
        tiny.transcribe(np.zeros((16000, 2), np.float32))


def test_int16_input_is_accepted(tiny, clips):
    audio, ref = clips[0]
    pcm16 = np.clip(audio * 32768, -32768, 32767).astype(np.int16)
    assert wer([ref], [tiny.transcribe(pcm16)]) < 0.34


def test_two_workers_transcribe_two_calls_at_once_with_the_same_text(clips):
    """stt.workers = 2: two calls' utterances go through Whisper side by side (two model
    workers), each transcript the same as when it is transcribed alone."""
    import threading

    stt = WhisperSTT(require_model("whisper-tiny.en"), cpu_threads=1, workers=2)
    assert stt.model.model.num_workers == 2
    audios = [clips[0][0], clips[2][0]]
    alone = [stt.transcribe(a) for a in audios]
    together: list[str | None] = [None, None]
    start = threading.Barrier(2)

    def run(i: int) -> None:
        start.wait(30)
        together[i] = stt.transcribe(audios[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone and all(alone)


async def test_transcribe_async_leaves_the_event_loop_free(tiny, clips):
    audio, ref = clips[2]  # the longest clip
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    t = time.perf_counter()
    text = await tiny.transcribe_async(audio)
    elapsed = time.perf_counter() - t
    task.cancel()
    assert wer([ref], [text]) < 0.2
    # The loop kept ticking while Whisper ran in its worker thread.
    assert ticks >= 0.3 * elapsed / 0.01, (ticks, elapsed)


def test_partial_transcript_of_the_first_half_is_a_prefix(tiny, clips):
    audio, ref = clips[1]
    partial = words(tiny.transcribe_partial(audio[: len(audio) // 2]))
    assert partial
    ref_words = words(ref).split()
    hits = sum(w in ref_words[: len(ref_words) * 2 // 3 + 1] for w in partial.split())
    assert hits >= 0.7 * len(partial.split())


# ---------------------------------------------------------------- broken models


def test_missing_model_folder_names_it_and_the_fix(tmp_path):
    """A folder given by hand: no pull can create it, so the fix says what is expected."""
    missing = tmp_path / "my-whisper"
    with pytest.raises(ModelFileMissingError) as info:
        WhisperSTT(missing)
    message = str(info.value)
    assert str(missing) in message and "`specvoice models list`" in message and "model.bin" in message
    assert "models pull my-whisper" not in message  # not a catalog name: that command would fail


def _store_folder(dst, name="whisper-tiny.en"):
    """A folder as the model store leaves it: files plus its manifest naming the model."""
    import json

    dst.mkdir()
    (dst / "specvoice-model.json").write_text(json.dumps({"name": name, "files": {}}))
    return dst


def test_missing_tokenizer_names_the_file(tmp_path):
    src = require_model("whisper-tiny.en")
    dst = _store_folder(tmp_path / "whisper-tiny.en")
    for name in ("config.json", "vocabulary.txt"):
        shutil.copy(src / name, dst / name)
    (dst / "model.bin").write_bytes(b"x" * 10)
    with pytest.raises(ModelFileMissingError) as info:
        WhisperSTT(dst)
    assert "tokenizer.json" in str(info.value)
    # The store skips a model whose manifest exists: the fix must delete the folder first.
    assert f"delete {dst} and run `specvoice models pull whisper-tiny.en`" in str(info.value)


def test_corrupted_model_file_names_it_and_the_fix(tmp_path):
    src = require_model("whisper-tiny.en")
    dst = _store_folder(tmp_path / "whisper-tiny.en")
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(src / name, dst / name)
    # The first 64 KiB of the real weights: a truncated download.
    with open(src / "model.bin", "rb") as f:
        (dst / "model.bin").write_bytes(f.read(1 << 16))
    with pytest.raises(ModelLoadError) as info:
        WhisperSTT(dst)
    assert str(dst / "model.bin") in str(info.value)
    assert f"delete {dst} and run `specvoice models pull whisper-tiny.en`" in str(info.value)
