"""Turn-taking stage: when a pause in the caller's speech ends their turn.

Silence mode (no end-of-turn model): every end of speech the endpointer declares ends the
turn, as it always did. Silence mode with pauses (`end_silence_s`, set when the call
answers preemptively: pipeline/stages/preempt.py): the endpointer declares short pauses
(`turn.pause_ms`), each one is announced (its audio can be answered already), and the turn
ends when the silence reaches `end_silence_s` (vad.end_silence_ms), on exactly the audio
of the last pause unless the caller spoke again; when the pause's words are known (`heard`,
from the preemptive start's STT) and leave the sentence open ("... a cleaning for next",
"... in passing,": voice.turn_detector.open_ending), it waits on up to
`turn.max_silence_ms` (reason "timeout"); so it does when the LLM scores those words as
unlikely to end the caller's message (`words_end` below `words_end_threshold`: the STT
writes "Do you accept?" for a caller who stopped after "accept" to think;
Preemptor.on_ending). With `words_done_silence_s` (turn.words_done_silence_ms, off by
default: misheard fragments score high too), words that close the sentence and score at
least `words_done_threshold` ("What is your address") end the turn sooner, at that
silence (reason "words_end"), as LiveKit's end-of-utterance model shortens its delay.
Whatever the mode, a silence that runs out within `voice_hold_s` of a voiced chunk the
endpointer heard since the pause (`Endpointer.voice_t`: the caller going on, not yet the
min_speech_ms that make it speech) waits, at most `onset_wait_s`, for the voice to become
speech or to stop (`on_time`).

With an end-of-turn model (Smart Turn v3.2, voice/turn_detector.py) the endpointer runs
with a short silence (`turn.pause_ms`, 200 ms): its SpeechEnded is a *pause*. The pause's
audio joins the pending turn, the model is asked once on the turn's audio so far, and
voice.turn_detector.TurnPolicy decides:

- P(complete) > threshold: the turn ends now;
- otherwise it waits: the caller speaks on (the next pause asks again), or the silence
  reaches `turn.max_silence_ms` and the turn ends anyway ("timeout");
- an utterance cut at the endpointer's maximum length, or the end of the stream, ends the
  turn at once; so does a pending turn longer than the maximum turn length.

With `announce_pauses` (set by a call that answers preemptively, pipeline/stages/preempt.py)
a pause is announced as a `TurnPending` carrying the turn's audio so far; its TurnEnd, if
the caller says nothing more, carries exactly that audio. With `on_pause` set, every pause
is handed to it the moment it is declared, before the model is asked (the answer starts
beside the model's decision: if it says "complete", the turn ends on the audio the answer
was started from); without, a pause that leaves the turn waiting is returned after the
decision.

With `transcribe_pause` (streaming STT, pipeline/stages/live_stt.py) each pause is also
transcribed, beside the model: a "complete" whose words end on one that cannot end a
sentence ("... for the", voice.turn_detector.dangling_word) waits like an "incomplete",
and a turn that ends on that pause's audio carries its transcript (no STT after the end).

A caller who pauses mid-sentence ("I would like to book a cleaning for ... next Tuesday")
stays in one turn instead of being answered twice. Each turn carries how it ended (reason,
probability) for the report.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Protocol

import numpy as np

from pipeline.events import TurnEnd, TurnPending
from voice.endpointer import SpeechEnded, SpeechStarted
from voice.turn_detector import TurnPolicy, open_ending

log = logging.getLogger(__name__)

__all__ = ["EndOfTurnModel", "TurnTaker"]


class EndOfTurnModel(Protocol):
    def probability(self, audio_16k: np.ndarray) -> float: ...


class TurnTaker:
    """Endpointer events in, caller turns out (see the module docstring)."""

    def __init__(self, model: EndOfTurnModel | None, policy: TurnPolicy, *, max_turn_s: float = 30.0,
                 executor: Executor | None = None, clock: Callable[[], float] = time.monotonic,
                 announce_pauses: bool = False,
                 transcribe_pause: Callable[[np.ndarray], Awaitable[str | None]] | None = None,
                 end_silence_s: float | None = None, words_end_threshold: float = 0.0,
                 words_done_threshold: float = 1.0, words_done_silence_s: float | None = None,
                 voice_hold_s: float = 0.3, onset_wait_s: float = 0.4):
        self.model, self.policy, self.max_turn_s = model, policy, max_turn_s
        # Silence mode with pauses (no model): the turn ends at this much silence (None:
        # every SpeechEnded ends it, the endpointer's own silence).
        self.end_silence_s = end_silence_s if model is None else None
        # Silence mode: a pending turn whose words score below this (words_ended) waits.
        self.words_end_threshold = words_end_threshold
        # ... and one whose words score at least this ends at words_done_silence_s (None: off).
        self.words_done_threshold, self.words_done_silence_s = words_done_threshold, words_done_silence_s
        # A silence that ran out does not end the turn within voice_hold_s of a voiced chunk
        # heard since the pause (the next words may be starting: the endpointer needs
        # min_speech_ms, 200, to call them speech), for at most onset_wait_s (on_time).
        self.voice_hold_s, self.onset_wait_s = voice_hold_s, onset_wait_s
        self._ran_out: float | None = None  # when the pending turn's silence ran out (held since)
        # Called at every pause as it is declared, with the pending turn's TurnPending (the
        # call starts its preemptive answer there); None: waiting pauses are returned.
        self.on_pause: Callable[[TurnPending], None] | None = None
        self.executor, self.clock = executor, clock
        self.announce_pauses = announce_pauses  # a waiting pause yields a TurnPending
        # Streaming STT's transcript of the turn so far (pipeline/stages/live_stt.py), asked
        # at each pause beside the model: a "complete" that ends on a dangling word waits,
        # and a turn that ends there already has its transcript.
        self.transcribe_pause = transcribe_pause
        self._transcript: asyncio.Future | None = None  # of the pending audio, from its last pause
        self._heard: str | None = None  # silence mode: the words of all the pending audio (heard())
        self._words_end: float | None = None  # ... and the LLM's P(they end the message) (words_ended())
        self._pending: list[SpeechEnded] = []
        self._probability: float | None = None
        self._speaking = False  # the caller is speaking again after a pause
        self.decisions: list[tuple[str, float | None]] = []  # every model answer: (decision, P)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def pending_audio(self) -> np.ndarray:
        """The pending turn's audio so far (its pieces before the one being spoken)."""
        if not self._pending:
            return np.zeros(0, np.float32)
        return np.concatenate([e.audio for e in self._pending])

    @property
    def pending_samples(self) -> int:
        return sum(len(e.audio) for e in self._pending)

    async def on_event(self, event: SpeechStarted | SpeechEnded) -> list[SpeechStarted | TurnEnd | TurnPending]:
        if isinstance(event, SpeechStarted):
            self._speaking = True
            self._ran_out = None  # the caller went on: a later silence runs out anew
            self._probability = None  # the caller went on: the next pause asks anew
            self._transcript = self._heard = self._words_end = None  # ... and its transcript is of other audio
            return [event]
        self._speaking = False
        if self.model is None and self.end_silence_s is None:  # "silence", or "max_length" / "flush"
            if not self._pending:
                return [TurnEnd(event, event.reason)]
            self._pending.append(event)  # the rest of a turn taken back (reopen)
            return [self._end(event.declared_t, event.reason)]
        self._pending.append(event)
        if event.reason in ("max_length", "flush") or self._duration() >= self.max_turn_s:
            return [self._end(event.declared_t, "max_length" if event.reason != "flush" else "flush")]
        loop = asyncio.get_running_loop()
        audio = np.concatenate([e.audio for e in self._pending])
        if self.transcribe_pause is not None:  # runs beside the model (two cores)
            self._transcript = asyncio.ensure_future(_or_none(self.transcribe_pause(audio)))
        if self.model is None:  # silence mode with pauses: on_time ends the turn
            if event.declared_t - event.last_voiced_t >= self.end_silence_s:
                return [self._end(event.declared_t, "silence")]
            pending = self._pending_of(audio, event, event.declared_t)
            if self.announce_pauses and self.on_pause is not None:
                self.on_pause(pending)
                return []
            return [pending] if self.announce_pauses else []
        announced = self.announce_pauses and self.on_pause is not None
        if announced:  # answered beside the model's decision
            self.on_pause(self._pending_of(audio, event, event.declared_t))
        self._probability = await loop.run_in_executor(self.executor, self.model.probability, audio)
        # The decision is made now, after the model answered (on a real-time source the
        # frame clock is the monotonic clock; a faster-than-real-time one runs ahead of it).
        now = max(event.declared_t, self.clock())
        decision = self.policy.decide(now - event.last_voiced_t, self._probability)
        if decision.action == "end" and decision.reason == "model" and self._transcript is not None:
            # "Complete": unless the words end on one that cannot end a sentence ("for the").
            # Decided on the silence the model answered at: waiting for the words is the
            # transcription the turn needs anyway, not more silence from the caller.
            transcript = await self._transcript
            decision = self.policy.decide(now - event.last_voiced_t, self._probability, transcript)
            now = max(now, self.clock())
        self.decisions.append((decision.action, self._probability))
        if decision.action == "end":
            return [self._end(now, decision.reason)]
        if self.announce_pauses and not announced:
            return [self._pending_of(audio, event, now)]
        return []

    def _pending_of(self, audio: np.ndarray, event: SpeechEnded, now: float) -> TurnPending:
        return TurnPending(audio, len(self._pending), self._pending[0].start_t, event.last_voiced_t, now,
                           self._probability, self._transcript)

    def on_time(self, now: float, voice_t: float | None = None) -> TurnEnd | None:
        """A frame's end time: a waiting turn whose silence ran out ends here. `voice_t`:
        the end of the latest voiced chunk the endpointer heard since the pause
        (Endpointer.voice_t), if any."""
        if not self._pending or self._speaking:
            return None
        reason = self._silence_ended(now - self._pending[-1].last_voiced_t)
        if reason is None:
            return None
        if self._ran_out is None:
            self._ran_out = now
        if voice_t is not None and now - voice_t < self.voice_hold_s and now - self._ran_out < self.onset_wait_s:
            # The caller may be going on: voice the endpointer needs min_speech_ms to call
            # speech. espeak-ng's "a cleaning for | next Tuesday" has a 0.75 s gap that the VAD
            # heard as 0.99 s (the fading "for", then a first syllable that broke off after
            # 128 ms): the turn ended 10-40 ms after "next" began, and the line was cut in two.
            return None
        return self._end(now, reason)

    def _silence_ended(self, silence: float) -> str | None:
        """Why this much silence ends the waiting turn, or None: it goes on waiting."""
        if self.model is None:
            if silence < self.end_silence_s:
                # "What is your address?": the words close the sentence and the LLM expects
                # the message to end there; "Do you accept?" (a caller thinking of the name)
                # scores far below it and waits the whole silence.
                done = (self.words_done_silence_s is not None and silence >= self.words_done_silence_s
                        and self._words_end is not None and self._words_end >= self.words_done_threshold
                        and self._heard is not None and not open_ending(self._heard))
                return "words_end" if done else None
            unfinished = self._words_end is not None and self._words_end < self.words_end_threshold
            if unfinished or (self._heard is not None and open_ending(self._heard)):
                # "I'd like a cleaning for next ... Tuesday", "in passing, ... that": the words
                # say the caller is not done; or the LLM does ("Do you accept ... Aetna?").
                return "timeout" if silence >= self.policy.max_silence_s else None
            return "silence"
        t = self._transcript
        transcript = t.result() if t is not None and t.done() and not t.cancelled() else None
        return "timeout" if self.policy.decide(silence, self._probability, transcript).action == "end" else None

    def heard(self, samples: int, text: str) -> None:
        """The words of the pending turn's first `samples` samples (a pause's transcript):
        kept while they are the words of all of it (the caller has not spoken since)."""
        if self._all_pending(samples):
            self._heard = text

    def words_ended(self, samples: int, probability: float) -> None:
        """The LLM's probability that the words of the pending turn's first `samples`
        samples end the caller's message (Preemptor.on_ending); kept as `heard` is."""
        if self._all_pending(samples):
            self._words_end = probability

    def _all_pending(self, samples: int) -> bool:
        """`samples` are all of the pending turn's audio, and the caller has not spoken since."""
        return bool(self._pending) and not self._speaking and samples == self.pending_samples

    def reopen(self, end: TurnEnd) -> None:
        """A turn that ended is taken back (pipeline/stages/take_back.py): the caller, speaking
        again, goes on with it. Its audio is the first piece of the pending turn, so the
        turn that now ends carries all of it, as if it had waited through the pause."""
        self._pending.insert(0, end.utterance)

    def flush(self) -> TurnEnd | None:
        """The stream ended (not a hang-up): a waiting turn is answered."""
        if not self._pending:
            return None
        return self._end(self._pending[-1].declared_t, "flush")

    def _duration(self) -> float:
        return sum(e.duration for e in self._pending)

    def _end(self, declared_t: float, reason: str) -> TurnEnd:
        pieces, self._pending = self._pending, []
        self._ran_out = None
        first, last = pieces[0], pieces[-1]
        merged = SpeechEnded(np.concatenate([p.audio for p in pieces]), first.start_t, last.last_voiced_t,
                             declared_t, reason, first.audio_start_t)
        probability, self._probability = self._probability, None
        # The last pause's transcript is of this very audio unless a piece came after it
        # (max_length / flush end on a new piece: the pause saw none of it).
        transcript, self._transcript, self._heard = self._transcript, None, None
        words_end, self._words_end = self._words_end, None
        if reason in ("max_length", "flush"):
            transcript = words_end = None
        return TurnEnd(merged, reason, probability, len(pieces), transcript, words_end)


async def _or_none(transcript: Awaitable[str | None]) -> str | None:
    """A pause transcript that failed is no transcript: the turn transcribes as usual."""
    try:
        return await transcript
    except Exception:
        log.exception("pause transcript failed")
        return None
