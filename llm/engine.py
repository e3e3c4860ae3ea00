"""The speculative engine: a target, optional drafters, and the state shared by conversations.

    engine = SpeculativeEngine.load(target="...", draft="...", drafter="hybrid")
    conv = engine.new_conversation()
    for group in engine.stream(engine.chat_prompt(messages), params, conv):
        print(group.text, end="")

One engine serves many conversations (calls). Every pass runs on one engine thread that
owns the model (llm/scheduler.py): a call's thread submits its pass and waits for its
verdict, and the engine thread runs the rows of all the conversations waiting at that
moment as ONE target forward (linears over all rows, attention per conversation over its
own cache), each conversation with its own drafts and gamma. The batch-invariant int8
(and the rowwise float) numerics make this exact: a call's tokens are those it gets
alone, whatever the other calls do. Conversations join and leave between passes.
`batched=False` keeps the engine thread but runs each conversation's pass alone.
The K/V of a shared prefix (the system prompt) is computed once and copied into each
new conversation.

Fixed width (`fixed_width=True`, the default on CUDA): every conversation's KV caches
are static (preallocated to context + R, R = max_gamma + 1) and every target pass,
decode or verify, runs R rows; the draft model runs 1 row per step (R for a catch-up).
With `cuda_graphs=True` (the default on CUDA) those steps are captured once per
conversation and replayed. On CPU the same fixed-width path runs eagerly (tests);
the CPU default stays the variable-width int8 path.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from llm.answer_memory import AnswerDrafter, AnswerMemory
from llm.call_drafter import CallDrafter
from llm.constrain import GrammarDrafter, Grammars
from llm.decoder import Generation, Observe, Sequence, new_sequence, speculative_stream
from llm.detokenize import IncrementalDetokenizer
from llm.drafters import Drafter, ModelDrafter, NgramDrafter, common_prefix
from llm.gamma import GammaController
from llm.loading import LoadedModel, check_tokenizers_match, load_model
from llm.cuda_graphs import static_cache, synchronize
from llm.model import forward, new_cache
from llm.quant import Linear
from llm.scheduler import PassScheduler
from llm.threads import cores, on_own_thread, release
from llm.types import GenerationStats, SamplingParams, TokenGroup

log = logging.getLogger(__name__)

DRAFTERS = ("model", "ngram", "hybrid", "none")


class FairLock:
    """A FIFO lock: waiters get the model in arrival order (threading.Lock makes no promise)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._waiters: deque[threading.Event] = deque()
        self._held = False

    def __enter__(self):
        with self._mutex:
            if not self._held and not self._waiters:
                self._held = True
                return self
            ev = threading.Event()
            self._waiters.append(ev)
        ev.wait()
        return self

    def __exit__(self, *exc):
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().set()  # ownership passes directly to the next waiter
            else:
                self._held = False
        return False


@dataclass
class Conversation:
    """One call's LLM state: target K/V, drafter state, and the learnt gamma estimates."""

    seq: Sequence
    drafters: list[Drafter]
    controller: GammaController
    last_stats: GenerationStats | None = None


@dataclass
class SpeculativeEngine:
    target: LoadedModel
    draft: LoadedModel | None = None
    drafter: str = "hybrid"
    gamma: int | str = "auto"
    max_gamma: int = 8
    context_tokens: int = 4096
    lock: FairLock = field(default_factory=FairLock)
    # (tokens, target K/V, draft K/V or None) of shared prefixes such as a system prompt
    prefixes: list[tuple[list[int], Sequence, object]] = field(default_factory=list)
    step_costs: dict[str, float] = field(default_factory=dict)
    # What conversations learn (acceptance per drafter, measured costs), for the engine's
    # lifetime: every conversation's controller shares its `verify` and `sources` (not
    # copies), so a turn starts from all the turns before it and a slower machine is seen
    # by every call at once. Set to None to start over (a benchmark's next mode).
    learned: GammaController | None = None
    # Static caches and fixed-width (R-row) target passes; CUDA graphs of those steps.
    fixed_width: bool = False
    cuda_graphs: bool = False
    # Batch the passes of concurrent conversations into one forward (variable width only;
    # a fixed-width step runs alone); gather_s: how long a round waits for the active
    # conversations' next passes after the last one woke them.
    batched: bool = True
    gather_s: float = 0.002
    batch_drafts: bool = True  # the draft model's steps batched across conversations too
    # Torch threads of the engine thread (None: the constructing thread's, llm.threads.cores).
    threads: int | None = None
    # The engine's recent answers, drafted from in every conversation (llm/answer_memory.py;
    # with the n-gram drafter). Off (max_answers = 0) unless asked for: `load(answer_memory=N)`
    # ([llm] answer_memory asks for 256 by default).
    answers: AnswerMemory = field(default_factory=lambda: AnswerMemory(max_answers=0), repr=False, compare=False)
    _scheduler: PassScheduler | None = field(default=None, init=False, repr=False, compare=False)
    _grammars: Grammars | None = field(default=None, init=False, repr=False, compare=False)
    _end_ids: list[int] | None = field(default=None, init=False, repr=False, compare=False)
    _scheduler_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @property
    def scheduler(self) -> PassScheduler:
        """The engine thread (started at the first pass; stopped by close() or with the engine)."""
        with self._scheduler_lock:
            if self._scheduler is None:
                self._scheduler = PassScheduler(self.lock, self.gather_s, self.batched, self.batch_drafts,
                                                self.threads)
                weakref.finalize(self, self._scheduler.close)
            return self._scheduler

    @property
    def grammars(self) -> Grammars:
        """The constraint compiler for this target's tokenizer (built at the first
        constrained request: about a second for a 150k vocabulary)."""
        with self._scheduler_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.target.tokenizer, self.target.model.args.vocab_size, self.target.eos_ids)
            return self._grammars

    @functools.cached_property
    def digit_ids(self) -> frozenset[int]:
        """The target vocabulary's all-digit tokens (prompt lookup keys numbers by where
        they begin: llm.drafters.NgramDrafter)."""
        return frozenset(i for text, i in self.target.tokenizer.get_vocab().items() if text.isdigit())

    def close(self) -> None:
        """Stop the engine thread (a later pass starts a new one)."""
        with self._scheduler_lock:
            sched, self._scheduler = self._scheduler, None
        if sched is not None:
            sched.close()

    @classmethod
    def load(
        cls,
        target: str,
        draft: str | None = None,
        drafter: str = "hybrid",
        gamma: int | str = "auto",
        max_gamma: int = 8,
        device: str = "cpu",
        dtype: str = "auto",
        context_tokens: int = 4096,
        calibrate: bool = True,
        fixed_width: bool | None = None,
        cuda_graphs: bool | None = None,
        batched: bool = True,
        gather_s: float = 0.002,
        answer_memory: int = 0,
    ) -> "SpeculativeEngine":
        """fixed_width / cuda_graphs: None picks the device's default (both on for CUDA,
        both off for CPU). batched / gather_s: see the fields. answer_memory: how many of
        the engine's recent answers the n-gram drafter may draft from (0: none;
        llm/answer_memory.py)."""
        if drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
        if isinstance(gamma, int) and gamma < 0:
            raise ValueError(f"gamma must be >= 0 or 'auto', got {gamma}")
        fixed_width, cuda_graphs = fixed_width_options(device, fixed_width, cuda_graphs)
        if drafter in ("model", "hybrid") and not draft:
            raise ValueError(f"drafter {drafter!r} needs a draft model (--draft); or use --drafter ngram")

        def load_models() -> tuple[LoadedModel, LoadedModel | None]:
            target_m = load_model(target, device, dtype)
            draft_m = None
            if drafter in ("model", "hybrid"):
                draft_m = load_model(draft, device, dtype)
                check_tokenizers_match(target_m, draft_m)
            if fixed_width:
                for m in (target_m, draft_m):
                    if m is not None:
                        one_gemm(m.model)
            return target_m, draft_m

        # Loaded on a thread that ends, and then this thread runs torch single-threaded:
        # the engine thread's OpenMP pool stays the only one (llm/threads.py).
        threads = cores()
        target_m, draft_m = on_own_thread(load_models)
        release()
        engine = cls(
            target_m, draft_m, drafter, gamma, max_gamma, min(context_tokens, target_m.model.args.max_position),
            fixed_width=fixed_width, cuda_graphs=cuda_graphs, batched=batched, gather_s=gather_s, threads=threads,
        )
        if calibrate and gamma == "auto" and drafter != "none":
            engine.calibrate()
        engine.answers = AnswerMemory(max_answers=answer_memory)  # empty: nothing of the calibration
        return engine

    # ---- costs -------------------------------------------------------------------------
    def calibrate(self, context: int = 64) -> dict[str, float]:
        """Measure a target step, a (max_gamma+1)-row verify and a draft step once, to seed
        the adaptive gamma before the first real pass has been timed. On the engine thread,
        where the passes will run (its threads, its OpenMP pool)."""
        return self.scheduler.call(lambda: self._calibrate(context))

    def _calibrate(self, context: int) -> dict[str, float]:

        # The steps as conversations run them (static cache and fixed width where they do).
        as_run = {"fixed_width": self.fixed_width, "graphs": self.cuda_graphs}
        k = self.verify_width
        # At fixed width a one-token pass runs all R rows too: it costs what a full verify costs.
        target = time_steps(self.target.model, (k,) if self.fixed_width else (1, k), context, **as_run)
        verify = target[k]
        step = verify if self.fixed_width else target[1]
        costs = {"target_step": step, f"target_verify_{k}": verify}
        if self.draft is not None:
            draft = time_steps(self.draft.model, (1, 16), context, **as_run)
            costs["draft_step"] = draft[1]
            costs["draft_catch_up_row"] = draft[16] / 16  # a row of a catch-up (a new turn's prompt)
        self.step_costs = costs
        log.info("calibrated step costs: %s", {k: round(v * 1e3, 1) for k, v in costs.items()})
        return costs

    def _controller(self) -> GammaController:
        fixed = None if self.gamma == "auto" else int(self.gamma)
        c = GammaController(max_gamma=self.max_gamma if fixed is None else max(fixed, 0), fixed=fixed)
        if fixed is not None:
            return c
        if self.learned is None:
            self.learned = GammaController(max_gamma=self.max_gamma)
            if self.step_costs:  # the calibration seeds what the engine will learn
                step = self.step_costs["target_step"]
                k = self.verify_width
                v = self.learned.verify
                v.step_s = step
                v.per_extra_row_s = max(0.0, (self.step_costs.get(f"target_verify_{k}", step) - step) / max(k - 1, 1))
                v.wide_seen = 1  # the calibration measured one wide pass
                if "draft_step" in self.step_costs:
                    self.learned.stats("model").cost_per_token = self.step_costs["draft_step"]
                    self.learned.stats("model").catch_up_row_s = self.step_costs["draft_catch_up_row"]
        c.verify, c.sources = self.learned.verify, self.learned.sources  # shared, for the engine's lifetime
        return c

    # ---- conversations -----------------------------------------------------------------
    @property
    def verify_width(self) -> int:
        """R: rows of the widest target pass (pending token + max drafts)."""
        fixed_gamma = self.gamma if isinstance(self.gamma, int) else 0
        return max(self.max_gamma, fixed_gamma) + 1

    def _static(self, model, widths: tuple[int, ...]):
        # Room for the whole context plus one full-width pass started at its last position.
        return static_cache(model, self.context_tokens + self.verify_width, widths, self.cuda_graphs)

    def new_conversation(self, seed: int | None = None) -> Conversation:
        drafters: list[Drafter] = []
        if self.drafter in ("ngram", "hybrid"):
            drafters.append(NgramDrafter(digits=self.digit_ids))
            if self.answers.max_answers > 0:
                drafters.append(AnswerDrafter(self.answers))
        if self.drafter in ("model", "hybrid") and self.draft is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed + 1 if seed is not None else int(time.time_ns() % 2**63))
            drafters.append(ModelDrafter(self.draft.model, self.target.model.args.vocab_size, gen))
            drafters[-1].step_s = self.step_costs.get("draft_step", 0.0)
        if self.gamma == 0:
            drafters = []
        if not self.fixed_width:
            return Conversation(new_sequence(self.target.model), drafters, self._controller())
        r = self.verify_width
        for d in drafters:
            if isinstance(d, ModelDrafter):
                # Draft steps run one row; a catch-up of up to R tokens runs one R-row step.
                d.cache = self._static(d.model, (1, r))
        return Conversation(Sequence(self._static(self.target.model, (r,))), drafters, self._controller())

    def draft_calls(self, conv: Conversation, tools: list[dict], values: dict[str, list[str]] | None = None) -> None:
        """Draft `conv`'s tool calls from `tools`' schemas (and the strings in `values`, e.g.
        {"slot": open slots}) ahead of its other drafters. Nothing with speculation off."""
        if not conv.drafters or any(isinstance(d, CallDrafter) for d in conv.drafters):
            return
        conv.drafters.insert(0, CallDrafter(tools, self.encode, self.target.tokenizer.decode, dict(values or {})))

    def warm_prefix(self, prompt: list[int]) -> None:
        """Compute and keep the K/V of a prefix (a system prompt) for all later conversations,
        for the target and for the draft model alike."""
        if any(tokens == prompt for tokens, _, _ in self.prefixes):
            return
        seq = new_sequence(self.target.model, len(prompt) + 1)
        draft_cache = new_cache(self.draft.model, len(prompt) + 1) if self.draft is not None else None
        ids = torch.tensor(prompt, device=self.target.model.device)

        def run() -> None:
            forward(self.target.model, seq.cache, ids, 0, all_logits=False)
            if draft_cache is not None:
                forward(self.draft.model, draft_cache, ids, 0, all_logits=False)

        self.scheduler.call(run)
        seq.tokens = list(prompt)
        self.prefixes.append((list(prompt), seq, draft_cache))

    def _adopt_prefix(self, conv: Conversation, prompt: list[int]) -> None:
        if conv.seq.tokens or not self.prefixes:
            return
        best_len, best = 0, None
        for entry in self.prefixes:
            n = common_prefix(entry[0], prompt)
            if n > best_len:
                best_len, best = n, entry
        if best is None:
            return
        _, seq, draft_cache = best
        conv.seq.cache.copy_prefix_from(seq.cache, best_len)
        conv.seq.tokens = list(prompt[:best_len])
        for d in conv.drafters:
            if isinstance(d, ModelDrafter) and draft_cache is not None and not d.tokens:
                d.cache.copy_prefix_from(draft_cache, best_len)
                d.tokens = list(prompt[:best_len])

    # ---- prompts -----------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """The prompt's token ids. `tools` (OpenAI "tools" entries) are rendered by the
        target's own chat template (Qwen2.5: into the system block, so a system prompt's
        K/V warmed with the same tools is still a prefix of every turn's prompt). Messages
        are OpenAI-shaped: assistant `tool_calls` with JSON-string arguments, role "tool".
        A last assistant message marked `"prefix": True` is the start of the reply: the
        prompt ends with its text, and the model writes what follows (a turn plan's
        '{"act": "answer"}' line, which is the product's, not the model's choice)."""
        if messages and messages[-1].get("role") == "assistant" and messages[-1].get("prefix"):
            start = messages[-1].get("content") or ""
            return self.chat_prompt(messages[:-1], True, tools) + (self.encode(start) if start else [])
        tok = self.target.tokenizer
        if getattr(tok, "chat_template", None):
            out = tok.apply_chat_template(template_messages(messages), tools=tools or None,
                                          add_generation_prompt=add_generation_prompt, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "input_ids"):
                out = out["input_ids"]
            return list(out)
        # No template: a plain transcript.
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + ("assistant:" if add_generation_prompt else "")
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self.target.tokenizer.encode(text, add_special_tokens=False))

    def open_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt of `messages` up to the end of the last message's text as far as more
        text after it would not change its tokens: what every prompt whose last message
        goes on from this text starts with (a caller's words so far, `prefill`). Found as
        the common prefix of the prompt and that of the text continued, so the template's
        closing tokens, and a last token more text could merge with, are left out."""
        if not messages or not isinstance(messages[-1].get("content"), str):
            return []
        more = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + " zq, 7 wx"}]
        a, b = self.chat_prompt(messages, True, tools), self.chat_prompt(more, True, tools)
        return a[:common_prefix(a, b)]

    def prefill(self, prompt: list[int], conversation: Conversation, cancel: threading.Event | None = None,
                observe: Observe | None = None) -> int:
        """Compute the K/V of `prompt` into the conversation's cache now, generating nothing
        kept: a later prompt that starts with it prefills only the rest (the caller's words
        while they still speak, pipeline/stages/preempt.py). The one pass is the prefill of
        a one-token generation, whose token is not cached (the decoder holds it as pending);
        the common-prefix reuse that keeps every prompt exact does the rest. Returns the
        tokens the cache holds afterwards. `observe`: decoder.Observe, of that pass."""
        if len(prompt) < 2:
            return len(conversation.seq.tokens)
        for _ in self.stream(prompt, SamplingParams(max_new_tokens=1), conversation, cancel, observe=observe):
            pass
        return len(conversation.seq.tokens)

    def end_mass(self, logits: torch.Tensor) -> float:
        """The probability a row of logits gives to the tokens that end a sentence or a
        message (end_ids): after a caller's words without their final mark, how likely
        the model thinks they end their message ("... a cleaning for next" near 0, "...
        on Saturday" near 1)."""
        ends = torch.tensor(self.end_ids, device=logits.device)
        return float(torch.softmax(logits.float(), -1)[ends].sum())

    def end_probability(self, prompt: list[int], conversation: Conversation,
                        cancel: threading.Event | None = None) -> float | None:
        """Prefill `prompt` as `prefill` does and return end_mass at its last row: `prompt`
        is a caller's words without their final mark (open_prompt). None when nothing was
        computed (a prompt under 2 tokens, or cancelled first). A preemptive start reads the
        same row off its own prefill instead (backend.stream, `words_end`)."""
        seen: list[float] = []
        self.prefill(prompt, conversation, cancel, Observe(0, lambda row: seen.append(self.end_mass(row))))
        return seen[0] if seen else None

    @property
    def end_ids(self) -> list[int]:
        """The target's tokens that end a sentence or a message: every token whose text is
        only end marks (".", "?", "!", "...", "?!", with or without spaces and newlines),
        and its end-of-message tokens."""
        if self._end_ids is None:
            tok = self.target.tokenizer
            vocab = self.target.model.args.vocab_size
            marks = {i for i in range(min(vocab, len(tok))) if _is_end_mark(tok.decode([i]))}
            self._end_ids = sorted(marks | {i for i in self.target.eos_ids if i < vocab})
        return self._end_ids

    def count_tokens(self, messages: list[dict]) -> int:
        return len(self.chat_prompt(messages))

    # ---- generation --------------------------------------------------------------------
    def stream(
        self,
        prompt: list[int],
        params: SamplingParams,
        conversation: Conversation | None = None,
        cancel: threading.Event | None = None,
        observe: Observe | None = None,
    ) -> Iterator[TokenGroup]:
        # A constraint compiles before anything runs: a bad one is an error with no token out.
        guide = self.grammars.start(params.constraint) if params.constraint is not None else None
        conv = conversation or self.new_conversation(params.seed)
        prompt = realign(conv.seq.tokens, prompt, self.target.tokenizer.decode)
        self._adopt_prefix(conv, prompt)
        stats = GenerationStats()
        conv.last_stats = stats
        detok = IncrementalDetokenizer(self.target.tokenizer, params.stop)
        scheduler = self.scheduler
        gen = Generation(params, self.target.eos_ids, self.context_tokens, cancel, self.lock, scheduler, guide,
                         observe)
        drafters = conv.drafters
        if guide is not None and drafters:
            # What the constraint forces is drafted first, for free (accepted with certainty).
            drafters = [GrammarDrafter(guide), *drafters]
        written: list[int] = []
        with scheduler.active(), torch.inference_mode():
            for group in speculative_stream(self.target.model, conv.seq, prompt, drafters, conv.controller, detok,
                                            gen, stats):
                written += group.token_ids
                if group.finish_reason in ("eos", "stop", "length") and params.greedy:
                    # A whole greedy answer (not one cut short): later greedy answers may
                    # draft from it (a sampled one is drafted from none: llm/answer_memory.py).
                    self.answers.add(prompt, written)
                yield group

    def generate(self, prompt: list[int], params: SamplingParams, conversation: Conversation | None = None) -> tuple[list[int], list[TokenGroup], GenerationStats]:
        conv = conversation or self.new_conversation(params.seed)
        groups = list(self.stream(prompt, params, conv))
        ids = [t for g in groups for t in g.token_ids]
        return ids, groups, conv.last_stats


def _is_end_mark(text: str) -> bool:
    text = text.strip()
    return bool(text) and all(c in ".?!" for c in text)


def realign(cached: list[int], prompt: list[int], decode: Callable[[list[int]], str]) -> list[int]:
    """`prompt` with the conversation's cached tokens in place of a re-encoding of the same
    text. A turn's prompt renders the previous answer as text, and the tokenizer may split
    that text otherwise than the model wrote it ("1 p.m." written as other tokens than it
    encodes to): the cache then parts from the prompt inside the answer, and the answer and
    everything after it would be computed again (18 of 35 prefilled tokens of a turn, the
    default 1.5B, `specvoice chat`). When the cache's tail and the prompt's next tokens
    decode to the same text, the prompt reads the tokens the model wrote, which the cache
    holds. Otherwise (a history trimmed, a message rendered otherwise) it is left as it is."""
    k = common_prefix(cached, prompt)
    if k == len(cached) or k == 0:
        return prompt
    tail = decode(cached[k:])
    if not tail or "\ufffd" in tail:
        return prompt  # bytes that are not text: equal text would not mean equal bytes
    for j in range(k + 1, len(prompt) + 1):
        text = decode(prompt[k:j])
        if text == tail:
            return [*cached, *prompt[j:]]
        if text.endswith("\ufffd") and len(text) <= len(tail):
            continue  # a character cut in the middle: the next token finishes it
        if len(text) > len(tail) or not tail.startswith(text):
            break  # past it, or not the same text
    return prompt


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-shaped messages as HF chat templates want them: an assistant round kept
    `as_written` as that text; a tool call's arguments as a
    mapping (Qwen2.5's template writes them with `tojson`; a JSON string would be quoted
    twice and the rendered call would no longer match what the model wrote, costing the
    KV cache reuse of the next round), and content never None."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("as_written"):
            # The round as the model wrote it (pipeline/stages/tools_step.py): the prompt
            # then begins with the very tokens it generated, still in the KV cache.
            out.append({"role": "assistant", "content": m["as_written"]})
            continue
        calls = m.get("tool_calls")
        if not calls and m.get("content") is not None:
            out.append(m)
            continue
        m = {**m, "content": m.get("content") or ""}
        if calls:
            m["tool_calls"] = [_template_call(c) for c in calls]
        out.append(m)
    return out


def _template_call(call: dict) -> dict:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    return {"type": "function", "function": {"name": fn.get("name", ""), "arguments": args}}


def time_steps(model, rows: tuple[int, ...], context: int = 64, repeats: int = 3, warmup: int = 0,
               fixed_width: bool = False, graphs: bool = False) -> dict[int, float]:
    """Seconds of one forward over k new rows at position `context`, for each k in `rows`:
    the best of `repeats` runs after `warmup` (on a shared machine the minimum is the
    step's cost, the rest is other load). One cache, prefilled with `context` tokens; at
    fixed width (optionally captured as CUDA graphs) a static cache with those widths."""
    widest = max(rows)
    if fixed_width:
        cache = static_cache(model, context + widest, tuple(rows), graphs)
    else:
        cache = new_cache(model, context + widest)
    ids = torch.arange(context + widest, device=model.device) % model.args.vocab_size
    costs = {}
    with torch.inference_mode():
        forward(model, cache, ids[:context], 0, all_logits=False)
        for k in rows:
            times = []
            for _ in range(warmup + repeats):
                synchronize(model.device)
                t0 = time.perf_counter()
                forward(model, cache, ids[context : context + k], context)
                synchronize(model.device)
                times.append(time.perf_counter() - t0)
            costs[k] = min(times[warmup:])
    return costs


def fixed_width_options(device: str, fixed_width: bool | None, cuda_graphs: bool | None) -> tuple[bool, bool]:
    """Resolve the fixed-width / CUDA-graph options for a device (None: the device's default)."""
    on_cuda = str(device).startswith("cuda")
    if fixed_width is None:
        fixed_width = on_cuda
    if cuda_graphs is None:
        cuda_graphs = on_cuda and fixed_width
    if cuda_graphs and not on_cuda:
        raise ValueError(f"cuda_graphs needs device cuda (got {device!r}); on CPU use fixed_width without graphs")
    if cuda_graphs and not fixed_width:
        raise ValueError("cuda_graphs captures the fixed-width steps: it needs fixed_width=True")
    return bool(fixed_width), bool(cuda_graphs)


def one_gemm(model) -> None:
    """Switch "rowwise" float linears to one GEMM per layer. At a fixed width a GEMM treats
    every row alike, so row-at-a-time batch invariance is no longer needed (same weights)."""
    for m in model.modules():
        if isinstance(m, Linear) and m.mode == "rowwise":
            m.mode = "float"
    if model.mode == "rowwise":
        model.mode = "float"
