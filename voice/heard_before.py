"""Drafts for Moonshine's decoder: what the beginning of this audio was heard as.

A caller's turn is transcribed several times as it grows: the speech prefill every 800 ms
while they speak, each pause, the end. Every time the decoder wrote the same words again,
one token per forward (about 4 ms each here, ~60 ms of a 3 s line; its encoder takes ~20).
Those earlier transcripts are drafts: the decoder checks all of a draft in ONE forward
(its with-past model takes several tokens; their logits come out causal, row by row),
keeps the tokens its own argmax agrees with, and writes from the first one it does not,
as the LLM's speculative decoding does (llm/decoder.py). A 3 s line whose first 2.5 s were
heard before costs the decoder a handful of forwards instead of fifteen.

`HeardBefore` remembers the last utterances transcribed (a digest of their samples, their
tokens) and finds, for new audio, the longest one it begins with. The audio is matched
sample for sample: the turn's audio grows by appending (the endpointer's buffer, the
bridge's streaming resampler), so a prefix is a prefix, and two calls never share one.
The very same audio again returns its tokens as they were (no forward at all), so one
audio always gets one transcript.

Not bit-exact against decoding without drafts: the int8 model quantises its activations
per tensor, so a row's logits move slightly with the rows beside it (up to ~0.6 here).
A near tie can go the other way; `specvoice bench voice` measures the WER both ways
(README: Voice stages).
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

HEAD = 160  # samples compared before a digest is computed (10 ms at 16 kHz)


@dataclass(frozen=True)
class _Heard:
    samples: int
    head: bytes
    digest: bytes
    tokens: tuple[int, ...]


def _digest(audio: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(audio).tobytes(), digest_size=16).digest()


class HeardBefore:
    """The last `size` utterances transcribed, shared by the threads transcribing them."""

    def __init__(self, size: int = 32):
        self._kept: deque[_Heard] = deque(maxlen=max(size, 1))
        self._lock = threading.Lock()
        self.enabled = size > 0

    def draft_for(self, audio: np.ndarray) -> tuple[list[int], bool]:
        """(tokens heard for the longest remembered audio this one begins with, whether it
        is this very audio); ([], False) when none."""
        if not self.enabled or len(audio) < HEAD:
            return [], False
        head = np.ascontiguousarray(audio[:HEAD]).tobytes()
        with self._lock:
            candidates = sorted((h for h in self._kept if h.head == head and h.samples <= len(audio)),
                                key=lambda h: -h.samples)
        for h in candidates:
            if _digest(audio[:h.samples]) == h.digest:
                return list(h.tokens), h.samples == len(audio)
        return [], False

    def remember(self, audio: np.ndarray, tokens: list[int]) -> None:
        if not self.enabled or len(audio) < HEAD:
            return
        heard = _Heard(len(audio), np.ascontiguousarray(audio[:HEAD]).tobytes(), _digest(audio), tuple(tokens))
        with self._lock:
            self._kept.append(heard)


def next_guess(source: list[int], made: list[int], k: int) -> list[int]:
    """Up to k tokens the decoder may write after `made`, read from `source` (an earlier
    transcript of the audio's beginning): its continuation while `made` still follows it
    word for word, else what followed the last two (or one) tokens of `made` in it (the
    earlier transcript cut a word, or heard one differently, and then agrees again)."""
    if k <= 0 or not source:
        return []
    n = len(made)
    if source[:n] == made:
        return source[n:n + k]
    for key_len in (2, 1):
        if n < key_len:
            continue
        key = made[-key_len:]
        for end in range(len(source) - 1, key_len - 1, -1):  # the latest occurrence with a continuation
            if source[end - key_len:end] == key:
                return source[end:end + k]
    return []
