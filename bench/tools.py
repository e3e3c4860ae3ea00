"""`specvoice bench tools`: does the agent book, cancel, take messages and transfer right?

Booking dialogues (bench/data/booking_dialogues.json) for the demo dental business are
played through the real turn loop (pipeline/stages/respond.py + tools_step.py: the same
`respond` a call runs, with the real ToolBox), text in, no audio, greedy. Each dialogue
gets a fresh SQLite database seeded with the business's open slots (and the dialogue's
pre-booked slots); the history between turns is kept as a call keeps it (pipeline/turn.py
History, tool messages included). Scoring is by rules, never by another model:

- final state: the active booking per slot (names case and spacing aside) and the
  messages are what the dialogue expects;
- tools: every expected call was made with its key arguments (a slot as the slot it
  names, loosely, as BookingStore.find_slot reads it) and succeeded, and no other call
  changed anything
  (check_slots and end_call are always allowed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench import BOOKING_DIALOGUES, report_header

HELP = "tool use: booking dialogues on a fresh database each; right final state, right tool calls, latency"
DESCRIPTION = """\
Plays every dialogue of bench/data/booking_dialogues.json (29 callers of the demo dental
practice: plain bookings, conflicts with a slot booked before the call, slots that do
not exist, cancellations, callers who change their mind, messages, transfers, strange
names, one question with no tool) through the real turn loop with the tools on, greedy,
each against a fresh temporary SQLite database, and checks by rules:

  state ok     the active booking per slot and the messages at the end are the expected
               ones (names case and spacing aside)
  tools ok     every expected call was made with its key arguments (a slot matched to the
               slot it names) and succeeded, and no unexpected call booked, cancelled, took a
               message or transferred (check_slots and end_call are always allowed)
  failed       tool calls that came back with an error (bad JSON, bad arguments, refused)
  fallbacks    turns that ended with the fixed "Sorry, I couldn't do that..." sentence
  double       slots with more than one active booking (the database forbids it: must be 0)
  unbacked     turns' claims of an action ("you're booked", "I've cancelled", "I've taken
               your message", "transferring you") that no successful tool call of that turn
               did (must be 0)

The turn loop is the call's: with [tools] plan each turn is a constrained plan acted on
through the database (pipeline/receptionist/plan.py), and with [agent] guard every sentence goes
through the fact guard (pipeline/receptionist/guard.py), as on a call with that config.

Latency: first-sentence latency (the request to the first sentence handed to TTS, median)
of turns with a tool call vs turns without; the target is that a tool turn adds at most
one extra first-sentence latency (tool median <= 2 x plain median). Also the time to the
first sentence spoken after the last tool result (the answer that carries the result).

examples:
  specvoice bench tools --out tools.json                  # all dialogues, the default pair
  specvoice bench tools --limit 5 --show                  # a quick look: 5 dialogues, every turn printed
  specvoice bench tools --ids cancel_friday,transfer_pain # just these
  specvoice bench tools --kind conflict --kind cancel     # one kind of dialogue or several
  specvoice bench tools --rescore tools.json              # re-score a saved run after a data fix (no model)
"""

DIALOGUES = BOOKING_DIALOGUES
KINDS = ("book", "conflict", "nonexistent", "cancel", "change_mind", "message", "transfer", "strange_name", "no_tool",
         "taken_meanwhile")
# Calls that change nothing in the database or the call: never held against a dialogue.
FREE_TOOLS = ("check_slots", "end_call")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config name or TOML file: the models, [agent] and [business] (default: default)")
    p.add_argument("--dialogues", type=Path, default=DIALOGUES, help="dialogue set (JSON)")
    p.add_argument("--ids", help="only these dialogues (comma-separated ids)")
    p.add_argument("--kind", action="append", choices=KINDS, help="only dialogues of this kind (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="only the first N dialogues (after --ids/--kind)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer budget per round (default: the config's)")
    p.add_argument("--show", action="store_true", help="print every turn: the caller, the agent, its tool calls")
    p.add_argument("--rescore", type=Path, metavar="JSON",
                   help="no model: score the runs saved in an earlier --out again against the current dialogue set")
    p.add_argument("--out", type=Path, help="write the JSON results here")


# ---------------------------------------------------------------- the dialogue set


@dataclass
class Dialogue:
    id: str
    kind: str
    lines: list[str]  # the caller's lines, as STT would give them
    seed: list[dict]  # bookings made before the call: {"slot", "name"}
    expect: dict  # calls, bookings (slot -> name), messages, action
    nonexistent_slots: list[str] = field(default_factory=list)
    note: str = ""
    # Bookings another caller makes during the call, just before line `before_line` is played:
    # {"before_line", "slot", "name"} (the slot was open when this caller heard of it).
    meanwhile: list[dict] = field(default_factory=list)


def load_dialogues(path: Path = DIALOGUES) -> list[Dialogue]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return [Dialogue(d["id"], d["kind"], d["lines"], d.get("seed", []), d["expect"],
                     d.get("nonexistent_slots", []), d.get("note", ""), d.get("meanwhile", []))
            for d in data["dialogues"]]


def resolve_slot(text: Any, labels: list[str]) -> str | None:
    """The configured slot `text` names, read as BookingStore.find_slot reads it (its
    label loosely: case, dots, ":00"; or the one label containing it); None if none or
    several. The bench must not be stricter than the database the agent writes to."""
    from pipeline.receptionist.bookings import _normal  # the database's own loose form, so the two cannot drift

    if not isinstance(text, str) or not text.strip():
        return None
    wanted = _normal(text)
    exact = [label for label in labels if _normal(label) == wanted]
    if exact:
        return exact[0]
    partial = [label for label in labels if wanted and wanted in _normal(label)]
    return partial[0] if len(partial) == 1 else None


def dialogue_problems(dialogues: list[Dialogue], labels: list[str]) -> list[str]:
    """What is wrong with the set against the business's slots (empty when well-formed):
    every slot it names must be a configured one, except those it declares non-existent,
    which must name none."""
    from pipeline.receptionist.tools import TOOLS

    problems = []
    ids = Counter(d.id for d in dialogues)
    problems += [f"{i}: id used {n} times" for i, n in ids.items() if n > 1]
    for d in dialogues:
        where = d.id
        if d.kind not in KINDS:
            problems.append(f"{where}: unknown kind {d.kind!r}")
        for m in d.meanwhile:
            if resolve_slot(m.get("slot"), labels) != m.get("slot") or not 0 <= m.get("before_line", -1) < len(d.lines):
                problems.append(f"{where}: meanwhile {m!r} names no configured slot or no line of the dialogue")
        if not d.lines or not all(isinstance(x, str) and x.strip() for x in d.lines):
            problems.append(f"{where}: needs caller lines")
        for s in d.seed:
            if s.get("slot") not in labels:
                problems.append(f"{where}: seed slot {s.get('slot')!r} is not a configured slot")
        if len({s.get("slot") for s in d.seed}) != len(d.seed):
            problems.append(f"{where}: two seed bookings of one slot")
        for slot in d.expect.get("bookings", {}):
            if slot not in labels:
                problems.append(f"{where}: expected booking at {slot!r}, not a configured slot")
        for c in d.expect.get("calls", []):
            if c.get("tool") not in TOOLS:
                problems.append(f"{where}: unknown tool {c.get('tool')!r}")
                continue
            fields = TOOLS[c["tool"]].arguments.model_fields
            for key in c.get("args", {}):
                if key not in fields:
                    problems.append(f"{where}: {key!r} is not an argument of {c['tool']}")
            slot = c.get("args", {}).get("slot")
            if slot is not None and slot not in labels:
                problems.append(f"{where}: expected call's slot {slot!r} is not a configured slot")
        for text in d.nonexistent_slots:
            if resolve_slot(text, labels) is not None:
                problems.append(f"{where}: 'non-existent' slot {text!r} names {resolve_slot(text, labels)!r}")
        if d.expect.get("action") not in (None, "transfer", "end_call"):
            problems.append(f"{where}: unknown action {d.expect.get('action')!r}")
    return problems


# ---------------------------------------------------------------- matching and scoring


def _name(text: Any) -> str:
    return " ".join(str(text).casefold().split()).strip(" .,")


def value_matches(spec: Any, actual: Any, key: str, labels: list[str]) -> bool:
    """One key argument: `slot` as the slot it names; {"contains": [...]} every word (case
    aside); a list: any one of the alternatives; else equal, case and spacing aside."""
    if isinstance(spec, list):
        return any(value_matches(s, actual, key, labels) for s in spec)
    if isinstance(spec, dict) and "contains" in spec:
        return isinstance(actual, str) and all(w.casefold() in actual.casefold() for w in spec["contains"])
    if actual is None:
        return False
    if key == "slot":
        return resolve_slot(actual, labels) == spec
    return _name(actual) == _name(spec)


def call_matches(expected: dict, actual: dict, labels: list[str]) -> bool:
    if actual.get("name") != expected["tool"]:
        return False
    args = actual.get("arguments")
    if not isinstance(args, dict):
        return not expected.get("args")
    return all(value_matches(spec, args.get(key), key, labels) for key, spec in expected.get("args", {}).items())


def match_calls(expected: list[dict], actual: list[dict], labels: list[str]) -> tuple[list[int | None], list[int]]:
    """Each expected call -> the index of a distinct actual call that matches it (None if
    none does; a call that succeeded is preferred), and the actual calls that changed
    something without being expected."""
    used: set[int] = set()
    found: list[int | None] = []
    for e in expected:
        candidates = [i for i, a in enumerate(actual) if i not in used and call_matches(e, a, labels)]
        candidates.sort(key=lambda i: not actual[i].get("ok"))
        found.append(candidates[0] if candidates else None)
        if candidates:
            used.add(candidates[0])
    extra = [i for i, a in enumerate(actual) if i not in used and a.get("ok") and a.get("name") not in FREE_TOOLS]
    return found, extra


@dataclass
class FinalState:
    """The database at the end of a dialogue."""

    bookings: list[dict]  # active: {"slot", "name", "phone"}
    cancelled: list[dict]  # cancelled during or before the dialogue
    messages: list[dict]  # {"name", "text", "callback"}

    @classmethod
    def of(cls, store) -> FinalState:
        rows = store.bookings()
        keep = lambda b: {"slot": b.slot, "name": b.name, "phone": b.phone}  # noqa: E731
        return cls([keep(b) for b in rows if b.cancelled_at is None], [keep(b) for b in rows if b.cancelled_at],
                   [{"name": m.name, "text": m.text, "callback": m.callback} for m in store.messages()])

    def double_bookings(self) -> int:
        """Active bookings beyond the first on any slot (the unique index should make this 0)."""
        per_slot = Counter(b["slot"] for b in self.bookings)
        return sum(n - 1 for n in per_slot.values() if n > 1)


def state_problems(expect: dict, state: FinalState, labels: list[str]) -> list[str]:
    problems = []
    want = expect.get("bookings", {})
    have: dict[str, list[str]] = {}
    for b in state.bookings:
        have.setdefault(b["slot"], []).append(b["name"])
    for slot in sorted(set(want) | set(have), key=lambda s: labels.index(s) if s in labels else len(labels)):
        names = have.get(slot, [])
        if slot not in want:
            problems.append(f"unexpected booking {slot}: {', '.join(names)}")
        elif not names:
            problems.append(f"missing booking {slot}: {want[slot]}")
        elif len(names) > 1 or not value_matches(want[slot], names[0], "name", labels):
            problems.append(f"wrong name at {slot}: {', '.join(names)} (expected {want[slot]})")
    wanted_messages = list(expect.get("messages", []))
    left = list(state.messages)
    for m in wanted_messages:
        hit = next((x for x in left if all(value_matches(spec, x.get(k), k, labels) for k, spec in m.items())), None)
        if hit is None:
            problems.append(f"missing message {json.dumps(m, ensure_ascii=False)}")
        else:
            left.remove(hit)
    problems += [f"unexpected message from {x['name']}: {x['text']}" for x in left]
    return problems


def score(d: Dialogue, run: dict, labels: list[str]) -> dict:
    """The verdict of one played dialogue (`run`: its turns and final state, as JSON)."""
    calls = [c for t in run["turns"] for c in t["tool_calls"]]
    state = FinalState(**run["state"])
    found, extra = match_calls(d.expect.get("calls", []), calls, labels)
    action = next((t["action"] for t in run["turns"] if t.get("action")), None)
    # An expected call counts when it was made with its key arguments and done: a right
    # book_slot the tool box refused (an empty optional argument, say) booked nothing.
    tool_problems = [f"missing call {e['tool']} {json.dumps(e.get('args', {}), ensure_ascii=False)}"
                     for e, i in zip(d.expect.get("calls", []), found) if i is None]
    tool_problems += [f"call {calls[i]['name']} {json.dumps(calls[i]['arguments'], ensure_ascii=False)} failed: "
                      f"{calls[i]['error']}" for i in found if i is not None and not calls[i].get("ok")]
    tool_problems += [f"unexpected call {calls[i]['name']} {json.dumps(calls[i]['arguments'], ensure_ascii=False)}"
                      for i in extra]
    if d.expect.get("action") != action and not (action == "end_call" and d.expect.get("action") is None):
        tool_problems.append(f"call action {action} (expected {d.expect.get('action')})")
    s_problems = state_problems(d.expect, state, labels)
    return {
        "state_ok": not s_problems, "tools_ok": not tool_problems,
        "state_problems": s_problems, "tool_problems": tool_problems,
        "expected_calls": len(found),
        "matched_calls": sum(i is not None and bool(calls[i].get("ok")) for i in found),
        "calls": len(calls), "failed_calls": sum(not c["ok"] for c in calls),
        "malformed_calls": sum(_malformed(c) for c in calls),
        "fallbacks": sum(bool(t.get("fallback")) for t in run["turns"]),
        "double_bookings": state.double_bookings(),
        "action": action,
    }


def _malformed(call: dict) -> bool:
    """A call the tool box could not even read (bad JSON, unknown tool, bad arguments), as
    against one it ran and the database refused (a taken slot, no such booking)."""
    error = call.get("error") or ""
    return not call.get("ok") and (call.get("name") is None or error.startswith(("bad arguments", "unknown tool"))
                                   or "not valid JSON" in error or "must be a JSON object" in error)


# ---------------------------------------------------------------- playing a dialogue


@dataclass
class Setup:
    """What every dialogue's call shares: the call's settings ([agent], [pipeline], [tools]
    as a call has them), the sampling, the token counter, the fact guard."""

    config: Any  # pipeline.config.Config
    labels: list[str]  # the business's open slots: each dialogue's database is seeded with them
    params: Any = None  # llm.types.SamplingParams; None: the config's
    count_tokens: Callable[[list[dict]], int] | None = None
    guard: Any = None  # pipeline.receptionist.guard.FactGuard ([agent] guard), or None
    prompt: str | None = None  # None: the config's system prompt


async def play(d: Dialogue, backend, store, setup: Setup, on_turn: Callable[[dict], None] = lambda t: None) -> dict:
    """Play dialogue `d` through the call's turn loop (pipeline.conversation, what `specvoice
    chat` runs: the plan, the tool rounds, the fact guard, the history as heard) with a
    ToolBox over `store` (seeded already). The call ends early when a tool asks it to
    (transfer, end call). Returns the turns and the final database state, as JSON."""
    from pipeline.agent import chars_token_count
    from pipeline.conversation import TextConversation
    from pipeline.receptionist.guard import claimed_actions
    from pipeline.receptionist.tools import ToolBox

    box = ToolBox(store, f"bench-{d.id}")
    conv = TextConversation(setup.config, backend, setup.count_tokens or chars_token_count, toolbox=box,
                            guard=setup.guard, greeting=setup.config.agent.greeting, prompt=setup.prompt,
                            params=setup.params)
    turns = []
    for n, line in enumerate(d.lines):
        for other in d.meanwhile:  # another caller books a slot between this caller's lines
            if other["before_line"] == n:
                ToolBox(store, "another-caller").run("book_slot", {"slot": other["slot"], "name": other["name"]})
        text_turn = await conv.turn(line)
        result, tl, spoken = text_turn.result, text_turn.timeline, text_turn.agent
        marks = [(kind, at) for kind, at, _ in text_turn.events if kind in ("sentence", "tool_result", "hold_line")]
        done = {c["name"] for c in result.tool_calls if c["ok"]}
        m = tl.metrics()
        start = tl.get("llm_request")
        last_tool = max((t for k, t in marks if k == "tool_result"), default=None)
        after_tool = next((t for k, t in marks if k == "sentence" and last_tool is not None and t >= last_tool), None)
        # The model's own first sentence (not the hold line, which is the first "sentence"
        # mark when spoken), and the first thing the caller heard at all.
        held = result.hold_line_t is not None
        own = [t for k, t in marks if k == "sentence"][1 if held else 0:]
        st = result.stats
        turn = {
            "caller": line, "agent": spoken,
            "tool_calls": [{k: c[k] for k in ("name", "arguments", "ok", "result", "error", "elapsed_ms", "round")}
                           for c in result.tool_calls],
            "fallback": result.fallback, "action": result.action, "finish_reason": result.finish_reason,
            # Actions the caller was told of that no tool call of this turn did ("You're booked").
            "unbacked_claims": [t for t in claimed_actions(spoken) if t not in done],
            "guarded": result.guarded, "plan": result.plan,
            "error": result.error,
            "first_sentence_s": (own[0] - start) if own and start is not None else None,
            "first_heard_s": m.get("first_sentence_latency"), "hold_line": held, "ttft_s": m.get("ttft"),
            "llm_total_s": m.get("llm_total"),
            # The first sentence spoken after the last tool's result: the one carrying it.
            "answer_after_tool_s": (after_tool - start) if after_tool is not None and start is not None else None,
            # Generations in the turn: one, plus one after each tool round that was fed back.
            "tool_rounds": len({c["round"] for c in result.tool_calls}),
            "new_tokens": st.new_tokens if st is not None else None,
            "prefilled_tokens": st.prefilled_tokens if st is not None else None,
            "passes": st.passes if st is not None else None,
            # Each generation's own figures: where a tool turn's time went (the call's
            # tokens, reading the tool's result, the answer after it).
            "rounds": [{"prefilled_tokens": r.prefilled_tokens, "prefill_s": round(r.prefill_s, 3),
                        "new_tokens": r.new_tokens, "passes": r.passes, "accepted": r.accepted,
                        "drafted": r.drafted, "total_s": round(r.total_s, 3)} for r in result.rounds],
        }
        turns.append(turn)
        on_turn(turn)
        if result.action is not None:  # the call is handed over or hung up after this turn
            break
    return {"turns": turns, "state": asdict(FinalState.of(store))}


def seeded_store(path: Path, d: Dialogue, labels: list[str]):
    """A fresh database for `d`: the business's slots, and the bookings made before the call."""
    from pipeline.receptionist.bookings import open_store

    store = open_store(path, open_slots=labels)
    for s in d.seed:
        store.book(s["slot"], s["name"], call_id="seed")
    return store


# ---------------------------------------------------------------- the report


def _median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _rate(flags) -> float | None:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else None


def summarize(rows: list[dict]) -> dict:
    """Figures over scored dialogues (each row: id, kind, run, verdict)."""
    v = [r["verdict"] for r in rows]
    turns = [t for r in rows for t in r["run"]["turns"]]
    tool_turns = [t for t in turns if t["tool_calls"]]
    plain_turns = [t for t in turns if not t["tool_calls"]]
    tool_fs, plain_fs = _median(t["first_sentence_s"] for t in tool_turns), _median(t["first_sentence_s"] for t in plain_turns)
    ratio = tool_fs / plain_fs if tool_fs is not None and plain_fs else None
    by_kind = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        k = [r["verdict"] for r in rows if r["kind"] == kind]
        by_kind[kind] = {"dialogues": len(k), "state_ok": _rate(x["state_ok"] for x in k),
                         "tools_ok": _rate(x["tools_ok"] for x in k)}
    return {
        "dialogues": len(rows),
        "state_ok": _rate(x["state_ok"] for x in v),
        "tools_ok": _rate(x["tools_ok"] for x in v),
        "both_ok": _rate(x["state_ok"] and x["tools_ok"] for x in v),
        "expected_calls": sum(x["expected_calls"] for x in v),
        "matched_calls": sum(x["matched_calls"] for x in v),
        "calls": sum(x["calls"] for x in v),
        "failed_calls": sum(x["failed_calls"] for x in v),
        "malformed_calls": sum(x["malformed_calls"] for x in v),
        "fallback_turns": sum(x["fallbacks"] for x in v),
        "double_bookings": sum(x["double_bookings"] for x in v),
        "unbacked_claims": sum(len(t.get("unbacked_claims") or ()) for t in turns),
        "guarded_sentences": sum(len(t.get("guarded") or ()) for t in turns),
        "turns": len(turns), "tool_turns": len(tool_turns), "plain_turns": len(plain_turns),
        "silent_turns": sum(not t["agent"] for t in turns),  # nothing said: no first sentence to time
        "latency": {
            "first_sentence_s": {"tool_turns": tool_fs, "plain_turns": plain_fs, "ratio": ratio,
                                 # issue 15: a tool turn adds at most one extra first-sentence latency
                                 "target_met": None if ratio is None else ratio <= 2.0},
            "answer_after_tool_s": _median(t["answer_after_tool_s"] for t in tool_turns),
            # What ends the caller's silence: the hold line where it was said, else the answer.
            "first_heard_s": {"tool_turns": _median(t.get("first_heard_s") for t in tool_turns),
                              "plain_turns": _median(t.get("first_heard_s") for t in plain_turns),
                              "hold_lines": sum(bool(t.get("hold_line")) for t in tool_turns)},
            "ttft_s": {"tool_turns": _median(t["ttft_s"] for t in tool_turns),
                       "plain_turns": _median(t["ttft_s"] for t in plain_turns)},
            "llm_total_s": {"tool_turns": _median(t["llm_total_s"] for t in tool_turns),
                            "plain_turns": _median(t["llm_total_s"] for t in plain_turns)},
        },
        "by_kind": by_kind,
    }


def print_table(report: dict) -> None:
    s = report["summary"]

    def pct(x):
        return "-" if x is None else f"{x:.0%}"

    def sec(x):
        return "-" if x is None else f"{x:.2f}"

    m = report.get("models", {})
    print(f"\n{s['dialogues']} booking dialogues, {s['turns']} turns, greedy, {m.get('target', '?')} "
          f"({m.get('drafter', '?')} drafts)")
    print(f"right final state     {pct(s['state_ok']):>5s}   (target >= 90%)")
    print(f"right tools and args  {pct(s['tools_ok']):>5s}   ({s['matched_calls']}/{s['expected_calls']} expected calls made and done)")
    print(f"both                  {pct(s['both_ok']):>5s}")
    print(f"tool calls {s['calls']}, failed {s['failed_calls']} (malformed {s['malformed_calls']}), "
          f"fallback turns {s['fallback_turns']}, silent turns {s.get('silent_turns', 0)}, "
          f"double bookings {s['double_bookings']}")
    print(f"claims of an action no tool did: {s.get('unbacked_claims', '-')}; sentences the fact guard held back: "
          f"{s.get('guarded_sentences', '-')}")
    lat = s["latency"]
    fs = lat["first_sentence_s"]
    met = {None: "-", True: "met", False: "NOT met"}[fs["target_met"]]
    print(f"first sentence (median s): tool turns {sec(fs['tool_turns'])} (n={s['tool_turns']}), plain turns "
          f"{sec(fs['plain_turns'])} (n={s['plain_turns']}), ratio "
          f"{'-' if fs['ratio'] is None else format(fs['ratio'], '.2f')} (target <= 2: {met})")
    heard = lat.get("first_heard_s")
    if heard:
        print(f"first words heard (median s; the hold line where the model began with a tool call): tool turns "
              f"{sec(heard['tool_turns'])} ({heard['hold_lines']} hold lines), plain turns {sec(heard['plain_turns'])}")
    print(f"answer after the last tool result (median s): {sec(lat['answer_after_tool_s'])}; "
          f"LLM total per turn: tool {sec(lat['llm_total_s']['tool_turns'])}, plain {sec(lat['llm_total_s']['plain_turns'])}")
    print(f"\n{'kind':14s} {'n':>3s} {'state':>6s} {'tools':>6s}")
    for kind, k in s["by_kind"].items():
        print(f"{kind:14s} {k['dialogues']:3d} {pct(k['state_ok']):>6s} {pct(k['tools_ok']):>6s}")
    print("\nper dialogue (state, tools; what was wrong)")
    for r in report["dialogues"]:
        v = r["verdict"]
        why = "; ".join(v["state_problems"] + v["tool_problems"])
        print(f"{r['id']:32s} {'ok' if v['state_ok'] else 'x':>3s} {'ok' if v['tools_ok'] else 'x':>3s}  {why}")


def show_turn(write, d_id: str, turn: dict) -> None:
    write(f"[{d_id}] caller: {turn['caller']}")
    for c in turn["tool_calls"]:
        outcome = "ok" if c["ok"] else f"ERROR {c['error']}"
        write(f"    tool {c['name']} {json.dumps(c['arguments'], ensure_ascii=False)} -> {outcome}")
    write(f"    agent: {turn['agent']}" + ("   [fallback]" if turn["fallback"] else "")
          + (f"   [{turn['action']}]" if turn["action"] else ""))


def _select(dialogues: list[Dialogue], args: argparse.Namespace) -> list[Dialogue] | str:
    if args.ids:
        wanted = [i.strip() for i in args.ids.split(",") if i.strip()]
        unknown = set(wanted) - {d.id for d in dialogues}
        if unknown:
            return f"unknown dialogue id(s) {sorted(unknown)}"
        dialogues = [d for d in dialogues if d.id in wanted]
    if args.kind:
        dialogues = [d for d in dialogues if d.kind in args.kind]
    return dialogues[: args.limit]


def rescore(args: argparse.Namespace, labels: list[str]) -> int:
    """Score the runs of an earlier --out again (greedy runs are deterministic, so a fix to
    an expectation needs no model run)."""
    by_id = {d.id: d for d in load_dialogues(args.dialogues)}
    report = json.loads(args.rescore.read_text(encoding="utf-8"))
    rows = [r for r in report["dialogues"] if r["id"] in by_id]
    for r in rows:
        r["verdict"] = score(by_id[r["id"]], r["run"], report.get("slots", labels))
    report.update(dialogues=rows, summary=summarize(rows), rescored_from=str(args.rescore))
    print_table(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    from pipeline.config import load_config

    config = load_config(args.config)
    labels = list(config.business.open_slots or [])
    if not labels:
        print("error: the config's [business] has no open_slots to book", file=sys.stderr)
        return 2
    if args.rescore:
        return rescore(args, labels)
    dialogues = load_dialogues(args.dialogues)
    problems = dialogue_problems(dialogues, labels)
    if problems:
        print("error: the dialogue set does not fit the config's slots:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    chosen = _select(dialogues, args)
    if isinstance(chosen, str):
        print(f"error: {chosen}", file=sys.stderr)
        return 2
    return asyncio.run(_run(args, config, labels, chosen))


async def _run(args: argparse.Namespace, config, labels: list[str], dialogues: list[Dialogue]) -> int:
    import dataclasses

    from tqdm import tqdm

    from llm.backend import SpeculativeBackend
    from pipeline.agent import load_engine, sampling_params
    from pipeline.receptionist.prompt import system_prompt, tool_schemas, tool_values
    from pipeline.receptionist.guard import FactGuard

    # The tools on, as `[tools] enabled = true` gives a call: the same prompt paragraph and schemas.
    config = config.model_copy(update={"tools": config.tools.model_copy(update={"enabled": True})})
    llm = config.llm
    params = sampling_params(config)
    if args.max_new_tokens:
        params = dataclasses.replace(params, max_new_tokens=args.max_new_tokens)
    prompt, schemas = system_prompt(config), tool_schemas(config)
    print(f"loading {llm.target} ({llm.drafter} drafts, {llm.device}, {llm.dtype}) ...", file=sys.stderr)
    engine = load_engine(llm, answer_memory=0)  # variants repeat the questions
    # As AgentModels.warm: the system block (tools included) computed once, copied into each call.
    prefix = engine.chat_prompt([{"role": "system", "content": prompt}], add_generation_prompt=False, tools=schemas)
    t = time.perf_counter()
    engine.warm_prefix(prefix)
    prefill = {"tokens": len(prefix), "seconds": time.perf_counter() - t}
    setup = Setup(config, labels, params, count_tokens=engine.count_tokens,
                  guard=FactGuard(config.business) if config.agent.guard else None)

    rows = []
    bar = tqdm(total=sum(len(d.lines) for d in dialogues), desc="bench tools", unit="turn", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-tools-") as tmp:
        for d in dialogues:
            bar.set_postfix_str(d.id)
            store = seeded_store(Path(tmp) / f"{d.id}.sqlite", d, labels)
            backend = SpeculativeBackend(engine, tools=schemas, tool_values=tool_values(config))  # one call
            t0 = time.perf_counter()
            try:
                result = await play(d, backend, store, setup, on_turn=lambda turn: (
                    show_turn(bar.write, d.id, turn) if args.show else None, bar.update()))
            finally:
                store.close()
                await backend.aclose()
            bar.update(len(d.lines) - len(result["turns"]))  # lines not played after a transfer
            result["seconds"] = time.perf_counter() - t0
            verdict = score(d, result, labels)
            rows.append({"id": d.id, "kind": d.kind, "run": result, "verdict": verdict})
            if args.show:
                bar.write(f"    => state {'ok' if verdict['state_ok'] else 'WRONG'}, tools "
                          f"{'ok' if verdict['tools_ok'] else 'WRONG'}  "
                          + "; ".join(verdict["state_problems"] + verdict["tool_problems"]))
    bar.close()

    report = {
        **report_header("tools", llm),
        "max_new_tokens": params.max_new_tokens,
        "slots": labels,
        "prefill": prefill,
        "summary": summarize(rows),
        "dialogues": rows,
        "system_prompt": prompt,
    }
    print_table(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False, default=str))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
