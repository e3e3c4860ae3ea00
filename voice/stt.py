"""Speech to text with faster-whisper (CTranslate2) on a local model folder.

`WhisperSTT` loads the model once and is then reused for every utterance (loading costs
hundreds of ms; a call has many turns). Input is a finished utterance of 16 kHz mono
float32 PCM, as the endpointer produces it.

Whisper is known to "hear" words in silence and noise ("Thank you.", "you"), which in a
voice agent would start a turn nobody asked for. Two guards: a level check that returns
"" for near-silent audio without running the model, and dropping segments that Whisper
itself rates as probably not speech (no_speech_prob high and low average log-prob, the
rule openai-whisper uses).
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from voice.audio import STT_RATE, rms_dbfs
from voice.errors import AudioFormatError, ModelFileMissingError, ModelLoadError, pull_hint_for

REQUIRED_FILES = ("model.bin", "config.json", "tokenizer.json")


@dataclass(frozen=True)
class Transcript:
    text: str
    audio_s: float  # seconds of audio transcribed
    compute_s: float  # wall time spent
    no_speech_prob: float = 0.0  # highest among kept segments (0 when none)

    @property
    def rtf(self) -> float:
        return self.compute_s / self.audio_s if self.audio_s else 0.0


def check_whisper_dir(model_path: str | Path) -> Path:
    """Refuse a model folder that is missing or incomplete, naming the file and the fix."""
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelFileMissingError(f"Whisper model folder {path} does not exist: {pull_hint_for(path)}", path)
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a CTranslate2 model folder (expected a folder holding model.bin): "
                             f"{pull_hint_for(path)}", path)
    for name in REQUIRED_FILES:
        f = path / name
        if not f.is_file() or f.stat().st_size == 0:
            raise ModelFileMissingError(f"Whisper model file {f} is missing or empty: {pull_hint_for(path)}", f)
    return path


class WhisperSTT:
    """faster-whisper wrapper: load once, transcribe many utterances."""

    sample_rate = STT_RATE

    def __init__(
        self,
        model_path: str | Path,
        device: str = "cpu",
        compute_type: str = "int8",
        beam_size: int = 1,
        language: str | None = "en",
        cpu_threads: int = 0,
        silence_dbfs: float = -55.0,
        no_speech_threshold: float = 0.6,
        logprob_threshold: float = -1.0,
        vad_filter: bool = False,
    ):
        self.model_path = check_whisper_dir(model_path)
        self.beam_size = beam_size
        self.language = language
        self.silence_dbfs = silence_dbfs
        self.no_speech_threshold = no_speech_threshold
        self.logprob_threshold = logprob_threshold
        self.vad_filter = vad_filter
        from faster_whisper import WhisperModel

        threads = cpu_threads or min(4, os.cpu_count() or 1)
        try:
            self.model = WhisperModel(str(self.model_path), device=device, compute_type=compute_type, cpu_threads=threads)
        except Exception as exc:  # ctranslate2 raises RuntimeError/ValueError with terse text
            bad = self.model_path / "model.bin"
            raise ModelLoadError(
                f"cannot load Whisper model from {bad} ({type(exc).__name__}: {exc}); the file may be corrupted: "
                f"{pull_hint_for(self.model_path)}", bad) from exc
        # English-only checkpoints (tiny.en) refuse any other language code.
        if not self.model.model.is_multilingual:
            self.language = "en" if language else None

    # -------------------------------------------------------------- sync

    def _check_audio(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        if sample_rate != STT_RATE:
            raise AudioFormatError(
                f"Whisper needs {STT_RATE} Hz audio, got {sample_rate} Hz: resample first "
                f"(voice.audio.resample(pcm, {sample_rate}, {STT_RATE}))")
        audio = np.asarray(audio)
        if audio.ndim != 1:
            raise AudioFormatError(f"expected mono 1-D audio, got shape {audio.shape}")
        if audio.dtype == np.int16:
            audio = audio.astype(np.float32) / 32768.0
        return audio.astype(np.float32, copy=False)

    def transcribe_full(self, audio: np.ndarray, sample_rate: int = STT_RATE, beam_size: int | None = None) -> Transcript:
        audio = self._check_audio(audio, sample_rate)
        t0 = time.perf_counter()
        audio_s = len(audio) / STT_RATE
        # Fast path: under ~0.1 s or near digital silence there is nothing to hear.
        if len(audio) < STT_RATE // 10 or rms_dbfs(audio) < self.silence_dbfs:
            return Transcript("", audio_s, time.perf_counter() - t0)
        segments, _info = self.model.transcribe(
            audio,
            language=self.language,
            beam_size=beam_size or self.beam_size,
            temperature=0.0,  # no fallback re-decoding: one pass, predictable latency
            condition_on_previous_text=False,
            without_timestamps=True,
            vad_filter=self.vad_filter,
        )
        texts, worst = [], 0.0
        for seg in segments:  # a generator: decoding happens here
            if seg.no_speech_prob > self.no_speech_threshold and seg.avg_logprob < self.logprob_threshold:
                continue  # Whisper itself thinks this is not speech
            texts.append(seg.text.strip())
            worst = max(worst, seg.no_speech_prob)
        return Transcript(" ".join(t for t in texts if t), audio_s, time.perf_counter() - t0, worst)

    def transcribe(self, audio: np.ndarray, sample_rate: int = STT_RATE) -> str:
        """Finished utterance (16 kHz mono float32) -> text ("" for silence or noise)."""
        return self.transcribe_full(audio, sample_rate).text

    def transcribe_partial(self, audio: np.ndarray, sample_rate: int = STT_RATE) -> str:
        """Interim transcript of an utterance still in progress (greedy, for display/early cues)."""
        return self.transcribe_full(audio, sample_rate, beam_size=1).text

    # -------------------------------------------------------------- async

    async def transcribe_async(self, audio: np.ndarray, sample_rate: int = STT_RATE,
                               executor: Executor | None = None) -> str:
        """`transcribe` in a worker thread, so the event loop keeps moving audio meanwhile.

        CTranslate2 releases the GIL while decoding, so the loop really does run.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, self.transcribe, audio, sample_rate)

    async def transcribe_partial_async(self, audio: np.ndarray, sample_rate: int = STT_RATE,
                                       executor: Executor | None = None) -> str:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, self.transcribe_partial, audio, sample_rate)
