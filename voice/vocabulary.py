"""The business's words put right in a transcript from an engine that takes no prompt.

Whisper conditions on the business's vocabulary as its prompt (voice/stt.py); Moonshine
has no prompt, so it writes what it knows: "Aetna" -> "Eatna", "Dr. Moreno" -> "doctor
Mornow", "check-up" -> "checkup". `VocabularyMatcher.correct` puts such words back:

- candidates: runs of 1-3 transcript words whose letters are close to a vocabulary
  phrase, or to a phrase's distinctive word (difflib's ratio on the letters alone, the
  same first sound, about as long: "eatna" ~ "aetna", "mornow" ~ "moreno");
- a change is made when it only respells ("check up" -> "check-up"), or when the engine
  wrote something that is not a word it knows (`known_words`: for Moonshine, the whole
  words of its tokenizer) and the change neither swaps one vocabulary word for another
  ("Dental" -> "Delta") nor one form of a word for another ("returned" -> "returns").
  A caller who said "a lot" keeps "a lot" in a business that sells a "slot".

Measured on the bench's dental sentences and Piper questions: "Mornow", "Eatna" and
"checkup" put right, no change on the LJ clips. Asking the engine instead (its
log-probability of the sentence with and without the change) did not separate right
changes from wrong ones: it prefers its own spelling in both (-41 and -27 nats for
"Moreno" and "Aetna", -10 for the wrong "returns").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from difflib import SequenceMatcher

MIN_SIMILARITY = 0.7  # letters' similarity for a candidate (difflib ratio)
SURE_SIMILARITY = 0.95  # a respelling (spaces, hyphens, case): always made
MAX_SPAN = 3  # transcript words one phrase may replace
_VOWELS = set("aeiouy")
# Titles and other short words that say nothing about which name follows.
_GENERIC = {"dr", "mr", "mrs", "ms", "the", "a", "an", "of", "and", "st"}


def letters(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _same_first_sound(a: str, b: str) -> bool:
    return bool(a and b) and (a[0] == b[0] or (a[0] in _VOWELS and b[0] in _VOWELS))


def similarity(a: str, b: str) -> float:
    """How alike two spellings are, letters only (0..1); 0 when they start with different sounds."""
    a, b = letters(a), letters(b)
    if not _same_first_sound(a, b):
        return 0.0
    return SequenceMatcher(None, a, b).ratio()


def _comparable(span: str, target: str, span_words: list[str]) -> bool:
    """A span about as long as the phrase, whose every word counts: "boots don't" is not
    a misspelt "boots" (the change would drop a word the caller said)."""
    a, b = len(letters(span)), len(letters(target))
    if not a or min(a, b) / max(a, b) < 0.7:
        return False
    if len(span_words) > 1:
        whole = similarity(span, target)
        for part in (span_words[1:], span_words[:-1]):
            if similarity(" ".join(part), target) >= whole:
                return False
    return True


@dataclass(frozen=True)
class Change:
    start: int  # first transcript word replaced
    end: int  # one past the last
    phrase: str  # what replaces them
    similarity: float


def _targets(vocabulary: Iterable[str]) -> list[str]:
    """The phrases, and each phrase's distinctive words alone ("Dr. Moreno" -> "Moreno")."""
    out: list[str] = []
    for phrase in vocabulary:
        phrase = " ".join(str(phrase).split())
        if not phrase:
            continue
        out.append(phrase)
        words = phrase.split()
        if len(words) > 1:
            out.extend(w for w in words if letters(w) not in _GENERIC and len(letters(w)) >= 4)
    seen: set[str] = set()
    return [t for t in out if not (t.lower() in seen or seen.add(t.lower()))]


class VocabularyMatcher:
    """`correct(text)`: the transcript with vocabulary phrases put back."""

    def __init__(self, vocabulary: Iterable[str] = (), known_words: Iterable[str] = (),
                 min_similarity: float = MIN_SIMILARITY):
        """known_words: words the engine spells right when it hears them (lower case)."""
        vocabulary = list(vocabulary)
        self.targets = _targets(vocabulary)
        self.vocabulary_words = {letters(w) for phrase in vocabulary for w in str(phrase).split()}
        self.known_words = {letters(w) for w in known_words}
        self.min_similarity = min_similarity

    def __bool__(self) -> bool:
        return bool(self.targets)

    def changes(self, words: list[str]) -> list[Change]:
        """Candidate changes, best first, none overlapping, none that changes nothing."""
        found: list[Change] = []
        for target in self.targets:
            target_letters = letters(target)
            n = len(target.split())
            for size in range(max(1, n - 1), min(MAX_SPAN, n + 2) + 1):
                for start in range(0, len(words) - size + 1):
                    span = " ".join(words[start:start + size])
                    if letters(span) == target_letters and span.strip(".,?!;:").lower() == target.lower():
                        continue  # already the phrase
                    if not _comparable(span, target, words[start:start + size]):
                        continue
                    s = similarity(span, target)
                    if s >= self.min_similarity:
                        found.append(Change(start, start + size, target, s))
        found.sort(key=lambda c: (-c.similarity, c.start))
        taken: set[int] = set()
        out = []
        for c in found:
            if taken.isdisjoint(range(c.start, c.end)):
                out.append(c)
                taken.update(range(c.start, c.end))
        return out

    def correct(self, text: str) -> str:
        if not self.targets or not text:
            return text
        words = text.split()
        current = list(words)
        for change in self.changes(words):
            if change.similarity < SURE_SIMILARITY and not self._plausible(words[change.start:change.end], change):
                continue
            current = _apply(current, words, change)
        return _text(current)

    def _plausible(self, span: list[str], change: Change) -> bool:
        keys = [letters(w) for w in span]
        if not any(k and k not in self.known_words for k in keys):
            return False  # every word is one the engine knows: it heard a word, not a name
        if "".join(keys) in self.vocabulary_words or any(k in self.vocabulary_words - set(
                letters(w) for w in change.phrase.split()) for k in keys):
            return False  # another of the business's words ("Dental" is not a misheard "Delta")
        if _stem("".join(keys)) == _stem(letters(change.phrase)):
            return False  # another form of the same word ("returned" / "returns")
        return True


_SUFFIXES = ("ing", "ers", "es", "ed", "er", "s", "d")


def _stem(word: str) -> str:
    """A word without its inflection ("returned", "returns" -> "return"), letters only."""
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[:-len(suffix)]
    return word


def _text(words: list[str]) -> str:
    return " ".join(w for w in words if w)


def _apply(current: list[str], original: list[str], change: Change) -> list[str]:
    """Replace the change's words (positions in `original`, kept in step in `current` by
    marking replaced words) with the phrase, keeping the punctuation around them."""
    # Work on a copy where replaced spans are single entries, so positions stay those of
    # `original`: entries are strings, a replaced span becomes [phrase, "", "", ...].
    out = list(current)
    lead = re.match(r"^[^\w]*", original[change.start]).group(0)
    trail = re.search(r"[^\w']*$", original[change.end - 1]).group(0)
    phrase = change.phrase.rstrip(".")
    out[change.start] = lead + phrase + trail
    for i in range(change.start + 1, change.end):
        out[i] = ""
    return out
