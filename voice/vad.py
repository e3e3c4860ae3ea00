"""Silero VAD on streaming 16 kHz audio: speech probability per 512-sample chunk.

The model is the ONNX file bundled in the `silero-vad` package, opened with
onnxruntime directly (importing the package itself would import torch, ~2 s, for
nothing). It is split in two so that many calls can share one model:

- `SileroModel`: the loaded ONNX session; load once per process (thread-safe to run).
- `SileroVAD`: one per audio stream; holds the recurrent state and the 64-sample
  context that Silero carries from chunk to chunk. `reset()` between utterances or calls.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from voice.errors import ModelFileMissingError, ModelLoadError

SAMPLE_RATE = 16000
CHUNK = 512  # the only chunk size Silero v5+ accepts at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous chunk the v5 model sees in front of each chunk


def bundled_model_path() -> Path:
    """The silero_vad.onnx shipped in the silero-vad package (found without importing it)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileMissingError("the silero-vad package is not installed: pip install silero-vad")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise ModelFileMissingError(f"{path}: Silero VAD model missing; reinstall silero-vad", path)
    return path


class SileroModel:
    """The Silero VAD network, loaded once and shared by every stream."""

    def __init__(self, path: str | Path | None = None, threads: int = 1):
        import onnxruntime as ort

        self.path = Path(path) if path is not None else bundled_model_path()
        if not self.path.is_file():
            raise ModelFileMissingError(f"{self.path}: Silero VAD model file not found", self.path)
        opts = ort.SessionOptions()
        # One thread: a 512-sample step is ~0.1 ms of work, thread hand-offs cost more,
        # and a call server runs many streams side by side anyway.
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(str(self.path), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidProtobuf types
            raise ModelLoadError(f"{self.path}: cannot load the Silero VAD model ({exc}); reinstall silero-vad", self.path) from exc
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)

    def stream(self) -> "SileroVAD":
        return SileroVAD(self)

    def run(self, x: np.ndarray, state: np.ndarray) -> tuple[float, np.ndarray]:
        out, new_state = self.session.run(None, {"input": x, "state": state, "sr": self._sr})
        return float(out.reshape(-1)[0]), new_state


class SileroVAD:
    """Per-stream VAD: feed 512-sample float32 chunks at 16 kHz, get P(speech)."""

    chunk_samples = CHUNK
    sample_rate = SAMPLE_RATE

    def __init__(self, model: SileroModel | None = None):
        self.model = model if model is not None else SileroModel()
        self.reset()

    def reset(self) -> None:
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)

    def __call__(self, chunk: np.ndarray) -> float:
        chunk = np.asarray(chunk, dtype=np.float32).reshape(-1)
        if chunk.shape[0] != CHUNK:
            raise ValueError(f"Silero takes {CHUNK}-sample chunks at 16 kHz, got {chunk.shape[0]} samples")
        x = np.concatenate([self._context, chunk])[None, :]
        prob, self._state = self.model.run(x, self._state)
        self._context = chunk[-CONTEXT:].copy()
        return prob

    def probabilities(self, pcm16k: np.ndarray) -> np.ndarray:
        """P(speech) for each whole 512-sample chunk of a signal (offline helper)."""
        pcm16k = np.asarray(pcm16k, dtype=np.float32)
        n = len(pcm16k) // CHUNK
        return np.array([self(pcm16k[i * CHUNK:(i + 1) * CHUNK]) for i in range(n)], dtype=np.float32)
