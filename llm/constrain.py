"""Constrained decoding: what the model may write, as a token mask at every position.

    grammars = Grammars(hf_tokenizer, vocab_size, eos_ids)   # once per engine (~1 s)
    state = grammars.start(Constraint.json_schema(schema))   # per generation; bad -> ConstraintError
    row = state.mask()                                       # bool (vocab,): the allowed next tokens
    state.advance([token])                                   # the grammar moves by what was kept

The masks come from llguidance (the Rust library behind Guidance and llama.cpp's
`%llguidance` grammars): a JSON schema, a regular expression or a Lark grammar compiles
to one grammar, and its matcher answers the set of allowed next tokens, checks a list
of tokens, rolls back, and tells the tokens the grammar forces from here (every other
token is masked off). xgrammar was measured beside it (bench constrained,
README): see there why this one.

How it meets speculation (llm/decoder.py):
- the target's distribution at every verified position is the masked one: row i of a
  verify is masked with the grammar's state after the pending token and drafts[:i];
- a draft token the grammar rejects ends the draft before verification (`check_drafts`):
  it is never verified and thrown away. For point-mass drafts (n-gram, forced tokens,
  greedy) that is exact: the target gives it probability 0, so rejection sampling
  would reject it with certainty and resample from the same p. A draft model that
  samples draws from its own *masked* distribution instead (`ModelDrafter`), so it
  never proposes such a token: truncating a sampled draft at a token the grammar
  rejects would bias the result towards the bonus draw;
- the state advances by exactly the accepted drafts plus the target's own token;
- the tokens the grammar forces (keys, punctuation, the rest of an enum value once a
  prefix picks it) are proposed as drafts for free (`GrammarDrafter`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from llm.drafters import Proposal
from llm.sampling import apply_mask
from llm.types import Constraint, SamplingParams

__all__ = ["ConstraintError", "ConstraintState", "GrammarDrafter", "Grammars", "apply_mask", "check_text", "grammar_text", "validate"]


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (raised before any token is produced), or a
    text that does not satisfy one."""


# JSON as models write it (and as Qwen2.5's template shows tool calls): `{"a": 1, "b": 2}`,
# one space after `:` and `,`, no other whitespace. Same documents as the schema allows;
# the separators become tokens the grammar forces (drafted for free). A schema's own
# "x-guidance" options override these.
COMPACT_JSON = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def grammar_text(c: Constraint, compact: bool = True) -> str:
    """The constraint as llguidance's grammar (a JSON string); raises ConstraintError for
    text that is not a JSON schema, a regex or a Lark grammar. `compact`: JSON written
    as COMPACT_JSON (the engine); off, any whitespace JSON allows (checking a server's text)."""
    import llguidance

    if c.kind == "json_schema":
        import json

        try:
            schema = json.loads(c.text)
        except ValueError as e:
            raise ConstraintError(f"the json_schema constraint is not JSON: {e}") from e
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
    try:
        if c.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(c.text, COMPACT_JSON if compact else None)
        if c.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(c.text)
        return llguidance.LLMatcher.grammar_from_lark(c.text)
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"the {c.kind} constraint does not compile: {e}") from e


def validate(c: Constraint, compact: bool = True) -> str:
    """The constraint's grammar once it is known to compile; else ConstraintError (no
    tokenizer needed: what a server will be sent is checked here first)."""
    import llguidance

    grammar = grammar_text(c, compact)
    problem = llguidance.LLMatcher.validate_grammar(grammar, None)
    if problem:
        raise ConstraintError(f"the {c.kind} constraint does not compile: {problem}")
    return grammar


def check_text(constraint: Constraint, text: str, complete: bool = True) -> str | None:
    """Why `text` does not satisfy `constraint` as a whole (or, not `complete`, cannot
    begin a text that does: an answer cut by its length), or None when it does (for
    servers' answers, which we cannot mask: llm/openai_backend.py checks them). Needs
    no tokenizer: llguidance's byte-level matcher reads the text as bytes."""
    import llguidance

    grammar = validate(constraint, compact=False)
    tok = _byte_tokenizer()
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    data = text.encode("utf-8")
    for i, byte in enumerate(data):
        if not m.consume_token(byte):
            return (f"the text stops matching the {constraint.kind} constraint at byte {i}: "
                    f"{data[:i].decode('utf-8', 'replace')[-40:]!r} then {data[i:i + 10].decode('utf-8', 'replace')!r}")
    if complete and not m.is_accepting():
        return f"the text ends before the {constraint.kind} constraint is complete"
    return None


_BYTES: object | None = None


def _byte_tokenizer():
    """A tokenizer whose 256 tokens are the bytes (GPT-2's byte-level alphabet, no merges)
    and an end token, so that any text is one token a byte: for checking text."""
    global _BYTES
    if _BYTES is None:
        import llguidance
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        shifted = [b for b in range(256) if b not in printable]
        char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
        vocab = {char[b]: b for b in range(256)} | {"</s>": 256}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        _BYTES = llguidance.LLTokenizer(tok.to_str(), n_vocab=257, eos_token=256)
    return _BYTES


@dataclass
class Grammars:
    """One engine's constraint compiler: the tokenizer as llguidance sees it (built once,
    about a second for a 150k vocabulary), and each constraint compiled once per
    process (later requests copy the compiled matcher). `vocab_size` is the model's
    logits width: rows past the tokenizer's (padding) are never allowed."""

    hf_tokenizer: object
    vocab_size: int
    eos_ids: frozenset[int]
    compile_s: dict[Constraint, float] = field(default_factory=dict)  # first compile of each
    _tokenizer: object | None = field(default=None, init=False, repr=False)
    _compiled: dict[Constraint, object] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=sorted(self.eos_ids) or None
            )
        return self._tokenizer

    def compile(self, c: Constraint):
        """The compiled matcher at its start (cached); ConstraintError when it cannot be."""
        import llguidance

        with self._lock:
            if c in self._compiled:
                return self._compiled[c]
            t0 = time.perf_counter()
            grammar = grammar_text(c)
            problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
            if problem:
                raise ConstraintError(f"the {c.kind} constraint does not compile: {problem}")
            m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if m.is_error():
                raise ConstraintError(f"the {c.kind} constraint does not compile: {m.get_error()}")
            self._compiled[c] = m
            self.compile_s[c] = time.perf_counter() - t0
            return m

    def start(self, c: Constraint) -> "ConstraintState":
        return ConstraintState(self.compile(c).deep_copy(), self.vocab_size, c)


class ConstraintState:
    """One generation's place in its constraint. Not thread-safe: it lives in one
    conversation's pass callbacks (which the engine thread runs one at a time)."""

    def __init__(self, matcher, vocab_size: int, constraint: Constraint, root: "ConstraintState | None" = None):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.constraint = constraint
        self._words = (vocab_size + 31) // 32
        self.mask_s = 0.0  # time spent computing masks (bench constrained), forks' included
        self.masks = 0
        self._root = root or self

    def fork(self) -> "ConstraintState":
        """A copy to look ahead with (a verify's draft rows, a draft model's steps). The
        generation's own state only ever moves forward by what was kept: looking ahead
        by consuming and rolling back went out of step with the text when a draft ran
        past the grammar's end (a stopped matcher consumes nothing, yet the rollback
        counted every draft) and after llguidance rollbacks in lazy grammars."""
        return ConstraintState(self.matcher.deep_copy(), self.vocab_size, self.constraint, self._root)

    def mask(self) -> torch.Tensor:
        """Bool (vocab,): the tokens the constraint allows next."""
        t0 = time.perf_counter()
        bits = np.empty(self._words, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
        self._root.mask_s += time.perf_counter() - t0
        self._root.masks += 1
        return torch.from_numpy(allowed)

    def advance(self, tokens: list[int]) -> None:
        """Move by tokens that were chosen under this constraint's masks."""
        for tok in tokens:
            if self.matcher.is_stopped():
                return  # complete: what follows is the end (EOS), which ends the generation
            if not self.matcher.consume_token(tok):
                raise ConstraintError(f"token {tok} breaks the {self.constraint.kind} constraint: {self.matcher.get_error()}")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the constraint accepts from here, without moving."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def check_drafts(self, drafts: list[int]) -> tuple[list[int], torch.Tensor]:
        """(the drafts up to the first one the constraint rejects, the masks of the
        verify's rows): row i is the mask after drafts[:i], so len(kept) + 1 rows. The
        state does not move (the rows come from a fork)."""
        kept = drafts[: self.valid_prefix(drafts)]
        rows = [self.mask()]
        if kept:
            ahead = self.fork()
            for i, tok in enumerate(kept):
                if ahead.matcher.is_stopped() or not ahead.matcher.consume_token(tok):
                    kept = kept[:i]  # past the grammar's end (or a token it refused after all)
                    break
                rows.append(ahead.mask())
        return kept, torch.stack(rows)

    def forced(self, limit: int) -> list[int]:
        """The tokens the constraint forces from here (at most `limit`), without moving."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())[:limit]

    @property
    def done(self) -> bool:
        """Nothing but the end of the text can follow."""
        return self.matcher.is_stopped()


@dataclass
class GrammarDrafter:
    """Proposes the tokens the constraint forces from here (SGLang's jump-forward as
    drafts): free like n-gram lookup, and accepted with certainty, since the masked
    target can write nothing else. The state is the generation's (set per generation
    by the decoder); with no constraint it proposes nothing."""

    state: ConstraintState | None = None
    name: str = "grammar"

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Proposal:
        t0 = time.perf_counter()
        tokens = self.state.forced(k) if self.state is not None else []
        return Proposal(tokens, None, self.name, time.perf_counter() - t0)

    def accepted(self, n: int) -> None:
        pass
