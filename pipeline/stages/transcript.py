"""Transcript stage: which transcript an ended caller turn gets, cheapest source first.

    1. the preemptive generation's (stages/preempt.py): the same audio was transcribed
       while the caller paused; the same greedy Whisper output, so it is reused;
    2. the last pause's (TurnEnd.transcript, streaming STT beside the end-of-turn model):
       made from exactly this turn's audio;
    3. the live stream's (stages/live_stt.py): streamed while the caller spoke, only the
       unconfirmed tail is left to transcribe;
    4. batch STT on the whole utterance (a worker thread).

The preemption and the live transcriber are claimed for the turn when its end is decided
(`claim`, in the call's input task), before the next turn's audio can reach them; the
turn runner asks for the text later (`transcribe`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from llm.types import SamplingParams
from pipeline.config import Config
from pipeline.events import CallEvent, TurnEnd, TurnPending
from pipeline.receptionist.business import FALLBACK
from pipeline.receptionist.caller import own_reply
from pipeline.ports import LLMBackend, SpeechToText, TextToSpeech
from pipeline.sentences import SentenceSplitter
from pipeline.stages.live_stt import LiveTranscript, TurnTranscript
from pipeline.stages.listen import UtteranceTap
from pipeline.stages.preempt import PreemptedBackend, Preemptor, SpeechPrefill, TurnPreemption
from pipeline.stages.speak_ahead import PrimedSpeech, speak_ahead
from pipeline.stages.turn_taking import TurnTaker
from voice.streaming_stt import StreamingTranscriber
from voice.stt import WhisperSTT

log = logging.getLogger(__name__)

__all__ = ["Transcript", "TranscriptSources"]


@dataclass
class Transcript:
    """One caller turn's text and what the sources did for it (for the report)."""

    text: str | None  # None: STT failed (see error)
    error: str | None = None
    preemption: TurnPreemption | None = None
    live: TurnTranscript | None = None

    @property
    def stt_stream(self) -> dict | None:
        """The streaming STT's record of the turn, None when it did not run."""
        return None if self.live is None else self.live.report


class TranscriptSources:
    """The call's transcript sources (see the module docstring)."""

    def __init__(self, stt: SpeechToText, executor: Executor, preemptor: Preemptor | None = None,
                 live: LiveTranscript | None = None, prefill: SpeechPrefill | None = None,
                 speech: PrimedSpeech | None = None):
        self.stt, self.executor, self.preemptor, self.live = stt, executor, preemptor, live
        self.prefill = prefill
        self.speech = speech  # the TTS with sentences made ahead (speak_ahead), or None
        self._claims: dict[int, tuple[TurnPreemption | None, TurnTranscript | None]] = {}  # id(TurnEnd) ->

    @classmethod
    def for_call(cls, config: Config, stt: SpeechToText, backend: LLMBackend, params: SamplingParams,
                 messages: Callable[[str], list[dict]], turns: TurnTaker, executor: Executor,
                 emit: Callable[[CallEvent], None], *, answering: Callable[[], bool],
                 new_transcriber: Callable[[], StreamingTranscriber] | None = None,
                 first_round: Callable[[list[dict], str], tuple[list[dict], SamplingParams]] | None = None,
                 tts: TextToSpeech | None = None) -> "TranscriptSources":
        """A call's sources as its config asks. Preemption (turn.preempts) when the turn-taker
        has pauses to wait on: an end-of-turn model's, or silence mode's own (end_silence_s);
        `first_round` says what the turn's first generation sends (Preemptor); with `tts`
        and turn.speak_ahead, `speech` is the TTS to speak through (the preemptive answer's
        first sentence made ahead, stages/speak_ahead.py). Streaming STT
        (stt.streaming): its passes wait while the agent is `answering` (the LLM needs the
        cores then)."""
        preemptor = live = prefill = speech = None
        if config.turn.preempts and (turns.model is not None or turns.end_silence_s is not None):
            turns.announce_pauses = True
            preemptor = Preemptor(stt, backend, params, messages, executor=executor, emit=emit,
                                  first_round=first_round,
                                  needs_llm=(lambda messages, text: own_reply(text, messages) is None)
                                  if config.agent.greet_back else None)
            if turns.model is None:
                preemptor.on_transcript = turns.heard  # "... for next" waits (silence mode)
                if turns.words_end_threshold > 0 or turns.words_done_silence_s is not None:
                    # ... and so does "Do you accept?"; "What is your address?" ends sooner.
                    preemptor.on_ending = turns.words_ended
            if tts is not None and config.turn.speak_ahead:
                hold_line = config.tools.hold_line if config.tools.enabled else ""
                fallback = (config.business.fallback or FALLBACK) if config.agent.guard else ""
                speech = PrimedSpeech(tts, executor, fixed=(hold_line, fallback),
                                      voice_first=getattr(backend, "voice_first", None))
                cfg = config.pipeline
                preemptor.on_group = speak_ahead(speech, lambda: SentenceSplitter(cfg.first_clause,
                                                                                  cfg.first_clause_min_words))
            if config.turn.speech_prefill_ms > 0 and getattr(backend, "prefill", None) is not None:
                prefill = SpeechPrefill(preemptor, turns, config.turn.speech_prefill_ms / 1000, answering)
        if config.stt.streaming:
            if new_transcriber is None:
                if not isinstance(stt, WhisperSTT):  # the streaming passes need its word timestamps
                    raise ValueError("stt.streaming needs the faster-whisper STT (voice.stt.WhisperSTT); "
                                     "set stt.streaming = false or pass new_transcriber")
                whisper, interval_s = stt, config.stt.stream_interval_ms / 1000
                new_transcriber = lambda: StreamingTranscriber(whisper, interval_s=interval_s)  # noqa: E731
            live = LiveTranscript(new_transcriber, executor=executor, emit=emit, paused=answering)
            if turns.model is not None:
                # Each pause is transcribed beside Smart Turn: a "complete" ending on a dangling
                # word waits, and a turn ending there already has its transcript.
                turns.transcribe_pause = live.transcribe_pause
        return cls(stt, executor, preemptor, live, prefill, speech)

    @property
    def tap(self) -> UtteranceTap | None:
        """What sees the caller's audio as the endpointer keeps it (listen's tap): the live
        stream, the speech prefill, or both."""
        taps = [t for t in (self.live, self.prefill) if t is not None]
        return taps[0] if len(taps) == 1 else (_Taps(taps) if taps else None)

    @property
    def busy(self) -> bool:
        """Preemptive work (a transcription, an answer) is running."""
        return self.preemptor is not None and self.preemptor.busy

    def paused(self, pending: TurnPending) -> None:
        """The caller paused and the turn-taker waits: transcribe and start the answer now."""
        if self.preemptor is not None:
            self.preemptor.start(pending)

    def turn_over(self) -> None:
        """The agent's turn is over, the caller's next one not begun: with speech prefill on,
        the history is prefilled up to the caller's next words (Preemptor.prefill_next)."""
        if self.prefill is not None:
            self.prefill.preemptor.prefill_next()

    def resumed(self) -> None:
        """The caller spoke again: the turn goes on with other audio."""
        if self.preemptor is not None:
            self.preemptor.discard("caller_resumed")

    def claim(self, end: TurnEnd) -> None:
        preemption = self.preemptor.claim(end) if self.preemptor is not None else None
        live = self.live.claim(end) if self.live is not None else None
        self._claims[id(end)] = (preemption, live)

    async def transcribe(self, end: TurnEnd) -> Transcript:
        preemption, live = self._claims.pop(id(end), (None, None))
        out = Transcript(None, preemption=preemption, live=live)
        text = await self.preemptor.transcript(preemption) if self.preemptor is not None else None
        pause_text = await asyncio.shield(end.transcript) if end.transcript is not None else None
        text = text if text is not None else pause_text
        if live is not None:
            if text is not None:
                used = pause_text is not None and text.strip() == pause_text.strip()
                live.drop("transcribed at the last pause" if used else "preemptive transcript", used=used)
            else:
                try:
                    text = await live.finish()
                except Exception:
                    log.exception("streaming STT failed; transcribing the whole utterance")
                    live.report = {"used": False, "why": "finish failed"}
        if text is None:
            try:
                loop = asyncio.get_running_loop()
                text = await loop.run_in_executor(self.executor, self.stt.transcribe, end.utterance.audio)
            except Exception as exc:
                log.exception("STT failed")
                out.error = f"stt: {type(exc).__name__}: {exc}"
                return out
        out.text = text or ""
        return out

    async def adopt(self, heard: Transcript, text: str, messages: list[dict]) -> LLMBackend | None:
        """The backend the turn's answer reads: a kept preemptive generation (started on
        exactly this text and these messages; any other is stopped here), or None."""
        if self.preemptor is None:
            return None
        return await self.preemptor.adopt(heard.preemption, text, messages)

    def taken_back(self, heard: Transcript | None) -> None:
        """The turn was taken back (stages/take_back.py): a preemptive generation it claimed
        and did not keep stops now, not after a whole answer nobody will hear."""
        claim = heard.preemption if heard is not None else None
        if self.preemptor is not None and claim is not None and claim.preemption is not None:
            self.preemptor.discard("taken_back", claim.preemption)

    async def make_way(self, backend: LLMBackend | None) -> None:
        """A turn is about to generate: one generation at a time on the conversation, so a
        preemption it did not keep (a keypad turn came first, say) is stopped and waited for."""
        if self.preemptor is not None:
            kept = backend.preemption if isinstance(backend, PreemptedBackend) else None
            self.preemptor.make_way(kept)
            await self.preemptor.settle(kept)

    async def close(self) -> None:
        """The call is over: preemptive work and the live stream stopped and waited for."""
        if self.preemptor is not None:
            await self.preemptor.close()
        if self.live is not None:
            await self.live.close()


class _Taps:
    """Several taps as one (pipeline/stages/listen.py UtteranceTap)."""

    def __init__(self, taps: list[UtteranceTap]):
        self.taps = taps

    def heard(self, endpointer, t: float) -> None:
        for tap in self.taps:
            tap.heard(endpointer, t)

    def piece_ended(self, ended) -> None:
        for tap in self.taps:
            tap.piece_ended(ended)
