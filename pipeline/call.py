"""One call: the stages of pipeline/stages connected, turn by turn, over typed ports.

    call = Call(config, source, sink, stt=..., tts=..., backend=..., endpointer=...)
    call = Call.from_models(config, models, source, sink)     # the same, from loaded AgentModels
    report = await call.run()                                 # until the caller is gone; report written

The input task hands each TurnEnd to the turn runner and a barge-in (or a take-back:
stages/take_back.py) to the turn in progress; the turn runner runs one turn at a time
(stages.transcript -> stages.respond and stages.speak side by side -> the turn recorded);
all it tells the world is a typed event on `Call.events`. The README walks a frame through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Literal

from pipeline.agent import (ModelSet, call_ports, chars_token_count, new_call_id, sampling_params, turn_taker,
                            voice_executor)
from pipeline.config import Config
from pipeline.events import (BargedIn, CallAction, CallEvents, EndOfTurn, KeypadEntry, KeypadTurn, KeyPress,
                             KeyPressed, SpeechStart, TranscriptReady, TurnEnd, TurnPending, TurnRecorded,
                             TurnTakenBack, UtteranceSkipped, event_callback, turn_callback)
from pipeline.mqtt import CallTelemetry, MqttPublisher
from pipeline.ports import AudioSink, AudioSource, LLMBackend, SpeechToText, TextToSpeech, ToolRunner
from pipeline.receptionist.guard import FactGuard, turn_guard
from pipeline.receptionist.prompt import system_prompt
from pipeline.report import CallReport, finish_report
from pipeline.sentences import SentenceSplitter
from pipeline.stages.listen import Keypad, listen
from pipeline.stages.plan_step import first_round
from pipeline.stages.respond import respond
from pipeline.stages.speak import speak
from pipeline.stages.take_back import take_back, takes_back
from pipeline.stages.transcript import Transcript, TranscriptSources
from pipeline.stages.turn_taking import TurnTaker
from pipeline.tasks import settle
from pipeline.timeline import TurnTimeline
from pipeline.turn import History, LLMResult, Reply, Turn
from voice.endpointer import Endpointer, SpeechStarted
from voice.streaming_stt import StreamingTranscriber

log = logging.getLogger(__name__)

__all__ = ["Call", "History", "ModelSet", "Turn", "new_call_id", "voice_executor"]


class Call:
    """A conversation between one caller (an AudioSource) and the agent (to an AudioSink)."""

    report: CallReport | None = None  # from run() on
    report_path: Path | None = None  # where run() wrote it
    ended_by: tuple[str, str | None] | None = None  # a tool ended the call: (action, why)
    _telemetry: CallTelemetry | None = None  # MQTT, when configured
    _responding: Turn | None = None  # the turn the agent is answering in (barge-in target)
    _caller_turn: Turn | None = None  # the voice turn being transcribed or answered (take-back target)
    _turn_task: asyncio.Task | None = None

    def __init__(
        self, config: Config, source: AudioSource, sink: AudioSink, *, stt: SpeechToText, tts: TextToSpeech,
        backend: LLMBackend, endpointer: Endpointer, turns: TurnTaker | None = None,
        count_tokens: Callable[[list[dict]], int] = chars_token_count, call_id: str | None = None,
        mqtt: MqttPublisher | None | Literal["config"] = "config", report_dir: str | Path | None = None,
        greeting: str = "", on_turn: Callable[[dict], None] | None = None,
        on_event: Callable[[str, dict], None] | None = None, executor: Executor | None = None,
        toolbox: ToolRunner | None = None, new_transcriber: Callable[[], StreamingTranscriber] | None = None,
    ):
        self.config, self.source, self.sink, self.greeting = config, source, sink, greeting
        self.stt, self.backend, self.endpointer, self.toolbox = stt, backend, endpointer, toolbox
        self.call_id = call_id or new_call_id()
        self.history = History(system_prompt(config), config.agent.history_tokens, count_tokens)
        self.params = sampling_params(config)
        self.mqtt = MqttPublisher.from_config(config.mqtt) if mqtt == "config" else mqtt
        self.report_dir = Path(report_dir if report_dir is not None else config.report.dir)
        self.executor = executor or voice_executor()
        # The fact guard ([agent] guard): each model sentence checked before TTS (receptionist/guard.py).
        self.guard = FactGuard(config.business) if config.agent.guard else None
        # Silence endpointing unless a turn-taker with an end-of-turn model is given.
        self.turn_taker = turns if turns is not None else turn_taker(config, None, self.executor)
        self.events = CallEvents()  # everything the call tells the world (pipeline/events.py)
        for observer in [turn_callback(f) for f in [on_turn] if f] + [event_callback(f) for f in [on_event] if f]:
            self.events.subscribe(observer)
        self.turns: list[Turn] = []
        self.skipped_utterances, self.barge_ins, self.llm_calls = 0, 0, 0  # skipped: STT heard nothing
        self.errors: list[str] = []
        self._utterances: asyncio.Queue[TurnEnd | KeypadEntry | None] = asyncio.Queue()
        self._keypad = Keypad(self._utterances.put_nowait, config.pipeline.keypad_timeout_ms / 1000)
        self._turn_done = asyncio.Event()
        self._mark_names = (f"s{i}" for i in itertools.count(1))
        # Preemptive answers while the caller pauses, streaming STT while they speak (config).
        self.transcripts = TranscriptSources.for_call(
            config, stt, backend, self.params, self.history.messages, self.turn_taker, self.executor,
            self.events.emit, answering=lambda: self._responding is not None, new_transcriber=new_transcriber,
            first_round=lambda messages, text: first_round(messages, text, self.toolbox, config.tools.plan,
                                                           self.backend.prefills, self.params), tts=tts)
        self.tts = self.transcripts.speech or tts  # with a preemptive answer's first sentence made ahead
        if self.transcripts.preemptor is not None:
            self.turn_taker.on_pause = self._paused  # the answer starts at the pause itself

    @classmethod
    def from_models(cls, config: Config, models: ModelSet, source: AudioSource, sink: AudioSink, *,
                    greeting: bool | str = False, **overrides: Any) -> "Call":
        """A call from loaded models; `overrides` swap stages (stt=, tts=, backend=, ...) or set Call's options."""
        call_id = overrides.pop("call_id", None) or new_call_id()
        text = config.agent.greeting if greeting is True else (greeting or "")
        return cls(config, source, sink, greeting=text, call_id=call_id, **call_ports(models, config, call_id, overrides))

    @property
    def idle(self) -> bool:
        """No turn running or waiting, and the caller is not mid-utterance."""
        return (self._turn_task is None and self._utterances.empty() and not self.endpointer.in_speech
                and not self.turn_taker.pending and not self._keypad.pending and not self.transcripts.busy)

    async def wait_turns(self, n: int, timeout: float | None = None) -> bool:
        """Wait until `n` turns have been recorded (True) or `timeout` passed (False)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while len(self.turns) < n:
                    self._turn_done.clear()
                    await self._turn_done.wait()
        return len(self.turns) >= n

    # ------------------------------------------------------------ run

    async def run(self) -> CallReport:
        """Run until the source ends. Always writes the report and stops everything it
        started, whatever happens (error, cancellation, hang-up)."""
        self.report = CallReport.from_config(self.call_id, self.config)
        if self.mqtt is not None:
            self.mqtt.start()  # connect while the caller speaks, not at the end of the first turn
            self._telemetry = CallTelemetry(self.mqtt, self.call_id, self.report.t0)
            self.events.subscribe(self._telemetry)
        end_reason, error = "completed", None
        input_task = asyncio.create_task(self._input(), name=f"{self.call_id}-input")
        turns_task = asyncio.create_task(self._turn_runner(), name=f"{self.call_id}-turns")
        try:
            end_reason = await self._until_over(input_task, turns_task)
        except asyncio.CancelledError:
            end_reason = "cancelled"
            raise
        except Exception as exc:
            log.exception("call %s failed", self.call_id)
            end_reason, error = "error", exc
        finally:
            tasks = (input_task, turns_task, self._turn_task)
            for task in tasks:
                if task is not None and not task.done():
                    task.cancel()
            await settle(*tasks)
            await self.transcripts.close()  # a hang-up mid-preemption: stopped before the backend closes
            await self._close(end_reason, error if error is not None or not self.errors else "; ".join(self.errors))
        return self.report

    async def _until_over(self, input_task: asyncio.Task, turns_task: asyncio.Task) -> str:
        """Why the call ended: the caller hung up, the script ended (what was said is
        answered first), or a tool ended it (the transport acts on "transfer", "end_call")."""
        await asyncio.wait({input_task, turns_task}, return_when=asyncio.FIRST_COMPLETED)
        if turns_task.done():
            turns_task.result()  # it ends early by failing, or when a tool ended the call
        if self.ended_by is not None:
            return self.ended_by[0]
        input_task.result()
        end_reason = "completed"
        if self.source.hangup:
            end_reason = self.source.end_reason or "caller_hangup"
            if self._turn_task is not None:
                self._turn_task.cancel()
        self._utterances.put_nowait(None)  # answer what was said (unless hung up), then end
        await turns_task
        return self.ended_by[0] if self.ended_by is not None else end_reason

    async def _close(self, end_reason: str, error: Any) -> None:
        assert self.report is not None
        self.report_path = finish_report(self.report, end_reason, error, self.report_dir)
        if self._telemetry is not None:
            await self._telemetry.close(self.report.end_reason, self.report.error, self.report.to_dict()["summary"])
        for closing in (self.sink.aclose, self.backend.aclose):
            # The backend's KV cache (~10 MB a call) freed now: a server keeps recent Calls listed.
            try:
                await closing()
            except BaseException:
                log.debug("call %s: closing failed", self.call_id, exc_info=True)

    # ------------------------------------------------------------ input: utterances and barge-in

    async def _input(self) -> None:
        try:
            async for event in listen(self.source, self.endpointer, self.turn_taker, self.transcripts.tap):
                if isinstance(event, SpeechStarted):
                    self._caller_spoke(event)
                elif isinstance(event, TurnEnd):
                    self.events.emit(EndOfTurn.of(event))
                    self.transcripts.claim(event)
                    self._utterances.put_nowait(event)
                elif isinstance(event, TurnPending):
                    self._paused(event)
                elif isinstance(event, KeyPress):
                    self.events.emit(KeyPressed(event.digit))
                    self._keypad.press(event)  # an entry reaches the queue when complete
            if not self.source.hangup:
                self._keypad.flush()  # the script ended: keys still waiting are answered
        finally:
            self._keypad.close()  # before run() ends the queue: no entry may come after it

    def _paused(self, pending: TurnPending) -> None:
        """The caller paused mid-turn: transcribe and start the answer now (preemptively).
        Only while no turn runs or waits: its answer would change the history (and use the
        conversation) under the preemptive generation."""
        if self._turn_task is None and self._utterances.empty():
            self.transcripts.paused(pending)

    def _caller_spoke(self, event: SpeechStarted) -> None:
        self.events.emit(SpeechStart(event.declared_t))
        self.transcripts.resumed()
        if (turn := self._caller_turn) is not None and takes_back(turn, event, self.config.turn.take_back_ms / 1000):
            return take_back(turn, event, self.turn_taker)  # the caller went on: their pause was no end
        turn = self._responding
        if turn is not None and self.config.pipeline.barge_in and not turn.barge_in.fired:
            turn.barge_in.fire(event.declared_t)
            self.barge_ins += 1
            self.events.emit(BargedIn(turn.index, turn.heard_text))

    # ------------------------------------------------------------ the turn runner

    async def _turn_runner(self) -> None:
        if self.greeting:
            await self._one_at_a_time(self._greet(self.greeting))
        if self.transcripts.speech is not None:  # the hold line and the fallback, before the caller speaks
            self.transcripts.speech.pin_fixed()
        self.transcripts.turn_over()  # after each turn too: the history so far, into the LLM's cache
        while (utterance := await self._utterances.get()) is not None:
            keys = isinstance(utterance, KeypadEntry)
            await self._one_at_a_time(self._keypad_turn(utterance) if keys else self._turn(utterance))
            if self.ended_by is not None:
                return  # a tool transferred or ended the call, after its turn was spoken
            self.transcripts.turn_over()

    async def _one_at_a_time(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run one turn as its own task (so a hang-up can cancel it without touching us)."""
        self._turn_task = task = asyncio.create_task(coro)
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():  # we are being cancelled ourselves
                task.cancel()
                await settle(task)
            self._turn_task = self._caller_turn = None
        if not task.cancelled() and task.exception() is not None:
            log.error("turn failed: %r", task.exception())

    async def _greet(self, text: str) -> None:
        turn = Turn(index=-1, timeline=TurnTimeline(index=-1), greeting=True, llm=LLMResult(text, [text]))
        reply = Reply.said(turn, text, emit=self.events.emit)
        self._responding = turn
        try:
            await speak(self.tts, self.sink, reply, self._mark_names, self.executor)
        finally:
            self._responding = None
        if turn.heard:
            self.history.add_agent(turn.heard_text)

    async def _turn(self, end: TurnEnd) -> None:
        u, index = end.utterance, len(self.turns)
        turn = Turn(index=index, timeline=TurnTimeline.of_utterance(index, u), end_of_turn=end)
        self._caller_turn = turn
        heard = await self.transcripts.transcribe(end)
        if heard.text is None or turn.taken_back_t is not None:
            turn.error, turn.user_text = heard.error, (heard.text or "").strip()
            return self._record(turn, heard)
        turn.timeline.mark("transcript")
        if not (text := heard.text.strip()):
            self.skipped_utterances += 1  # silence or noise STT could not read: no turn, no LLM call
            return self.events.emit(UtteranceSkipped(len(u.audio) / 16000, heard.stt_stream))
        turn.user_text = text
        self.events.emit(TranscriptReady(turn.index, text))
        try:
            await self._answer(turn, heard)
        finally:
            self._record(turn, heard)

    async def _keypad_turn(self, entry: KeypadEntry) -> None:
        """Keys the caller pressed, answered like words: no STT, the rest is a normal turn."""
        index = len(self.turns)
        turn = Turn(index=index, timeline=TurnTimeline.of_keypad(index, entry), user_text=entry.text)
        self.events.emit(KeypadTurn(turn.index, entry.text, entry.ended_by))
        try:
            await self._answer(turn)
        finally:
            self._record(turn, keypad=entry)

    async def _answer(self, turn: Turn, heard: Transcript | None = None) -> None:
        """The LLM stage and the speaker stage, side by side, joined by the reply's sentence
        queue; from a kept preemptive generation if `heard` has one started on exactly these messages."""
        self._responding = turn  # a barge-in's target from here on
        try:
            messages = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.history.messages, turn.user_text)
            backend = await self.transcripts.adopt(heard, turn.user_text, messages) if heard else None
            await self.transcripts.make_way(backend)  # no other generation on the conversation
            reply = self._reply(turn)
            self.llm_calls += 1
            # Each stage fills its own part of the turn as it goes: a hang-up mid-answer still
            # leaves what was said and heard for the report.
            speaker = asyncio.create_task(speak(self.tts, self.sink, reply, self._mark_names, self.executor),
                                          name=f"{self.call_id}-speak-{turn.index}")
            try:
                await respond(backend or self.backend, messages, reply)
                await speaker
            finally:
                speaker.cancel()  # no-op once it is done
                await settle(speaker)
            turn.error = turn.llm.error or turn.speech.error
        finally:
            self._responding = None

    def _reply(self, turn: Turn) -> Reply:
        cfg, tools = self.config.pipeline, self.config.tools
        guard = turn_guard(self.guard, turn.user_text, turn.llm, self.toolbox, self.history.exchanges)
        return Reply.of(turn, params=self.params, splitter=SentenceSplitter(cfg.first_clause, cfg.first_clause_min_words),
                        emit=self.events.emit, toolbox=self.toolbox, hold_line=tools.hold_line, guard=guard,
                        plan=tools.plan, caller_text=turn.user_text, greet_back=self.config.agent.greet_back,
                        voice_first=getattr(self.backend, "voice_first", None))

    def _record(self, turn: Turn, heard: Transcript | None = None, keypad: KeypadEntry | None = None) -> None:
        """A finished turn: history gets what the caller heard, the report its entry, observers a TurnRecorded."""
        assert self.report is not None
        self._caller_turn = None
        if turn.taken_back_t is not None:  # not answered: its audio begins the next turn
            self.transcripts.taken_back(heard)
            return self.events.emit(TurnTakenBack(self.report.add_taken_back(turn)))
        if turn.user_text:
            self.history.add(turn.user_text, turn.heard_text, turn.llm.tool_messages,
                             turn.llm.written_if_heard(turn.heard_text))
        preemption = heard.preemption.record() if heard is not None and heard.preemption is not None else None
        entry = self.report.add_call_turn(turn, keypad, preemption, heard.stt_stream if heard is not None else None)
        if turn.llm.action is not None:
            self.ended_by = (turn.llm.action, turn.llm.action_reason)
            self.events.emit(CallAction(turn.index, turn.llm.action, turn.llm.action_reason))
        if turn.error:
            self.errors.append(f"turn {turn.index}: {turn.error}")
        self.turns.append(turn)
        self.events.emit(TurnRecorded(entry))
        self._turn_done.set()

