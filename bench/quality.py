"""`specvoice bench quality`: does the agent state the facts, and only the facts?

A fact-checked question set (bench/data/quality.json) over the four demo businesses
(demo/data/businesses/*.toml) is put to the agent, greedy. Each answer is checked by
rules, never by another model: every `must` fact has to be there (any one of its
alternatives) and no `must_not` claim may match. Prompts are built by the same builder
a call uses (pipeline/receptionist/business.py), so a prompt option measured here is the option a
call gets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from bench import QUALITY, report_header

HELP = "answer quality: how many answers are correct and how many state a false claim, per prompt variant"
DESCRIPTION = """\
Puts every question of bench/data/quality.json (96 questions over the four demo
businesses: single questions, 2-3 turn follow-ups, questions the facts do not answer,
and false premises like "you're open Sundays, right?"; 64 "dev" questions the prompt
options were compared on, 16 "holdout" ones written afterwards, and 16 more holdout
ones written after the fact guard was tuned on the saved answers) to the agent, greedy,
and checks each answer by rules:

  correct       every fact the answer must state is there, and no false claim
  false claim   a rule for a claim the answer must not make matched (a wrong time,
                price or day, an invented offer, agreeing with a false premise)

Prompt variants are compared side by side in one run, question by question (this
machine is noisy; speeds count only within one run):

  before           the prompts as they were: one paragraph of facts, no rules (dental: the
                   old default agent prompt; others: the prompts of bench/data/dialogues.json)
  paragraph        built from the business config: one paragraph, no rules, no examples
  lines            one labelled fact a line; no rules, no examples
  paragraph_rules  paragraph + the rules (only the facts; say "I'm not sure about that. I can
                   take a message..." rather than guess; never agree with what they don't say)
  rules            lines + the rules
  examples         lines + worked examples filled from the facts, no rules
  rules_examples   lines + rules + examples
  checker          lines + rules, opening "callers often get facts wrong; compare..."
  config           what --config's [agent] says (the default config: the shipped default)
  tools            config's prompt as a call with [tools] enabled has it (a tools paragraph,
                   then the rules as rules for questions) and the tool schemas; scores what
                   the caller would hear and counts the answers that called a tool instead
  guard            config's prompt through the call's own turn loop (pipeline/conversation.py:
                   history, respond stage) with the fact guard on every sentence: scores what
                   the caller hears; each answer records the sentences the guard held back
  plan             as guard, with [tools] plan: the turn's constrained plan line first (not
                   heard), then the answer (or an act on a fresh database); side by side with
                   guard it measures what the plan adds to a question's first sentence

--guard with --rescore adds "<variant>+guard" for every saved variant: its answers as the
fact guard would have let them through (greedy answers are deterministic, so this is what
the same run would have said with the guard on; no model needed).

Speed is reported per variant: tokens/s after the first token, TTFT and first-sentence
latency (median, with the system prompt's K/V already computed, as on a call), and the
one-off prefill of each business's system prompt (tokens and seconds).

examples:
  specvoice bench quality --out quality.json                       # before vs the shipped default
  specvoice bench quality --variants before,paragraph,lines,rules,examples,config
  specvoice bench quality --turns 8 --variants config              # a quick look at 8 questions
  specvoice bench quality --business dental --show                 # print each answer and its verdict
  specvoice bench quality --rescore quality.json --show            # re-check saved answers after a rule change
"""

QUESTIONS = QUALITY
CATEGORIES = ("single", "followup", "unknown", "false_premise")

# Prompt options per variant, as AgentConfig fields (None: the prompts from before).
_OFF = {"prompt_rules": False, "prompt_examples": False, "prompt_persona": "role"}
VARIANTS: dict[str, dict | None] = {
    "before": None,
    "paragraph": {"prompt_layout": "paragraph", **_OFF},
    "lines": {"prompt_layout": "lines", **_OFF},
    "paragraph_rules": {"prompt_layout": "paragraph", **_OFF, "prompt_rules": True},
    "rules": {"prompt_layout": "lines", **_OFF, "prompt_rules": True},
    "examples": {"prompt_layout": "lines", **_OFF, "prompt_examples": True},
    "rules_examples": {"prompt_layout": "lines", **_OFF, "prompt_rules": True, "prompt_examples": True},
    "checker": {"prompt_layout": "lines", **_OFF, "prompt_rules": True, "prompt_persona": "checker"},
    "config": {},
    # The config's prompt as a call with [tools] enabled sees it (pipeline.agent.system_prompt:
    # the tools paragraph, then the rules for questions) with the tool schemas in the chat template; the
    # answer is what the caller would hear (text before a tool call), and a tool call is counted.
    "tools": {},
    # The config's prompt through the call's turn loop with the fact guard (pipeline/receptionist/guard.py).
    "guard": {},
    # As "guard", with [tools] plan: each turn a constrained plan first (pipeline/receptionist/plan.py), the
    # answer after it, on a fresh database seeded with the business's slots.
    "plan": {},
}
OPTIONS = ("prompt_layout", "prompt_rules", "prompt_examples", "prompt_persona")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config name or TOML file: the models and the [agent] prompt options of 'config'")
    p.add_argument("--variants", default="before,config",
                   help=f"comma-separated prompt variants, side by side ({','.join(VARIANTS)}); default: before,config")
    p.add_argument("--turns", type=int, default=None, help="only the first N questions (default: all)")
    p.add_argument("--business", help="only this business's questions (dental, bistro, isp, shop)")
    p.add_argument("--ids", help="only these questions (comma-separated ids)")
    p.add_argument("--split", choices=["dev", "holdout"], help="only the dev or the held-out questions")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer budget (default: the config's llm.max_new_tokens)")
    p.add_argument("--questions", type=Path, default=QUESTIONS, help="question set (JSON)")
    p.add_argument("--show", action="store_true", help="print every answer with its verdict")
    p.add_argument("--guard", action="store_true",
                   help="with --rescore: add each variant's answers as the fact guard would have let them through")
    p.add_argument("--rescore", type=Path, metavar="JSON",
                   help="no model: check the answers of an earlier run's JSON again against the current rules")
    p.add_argument("--out", type=Path, help="write the JSON results here")


# ---------------------------------------------------------------- normalising text

_NUMBERS = {w: i for i, w in enumerate(
    ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"])}
_TENS = {w: 10 * i for i, w in enumerate(["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]) if w != "_"}
_NUM_WORD = r"\b(?:(" + "|".join(_TENS) + r")(?:[- ](" + "|".join(list(_NUMBERS)[1:10]) + r"))?|(" + "|".join(_NUMBERS) + r"))\b"


def _number_word(m: re.Match) -> str:
    if m.group(3):
        return str(_NUMBERS[m.group(3)])
    return str(_TENS[m.group(1)] + (_NUMBERS[m.group(2)] if m.group(2) else 0))


def normalize(text: str) -> str:
    """Text in one canonical spelling, so rules need not list every way to say a fact.

    "Nine A.M." / "9:00 am" / "9am" / "9 o'clock in the morning" -> "9 am";
    "eighty-nine dollars" -> "$89"; "$89.00" -> "$89"; "check-up" -> "check up";
    "Dr." -> "dr" (so the sentence splitter does not cut there); lower case, one space.
    """
    # "a.m." ending a sentence keeps one dot, so the sentence splitter still sees the end.
    t = re.sub(r"\b([aApP])\.\s?[mM]\.(?=\s+[A-Z])", r"\1m.", text)
    t = t.lower()
    t = t.translate(str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-",
                                   "\u2014": " - ", "\u00a0": " "}))
    t = re.sub(r"\b(dr|mr|mrs|ms|st|ave)\.", r"\1", t)
    t = re.sub(_NUM_WORD, _number_word, t)
    t = re.sub(r"\b([ap])\.\s?m\b\.?", r"\1m", t)  # a.m. / a. m. / p.m
    t = re.sub(r"(\d)\s*([ap]m)\b", r"\1 \2", t)  # 9am -> 9 am
    t = re.sub(r"\s*o'?clock\b", "", t)
    t = re.sub(r"(\d) in the morning\b", r"\1 am", t)
    t = re.sub(r"(\d) (?:in the afternoon|in the evening|at night)\b", r"\1 pm", t)
    t = re.sub(r"\bnoon\b", "12 pm", t)
    t = re.sub(r"\bmidnight\b", "12 am", t)
    t = re.sub(r"\b(\d{1,2}) (15|30|45) ([ap]m)\b", r"\1:\2 \3", t)  # "ten thirty am"
    t = re.sub(r"\b(\d{1,2}):00\b", r"\1", t)
    t = re.sub(r"\b(\d+) dollars? and (\d{1,2}) cents?\b", lambda m: f"${m.group(1)}.{int(m.group(2)):02d}", t)
    t = re.sub(r"(?<!\$)\b(\d+(?:\.\d\d)?) (?:dollars?|bucks|usd)\b", r"$\1", t)
    t = re.sub(r"\$(\d+)\.00\b", r"$\1", t)
    t = re.sub(r"(\d),(\d{3})\b", r"\1\2", t)
    t = re.sub(r"(?<=[a-z])-(?=[a-z])", " ", t)  # check-up -> check up, gluten-free -> gluten free
    t = re.sub(r"\bcheckups?\b", lambda m: "check up" + ("s" if m.group(0).endswith("s") else ""), t)
    return re.sub(r"\s+", " ", t).strip()


def sentences(normalized: str) -> list[str]:
    """Sentences of normalised text (abbreviation dots are gone; "$39.99" is not cut)."""
    return [s for s in re.split(r"(?<=[.!?;])\s+", normalized) if s]


# ---------------------------------------------------------------- rules


def expand(pattern: str, macros: dict[str, str]) -> str:
    """Replace {{name}} with the question set's macro `name` (shared pieces of regex)."""

    def sub(m: re.Match) -> str:
        if m.group(1) not in macros:
            raise KeyError(f"unknown macro {{{{{m.group(1)}}}}} in rule {pattern!r}")
        return macros[m.group(1)]

    return re.sub(r"\{\{(\w+)\}\}", sub, pattern)


def compile_alternative(alt: str, macros: dict[str, str]) -> re.Pattern:
    """An alternative of a `must` fact: "re:REGEX" on normalised text, or else a phrase that
    must appear, normalised the same way, as whole words ("9 am" is not in "19 am")."""
    if alt.startswith("re:"):
        return re.compile(expand(alt[3:], macros))
    return re.compile(r"(?<![\w$])" + re.escape(normalize(alt)) + r"(?!\w|\.\d)")


@dataclass
class Rules:
    must: list[list[re.Pattern]]  # every fact must be there, each in any one of its spellings
    must_not: list[re.Pattern]  # no claim may match in any one sentence
    must_text: list[str] = field(default_factory=list)  # the facts as written, for the report

    @classmethod
    def build(cls, must: list[list[str]], must_not: list[str], macros: dict[str, str]) -> Rules:
        return cls([[compile_alternative(a, macros) for a in fact] for fact in must],
                   [re.compile(expand(p, macros)) for p in must_not], [" | ".join(fact) for fact in must])


@dataclass
class Verdict:
    correct: bool
    missing: list[str]  # the must facts not found
    false_claims: list[str]  # "pattern :: sentence" of every must_not that matched

    @property
    def false_claim(self) -> bool:
        return bool(self.false_claims)


def check(answer: str, rules: Rules) -> Verdict:
    """Correct = every must fact present and no must_not claim. must facts are looked for in
    the whole answer; must_not claims within one sentence at a time, so a pattern's ".*"
    cannot join "we're closed Sunday" to "open Saturday" from the next sentence."""
    text = normalize(answer)
    missing = [rules.must_text[i] if rules.must_text else str(i) for i, fact in enumerate(rules.must)
               if not any(p.search(text) for p in fact)]
    claims = [f"{p.pattern} :: {s}" for p in rules.must_not for s in sentences(text) if p.search(s)]
    return Verdict(bool(text) and not missing and not claims, missing, claims)


# ---------------------------------------------------------------- the question set


@dataclass
class Question:
    id: str
    business: str
    category: str
    split: str  # "dev": used to compare prompt options; "holdout": only measured
    messages: list[dict]  # the caller's turns (and the agent's earlier answers); no system prompt
    rules: Rules


def load_questions(path: Path = QUESTIONS) -> tuple[list[Question], dict]:
    """The questions with compiled rules (a business's shared must_not added to each of its
    questions), and the raw JSON."""
    data = json.loads(path.read_text(encoding="utf-8"))
    macros = data.get("macros", {})
    shared = {k: v.get("must_not", []) for k, v in data["businesses"].items()}
    out = []
    for q in data["questions"]:
        rules = Rules.build(q.get("must", []), q.get("must_not", []) + shared[q["business"]], macros)
        out.append(Question(q["id"], q["business"], q["category"], q.get("split", "dev"), q["messages"], rules))
    return out, data


def business_file(key: str, data: dict, root: Path = QUESTIONS.parent) -> Path:
    """The TOML file of business `key` of the question set: in the set's folder `root`, else
    one of the demo businesses (demo/data/businesses)."""
    from demo import BUSINESSES

    name = data["businesses"][key]["config"]
    return root / name if (root / name).is_file() else BUSINESSES / name


def load_business(key: str, data: dict, root: Path = QUESTIONS.parent):
    """Business `key` of the question set, from its TOML file (`business_file`)."""
    from pipeline.receptionist.business import BusinessConfig

    path = business_file(key, data, root)
    return BusinessConfig.model_validate(tomllib.loads(path.read_text(encoding="utf-8"))["business"])


def variant_prompts(variant: str, agent, data: dict, root: Path = QUESTIONS.parent) -> dict[str, str]:
    """business key -> system prompt for this variant (`agent`: the config's AgentConfig).
    "before" is the prompt each business had before prompts were built from its config."""
    options = VARIANTS[variant]
    if options is None:
        return {key: b["before"] for key, b in data["businesses"].items()}
    a = agent.model_copy(update=options)
    if variant in ("tools", "plan"):
        return {key: tools_prompt(a, load_business(key, data, root), plan=variant == "plan")
                for key in data["businesses"]}
    return {key: a.built_prompt(load_business(key, data, root)) for key in data["businesses"]}


def tools_prompt(agent, business, plan: bool = False) -> str:
    """The system prompt of a call on `business` with [tools] enabled (and `plan`)."""
    from pipeline.receptionist.prompt import system_prompt
    from pipeline.config import Config, ToolsConfig

    built = agent.model_copy(update={"system_prompt": agent.built_prompt(business)})
    return system_prompt(Config.model_construct(agent=built, business=business,
                                                tools=ToolsConfig(enabled=True, plan=plan)))


# ---------------------------------------------------------------- running


@dataclass
class Answer:
    text: str
    tokens: int
    ttft_s: float
    first_sentence_s: float | None
    tokens_per_s: float
    passes: int
    tool_calls: list[str] = field(default_factory=list)  # tools the model called ("?" for a malformed call)


def answer(engine, prompt: list[int], params, tools: bool = False) -> Answer:
    """One greedy answer. With `tools`, only the speakable text counts (a tool call's text is
    held back from the caller, as llm/tool_calls.py does on a call) and the call is noted."""
    from bench.llm import FirstSentenceClock
    from llm.tool_calls import ToolCallFilter
    from pipeline.receptionist.tools import TOOLS

    conv = engine.new_conversation()
    filt = ToolCallFilter(tool_names=frozenset(TOOLS)) if tools else None
    t0 = time.perf_counter()
    clock = FirstSentenceClock(t0)
    text, times = [], []
    for g in engine.stream(prompt, params, conv):
        now = time.perf_counter()
        said = filt.feed(g.text) if filt else g.text
        text.append(said)
        times += [now] * len(g.token_ids)
        clock.feed(said, len(g.token_ids), now)
    called: list[str] = []
    if filt:
        rest, parse = filt.finish()
        text.append(rest)
        called = [c.name for c in parse.calls] or (["?"] if parse.found else [])
    clock.end(time.perf_counter())
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    rate = (len(times) - 1) / span if span > 0 else 0.0
    return Answer("".join(text).strip(), len(times), clock.first_token or 0.0, clock.first_sentence, rate,
                  conv.last_stats.passes, called)


def rate(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(rows: list[dict]) -> dict:
    out = {"questions": len(rows), "correct": rate([r["correct"] for r in rows]),
           "false_claim": rate([r["false_claim"] for r in rows])}
    if any("tool_calls" in r for r in rows):
        out["tool_call"] = rate([bool(r.get("tool_calls")) for r in rows])
    return out


def variant_report(rows: list[dict], prefill: dict) -> dict:
    groups = lambda key: {k: summarize([r for r in rows if r[key] == k]) for k in dict.fromkeys(r[key] for r in rows)}
    return {
        **summarize(rows),
        "by_business": groups("business"),
        "by_category": groups("category"),
        "by_split": groups("split"),
        "speed": {
            "tokens_per_s": median([r["tokens_per_s"] or None for r in rows]),
            "ttft_s": median([r["ttft_s"] for r in rows]),
            "first_sentence_s": median([r["first_sentence_s"] for r in rows]),
            "answer_tokens": median([r["tokens"] for r in rows]),
            "tokens_per_pass": (sum(r["tokens"] for r in rows) / sum(r["passes"] for r in rows))
            if sum(r["passes"] for r in rows) else None,
            "system_prompt_tokens": median([p["tokens"] for p in prefill.values()]),
            "prefill_s": median([p["seconds"] for p in prefill.values()]),
        },
        "prefill": prefill,
        "questions": rows,
    }


def rescore(args: argparse.Namespace) -> int:
    """Check the saved answers of an earlier run against the current rules (greedy answers
    are deterministic, so a rule can be fixed without running the model again)."""
    questions, _ = load_questions(args.questions)
    by_id = {q.id: q for q in questions}
    report = json.loads(args.rescore.read_text(encoding="utf-8"))
    for v, entry in report["variants"].items():
        rows = [r for r in entry["questions"] if r["id"] in by_id]
        for r in rows:
            r.setdefault("split", by_id[r["id"]].split)
            verdict = check(r["answer"], by_id[r["id"]].rules)
            r.update(correct=verdict.correct, false_claim=verdict.false_claim, missing=verdict.missing,
                     false_claims=verdict.false_claims)
            if args.show:
                show(print, v, by_id[r["id"]], r["answer"], verdict)
        entry.update(variant_report(rows, entry["prefill"]))
    if args.guard:
        report["variants"].update({f"{v}+guard": guarded_variant(entry, by_id, args.questions)
                                   for v, entry in list(report["variants"].items()) if not v.endswith("+guard")})
    report["rescored_from"] = str(args.rescore)
    print_table(report)
    for v, entry in report["variants"].items():
        if entry.get("guard_ms_per_sentence"):
            c = entry["guard_ms_per_sentence"]
            print(f"{v}: the guard held back {entry['guarded_sentences']} sentences; it took {c['median']:.3f} ms "
                  f"of CPU a sentence (median; p95 {c['p95']:.3f}, max {c['max']:.3f}; {c['sentences']} sentences; "
                  f"wall median {c['wall_median']:.3f}, p95 {c['wall_p95']:.3f})")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def guarded_variant(entry: dict, by_id: dict[str, Question], questions: Path) -> dict:
    """A saved variant's answers as the fact guard lets them through, re-checked. The guard
    sees what it sees on a call: the caller's line, the caller's earlier lines, the facts."""
    from pipeline.receptionist.guard import FactGuard, TurnGuard
    from pipeline.sentences import split_sentences

    data = json.loads(questions.read_text(encoding="utf-8"))
    guards = {key: FactGuard(load_business(key, data, questions.parent)) for key in data["businesses"]}
    rows, costs, walls = [], [], []
    for r in entry["questions"]:
        q = by_id.get(r["id"])
        if q is None:
            continue
        users = [m["content"] for m in q.messages if m["role"] == "user"]
        turn = TurnGuard(guards[q.business], users[-1], earlier=users[:-1])
        said = []
        for sentence in split_sentences(r["answer"]):
            # CPU time of this thread: what the guard costs, without the time the shared
            # machine's other processes took the core away (wall time kept beside it).
            t, w = time.thread_time(), time.perf_counter()
            out = turn(sentence)  # the turn's first sentence also builds what the turn may rest on
            costs.append(time.thread_time() - t)
            walls.append(time.perf_counter() - w)
            if out is not None:
                said.append(out)
        text = " ".join(said)
        verdict = check(text, q.rules)
        rows.append({**r, "answer": text, "unguarded": r["answer"], "guarded": turn.guarded,
                     "correct": verdict.correct, "false_claim": verdict.false_claim, "missing": verdict.missing,
                     "false_claims": verdict.false_claims})
    out = {**{k: v for k, v in entry.items() if k != "questions"}, **variant_report(rows, entry["prefill"])}
    out["guarded_sentences"] = sum(len(r["guarded"]) for r in rows)
    costs.sort()
    walls.sort()
    out["guard_ms_per_sentence"] = {"sentences": len(costs), "median": round(1000 * statistics.median(costs), 4),
                                    "p95": round(1000 * costs[int(0.95 * (len(costs) - 1))], 4),
                                    "max": round(1000 * costs[-1], 4), "clock": "thread CPU time",
                                    "wall_median": round(1000 * statistics.median(walls), 4),
                                    "wall_p95": round(1000 * walls[int(0.95 * (len(walls) - 1))], 4)} if costs else None
    return out


def turn_answer(engine, config, business, q: Question, prompt: str, plan: bool = False):
    """One question through the call's text turn loop (pipeline/conversation.py) with the
    fact guard: the earlier exchanges of a follow-up are the history, the last line the turn.
    `plan`: with [tools] plan and a ToolBox on a fresh SQLite file seeded with the slots."""
    import tempfile

    from pipeline.receptionist.bookings import open_store
    from pipeline.receptionist.tools import ToolBox

    if not plan:
        return _turn_answer(engine, config, business, q, prompt, None)
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        store = open_store(Path(tmp) / "b.sqlite", open_slots=business.open_slots)
        try:
            return _turn_answer(engine, config, business, q, prompt, ToolBox(store, f"quality-{q.id}"))
        finally:
            store.close()


def _turn_answer(engine, config, business, q: Question, prompt: str, box):
    import asyncio

    from llm.backend import SpeculativeBackend
    from pipeline.conversation import TextConversation
    from pipeline.receptionist.guard import FactGuard

    if box is not None:
        config = config.model_copy(update={"business": business, "tools": config.tools.model_copy(
            update={"enabled": True, "plan": True})})
    conv = TextConversation(config, SpeculativeBackend(engine), engine.count_tokens, guard=FactGuard(business),
                            prompt=prompt, toolbox=box)
    msgs = q.messages
    for i in range(0, len(msgs) - 1, 2):
        conv.history.add(msgs[i]["content"], msgs[i + 1]["content"] if i + 1 < len(msgs) - 1 else "")
    turn = asyncio.run(conv.turn(msgs[-1]["content"]))
    st = turn.result.stats
    first = turn.timeline.metrics()
    tokens = st.new_tokens if st is not None else 0
    span = (st.total_s - (st.ttft_s or 0.0)) if st is not None else 0.0
    return Answer(turn.agent, tokens, first.get("ttft") or 0.0, first.get("first_sentence_latency"),
                  (tokens - 1) / span if st is not None and span > 0 and tokens > 1 else 0.0,
                  st.passes if st is not None else 0), turn.result.guarded, turn.result.plan


def show(write, variant: str, q: Question, text: str, verdict: Verdict) -> None:
    mark = "ok" if verdict.correct else ("FALSE" if verdict.false_claim else "miss")
    write(f"[{variant}] {mark:5s} {q.id}: {q.messages[-1]['content']}\n    -> {text}"
          + "".join(f"\n       missing: {m}" for m in verdict.missing)
          + "".join(f"\n       false: {c}" for c in verdict.false_claims))


def run(args: argparse.Namespace) -> int:
    if args.rescore:
        return rescore(args)
    from tqdm import tqdm

    from pipeline.agent import load_engine, sampling_params
    from pipeline.config import load_config
    from pipeline.receptionist.tools import TOOL_SCHEMAS

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        print(f"error: unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    questions, data = load_questions(args.questions)
    if args.business:
        if args.business not in data["businesses"]:
            print(f"error: unknown business {args.business!r}; choose from {', '.join(data['businesses'])}", file=sys.stderr)
            return 2
        questions = [q for q in questions if q.business == args.business]
    if args.split:
        questions = [q for q in questions if q.split == args.split]
    if args.ids:
        wanted = {i.strip() for i in args.ids.split(",") if i.strip()}
        unknown = wanted - {q.id for q in questions}
        if unknown:
            print(f"error: unknown question id(s) {sorted(unknown)}", file=sys.stderr)
            return 2
        questions = [q for q in questions if q.id in wanted]
    questions = questions[: args.turns]
    config = load_config(args.config)
    llm = config.llm
    params = sampling_params(config)
    if args.max_new_tokens:
        params = dataclasses.replace(params, max_new_tokens=args.max_new_tokens)
    prompts = {v: variant_prompts(v, config.agent, data, args.questions.parent) for v in variants}

    print(f"loading {llm.target} ({llm.drafter} drafts, {llm.device}, {llm.dtype}) ...", file=sys.stderr)
    engine = load_engine(llm, answer_memory=0)  # variants repeat the questions
    # The product computes each system prompt's K/V once per process; time that once here.
    used = dict.fromkeys(q.business for q in questions)
    prefill: dict[str, dict] = {v: {} for v in variants}
    schemas = {v: TOOL_SCHEMAS if v == "tools" else None for v in variants}
    for v in variants:
        for key in used:
            ids = engine.chat_prompt([{"role": "system", "content": prompts[v][key]}], add_generation_prompt=False,
                                     tools=schemas[v])
            t = time.perf_counter()
            engine.warm_prefix(ids)
            prefill[v][key] = {"tokens": len(ids), "seconds": time.perf_counter() - t}

    businesses = {key: load_business(key, data, args.questions.parent) for key in data["businesses"]}
    # The turn loop samples as the config says, with this run's answer budget.
    turn_config = config.model_copy(update={"llm": config.llm.model_copy(update={
        "max_new_tokens": params.max_new_tokens})})
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    bar = tqdm(total=len(questions) * len(variants), desc="bench quality", unit="answer", file=sys.stderr)
    for q in questions:  # variants interleaved question by question: the machine's noise hits all alike
        for v in variants:
            bar.set_postfix_str(f"{q.id} {v}")
            msgs = [{"role": "system", "content": prompts[v][q.business]}] + q.messages
            extra = {}
            if v in ("guard", "plan"):
                a, guarded, plan = turn_answer(engine, turn_config, businesses[q.business], q, prompts[v][q.business],
                                               plan=v == "plan")
                extra = {"guarded": guarded, **({"plan": plan} if v == "plan" else {})}
            else:
                a = answer(engine, engine.chat_prompt(msgs, tools=schemas[v]), params, tools=schemas[v] is not None)
            verdict = check(a.text, q.rules)
            if schemas[v] is not None:
                extra = {"tool_calls": a.tool_calls}
            rows[v].append({**extra, "id": q.id, "business": q.business, "category": q.category, "split": q.split,
                            "question": q.messages[-1]["content"], "answer": a.text, "correct": verdict.correct,
                            "false_claim": verdict.false_claim, "missing": verdict.missing,
                            "false_claims": verdict.false_claims, "tokens": a.tokens, "ttft_s": a.ttft_s,
                            "first_sentence_s": a.first_sentence_s, "tokens_per_s": a.tokens_per_s, "passes": a.passes})
            if args.show:
                show(bar.write, v, q, a.text, verdict)
            bar.update()
    bar.close()

    report = {
        **report_header("quality", llm),
        "questions": len(questions),
        "max_new_tokens": params.max_new_tokens,
        "variants": {v: {"options": VARIANTS[v] if VARIANTS[v] != {} else {k: getattr(config.agent, k) for k in OPTIONS},
            **variant_report(rows[v], prefill[v])} for v in variants},
        "prompts": prompts,
    }
    print_table(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def print_table(report: dict) -> None:
    def pct(v):
        return "-" if v is None else f"{v:.0%}"

    def num(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    variants = report["variants"]
    w = max(8, *(len(v) for v in variants))
    print(f"\n{report['questions']} questions, greedy, max {report['max_new_tokens']} new tokens, "
          f"{report['models']['target']} ({report['models']['drafter']} drafts)")
    head = (f"{'variant':{w}s} {'correct':>7s} {'false':>6s} {'tool':>5s} {'tok/s':>6s} {'tok/pass':>8s} {'TTFT s':>7s} "
            f"{'1st sent s':>10s} {'sys tok':>7s} {'prefill s':>9s}")
    print(head)
    print("-" * len(head))
    for v, e in variants.items():
        s = e["speed"]
        print(f"{v:{w}s} {pct(e['correct']):>7s} {pct(e['false_claim']):>6s} {pct(e.get('tool_call')):>5s} "
              f"{num(s['tokens_per_s'], '.1f'):>6s} "
              f"{num(s['tokens_per_pass']):>8s} {num(s['ttft_s'], '.3f'):>7s} {num(s['first_sentence_s'], '.3f'):>10s} "
              f"{num(s['system_prompt_tokens'], '.0f'):>7s} {num(s['prefill_s'], '.2f'):>9s}")
    for key, title in (("by_business", "business"), ("by_category", "category"), ("by_split", "split")):
        names = list(next(iter(variants.values()))[key])
        print(f"\ncorrect / false claim by {title}")
        print(f"{title:14s} " + " ".join(f"{v:>{max(w, 11)}s}" for v in variants))
        for n in names:
            cells = [f"{pct(variants[v][key][n]['correct'])} / {pct(variants[v][key][n]['false_claim'])}" for v in variants]
            print(f"{n:14s} " + " ".join(f"{c:>{max(w, 11)}s}" for c in cells))
    print("\nper question (. correct, x false claim, - a fact missing)")
    rows = [{r["id"]: r for r in variants[v]["questions"]} for v in variants]
    ids = list(rows[0])
    print(f"{'question':26s} " + " ".join(f"{v:>{w}s}" for v in variants))
    for qid in ids:
        marks = []
        for by_id in rows:
            r = by_id.get(qid)
            marks.append(" " if r is None else "." if r["correct"] else ("x" if r["false_claim"] else "-"))
        print(f"{qid:26s} " + " ".join(f"{m:>{w}s}" for m in marks))
