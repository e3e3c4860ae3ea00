"""Text to speech: one interface, two engines (Piper by default, Coqui optional).

An engine takes ONE sentence and yields `AudioChunk`s (float32 PCM plus its sample
rate) as soon as it has them; the pipeline flushes the first sentence of an answer
to TTS at once, so time-to-first-chunk is what the caller hears as delay.

Piper (VITS, ONNX) synthesises a whole sentence per model call, so for one sentence its
first chunk is the whole sentence; `PiperTTS(split_clauses=True)` cuts long sentences at
commas/semicolons and synthesises clause by clause, bringing the first audio forward at
a small cost in prosody across the cut.

`synthesize_async` runs any engine in a worker thread and streams its chunks into the
event loop as they are made.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from threadrelay import relay
from voice.errors import EngineNotInstalledError, ModelFileMissingError, ModelLoadError, pull_hint_for
from voice.normalize import normalize_for_speech

_PIPER_EXPECTED = "a Piper voice (.onnx with its .onnx.json beside it)"


@dataclass(frozen=True)
class AudioChunk:
    pcm: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int

    @property
    def duration(self) -> float:
        return len(self.pcm) / self.sample_rate


@runtime_checkable
class TTSEngine(Protocol):
    sample_rate: int

    def synthesize(self, text: str) -> Iterator[AudioChunk]:
        """One sentence -> its audio, chunk by chunk, first chunk as early as possible."""
        ...


CLAUSE_ENDS = ",;:"  # where split_clauses may cut a sentence (after the mark)


def split_clauses(text: str, min_chars: int = 20) -> list[str]:
    """Cut a sentence after , ; : when both sides are long enough to sound natural alone."""
    parts = re.split(rf"(?<=[{CLAUSE_ENDS}])\s+", text.strip())
    out: list[str] = []
    for part in parts:
        if out and (len(out[-1]) < min_chars or len(part) < min_chars // 2):
            out[-1] = out[-1] + " " + part
        else:
            out.append(part)
    return [p for p in out if p]


# ---------------------------------------------------------------- Piper


def check_piper_files(onnx_path: str | Path, config_path: str | Path | None = None) -> tuple[Path, Path]:
    onnx = Path(onnx_path).expanduser()
    if onnx.is_dir():  # a voice folder: take the one .onnx in it
        found = sorted(onnx.glob("*.onnx"))
        if not found:
            raise ModelFileMissingError(f"no .onnx Piper voice in {onnx}: {pull_hint_for(onnx, _PIPER_EXPECTED)}", onnx)
        onnx = found[0]
    if not onnx.is_file() or onnx.stat().st_size == 0:
        raise ModelFileMissingError(f"Piper voice file {onnx} is missing or empty: {pull_hint_for(onnx.parent, _PIPER_EXPECTED)}", onnx)
    config = Path(config_path).expanduser() if config_path else Path(str(onnx) + ".json")
    if not config.is_file():
        raise ModelFileMissingError(
            f"Piper voice config {config} is missing (it sits next to the .onnx): {pull_hint_for(onnx.parent, _PIPER_EXPECTED)}", config)
    return onnx, config


class PiperTTS:
    """Piper voice (e.g. en_US-joe-medium, 22.05 kHz), loaded once."""

    def __init__(self, onnx_path: str | Path, config_path: str | Path | None = None,
                 length_scale: float | None = None, normalize: bool = True,
                 split_clauses: bool = False, threads: int = 0,
                 noise_scale: float | None = None, noise_w_scale: float | None = None):
        # noise_scale / noise_w_scale: Piper samples its voice and phoneme lengths (None keeps the
        # voice's own values); 0 and 0 make it deterministic, same text, same samples.
        self.onnx_path, self.config_path = check_piper_files(onnx_path, config_path)
        self.normalize = normalize
        self.split_clauses = split_clauses
        try:
            from piper import PiperVoice, SynthesisConfig
        except ImportError as exc:  # pragma: no cover - piper-tts is a core dependency
            raise EngineNotInstalledError("piper-tts is not installed: pip install piper-tts") from exc
        try:
            self.voice = PiperVoice.load(self.onnx_path, config_path=self.config_path)
        except Exception as exc:  # onnxruntime InvalidProtobuf, JSON errors, ...
            raise ModelLoadError(f"cannot load Piper voice {self.onnx_path} ({type(exc).__name__}: {exc}); "
                                 f"the file may be corrupted: {pull_hint_for(self.onnx_path.parent, _PIPER_EXPECTED)}", self.onnx_path) from exc
        if threads:
            import onnxruntime as ort

            from voice.ort_options import sleeping_threads

            # Idle threads sleep: beside the LLM's passes (pipeline.agent._threads).
            self.voice.session = ort.InferenceSession(str(self.onnx_path), sess_options=sleeping_threads(threads),
                                                      providers=["CPUExecutionProvider"])
        self.sample_rate = int(self.voice.config.sample_rate)
        self._syn_config = SynthesisConfig(length_scale=length_scale, noise_scale=noise_scale,
                                           noise_w_scale=noise_w_scale)
        # One ONNX session, many callers: serialise so two calls never interleave phonemizer state.
        self._lock = threading.Lock()

    def synthesize(self, text: str) -> Iterator[AudioChunk]:
        text = normalize_for_speech(text) if self.normalize else text
        if not text.strip():
            return
        pieces = split_clauses(text) if self.split_clauses else [text]
        for piece in pieces:
            with self._lock:
                chunks = list(self.voice.synthesize(piece, syn_config=self._syn_config))
            for chunk in chunks:
                yield AudioChunk(np.asarray(chunk.audio_float_array, dtype=np.float32), int(chunk.sample_rate))


# ---------------------------------------------------------------- Coqui (optional)


class CoquiTTS:
    """Coqui TTS (`pip install 'specvoice[coqui]'`) from a local model folder and config.

    Imported lazily: coqui-tts needs torchaudio, which is not installable beside every
    torch build, so the default install does without it.
    """

    def __init__(self, model_dir: str | Path, config_path: str | Path | None = None,
                 speaker: str | None = None, language: str | None = None, device: str = "cpu",
                 normalize: bool = True):
        try:
            from TTS.api import TTS as CoquiAPI  # the coqui-tts package installs module `TTS`
        except ImportError as exc:
            raise EngineNotInstalledError(
                "the Coqui engine needs the coqui-tts package, which is not installed: "
                "pip install 'specvoice[coqui]' (it requires torchaudio matching your torch), "
                "or use the default engine: --engine piper") from exc
        model_dir = Path(model_dir).expanduser()
        if not model_dir.is_dir():
            raise ModelFileMissingError(f"Coqui model folder {model_dir} does not exist", model_dir)
        config = Path(config_path).expanduser() if config_path else model_dir / "config.json"
        if not config.is_file():
            raise ModelFileMissingError(f"Coqui model config {config} is missing", config)
        checkpoints = sorted(p for p in model_dir.iterdir() if p.suffix in (".pth", ".pt", ".safetensors"))
        model_file = checkpoints[0] if checkpoints else model_dir
        try:
            self.tts = CoquiAPI(model_path=str(model_file), config_path=str(config)).to(device)
        except Exception as exc:
            raise ModelLoadError(f"cannot load Coqui model from {model_dir} ({exc})", model_dir) from exc
        self.speaker, self.language, self.normalize = speaker, language, normalize
        self.sample_rate = int(self.tts.synthesizer.output_sample_rate)

    def synthesize(self, text: str) -> Iterator[AudioChunk]:
        text = normalize_for_speech(text) if self.normalize else text
        if not text.strip():
            return
        wav = self.tts.tts(text=text, speaker=self.speaker, language=self.language)
        yield AudioChunk(np.asarray(wav, dtype=np.float32), self.sample_rate)


ENGINES = {"piper": PiperTTS, "coqui": CoquiTTS}


def load_tts(engine: str, model_path: str | Path, **kwargs) -> TTSEngine:
    """Engine by name ("piper" | "coqui") on a local model path."""
    try:
        cls = ENGINES[engine]
    except KeyError:
        raise ValueError(f"unknown TTS engine {engine!r}; choose one of {', '.join(ENGINES)}") from None
    return cls(model_path, **kwargs)


# ---------------------------------------------------------------- async streaming



async def synthesize_async(engine: TTSEngine, text: str, executor: Executor | None = None) -> AsyncIterator[AudioChunk]:
    """Stream `engine.synthesize(text)` from a worker thread into the event loop.

    Each chunk is handed over the moment the engine yields it. Closing the async
    iterator (barge-in, hang-up) stops the worker after the chunk in progress and waits
    for it, so no synthesis outlives its caller. `executor`: the thread pool to run on
    (default: the loop's).
    """
    async with contextlib.aclosing(relay(lambda _stop: engine.synthesize(text), executor)) as chunks:
        async for chunk in chunks:
            yield chunk
