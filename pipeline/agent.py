"""The models a call needs, loaded once per process and shared by every call.

    models = AgentModels.load(config)        # ~25 s for the default pair, once
    backend = models.new_backend()           # one per call: keeps that call's KV cache
    endpointer = models.new_endpointer()     # one per call: per-stream VAD state

One speculative engine serves all calls (its fair lock interleaves them pass by pass),
one Whisper, one Piper voice (serialised by its own lock) and one Silero session. The
system prompt's K/V is computed once (`warm_prefix`) and copied into each new call.

With `[tools] enabled` the bookings database is opened once (a clear error naming the
path if it cannot be), the tool schemas go into every prompt (and into the warmed prefix,
so it stays a prefix), and each call gets its own `ToolBox` (`new_toolbox(call_id)`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from llm.types import LLMBackend, SamplingParams
from pipeline.config import Config, LLMConfig
from pipeline.receptionist.prompt import system_prompt, tool_schemas, tool_values
from pipeline.ports import SpeechToText, TextToSpeech, ToolRunner
from pipeline.stages.turn_taking import EndOfTurnModel, TurnTaker
from voice.turn_detector import TurnPolicy
from voice.endpointer import EndpointConfig, Endpointer

if TYPE_CHECKING:  # heavy imports, loaded only by AgentModels.load
    from llm.engine import SpeculativeEngine
    from pipeline.receptionist.bookings import BookingStore
    from pipeline.receptionist.tools import ToolBox
    from voice.vad import SileroModel

log = logging.getLogger(__name__)

__all__ = ["AgentModels", "ModelSet", "call_ports", "chars_token_count", "endpoint_config", "load_engine", "new_call_id", "sampling_params",
           "voice_executor"]

_voice_pool: ThreadPoolExecutor | None = None
_voice_pool_lock = threading.Lock()


def new_call_id() -> str:
    return f"call-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


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
    """What `Call.from_models` and the transports' call handlers take: AgentModels, or a
    test's stand-in."""

    stt: SpeechToText
    tts: TextToSpeech

    def new_backend(self, config: Config | None = None) -> LLMBackend: ...

    def new_endpointer(self) -> Endpointer: ...

    def count_tokens(self, messages: list[dict]) -> int: ...

    def new_turn_taker(self, executor: Executor | None = None) -> TurnTaker: ...

    def new_toolbox(self, call_id: str, caller: str | None = None) -> ToolRunner | None: ...  # None: no tools




def load_engine(llm: LLMConfig, drafter: str | None = None, gamma: int | str | None = None,
                answer_memory: int | None = None) -> SpeculativeEngine:
    """The in-process engine an `[llm]` section describes: its models resolved from the
    model cache, the draft model loaded only for a drafter that uses it. `drafter`,
    `gamma` and `answer_memory` override the section's (benchmarks compare settings on one
    engine, and those that ask one prompt more than once measure speculation without the
    memory of earlier answers: answer_memory=0)."""
    from llm.engine import SpeculativeEngine
    from modelstore import resolve_model

    drafter = drafter or llm.drafter
    draft = resolve_model(llm.draft) if llm.draft and drafter in ("model", "hybrid") else None
    return SpeculativeEngine.load(resolve_model(llm.target), draft, drafter=drafter,
                                  gamma=llm.gamma if gamma is None else gamma, max_gamma=llm.max_gamma,
                                  device=llm.device, dtype=llm.dtype, context_tokens=llm.context_tokens,
                                  answer_memory=llm.answer_memory if answer_memory is None else answer_memory)


def endpoint_config(config: Config, end_of_turn_model: bool = False) -> EndpointConfig:
    """The config's [vad] section in the endpointer's terms. With an end-of-turn model, or
    a call that answers at pauses (turn.preempts), the endpointer declares *pauses*
    (turn.pause_ms); the turn-taker decides turns."""
    v = config.vad
    pauses = end_of_turn_model or (config.turn.preempts and config.turn.pause_ms < v.end_silence_ms)
    return EndpointConfig(
        threshold=v.threshold,
        min_speech_ms=float(v.start_ms),
        min_silence_ms=float(config.turn.pause_ms if pauses else v.end_silence_ms),
        pre_roll_ms=float(v.preroll_ms),
        max_utterance_s=v.max_utterance_s,
    )


def sampling_params(config: Config) -> SamplingParams:
    llm = config.llm
    return SamplingParams(
        max_new_tokens=llm.max_new_tokens, temperature=llm.temperature, top_k=llm.top_k,
        top_p=llm.top_p, seed=llm.seed, stop=tuple(llm.stop),
    )


def chars_token_count(messages: list[dict]) -> int:
    """Token estimate when no tokenizer is at hand (a remote OpenAI-compatible server):
    about 4 characters a token for English, plus a few tokens of framing per message."""
    return sum(len(m.get("content", "")) // 4 + 4 for m in messages)


def thread_counts(config: Config, threads: int | None) -> tuple[int, int, int]:
    """(torch, whisper, piper) thread counts.

    The LLM, Whisper and Piper all compete for the same cores, and the LLM keeps
    generating while Piper speaks; oversubscribed pools that spin against each other make
    torch many times slower. Piper gets two threads that sleep when idle (no spinning,
    voice.tts.PiperTTS): an answer's first audio is made while the model waits for it
    (llm/voice_first.py), with the cores to itself, and there two threads made a first
    chunk in 90-99 ms against 163 ms with one (a script on a 2-core EPYC); beside a decoding
    model, two such threads cost the model no more than one. In calls: README "Voice
    first" (bench pipeline). Whisper runs while the LLM waits for it, so it may use the
    cores; torch gets `llm.threads` or all cores.
    """
    cores = os.cpu_count() or 1
    if threads is not None:
        return threads, threads, threads
    return config.llm.threads or cores, min(4, cores), min(2, cores)


def load_stt(config: Config, threads: int):
    """The STT engine [stt] names: Moonshine, or faster-whisper (with its window)."""
    from modelstore import resolve_model
    from voice.stt import WhisperPrompt, WhisperSTT

    if config.stt.engine == "moonshine":
        from voice.moonshine import MoonshineSTT

        # No prompt: the business's words are matched onto the transcript.
        return MoonshineSTT(resolve_model(config.stt.model_for_engine, kind="stt"), cpu_threads=threads,
                            vocabulary=config.stt.vocabulary)
    # The business's words as Whisper's prompt (stt.vocabulary; empty: no prompt).
    prompt = WhisperPrompt.from_vocabulary(config.stt.vocabulary, config.stt.vocabulary_mode)
    return WhisperSTT(resolve_model(config.stt.model), device=config.stt.device,
                      compute_type=config.stt.compute_type, beam_size=config.stt.beam_size,
                      language=config.stt.language, cpu_threads=threads,
                      initial_prompt=prompt.initial_prompt, hotwords=prompt.hotwords,
                      workers=config.stt.workers, window=config.stt.window)


def call_ports(models: ModelSet, config: Config, call_id: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """One call's ports from loaded models, with `overrides` (a test's, a transport's) in
    place of any of them: the keyword arguments of pipeline.call.Call."""
    ports: dict[str, Any] = {"stt": models.stt, "tts": models.tts, "count_tokens": models.count_tokens}
    if "backend" not in overrides:
        ports["backend"] = models.new_backend(config)
    if "endpointer" not in overrides:
        ports["endpointer"] = models.new_endpointer()
    if "turns" not in overrides:
        ports["turns"] = models.new_turn_taker(overrides.get("executor"))
    if "toolbox" not in overrides:
        ports["toolbox"] = models.new_toolbox(call_id)
    return {**ports, **overrides}


@dataclass
class AgentModels:
    config: Config
    stt: SpeechToText
    tts: TextToSpeech
    vad_model: SileroModel
    engine: SpeculativeEngine | None = None  # None for the OpenAI backend
    end_of_turn: EndOfTurnModel | None = None  # Smart Turn (turn.mode = "smart_turn"), else None
    load_s: dict[str, float] = field(default_factory=dict)
    bookings: BookingStore | None = None  # [tools] enabled: the database every call's tools use

    @classmethod
    def load(cls, config: Config, *, threads: int | None = None, warm: bool = True) -> "AgentModels":
        """Load everything the config names. Raises ModelNotFoundError (with the pull
        command) for a model that is not on disk."""
        from modelstore import resolve_model
        from voice.tts import load_tts
        from voice.vad import SileroModel

        bookings = open_bookings(config)  # first: a bad database path fails before a minute of loading
        torch_threads, stt_threads, tts_threads = thread_counts(config, threads)
        times: dict[str, float] = {}
        engine = None
        if config.llm.backend == "speculative":
            import torch

            torch.set_num_threads(torch_threads)
            t = time.perf_counter()
            engine = load_engine(config.llm)
            times["llm"] = time.perf_counter() - t
        t = time.perf_counter()
        stt = load_stt(config, stt_threads)
        times["stt"] = time.perf_counter() - t
        t = time.perf_counter()
        if config.tts.engine == "piper":
            tts = load_tts("piper", resolve_model(config.tts.voice), length_scale=config.tts.length_scale,
                           threads=tts_threads, split_clauses=config.tts.split_clauses)
        else:
            tts = load_tts(config.tts.engine, resolve_model(config.tts.voice))
        times["tts"] = time.perf_counter() - t
        vad = SileroModel()
        end_of_turn = load_end_of_turn(config)
        models = cls(config, stt, tts, vad, engine, end_of_turn, times, bookings)
        if warm:
            models.warm()
        return models

    def warm(self) -> None:
        """Compute the system prompt's K/V once; every call starts from a copy of it."""
        if self.engine is None:
            return
        prefix = self.engine.chat_prompt(
            [{"role": "system", "content": system_prompt(self.config)}], add_generation_prompt=False,
            tools=tool_schemas(self.config))
        if prefix:
            self.engine.warm_prefix(prefix)
        if self.config.turn.scores_words:
            _ = self.engine.end_ids  # the end marks of a 150k vocabulary (~0.7 s), not in the first pause
        if self.config.tools.plan and self.bookings is not None:
            # The plan's constraint: llguidance's tokenizer (about a second for a 150k
            # vocabulary) and the grammar of today's slots, built now rather than inside the
            # first caller's silence (the grammar is cached while the slots stay the same). A
            # turn that may only answer needs no grammar here: the engine prefills its line.
            from llm.types import Constraint
            from pipeline.receptionist.plan import plan_grammar, plan_slots

            self.engine.grammars.compile(Constraint.grammar(plan_grammar(*plan_slots(self.bookings))))

    def new_backend(self, config: Config | None = None) -> LLMBackend:
        """A fresh LLM backend for one call (its own conversation state)."""
        config = config or self.config
        if config.llm.backend == "openai":
            from llm.openai_backend import OpenAIChatBackend

            o = config.llm.openai
            return OpenAIChatBackend(o.base_url, o.model, os.environ.get(o.api_key_env), o.timeout_s,
                                     tools=tool_schemas(config), dialect=o.dialect)
        from llm.backend import SpeculativeBackend

        return SpeculativeBackend(self.engine, tools=tool_schemas(config), tool_values=tool_values(config))

    def new_toolbox(self, call_id: str, caller: str | None = None) -> ToolBox | None:
        """One call's tools (None when [tools] is off)."""
        if self.bookings is None:
            return None
        from pipeline.receptionist.tools import ToolBox

        return ToolBox(self.bookings, call_id, caller)

    def count_tokens(self, messages: list[dict]) -> int:
        if self.engine is not None:
            return self.engine.count_tokens(messages)
        return chars_token_count(messages)

    def new_endpointer(self) -> Endpointer:
        return Endpointer(self.vad_model.stream(), endpoint_config(self.config, self.end_of_turn is not None))

    def new_turn_taker(self, executor: Executor | None = None) -> TurnTaker:
        return turn_taker(self.config, self.end_of_turn, executor)


def open_bookings(config: Config) -> BookingStore | None:
    """The bookings database when [tools] is enabled (DatabaseError, naming the path, if
    it cannot be opened), seeded with the business's open slots while it has none."""
    if not config.tools.enabled:
        return None
    from pipeline.receptionist.bookings import open_store

    return open_store(config.tools.database, open_slots=config.business.open_slots)


def load_end_of_turn(config: Config) -> EndOfTurnModel | None:
    """The end-of-turn model the config asks for (None in silence mode). Missing: a clear
    error naming the pull command, or with turn.fallback_to_silence a warning and None."""
    if config.turn.mode != "smart_turn":
        return None
    from modelstore import ModelNotFoundError, resolve_model
    from voice.errors import ModelLoadError
    from voice.turn_detector import TurnDetector

    try:
        return TurnDetector.load(resolve_model(config.turn.model), threshold=config.turn.threshold)
    except (ModelNotFoundError, ModelLoadError, FileNotFoundError) as exc:
        if not config.turn.fallback_to_silence:
            raise
        log.warning("end-of-turn model unavailable (%s): falling back to silence endpointing "
                    "(vad.end_silence_ms = %d)", exc, config.vad.end_silence_ms)
        return None


def turn_taker(config: Config, model: EndOfTurnModel | None, executor: Executor | None = None) -> TurnTaker:
    t = config.turn
    policy = TurnPolicy(check_silence_s=t.pause_ms / 1000, threshold=t.threshold,
                        max_silence_s=t.max_silence_ms / 1000)
    # Silence mode that answers at pauses: the pauses are the endpointer's (pause_ms), the
    # turn's end is still vad.end_silence_ms of silence.
    end_silence_s = (config.vad.end_silence_ms / 1000 if model is None and t.preempts
                     and t.pause_ms < config.vad.end_silence_ms else None)
    # ... and ends sooner on words the LLM scores as the end of the message (words_done_*;
    # Config keeps it shorter than vad.end_silence_ms).
    words_done_s = (t.words_done_silence_ms / 1000 if end_silence_s is not None and t.words_done_silence_ms > 0
                    else None)
    return TurnTaker(model, policy, max_turn_s=t.max_turn_s, executor=executor, end_silence_s=end_silence_s,
                     words_end_threshold=t.words_end_threshold, words_done_threshold=t.words_done_threshold,
                     words_done_silence_s=words_done_s)

    def describe(self) -> dict[str, Any]:
        return {"load_s": {k: round(v, 2) for k, v in self.load_s.items()}}
