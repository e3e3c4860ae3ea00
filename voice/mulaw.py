"""G.711 mu-law, the telephony codec (8 kHz, one byte a sample), in numpy.

Bit-exact with the classic Sun/CCITT reference that CPython's `audioop.lin2ulaw` and
`audioop.ulaw2lin` implement (audioop is deprecated and leaves the stdlib in 3.13, so
we do not depend on it). Both directions are table lookups: 65536 entries for encode,
256 for decode, built once with vectorised integer arithmetic at import time.
"""

from __future__ import annotations

import numpy as np

_BIAS = 0x84  # 132: added so every segment's lower edge is a power of two
_CLIP = 8159  # largest 14-bit magnitude that fits after the bias
_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF], dtype=np.int32)


def _build_encode_table() -> np.ndarray:
    # The reference works on 14-bit samples: the 16-bit value shifted right by 2
    # (arithmetic shift, i.e. floor for negatives).
    pcm14 = np.arange(-32768, 32768, dtype=np.int32) >> 2
    negative = pcm14 < 0
    mag = np.where(negative, -pcm14, pcm14)
    mask = np.where(negative, 0x7F, 0xFF)
    mag = np.minimum(mag, _CLIP) + (_BIAS >> 2)
    seg = np.searchsorted(_SEG_END, mag, side="left")  # first segment whose end >= mag
    uval = (seg << 4) | ((mag >> (seg + 1)) & 0xF)
    # seg == 8 cannot happen after clipping, but keep the reference's rule anyway.
    uval = np.where(seg >= 8, 0x7F, uval)
    return (uval ^ mask).astype(np.uint8)


def _build_decode_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + _BIAS) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, _BIAS - t, t - _BIAS).astype(np.int16)


_ENCODE = _build_encode_table()
_DECODE = _build_decode_table()


def encode(pcm16: np.ndarray) -> np.ndarray:
    """int16 samples -> mu-law bytes (uint8 array, same length).

    Floats are accepted and converted as `voice.audio.to_int16` would.
    """
    pcm16 = np.asarray(pcm16)
    if pcm16.dtype != np.int16:
        from voice.audio import to_int16

        pcm16 = to_int16(pcm16)
    return _ENCODE[pcm16.astype(np.int32) + 32768]


def decode(ulaw: np.ndarray | bytes | bytearray | memoryview) -> np.ndarray:
    """mu-law bytes (or a uint8 array) -> int16 samples."""
    if isinstance(ulaw, (bytes, bytearray, memoryview)):
        ulaw = np.frombuffer(ulaw, dtype=np.uint8)
    ulaw = np.asarray(ulaw)
    if ulaw.dtype != np.uint8:
        raise TypeError(f"mu-law data must be uint8 bytes, got {ulaw.dtype}")
    return _DECODE[ulaw]


def encode_bytes(pcm16: np.ndarray) -> bytes:
    """int16 samples -> mu-law payload bytes (what a Twilio `media` message carries)."""
    return encode(pcm16).tobytes()


def phone_roundtrip(pcm: np.ndarray, sample_rate: int) -> np.ndarray:
    """What a phone call does to audio: down to 8 kHz, mu-law, back to `sample_rate`.

    Returns float32. Used by `specvoice transcribe --phone` and the STT tests.
    """
    from voice.audio import PHONE_RATE, resample, to_float32, to_int16

    narrow = resample(to_float32(pcm), sample_rate, PHONE_RATE)
    decoded = decode(encode(to_int16(narrow)))
    return resample(to_float32(decoded), PHONE_RATE, sample_rate)
