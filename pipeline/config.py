"""The agent's configuration: TOML files under `configs/`, validated with pydantic.

One model per section, each with the defaults of the embedded offline CPU setup, so a
config file only names what it changes. Unknown keys are errors (a typo must not be
silently ignored on a live call).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.receptionist.business import BusinessConfig, Layout, Persona, default_business
from pipeline.receptionist.business import facts_prompt

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpenAIConfig(Section):
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = ""
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 30.0
    # How the server takes a constraint (llm/openai_backend.py): "openai" (JSON schemas
    # only), "llama.cpp" (its llguidance grammars too), "vllm" (structured_outputs).
    dialect: Literal["openai", "llama.cpp", "vllm"] = "openai"


class LLMConfig(Section):
    backend: Literal["speculative", "openai"] = "speculative"
    # A catalog name (see `specvoice models list`), a Hugging Face id, a local directory or a GGUF file.
    target: str = "qwen2.5-coder-1.5b-instruct"
    draft: str | None = "qwen2.5-coder-0.5b-instruct"
    drafter: Literal["model", "ngram", "hybrid", "none"] = "hybrid"
    # "auto": adaptive gamma in [0, max_gamma]; an integer: a fixed gamma.
    gamma: int | Literal["auto"] = "auto"
    max_gamma: int = Field(default=8, ge=0, le=32)
    device: str = "cpu"
    # "int8": batch-invariant int8 linears (the CPU fast path); float dtypes elsewhere.
    dtype: Literal["auto", "int8", "float32", "bfloat16", "float16"] = "auto"
    max_new_tokens: int = Field(default=96, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)  # 0 means greedy
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = 0
    stop: list[str] = Field(default_factory=list)
    context_tokens: int = Field(default=4096, ge=64)
    threads: int | None = None
    # The engine's last N greedy answers, drafted from by every greedy call
    # (llm/answer_memory.py; with the n-gram drafter): a receptionist's common answers in
    # fewer passes. 0: off, where calls must not share even how fast an answer comes
    # (README: "Drafting from earlier answers").
    answer_memory: int = Field(default=256, ge=0)
    openai: OpenAIConfig = Field(default_factory=OpenAIConfig)

    @model_validator(mode="after")
    def _gamma_in_range(self) -> LLMConfig:
        if isinstance(self.gamma, int) and self.gamma < 0:
            raise ValueError("llm.gamma must be 'auto' or an integer >= 0")
        return self


class AgentConfig(Section):
    """How the agent speaks. What it knows is the [business] section: the system prompt is
    built from it (pipeline/receptionist/business.py) unless `system_prompt` is given explicitly."""

    name: str = ""  # empty: business.name
    # An explicit prompt overrides the one built from [business] (configs written before
    # [business] existed keep working); empty means "build it".
    system_prompt: str = ""
    greeting: str = ""  # empty: business.greeting
    # How the prompt is built from [business]; the defaults measured best with
    # `specvoice bench quality` (README: Answer quality).
    prompt_layout: Layout = "lines"  # "lines": one labelled fact a line; "paragraph": the old running text
    prompt_rules: bool = True  # only the facts; a fixed sentence rather than a guess; never agree with a wrong claim
    prompt_examples: bool = False  # a few worked exchanges filled from the facts
    prompt_persona: Persona = "role"  # "role": the business's receptionist/host/...; "checker": compares before agreeing
    # Budget for the conversation history fed to the LLM; older turns are dropped first.
    history_tokens: int = Field(default=1536, ge=64)
    # The fact guard (pipeline/receptionist/guard.py): a sentence is spoken only if the [business] facts or
    # the turn's tool results support it; else a correction or the fallback is said. On in
    # configs/default.toml; off here so that a config without [business] facts (an explicit
    # system_prompt) is not judged against the default business.
    guard: bool = False
    # A caller's line that only greets ("Hi.", "Hello, this is Maria Lopez.") and answers no
    # question of the agent's is greeted back in our words ("Hi Maria, how can I help you
    # today?"), without the model: the 1.5B read every fact of the business out to "Hi, my
    # name is Robert." (pipeline/receptionist/caller.py). So is a caller who only asks for the
    # name they gave ("Do you remember my name?" -> "Your name is Robert.").
    greet_back: bool = True

    def built_prompt(self, business: BusinessConfig) -> str:
        return facts_prompt(business, self.prompt_layout, self.prompt_rules, self.prompt_examples, self.prompt_persona)


class STTConfig(Section):
    # "whisper": faster-whisper (CTranslate2); "moonshine": Moonshine base English on
    # onnxruntime (voice/moonshine.py), whose cost follows the audio and which takes no
    # prompt (the vocabulary is matched onto its transcript instead). README: "Choosing the STT".
    engine: Literal["whisper", "moonshine"] = "whisper"
    model: str = "whisper-base"  # catalog name (or alias: base, tiny.en) or a model folder; see model_for_engine
    # Whisper's window: "full" encodes 30 s whatever the turn's length (faster-whisper as
    # shipped); "audio" the turn + 4 s, guarded against repetition loops (voice/stt.py).
    window: Literal["full", "audio"] = "full"
    device: str = "cpu"
    compute_type: str = "int8"
    beam_size: int = Field(default=1, ge=1)
    language: str | None = "en"
    # Transcribe while the caller speaks (voice/streaming_stt.py: LocalAgreement-2 over
    # re-transcriptions every stream_interval_ms); after the end of the turn only the
    # words not yet confirmed are transcribed. Interim and stable transcripts become call
    # events; each turn's report has stt_after_endpoint and the streaming passes.
    streaming: bool = False
    stream_interval_ms: int = Field(default=1000, ge=100)
    # Transcriptions that may run at once (faster-whisper's num_workers): calls whose turns
    # end together are transcribed side by side instead of queueing behind one another.
    # `bench load --calls 1 4 --config default`, 2 cores: at 4 calls STT p50 1.6-1.8 s with
    # 2 against 2.6 s with 1, voice-to-voice p50 4.2 against 5.0 s; one call unchanged.
    workers: int = Field(default=2, ge=1, le=16)
    # Words and phrases callers will say that Whisper may not know: the business's name,
    # staff, services, products, streets, days ("Riverside Dental", "Dr. Patel", "cleaning").
    # Empty: Whisper gets no prompt.
    vocabulary: list[str] = Field(default_factory=list)
    # How the vocabulary reaches Whisper. Measured with whisper-base over 8 kHz mu-law
    # (`specvoice bench voice --vocabulary --phone --repeat 2`, bench/results/stt-vocabulary-phone.json):
    # WER on the demo's caller questions 9.3% -> 7.5%, on domain-heavy sentences 8.1% -> 1.6%,
    # on LJ Speech (unrelated text) 6.8% -> 11.4% (one clip). initial_prompt and hotwords give
    # identical text (faster-whisper puts both in the previous-text slot); "both" is no better.
    vocabulary_mode: Literal["none", "initial_prompt", "hotwords", "both"] = "initial_prompt"

    @property
    def model_for_engine(self) -> str:
        """The model the engine loads: `model`, except that Moonshine left with Whisper's
        default model name loads Moonshine's own (one key to switch engines)."""
        if self.engine == "moonshine" and self.model in ("whisper-base", "base"):
            return "moonshine-base-en"
        return self.model


class TTSConfig(Section):
    engine: Literal["piper", "coqui"] = "piper"
    voice: str = "piper-joe-medium"  # catalog name or a path to a voice (.onnx) / model directory
    length_scale: float = 1.0
    # Piper: a long sentence is synthesised clause by clause (at , ; : with both sides long
    # enough, voice.tts.split_clauses): its first audio goes out sooner, at a small cost in
    # prosody across the cut. The fact guard has judged the sentence whole before.
    split_clauses: bool = False


class VADConfig(Section):
    threshold: float = Field(default=0.5, gt=0.0, lt=1.0)
    start_ms: int = Field(default=200, ge=0)
    end_silence_ms: int = Field(default=500, ge=30)
    preroll_ms: int = Field(default=300, ge=0)
    max_utterance_s: float = Field(default=20.0, gt=0.0)


class TurnConfig(Section):
    """When the caller's turn is over. "silence": after vad.end_silence_ms of silence.
    "smart_turn": a short pause (pause_ms) asks the Smart Turn v3.2 end-of-turn model;
    "complete" ends the turn, "incomplete" waits, up to max_silence_ms of silence."""

    mode: Literal["silence", "smart_turn"] = "silence"
    model: str = "smart-turn-v3.2"  # catalog name or a path to the ONNX file / folder
    pause_ms: int = Field(default=200, ge=30)
    threshold: float = Field(default=0.5, ge=0.0, lt=1.0)
    max_silence_ms: int = Field(default=1500, ge=100)
    max_turn_s: float = Field(default=30.0, gt=0.0)  # a caller who never stops: the turn ends here
    # The model is missing at start: False -> a clear error naming the pull command;
    # True -> a warning, and silence endpointing.
    fallback_to_silence: bool = False
    # At each pause (pause_ms of silence) transcribe the turn so far and start the LLM into
    # a buffer; kept (token-identical) if the turn ends on that same audio, else cancelled
    # and dropped (pipeline/stages/preempt.py). Nothing is played before the turn ends.
    # smart_turn: started beside the model's decision. silence: the endpointer declares
    # pauses of pause_ms, and the turn still ends at vad.end_silence_ms of silence.
    # None (not set): on with smart_turn, off with silence.
    preemptive: bool | None = None
    # With preemption: while the caller speaks, every this many ms of speech their turn so
    # far is transcribed and the prompt up to those words is prefilled into the LLM's K/V
    # (nothing generated; pipeline/stages/preempt.py SpeechPrefill); and once each turn is
    # over, the history up to the caller's next words (Preemptor.prefill_next). 0: off.
    speech_prefill_ms: int = Field(default=800, ge=0)
    # With preemption: the first sentence of the answer being buffered is synthesised while
    # the silence runs out (pipeline/stages/speak_ahead.py); a kept answer's audio is ready
    # at the end of the turn. Only the exact sentence the turn says reuses it.
    speak_ahead: bool = True
    # Silence mode with preemption: at each pause the LLM scores the caller's words (without
    # their final mark) for how likely they end the message: the probability, read off the
    # preemptive start's own prefill, that its next token is ".", "?", "!" or the end of the
    # message (llm.engine.SpeculativeEngine.end_mass). Below this the turn waits up to
    # max_silence_ms, as on "... for next": the STT writes "Do you accept?" for a caller
    # who stopped after "accept" to think. 0: off. Measured: README "Turn-taking".
    words_end_threshold: float = Field(default=0.002, ge=0.0, lt=1.0)
    # ... and at or above this score, with words that close the sentence, the turn ends at
    # words_done_silence_ms of silence instead of vad.end_silence_ms (the score arrives with
    # the preemptive start's prefill, so on a slow CPU it may end later than that, never
    # later than vad.end_silence_ms). 0 ms: off, the default: a misheard fragment scores
    # high too ("... a cleaning for" heard as "... for now.", 0.80) and a caller's 700 ms
    # pause was cut in two. Measured: README "Turn-taking".
    words_done_threshold: float = Field(default=0.5, gt=0.0, le=1.0)
    words_done_silence_ms: int = Field(default=0, ge=0)
    # The caller speaks again within this many ms of the turn's end, before its answer was
    # heard (or within this many ms of its first audio): the turn ended too soon, so it is
    # taken back (not answered, kept out of the history) and its audio begins the turn being
    # spoken (pipeline/stages/take_back.py). Not once the turn acted (a tool ran). 0: off.
    take_back_ms: int = Field(default=500, ge=0)

    @property
    def preempts(self) -> bool:
        """Whether the call answers at pauses, preemptively (`preemptive`, or the mode's default)."""
        return self.preemptive if self.preemptive is not None else self.mode == "smart_turn"

    @property
    def scores_words(self) -> bool:
        """Whether the LLM scores the caller's words at pauses (either use of the score on)."""
        return self.words_end_threshold > 0 or self.words_done_silence_ms > 0

    @model_validator(mode="after")
    def _pause_shorter_than_max(self) -> TurnConfig:
        if self.pause_ms >= self.max_silence_ms:
            raise ValueError("turn.pause_ms must be shorter than turn.max_silence_ms")
        return self


class PipelineConfig(Section):
    first_clause: bool = False
    first_clause_min_words: int = Field(default=6, ge=2)
    barge_in: bool = True
    # Keys the caller presses (phone DTMF) become one turn's text, "[keypad] 123": the entry
    # ends at '#' or after this long without another key. 2 s: long enough for a caller
    # keying a number (a key every second or so), short enough that a lone "press 1 to
    # confirm" is not left hanging (Twilio's <Gather> waits 5 s; '#' ends at once).
    keypad_timeout_ms: int = Field(default=2000, ge=100, le=30000)


class BridgeConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)
    public_url: str | None = None  # wss://... used in TwiML; defaults to the request's Host
    max_calls: int = Field(default=4, ge=1)
    idle_timeout_s: float = Field(default=30.0, gt=0.0)
    max_message_bytes: int = Field(default=64 * 1024, ge=1024)
    handshake_timeout_s: float = Field(default=5.0, gt=0.0)
    auth_token_file: str | None = None
    twilio_auth_token_file: str | None = None
    require_auth: bool = True
    max_media_bytes: int = Field(default=16 * 1024, ge=160)  # decoded mu-law per media message
    end_grace_s: float = Field(default=5.0, ge=0.0)  # time the pipeline gets to finish after hang-up
    # SIGTERM drains: no new calls (503, /health 503 so a load balancer moves on), calls in
    # progress go on up to this long, then the rest are closed with their reports. 0: close at once.
    drain_s: float = Field(default=30.0, ge=0.0)
    # Outbound audio goes out this far ahead of real time (absorbs event-loop jitter; a
    # barge-in `clear` still leaves at most this much queued at Twilio).
    send_ahead_s: float = Field(default=0.04, ge=0.0, le=1.0)
    # Where transfer_to_human sends the caller: a phone number in E.164 form ("+15550100"),
    # dialled by the TwiML the bridge serves when the stream ends. Empty: no transfer; the
    # tool tells the model so, and it offers to take a message (docs/tools.md: Transfer).
    transfer_to: str = ""

    @field_validator("transfer_to")
    @classmethod
    def _e164_or_empty(cls, value: str) -> str:
        value = value.strip()
        if value and not re.fullmatch(r"\+[1-9]\d{6,14}", value):
            raise ValueError(f"bridge.transfer_to must be a phone number in E.164 form (like +15550100), "
                             f"or empty; got {value[:40]!r}")
        return value


class ReportConfig(Section):
    dir: str = "reports"
    # Which calls `specvoice serve` records as a stereo WAV beside their report (caller left,
    # agent right; the report page plays it): "browser" (calls from the call page, which says
    # so), "all" (phone calls too: tell your callers, recording laws apply), "none".
    record: Literal["none", "browser", "all"] = "browser"


class MQTTConfig(Section):
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(default=1883, ge=1, le=65535)
    topic_prefix: str = "specvoice"
    qos: Literal[0, 1, 2] = 1
    buffer: int = Field(default=256, ge=1)
    retry_s: float = Field(default=1.0, gt=0.0)


class ToolsConfig(Section):
    """`[tools]`: the agent's tools (booking, messages, transfer; pipeline/receptionist/tools.py) and the
    database they write to (pipeline/receptionist/bookings.py)."""

    enabled: bool = False
    # Empty: the SQLite file data/bookings.sqlite under the working directory (made if
    # missing). Else a SQLite file path, or a postgresql://user:password@host/db URL.
    database: str = ""
    # Said at once when the model starts a tool call before it has said anything: the tool
    # call and the answer after it take seconds on a CPU (README "Tool use"), and a caller
    # should not sit in silence meanwhile. Not the model's words: it is not in the model's
    # messages, only in what the caller heard. Empty: silence until the answer.
    hold_line: str = "One moment, please."
    # Decide each turn as a constrained plan ({"act": "book", "slot": <an open slot>, ...},
    # pipeline/receptionist/plan.py), act on it through the database, then say what it did, instead of
    # the model writing tool calls. The prompt then carries no tool schemas.
    plan: bool = False


class Config(Section):
    llm: LLMConfig = Field(default_factory=LLMConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    # The business the agent answers for; without a [business] section, Riverside Dental.
    business: BusinessConfig = Field(default_factory=default_business)
    stt: STTConfig = Field(default_factory=STTConfig)
    tts: TTSConfig = Field(default_factory=TTSConfig)
    vad: VADConfig = Field(default_factory=VADConfig)
    turn: TurnConfig = Field(default_factory=TurnConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    bridge: BridgeConfig = Field(default_factory=BridgeConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    mqtt: MQTTConfig = Field(default_factory=MQTTConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)

    @model_validator(mode="after")
    def _early_end_in_range(self) -> Config:
        """turn.words_done_silence_ms, when on, lies between a pause (where the words are
        scored) and the end of turn (at or after it the early end would never happen)."""
        early = self.turn.words_done_silence_ms
        if 0 < early < self.turn.pause_ms:
            raise ValueError("turn.words_done_silence_ms must be at least turn.pause_ms (the words are "
                             "scored at a pause), or 0 to turn it off")
        if early >= self.vad.end_silence_ms:
            raise ValueError(f"turn.words_done_silence_ms ({early}) must be shorter than "
                             f"vad.end_silence_ms ({self.vad.end_silence_ms}), or 0 to turn the early end off")
        return self

    @model_validator(mode="after")
    def _agent_from_business(self) -> Config:
        """Fill the agent's prompt, greeting and name from [business] where not given.

        Everything downstream reads `agent.system_prompt` and `agent.greeting`, so a call,
        the prefix warm-up and the benchmarks all see the same prompt."""
        a, built = self.agent, self.agent.built_prompt(self.business)
        if a.system_prompt and a.system_prompt != built and "business" in self.model_fields_set:
            # Two sources of truth for what the agent knows: refuse rather than pick one.
            raise ValueError("both agent.system_prompt and a [business] section are given; the prompt is built "
                             "from [business], so drop agent.system_prompt (or drop [business] to keep your own prompt)")
        a.system_prompt = a.system_prompt or built
        a.greeting = a.greeting or self.business.greeting
        a.name = a.name or self.business.name
        return self


class ConfigError(ValueError):
    """A config file that is missing, unreadable or invalid."""


def _read_with_base(path: Path, seen: tuple[Path, ...]) -> dict:
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
        raise ConfigError(f"config file not found: {path} (built-in configs: {known})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"invalid config {path}: base must be a config name or a path, e.g. base = \"default\"")
    base_path = Path(base)
    if base_path.suffix and not base_path.is_absolute():
        base_path = path.parent / base_path  # a file beside this one
    base_path = config_path(base_path if base_path.suffix else base)
    if base_path.resolve() in seen or base_path.resolve() == path.resolve():
        raise ConfigError(f"invalid config {path}: base {base!r} leads back to itself")
    merged = _read_with_base(base_path, (*seen, path.resolve()))
    for section, value in data.items():
        if isinstance(value, dict) and isinstance(merged.get(section), dict) and section != "business":
            merged[section] = {**merged[section], **value}
        else:
            merged[section] = value
    return merged


def config_path(name_or_path: str | Path | None) -> Path:
    """`None` -> configs/default.toml; a bare name like "gpu" -> configs/gpu.toml; else a path."""
    if name_or_path is None:
        return CONFIG_DIR / "default.toml"
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = CONFIG_DIR / f"{name_or_path}.toml"
    return path


def load_config(name_or_path: str | Path | None = None) -> Config:
    """A config file, validated. A top-level `base = "default"` (a built-in name, or a path
    relative to the file) starts from that config: each section's keys override the base's,
    and a [business] section replaces the base's whole (one business's prices or hours must
    not leak into another's). So a file with `base = "default"` and a [business] is a full
    config for your own business on the default models."""
    path = config_path(name_or_path)
    data = _read_with_base(path, ())
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid config {path}:\n{exc}") from exc
