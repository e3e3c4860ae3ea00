"""Speaker stage: sentences -> TTS -> the paced output, a mark after each sentence.

Each sentence is synthesised as it arrives (the LLM keeps writing meanwhile) and its
chunks are queued on the sink; the first chunk's going out is `first_audio_out`. Until
the reply's first chunk exists the LLM's next pass waits (`reply.voice_first`,
llm/voice_first.py): the caller is in silence until then, and Piper beside a decoding
model took up to twice as long. After each sentence a mark: once it is confirmed (the
audio before it has played) the sentence counts as heard. A peer that never confirms
marks must not hang the call: each mark gets the audio's length plus slack.

On a barge-in this stage clears the output first (what the caller hears), stops TTS, and
plays nothing more; the sink resolves every unconfirmed mark as not heard, so the
history keeps only the sentences whose audio fully played.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Executor

from pipeline.events import SentenceHeard
from pipeline.playout import wait_confirmed
from pipeline.ports import AudioSink, TextToSpeech
from pipeline.timeline import TurnTimeline
from pipeline.turn import BargeIn, Reply, SpeechResult
from voice.tts import synthesize_async

log = logging.getLogger(__name__)

__all__ = ["speak", "MARK_SLACK_S"]

MARK_SLACK_S = 10.0  # beyond the audio's own length, how long a mark may take to come back


async def speak(tts: TextToSpeech, sink: AudioSink, reply: Reply, mark_names: Iterator[str],
                executor: Executor | None = None) -> SpeechResult:
    """Speak each sentence of `reply.sentences` as it comes; fills `reply.speech` (heard,
    audio_s, error) as it goes."""
    sentences, timeline, barge_in, result = reply.sentences, reply.timeline, reply.barge_in, reply.speech
    marks: asyncio.Queue = asyncio.Queue()
    clearer = asyncio.create_task(_clear_on_barge_in(sink, timeline, barge_in))
    confirmer = asyncio.create_task(_confirm_marks(marks, reply))
    started = time.monotonic()

    def stamp_out(went_out: asyncio.Future) -> None:
        if not went_out.cancelled() and went_out.result() is not None:
            timeline.mark("first_audio_out", went_out.result())

    try:
        while (sentence := await sentences.get()) is not None:
            if barge_in.fired:
                continue  # drain what the LLM stage still hands over; play nothing
            timeline.mark("tts_request")
            # The caller hears nothing yet: the model's next pass waits for this first chunk.
            hold = reply.voice_first.hold() if reply.voice_first is not None and not result.audio_s else None
            try:
                async with contextlib.aclosing(synthesize_async(tts, sentence, executor)) as chunks:
                    async for chunk in chunks:
                        if hold is not None:
                            hold.release()
                        if barge_in.fired:
                            break
                        timeline.mark("tts_first_audio")
                        sink.play(chunk).add_done_callback(stamp_out)
                        result.audio_s += chunk.duration
            except Exception as exc:  # a sentence TTS cannot say: skip it, keep the turn going
                log.exception("TTS failed on %r", sentence[:60])
                result.error = f"tts: {type(exc).__name__}: {exc}"
                continue
            finally:
                if hold is not None:
                    hold.release()
            if barge_in.fired:
                continue
            marks.put_nowait((sink.mark(next(mark_names)), sentence, started + result.audio_s))
        marks.put_nowait(None)
        await confirmer  # the marks of what was played: heard or not
    finally:
        for task in (clearer, confirmer):
            task.cancel()
        await asyncio.gather(clearer, confirmer, return_exceptions=True)
    return result


async def _clear_on_barge_in(sink: AudioSink, timeline: TurnTimeline, barge_in: BargeIn) -> None:
    await barge_in.event.wait()
    await sink.clear()
    timeline.mark("barge_in")


async def _confirm_marks(marks: asyncio.Queue, reply: Reply) -> None:
    result, timeline, barge_in = reply.speech, reply.timeline, reply.barge_in
    last = None
    while (item := await marks.get()) is not None:
        confirmed, sentence, audio_until = item
        timeout = max(0.0, audio_until - time.monotonic()) + MARK_SLACK_S
        if await wait_confirmed(confirmed, timeout) and not barge_in.fired:
            result.heard.append(sentence)
            last = time.monotonic()
            reply.emit(SentenceHeard(reply.turn, sentence))
    if last is not None and "first_audio_out" in timeline:
        timeline.mark("playback_done", max(last, timeline.events["first_audio_out"]))
