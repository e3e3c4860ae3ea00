"""One call: audio in -> endpointer -> STT -> LLM (token groups) -> sentences -> TTS -> audio out.

    call = Call(config, models, source, sink)        # models: pipeline.agent.AgentModels
    report = await call.run()                        # until the caller is gone; report written

Everything runs on one asyncio loop; Whisper, the LLM and Piper run in worker threads,
so the loop only moves audio, decides endpoints (Silero, ~0.2 ms a chunk) and stamps
timelines. Small pieces, one job each:

- `History`: the conversation, trimmed to a token budget (oldest exchanges dropped first).
- the input task: source frames -> endpointer; SpeechEnded -> utterance queue;
  SpeechStarted while the agent responds -> barge-in.
- the turn task (one at a time): STT, then `_respond`: the LLM stream feeds a
  SentenceSplitter; each sentence goes to the speaker task the moment it is complete,
  while the LLM keeps generating.
- the speaker task: TTS per sentence, chunks to the sink as they come, a sink mark
  after each sentence; the mark tracker moves a sentence into "heard" once the sink
  confirms it has played.

Barge-in (caller speech declared while the agent is responding, config.pipeline.barge_in):
the sink is cleared at once (telephony: `clear`), the LLM's cancel event is set (it
stops between target passes), the turn task is cancelled, and history keeps only the
sentences whose audio fully played (the confirmed marks). A partly played sentence is
left out: we cannot tell which of its words were heard, and the model repeating
something is better than it believing it said something the caller never heard.

Without barge-in (half-duplex), speech during the agent's answer is queued and answered
after it.

Timeline events (pipeline.timeline.EVENTS) are stamped by the stage that causes them;
every metric comes from `compute_metrics` on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm.types import GenerationStats, SamplingParams
from pipeline.config import Config
from pipeline.mqtt import MqttPublisher
from pipeline.report import CallReport, write_report
from pipeline.sentences import SentenceSplitter
from pipeline.timeline import TurnTimeline
from voice.endpointer import SpeechEnded, SpeechStarted
from voice.tts import synthesize_async

log = logging.getLogger(__name__)

__all__ = ["Call", "History", "Turn", "tts_stream", "voice_executor"]

_DEFAULT = object()
_DONE = object()
_voice_pool: ThreadPoolExecutor | None = None
_voice_pool_lock = threading.Lock()


def voice_executor() -> ThreadPoolExecutor:
    """Threads for STT and TTS, apart from the default executor where LLM workers wait
    their turn on the engine lock: with several calls, a speech synthesis must never
    queue behind another call's LLM."""
    global _voice_pool
    with _voice_pool_lock:
        if _voice_pool is None:
            _voice_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="specvoice-voice")
        return _voice_pool


# ---------------------------------------------------------------- history


@dataclass
class History:
    """System prompt + (user, agent-as-heard) exchanges, within a token budget.

    `count_tokens(messages)` is the LLM's own count (chat template included); the budget
    covers everything after the system prompt. The newest user message is always kept;
    whole exchanges are dropped oldest first so roles keep alternating.
    """

    system_prompt: str
    budget_tokens: int
    count_tokens: Callable[[list[dict]], int]
    exchanges: list[tuple[str, str]] = field(default_factory=list)
    dropped: int = 0

    def add(self, user_text: str, agent_text: str) -> None:
        self.exchanges.append((user_text, agent_text))

    def add_agent(self, agent_text: str) -> None:
        """An agent line with no user line before it (the greeting)."""
        self.exchanges.append(("", agent_text))

    @staticmethod
    def _messages(exchanges: list[tuple[str, str]]) -> list[dict]:
        out = []
        for user, agent in exchanges:
            if user:
                out.append({"role": "user", "content": user})
            if agent:
                out.append({"role": "assistant", "content": agent})
        return out

    def messages(self, user_text: str) -> list[dict]:
        """The prompt for a new user message, trimming old exchanges to fit the budget."""
        system = [{"role": "system", "content": self.system_prompt}]
        base = self.count_tokens(system)
        user = [{"role": "user", "content": user_text}]
        while self.exchanges:
            msgs = system + self._messages(self.exchanges) + user
            if self.count_tokens(msgs) - base <= self.budget_tokens:
                return msgs
            self.exchanges.pop(0)
            self.dropped += 1
        return system + user


# ---------------------------------------------------------------- turn state


@dataclass
class Turn:
    index: int
    timeline: TurnTimeline
    user_text: str = ""
    agent_text: str = ""
    sentences: list[str] = field(default_factory=list)  # handed to TTS
    heard: list[str] = field(default_factory=list)  # confirmed played (marks)
    interrupted: bool = False
    greeting: bool = False
    error: str | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    groups: int = 0
    audio_s: float = 0.0  # agent audio handed to the sink
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    barge_in_declared_t: float | None = None  # endpointer's decision time of the barge-in
    llm_passes_at_barge_in: int | None = None
    _stats_before: Any = None
    _frozen: bool = False  # heard is final (barge-in)

    @property
    def heard_text(self) -> str:
        return " ".join(self.heard)

    @property
    def llm_passes_after_barge_in(self) -> int | None:
        if self.llm_passes_at_barge_in is None or self.stats is None:
            return None
        return self.stats.passes - self.llm_passes_at_barge_in


# TTS in a worker thread of the call's executor; closing it waits for the chunk in progress.
tts_stream = synthesize_async


# ---------------------------------------------------------------- the call


class Call:
    """A conversation between one caller (an AudioSource) and the agent (to an AudioSink).

    Components come from `models` (pipeline.agent.AgentModels) unless given one by one
    (tests swap any stage): `backend` (LLM), `stt` (has `transcribe(audio)`), `tts` (has
    `synthesize(text)`), `endpointer`, `count_tokens`.
    """

    def __init__(
        self,
        config: Config,
        models: Any = None,
        source: Any = None,
        sink: Any = None,
        *,
        call_id: str | None = None,
        backend: Any = None,
        stt: Any = None,
        tts: Any = None,
        endpointer: Any = None,
        count_tokens: Callable[[list[dict]], int] | None = None,
        mqtt: Any = _DEFAULT,
        report_dir: str | Path | None = None,
        greeting: bool | str = False,
        on_turn: Callable[[dict], None] | None = None,
        on_event: Callable[[str, dict], None] | None = None,
        executor: Executor | None = None,
    ):
        self.config = config
        self.models = models
        self.source, self.sink = source, sink
        self.call_id = call_id or f"call-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.backend = backend if backend is not None else models.new_backend(config)
        self.stt = stt if stt is not None else models.stt
        self.tts = tts if tts is not None else models.tts
        self.endpointer = endpointer if endpointer is not None else models.new_endpointer()
        counter = count_tokens or (models.count_tokens if models is not None else None)
        if counter is None:
            from pipeline.agent import chars_token_count

            counter = chars_token_count
        self.history = History(config.agent.system_prompt, config.agent.history_tokens, counter)
        from pipeline.agent import sampling_params

        self.params: SamplingParams = sampling_params(config)
        self._mqtt_arg = mqtt
        self.mqtt: MqttPublisher | None = None
        self.report_dir = Path(report_dir if report_dir is not None else config.report.dir)
        self.greeting = config.agent.greeting if greeting is True else (greeting or "")
        self.on_turn = on_turn
        self.on_event = on_event
        self.executor = executor or voice_executor()

        self.report: CallReport | None = None
        self.report_path: Path | None = None
        self.turns: list[Turn] = []
        self.skipped_utterances = 0  # STT heard nothing: no LLM call
        self.barge_ins = 0
        self.errors: list[str] = []
        self.llm_calls = 0
        self._utterances: asyncio.Queue = asyncio.Queue()
        self._active: Turn | None = None  # the turn the agent is responding in
        self._audio_turn: Turn | None = None  # the turn whose audio the sink is playing
        self._turn_task: asyncio.Task | None = None
        self._turn_done: asyncio.Event | None = None
        self._marks = 0
        self._busy = False

    # ------------------------------------------------------------ public helpers

    @property
    def idle(self) -> bool:
        """No turn running or waiting, and the caller is not mid-utterance."""
        return not self._busy and self._utterances.empty() and not self.endpointer.in_speech

    async def wait_turns(self, n: int, timeout: float | None = None) -> bool:
        """Wait until `n` turns have been recorded (True) or `timeout` passed (False)."""
        async def waiter() -> None:
            while len(self.turns) < n:
                assert self._turn_done is not None
                self._turn_done.clear()
                await self._turn_done.wait()
        while self._turn_done is None:
            await asyncio.sleep(0.01)
        try:
            await asyncio.wait_for(waiter(), timeout)
            return True
        except TimeoutError:
            return False

    def _emit(self, kind: str, **data: Any) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, data)
            except Exception:  # a display callback must not break the call
                log.exception("on_event callback failed")

    # ------------------------------------------------------------ run

    async def run(self) -> CallReport:
        """Run until the source ends. Always writes the report and stops everything it
        started, whatever happens (error, cancellation, hang-up)."""
        self.report = CallReport.from_config(self.call_id, self.config)
        self.mqtt = MqttPublisher.from_config(self.config.mqtt) if self._mqtt_arg is _DEFAULT else self._mqtt_arg
        if self.mqtt is not None:
            self.mqtt.start()  # connect while the caller speaks, not at the end of the first turn
        self._turn_done = asyncio.Event()
        if self.sink is not None:
            self.sink.on_audio_out = self._on_audio_out
        end_reason, error = "completed", None
        input_task = asyncio.create_task(self._input_loop(), name=f"{self.call_id}-input")
        turns_task = asyncio.create_task(self._turn_loop(), name=f"{self.call_id}-turns")
        try:
            await asyncio.wait({input_task, turns_task}, return_when=asyncio.FIRST_COMPLETED)
            if turns_task.done():
                turns_task.result()  # it only ends early by failing
            input_task.result()
            if getattr(self.source, "hangup", False):
                end_reason = getattr(self.source, "end_reason", None) or "caller_hangup"
                if self._turn_task is not None:
                    self._turn_task.cancel()
                self._utterances.put_nowait(None)
            else:
                self._utterances.put_nowait(None)  # answer what was said, then end
            await turns_task
        except asyncio.CancelledError:
            end_reason = "cancelled"
            raise
        except Exception as exc:
            log.exception("call %s failed", self.call_id)
            end_reason, error = "error", exc
        finally:
            for task in (input_task, turns_task, self._turn_task):
                if task is not None and not task.done():
                    task.cancel()
            await _settle(input_task, turns_task, self._turn_task)
            if error is None and self.errors:
                error = "; ".join(self.errors)
            await self._close(end_reason, error)
        return self.report

    async def _close(self, end_reason: str, error: Any) -> None:
        assert self.report is not None
        self.report.finish(end_reason, error)
        try:
            self.report_path = write_report(self.report, self.report_dir)
            log.info("call %s: report written to %s", self.call_id, self.report_path)
        except Exception:
            log.exception("call %s: cannot write the report", self.call_id)
        if self.mqtt is not None:
            summary = self.report.to_dict()["summary"]
            self.mqtt.publish_summary(self.call_id, {"end_reason": self.report.end_reason,
                                                     "error": self.report.error, **summary})
            with contextlib.suppress(BaseException):
                await self.mqtt.aclose(timeout=2.0)
        if self.sink is not None:
            with contextlib.suppress(BaseException):
                await self.sink.aclose()
        close = getattr(self.backend, "aclose", None)
        if close is not None:
            with contextlib.suppress(BaseException):
                await close()

    # ------------------------------------------------------------ input: endpointing, barge-in

    async def _input_loop(self) -> None:
        async for frame in self.source:
            for event in self.endpointer.feed(frame.pcm, frame.t):
                await self._on_endpoint(event)
        if getattr(self.source, "hangup", False):
            return  # the caller is gone: nobody to answer a half-said utterance
        for event in self.endpointer.flush():
            await self._on_endpoint(event)

    async def _on_endpoint(self, event: Any) -> None:
        if isinstance(event, SpeechStarted):
            self._emit("speech_started", t=event.declared_t)
            turn = self._active
            if turn is not None and self.config.pipeline.barge_in and not turn._frozen:
                await self._barge_in(turn, event)
        elif isinstance(event, SpeechEnded):
            self._utterances.put_nowait(event)

    async def _barge_in(self, turn: Turn, event: SpeechStarted) -> None:
        """Stop talking now: clear the sink first (what the caller hears), then stop the LLM."""
        turn._frozen = True  # what was heard is decided now, before the clear resolves marks
        turn.interrupted = True
        turn.barge_in_declared_t = event.declared_t
        live = getattr(getattr(self.backend, "conversation", None), "last_stats", None)
        if live is not None and live is not turn._stats_before:
            turn.llm_passes_at_barge_in = live.passes
        elif turn.timeline.get("llm_request") is not None:
            turn.llm_passes_at_barge_in = 0
        turn.cancel.set()
        self.barge_ins += 1
        await self.sink.clear()
        turn.timeline.mark("barge_in")
        if self._turn_task is not None and not self._turn_task.done():
            self._turn_task.cancel()
        self._emit("barge_in", turn=turn.index, heard=turn.heard_text)

    def _on_audio_out(self, t: float) -> None:
        turn = self._audio_turn
        if turn is not None and "tts_first_audio" in turn.timeline and "first_audio_out" not in turn.timeline:
            turn.timeline.mark("first_audio_out", t)

    # ------------------------------------------------------------ turns

    async def _turn_loop(self) -> None:
        if self.greeting:
            await self._run_task(self._greet(self.greeting))
        while True:
            utterance = await self._utterances.get()
            if utterance is None:
                return
            await self._run_task(self._run_turn(utterance))

    async def _run_task(self, coro: Any) -> None:
        """Run one turn as its own task (so barge-in can cancel it without touching us)."""
        self._busy = True
        task = asyncio.create_task(coro)
        self._turn_task = task
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():  # we are being cancelled ourselves
                task.cancel()
                await _settle(task)
            self._turn_task = None
            self._busy = False
        if not task.cancelled() and task.exception() is not None:
            log.error("turn failed: %r", task.exception())

    async def _greet(self, text: str) -> None:
        turn = Turn(index=-1, timeline=TurnTimeline(index=-1), greeting=True, agent_text=text)
        self._active = turn
        try:
            queue: asyncio.Queue = asyncio.Queue()
            queue.put_nowait(text)
            queue.put_nowait(None)
            turn.sentences.append(text)
            await self._speak(turn, queue)
        finally:
            self._active = None
            if turn.heard:
                self.history.add_agent(turn.heard_text)

    async def _run_turn(self, utterance: SpeechEnded) -> None:
        tl = TurnTimeline(index=len(self.turns))
        tl.mark("speech_start", utterance.start_t)
        tl.mark("last_voiced", utterance.last_voiced_t)
        tl.mark("end_of_speech", utterance.declared_t)
        turn = Turn(index=len(self.turns), timeline=tl)
        loop = asyncio.get_running_loop()
        try:
            text = await loop.run_in_executor(self.executor, self.stt.transcribe, utterance.audio)
        except Exception as exc:
            log.exception("call %s: STT failed", self.call_id)
            turn.error = f"stt: {type(exc).__name__}: {exc}"
            self._record(turn)
            return
        tl.mark("transcript")
        text = (text or "").strip()
        if not text:
            # Silence or noise Whisper could not read: no turn, no LLM call.
            self.skipped_utterances += 1
            self._emit("skipped", audio_s=len(utterance.audio) / 16000)
            return
        turn.user_text = text
        self._emit("transcript", turn=turn.index, text=text)
        self._active = turn
        try:
            await self._respond(turn)
        finally:
            self._active = None
            self._record(turn)

    async def _respond(self, turn: Turn) -> None:
        tl = turn.timeline
        loop = asyncio.get_running_loop()
        messages = await loop.run_in_executor(self.executor, self.history.messages, turn.user_text)
        cfg = self.config.pipeline
        splitter = SentenceSplitter(cfg.first_clause, cfg.first_clause_min_words)
        sentences: asyncio.Queue = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(turn, sentences), name=f"{self.call_id}-speak-{turn.index}")
        turn._stats_before = getattr(getattr(self.backend, "conversation", None), "last_stats", None)
        try:
            tl.mark("llm_request")
            self.llm_calls += 1
            try:
                async with contextlib.aclosing(self.backend.stream(messages, self.params, turn.cancel)) as stream:
                    async for group in stream:
                        tl.mark("first_token", min(group.timestamp, time.monotonic()))
                        turn.groups += 1
                        if group.finish_reason:
                            turn.finish_reason = group.finish_reason
                        if group.text:
                            turn.agent_text += group.text
                            self._emit("llm_text", turn=turn.index, text=group.text)
                            for sentence in splitter.feed(group.text):
                                self._hand(turn, sentence, sentences)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # The model failed mid-answer: say what we have, record the error, go on.
                log.exception("call %s: LLM failed in turn %d", self.call_id, turn.index)
                turn.error = f"llm: {type(exc).__name__}: {exc}"
                turn.finish_reason = "error"
            finally:
                turn.stats = getattr(self.backend, "last_stats", None)
            for sentence in splitter.flush():
                self._hand(turn, sentence, sentences)
            tl.mark("llm_done")
            sentences.put_nowait(None)
            await speaker
        finally:
            if not speaker.done():
                speaker.cancel()
            await _settle(speaker)
            if "llm_request" in tl and "llm_done" not in tl and "first_token" in tl:
                tl.mark("llm_done")  # cancelled: the stream ended here

    def _hand(self, turn: Turn, sentence: str, queue: asyncio.Queue) -> None:
        turn.timeline.mark("first_sentence")
        turn.sentences.append(sentence)
        queue.put_nowait(sentence)
        self._emit("sentence", turn=turn.index, text=sentence)

    async def _speak(self, turn: Turn, sentences: asyncio.Queue) -> None:
        """TTS each sentence as it comes; audio to the sink; a mark after each sentence."""
        tl = turn.timeline
        played: asyncio.Queue = asyncio.Queue()
        tracker = asyncio.create_task(self._track_marks(turn, played))
        try:
            while (sentence := await sentences.get()) is not None:
                tl.mark("tts_request")
                async with contextlib.aclosing(tts_stream(self.tts, sentence, self.executor)) as chunks:
                    async for chunk in chunks:
                        tl.mark("tts_first_audio")
                        self._audio_turn = turn
                        turn.audio_s += chunk.duration
                        await self.sink.play(chunk)
                self._marks += 1
                name = f"s{self._marks}"
                await self.sink.mark(name)
                played.put_nowait((name, sentence, turn.audio_s))
            played.put_nowait(None)
            await tracker
        finally:
            if not tracker.done():
                tracker.cancel()
            await _settle(tracker)

    async def _track_marks(self, turn: Turn, played: asyncio.Queue) -> None:
        start = time.monotonic()
        last = None
        while (item := await played.get()) is not None:
            name, sentence, audio_until = item
            # The sink confirms a mark once the audio before it has played; a peer that never
            # echoes marks must not hang the call: allow the audio's length plus slack.
            timeout = max(0.0, start + audio_until - time.monotonic()) + 10.0
            ok = await self.sink.wait_mark(name, timeout)
            if ok and not turn._frozen:
                turn.heard.append(sentence)
                last = time.monotonic()
                self._emit("heard", turn=turn.index, text=sentence)
        if last is not None and "first_audio_out" in turn.timeline:
            turn.timeline.mark("playback_done", max(last, turn.timeline.events["first_audio_out"]))

    def _record(self, turn: Turn) -> None:
        """A finished turn: history gets what the caller heard; report, MQTT, callbacks."""
        assert self.report is not None
        heard = turn.heard_text
        if turn.user_text:
            self.history.add(turn.user_text, heard)
        entry = self.report.add_turn(
            turn.timeline, turn.user_text, turn.agent_text, heard, turn.interrupted,
            llm=turn.stats,
        )
        entry["finish_reason"] = turn.finish_reason
        if turn.error:
            entry["error"] = turn.error
            self.errors.append(f"turn {turn.index}: {turn.error}")
        self.turns.append(turn)
        if self.mqtt is not None:
            self.mqtt.publish_turn(self.call_id, entry)
        if self.on_turn is not None:
            try:
                self.on_turn(entry)
            except Exception:
                log.exception("on_turn callback failed")
        if self._turn_done is not None:
            self._turn_done.set()


async def _settle(*tasks: Any) -> None:
    """Await tasks that were cancelled or finished, swallowing their outcome."""
    live = [t for t in tasks if t is not None]
    if live:
        await asyncio.gather(*live, return_exceptions=True)
