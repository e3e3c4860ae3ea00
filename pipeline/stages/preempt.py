"""Preemptive generation, exact: answer a turn while the caller pauses, and keep the work
only when the turn ends on the very audio it was started from.

    pause, turn still open (TurnPending)   -> Preemptor.start: a task runs
        STT on the turn's audio so far -> messages (history + transcript)
        -> backend.stream(...) into a buffer: nothing reaches TTS, nothing is played,
           history is not touched
    SpeechStarted while the turn is open   -> discard("caller_resumed"): the generation is
                                              stopped (the backend's cancel, between target
                                              passes) and dropped
    TurnEnd                                -> claim: the same audio (same pieces, same
                                              samples) -> the preemption goes to the turn;
                                              any other audio -> discard("audio_changed")
    the turn (pipeline/call.py)            -> reuses the transcript instead of running STT;
        `adopt` checks that the transcript and the messages the turn would send are those
        the generation started from, and hands the turn a `PreemptedBackend`: its first
        stream, if it asks for exactly what the generation was sent (a plan turn's answer
        line or grammar, built from the database's slots at the start, included), replays
        the buffered token groups, then follows the live ones. Otherwise discard
        ("transcript_changed", "history_changed"), or a live stream, and the turn
        generates as usual.

Exact. With greedy decoding a generation is a function of its prompt: the same audio
gives the same transcript (Whisper greedy, temperature 0, no fallback), the same history
and transcript give the same messages (checked, not assumed), so the kept generation's
tokens are those a turn started after the endpoint would get. (With temperature > 0 the
kept answer is a sample of the same distribution, not the same sample.) A discarded
generation leaves the conversation's KV cache valid for the tokens it holds (the engine
commits tokens and cache length together at each pass boundary, and stops only there);
the next prompt reuses the common prefix and recomputes the rest. Nothing else runs on the
conversation until a discarded generation has stopped: a new start waits for it, and the
turn calls `settle()` before it generates.

Bounded: one start per pause, `max_starts` per turn, one preemption at a time, no LLM on
an empty transcript (silence or noise Whisper could not read).

Prefill while the caller speaks (`SpeechPrefill`, the listen stage's tap): every
`interval_s` of new speech, the turn's audio so far is transcribed and the prompt the
turn would send, up to those words less the last (the next audio may change it), is
computed into the conversation's K/V (the backend's `prefill`; nothing generated). The
pause's generation then prefills only the words after them. Exact for the same reason a
discarded generation is: a prompt reuses only the prefix its tokens share with the cache.
One piece of work at a time on the conversation: a prefill runs only when nothing else
does, a start waits for it before its LLM (and stops one still transcribing, which then
touches nothing, so neither the start nor its turn waits for it); the start's own STT runs
beside it.

Prefill after the agent's turn (`Preemptor.prefill_next`, from the call once a turn is
over): the history as the next prompt renders it, up to the caller's next words. A
turn's cache holds what the model wrote, and the next prompt renders what the caller
heard: an action's plan line is not in it, the hold line and the reply are ("One moment,
please. ..."), so without this the caller's next turn prefilled that reply first
(measured: 40-50 tokens, 2-3 s on a 2-core AVX2 EPYC, where a start waited for it).

Whether the caller is done (`on_ending`, silence mode): the start asks its own stream to
score the pause's words (llm.types.WordsEnd on its cancel): the probability, from the
logits after the words in the prompt its prefill computes anyway, that they end the
caller's message. The turn-taker waits on a low one ("Do you accept?" from a caller who
stopped after "accept"), as on words that end on "for".

Events (through `emit`, and in the turn's report entry): preemptive_start,
preemptive_kept, preemptive_discarded (with why).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llm.tool_calls import ToolCallParse
from llm.types import GenerationStats, SamplingParams, TokenGroup, WordsEnd
from pipeline.ports import LLMBackend, SpeechToText
from pipeline.events import (CallEvent, PreemptiveDiscarded, PreemptiveKept, PreemptiveStart, TurnEnd,
                             TurnPending)
from voice.turn_detector import open_ending, without_end_mark

log = logging.getLogger(__name__)

__all__ = ["MAX_STARTS_PER_TURN", "Preemption", "PreemptedBackend", "Preemptor", "SpeechPrefill", "TurnPreemption",
           "same_audio"]

MAX_STARTS_PER_TURN = 3
_EVENTS = {"start": PreemptiveStart, "kept": PreemptiveKept, "discarded": PreemptiveDiscarded}


class Stop:
    """The preemptive generation's cancel: its own flag, or any event linked to it later
    (the turn's barge-in, once the turn has adopted the generation). Duck-types the
    Event the backends take (they only read `is_set()`; reading flags from the engine's
    worker thread is safe)."""

    def __init__(self) -> None:
        self._set = False
        self._linked: list[Any] = []
        # Until the turn ends on this audio: the engine runs these passes only when no other
        # conversation's wait (llm/scheduler.py); read from the engine's thread.
        self.background = True
        self.on_conversation = False  # a speech prefill: past its STT, into the LLM's cache
        # The start's request to score the caller's words from its prefill (llm.types.WordsEnd).
        self.words_end: WordsEnd | None = None

    def set(self) -> None:
        self._set = True

    def link(self, event: Any) -> None:
        self._linked.append(event)

    def is_set(self) -> bool:
        return self._set or any(e.is_set() for e in self._linked)


@dataclass
class Preemption:
    """One preemptive start: its pause, transcript, messages and buffered token groups."""

    pause: TurnPending
    params: SamplingParams
    log: list[dict]  # the pending turn's preemption events (shared with its TurnPreemption)
    started_t: float = field(default_factory=time.monotonic)
    stop: Stop = field(default_factory=Stop)
    transcript: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    prompt: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    text: str | None = None  # None: STT not done or failed
    messages: list[dict] | None = None  # what the generation was started on (None: no generation)
    # The turn's first round on those messages (Preemptor.first_round): what the backend
    # was sent, the answer plan's prefilled line or constraint included.
    sent: list[dict] | None = None
    groups: list[TokenGroup] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False  # the generation ended (or never started)
    error: BaseException | None = None
    discarded: str | None = None  # why, once discarded
    kept: bool = False
    task: asyncio.Task | None = None


@dataclass
class TurnPreemption:
    """What preemption did during one caller turn, for that turn: the preemption its
    TurnEnd matched (if any) and every start/discard on the way."""

    preemption: Preemption | None
    log: list[dict]

    @property
    def starts(self) -> int:
        return sum(1 for e in self.log if e["event"] == "start")

    @property
    def hit(self) -> bool:
        return self.preemption is not None and self.preemption.kept

    def record(self) -> dict:
        """For the turn's report entry (pipeline/report.py): hit, starts, and the events."""
        return {"hit": self.hit, "starts": self.starts, "events": self.log}


def same_audio(pause: TurnPending, end: TurnEnd) -> bool:
    """The turn ended on exactly the audio the preemption heard: the same pieces and the
    same samples (compared, not inferred from timing)."""
    audio = end.utterance.audio
    return (end.pauses == pause.pauses and len(audio) == len(pause.audio)
            and bool(np.array_equal(audio, pause.audio)))


class Preemptor:
    """The call's preemptive starts, one pending turn at a time (see the module docstring).
    Driven from the call's input task (start / discard / claim) and its turn (adopt /
    settle); `close()` at the end of the call."""

    def __init__(self, stt: SpeechToText, backend: LLMBackend, params: SamplingParams,
                 messages_for: Callable[[str], list[dict]], *, executor: Executor | None = None,
                 emit: Callable[[CallEvent], None] = lambda event: None, max_starts: int = MAX_STARTS_PER_TURN,
                 first_round: Callable[[list[dict], str], tuple[list[dict], SamplingParams]] | None = None,
                 needs_llm: Callable[[list[dict], str], bool] | None = None):
        self.stt, self.backend, self.params = stt, backend, params
        # (messages, transcript) -> whether its turn would ask the model: a line the turn
        # answers in our own words (a greeting, Reply.greet_back) starts no generation.
        self.needs_llm = needs_llm or (lambda messages, text: True)
        self.messages_for = messages_for  # transcript -> the messages its turn would send (runs in a thread)
        # (messages, transcript) -> what the turn's first round sends the backend: the
        # messages and params (a plan turn's prefilled line or grammar, stages/plan_step.py).
        # Runs in a thread (it may read the bookings database).
        self.first_round = first_round or (lambda messages, text: (messages, self.params))
        self.executor, self.emit, self.max_starts = executor, emit, max_starts
        # Told each pause's transcript as it is known: (samples of the turn's audio, text);
        # silence mode's turn-taker waits longer on "... for next" (stages/turn_taking.py).
        self.on_transcript: Callable[[int, str], None] | None = None
        # Told, when set and the backend can score it (`scores_words_end`), the LLM's
        # probability that a pause's words end the caller's message: (samples, P).
        self.on_ending: Callable[[int, float], None] | None = None
        # Told each buffered token group of a generation (preemption, group): the first
        # sentence is synthesised ahead (stages/speak_ahead.py).
        self.on_group: Callable[[Preemption, TokenGroup], None] | None = None
        self.current: Preemption | None = None
        self.llm_starts = 0  # generations started, over the call
        self.prefilled: list[int] = []  # each speech prefill's tokens cached, over the call (SpeechPrefill)
        self._prefill_stop: Stop | None = None  # the running speech prefill's
        self._prefill_task: asyncio.Task | None = None  # ... and its task
        self._log: list[dict] = []  # the pending turn's events
        # Started and not yet finished (discarded ones included), each with its cancel.
        self._tasks: dict[asyncio.Task, Stop] = {}

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    # ---------------------------------------------------------------- from the input task

    def start(self, pause: TurnPending) -> Preemption | None:
        """A pause left the turn open: start on it, unless the turn had its share of starts
        or a preemption of this turn is still live (one pause, one start: a new pause
        comes only after SpeechStarted, which discards the previous one)."""
        if self.current is not None and self.current.discarded is None:
            return None
        if sum(1 for e in self._log if e["event"] == "start") >= self.max_starts:
            return None
        if self._prefill_stop is not None:
            self._prefill_stop.set()  # a speech prefill still transcribing: the start transcribes all
        previous = self._on_conversation()  # discarded ones still stopping: ours waits for them
        p = Preemption(pause, self.params, self._log)
        self._note(p, "start", pause=pause.pauses, audio_s=round(len(pause.audio) / 16000, 3))
        self.current = p
        p.task = asyncio.create_task(self._run(p, previous), name="preemptive")
        self._track(p.task, p.stop)
        return p

    def _track(self, task: asyncio.Task, stop: Stop) -> None:
        self._tasks[task] = stop
        task.add_done_callback(lambda t: self._tasks.pop(t, None))

    def discard(self, why: str, p: Preemption | None = None) -> None:
        """Stop and drop a preemption (default: the pending turn's)."""
        p = p if p is not None else self.current
        if p is None:
            return
        if p is self.current and why == "caller_resumed":
            self.current = None
        if p.discarded is not None or p.kept:
            return
        p.discarded = why
        p.stop.set()
        self._note(p, "discarded", why=why)

    def claim(self, end: TurnEnd) -> TurnPreemption | None:
        """The pending turn ended: its preemption, if the audio is the one it heard, goes
        to the turn; otherwise it is discarded. None when the turn had no preemption."""
        p, log_, self.current, self._log = self.current, self._log, None, []
        # The turn has ended, and its answer (kept or new) waits for all work still on the
        # conversation (a speech prefill's pass, a discarded start's last one): none of it
        # yields to other calls' passes any more, passes already queued included (the
        # scheduler reads the flag when it chooses a round). Under load they waited seconds.
        for stop in self._tasks.values():
            stop.background = False
        if p is not None and not same_audio(p.pause, end):
            self.discard("audio_changed", p)
            p = None
        if p is not None:
            p.stop.background = False  # the turn's answer goes first from now on
        if p is None and not log_:
            return None
        return TurnPreemption(p, log_)

    def prefill(self, audio: np.ndarray | None) -> bool:
        """The caller is still speaking; `audio` is their turn so far: transcribe it and
        prefill the turn's prompt up to those words but the last (module doc); None: no
        words yet (prefill_next). Only when no other work runs on the conversation and the
        backend can prefill; False if not started."""
        prefill = getattr(self.backend, "prefill", None)
        if prefill is None or self._tasks or (self.current is not None and self.current.discarded is None):
            return False
        stop = self._prefill_stop = Stop()
        task = self._prefill_task = asyncio.create_task(self._prefill(prefill, audio, stop), name="speech-prefill")
        self._track(task, stop)
        return True

    def prefill_next(self) -> bool:
        """The agent's turn is over and the caller has not spoken yet: prefill the history
        up to the caller's next words (module doc). False if not started (as `prefill`)."""
        return self.prefill(None)

    async def _prefill(self, prefill: Callable, audio: np.ndarray | None, stop: Stop) -> None:
        loop = asyncio.get_running_loop()
        try:
            words: list[str] = []  # no audio: the next caller message's opening, no words yet
            if audio is not None:
                text = await loop.run_in_executor(self.executor, self.stt.transcribe, audio)
                words = (text or "").split()[:-1]  # the last word may be cut, or change with more audio
                if len(words) < 2:
                    return
            if stop.is_set():
                return
            messages = await loop.run_in_executor(self.executor, self.messages_for, " ".join(words))
            if stop.is_set():
                return
            stop.on_conversation = True  # from here on it computes into the conversation's cache
            self.prefilled.append(await prefill(messages, stop))
        except asyncio.CancelledError:
            pass  # the call ended
        except Exception:  # a prefill is only a head start: the turn prefills what it needs
            log.warning("speech prefill failed", exc_info=True)
        finally:
            if self._prefill_stop is stop:
                self._prefill_stop = None

    # ---------------------------------------------------------------- from the turn

    async def transcript(self, claim: TurnPreemption | None) -> str | None:
        """The claimed preemption's transcript (waiting for its STT if still running);
        None when there is none to reuse (no preemption, or its STT failed)."""
        if claim is None or claim.preemption is None:
            return None
        return await asyncio.shield(claim.preemption.transcript)

    async def adopt(self, claim: TurnPreemption | None, text: str, messages: list[dict]) -> PreemptedBackend | None:
        """The turn's transcript and messages are known: keep the generation if it was
        started on exactly these, else discard it (and let it stop). Returns the backend
        the turn's respond stage should read, or None to generate as usual."""
        if claim is None or claim.preemption is None:
            return None
        p = claim.preemption
        if p.discarded is None:
            started_on = await asyncio.shield(p.prompt)  # the generation's messages, or None
            if p.discarded is not None:
                pass
            elif started_on is None:
                self.discard("no_generation", p)  # STT failed or found nothing
            elif p.text != text:
                self.discard("transcript_changed", p)
            elif started_on != messages:
                self.discard("history_changed", p)
            elif p.finished and p.error is not None:
                self.discard("llm_error", p)
            else:
                p.kept = True
                self._note(p, "kept", groups_ready=len(p.groups), finished=p.finished)
                return PreemptedBackend(self.backend, p)
        await self.settle()
        return None

    def make_way(self, keep: Preemption | None = None) -> None:
        """A turn is about to generate: the pending turn's preemption (if it is not the
        one this turn kept) would share the conversation with it, and the turn's answer
        changes the history it was started on: stop it."""
        if self.current is not None and self.current is not keep:
            self.discard("another_turn", self.current)

    def _on_conversation(self) -> list[asyncio.Task]:
        """The tasks that run, or may still run, work on the conversation: all but a speech
        prefill stopped while it was transcribing (it ends after its STT, touching nothing)."""
        stop, task = self._prefill_stop, self._prefill_task
        idle = task if stop is not None and stop.is_set() and not stop.on_conversation else None
        return [t for t in self._tasks if t is not idle]

    async def settle(self, keep: Preemption | None = None) -> None:
        """Wait until no preemptive work other than `keep`'s runs on the conversation (it is
        the turn's alone afterwards)."""
        others = [t for t in self._on_conversation() if keep is None or t is not keep.task]
        if others:
            await asyncio.wait(others)

    async def close(self) -> None:
        """The call is over: stop everything, wait for it."""
        for p in (self.current,):
            if p is not None:
                self.discard("call_ended", p)
        self.current = None
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # ---------------------------------------------------------------- the work

    async def _run(self, p: Preemption, previous: list[asyncio.Task]) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        try:
            try:
                # Streaming STT transcribed this pause already (TurnPending.transcript): reuse
                # it, the same text the turn would get; else the STT on the whole audio, beside
                # the work still running on the conversation (a speech prefill's pass, a
                # discarded start's last one): only the LLM waits for that.
                text = await asyncio.shield(p.pause.transcript) if p.pause.transcript is not None else None
                if text is None:
                    text = await loop.run_in_executor(self.executor, self.stt.transcribe, p.pause.audio)
            except Exception:
                log.exception("preemptive STT failed")
                return
            p.text = (text or "").strip()
            p.transcript.set_result(p.text)
            if self.on_transcript is not None:
                self.on_transcript(len(p.pause.audio), p.text)
            if not p.text:
                self.discard("empty_transcript", p)  # noise: no LLM start
                return
            t_stt = time.monotonic()
            if previous:
                await asyncio.wait(previous)  # one piece of work at a time on the conversation
            t_free = time.monotonic()
            if p.stop.is_set():
                return
            messages = await loop.run_in_executor(self.executor, self.messages_for, p.text)
            if p.stop.is_set():
                return
            if not self.needs_llm(messages, p.text):
                self.discard("no_llm", p)  # "Hi, my name is Robert.": the turn greets back, no model
                return
            sent, p.params = await loop.run_in_executor(self.executor, self.first_round, messages, p.text)
            if p.stop.is_set():
                return
            self._ask_words_end(p, messages)
            p.messages, p.sent = messages, sent
            p.prompt.set_result(messages)
            self.llm_starts += 1
            # Where the start's time went (the report's llm_start): its STT, the wait for the
            # work still on the conversation, and the prompt and plan built after it.
            self._note(p, "llm_start", stt_s=round(t_stt - t0, 3), waited_s=round(t_free - t_stt, 3),
                       prompt_s=round(time.monotonic() - t_free, 3))
            async with contextlib.aclosing(self.backend.stream(sent, p.params, p.stop)) as stream:
                async for group in stream:
                    p.groups.append(group)
                    p.changed.set()
                    if self.on_group is not None and not p.stop.is_set():
                        self.on_group(p, group)
        except asyncio.CancelledError:
            pass  # close(): the call ended
        except Exception as exc:  # a failing model: the turn will not keep this generation
            log.warning("preemptive generation failed: %r", exc)
            p.error = exc
        finally:
            for fut in (p.transcript, p.prompt):
                if not fut.done():
                    fut.set_result(None)
            p.finished = True
            p.changed.set()

    def _ask_words_end(self, p: Preemption, messages: list[dict]) -> None:
        """Have the start's own prefill score how likely the pause's words end the caller's
        message (llm.types.WordsEnd: the logits after the words without their final mark,
        one more row of the vocabulary head, no pass of its own); `on_ending` is told, and
        the turn-taker waits on a low one. Not when the words already leave the sentence
        open ("... for next", which waits anyway), nor on a backend that cannot. `messages`
        are the start's (messages_for(p.text)): the same ones with the caller's last
        message cut to the words."""
        words = without_end_mark(p.text)
        if (self.on_ending is None or not getattr(self.backend, "scores_words_end", False) or not words
                or open_ending(p.text) or not messages or messages[-1].get("role") != "user"):
            return
        loop = asyncio.get_running_loop()
        messages = [*messages[:-1], {**messages[-1], "content": words}]

        def scored(probability: float) -> None:  # on the loop
            if not p.stop.is_set() and self.on_ending is not None:
                self._note(p, "words_end", probability=round(probability, 5))
                self.on_ending(len(p.pause.audio), probability)

        p.stop.words_end = WordsEnd(messages, lambda probability: loop.call_soon_threadsafe(scored, probability))

    def _note(self, p: Preemption, event: str, **data: Any) -> None:
        p.log.append({"event": event, "t": time.monotonic(), **data})
        if (event_type := _EVENTS.get(event)) is not None:  # llm_start is the report's only
            self.emit(event_type(**data))


class SpeechPrefill:
    """The listen stage's tap (pipeline/stages/listen.py UtteranceTap) that prefills a
    caller's words while they speak: every `interval_s` of new speech in the pending turn,
    `Preemptor.prefill` on the turn's audio so far; never while the agent is `answering`
    (the LLM is the caller's then). A prefill skipped because other work ran is tried again
    at the next frame."""

    def __init__(self, preemptor: Preemptor, pending: Any, interval_s: float = 0.8,
                 answering: Callable[[], bool] = lambda: False):
        self.preemptor, self.pending, self.answering = preemptor, pending, answering
        self.interval = int(interval_s * 16000)
        self._done = 0  # samples of the pending turn the last prefill heard

    def heard(self, endpointer: Any, t: float) -> None:
        if not endpointer.in_speech:
            return
        total = self.pending.pending_samples + endpointer.voiced_samples
        if total < self._done:
            self._done = 0  # a new turn
        if total - self._done < self.interval or self.answering():
            return
        audio = np.concatenate([self.pending.pending_audio(), endpointer.voiced_audio()])
        if self.preemptor.prefill(audio):
            self._done = total

    def piece_ended(self, ended: Any) -> None:
        pass


class PreemptedBackend:
    """The call's backend for one turn whose first generation is already running (or
    done): the first `stream` on the preemption's messages replays its token groups, then
    follows the live ones; any other stream (a tool round) goes to the call's backend."""

    def __init__(self, backend: LLMBackend, preemption: Preemption):
        self.backend, self.preemption = backend, preemption
        self._handed = False

    @property
    def last_stats(self) -> GenerationStats | None:
        # Before the hand-over the preemption's stats must not look like the previous
        # generation's (the respond stage counts a round by its stats object changing).
        return self.backend.last_stats if self._handed else None

    # The tools, and the calls a server parsed after a stream, are the call's backend's:
    # nothing else ran on it since the kept generation (settled before the turn generates).
    @property
    def tools(self) -> list[dict] | None:
        return self.backend.tools

    @property
    def prefills(self) -> bool:
        return self.backend.prefills

    @property
    def last_tool_parse(self) -> ToolCallParse | None:
        return self.backend.last_tool_parse

    async def aclose(self) -> None:
        pass  # the call closes its own backend

    async def stream(self, messages: list[dict], params: SamplingParams, cancel: Any = None) -> AsyncIterator[TokenGroup]:
        p = self.preemption
        if self._handed or messages != p.sent or params != p.params:
            async with contextlib.aclosing(self.backend.stream(messages, params, cancel)) as stream:
                async for group in stream:
                    yield group
            return
        self._handed = True
        async with contextlib.aclosing(replay(p, cancel)) as groups:
            async for group in groups:
                yield group


async def replay(p: Preemption, cancel: Any = None) -> AsyncIterator[TokenGroup]:
    """The preemption's token groups, buffered ones first. A group produced before the
    turn adopted it is stamped with the adoption time: the caller could not have had it
    earlier, and TTFT stays a wait the caller saw. The turn's cancel (barge-in) now also
    stops the generation; leaving early stops it and waits until it has stopped."""
    if cancel is not None:
        p.stop.link(cancel)
    adopted_t = time.monotonic()
    i = 0
    try:
        while True:
            if i < len(p.groups):
                group = p.groups[i]
                i += 1
                yield dataclasses.replace(group, timestamp=max(group.timestamp, adopted_t))
                if group.finish_reason:
                    return
            elif p.finished:
                if p.error is not None:
                    raise p.error
                return
            else:
                p.changed.clear()
                await p.changed.wait()
    finally:
        if not p.finished:
            p.stop.set()
        if p.task is not None and not p.task.done():
            # Also cancelled: a backend waiting on something else than its next pass (a
            # stalled server) must not hold up a hang-up; the relay still waits for the
            # engine's current pass, so nothing outlives this.
            p.task.cancel()
            await asyncio.wait({p.task})
