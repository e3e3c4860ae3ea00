"""Guards for a decoder that sees only as much audio as the utterance (no 30 s of padding).

Whisper trained on 30 s windows; given the utterance plus a few seconds, it sometimes
repeats its last words until the token limit (WER 170-970% measured with the window cut
to the audio + 0-2 s; audio + 4 s still looped on 6 of 38 Piper questions). Two guards
made the short window match the full one on every set tried (issue 26):

- a token cap that follows the audio: nobody speaks more than ~6 tokens a second, so a
  decoder past `max_new_tokens(audio_s)` is looping, not listening;
- a trailing-repetition cut: when the transcript ends in copies of one run of words, keep
  the first copy ("has never been surpassed. has never been surpassed. has never" ->
  "has never been surpassed.").

Moonshine runs on the utterance alone too, and takes the same two guards.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

TOKENS_PER_S = 6.0
TOKENS_EXTRA = 8
# A run of 1-2 words repeated this many times at the end is a loop ("no no" is speech,
# "no no no no" from a decoder is not); a run of 3 or more words, twice.
MIN_COPIES_SHORT = 3
MIN_COPIES_LONG = 2


def max_new_tokens(audio_s: float, per_s: float = TOKENS_PER_S, extra: int = TOKENS_EXTRA) -> int:
    """The most text tokens an utterance of `audio_s` seconds can honestly hold."""
    return int(math.ceil(per_s * max(0.0, audio_s))) + extra


def _key(word: str) -> str:
    return re.sub(r"^[^\w']+|[^\w']+$", "", word.casefold())


def repetition_keep(words: Sequence[str]) -> int:
    """How many of `words` to keep: all of them, or up to the end of the first copy when
    the words end in repeated copies of one run (the last copy may be cut short, as a
    token cap leaves it). Words compare case-folded, without surrounding punctuation."""
    keys = [_key(w) for w in words]
    n = len(keys)
    best = n
    for period in range(1, n // 2 + 1):
        # Walk back while each word equals the one `period` before it: words[start:] is periodic.
        start = n - period
        while start - 1 >= 0 and start - 1 + period < n and keys[start - 1] == keys[start - 1 + period]:
            start -= 1
        # Now keys[i] == keys[i + period] for every i in [start, n - period): words[start:]
        # is copies of words[start:start + period], the last one maybe cut short.
        copies = (n - start) / period
        needed = MIN_COPIES_SHORT if period <= 2 else MIN_COPIES_LONG
        if copies >= needed and all(keys[start:start + period]):
            best = min(best, start + period)
    return best


def cut_repetition(text: str) -> str:
    """`text` with a trailing repetition loop cut after its first copy (unchanged otherwise)."""
    words = text.split()
    keep = repetition_keep(words)
    return text if keep == len(words) else " ".join(words[:keep])
