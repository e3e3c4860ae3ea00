"""One call: the stages of pipeline/stages connected, turn by turn, over typed ports.

    call = Call(config, source, sink, stt=..., tts=..., backend=..., endpointer=...)
    call = Call.from_models(config, models, source, sink)     # the same, from loaded AgentModels
    report = await call.run()                                 # until the caller is gone; report written

Data flow of one caller frame, in the order the code runs:

    source (AudioSource) -> stages.listen (endpointer) -> SpeechEnded -> utterance queue
    -> turn runner: STT (worker thread) -> history -> stages.respond (LLM groups -> sentences)
    -> sentence queue -> stages.speak (TTS -> sink.play, a mark per sentence) -> sink (AudioSink)
    -> turn recorded: history (as heard), report, MQTT, callbacks

Everything runs on one asyncio loop; Whisper, the LLM and Piper run in worker threads, so
the loop only moves audio, decides endpoints (Silero, ~0.2 ms a chunk) and stamps
timelines. The call's own jobs are the input task (endpointer events: utterances to the
turn runner, a barge-in to the turn in progress), the turn runner (one turn at a time,
each built from its stages' results: a turn's state has one owner), recording and the
call's lifecycle.

Barge-in (caller speech declared while the agent is responding, config.pipeline.barge_in)
is one event, `Turn.barge_in`: the speaker clears the sink at once (telephony: `clear`)
and plays nothing more, the LLM stops between target passes (the event is its cancel),
and history keeps only the sentences whose audio fully played (the confirmed marks). A
partly played sentence is left out: we cannot tell which of its words were heard, and the
model repeating something is better than it believing it said something never heard.
Without barge-in (half-duplex), speech during the agent's answer is queued and answered
after it.

Preemptive generation (config.turn.preemptive, smart_turn mode only; stages/preempt.py):
while a pause leaves the caller's turn open and no turn is running, the pending audio is
transcribed and the LLM started on the messages that turn would send, into a buffer. A
turn that then ends on the same audio reuses the transcript and, if its messages are the
same, reads that generation (kept: token-identical); speech in between, or anything
else, cancels and drops it. Nothing is played before the turn has ended.

Keys the caller presses (a phone's DTMF, as KeyPress from the source) are gathered by
stages.listen.Keypad into one entry ("[keypad] 1", ended by '#' or a pause of
config.pipeline.keypad_timeout_ms) that joins the same queue as utterances and is answered
as a normal turn without STT; its report entry has "input": "dtmf". Keys do not barge in:
a caller pressing 1 while the agent still lists the options is answered after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Protocol

from llm.types import SamplingParams
from pipeline.agent import chars_token_count, sampling_params, turn_taker
from pipeline.receptionist.prompt import system_prompt
from pipeline.config import Config
from pipeline.receptionist.guard import FactGuard, turn_guard
from pipeline.mqtt import MqttPublisher
from pipeline.events import KeyPress, KeypadEntry, TurnEnd, TurnPending
from pipeline.ports import AudioSink, AudioSource, LLMBackend, SpeechToText, TextToSpeech, ToolRunner
from pipeline.report import CallReport, write_report
from pipeline.sentences import SentenceSplitter
from pipeline.stages.listen import Keypad, listen
from pipeline.stages.live_stt import LiveTranscript, TurnTranscript
from pipeline.stages.preempt import PreemptedBackend, Preemptor, TurnPreemption
from pipeline.stages.respond import respond
from pipeline.stages.speak import speak
from pipeline.stages.turn_taking import TurnTaker
from pipeline.timeline import TurnTimeline
from pipeline.turn import History, LLMResult, Turn
from voice.endpointer import Endpointer, SpeechStarted
from voice.streaming_stt import StreamingTranscriber

log = logging.getLogger(__name__)

__all__ = ["Call", "History", "ModelSet", "Turn", "voice_executor"]

# Call events also published to MQTT as they happen (<prefix>/calls/<id>/events): the
# end-of-turn decision, the preemptive generation's start / kept / discarded, and the
# streaming STT's interim, stable and pause transcripts.
MQTT_EVENTS = frozenset({"end_of_turn", "preemptive_start", "preemptive_kept", "preemptive_discarded",
                         "transcript_interim", "transcript_stable", "transcript_pause"})

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


class ModelSet(Protocol):
    """What `Call.from_models` takes: pipeline.agent.AgentModels, or a test's stand-in."""

    stt: SpeechToText
    tts: TextToSpeech

    def new_backend(self, config: Config | None = None) -> LLMBackend: ...

    def new_endpointer(self) -> Endpointer: ...

    def count_tokens(self, messages: list[dict]) -> int: ...

    def new_turn_taker(self, executor: Executor | None = None) -> TurnTaker: ...


class Call:
    """A conversation between one caller (an AudioSource) and the agent (to an AudioSink)."""

    def __init__(
        self,
        config: Config,
        source: AudioSource,
        sink: AudioSink,
        *,
        stt: SpeechToText,
        tts: TextToSpeech,
        backend: LLMBackend,
        endpointer: Endpointer,
        turns: TurnTaker | None = None,
        count_tokens: Callable[[list[dict]], int] = chars_token_count,
        call_id: str | None = None,
        mqtt: MqttPublisher | None | Literal["config"] = "config",
        report_dir: str | Path | None = None,
        greeting: str = "",
        on_turn: Callable[[dict], None] | None = None,
        on_event: Callable[[str, dict], None] | None = None,
        executor: Executor | None = None,
        toolbox: ToolRunner | None = None,
        new_transcriber: Callable[[], StreamingTranscriber] | None = None,
    ):
        self.config = config
        self.source, self.sink = source, sink
        self.stt, self.tts, self.backend, self.endpointer = stt, tts, backend, endpointer
        self.call_id = call_id or new_call_id()
        self.history = History(system_prompt(config), config.agent.history_tokens, count_tokens)
        self.params: SamplingParams = sampling_params(config)
        self.mqtt: MqttPublisher | None = (MqttPublisher.from_config(config.mqtt) if mqtt == "config" else mqtt)
        self.report_dir = Path(report_dir if report_dir is not None else config.report.dir)
        self.greeting = greeting
        self.on_turn = on_turn
        self.on_event = on_event
        self.executor = executor or voice_executor()
        # The model may call tools (pipeline.receptionist.tools.ToolBox; the backend renders the schemas).
        self.toolbox = toolbox
        # The fact guard ([agent] guard): every sentence of the model's checked against the
        # business's facts and the turn's tool results before TTS (pipeline/receptionist/guard.py).
        self.guard = FactGuard(config.business) if config.agent.guard else None
        # Silence endpointing unless a turn-taker with an end-of-turn model is given.
        self.turn_taker = turns if turns is not None else turn_taker(config, None, self.executor)

        self.report: CallReport | None = None
        self.report_path: Path | None = None
        self.turns: list[Turn] = []
        self.skipped_utterances = 0  # STT heard nothing: no LLM call
        self.barge_ins = 0
        self.errors: list[str] = []
        self.llm_calls = 0
        # A tool ended the call ("transfer" / "end_call", and why): set after that turn was spoken.
        self.ended_by: tuple[str, str | None] | None = None
        self._utterances: asyncio.Queue[TurnEnd | KeypadEntry | None] = asyncio.Queue()
        self._keypad = Keypad(self._utterances.put_nowait, config.pipeline.keypad_timeout_ms / 1000)
        self._responding: Turn | None = None  # the turn the agent is answering in (barge-in target)
        self._turn_task: asyncio.Task | None = None
        self._turn_done = asyncio.Event()
        self._mark_names = (f"s{i}" for i in itertools.count(1))
        # Preemptive answers while the caller pauses: only with an end-of-turn model (silence
        # endpointing ends the turn at every pause, there is nothing to wait on).
        self.preemptor: Preemptor | None = None
        self._preempted: dict[int, TurnPreemption] = {}  # id(TurnEnd) -> what preemption did in that turn
        if config.turn.preemptive and self.turn_taker.model is not None:
            self.preemptor = Preemptor(stt, backend, self.params, self.history.messages, executor=self.executor,
                                       emit=self._emit)
            self.turn_taker.announce_pauses = True
        # Streaming STT (config.stt.streaming): the turn is transcribed while the caller
        # speaks; passes wait while the agent answers (the LLM needs the cores then).
        self.live: LiveTranscript | None = None
        self._live_claims: dict[int, TurnTranscript] = {}  # id(TurnEnd) -> its streamed transcript
        if config.stt.streaming:
            if new_transcriber is None:
                if getattr(stt, "model", None) is None:
                    raise ValueError("stt.streaming needs the faster-whisper STT (voice.stt.WhisperSTT); "
                                     "set stt.streaming = false or pass new_transcriber")
                interval_s = config.stt.stream_interval_ms / 1000
                new_transcriber = lambda: StreamingTranscriber(stt, interval_s=interval_s)  # noqa: E731
            self.live = LiveTranscript(new_transcriber, executor=self.executor, emit=self._emit,
                                       paused=lambda: self._responding is not None)
            if self.turn_taker.model is not None:
                # Each pause is transcribed beside Smart Turn: a "complete" ending on a dangling
                # word waits, and a turn ending there already has its transcript.
                self.turn_taker.transcribe_pause = self.live.transcribe_pause

    @classmethod
    def from_models(
        cls, config: Config, models: ModelSet, source: AudioSource, sink: AudioSink, *,
        greeting: bool | str = False, **overrides: Any,
    ) -> "Call":
        """A call whose stages come from loaded models; `overrides` swap any of them
        (stt=, tts=, backend=, endpointer=, count_tokens=) or set Call's options."""
        ports: dict[str, Any] = {"stt": models.stt, "tts": models.tts, "count_tokens": models.count_tokens}
        if "backend" not in overrides:
            ports["backend"] = models.new_backend(config)
        if "endpointer" not in overrides:
            ports["endpointer"] = models.new_endpointer()
        if "turns" not in overrides:
            ports["turns"] = models.new_turn_taker(overrides.get("executor"))
        call_id = overrides.pop("call_id", None) or new_call_id()
        new_toolbox = getattr(models, "new_toolbox", None)  # a test's stand-in may have no tools
        if "toolbox" not in overrides and new_toolbox is not None:
            ports["toolbox"] = new_toolbox(call_id)
        text = config.agent.greeting if greeting is True else (greeting or "")
        return cls(config, source, sink, greeting=text, call_id=call_id, **{**ports, **overrides})

    # ------------------------------------------------------------ public helpers

    @property
    def idle(self) -> bool:
        """No turn running or waiting, and the caller is not mid-utterance."""
        return (self._turn_task is None and self._utterances.empty() and not self.endpointer.in_speech
                and not self.turn_taker.pending and not self._keypad.pending
                and (self.preemptor is None or not self.preemptor.busy))

    async def wait_turns(self, n: int, timeout: float | None = None) -> bool:
        """Wait until `n` turns have been recorded (True) or `timeout` passed (False)."""
        async def waiter() -> None:
            while len(self.turns) < n:
                self._turn_done.clear()
                await self._turn_done.wait()
        try:
            await asyncio.wait_for(waiter(), timeout)
            return True
        except TimeoutError:
            return False

    def _emit(self, kind: str, **data: Any) -> None:
        if self.mqtt is not None and kind in MQTT_EVENTS:
            # Live, as it happens (the turn's message comes only once the turn is over); t is
            # seconds since the call start, like the report's timelines.
            t = None if self.report is None else round(time.monotonic() - self.report.t0, 6)
            self.mqtt.publish_event(self.call_id, kind, {"t": t, **data})
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
        if self.mqtt is not None:
            self.mqtt.start()  # connect while the caller speaks, not at the end of the first turn
        end_reason, error = "completed", None
        input_task = asyncio.create_task(self._input(), name=f"{self.call_id}-input")
        turns_task = asyncio.create_task(self._turn_runner(), name=f"{self.call_id}-turns")
        try:
            await asyncio.wait({input_task, turns_task}, return_when=asyncio.FIRST_COMPLETED)
            if turns_task.done():
                turns_task.result()  # it ends early by failing, or when a tool ended the call
            if self.ended_by is not None:
                end_reason = self.ended_by[0]  # the transport acts on the event ("transfer", "end_call")
            else:
                input_task.result()
                if self.source.hangup:
                    end_reason = self.source.end_reason or "caller_hangup"
                    if self._turn_task is not None:
                        self._turn_task.cancel()
                self._utterances.put_nowait(None)  # answer what was said (unless hung up), then end
                await turns_task
                if self.ended_by is not None:
                    end_reason = self.ended_by[0]
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
            if self.preemptor is not None:
                await self.preemptor.close()  # a hang-up mid-preemption: stopped before the backend closes
            if self.live is not None:
                await self.live.close()
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
        with contextlib.suppress(BaseException):
            await self.sink.aclose()
        # Free the LLM conversation (the KV cache, ~10 MB a call for SmolLM2, more for the
        # default pair) now, not when the Call is dropped: a server keeps recent Calls listed.
        with contextlib.suppress(BaseException):
            await self.backend.aclose()

    # ------------------------------------------------------------ input: utterances and barge-in

    async def _input(self) -> None:
        try:
            async for event in listen(self.source, self.endpointer, self.turn_taker, self.live):
                if isinstance(event, SpeechStarted):
                    self._emit("speech_started", t=event.declared_t)
                    if self.preemptor is not None:
                        self.preemptor.discard("caller_resumed")  # the turn goes on: other audio
                    turn = self._responding
                    if turn is not None and self.config.pipeline.barge_in and not turn.barge_in.fired:
                        turn.barge_in.fire(event.declared_t)
                        self.barge_ins += 1
                        self._emit("barge_in", turn=turn.index, heard=turn.heard_text)
                elif isinstance(event, TurnEnd):
                    u = event.utterance  # delay: the turn's eot_delay (last voiced -> decided)
                    self._emit("end_of_turn", reason=event.reason, probability=event.probability,
                               delay=round(u.declared_t - u.last_voiced_t, 6), pauses=event.pauses)
                    if self.preemptor is not None and (claim := self.preemptor.claim(event)) is not None:
                        self._preempted[id(event)] = claim
                    if self.live is not None:
                        self._live_claims[id(event)] = self.live.claim(event)
                    self._utterances.put_nowait(event)
                elif isinstance(event, TurnPending):
                    # Start only while no turn runs or waits: its answer would change the
                    # history (and use the conversation) under the preemptive generation.
                    if self.preemptor is not None and self._turn_task is None and self._utterances.empty():
                        self.preemptor.start(event)
                elif isinstance(event, KeyPress):
                    self._emit("key", digit=event.digit)
                    self._keypad.press(event)  # an entry reaches the queue when complete
            if not self.source.hangup:
                self._keypad.flush()  # the script ended: keys still waiting are answered
        finally:
            self._keypad.close()  # before run() ends the queue: no entry may come after it

    # ------------------------------------------------------------ the turn runner

    async def _turn_runner(self) -> None:
        if self.greeting:
            await self._one_at_a_time(self._greet(self.greeting))
        while (utterance := await self._utterances.get()) is not None:
            if isinstance(utterance, KeypadEntry):
                await self._one_at_a_time(self._keypad_turn(utterance))
            else:
                await self._one_at_a_time(self._turn(utterance))
            if self.ended_by is not None:
                return  # a tool transferred or ended the call, after its turn was spoken

    async def _one_at_a_time(self, coro: Any) -> None:
        """Run one turn as its own task (so a hang-up can cancel it without touching us)."""
        task = asyncio.create_task(coro)
        self._turn_task = task
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():  # we are being cancelled ourselves
                task.cancel()
                await _settle(task)
            self._turn_task = None
        if not task.cancelled() and task.exception() is not None:
            log.error("turn failed: %r", task.exception())

    async def _greet(self, text: str) -> None:
        turn = Turn(index=-1, timeline=TurnTimeline(index=-1), greeting=True, llm=LLMResult(text, [text]))
        sentences: asyncio.Queue = asyncio.Queue()
        sentences.put_nowait(text)
        sentences.put_nowait(None)
        self._responding = turn
        try:
            await speak(self.tts, self.sink, sentences, turn.timeline, turn.barge_in, self._mark_names, turn.speech,
                        self.executor, self._turn_emitter(turn))
        finally:
            self._responding = None
        if turn.heard:
            self.history.add_agent(turn.heard_text)

    async def _turn(self, end: TurnEnd) -> None:
        utterance = end.utterance
        tl = TurnTimeline(index=len(self.turns))
        tl.mark("speech_start", utterance.start_t)
        tl.mark("last_voiced", utterance.last_voiced_t)
        tl.mark("end_of_speech", utterance.declared_t)
        turn = Turn(index=len(self.turns), timeline=tl, end_of_turn=end)
        loop = asyncio.get_running_loop()
        claim = self._preempted.pop(id(end), None)
        preemptor = self.preemptor
        # The same audio was transcribed while the caller paused: the same greedy Whisper
        # output, so it is reused (None: no preemption, or its STT failed).
        text = await preemptor.transcript(claim) if preemptor is not None else None
        # Made at the turn's last pause from the streamed audio, which is this turn's audio
        # (a preemption started at that pause used the same one).
        pause_text = await asyncio.shield(end.transcript) if end.transcript is not None else None
        text = text if text is not None else pause_text
        live = self._live_claims.pop(id(end), None)
        if live is not None:
            if text is not None:
                used = pause_text is not None and text.strip() == pause_text.strip()
                live.drop("transcribed at the last pause" if used else "preemptive transcript", used=used)
            else:
                # Streamed while the caller spoke: only the unconfirmed tail is left.
                try:
                    text = await live.finish()
                except Exception:
                    log.exception("call %s: streaming STT failed; transcribing the whole utterance", self.call_id)
                    live.report = {"used": False, "why": "finish failed"}
        if text is None:
            try:
                text = await loop.run_in_executor(self.executor, self.stt.transcribe, utterance.audio)
            except Exception as exc:
                log.exception("call %s: STT failed", self.call_id)
                turn.error = f"stt: {type(exc).__name__}: {exc}"
                self._record(turn, preemption=claim, live=live)
                return
        tl.mark("transcript")
        text = (text or "").strip()
        if not text:
            # Silence or noise Whisper could not read: no turn, no LLM call.
            self.skipped_utterances += 1
            self._emit("skipped", audio_s=len(utterance.audio) / 16000,
                       **({"stt_stream": live.report} if live is not None else {}))
            return
        turn.user_text = text
        self._emit("transcript", turn=turn.index, text=text)
        self._responding = turn
        try:
            messages = await loop.run_in_executor(self.executor, self.history.messages, text)
            backend = None
            if preemptor is not None:
                # Kept only if it was started on exactly these messages; else it is stopped here.
                backend = await preemptor.adopt(claim, text, messages)
            await self._answer(turn, messages, backend)
        finally:
            self._responding = None
            self._record(turn, preemption=claim, live=live)

    async def _keypad_turn(self, entry: KeypadEntry) -> None:
        """Keys the caller pressed, answered like words: no STT, the rest is a normal turn.
        The timeline starts at the first key and has no last_voiced (nothing was voiced), so
        the turn stays out of voice-to-voice figures instead of counting the keypad pause."""
        tl = TurnTimeline(index=len(self.turns))
        tl.mark("speech_start", entry.first_t)
        tl.mark("end_of_speech", entry.ended_t)
        tl.mark("transcript", entry.ended_t)
        turn = Turn(index=len(self.turns), timeline=tl, user_text=entry.text)
        self._emit("keypad", turn=turn.index, text=entry.text, ended_by=entry.ended_by)
        self._responding = turn
        try:
            await self._answer(turn)
        finally:
            self._responding = None
            self._record(turn, keypad=entry)

    async def _answer(self, turn: Turn, messages: list[dict] | None = None, backend: LLMBackend | None = None) -> None:
        """The LLM stage and the speaker stage, side by side, joined by a sentence queue.
        `backend`: the call's, or a PreemptedBackend reading a kept preemptive generation."""
        loop = asyncio.get_running_loop()
        if messages is None:
            messages = await loop.run_in_executor(self.executor, self.history.messages, turn.user_text)
        if self.preemptor is not None:
            # One generation at a time on the conversation: a preemption this turn did not
            # keep (a keypad turn came first, say) is stopped and waited for.
            kept = backend.preemption if isinstance(backend, PreemptedBackend) else None
            self.preemptor.make_way(kept)
            await self.preemptor.settle(kept)
        cfg = self.config.pipeline
        sentences: asyncio.Queue = asyncio.Queue()
        emit = self._turn_emitter(turn)
        self.llm_calls += 1
        # Each stage fills its own part of the turn as it goes, so a hang-up mid-answer
        # still leaves what was said and heard for the report.
        speaker = asyncio.create_task(
            speak(self.tts, self.sink, sentences, turn.timeline, turn.barge_in, self._mark_names, turn.speech,
                  self.executor, emit),
            name=f"{self.call_id}-speak-{turn.index}")
        try:
            await respond(backend or self.backend, messages, self.params,
                          SentenceSplitter(cfg.first_clause, cfg.first_clause_min_words),
                          sentences, turn.timeline, turn.barge_in, turn.llm, emit, self.toolbox,
                          self.config.tools.hold_line,
                          turn_guard(self.guard, turn.user_text, turn.llm, self.toolbox,
                                     [user for user, _ in self.history.exchanges if user]),
                          self.config.tools.plan, turn.user_text)
            await speaker
        finally:
            if not speaker.done():
                speaker.cancel()
            await _settle(speaker)
        turn.error = turn.llm.error or turn.speech.error

    def _turn_emitter(self, turn: Turn) -> Callable[..., None]:
        return lambda kind, **data: self._emit(kind, turn=turn.index, **data)

    # ------------------------------------------------------------ recording

    def _record(self, turn: Turn, keypad: KeypadEntry | None = None, preemption: TurnPreemption | None = None,
                live: TurnTranscript | None = None) -> None:
        """A finished turn: history gets what the caller heard; report, MQTT, callbacks."""
        assert self.report is not None
        if turn.user_text:
            self.history.add(turn.user_text, turn.heard_text, turn.llm.tool_messages)
        entry = self.report.add_turn(
            turn.timeline, turn.user_text, turn.agent_text, turn.heard_text, turn.interrupted, llm=turn.stats,
            tool_calls=turn.llm.tool_calls,
            preemption=None if preemption is None else {"hit": preemption.hit, "starts": preemption.starts,
                                                        "events": preemption.log},
        )
        entry["finish_reason"] = turn.finish_reason
        if keypad is not None:
            entry["input"] = "dtmf"
            entry["keypad"] = {"digits": keypad.digits, "ended_by": keypad.ended_by}
        if turn.llm.fallback:
            entry["tool_fallback"] = True
        if turn.llm.hold_line_t is not None:
            entry["hold_line"] = True  # the first sentence was the hold line, not the model's
        if turn.llm.guarded:
            entry["guarded"] = list(turn.llm.guarded)  # sentences the fact guard did not let through
        if turn.llm.plan is not None:
            entry["plan"] = turn.llm.plan
        if turn.llm.action is not None:
            entry["action"] = {"action": turn.llm.action, "reason": turn.llm.action_reason}
            self.ended_by = (turn.llm.action, turn.llm.action_reason)
            self._emit(turn.llm.action, turn=turn.index, reason=turn.llm.action_reason)
        if live is not None:
            # Event times as the timeline's: seconds since the call start (frame clock = monotonic).
            entry["stt_stream"] = {**live.report, "events": [
                {**e, "at": round(e["at"] - self.report.t0, 6)} for e in live.report.get("events", ())]}
        if turn.end_of_turn is not None:
            e = turn.end_of_turn
            entry["end_of_turn"] = {"reason": e.reason, "probability": e.probability, "pauses": e.pauses}
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
        self._turn_done.set()


def new_call_id() -> str:
    return f"call-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


async def _settle(*tasks: asyncio.Task | asyncio.Future | None) -> None:
    """Await tasks that were cancelled or finished, swallowing their outcome."""
    live = [t for t in tasks if t is not None]
    if live:
        await asyncio.gather(*live, return_exceptions=True)
