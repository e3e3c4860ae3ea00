"""The call report: one JSON file per call, written when it ends or breaks off.

Schema "specvoice.call_report/1" (times in seconds):

    {"schema", "call_id", "started_at" (ISO-8601, UTC), "ended_at", "duration_s",
     "end_reason", "error", "config", "models": {"llm_target", "llm_draft", "drafter", "stt", "tts"},
     "turns": [{"index", "user_text", "agent_text", "agent_text_heard", "interrupted",
                "timeline": {event: seconds since call start}, "metrics": {metric: seconds|null},
                "llm": GenerationStats.as_dict() | null,
                "tool_calls": [{"name", "arguments", "ok", "result", "error", "elapsed_ms", "action",
                                "reason", "round", "start", "end" (seconds since call start)}]
                               (only on turns that called a tool),
                "preemptive_hit": true | false (only on turns where a preemptive generation started:
                                  true when the turn kept it),
                "preemptive": {"starts", "events": [{"event": one of start, llm_start, kept,
                               discarded; "t" (seconds since call start), "why" (discarded),
                               "pause", "audio_s" (start), "groups_ready", "finished" (kept),
                               "stt_s", "waited_s", "prompt_s" (llm_start: the start's STT, its
                               wait for work still on the conversation, its prompt and plan)}]}}],
     "taken_back": [{"before_turn", "user_text", "agent_text", "agent_audio_s", "resumed_at",
                     "timeline", "end_of_turn": {"reason", "pauses"}}]
                   (turns the caller went on speaking in before their answer was heard: not
                    answered, their audio begins turn `before_turn`; pipeline/stages/take_back.py),
     "summary": {"turns", "taken_back", "metrics": {metric: {"p50", "p90", "max", "n"}},
                 "llm": {"tokens", "passes", "tokens_per_pass", "acceptance_rate", "tokens_per_s"},
                 "tools": {"calls", "failed", "turns", "fallbacks",
                           "voice_to_voice": {"with_tools": {...}, "without_tools": {...}}},
                 "preemptive": {"turns" (with a start), "starts", "hits", "hit_rate" (hits / turns, or null),
                                "discarded": {why: count}}}}

A turn that runs a tool waits for it (and for a second generation) before it can speak,
so its voice-to-voice is summarised apart from the others': one slow booking must not
hide in, or inflate, the plain turns' percentiles.

Percentiles use the nearest-rank method (the value at rank ceil(q * n) of the sorted
samples): always an observed latency, never an interpolation between two turns.

Writing is atomic (temp file in the same folder, fsync, os.replace) so a reader never
sees half a report, and the file name is derived from the call id so that no id, however
hostile (it comes from the telephony provider or a client), can place a file outside the
report folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from llm.types import GenerationStats
from pipeline.events import KeypadEntry
from pipeline.timeline import METRICS, TurnTimeline, compute_metrics
from pipeline.turn import Turn

log = logging.getLogger(__name__)

__all__ = [
    "SCHEMA",
    "END_REASONS",
    "CallReport",
    "HEADLINE_METRICS",
    "ReportError",
    "finish_report",
    "load_report",
    "percentile",
    "report_filename",
    "summarize",
    "summarize_preemptive",
    "summarize_tools",
    "write_report",
]

SCHEMA = "specvoice.call_report/1"
# The headline metrics of a report, in the order a caller's silence unfolds, with the
# labels every view (the terminal table, the HTML page) shows them under.
HEADLINE_METRICS: dict[str, str] = {
    "endpoint_delay": "endpoint delay",
    "stt_latency": "STT",
    "ttft": "TTFT",
    "first_sentence_latency": "first sentence",
    "tts_first_audio": "TTS first audio",
    "voice_to_voice": "voice to voice",
}
END_REASONS = frozenset(
    {"completed", "caller_hangup", "stop", "error", "idle_timeout", "server_shutdown", "cancelled",
     "protocol_error", "transfer", "end_call"}
)
_MODEL_KEYS = ("llm_target", "llm_draft", "drafter", "stt", "tts")
_ROUND = 6  # microseconds are plenty for latencies


class ReportError(ValueError):
    """A report that cannot be written or read back."""


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).isoformat(timespec="milliseconds")


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, _ROUND)


@dataclass
class CallReport:
    """Builds a call's report turn by turn; `finish()` then `to_dict()` / `write_report`.

    `t0` is the call start on the monotonic clock (the clock timelines use); `started_at`
    the same instant on the wall clock, for humans.
    """

    call_id: str
    config: dict[str, Any] = field(default_factory=dict)
    models: dict[str, str | None] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)
    turns: list[dict[str, Any]] = field(default_factory=list)
    taken_back: list[dict[str, Any]] = field(default_factory=list)  # add_taken_back
    ended_at: float | None = None
    end_reason: str | None = None
    error: str | None = None

    @classmethod
    def from_config(cls, call_id: str, config: Any, **kwargs: Any) -> "CallReport":
        """A report whose config and models sections come from a pipeline `Config`."""
        dumped = config.model_dump(mode="json")
        llm = config.llm
        if llm.backend == "openai":
            models = {"llm_target": llm.openai.model or "(server default)", "llm_draft": None,
                      "drafter": "server"}
        else:
            models = {"llm_target": llm.target, "llm_draft": llm.draft if llm.drafter in ("model", "hybrid") else None,
                      "drafter": llm.drafter}
        models.update(stt=config.stt.model_for_engine, tts=f"{config.tts.engine}:{config.tts.voice}")
        return cls(call_id=call_id, config=dumped, models=models, **kwargs)

    def add_turn(
        self,
        timeline: TurnTimeline,
        user_text: str = "",
        agent_text: str = "",
        agent_text_heard: str | None = None,
        interrupted: bool = False,
        llm: GenerationStats | dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        preemption: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Record a finished turn; returns its report entry (what MQTT publishes too).
        `tool_calls` carry their start/end on the monotonic clock; the entry has them as
        seconds since the call start, like the timeline."""
        if isinstance(llm, GenerationStats):
            llm = llm.as_dict()
        turn = {
            "index": len(self.turns),
            "user_text": user_text,
            "agent_text": agent_text,
            "agent_text_heard": agent_text if agent_text_heard is None else agent_text_heard,
            "interrupted": bool(interrupted),
            "timeline": {k: _r(v) for k, v in timeline.relative(self.t0).items()},
            "metrics": {k: _r(v) for k, v in compute_metrics(timeline).items()},
            "llm": llm,
        }
        if tool_calls:
            turn["tool_calls"] = [self._tool_call(c) for c in tool_calls]
        if preemption is not None and preemption.get("starts"):
            turn["preemptive_hit"] = bool(preemption.get("hit"))
            events = [{**e, "t": _r(e["t"] - self.t0)} if e.get("t") is not None else dict(e)
                      for e in preemption.get("events", [])]
            turn["preemptive"] = {"starts": int(preemption["starts"]), "events": events}
        self.turns.append(turn)
        return turn

    def add_call_turn(self, turn: Turn, keypad: KeypadEntry | None = None, preemption: dict[str, Any] | None = None,
                      stt_stream: dict[str, Any] | None = None) -> dict[str, Any]:
        """Record a call's finished turn (pipeline.turn.Turn): `add_turn`'s entry and what the
        turn's stages and events add to it. `preemption`: TurnPreemption.record();
        `stt_stream`: the streaming STT's record (event times on the monotonic clock)."""
        llm = turn.llm
        entry = self.add_turn(turn.timeline, turn.user_text, turn.agent_text, turn.heard_text, turn.interrupted,
                              llm=turn.stats, tool_calls=llm.tool_calls, preemption=preemption)
        entry["finish_reason"] = turn.finish_reason
        if keypad is not None:
            entry["input"] = "dtmf"
            entry["keypad"] = {"digits": keypad.digits, "ended_by": keypad.ended_by}
        if llm.fallback:
            entry["tool_fallback"] = True
        if llm.hold_line_t is not None:
            entry["hold_line"] = True  # the first sentence was the hold line, not the model's
        if llm.guarded:
            entry["guarded"] = list(llm.guarded)  # sentences the fact guard did not let through
        if llm.cut_short:
            entry["cut_short"] = llm.cut_short  # the unfinished sentence the token limit cut, not said
        if llm.plan is not None:
            entry["plan"] = llm.plan
        if llm.action is not None:
            entry["action"] = {"action": llm.action, "reason": llm.action_reason}
        if stt_stream is not None:
            # Event times as the timeline's: seconds since the call start (frame clock = monotonic).
            entry["stt_stream"] = {**stt_stream, "events": [
                {**e, "at": round(e["at"] - self.t0, 6)} for e in stt_stream.get("events", ())]}
        if turn.end_of_turn is not None:
            e = turn.end_of_turn
            entry["end_of_turn"] = {"reason": e.reason, "probability": e.probability, "pauses": e.pauses}
            if e.words_end is not None:  # silence mode: the LLM scored the pause's words
                entry["end_of_turn"]["words_end"] = e.words_end
        if turn.error:
            entry["error"] = turn.error
        return entry

    def add_taken_back(self, turn: Turn) -> dict[str, Any]:
        """Record a turn taken back (pipeline/stages/take_back.py): the caller went on speaking
        before its answer was heard, so it was not answered and its audio begins the next
        turn (`before_turn`, that turn's index). What it heard and had begun to say, and when
        the caller went on (`resumed_at`, seconds since the call start, like the timeline)."""
        e, resumed = turn.end_of_turn, turn.taken_back_t
        entry = {"before_turn": len(self.turns), "user_text": turn.user_text, "agent_text": turn.agent_text,
                 "agent_audio_s": round(turn.speech.audio_s, 3),
                 "resumed_at": None if resumed is None else _r(resumed - self.t0),
                 "timeline": {k: _r(v) for k, v in turn.timeline.relative(self.t0).items()},
                 "end_of_turn": None if e is None else {"reason": e.reason, "pauses": e.pauses}}
        self.taken_back.append(entry)
        return entry

    def _tool_call(self, call: dict[str, Any]) -> dict[str, Any]:
        out = dict(call)
        for key in ("start", "end"):
            if out.get(key) is not None:
                out[key] = _r(out[key] - self.t0)
        return out

    def finish(self, end_reason: str, error: str | BaseException | None = None) -> None:
        """Close the report. The first call wins: a later 'error' cannot rewrite a hangup."""
        if self.end_reason is not None:
            return
        if not end_reason:
            raise ValueError("end_reason must be a non-empty string")
        self.end_reason = end_reason
        if isinstance(error, BaseException):
            error = f"{type(error).__name__}: {error}"
        self.error = error
        self.ended_at = time.time()

    def to_dict(self) -> dict[str, Any]:
        ended = self.ended_at if self.ended_at is not None else time.time()
        models = {k: self.models.get(k) for k in _MODEL_KEYS}
        models.update({k: v for k, v in self.models.items() if k not in models})
        return {
            "schema": SCHEMA,
            "call_id": self.call_id,
            "started_at": _iso(self.started_at),
            "ended_at": _iso(ended),
            "duration_s": round(max(0.0, ended - self.started_at), 3),
            "end_reason": self.end_reason or "unfinished",
            "error": self.error,
            "config": self.config,
            "models": models,
            "turns": self.turns,
            "taken_back": self.taken_back,
            "summary": {**summarize(self.turns), "taken_back": len(self.taken_back)},
        }


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile: the smallest sample with at least q of the samples <= it."""
    if not values:
        return None
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def summarize(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric p50/p90/max/n over the turns that have the metric, plus LLM totals."""
    metrics = {}
    for name in METRICS:
        values = [t["metrics"][name] for t in turns if t.get("metrics", {}).get(name) is not None]
        metrics[name] = {
            "p50": _r(percentile(values, 0.5)),
            "p90": _r(percentile(values, 0.9)),
            "max": _r(max(values)) if values else None,
            "n": len(values),
        }
    stats = [t["llm"] for t in turns if t.get("llm")]
    tokens = sum(s.get("new_tokens", 0) for s in stats)
    passes = sum(s.get("passes", 0) for s in stats)
    drafted = sum(s.get("drafted", 0) for s in stats)
    accepted = sum(s.get("accepted", 0) for s in stats)
    total_s = sum(s.get("total_s", 0.0) for s in stats)
    # Ratios of sums, not means of ratios: a long answer weighs more than a one-word one.
    llm = {
        "tokens": tokens,
        "passes": passes,
        "tokens_per_pass": round(tokens / passes, 4) if passes else 0.0,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "tokens_per_s": round(tokens / total_s, 3) if total_s > 0 else 0.0,
    }
    return {"turns": len(turns), "metrics": metrics, "llm": llm, "tools": summarize_tools(turns),
            "preemptive": summarize_preemptive(turns)}


def summarize_preemptive(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Turns with a preemptive start, starts, turns that kept one (hits), and why the
    discarded ones were dropped."""
    tried = [t for t in turns if "preemptive_hit" in t]
    hits = sum(1 for t in tried if t["preemptive_hit"])
    why: dict[str, int] = {}
    for t in tried:
        for e in (t.get("preemptive") or {}).get("events", []):
            if e.get("event") == "discarded":
                why[str(e.get("why"))] = why.get(str(e.get("why")), 0) + 1
    return {"turns": len(tried), "starts": sum((t.get("preemptive") or {}).get("starts", 0) for t in tried),
            "hits": hits, "hit_rate": round(hits / len(tried), 4) if tried else None, "discarded": why}


def _spread(values: list[float]) -> dict[str, Any]:
    return {"p50": _r(percentile(values, 0.5)), "p90": _r(percentile(values, 0.9)),
            "max": _r(max(values)) if values else None, "n": len(values)}


def summarize_tools(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Tool calls made, failed, turns with a call, fallbacks spoken; and voice-to-voice
    for the turns with a tool call apart from the turns without one."""
    calls = [c for t in turns for c in t.get("tool_calls") or []]
    v2v: dict[bool, list[float]] = {True: [], False: []}
    for t in turns:
        value = (t.get("metrics") or {}).get("voice_to_voice")
        if value is not None:
            v2v[bool(t.get("tool_calls"))].append(value)
    return {
        "calls": len(calls),
        "failed": sum(1 for c in calls if not c.get("ok")),
        "turns": sum(1 for t in turns if t.get("tool_calls")),
        "fallbacks": sum(1 for t in turns if t.get("tool_fallback")),
        "voice_to_voice": {"with_tools": _spread(v2v[True]), "without_tools": _spread(v2v[False])},
    }


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
# What a name with a digest appended looks like: an id of that shape gets a digest too, so
# that it can never meet the altered form of another id.
_DIGESTED = re.compile(r".*-[0-9a-f]{10}")


def report_filename(call_id: str) -> str:
    """A safe file name for a call id: [A-Za-z0-9_.-] only, no '..', no leading dot.

    An id that is already safe is kept as it is ("call-42" -> "call-42.json"). Any other is
    made safe (unsafe characters to "_", runs of dots to "_", no dot at either end, at most
    96 characters) and a short hash of the original id is appended, so that two different
    ids ("a/b" and "a_b", "0." and "0") never share a file.
    """
    safe = _UNSAFE.sub("_", call_id)
    # A dot at the end would meet the ".json" suffix and make "..": strip both ends.
    safe = re.sub(r"\.{2,}", "_", safe).strip(".")[:96].rstrip(".")
    if safe != call_id or not safe or _DIGESTED.fullmatch(safe):
        digest = hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        safe = f"{safe or 'call'}-{digest}"
    return f"{safe}.json"


def finish_report(report: CallReport, end_reason: str, error: str | BaseException | None,
                  directory: str | os.PathLike[str]) -> Path | None:
    """Close the call's report and write it; None (logged) when it cannot be written: the
    call still ends cleanly."""
    report.finish(end_reason, error)
    try:
        path = write_report(report, directory)
    except Exception:
        log.exception("call %s: cannot write the report", report.call_id)
        return None
    log.info("call %s: report written to %s", report.call_id, path)
    return path


def write_report(report: CallReport | dict[str, Any], directory: str | os.PathLike[str]) -> Path:
    """Write the report atomically into `directory` (created if needed); returns its path."""
    data = report.to_dict() if isinstance(report, CallReport) else report
    if data.get("schema") != SCHEMA:
        raise ReportError(f"refusing to write a report without schema {SCHEMA!r}")
    folder = Path(directory).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    path = _free_path(folder, report_filename(str(data["call_id"])), data)
    if path.parent != folder:  # belt and braces: the name is already sanitised
        raise ReportError(f"report path {path} escapes the report folder {folder}")
    text = json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(folder)  # make the rename itself durable
    return path


def _free_path(folder: Path, name: str, data: dict[str, Any]) -> Path:
    """`folder/name`, unless it holds another call's report (a call id reused by a client,
    or by a second bridge): then `stem-2.json`, `stem-3.json`... A report is never
    overwritten by a different call's; rewriting the same call's report replaces it."""
    stem = name[: -len(".json")]
    path, n = (folder / name).resolve(), 1
    while path.exists() and not _same_call(path, data):
        n += 1
        path = (folder / f"{stem}-{n}.json").resolve()
    return path


def _same_call(path: Path, data: dict[str, Any]) -> bool:
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(old, dict) and old.get("call_id") == data.get("call_id") \
        and old.get("started_at") == data.get("started_at")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a report back, checking that it is one this code understands."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"cannot read call report {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ReportError(f"{path} is not a call report (top level is {type(data).__name__}, not an object)")
    schema = data.get("schema")
    if schema != SCHEMA:
        raise ReportError(
            f"{path}: unsupported call report schema {schema!r}; this version reads {SCHEMA!r}"
        )
    missing = [k for k in ("call_id", "turns", "summary", "end_reason") if k not in data]
    if missing:
        raise ReportError(f"{path}: call report lacks {', '.join(missing)}")
    return data
