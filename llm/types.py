"""The LLM stage's vocabulary: what a generation is asked for and what it streams out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from llm.tool_calls import ToolCallParse

FinishReason = Literal["eos", "length", "stop", "cancelled", "error"]


@dataclass(frozen=True)
class TokenGroup:
    """The tokens one target forward pass accepted, streamed downstream as one unit.

    `text` is the UTF-8-safe text delta: a character split across tokens appears whole,
    in the group that completes it. `drafted` is how many tokens the drafter proposed for
    this pass and `accepted` how many of those the target kept; the group holds
    `accepted + 1` tokens (the target's own token) unless the turn ended inside it.
    """

    token_ids: tuple[int, ...]
    text: str
    drafted: int
    accepted: int
    timestamp: float = field(default_factory=time.monotonic)
    finish_reason: FinishReason | None = None


ConstraintKind = Literal["json_schema", "regex", "grammar"]


@dataclass(frozen=True)
class Constraint:
    """What the model may write: a JSON schema (as JSON text), a regular expression, or a
    grammar (Lark / EBNF text, as llguidance reads it). The engine masks every position's
    distribution to the tokens the constraint allows (llm/constrain.py); an OpenAI server
    is sent the same constraint (`response_format`, or llama.cpp's `grammar`)."""

    kind: ConstraintKind
    text: str

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        import json

        # Key order kept: JSON-schema grammars write properties in the order they are listed.
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, lark: str) -> "Constraint":
        return cls("grammar", lark)

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "regex", "grammar"):
            raise ValueError(f"constraint kind must be json_schema, regex or grammar, got {self.kind!r}")
        if not self.text:
            raise ValueError(f"empty {self.kind} constraint")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature == 0 means greedy (exact argmax). `constraint`:
    None writes free text; else every token is one the constraint allows."""

    max_new_tokens: int = 96
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationStats:
    """Per-generation counters; `tokens_per_pass` is the figure speculation exists to raise."""

    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually computed (the rest came from a KV cache)
    new_tokens: int = 0
    passes: int = 0  # target forward passes after prefill
    drafted: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    ttft_s: float | None = None
    gammas: list[int] = field(default_factory=list)
    forced_tokens: int = 0  # tokens a constraint allowed alone (nothing else could be written)
    mask_s: float = 0.0  # time spent computing a constraint's masks
    # One record per speculative pass: the gamma chosen and from which drafter, what the
    # controller expected (rate, acceptance, verify cost, a draft model's catch-up) and what
    # was measured (draft and verify seconds, accepted): why speculation paid or did not.
    trace: list[dict] = field(default_factory=list)

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / self.passes if self.passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "new_tokens": self.new_tokens,
            "passes": self.passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tokens_per_pass": round(self.tokens_per_pass, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_s": round(self.prefill_s, 5),
            "draft_s": round(self.draft_s, 5),
            "verify_s": round(self.verify_s, 5),
            "total_s": round(self.total_s, 5),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 5),
            "mean_gamma": round(sum(self.gammas) / len(self.gammas), 3) if self.gammas else 0.0,
            "forced_tokens": self.forced_tokens,
            "mask_s": round(self.mask_s, 5),
        }


@dataclass(frozen=True)
class WordsEnd:
    """What a stream's `cancel` may carry (as `words_end`) to have the backend score the
    caller's words from the stream's own prefill: `messages` are the stream's messages up
    to those words, without their final mark ("Do you accept"); `report` is called with the
    probability that they end the caller's message (llm.engine.SpeculativeEngine.end_mass),
    from the engine's thread, if the prefill computes their last row."""

    messages: list[dict]
    report: Callable[[float], None]


@runtime_checkable
class LLMBackend(Protocol):
    """What a call needs of its language model.

    `stream` yields one TokenGroup per step (a target pass in-process, a streamed chunk
    from a server) and stops between steps once `cancel` is set, ending with a group whose
    finish_reason is "cancelled". `last_stats` is the stats of the generation in progress
    (updated as it runs), else of the last one; None before the first. `aclose` frees
    what the backend holds (a conversation's KV cache, an HTTP client).

    Tools: `tools` is the OpenAI tool schemas the backend puts in every prompt (None: no
    tools); `last_tool_parse` the calls a server parsed itself in the last answer (OpenAI
    `tool_calls`, llm/openai_backend.py), None where calls are written as text.

    `prefills`: the reply can be started with a given text, computed with the prompt (a
    last assistant message marked `"prefix": True`; llm.engine.SpeculativeEngine.chat_prompt).

    Optional: `async prefill(messages, cancel) -> int`, the K/V of the prompt up to the
    last message's words so far, computed now (llm.backend.SpeculativeBackend; a call
    prefills a caller's words while they speak). A backend without it is not asked.
    Optional: `scores_words_end = True`: a `cancel` carrying `words_end` (WordsEnd) gets
    the probability that the caller's words end their message, read off the stream's own
    prefill (a preemptive start; the turn waits on a low one).
    Optional: `voice_first` (llm.voice_first.VoiceFirst or None): a gate the stream waits
    at before each step while the call's speaker makes a reply's first audio
    (llm.backend.SpeculativeBackend); a backend without it never waits.
    """

    tools: list[dict] | None
    last_tool_parse: ToolCallParse | None
    prefills: bool

    def stream(
        self, messages: list[dict], params: SamplingParams, cancel: asyncio.Event | threading.Event | None = None
    ) -> AsyncIterator[TokenGroup]: ...

    @property
    def last_stats(self) -> GenerationStats | None: ...

    async def aclose(self) -> None: ...
