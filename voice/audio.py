"""PCM helpers: sample formats, resampling, fixed-size framing.

Convention across voice/: audio is a 1-D numpy array; float32 in [-1, 1] is the working
format (what Whisper, Silero and Piper use); int16 is the wire/file format. 16 kHz is
the rate of everything between the microphone/phone and STT.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from voice.errors import AudioFormatError

STT_RATE = 16000  # Whisper and Silero both want 16 kHz mono
PHONE_RATE = 8000  # G.711 telephony


def to_float32(pcm: np.ndarray) -> np.ndarray:
    """int16 (or any int/float) samples -> float32 in [-1, 1].

    int16 is scaled by 1/32768 (so -32768 maps to exactly -1.0); floats pass through.
    """
    pcm = np.asarray(pcm)
    if pcm.dtype == np.int16:
        return pcm.astype(np.float32) / 32768.0
    if pcm.dtype == np.uint8:  # 8-bit WAV is unsigned, centred on 128
        return (pcm.astype(np.float32) - 128.0) / 128.0
    if np.issubdtype(pcm.dtype, np.integer):
        info = np.iinfo(pcm.dtype)
        return (pcm.astype(np.float64) / float(-info.min)).astype(np.float32)
    if np.issubdtype(pcm.dtype, np.floating):
        return pcm.astype(np.float32, copy=False)
    raise AudioFormatError(f"unsupported sample type {pcm.dtype}")


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] -> int16, clipping instead of wrapping around on overload."""
    pcm = np.asarray(pcm)
    if pcm.dtype == np.int16:
        return pcm
    x = to_float32(pcm)
    # Round to nearest and scale by 32768, the inverse of to_float32, then clip: +1.0
    # becomes 32767 rather than overflowing to -32768.
    return np.clip(np.rint(x * 32768.0), -32768, 32767).astype(np.int16)


def resample(pcm: np.ndarray, from_rate: int, to_rate: int, quality: str = "HQ") -> np.ndarray:
    """Resample 1-D float audio with soxr (band-limited; keeps frequency and level).

    int16 input comes back as int16, float as float32. Same rate: returned unchanged.
    """
    if from_rate <= 0 or to_rate <= 0:
        raise AudioFormatError(f"sample rates must be positive, got {from_rate} -> {to_rate}")
    pcm = np.asarray(pcm)
    if from_rate == to_rate or pcm.size == 0:
        return pcm
    import soxr  # imported here: most callers of this module never resample

    was_int16 = pcm.dtype == np.int16
    out = soxr.resample(to_float32(pcm), from_rate, to_rate, quality=quality)
    return to_int16(out) if was_int16 else out.astype(np.float32, copy=False)


def frame_samples(sample_rate: int, frame_ms: float) -> int:
    n = sample_rate * frame_ms / 1000.0
    if n != int(n) or n <= 0:
        raise AudioFormatError(f"{frame_ms} ms is not a whole number of samples at {sample_rate} Hz")
    return int(n)


def frames(pcm: np.ndarray, sample_rate: int, frame_ms: float = 20, pad: bool = True) -> Iterator[np.ndarray]:
    """Cut a whole signal into fixed frames (20 ms is a phone packet, 30 ms a common VAD frame).

    The last partial frame is zero-padded (pad=True) or dropped (pad=False).
    """
    n = frame_samples(sample_rate, frame_ms)
    pcm = np.asarray(pcm)
    full = len(pcm) // n
    for i in range(full):
        yield pcm[i * n:(i + 1) * n]
    rest = pcm[full * n:]
    if len(rest) and pad:
        yield np.concatenate([rest, np.zeros(n - len(rest), dtype=pcm.dtype)])


class Rebuffer:
    """Streaming counterpart of `frames`: push blocks of any size, pop fixed-size frames.

    Network packets and sound-card blocks never line up with model windows (Silero
    wants exactly 512 samples at 16 kHz), so every stream needs one of these.
    """

    def __init__(self, frame_size: int, dtype=np.float32):
        if frame_size <= 0:
            raise ValueError("frame_size must be positive")
        self.frame_size = frame_size
        self.dtype = dtype
        self._parts: list[np.ndarray] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, block: np.ndarray) -> list[np.ndarray]:
        block = np.asarray(block, dtype=self.dtype).reshape(-1)
        if block.size:
            self._parts.append(block)
            self._count += block.size
        out: list[np.ndarray] = []
        if self._count < self.frame_size:
            return out
        data = np.concatenate(self._parts)
        k = len(data) // self.frame_size
        out = [data[i * self.frame_size:(i + 1) * self.frame_size] for i in range(k)]
        rest = data[k * self.frame_size:]
        self._parts = [rest] if rest.size else []
        self._count = rest.size
        return out

    def flush(self, pad: bool = True) -> np.ndarray | None:
        """The leftover samples as one last frame (zero-padded), or None when empty."""
        if not self._count:
            return None
        data = np.concatenate(self._parts)
        self._parts, self._count = [], 0
        if pad:
            data = np.concatenate([data, np.zeros(self.frame_size - len(data), dtype=self.dtype)])
        return data


def rms_dbfs(pcm: np.ndarray) -> float:
    """Level of a signal in dB relative to full scale (-inf for digital silence)."""
    x = to_float32(pcm).astype(np.float64)
    if x.size == 0:
        return float("-inf")
    r = float(np.sqrt(np.mean(x * x)))
    return 20.0 * np.log10(r) if r > 0 else float("-inf")
