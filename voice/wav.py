"""WAV files in and out (soundfile), normalised to what the pipeline wants.

`read_wav` always returns mono float32 at the requested rate: stereo is mixed down,
other rates are resampled, 8-bit/24-bit/float files are converted. Anything soundfile
cannot parse (empty file, broken header, not audio at all) is refused with an
AudioFormatError that names the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from voice.audio import STT_RATE, resample, to_float32, to_int16
from voice.errors import AudioFormatError


def read_wav(path: str | Path, sample_rate: int | None = STT_RATE, mono: bool = True) -> tuple[np.ndarray, int]:
    """Read an audio file -> (float32 samples, rate).

    sample_rate=None keeps the file's own rate. mono=False keeps channels as
    shape (frames, channels).
    """
    import soundfile as sf

    path = Path(path)
    if not path.is_file():
        raise AudioFormatError(f"{path}: no such audio file")
    if path.stat().st_size == 0:
        raise AudioFormatError(f"{path}: the file is empty (0 bytes), not a WAV file")
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise AudioFormatError(f"{path}: cannot read it as audio ({exc})") from exc
    if mono:
        # Mean, not sum: keeps the level of a signal that is identical on both channels.
        data = data.mean(axis=1).astype(np.float32) if data.shape[1] > 1 else data[:, 0]
    if sample_rate is not None and rate != sample_rate:
        if mono:
            data = resample(data, rate, sample_rate)
        else:
            data = np.stack([resample(data[:, c], rate, sample_rate) for c in range(data.shape[1])], axis=1)
        rate = sample_rate
    return np.ascontiguousarray(data, dtype=np.float32), int(rate)


def write_wav(path: str | Path, pcm: np.ndarray, sample_rate: int) -> Path:
    """Write mono (or (frames, channels)) audio as 16-bit PCM WAV, creating folders."""
    import soundfile as sf

    if sample_rate <= 0:
        raise AudioFormatError(f"sample rate must be positive, got {sample_rate}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), to_int16(to_float32(np.asarray(pcm))), sample_rate, subtype="PCM_16", format="WAV")
    return path
