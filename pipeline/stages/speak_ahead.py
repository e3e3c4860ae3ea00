"""Speaking ahead: the first sentence of a preemptive answer is synthesised while the
caller's silence runs out, so that a kept answer's audio is ready when the turn ends.

In silence mode the answer starts at the 200 ms pause (stages/preempt.py) and is mostly
written before the turn ends at `vad.end_silence_ms`; what the caller still waited for
after the end was Piper's first audio (0.1-0.3 s on two cores). Here the first sentence
of the buffered answer, as the turn would hand it to TTS (the plan line held back, the
call's sentence splitter), is synthesised meanwhile on the voice threads, and when the
speak stage asks for that very text it plays those chunks (`PrimedSpeech.synthesize`).

Nothing is played early and nothing changes what is said: audio made ahead is only ever
used for the exact sentence text the speak stage asks for. A sentence the fact guard
rewrites, or a preemption that is dropped, leaves audio nobody asks for; the oldest is
forgotten when more is made (`keep`). One sentence per preemptive start.

With a voice that cuts long sentences at commas (Piper's `split_clauses`), the first
sentence's first clause is made as soon as no more text can change it, while the model
still writes the rest (`FirstSentence.first_clause`); the rest is made once the sentence is
complete. A sentence asked for that starts with such a clause plays it from that audio,
then the rest (`PrimedSpeech.synthesize`): the same words, cut where the voice would cut
them. Measured: turns whose first sentence was complete only after the turn ended waited
0.3-0.5 s for Piper on a slow 2-core EPYC (README "Turn-taking", speaks ahead).

A turn that acts (a booking) cannot be spoken ahead: its words come from the database
after the turn ends. What the caller hears first there is the hold line ("One moment,
please."), the same words every time; a sentence the fact guard stops is replaced by the
business's fallback ("I'm not sure about that. ..."), also the same every time. These
`fixed` lines are made when a call starts (after its greeting, while the caller has not
spoken: `pin_fixed`) and kept (`pin`), once per TTS engine: the calls a server holds share
its engine, so they share those lines' audio, and a later call makes none. Made at the
first preemptive start instead, they took a core from that turn's answer. They are pinned
sentence by sentence: the guard says the whole fallback as one text, but a model that
writes the fallback itself is split by the call's splitter, and either way the text asked
for is played from the pinned sentences it is made of (measured: with the whole line
pinned, the model's own "I'm not sure about that." waited 0.3-0.6 s for Piper).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Executor

from llm.types import TokenGroup
from llm.voice_first import VoiceFirst
from pipeline.ports import TextToSpeech
from pipeline.sentences import SentenceSplitter, split_sentences
from pipeline.stages.plan_step import PlanFilter
from voice.tts import CLAUSE_ENDS, AudioChunk, split_clauses

log = logging.getLogger(__name__)

__all__ = ["FirstSentence", "PrimedSpeech"]


class FirstSentence:
    """The first sentence the caller would hear of a generation, from its token groups:
    the plan line held back (PlanFilter: an action's answer is the database's, not the
    model's, so none), then the call's splitter."""

    def __init__(self, splitter: SentenceSplitter):
        self.filter, self.splitter = PlanFilter(), splitter
        self.done = False
        self.text = ""  # what the caller would hear of it so far, until the first sentence is whole
        self.clause: str | None = None  # its first clause, once given (first_clause)

    def feed(self, group: TokenGroup) -> str | None:
        """The first sentence once this group completes it (once per generation), else None."""
        if self.done:
            return None
        heard = self.filter.feed(group.text) if group.text else ""
        self.text += heard
        sentences = self.splitter.feed(heard) if group.text else []
        if not sentences and group.finish_reason:
            sentences = self.splitter.flush()
        if sentences:
            self.done = True
            return sentences[0]
        if group.finish_reason:
            self.done = True
        return None

    def first_clause(self) -> str | None:
        """The unfinished first sentence's first clause as voice.tts.split_clauses cuts it,
        once no more text can change it (a later piece split off: earlier pieces are whole,
        the last only grows); once per generation, else None."""
        if self.done or self.clause is not None:
            return None
        pieces = split_clauses(self.text)
        if len(pieces) < 2:
            return None
        self.clause = pieces[0]
        return self.clause


class _Ahead:
    """One sentence being synthesised ahead: its chunks as they come, for one reader."""

    def __init__(self) -> None:
        self.chunks: list[AudioChunk] = []
        self.cond = threading.Condition()
        self.started = self.done = self.dropped = False
        self.error: BaseException | None = None


# The pinned lines of each TTS engine, shared by every call speaking through it.
_PINNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PINNED_LOCK = threading.Lock()


def _pinned_lines(tts: TextToSpeech) -> dict[str, "_Ahead"]:
    with _PINNED_LOCK:
        try:
            return _PINNED.setdefault(tts, {})
        except TypeError:  # an engine that takes no weak reference: its lines are this call's
            return {}


class PrimedSpeech:
    """A TextToSpeech whose sentences can be made ahead (`prime`); `synthesize` plays a
    primed sentence's chunks (waiting for those still being made), any other text as the
    engine would. Other attributes are the engine's."""

    def __init__(self, tts: TextToSpeech, executor: Executor, keep: int = 4, fixed: tuple[str, ...] = (),
                 voice_first: VoiceFirst | None = None):
        self.tts, self.executor, self.keep = tts, executor, keep
        # The call's LLM gate: a whole first sentence made ahead holds the model's next pass
        # until its first chunk exists (`prime(..., first=True)`; llm/voice_first.py).
        self.voice_first = voice_first
        self.fixed = tuple(line for line in fixed if line.strip())  # said again and again: pin_fixed
        self._ahead: OrderedDict[str, _Ahead] = OrderedDict()
        self._pinned = _pinned_lines(tts)  # lines said again and again (the hold line), per engine
        self._lock = _PINNED_LOCK  # guards _pinned (shared between calls) and _ahead
        self.primed = self.used = 0  # sentences made ahead / played from them, over the call

    def __getattr__(self, name: str):
        return getattr(self.tts, name)

    def prime(self, text: str, first: bool = False) -> None:
        """Start synthesising `text` on the executor (returns at once). `first`: it is the
        answer's whole first sentence (or its rest after a clause made ahead): what the
        caller will wait for is its audio, so the model's next pass waits until its first
        chunk exists (voice_first). A first clause is not `first`: the model is still writing
        the sentence the caller waits for."""
        if not text.strip():
            return
        with self._lock:
            if text in self._ahead or text in self._pinned:  # a fixed line is made already
                return
            ahead = self._ahead[text] = _Ahead()
            while len(self._ahead) > self.keep:
                _, old = self._ahead.popitem(last=False)
                with old.cond:
                    old.dropped = True
            self.primed += 1
        self.executor.submit(self._make, text, ahead, first)

    def pin(self, text: str) -> None:
        """Make `text` once, in the background, and keep it for every time it is said."""
        with self._lock:
            if not text.strip() or text in self._pinned and self._pinned[text].error is None:
                return
            ahead = self._pinned[text] = _Ahead()  # new, or made again after a failure
        self.executor.submit(self._make, text, ahead)

    def pin_fixed(self) -> None:
        """Pin the `fixed` lines, sentence by sentence (the call's start: see the module docstring)."""
        for line in self.fixed:
            for sentence in split_sentences(line):
                self.pin(sentence)

    def _make(self, text: str, ahead: _Ahead, first: bool = False) -> None:
        with ahead.cond:
            if ahead.dropped:
                return
            ahead.started = True
        hold = self.voice_first.hold() if first and self.voice_first is not None else None
        try:
            for chunk in self.tts.synthesize(text):
                if hold is not None:
                    hold.release()
                with ahead.cond:
                    if ahead.dropped:
                        break
                    ahead.chunks.append(chunk)
                    ahead.cond.notify_all()
        except Exception as exc:  # the speak stage synthesises it again (and reports that)
            log.warning("speaking ahead failed on %r: %r", text[:60], exc)
            ahead.error = exc
        finally:
            if hold is not None:
                hold.release()
            with ahead.cond:
                ahead.done = True
                ahead.cond.notify_all()

    def synthesize(self, text: str) -> Iterator[AudioChunk]:
        sentences = split_sentences(text) or [text]
        with self._lock:
            whole = self._pinned.get(text)
            if whole is not None:
                sentences, parts = [text], [whole]
            else:
                parts = [self._pinned.get(sentence) for sentence in sentences]
            ahead = self._ahead.pop(text, None)
            clause = None if ahead is not None else next(
                (c for c in self._ahead if c[-1] in CLAUSE_ENDS and text.startswith(c) and text[len(c):].strip()), None)
            if clause is not None:
                ahead = self._ahead.pop(clause)
        if None not in parts:  # pinned, whole or sentence by sentence: read, never used up
            for sentence, part in zip(sentences, parts):
                yield from self._play(sentence, part, pinned=True)
            return
        if clause is None:
            yield from self._play(text, ahead, pinned=False)
            return
        yield from self._play(clause, ahead, pinned=False)  # its first clause, made ahead
        yield from self.synthesize(text[len(clause):].strip())  # the rest: made ahead too, or now

    def _play(self, text: str, ahead: _Ahead | None, pinned: bool) -> Iterator[AudioChunk]:
        if ahead is not None:
            with ahead.cond:
                if not ahead.started:  # still queued: synthesise here instead (never wait on a queue)
                    ahead.dropped = not pinned
                    ahead = None
        if ahead is None:
            yield from self.tts.synthesize(text)
            return
        i = 0
        while True:
            with ahead.cond:
                while i >= len(ahead.chunks) and not ahead.done:
                    ahead.cond.wait()
                chunk = ahead.chunks[i] if i < len(ahead.chunks) else None
                failed = ahead.error is not None and chunk is None
            if chunk is None:
                break
            if i == 0:
                self.used += 1
            i += 1
            yield chunk
        if failed and i == 0:
            yield from self.tts.synthesize(text)  # made nothing: as if never primed
        elif failed:
            raise ahead.error  # part of it was played: the speak stage reports the sentence's failure


def speak_ahead(primed: PrimedSpeech, new_splitter: Callable[[], SentenceSplitter]):
    """The Preemptor's `on_group` hook: each preemptive generation's first sentence primed."""
    last: list = [None, None]  # the preemption being read, its FirstSentence (one at a time)

    clauses = bool(getattr(primed, "split_clauses", False))  # the voice cuts long sentences at commas

    def on_group(preemption: object, group: TokenGroup) -> None:
        if last[0] is not preemption:
            last[:] = [preemption, FirstSentence(new_splitter())]
        first: FirstSentence = last[1]
        if (sentence := first.feed(group)) is not None:
            clause = first.clause
            primed.prime(sentence[len(clause):].strip() if clause and sentence.startswith(clause) else sentence,
                         first=True)
        elif clauses and (clause := first.first_clause()) is not None:
            primed.prime(clause)

    return on_group
