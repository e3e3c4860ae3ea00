"""Streaming STT stage: transcribe the caller's turn while they speak, so that after the
end of the turn only the words not yet confirmed are left to transcribe.

    listen (each frame) -> LiveTranscript.heard(endpointer, t): the new audio the endpointer
        is sure to keep joins the turn's StreamingTranscriber (voice/streaming_stt.py); a
        pass (LocalAgreement-2 over re-transcriptions) runs every `interval_s` in a worker,
        one at a time -> transcript_interim / transcript_stable events
    a piece of speech ends (SpeechEnded) -> piece_ended: the rest of its audio joins
    the caller falls silent (post-roll of silence, still in speech) -> a pass on all of it at
        once, whatever the interval and beside a running interval pass: if the turn ends
        there, that pass is its transcript
    the turn ends (TurnEnd) -> claim: the turn takes its transcriber, a new one starts for
        the next turn; the turn's `finish` uses the last pass if it heard everything, else
        transcribes the unconfirmed tail only

The transcriber of a turn holds exactly the turn's audio: the pieces the endpointer keeps
(Endpointer.voiced_audio never returns a sample its SpeechEnded would trim), merged in
order as the turn-taker merges them. `claim` checks that sample for sample; on any
difference the turn falls back to transcribing the whole utterance (and says so in its
report), so a bug here costs time, never words.

Passes stop while the agent answers (`paused`): on two cores a Whisper pass beside
the LLM would slow the answer the caller is waiting for; the audio is still kept, so the
turn's finish covers it. An interval pass never starts while another runs, so a slow
machine gets fewer passes, not a queue of them; the silence pass runs beside it (at most
two at once, on two cores). Silence and noise give no words (Whisper's silence guards in
voice/streaming_stt.WhisperWords), so they start nothing downstream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.events import CallEvent, TranscriptInterim, TranscriptPause, TranscriptStable, TurnEnd
from voice.endpointer import Endpointer, SpeechEnded
from voice.streaming_stt import FinishStats, StreamingTranscriber, TranscriptEvent

log = logging.getLogger(__name__)

__all__ = ["LiveTranscript", "TurnTranscript"]

_EMPTY = np.zeros(0, np.float32)


@dataclass
class TurnTranscript:
    """One ended turn's streaming transcriber, claimed by that turn."""

    transcriber: StreamingTranscriber | None  # None: its audio did not match (see `mismatch`)
    executor: Executor | None
    mismatch: str | None = None  # why the whole utterance must be transcribed instead
    report: dict[str, Any] = field(default_factory=dict)

    async def finish(self) -> str | None:
        """The turn's transcript: the stable prefix plus the tail, transcribed now (None when
        the streamed audio was not the turn's: the caller transcribes the whole utterance)."""
        if self.transcriber is None:
            self.report = {"used": False, "why": self.mismatch}
            return None
        text = await self.transcriber.finish_async(self.executor)
        s = self.transcriber.stats
        self.report = {"used": True, "final": "after_end", **_stats(s), "tail_s": round(s.tail_s, 4),
                       "finish_compute_s": round(s.compute_s, 4)}
        return text

    def drop(self, why: str, used: bool = False) -> None:
        """Not finished here: the turn got its transcript elsewhere (`used`: from this
        stream at the last pause, TurnEnd.transcript; else from a whole-utterance STT)."""
        if self.transcriber is None:
            self.report = {"used": False, "why": self.mismatch}
            return
        stats = self.transcriber.snapshot()
        self.transcriber.reset()
        self.report = {"used": used, **({"final": "pause"} if used else {}), "why": why, **_stats(stats)}


def _stats(s: FinishStats) -> dict[str, Any]:
    return {"passes": s.passes, "stream_compute_s": round(s.stream_compute_s, 4), "utterance_s": round(s.utterance_s, 4),
            "events": [{"kind": e.kind, "text": e.text, "new": e.new, "at": e.at} for e in s.events]}


class LiveTranscript:
    """The call's streaming STT (see the module docstring). Driven from the call's input
    task: `heard` after every frame, `piece_ended` on each SpeechEnded, `claim` on TurnEnd."""

    def __init__(self, new_transcriber: Callable[[], StreamingTranscriber], *, executor: Executor | None = None,
                 emit: Callable[[CallEvent], None] = lambda event: None, paused: Callable[[], bool] = lambda: False):
        self.new_transcriber = new_transcriber
        self.executor, self.emit = executor, emit
        self.paused = paused  # True while the agent answers: no passes (the audio is still kept)
        self.transcriber = new_transcriber()
        self._fed = 0  # samples of the endpointer's current piece already given to the transcriber
        self._interval_pass: asyncio.Task | None = None  # every interval_s while speaking
        self._now_pass: asyncio.Task | None = None  # when the caller falls silent (beside the other)

    @property
    def busy(self) -> bool:
        return _running(self._interval_pass) or _running(self._now_pass)

    async def settle(self) -> None:
        """Until no pass runs."""
        running = [t for t in (self._interval_pass, self._now_pass) if _running(t)]
        if running:
            await asyncio.wait(running)

    def heard(self, endpointer: Endpointer, t: float) -> None:
        """After a frame: the new audio of the piece in progress, and a pass if one is due."""
        new = endpointer.voiced_audio(self._fed)
        if new.size:
            self.transcriber.append(new)
            self._fed += new.size
            self._maybe_pass(t)
        elif endpointer.trailing_silence_s * 1000 >= endpointer.config.post_roll_ms:
            # The caller fell silent: all the voiced audio is in (it ends post-roll after the
            # last voiced chunk). Guess the turn is over: a pass on all of it now is then the
            # final transcript, ready when the end is declared.
            self._maybe_pass(t, now=True)

    def piece_ended(self, ended: SpeechEnded) -> None:
        """A piece of speech ended: the rest of its audio joins the turn."""
        rest = ended.audio[self._fed:]
        self.transcriber.append(rest)
        self._fed = 0
        self._maybe_pass(ended.declared_t, now=True)

    def claim(self, end: TurnEnd) -> TurnTranscript:
        """The turn ended: hand it this transcriber (checked against its audio) and start
        a new one for the next turn."""
        transcriber = self.transcriber
        self.transcriber, self._fed = self.new_transcriber(), 0
        mismatch = _mismatch(transcriber, end.utterance.audio)
        if mismatch is not None:
            log.warning("streaming STT: %s; transcribing the whole utterance", mismatch)
            transcriber.reset()
            return TurnTranscript(None, self.executor, mismatch)
        return TurnTranscript(transcriber, self.executor)

    async def transcribe_pause(self, audio: np.ndarray) -> str | None:
        """At a pause: the transcript the turn would have if it ended now on `audio` (the
        turn's audio so far), without ending the stream: the stable words plus the tail,
        transcribed now (TurnTaker asks this beside the end-of-turn model). None when the
        streamed audio is not `audio` (the caller then transcribes as usual)."""
        transcriber = self.transcriber
        if (mismatch := _mismatch(transcriber, audio)) is not None:
            log.warning("streaming STT at a pause: %s; no pause transcript", mismatch)
            return None
        text, tail_s, compute_s = await transcriber.peek_async(self.executor)
        self.emit(TranscriptPause(text, round(tail_s, 4), round(compute_s, 4)))
        return text

    async def close(self) -> None:
        tasks = [t for t in (self._interval_pass, self._now_pass) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _maybe_pass(self, t: float, now: bool = False) -> None:
        tr = self.transcriber
        if now:
            # Beside a running interval pass: that one heard less, and waiting for it would
            # put a whole Whisper run between the caller's last word and the answer.
            if tr.heard_all or not tr.samples or _running(self._now_pass) or self.paused():
                return
            self._now_pass = asyncio.create_task(self._run_pass(tr, t, now))
        elif not _running(self._interval_pass) and not self.paused():
            self._interval_pass = asyncio.create_task(self._run_pass(tr, t, now))

    async def _run_pass(self, transcriber: StreamingTranscriber, t: float, now: bool) -> None:
        try:
            if now:
                events = await transcriber.pass_now_async(t, self.executor)
            else:
                events = await transcriber.feed_async(_EMPTY, t, self.executor)
        except Exception:  # a failed pass costs only the head start: finish() transcribes all
            log.exception("streaming STT pass failed")
            return
        for e in events:
            self.emit(_event_type(e)(e.text, e.new, e.at))


def _mismatch(transcriber: StreamingTranscriber, audio: np.ndarray) -> str | None:
    """Why the streamed audio is not `audio` (None: it is, sample for sample)."""
    if transcriber.samples != len(audio):
        return f"streamed {transcriber.samples} samples, the turn has {len(audio)}"
    if not np.array_equal(transcriber.buffered_audio(), audio):
        return "streamed audio differs from the turn's"
    return None


def _event_type(event: TranscriptEvent) -> type[TranscriptStable] | type[TranscriptInterim]:
    return TranscriptStable if event.kind == "stable" else TranscriptInterim


def _running(task: asyncio.Task | None) -> bool:
    return task is not None and not task.done()
