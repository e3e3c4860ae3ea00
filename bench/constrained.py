"""`specvoice bench constrained`: constrained decoding with and without speculation, side by side.

Two kinds of constrained output on the default models, each task run in every mode one
after the other (so the machine's noise hits all modes alike):

- tool calls: the first line of each bench-tools dialogue that asks for an action, the
  model's call written after `<tool_call>\\n`, constrained by a JSON schema of the tools
  (the name one of the tools, its arguments by the tool's schema, a slot one of the open
  slots);
- extraction: caller lines turned into a small JSON record (intent, day, time, name).

Modes:
  call_drafter      unconstrained, n-gram + the tool-call drafter, adaptive gamma (today's
                    tool turns; tool-call tasks only; ends at </tool_call>)
  constrained_plain the constraint, no speculation (gamma 0)
  constrained_spec  the constraint, n-gram lookup + forced tokens drafted, adaptive gamma
  constrained_spec_call  as constrained_spec, plus the tool-call drafter (tool calls only)

It also measures the mask library on the target's tokenizer: llguidance (what the
engine uses) and, when installed, xgrammar: tokenizer set-up, compile time per schema
and mask time per token; and the mask cost per target pass against a one-token step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import BOOKING_DIALOGUES

HELP = "constrained decoding: JSON tool calls and extraction, constrained with/without speculation vs the call drafter"
DESCRIPTION = __doc__.split("\n", 2)[2] + """
examples:
  specvoice bench constrained --out bench/results/constrained.json
  specvoice bench constrained --tasks 6 --modes constrained_plain,constrained_spec
"""

MODES = ("call_drafter", "constrained_plain", "constrained_spec", "constrained_spec_call")
ACTION_KINDS = ("book", "cancel", "message", "transfer", "strange_name", "change_mind", "conflict")
EXTRACT_SYSTEM = ("Read the caller's line and write what they want as JSON: intent (book, cancel, question, "
                  "message or other), day (a weekday or null), time (like 10:30 or null), name (the caller's name or null).")
EXTRACT_LINES = [
    "Hi, this is Ann Lee, can I get the Tuesday 10:30 with Dr. Patel?",
    "I need to cancel my appointment on Friday, my name is Rita Gomez.",
    "Are you open on Saturday?",
    "Could you tell Dr. Moreno that Sam Ortiz called about his crown?",
    "Book me for Wednesday at 2:15 please, I'm Marcus Brown.",
    "How much is a cleaning?",
    "It's Priya Nair, I want to move my Monday 9:00 to Thursday.",
    "Can someone call me back? This is Li Wei.",
]
EXTRACT_SCHEMA = {
    "type": "object",
    "properties": {
        "intent": {"enum": ["book", "cancel", "question", "message", "other"]},
        "day": {"anyOf": [{"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]},
                          {"type": "null"}]},
        "time": {"anyOf": [{"type": "string", "pattern": "^[0-9]{1,2}:[0-9]{2}$"}, {"type": "null"}]},
        "name": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]},
    },
    "required": ["intent", "day", "time", "name"],
    "additionalProperties": False,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config name or TOML file (models, device, dtype, business)")
    p.add_argument("--tasks", type=int, help="use only the first N tool-call tasks and N extraction tasks")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, help="write the JSON results here")


@dataclass
class Task:
    kind: str  # "tool_call" or "extract"
    id: str
    prompt: list[int]
    schema: dict
    tools: list[dict] | None = None
    opener: int = 0  # tokens of `<tool_call>\n` at the prompt's end (the call_drafter mode writes them itself)


def call_schema(tools: list[dict], slots: list[str]) -> dict:
    """A JSON schema of one tool call as Qwen2.5 writes it: {"name": ..., "arguments": {...}},
    one branch per tool (its name a constant), a slot argument one of the open slots."""
    branches = []
    for t in tools:
        fn = t["function"]
        params = json.loads(json.dumps(fn["parameters"]))
        slot = params.get("properties", {}).get("slot")
        if slot is not None and slots:
            params["properties"]["slot"] = {"enum": list(slots)}
        branches.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                         "required": ["name", "arguments"], "additionalProperties": False})
    return {"anyOf": branches}


def build_tasks(engine, config, limit: int | None) -> list[Task]:
    from pipeline.receptionist.prompt import system_prompt
    from pipeline.receptionist.tools import TOOL_SCHEMAS

    tools_config = config.model_copy(update={"tools": config.tools.model_copy(update={"enabled": True, "plan": False})})
    system = system_prompt(tools_config)
    slots = list(config.business.open_slots or [])
    schema = call_schema(TOOL_SCHEMAS, slots)
    dialogues = json.loads(BOOKING_DIALOGUES.read_text())["dialogues"]
    calls = [d for d in dialogues if d["kind"] in ACTION_KINDS and d["expect"].get("calls")]
    tasks = []
    opener = engine.encode("<tool_call>\n")
    # The system prompt's K/V once, as the product computes it once per process.
    engine.warm_prefix(engine.chat_prompt([{"role": "system", "content": system}], add_generation_prompt=False,
                                          tools=TOOL_SCHEMAS))
    engine.warm_prefix(engine.chat_prompt([{"role": "system", "content": EXTRACT_SYSTEM}], add_generation_prompt=False))
    for d in calls[:limit]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": d["lines"][-1]}]
        prompt = engine.chat_prompt(messages, tools=TOOL_SCHEMAS) + opener
        tasks.append(Task("tool_call", d["id"], prompt, schema, TOOL_SCHEMAS, len(opener)))
    for i, line in enumerate(EXTRACT_LINES[:limit]):
        messages = [{"role": "system", "content": EXTRACT_SYSTEM}, {"role": "user", "content": line}]
        tasks.append(Task("extract", f"extract_{i}", engine.chat_prompt(messages), EXTRACT_SCHEMA))
    return tasks


def run_mode(engine, task: Task, mode: str, max_new: int, slots: list[str]) -> dict:
    from llm.constrain import check_text
    from llm.types import Constraint, SamplingParams

    constraint = Constraint.json_schema(task.schema)
    conv = engine.new_conversation()
    if mode == "constrained_plain":
        conv.drafters = []  # gamma 0: plain decoding under the mask
    if mode in ("call_drafter", "constrained_spec_call"):
        engine.draft_calls(conv, task.tools, {"slot": slots})
    params = SamplingParams(max_new_tokens=max_new, stop=("</tool_call>",) if mode == "call_drafter" else (),
                            constraint=None if mode == "call_drafter" else constraint)
    # Unconstrained, the model opens its call itself (given `<tool_call>\n` it ends at once:
    # measured); its text is checked from after the opening tag.
    prompt = task.prompt[: len(task.prompt) - task.opener] if mode == "call_drafter" else task.prompt
    t0 = time.perf_counter()
    times, ids, text = [], [], []
    opening = None
    for g in engine.stream(prompt, params, conv):
        times.append(time.perf_counter())
        ids.extend(g.token_ids)
        text.append(g.text)
        if opening is None:  # what the constraint forces at its start comes with the first token
            opening = max(len(g.token_ids) - 1, 0)
    s = conv.last_stats
    written = "".join(text).strip()
    if mode == "call_drafter":
        written = written.split("<tool_call>", 1)[-1].strip()
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    passes = max(s.passes - 1, 1)  # passes after the first token (prefill is not a verify)
    return {
        "mode": mode, "task": task.id, "kind": task.kind, "ids": ids, "text": written,
        "tokens": len(ids), "passes": s.passes, "tokens_per_pass": round(s.tokens_per_pass, 3), "opening": opening or 0,
        "tokens_per_s": round((len(ids) - 1) / decode_s, 3) if decode_s > 0 else None,
        "total_s": round(time.perf_counter() - t0, 4), "forced": s.forced_tokens,
        "mask_ms_per_pass": round(1e3 * s.mask_s / passes, 4) if params.constraint else None,
        "mean_gamma": round(sum(s.gammas) / len(s.gammas), 3) if s.gammas else 0.0,
        "valid": check_text(constraint, written) is None,
    }


def library_costs(engine, tasks: list[Task], texts: list[str]) -> dict:
    """llguidance vs xgrammar on the target's tokenizer: set-up, compile per schema (fresh,
    no cache), mask per token over the constrained answers' tokens."""
    import numpy as np

    tok, vocab = engine.target.tokenizer, engine.target.model.args.vocab_size
    schemas = {json.dumps(t.schema) for t in tasks}
    pieces = [engine.encode(x) for x in texts if x]
    out: dict = {}

    import llguidance
    import llguidance.hf

    from llm.constrain import COMPACT_JSON

    t0 = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = time.perf_counter() - t0
    compile_ms, mask_ms = [], []
    words = np.empty((vocab + 31) // 32, dtype=np.int32)
    for schema in schemas:
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(schema, COMPACT_JSON), log_level=0)
        compile_ms.append(1e3 * (time.perf_counter() - t0))
    for schema, ids in zip([json.dumps(t.schema) for t in tasks], pieces):
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(schema, COMPACT_JSON), log_level=0)
        for t in ids:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)
            mask_ms.append(1e3 * (time.perf_counter() - t0))
            if not m.consume_token(t):
                break
    out["llguidance"] = _lib_summary(setup, compile_ms, mask_ms)
    try:
        import xgrammar as xgr
    except ImportError:
        out["xgrammar"] = {"missing": "pip install xgrammar==0.2.8 to measure it beside llguidance"}
        return out
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    setup = time.perf_counter() - t0
    compile_ms, mask_ms = [], []
    for schema in schemas:
        t0 = time.perf_counter()
        xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
        compile_ms.append(1e3 * (time.perf_counter() - t0))
    compiler = xgr.GrammarCompiler(info)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for schema, ids in zip([json.dumps(t.schema) for t in tasks], pieces):
        m = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": ")))
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
            mask_ms.append(1e3 * (time.perf_counter() - t0))
            if not m.accept_token(t):
                break
    out["xgrammar"] = _lib_summary(setup, compile_ms, mask_ms)
    return out


def _lib_summary(setup_s: float, compile_ms: list[float], mask_ms: list[float]) -> dict:
    return {"tokenizer_setup_s": round(setup_s, 3),
            "compile_ms_median": round(statistics.median(compile_ms), 3) if compile_ms else None,
            "compile_ms_max": round(max(compile_ms), 3) if compile_ms else None,
            "mask_ms_median": round(statistics.median(mask_ms), 4) if mask_ms else None,
            "mask_ms_p90": round(sorted(mask_ms)[int(0.9 * (len(mask_ms) - 1))], 4) if mask_ms else None,
            "masks": len(mask_ms)}


def summarize(rows: list[dict], modes: list[str]) -> dict:
    out = {}
    for kind in ("tool_call", "extract"):
        for mode in modes:
            rs = [r for r in rows if r["mode"] == mode and r["kind"] == kind]
            if not rs:
                continue
            tokens, passes = sum(r["tokens"] for r in rs), sum(r["passes"] for r in rs)
            rates = [r["tokens_per_s"] for r in rs if r["tokens_per_s"]]
            out[f"{kind}/{mode}"] = {
                "tasks": len(rs), "tokens": tokens, "passes": passes,
                "tokens_per_pass": round(tokens / passes, 3) if passes else None,
                "tokens_per_s_median": round(statistics.median(rates), 3) if rates else None,
                "forced_share": round(sum(r["forced"] for r in rs) / tokens, 3) if tokens and mode != "call_drafter" else None,
                "mask_ms_per_pass_median": (round(statistics.median(r["mask_ms_per_pass"] for r in rs), 4)
                                            if mode != "call_drafter" else None),
                "valid": f"{sum(r['valid'] for r in rs)}/{len(rs)}",
                "total_s": round(sum(r["total_s"] for r in rs), 3),
            }
    return out


def run(args: argparse.Namespace) -> int:
    from bench import report_header
    from pipeline.agent import load_engine
    from pipeline.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"error: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    engine = load_engine(config.llm, drafter="ngram", gamma="auto", answer_memory=0)  # modes repeat the prompts
    slots = list(config.business.open_slots or [])
    tasks = build_tasks(engine, config, args.tasks)
    from llm.engine import time_steps

    step_s = time_steps(engine.target.model, (1,), context=256, repeats=5)[1]  # a one-token step, measured here
    rows = []
    jobs = [(t, m) for t in tasks for m in modes if not (t.kind == "extract" and m in ("call_drafter", "constrained_spec_call"))]
    for task, mode in tqdm(jobs, desc="bench constrained", unit="run", file=sys.stderr):
        rows.append(run_mode(engine, task, mode, args.max_new_tokens, slots))
    exact = {}
    for task in tasks:
        base = next((r["ids"] for r in rows if r["task"] == task.id and r["mode"] == "constrained_plain"), None)
        for r in rows:
            if r["task"] == task.id and r["mode"].startswith("constrained_spec") and base is not None:
                exact.setdefault(r["mode"], []).append(r["ids"] == base)
    libs = library_costs(engine, tasks, [r["text"] for r in rows if r["mode"] == "constrained_plain"])
    summary = summarize(rows, modes)
    report = {
        **report_header("constrained", config.llm),
        "target_step_ms": round(1e3 * step_s, 2) if step_s else None,
        "max_gamma": engine.max_gamma,
        "summary": summary,
        "exact_vs_constrained_plain": {m: f"{sum(v)}/{len(v)}" for m, v in exact.items()},
        "libraries": libs,
        "mask_cost_per_pass_vs_step": {
            k: round(v["mask_ms_per_pass_median"] / (1e3 * step_s), 4)
            for k, v in summary.items() if v.get("mask_ms_per_pass_median") is not None and step_s
        },
        "compile_ms_engine": {c.kind + ":" + str(len(c.text)): round(1e3 * s, 2) for c, s in engine.grammars.compile_s.items()},
        "runs": [{k: v for k, v in r.items() if k != "ids"} for r in rows],
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    print_table(report)
    return 0


def print_table(report: dict) -> None:
    print(f"target one-token step: {report['target_step_ms']} ms")
    print(f"{'tasks/mode':34} {'tok/pass':>8} {'tok/s':>7} {'forced':>7} {'mask ms/pass':>12} {'valid':>6}")
    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    for k, v in report["summary"].items():
        forced = "-" if v["forced_share"] is None else f"{100 * v['forced_share']:.0f}%"
        print(f"{k:34} {cell(v['tokens_per_pass'], '.2f'):>8} {cell(v['tokens_per_s_median'], '.2f'):>7} {forced:>7} "
              f"{cell(v['mask_ms_per_pass_median'], '.3f'):>12} {v['valid']:>6}")
    print("exact vs constrained_plain:", report["exact_vs_constrained_plain"])
    for lib, v in report["libraries"].items():
        print(f"{lib}: {v}")
