"""Microphone in, speaker out, through sounddevice (PortAudio), in small blocks.

Both ends are asyncio-friendly: the PortAudio callback runs on its own thread and hands
blocks over with `call_soon_threadsafe`. Machines without PortAudio or without a
device (servers, containers, CI) get a DeviceUnavailableError that says what is
missing and points at `specvoice call`, which simulates the caller instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from voice.audio import STT_RATE, to_float32
from voice.errors import DeviceUnavailableError

FALLBACK = "run `specvoice call` instead: it simulates a caller without any sound device"


def _sounddevice():
    try:
        import sounddevice as sd
    except OSError as exc:  # sounddevice raises OSError when libportaudio cannot be loaded
        raise DeviceUnavailableError(
            f"PortAudio is not installed ({exc}); install it (apt-get install libportaudio2) "
            f"to use a microphone or speaker, or {FALLBACK}") from exc
    except ImportError as exc:
        raise DeviceUnavailableError(f"the sounddevice package is not installed; {FALLBACK}") from exc
    return sd


def check_device(kind: str, device: int | str | None = None) -> dict:
    """The device `kind` ("input" | "output") that would be used, or DeviceUnavailableError."""
    if kind not in ("input", "output"):
        raise ValueError("kind must be 'input' or 'output'")
    sd = _sounddevice()
    what = "microphone (input)" if kind == "input" else "speaker (output)"
    try:
        info = sd.query_devices(device, kind=kind)
    except Exception as exc:  # PortAudioError / ValueError: -1 means "no default device"
        raise DeviceUnavailableError(f"no {what} sound device found ({exc}); {FALLBACK}") from exc
    channels = info.get("max_input_channels" if kind == "input" else "max_output_channels", 0)
    if channels < 1:
        raise DeviceUnavailableError(f"sound device {info.get('name')!r} has no {kind} channels; {FALLBACK}")
    return dict(info)


@dataclass(frozen=True)
class MicFrame:
    pcm: np.ndarray  # float32 mono
    t: float  # time.monotonic() of the block's first sample (estimated from PortAudio's clock)


async def microphone(sample_rate: int = STT_RATE, block_ms: float = 20.0, device: int | str | None = None,
                     max_queue: int = 500) -> AsyncIterator[MicFrame]:
    """Record mono blocks of `block_ms` until the consumer stops iterating."""
    check_device("input", device)
    sd = _sounddevice()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[MicFrame] = asyncio.Queue(maxsize=max_queue)
    block = int(sample_rate * block_ms / 1000)

    def put(frame: MicFrame) -> None:
        if queue.full():  # consumer too slow: drop the oldest block, never block PortAudio
            queue.get_nowait()
        queue.put_nowait(frame)

    def callback(indata, frames, time_info, status) -> None:
        # Capture time of the first sample, mapped from PortAudio's stream clock to monotonic.
        lag = max(0.0, time_info.currentTime - time_info.inputBufferAdcTime) if time_info.inputBufferAdcTime else 0.0
        frame = MicFrame(indata[:, 0].astype(np.float32).copy(), time.monotonic() - lag)
        loop.call_soon_threadsafe(put, frame)

    stream = sd.InputStream(samplerate=sample_rate, blocksize=block, channels=1, dtype="float32",
                            device=device, callback=callback)
    with stream:
        while True:
            yield await queue.get()


class Speaker:
    """Plays float32 chunks in small blocks; `clear()` drops queued audio (barge-in)."""

    def __init__(self, sample_rate: int, block_ms: float = 20.0, device: int | str | None = None):
        check_device("output", device)
        sd = _sounddevice()
        self.sample_rate = sample_rate
        self._block = int(sample_rate * block_ms / 1000)
        self._pending = np.zeros(0, dtype=np.float32)
        import threading

        self._lock = threading.Lock()
        self._stream = sd.OutputStream(samplerate=sample_rate, blocksize=self._block, channels=1,
                                       dtype="float32", device=device, callback=self._callback)

    def _callback(self, outdata, frames, time_info, status) -> None:
        with self._lock:
            n = min(frames, len(self._pending))
            outdata[:n, 0] = self._pending[:n]
            outdata[n:, 0] = 0.0  # underrun: play silence rather than garbage
            self._pending = self._pending[n:]

    def start(self) -> None:
        self._stream.start()

    def play(self, pcm: np.ndarray) -> None:
        with self._lock:
            self._pending = np.concatenate([self._pending, to_float32(pcm).reshape(-1)])

    def clear(self) -> None:
        with self._lock:
            self._pending = np.zeros(0, dtype=np.float32)

    @property
    def queued_s(self) -> float:
        return len(self._pending) / self.sample_rate

    async def drain(self) -> None:
        while self.queued_s > 0:
            await asyncio.sleep(0.01)

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()

    def __enter__(self) -> "Speaker":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
