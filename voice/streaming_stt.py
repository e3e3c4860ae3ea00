"""Streaming STT with a stable prefix: LocalAgreement-2 over re-transcriptions of a growing buffer.

While the caller is still speaking, the utterance buffer is transcribed again every
`interval_s` (faster-whisper, word timestamps). A word is *stable* (committed) once two
successive hypotheses agree on it: the longest common prefix of the two, after the text
already committed (the LocalAgreement-2 policy of ufal/whisper_streaming, Machacek et al.
2023). The rest of the latest hypothesis is the unconfirmed *tail*. Committed words are
never taken back, so the stable prefix only grows and downstream stages may act on it
(end-of-turn hints, early LLM prefill) before the caller stops.

When the utterance ends, only the audio after the last committed word is left to
transcribe (`finish`, from 1 s before that word's end, see there), with the committed text
as Whisper's prompt: after the endpoint, Whisper decodes the last few words, not the whole
utterance (its encoder still runs on a 30 s window: on short utterances the saving is the
decoding, not the encoding).

The policy (`LocalAgreement`) is pure: words in, commits out; it is tested on scripted
hypotheses. `StreamingTranscriber` adds the audio buffer, the schedule and a `Recognizer`
(`WhisperWords` wraps voice.stt.WhisperSTT); time is whatever clock the caller passes to
`feed`, so tests run on simulated time without sleeping.

Differences from ufal's HypothesisBuffer, on purpose:
- words are compared case-folded and without surrounding punctuation, so "Tuesday" and
  "Tuesday?" agree (the newer spelling is the one committed);
- the buffer is not trimmed at every completed segment: call utterances are short. It is
  trimmed at the last committed word only past `max_buffer_s`, keeping Whisper's input
  under its 30 s window.
"""

from __future__ import annotations

import asyncio
import copy
import re
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np

from voice.audio import STT_RATE, rms_dbfs, to_float32
from voice.errors import AudioFormatError

# ufal's constants: words starting this long before the last commit are old words again;
# an overlap of up to this many words between the commit and a new hypothesis is removed.
OVERLAP_S = 0.1
MAX_NGRAM = 5
NEAR_COMMIT_S = 1.0
# finish() starts this long before the last committed word's end (see StreamingTranscriber.finish).
FINISH_OVERLAP_S = 1.0


@dataclass(frozen=True)
class Word:
    """One recognised word, times in seconds from the start of the utterance."""

    start: float
    end: float
    text: str  # as Whisper wrote it, stripped ("Tuesday?")

    @property
    def key(self) -> str:
        return word_key(self.text)


def word_key(text: str) -> str:
    """What two hypotheses must share to agree on a word: case-folded, no surrounding punctuation."""
    return re.sub(r"^[^\w']+|[^\w']+$", "", text.casefold())


def join_words(words: Sequence[Word]) -> str:
    return " ".join(w.text for w in words if w.text)


class LocalAgreement:
    """LocalAgreement-2: commit the words two successive hypotheses agree on.

    `insert(hypothesis)` takes the latest hypothesis for the whole utterance (or for the
    audio from some point on: words before the last commit are ignored) and returns the
    words it commits. `finish(hypothesis)` takes the last hypothesis at the end of the
    utterance and commits all of it (nothing later can confirm or contradict it).
    """

    def __init__(self) -> None:
        self.committed: list[Word] = []
        self.tail: list[Word] = []  # the previous hypothesis, less what it committed
        self.last_end = 0.0  # end time of the last committed word

    @property
    def stable_text(self) -> str:
        return join_words(self.committed)

    @property
    def tail_text(self) -> str:
        return join_words(self.tail)

    @property
    def text(self) -> str:
        """The best current transcript: the stable prefix and the unconfirmed tail."""
        return join_words([*self.committed, *self.tail])

    def _new_words(self, hypothesis: Sequence[Word]) -> list[Word]:
        """The hypothesis after what is already committed (by time, then by an n-gram overlap)."""
        new = [w for w in hypothesis if w.key and w.start > self.last_end - OVERLAP_S]
        if new and self.committed and abs(new[0].start - self.last_end) < NEAR_COMMIT_S:
            # The new hypothesis may begin by repeating the last committed words: drop the
            # shortest such n-gram (1..5 words), as ufal does.
            for n in range(1, min(len(self.committed), len(new), MAX_NGRAM) + 1):
                if [w.key for w in self.committed[-n:]] == [w.key for w in new[:n]]:
                    del new[:n]
                    break
        return new

    def insert(self, hypothesis: Sequence[Word]) -> list[Word]:
        new = self._new_words(hypothesis)
        agreed = 0
        for old, fresh in zip(self.tail, new):
            if old.key != fresh.key:
                break
            agreed += 1
        commit = new[:agreed]
        self._commit(commit)
        self.tail = new[agreed:]
        return commit

    def finish(self, hypothesis: Sequence[Word]) -> list[Word]:
        commit = self._new_words(hypothesis)
        self._commit(commit)
        self.tail = []
        return commit

    def _commit(self, words: list[Word]) -> None:
        if words:
            self.committed.extend(words)
            self.last_end = max(self.last_end, words[-1].end)


# ---------------------------------------------------------------- recognizers


class Recognizer(Protocol):
    def words(self, audio: np.ndarray, prompt: str | None = None) -> list[Word]:
        """16 kHz mono float32 -> words with times from the start of `audio`."""
        ...


class WhisperWords:
    """faster-whisper word timestamps through a loaded voice.stt.WhisperSTT (same model,
    language, silence guards and vocabulary prompt as the whole-utterance path)."""

    def __init__(self, stt, beam_size: int = 1):
        self.stt = stt
        self.beam_size = beam_size

    def words(self, audio: np.ndarray, prompt: str | None = None) -> list[Word]:
        stt = self.stt
        if audio.size < STT_RATE // 10 or rms_dbfs(audio) < stt.silence_dbfs:
            return []
        from voice.stt import WhisperPrompt

        initial = " ".join(p for p in (stt.initial_prompt, prompt) if p) or None
        # Through the engine's window and guards: with window="audio" a pass costs what
        # its audio costs, not a 30 s window.
        segments, _cut = stt.segments(audio, self.beam_size, WhisperPrompt(initial, stt.hotwords),
                                      word_timestamps=True)
        out: list[Word] = []
        for seg in segments:
            if seg.no_speech_prob > stt.no_speech_threshold and seg.avg_logprob < stt.logprob_threshold:
                continue  # Whisper itself thinks this is not speech
            out.extend(Word(float(w.start), float(w.end), w.word.strip()) for w in seg.words or () if w.word.strip())
        return out


# ---------------------------------------------------------------- the stream


@dataclass(frozen=True)
class TranscriptEvent:
    """`stable`: words were committed; `text` is the whole stable prefix, `new` the words just
    committed. `interim`: the best current transcript changed; `text` is stable prefix +
    tail, `new` the tail. `start`/`end`: utterance time of `new`'s first and last word.
    `at`: the stream time passed to the `feed` that produced it."""

    kind: Literal["stable", "interim"]
    text: str
    new: str
    start: float
    end: float
    at: float


@dataclass
class FinishStats:
    tail_s: float = 0.0  # seconds of audio transcribed by finish()
    compute_s: float = 0.0  # its wall time
    utterance_s: float = 0.0
    passes: int = 0  # streaming passes before finish()
    stream_compute_s: float = 0.0
    events: list[TranscriptEvent] = field(default_factory=list)


class StreamingTranscriber:
    """One utterance at a time: `feed` audio as it arrives, `finish` at the end of the turn.

    `feed` transcribes the buffer when `interval_s` of stream time has passed since the
    last pass (and at least `min_audio_s` is buffered); it blocks for that pass (0.3-1 s
    with tiny.en on 2 busy cores, word timestamps included), so async code calls
    `feed_async`/`finish_async`: audio is added on the loop, passes run in an executor one
    at a time, and finish waits for a running pass. After `finish` the transcriber is empty
    and ready for the next utterance; `stats` describes the one just finished.
    """

    def __init__(self, stt=None, interval_s: float = 0.5, min_audio_s: float = 0.5,
                 max_buffer_s: float = 20.0, finish_overlap_s: float = FINISH_OVERLAP_S,
                 recognizer: Recognizer | None = None):
        if recognizer is None:
            if stt is None:
                raise ValueError("give a WhisperSTT or a recognizer")
            recognizer = WhisperWords(stt)
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.recognizer = recognizer
        self.interval_s = interval_s
        self.min_audio_s = min_audio_s
        self.max_buffer_s = max_buffer_s
        self.finish_overlap_s = finish_overlap_s
        self.stats = FinishStats()
        self.reset()

    def reset(self) -> None:
        """Drop the utterance in progress (a pass still running in a worker is ignored)."""
        self._generation = getattr(self, "_generation", 0) + 1
        self._lock = threading.Lock()  # a pass's commit vs another pass's (two may run: pass_now_async)
        self._inflight: asyncio.Future | None = None  # the running interval pass
        self._now: asyncio.Future | None = None  # the running pass_now_async pass
        self._now_samples = 0  # the samples that one hears
        self.agreement = LocalAgreement()
        self._chunks: list[np.ndarray] = []
        self._audio = np.zeros(0, np.float32)
        self._buffer_start = 0  # sample index the next pass starts from (moves only past max_buffer_s)
        self._last_pass_at: float | None = None
        self._first_at: float | None = None
        self._last_interim = ""
        self._passes = 0
        self._covered = 0  # samples of the buffer the last finished pass heard (all from the start)
        self._compute_s = 0.0
        self._events: list[TranscriptEvent] = []

    # -------------------------------------------------------------- state

    @property
    def audio_s(self) -> float:
        return self.samples / STT_RATE

    @property
    def stable_text(self) -> str:
        return self.agreement.stable_text

    @property
    def text(self) -> str:
        return self.agreement.text

    def snapshot(self) -> FinishStats:
        """The utterance's streaming so far (passes, their compute, events), not finishing it."""
        return FinishStats(utterance_s=self.audio_s, passes=self._passes, stream_compute_s=self._compute_s,
                           events=list(self._events))

    @property
    def samples(self) -> int:
        return self._audio.size + sum(c.size for c in self._chunks)

    @property
    def heard_all(self) -> bool:
        """The last finished pass heard every sample buffered: its hypothesis (stable words +
        tail) is the transcript of all of it, with no Whisper run left to do."""
        return self._passes > 0 and self._covered == self.samples

    def buffered_audio(self) -> np.ndarray:
        """All the audio of the utterance so far (16 kHz float32)."""
        return self._buffer()

    def _buffer(self) -> np.ndarray:
        if self._chunks:
            self._audio = np.concatenate([self._audio, *self._chunks])
            self._chunks = []
        return self._audio

    # -------------------------------------------------------------- stream

    def append(self, pcm16k: np.ndarray) -> None:
        """Add audio (16 kHz mono, float32 or int16) without transcribing."""
        pcm = np.asarray(pcm16k)
        if pcm.ndim != 1:
            raise AudioFormatError(f"streaming STT wants 1-D 16 kHz mono audio, got shape {pcm.shape}")
        if pcm.size:
            self._chunks.append(to_float32(pcm).copy())

    def _due(self, t: float | None) -> float | None:
        """The stream time now if a pass is due, else None."""
        now = self.audio_s if t is None else float(t)
        if self._first_at is None:
            self._first_at = now
        due_from = self._first_at if self._last_pass_at is None else self._last_pass_at
        if now - due_from < self.interval_s or self.audio_s < self.min_audio_s:
            return None
        return now

    def feed(self, pcm16k: np.ndarray, t: float | None = None) -> list[TranscriptEvent]:
        """Add audio (16 kHz mono, float32 or int16); `t` is the stream time now (seconds, any
        clock; default: seconds of audio fed so far). Returns the events of a pass, if one ran."""
        self.append(pcm16k)
        now = self._due(t)
        return [] if now is None else self._pass(self._buffer(), now, self._generation)

    def _pass(self, audio: np.ndarray, now: float, generation: int) -> list[TranscriptEvent]:
        with self._lock:
            if audio.size - self._buffer_start > self.max_buffer_s * STT_RATE and self.agreement.committed:
                # Keep Whisper's input short: restart the buffer at the last committed word.
                self._buffer_start = max(self._buffer_start, int(self.agreement.last_end * STT_RATE))
            start = self._buffer_start
            prompt = _prompt_before(self.agreement, start / STT_RATE)
        offset = start / STT_RATE
        started = time.perf_counter()
        words = self.recognizer.words(audio[start:], prompt)
        with self._lock:
            if generation != self._generation:
                return []  # reset while this pass ran: its utterance is gone
            self._compute_s += time.perf_counter() - started
            if audio.size <= self._covered:
                return []  # a pass that heard more finished first: this one is stale
            return self._commit(words, offset, audio.size, now)

    def _commit(self, words: list[Word], offset: float, samples: int, now: float) -> list[TranscriptEvent]:
        self._passes += 1
        self._covered = samples
        self._last_pass_at = now
        hypothesis = [Word(w.start + offset, w.end + offset, w.text) for w in words]
        committed = self.agreement.insert(hypothesis)
        events: list[TranscriptEvent] = []
        if committed:
            events.append(TranscriptEvent("stable", self.agreement.stable_text, join_words(committed),
                                          committed[0].start, committed[-1].end, now))
        if self.agreement.text != self._last_interim:
            self._last_interim = self.agreement.text
            tail = self.agreement.tail
            events.append(TranscriptEvent(
                "interim", self.agreement.text, self.agreement.tail_text,
                tail[0].start if tail else self.agreement.last_end,
                tail[-1].end if tail else self.agreement.last_end, now))
        self._events.extend(events)
        return events

    def finish(self) -> str:
        """The final transcript of the utterance: the stable prefix plus the audio after the
        last committed word, transcribed once with the stable text as prompt. Resets.

        The tail starts `finish_overlap_s` (1 s) before the last committed word's end, not at
        it: Whisper's word end times are off by 0.1-0.3 s, and a cut exactly there clips the
        next word ("comparatively" -> "a paratively") or leaves a sliver that Whisper fills
        with "Thank you." (LJ clips, tiny.en: final WER 0.16 with no overlap, 0.045 with
        0.5 s or 1 s, whole-utterance 0.068). The re-heard committed words are dropped by
        time and by the n-gram overlap check, as in every streaming pass; the prompt is the
        stable text before the cut. `finish_overlap_s=0` cuts exactly at the word's end."""
        return self._finish(self._buffer())

    def _finish(self, audio: np.ndarray) -> str:
        if self.heard_all:  # the last pass heard it all: its tail is the rest (no Whisper run)
            with self._lock:  # an interval pass may still be running: its result is stale
                self.agreement.finish(list(self.agreement.tail))
                text, tail_s, compute = self.agreement.stable_text, 0.0, 0.0
        else:
            text, tail_s, compute = self._transcribe_tail(self.agreement, audio, self._buffer_start)
        self.stats = FinishStats(tail_s=tail_s, compute_s=compute, utterance_s=audio.size / STT_RATE,
                                 passes=self._passes, stream_compute_s=self._compute_s, events=self._events)
        self.reset()
        return text

    def _transcribe_tail(self, agreement: LocalAgreement, audio: np.ndarray,
                         buffer_start: int) -> tuple[str, float, float]:
        """Finish `agreement` (mutated) on `audio`: (text, seconds of tail transcribed, compute s)."""
        cut_s = agreement.last_end - self.finish_overlap_s if agreement.committed else 0.0
        cut = min(audio.size, max(buffer_start, int(round(cut_s * STT_RATE))))
        started = time.perf_counter()
        prompt = _prompt_before(agreement, cut / STT_RATE)
        words = self.recognizer.words(audio[cut:], prompt)
        compute = time.perf_counter() - started
        offset = cut / STT_RATE
        agreement.finish([Word(w.start + offset, w.end + offset, w.text) for w in words])
        return agreement.stable_text, (audio.size - cut) / STT_RATE, compute

    # -------------------------------------------------------------- async

    async def feed_async(self, pcm16k: np.ndarray, t: float | None = None,
                         executor: Executor | None = None) -> list[TranscriptEvent]:
        """`feed` for the event loop: the audio is added at once; a due pass runs in `executor`
        on a snapshot of the buffer. While a pass runs, no other starts (the next due frame
        starts it), so passes never overlap and stretch out when the machine is slow."""
        self.append(pcm16k)
        if self._inflight is not None and not self._inflight.done():
            return []
        now = self._due(t)
        if now is None:
            return []
        loop = asyncio.get_running_loop()
        self._inflight = loop.run_in_executor(executor, self._pass, self._buffer(), now, self._generation)
        # Shielded: a cancelled caller leaves the pass to finish in its thread, still marked
        # in flight, rather than a second pass starting beside it.
        return await asyncio.shield(self._inflight)

    async def pass_now_async(self, t: float, executor: Executor | None = None) -> list[TranscriptEvent]:
        """A pass now, whatever the interval, even beside a running interval pass (that one
        heard less: it would only delay this one): the caller fell silent, and a pass on all
        the audio so far makes the end of the turn need no Whisper run (`heard_all`). Nothing
        when the last pass, or one running, heard every sample."""
        samples = self.samples
        running = self._now is not None and not self._now.done()
        if self.heard_all or not samples or (running and self._now_samples == samples):
            return []
        if running:
            await asyncio.wait([self._now])  # it heard less: one such pass at a time
            if self.heard_all or self.samples != samples:
                return []
        loop = asyncio.get_running_loop()
        self._now_samples = samples
        self._now = loop.run_in_executor(executor, self._pass, self._buffer(), float(t), self._generation)
        return await asyncio.shield(self._now)

    async def _settle(self) -> None:
        """Wait until the transcript of all the audio is known: the silence pass, if one
        running hears every sample (an interval pass beside it heard less: its result will be
        stale, not worth waiting for); else every running pass."""
        if self._now is not None and not self._now.done() and self._now_samples == self.samples:
            await asyncio.wait([self._now])
            if self.heard_all:
                return
        running = [f for f in (self._inflight, self._now) if f is not None and not f.done()]
        if running:
            await asyncio.wait(running)

    async def peek_async(self, executor: Executor | None = None) -> tuple[str, float, float]:
        """What `finish` would return now, without finishing: the utterance goes on (a pause
        that may or may not end the turn). Returns (text, tail seconds, compute seconds). Waits
        for a running pass; later passes do not touch the copy it works on."""
        await self._settle()
        if self.heard_all:
            with self._lock:
                return self.agreement.text, 0.0, 0.0
        # Copied on the loop, where passes are started: none can change it from here on.
        agreement, audio = copy.deepcopy(self.agreement), self._buffer()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, self._transcribe_tail, agreement, audio, self._buffer_start)

    async def finish_async(self, executor: Executor | None = None) -> str:
        """`finish` in `executor`, after any pass still running."""
        await self._settle()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, self._finish, self._buffer())


def _prompt_before(agreement: LocalAgreement, start_s: float) -> str | None:
    """Whisper's prompt for audio from `start_s` on: the committed words before it."""
    return join_words([w for w in agreement.committed if w.end <= start_s]) or None
