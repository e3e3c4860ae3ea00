"""Streaming sentence splitter: hands each sentence to TTS the moment it is provably complete.

The LLM streams token groups; TTS wants whole sentences (prosody needs them) but every
character we hold back is silence for the caller. So a boundary is declared as soon as the
text already received proves it, and only then:

* "?" / "!" (possibly repeated, mixed, or after "...") followed by closing quotes/brackets
  and then whitespace end a sentence. The whitespace is the proof: "?a=1" in a URL or
  "Yahoo!Inc" are not sentence ends, and a closing quote may still follow the mark.
* "." followed by closing quotes/brackets, then whitespace, then a capital letter, an
  opening quote/bracket or a digit ends a sentence, unless the word before it is a title
  or abbreviation that a name or more text follows ("Dr.", "Mrs.", "St.", "e.g.",
  "i.e.", "U.S.", initials like "J."), a list number at the start of a line ("1. First"),
  or "No." before a number ("No. 5"). "a.m.", "p.m.", "etc." and similar do end a
  sentence before a capital, except before a weekday or month name ("9 a.m. Monday").
* "." followed by whitespace containing a newline always ends a sentence.
* A "." with no whitespace after it ("3.5", "$29.99", "a.b@c.com", "x.y/z.html",
  "www.x.com") is never a boundary, and neither is an ellipsis ("..." or "…").

Every decision looks only at the pending sentence (text since the last boundary) and a
bounded lookahead. When the lookahead runs into the end of the text received so far, the
decision waits for more text instead of guessing, so the sentences produced never depend
on how the text was chunked into groups (the tests feed the same text whole, character
by character and in random pieces). At `flush()` the end of the turn counts as the end
of the lookahead and whatever is pending is handed over.

Optionally (`first_clause=True`) the first clause of a turn goes early: at a comma
followed by whitespace once the pending text has `first_clause_min_words` words, and only
while nothing has been emitted in this turn yet. That trades a little prosody for a
shorter silence before the agent starts speaking.
"""

from __future__ import annotations

import re
from enum import Enum

__all__ = ["SentenceSplitter", "split_sentences"]

_STRONG = frozenset("?!？！")
_TERMINATORS = frozenset(".…") | _STRONG
# Characters that belong to the sentence when they come right after its terminator.
_CLOSERS = frozenset("\"'”’»)]}")
# Characters that may start a new sentence after a period (besides capitals and digits).
_OPENERS = frozenset("\"'“‘«([{¿¡")

# Words (lower case, no final dot) after which a name or more of the sentence follows:
# a period after them never ends a sentence.
_NEVER_SPLIT = frozenset(
    """mr mrs ms mx dr prof st mt rev fr sr gen col capt cpt lt sgt gov sen rep hon pres
    supt messrs mmes vs approx apt dept est fig figs vol cf viz e.g i.e u.s u.k""".split()
)
# Abbreviations that often end a sentence too: split before a capital, unless the next
# word is a weekday or month ("at 9 a.m. Monday", "etc. May" is rare enough to accept).
_MAY_END = frozenset("a.m p.m etc inc ltd co corp jr ph.d".split())
_CALENDAR_WORDS = frozenset(
    """monday tuesday wednesday thursday friday saturday sunday mon tue tues wed thu thur
    thurs fri sat sun january february march april may june july august september october
    november december jan feb mar apr jun jul aug sep sept oct nov dec""".split()
)
_DOTTED_ACRONYM = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")


class _Verdict(Enum):
    BOUNDARY = 1
    NOT_BOUNDARY = 2
    NEED_MORE = 3


class SentenceSplitter:
    """Feed streamed text; get back the sentences it completed.

    `feed(text)` returns the sentences completed by this text (possibly none);
    `flush()` returns what is left at the end of the turn and resets the splitter for the
    next turn. Sentences are stripped of surrounding whitespace; joined with single spaces
    they reproduce the input with its whitespace normalised.
    """

    def __init__(self, first_clause: bool = False, first_clause_min_words: int = 6) -> None:
        if first_clause_min_words < 1:
            raise ValueError("first_clause_min_words must be >= 1")
        self.first_clause = first_clause
        self.first_clause_min_words = first_clause_min_words
        self.reset()

    def reset(self) -> None:
        """Forget any pending text: start a new turn."""
        self._buf = ""  # text since the last boundary (may start with whitespace)
        self._scan = 0  # where the next undecided candidate may start in _buf
        self._emitted_any = False  # anything emitted this turn (first-clause rule)

    @property
    def pending(self) -> str:
        """Text received but not yet handed over."""
        return self._buf

    def feed(self, text: str) -> list[str]:
        if not text:
            return []
        self._buf += text
        return self._split(final=False)

    def flush(self) -> list[str]:
        out = self._split(final=True)
        rest = self._buf.strip()
        if rest:
            out.append(rest)
        self.reset()
        return out

    # -- scanning -----------------------------------------------------------------------

    def _split(self, final: bool) -> list[str]:
        out: list[str] = []
        buf, i = self._buf, self._scan
        while i < len(buf):
            ch = buf[i]
            if ch in _TERMINATORS:
                verdict, end = self._judge_terminator(buf, i, final)
            elif ch == "," and self.first_clause and not self._emitted_any:
                verdict, end = self._judge_comma(buf, i, final)
            else:
                i += 1
                continue
            if verdict is _Verdict.NEED_MORE:
                break
            if verdict is _Verdict.BOUNDARY:
                sentence = buf[:end].strip()
                if sentence:
                    out.append(sentence)
                    self._emitted_any = True
                buf, i = buf[end:], 0
            else:
                i = end
        self._buf, self._scan = buf, i
        return out

    def _judge_comma(self, buf: str, i: int, final: bool) -> tuple[_Verdict, int]:
        end = i + 1
        if end == len(buf):
            return (_Verdict.NOT_BOUNDARY if final else _Verdict.NEED_MORE), end
        if not buf[end].isspace():  # "1,000", "a,b"
            return _Verdict.NOT_BOUNDARY, end
        if len(buf[:i].split()) >= self.first_clause_min_words:
            return _Verdict.BOUNDARY, end
        return _Verdict.NOT_BOUNDARY, end

    def _judge_terminator(self, buf: str, i: int, final: bool) -> tuple[_Verdict, int]:
        """Decide whether the run of terminators/closers starting at `i` ends a sentence.

        Returns the verdict and the index just past the run (where the sentence would end).
        At `final` (end of turn) running into the end of the text is not a reason to wait:
        whatever is pending is handed over anyway.
        """
        n = len(buf)
        end = i
        while end < n and (buf[end] in _TERMINATORS or buf[end] in _CLOSERS):
            end += 1
        wait = _Verdict.NOT_BOUNDARY if final else _Verdict.NEED_MORE
        if end == n:  # the run may go on ("?" -> "?!", "." -> "...", '."')
            return wait, end
        if not buf[end].isspace():
            return _Verdict.NOT_BOUNDARY, end
        marks = [c for c in buf[i:end] if c in _TERMINATORS]
        if any(c in _STRONG for c in marks):
            return _Verdict.BOUNDARY, end
        if len(marks) > 1 or "…" in marks:  # an ellipsis is a pause, not an end
            return _Verdict.NOT_BOUNDARY, end
        # A single period followed by whitespace: look at what comes next.
        k = end
        while k < n and buf[k].isspace():
            if buf[k] == "\n":
                return _Verdict.BOUNDARY, end
            k += 1
        if k == n:
            return wait, end
        nxt = buf[k]
        if not (nxt.isupper() or nxt in _OPENERS or nxt.isdigit()):
            return _Verdict.NOT_BOUNDARY, end  # "e.g. the", "etc. and"
        word, at_line_start = _word_before(buf, i)
        lower = word.lower()
        if lower in _NEVER_SPLIT:
            return _Verdict.NOT_BOUNDARY, end
        if lower == "no" and nxt.isdigit():  # "No. 5"
            return _Verdict.NOT_BOUNDARY, end
        if len(word) == 1 and word.isupper() and word != "I":  # an initial: "J. K. Rowling"
            return _Verdict.NOT_BOUNDARY, end
        if word.isdigit() and len(word) <= 3 and at_line_start:  # "1. First"
            return _Verdict.NOT_BOUNDARY, end
        if lower in _MAY_END:
            if nxt.isdigit():
                return _Verdict.NOT_BOUNDARY, end
            if nxt.isupper():
                m = k
                while m < n and buf[m].isalpha():
                    m += 1
                if m == n and not final:  # the next word may still grow ("Mon" -> "Money")
                    return _Verdict.NEED_MORE, end
                if buf[k:m].lower() in _CALENDAR_WORDS:
                    return _Verdict.NOT_BOUNDARY, end
            return _Verdict.BOUNDARY, end
        if _DOTTED_ACRONYM.fullmatch(word):  # "U.N.", "U.S.A." before a name
            return _Verdict.NOT_BOUNDARY, end
        return _Verdict.BOUNDARY, end


def _word_before(buf: str, i: int) -> tuple[str, bool]:
    """The word ending at `i` (opening punctuation removed) and whether it starts a line."""
    s = i
    while s > 0 and not buf[s - 1].isspace():
        s -= 1
    word = buf[s:i].lstrip("".join(_OPENERS))
    k = s
    while k > 0 and buf[k - 1].isspace():
        if buf[k - 1] == "\n":
            return word, True
        k -= 1
    return word, k == 0  # k == 0: the word starts the pending sentence


def split_sentences(text: str, first_clause: bool = False, first_clause_min_words: int = 6) -> list[str]:
    """Split a whole text the way the streaming splitter would."""
    splitter = SentenceSplitter(first_clause, first_clause_min_words)
    return splitter.feed(text) + splitter.flush()
