"""Speech to text with faster-whisper (CTranslate2) on a local model folder.

`WhisperSTT` loads the model once and is then reused for every utterance (loading costs
hundreds of ms; a call has many turns). Input is a finished utterance of 16 kHz mono
float32 PCM, as the endpointer produces it.

Whisper is known to "hear" words in silence and noise ("Thank you.", "you"), which in a
voice agent would start a turn nobody asked for. Two guards: a level check that returns
"" for near-silent audio without running the model, and dropping segments that Whisper
itself rates as probably not speech (no_speech_prob high and low average log-prob, the
rule openai-whisper uses).

Domain words (a business's names, services, days) can be given to Whisper as text it
conditions on: `initial_prompt` (decoded as if it were the previous sentence) and
`hotwords` (faster-whisper's hint phrases, placed in the same previous-text slot). Both
come from one plain list of words and phrases (`WhisperPrompt.from_vocabulary`); one
engine serves calls of different businesses, so `transcribe_full` also takes a
per-call `prompt`.

Whisper's window: faster-whisper pads every utterance's mel to Whisper's 30 s window, so a
3 s turn costs the encoder as much as 30 s of audio (1.8 s of CPU with base on one core).
CTranslate2 encodes a shorter mel just as well. With `window="audio"` the encoder sees the
utterance plus `window_pad_s` (4 s) of the padding, and the decoder is guarded against the
repetition loops a short window invites (voice/decode_guard.py: a token cap that follows
the audio, a trailing-repetition cut). `window="full"` is faster-whisper as shipped.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, get_args

import numpy as np

from voice.audio import STT_RATE, rms_dbfs
from voice.decode_guard import max_new_tokens, repetition_keep
from voice.errors import AudioFormatError, ModelFileMissingError, ModelLoadError, pull_hint_for

REQUIRED_FILES = ("model.bin", "config.json", "tokenizer.json")

# How much of Whisper's 30 s window the encoder sees: all of it (faster-whisper as
# shipped), or the utterance plus `window_pad_s` of the padding.
Window = Literal["full", "audio"]
WINDOWS: tuple[str, ...] = get_args(Window)
FULL_WINDOW_FRAMES = 3000  # 30 s of 10 ms mel frames
# The padding kept after the audio: cut closer (0-2 s) Whisper loops on most short clips.
WINDOW_PAD_S = 4.0

# How a vocabulary reaches Whisper: not at all, as the initial prompt, as hotwords, or both.
VocabularyMode = Literal["none", "initial_prompt", "hotwords", "both"]
VOCABULARY_MODES: tuple[str, ...] = get_args(VocabularyMode)
# Whisper keeps at most 223 tokens of previous text; a vocabulary longer than this many
# characters (about 4 a token) would be cut by the model anyway, so it is cut here, at a
# phrase boundary, where the cut is visible and predictable.
MAX_VOCABULARY_CHARS = 600


def vocabulary_text(vocabulary: Iterable[str], max_chars: int = MAX_VOCABULARY_CHARS) -> str | None:
    """Words and phrases -> "Riverside Dental, Dr. Patel, cleaning." (None when empty).

    Blank entries and repeats (ignoring case) are dropped, order is kept; phrases that
    would take the text past `max_chars` are left out.
    """
    seen: set[str] = set()
    kept: list[str] = []
    length = 0
    for item in vocabulary:
        phrase = " ".join(str(item).split()).strip(" ,;")
        if not phrase or phrase.lower() in seen:
            continue
        if length + len(phrase) + 2 > max_chars:
            break
        seen.add(phrase.lower())
        kept.append(phrase)
        length += len(phrase) + 2
    if not kept:
        return None
    text = ", ".join(kept)
    return text if text.endswith((".", "?", "!")) else text + "."


# openai-whisper's compression_ratio_threshold: text that gzips this well is a repetition loop.
COMPRESSION_RATIO_LIMIT = 2.4
# This many of the prompt's phrases, in its order, in a transcript: a recital of the prompt.
ECHO_PHRASES = 3


def _plain(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", "")).split())


def _prompt_runs(text: str | None) -> set[str]:
    """Every run of ECHO_PHRASES consecutive phrases of a prompt ("a, b, c, d." -> "a b c", "b c d")."""
    if not text:
        return set()
    phrases = [p for p in (_plain(x) for x in text.rstrip(".!?").split(",")) if p]
    return {" ".join(phrases[i:i + ECHO_PHRASES]) for i in range(len(phrases) - ECHO_PHRASES + 1)}



def stt_audio(audio: np.ndarray, sample_rate: int, engine: str) -> np.ndarray:
    """One utterance as every STT engine here reads it: 16 kHz mono float32 in [-1, 1]
    (int16 scaled); a wrong rate or shape is an AudioFormatError that says what to do."""
    if sample_rate != STT_RATE:
        raise AudioFormatError(
            f"{engine} needs {STT_RATE} Hz audio, got {sample_rate} Hz: resample first "
            f"(voice.audio.resample(pcm, {sample_rate}, {STT_RATE}))")
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise AudioFormatError(f"expected mono 1-D audio, got shape {audio.shape}")
    if audio.dtype == np.int16:
        audio = audio.astype(np.float32) / 32768.0
    return audio.astype(np.float32, copy=False)

@dataclass(frozen=True)
class WhisperPrompt:
    """The text Whisper conditions on: faster-whisper's `initial_prompt` and `hotwords`."""

    initial_prompt: str | None = None
    hotwords: str | None = None

    @classmethod
    def from_vocabulary(cls, vocabulary: Iterable[str], mode: VocabularyMode = "none") -> "WhisperPrompt":
        if mode not in VOCABULARY_MODES:
            raise ValueError(f"vocabulary mode must be one of {', '.join(VOCABULARY_MODES)}, got {mode!r}")
        text = vocabulary_text(vocabulary) if mode != "none" else None
        return cls(initial_prompt=text if mode in ("initial_prompt", "both") else None,
                   hotwords=text if mode in ("hotwords", "both") else None)

    def __bool__(self) -> bool:
        return bool(self.initial_prompt or self.hotwords)


@dataclass(frozen=True)
class Transcript:
    text: str
    audio_s: float  # seconds of audio transcribed
    compute_s: float  # wall time spent
    no_speech_prob: float = 0.0  # highest among kept segments (0 when none)
    prompt_dropped: bool = False  # the prompt was not trusted for this audio: decoded again without it
    repetition_cut: bool = False  # a trailing repetition loop was cut (window="audio")
    drafted_tokens: int = 0  # Moonshine: tokens checked from an earlier transcript's draft (voice/heard_before.py)

    @property
    def rtf(self) -> float:
        return self.compute_s / self.audio_s if self.audio_s else 0.0


def _fix_hint(folder: Path) -> str:
    return pull_hint_for(folder, f"a folder holding a CTranslate2 Whisper model ({', '.join(REQUIRED_FILES)})")


def check_whisper_dir(model_path: str | Path) -> Path:
    """Refuse a model folder that is missing or incomplete, naming the file and the fix."""
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelFileMissingError(f"Whisper model folder {path} does not exist: {_fix_hint(path)}", path)
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a CTranslate2 model folder (expected a folder holding model.bin): "
                             f"{_fix_hint(path)}", path)
    for name in REQUIRED_FILES:
        f = path / name
        if not f.is_file() or f.stat().st_size == 0:
            raise ModelFileMissingError(f"Whisper model file {f} is missing or empty: {_fix_hint(path)}", f)
    return path


def window_frames(audio_s: float, pad_s: float = WINDOW_PAD_S) -> int | None:
    """Mel frames the encoder sees for an utterance of `audio_s` seconds (even: the
    encoder's convolution halves them), or None when that is the whole 30 s window."""
    frames = int(np.ceil((audio_s + pad_s) * 100 / 2)) * 2
    return None if frames >= FULL_WINDOW_FRAMES else frames


def _windowed_model_class():
    """faster-whisper's WhisperModel whose encoder can be told to see fewer mel frames.

    faster-whisper pads each segment's mel to 3000 frames just before `encode`; cutting
    there keeps everything else (prompts, the decoding options, word timestamps, which
    align over the segment's own frames) exactly faster-whisper's.
    """
    from faster_whisper import WhisperModel

    class WindowedWhisperModel(WhisperModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # Per thread: with num_workers > 1 two utterances are transcribed at once.
            self._window = threading.local()

        def encode(self, features):
            frames = getattr(self._window, "frames", None)
            if frames is not None and features.shape[-1] > frames:
                features = features[..., :frames]
            return super().encode(features)

    return WindowedWhisperModel


def _cut_repetition(segments: list, word_timestamps: bool) -> tuple[list, bool]:
    """Segments with a trailing repetition loop (across all of them) cut after its first
    copy: whole words (word timestamps) or the text's words are the units."""
    from dataclasses import replace

    units = [[w.word for w in seg.words or ()] if word_timestamps else seg.text.split() for seg in segments]
    flat = [u for seg_units in units for u in seg_units]
    keep = repetition_keep(flat)
    if keep == len(flat):
        return segments, False
    out = []
    for seg, seg_units in zip(segments, units):
        take = min(len(seg_units), keep)
        keep -= take
        if take == 0:
            break
        if word_timestamps:
            words = list(seg.words[:take])
            out.append(replace(seg, words=words, text="".join(w.word for w in words), end=words[-1].end))
        else:
            out.append(replace(seg, text=(" " if seg.text.startswith(" ") else "") + " ".join(seg_units[:take])))
    return out, True


class ThreadedSTT:
    """An STT engine whose transcriptions run in a worker thread from asyncio, so the event
    loop keeps moving audio meanwhile. Both engines release the GIL while they decode
    (CTranslate2 for Whisper, onnxruntime for Moonshine), so the loop really does run.
    Subclasses define `transcribe` and `transcribe_partial`."""

    def transcribe(self, audio: np.ndarray, sample_rate: int = STT_RATE) -> str:
        raise NotImplementedError

    def transcribe_partial(self, audio: np.ndarray, sample_rate: int = STT_RATE) -> str:
        raise NotImplementedError

    async def transcribe_async(self, audio: np.ndarray, sample_rate: int = STT_RATE,
                               executor: Executor | None = None) -> str:
        """`transcribe` in a worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, self.transcribe, audio, sample_rate)

    async def transcribe_partial_async(self, audio: np.ndarray, sample_rate: int = STT_RATE,
                                       executor: Executor | None = None) -> str:
        """`transcribe_partial` in a worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, self.transcribe_partial, audio, sample_rate)


class WhisperSTT(ThreadedSTT):
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
        initial_prompt: str | None = None,
        hotwords: str | None = None,
        workers: int = 1,
        window: Window = "full",
        window_pad_s: float = WINDOW_PAD_S,
    ):
        """workers: transcriptions that may run at once from different threads (faster-whisper's
        num_workers; each uses cpu_threads); with 1 they queue.
        window: "full" encodes Whisper's 30 s window whatever the utterance's length;
        "audio" encodes the utterance plus window_pad_s, guarded against repetition loops
        (cost follows the audio: about 5x less for a 3 s turn)."""
        if window not in WINDOWS:
            raise ValueError(f"window must be one of {', '.join(WINDOWS)}, got {window!r}")
        self.window = window
        self.window_pad_s = window_pad_s
        self.model_path = check_whisper_dir(model_path)
        # Default conditioning text for every utterance (see WhisperPrompt); None: none.
        self.initial_prompt = initial_prompt or None
        self.hotwords = hotwords or None
        self.beam_size = beam_size
        self.language = language
        self.silence_dbfs = silence_dbfs
        self.no_speech_threshold = no_speech_threshold
        self.logprob_threshold = logprob_threshold
        self.vad_filter = vad_filter
        threads = cpu_threads or min(4, os.cpu_count() or 1)
        try:
            self.model = _windowed_model_class()(str(self.model_path), device=device, compute_type=compute_type, cpu_threads=threads,
                                      num_workers=workers)
        except Exception as exc:  # ctranslate2 raises RuntimeError/ValueError with terse text
            bad = self.model_path / "model.bin"
            raise ModelLoadError(
                f"cannot load Whisper model from {bad} ({type(exc).__name__}: {exc}); the file may be corrupted: "
                f"{_fix_hint(self.model_path)}", bad) from exc
        # English-only checkpoints (tiny.en) refuse any other language code.
        if not self.model.model.is_multilingual:
            self.language = "en" if language else None

    # -------------------------------------------------------------- sync

    @property
    def prompt(self) -> WhisperPrompt:
        """The engine's default conditioning text."""
        return WhisperPrompt(self.initial_prompt, self.hotwords)

    def segments(self, audio: np.ndarray, beam_size: int | None = None, prompt: WhisperPrompt | None = None,
                 word_timestamps: bool = False) -> tuple[list, bool]:
        """faster-whisper's segments for 16 kHz float32 `audio` through this engine's
        window and guards; (segments, whether a repetition loop was cut). The level
        checks and the not-speech rule are the caller's (transcribe_full, streaming)."""
        prompt = self.prompt if prompt is None else prompt
        audio_s = len(audio) / STT_RATE
        frames = window_frames(audio_s, self.window_pad_s) if self.window == "audio" else None
        cap = None
        if frames is not None:
            # Whisper keeps 448 tokens, the prompt up to 223 of them: never ask for more than the rest.
            cap = min(max_new_tokens(audio_s), 220)
        if frames is not None:
            self.model._window.frames = frames
        try:
            segments, _info = self.model.transcribe(
                audio,
                language=self.language,
                beam_size=beam_size or self.beam_size,
                temperature=0.0,  # no fallback re-decoding: one pass, predictable latency
                condition_on_previous_text=False,
                without_timestamps=not word_timestamps,
                word_timestamps=word_timestamps,
                vad_filter=self.vad_filter,
                initial_prompt=prompt.initial_prompt or None,
                hotwords=prompt.hotwords or None,
                max_new_tokens=cap,
            )
            segments = list(segments)  # a generator: decoding happens here
        finally:
            if frames is not None:
                self.model._window.frames = None
        if frames is None:
            return segments, False
        return _cut_repetition(segments, word_timestamps)

    def _decode(self, audio: np.ndarray, beam_size: int, prompt: WhisperPrompt) -> tuple[list, bool]:
        return self.segments(audio, beam_size, prompt)

    def prompt_suspect(self, segments: list, prompt: WhisperPrompt) -> bool:
        """Did the prompt, rather than the audio, write this transcript?

        On noise and silence a prompted Whisper repeats its prompt with confidence ("Dr.
        Patel, Dr. Moreno, Dr. Moreno, ..."), so the usual rule (probably not speech AND
        not confident) lets it through. Signs, each measured on such output: Whisper rates
        the audio as probably not speech, the text repeats itself (compression ratio above
        openai-whisper's 2.4), or it recites three of the prompt's phrases in a row.
        """
        echo = _prompt_runs(prompt.initial_prompt) | _prompt_runs(prompt.hotwords)
        for seg in segments:
            if seg.no_speech_prob > self.no_speech_threshold or seg.compression_ratio > COMPRESSION_RATIO_LIMIT:
                return True
            said = f" {_plain(seg.text)} "
            if any(f" {run} " in said for run in echo):
                return True
        if self.window == "audio":
            # The short window's token cap stops a recital before it is long enough for the
            # signs above ("Dr. Patel, Dr." on -26 dBFS noise, base): a transcript made of
            # nothing but the prompt's words is checked against the audio alone.
            prompt_words = set(_plain(f"{prompt.initial_prompt or ''} {prompt.hotwords or ''}").split())
            said = _plain(" ".join(seg.text for seg in segments)).split()
            if said and all(w in prompt_words for w in said):
                return True
        return False

    def transcribe_full(self, audio: np.ndarray, sample_rate: int = STT_RATE, beam_size: int | None = None,
                        prompt: WhisperPrompt | None = None) -> Transcript:
        """`prompt` replaces the engine's default conditioning text for this utterance
        (WhisperPrompt() for none); None keeps the default.

        When the prompted transcript looks written by the prompt (`prompt_suspect`), the
        utterance is decoded again without it, so a prompt never turns noise into words.
        """
        audio = stt_audio(audio, sample_rate, "Whisper")
        prompt = self.prompt if prompt is None else prompt
        t0 = time.perf_counter()
        audio_s = len(audio) / STT_RATE
        # Fast path: under ~0.1 s or near digital silence there is nothing to hear.
        if len(audio) < STT_RATE // 10 or rms_dbfs(audio) < self.silence_dbfs:
            return Transcript("", audio_s, time.perf_counter() - t0)
        beam = beam_size or self.beam_size
        segments, cut = self._decode(audio, beam, prompt)
        prompt_dropped = False
        if prompt and (cut or self.prompt_suspect(segments, prompt)):  # a prompted loop: the prompt talking
            segments, cut = self._decode(audio, beam, WhisperPrompt())
            prompt_dropped = True
        texts, worst = [], 0.0
        for seg in segments:
            if seg.no_speech_prob > self.no_speech_threshold and seg.avg_logprob < self.logprob_threshold:
                continue  # Whisper itself thinks this is not speech
            if not re.search(r"\w", seg.text):
                continue  # ". . . ." (tiny.en on loud white noise, short window): no word was heard
            texts.append(seg.text.strip())
            worst = max(worst, seg.no_speech_prob)
        return Transcript(" ".join(t for t in texts if t), audio_s, time.perf_counter() - t0, worst, prompt_dropped,
                          cut)

    def transcribe(self, audio: np.ndarray, sample_rate: int = STT_RATE) -> str:
        """Finished utterance (16 kHz mono float32) -> text ("" for silence or noise)."""
        return self.transcribe_full(audio, sample_rate).text

    def transcribe_partial(self, audio: np.ndarray, sample_rate: int = STT_RATE) -> str:
        """Interim transcript of an utterance still in progress (greedy, for display/early cues)."""
        return self.transcribe_full(audio, sample_rate, beam_size=1).text
