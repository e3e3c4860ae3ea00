"""End of turn from the sound of the speech: Pipecat's Smart Turn v3.2 on onnxruntime.

VAD silence alone cannot tell "I'd like to book ... [thinking] ... a cleaning" from a
finished question; Smart Turn (a Whisper-tiny encoder with a classifier head, BSD-2-Clause)
listens to the last <= 8 s of the turn and returns P(turn complete), from prosody and words.

The model is one file from the `pipecat-ai` wheel (catalog name `smart-turn-v3.2`, pulled
and SHA-256 checked by the model store); pipecat itself is never imported. The input is
prepared exactly as Pipecat 1.14 does (`LocalSmartTurnAnalyzerV3._predict_endpoint`):

1. keep the last 8 s of 16 kHz audio, or left-pad it with zeros to 8 s (128000 samples);
2. normalize the waveform to zero mean, unit variance (over the padded 8 s, eps 1e-7);
3. Whisper log-mel, 80 bins, n_fft 400, hop 160, chunk 8 s -> (80, 800), float32;
4. one ONNX run, input `input_features` (1, 80, 800), output `logits` (1, 1), which is
   already a sigmoid probability.

Step 3 uses faster-whisper's numpy FeatureExtractor (chunk_length=8, padding=0), which
matches transformers' WhisperFeatureExtractor (which Pipecat's vendored numpy copy replicates)
within ~2e-5 on features in [-1, 1.5] (its FFT is float32, theirs float64; checked in
tests/test_turn_detector.py), with no transformers import (seconds) at run time.

Cost: one 8 s window per decision whatever the utterance length, ~66 ms on one core.
Pipecat's default is one intra-op thread; so is this one (decisions are rare and short,
and the cores belong to STT and the LLM).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from voice.audio import STT_RATE, to_float32
from voice.errors import AudioFormatError, ModelFileMissingError, ModelLoadError

CATALOG_NAME = "smart-turn-v3.2"
MODEL_FILE = "smart-turn-v3.2-cpu.onnx"
WINDOW_S = 8  # the model sees exactly this much audio
WINDOW_SAMPLES = WINDOW_S * STT_RATE
N_MELS = 80
N_FRAMES = WINDOW_SAMPLES // 160  # 800
INPUT_NAME = "input_features"
NORM_EPS = 1e-7  # transformers' zero-mean unit-variance epsilon
# Pipecat's own cut: a probability above this is "complete".
DEFAULT_THRESHOLD = 0.5

PULL_FIX = f"run `specvoice models pull {CATALOG_NAME}`"


@dataclass(frozen=True)
class TurnPrediction:
    probability: float  # P(turn complete), 0..1
    complete: bool  # probability > threshold
    audio_s: float  # seconds of audio given (the model sees at most WINDOW_S of it)
    compute_ms: float  # features + model, wall time


_extractor = None


def _feature_extractor():
    global _extractor
    if _extractor is None:
        from faster_whisper.feature_extractor import FeatureExtractor

        _extractor = FeatureExtractor(feature_size=N_MELS, sampling_rate=STT_RATE, hop_length=160,
                                      chunk_length=WINDOW_S, n_fft=400)
    return _extractor


def fit_window(audio: np.ndarray) -> np.ndarray:
    """The last WINDOW_S seconds of `audio`, left-padded with zeros to exactly WINDOW_SAMPLES."""
    if audio.size >= WINDOW_SAMPLES:
        return audio[-WINDOW_SAMPLES:]
    return np.pad(audio, (WINDOW_SAMPLES - audio.size, 0))


def smart_turn_features(audio_16k: np.ndarray) -> np.ndarray:
    """Pipecat's Smart Turn v3 input for 16 kHz mono audio: float32 (80, 800)."""
    x = fit_window(_check_audio(audio_16k))
    x = ((x - x.mean()) / np.sqrt(x.var() + NORM_EPS)).astype(np.float32)
    features = _feature_extractor()(x, padding=0)
    assert features.shape == (N_MELS, N_FRAMES), features.shape
    return features.astype(np.float32, copy=False)


def _check_audio(audio: np.ndarray) -> np.ndarray:
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise AudioFormatError(f"turn detector wants 1-D 16 kHz mono audio, got shape {audio.shape}")
    audio = to_float32(audio)
    if not np.all(np.isfinite(audio)):
        raise AudioFormatError("turn detector got audio with NaN or infinite samples")
    return audio


def model_file(path: str | Path) -> Path:
    """The ONNX file for a path that is the file itself or the pulled model folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / MODEL_FILE
    if not p.is_file() or p.stat().st_size == 0:
        raise ModelFileMissingError(f"Smart Turn model {p} is missing or empty: {PULL_FIX}", p)
    return p


class TurnDetector:
    """Smart Turn v3.2: `probability(audio)` -> P(the speaker has finished their turn).

    Load once (about 0.1 s), then call from any thread: an onnxruntime session's run is
    thread-safe. Give it the turn's audio so far, from a little before speech started up
    to now (trailing silence included, as Pipecat does): only the last 8 s are used.
    """

    sample_rate = STT_RATE

    def __init__(self, session, path: Path, threshold: float = DEFAULT_THRESHOLD):
        self._session = session
        self.path = path
        self.threshold = threshold

    @classmethod
    def load(cls, path: str | Path, threads: int = 1, threshold: float = DEFAULT_THRESHOLD) -> TurnDetector:
        """`path`: the ONNX file or the model folder (`modelstore.resolve_model("smart-turn-v3.2")`)."""
        file = model_file(path)
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        options.intra_op_num_threads = max(1, int(threads))
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            session = ort.InferenceSession(str(file), sess_options=options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own terse exception types
            raise ModelLoadError(f"cannot load Smart Turn model {file} ({type(exc).__name__}: {exc}); the file "
                                 f"may be corrupted: delete {file.parent} and {PULL_FIX}", file) from exc
        inputs = [i.name for i in session.get_inputs()]
        if inputs != [INPUT_NAME]:
            raise ModelLoadError(f"{file} is not a Smart Turn v3 model (inputs {inputs}, expected "
                                 f"[{INPUT_NAME!r}]): {PULL_FIX}", file)
        return cls(session, file, threshold)

    def predict(self, audio_16k: np.ndarray) -> TurnPrediction:
        """The decision for the audio so far. Empty audio: probability 0 (nothing was said)."""
        started = time.perf_counter()
        audio = _check_audio(audio_16k)
        if audio.size == 0:
            return TurnPrediction(0.0, False, 0.0, 0.0)
        features = smart_turn_features(audio)[np.newaxis]
        (out,) = self._session.run(None, {INPUT_NAME: features})
        probability = float(np.clip(np.asarray(out).reshape(-1)[0], 0.0, 1.0))
        return TurnPrediction(probability, probability > self.threshold, audio.size / STT_RATE,
                              (time.perf_counter() - started) * 1000.0)

    def probability(self, audio_16k: np.ndarray) -> float:
        """P(turn complete) for 16 kHz mono audio (float32 in [-1, 1], or int16)."""
        return self.predict(audio_16k).probability


# Words an English turn almost never ends on: articles, conjunctions, possessives, fillers.
DANGLING_WORDS = frozenset(
    "a an the and but or nor so because if than that my your our their his her its um uh er erm".split()
)
# Words a caller's sentence breaks after when they stop to think ("book a cleaning for ...",
# "is Dr. Patel free on ...", "I would like ..."), where Smart Turn hears a TTS voice's falling
# pitch as finished. A question can end on one too ("What are you looking for?"): Whisper
# writes its question mark, so these count only without one. A wrong "dangling" costs a
# wait up to the silence timeout; a wrong "complete" answers half a sentence.
# "next" too: "a cleaning for next ... Tuesday" (espeak-ng's line in bench pipeline, cut in two
# at 1 s of silence); a statement rarely ends on it, and "Who's next?" keeps its question mark.
OPEN_WORDS = frozenset("for on to at with from of in into about like next".split())


def dangling_word(transcript: str) -> str | None:
    """The last word of `transcript` when it leaves the sentence open ("... for the" -> "the").

    Smart Turn hears prosody; a speaker (or a TTS voice) with a flat, falling delivery can
    stop on "for the" and still sound finished to it (~0.97 on Piper). The transcript knows
    better: the call should not end a turn whose text ends on such a word until the longer
    silence timeout. Whisper often adds a final "." to fragments, so a full stop is ignored;
    a question mark after a preposition ("... looking for?") means the question is whole.
    """
    words = "".join(c if c.isalpha() or c in "' " else " " for c in transcript.lower()).split()
    if not words:
        return None
    last = words[-1]
    if last in DANGLING_WORDS or (last in OPEN_WORDS and not transcript.rstrip().endswith("?")):
        return last
    return None


def open_ending(transcript: str) -> str | None:
    """What in `transcript` leaves the sentence open: its dangling word (dangling_word), or
    "," when it ends on a comma.

    The STT writes a final comma where the voice went on rising, mid-sentence: the LJ
    Speech readings that end on "," stop mid-sentence (test_a_human_reader_mid_sentence_scores_low),
    and a reader's own pause after "in passing," was cut in two at 1 s of silence (bench
    pipeline's human lines). Silence mode waits on either up to the silence timeout; a
    whole turn transcribed with a comma (espeak-ng's flat "...of the clinic,") pays that
    wait, a wrong "complete" answers half a sentence.
    """
    word = dangling_word(transcript)
    if word is None and transcript.rstrip().endswith(","):
        return ","
    return word


def without_end_mark(transcript: str) -> str:
    """`transcript` without the marks the STT ends it with ("Do you accept?" -> "Do you
    accept"): what the LLM scores for whether the caller's message ends there."""
    return transcript.strip().rstrip(".?!,;:…").rstrip()


# ---------------------------------------------------------------- the end-of-turn rule


TurnAction = Literal["wait", "ask", "end"]


@dataclass(frozen=True)
class TurnDecision:
    action: TurnAction  # wait: keep listening; ask: run the detector now; end: the turn is over
    reason: str  # speaking | pause | model | incomplete | dangling | timeout


@dataclass(frozen=True)
class TurnPolicy:
    """When a pause in the caller's speech ends the turn: VAD silence, Smart Turn, transcript.

    Per pause (the VAD's trailing silence, reset whenever speech resumes):

    - under `check_silence_s` of silence: wait (a breath, not a pause);
    - at `check_silence_s`: ask Smart Turn once, on the turn's audio so far (from just
      before speech started up to now, silence included; the last 8 s);
    - P > `threshold`: the turn ends now, unless the transcript of all the speech so far
      ends on a dangling word ("... for the"): then wait;
    - otherwise wait, and end the turn anyway at `max_silence_s` of silence.

    Pure: the caller owns clocks, audio and models, and passes what it knows.
    """

    check_silence_s: float = 0.2  # Pipecat's VAD stop_secs for Smart Turn
    threshold: float = DEFAULT_THRESHOLD
    max_silence_s: float = 1.5  # Pipecat waits 3 s; a phone agent that waits that long sounds dead
    hold_on_dangling: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.check_silence_s < self.max_silence_s:
            raise ValueError("need 0 < check_silence_s < max_silence_s")
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError("threshold must be in [0, 1)")

    def decide(self, silence_s: float, probability: float | None = None,
               transcript: str | None = None) -> TurnDecision:
        """`silence_s`: trailing silence of the current pause (0 while speaking).
        `probability`: Smart Turn's answer for this pause, None if not asked yet.
        `transcript`: stable text + unconfirmed tail from a transcription that heard all the
        speech of the turn so far; None when none is that fresh (then it is not used)."""
        if silence_s <= 0.0:
            return TurnDecision("wait", "speaking")
        if silence_s >= self.max_silence_s:
            return TurnDecision("end", "timeout")
        if silence_s < self.check_silence_s:
            return TurnDecision("wait", "pause")
        if probability is None:
            return TurnDecision("ask", "pause")
        if probability <= self.threshold:
            return TurnDecision("wait", "incomplete")
        if self.hold_on_dangling and transcript is not None and dangling_word(transcript):
            return TurnDecision("wait", "dangling")
        return TurnDecision("end", "model")
