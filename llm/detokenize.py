"""Incremental, UTF-8-safe text from a growing list of token ids, with stop strings.

Byte-level BPE splits multi-byte characters across tokens; decoding a prefix then ends
in U+FFFD. We hold such a tail back until the character is complete, so every delta
is whole text. Stop strings end the output right before the stop string (it is never
emitted), and text that might be the start of a stop string is held back until the
next tokens decide it.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.emitted = ""  # text already handed out
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Add one token; return the text delta it makes final (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        text = self._decode()
        # An incomplete UTF-8 sequence decodes to U+FFFD at the end: wait for more bytes.
        stable = text.rstrip("\ufffd")
        if self.stop:
            start = max(0, len(self.emitted) - max(map(len, self.stop)))
            hits = [i for i in (stable.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                stable = stable[: min(hits)]
            else:
                stable = stable[: len(stable) - self._partial_stop_len(stable)]
        if not stable.startswith(self.emitted):
            # Decoding is prefix-stable for byte-level BPE; if a tokenizer ever rewrites
            # earlier text, emit nothing rather than repeat or garble it.
            return ""
        delta = stable[len(self.emitted) :]
        self.emitted = stable
        return delta

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def finish(self) -> str:
        """At the end of generation: release text held back as a possible stop prefix."""
        if self.stopped:
            return ""
        text = self._decode()
        if not text.startswith(self.emitted):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta
