"""Call reports (`specvoice.call_report/1` JSON) as one self-contained HTML page and as text.

The page has no external resources and no JavaScript: inline CSS, SVG drawn here.
Everything that comes from a report (transcripts above all: a caller may say anything)
goes through `esc`; numbers carry `data-*` attributes with their exact JSON value so
tests and scripts can read them back from the DOM.

Tool calls (issue 15) appear three times: as bars in the turn's waterfall (a failed call
red, its error in the tooltip), as a table under the waterfall (name, arguments, result or
error, ms), and in a "Tools" summary with voice to voice for turns with a tool call apart
from the others. Tool arguments carry what the caller said (a name stored as heard), so
they are escaped like transcripts.

End of turn and preemptive generation (issue 13), where the report has them: each turn
says how its end was decided (reason, the model's probability, eot_delay), carries a
badge for its preemptive generation (kept, or discarded and why; a kept one also means
STT did not run after the endpoint: the pause's transcript was reused), and its
waterfall marks the preemptive events (start, LLM start, kept / discarded) on a row of
their own. The per-turn table gains an end-of-turn delay column and a preemptive column,
and a "Preemptive generation" section shows summary.preemptive, when the report has
them. A report without these fields renders as it did before.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterable

from pipeline.report import HEADLINE_METRICS, ReportError, load_report, percentile, summarize_preemptive

# Re-exported for `specvoice report` and the tests: the page reads reports with pipeline.report's reader.
__all__ = ["ReportError", "load_report", "render_html", "text_comparison", "text_summary", "write_html"]

# The schema, its reader, percentiles and metric names are pipeline.report's: one definition.
METRICS = list(HEADLINE_METRICS)
METRIC_LABELS = HEADLINE_METRICS
STATS = ["p50", "p90", "max"]
LLM_STATS = ["tokens", "passes", "tokens_per_pass", "acceptance_rate", "tokens_per_s"]
# Waterfall rows: (label, from event, to events (first present wins), colour).
SEGMENTS = [
    ("user speech", "speech_start", ("last_voiced",), "#9aa5b1"),
    ("endpoint", "last_voiced", ("end_of_speech",), "#f0b429"),
    ("STT", "end_of_speech", ("transcript",), "#de911d"),
    ("TTFT", "llm_request", ("first_token",), "#e12d39"),
    ("to first sentence", "first_token", ("first_sentence",), "#ab091e"),
    ("LLM generation", "llm_request", ("llm_done",), "#f29b9b"),
    ("TTS first audio", "first_sentence", ("tts_first_audio",), "#8719e0"),
    ("playback", "first_audio_out", ("barge_in", "playback_done"), "#3ebd93"),
]
TOOL_OK_COLOUR = "#0b7285"
TOOL_FAILED_COLOUR = "#d64545"
# A tool's result can be a long list of slots: the table shows this much, the JSON has all.
TOOL_TEXT_MAX = 2000
# The end-of-turn delay (last voiced audio -> turn end decided): shown where reports have it.
EOT_METRIC = "eot_delay"
EOT_LABEL = "end-of-turn delay"
# Preemptive events (pipeline/stages/preempt.py) as the waterfall marks them: label, colour.
PREEMPT_EVENTS = {"start": ("start", "#2680c2"), "llm_start": ("LLM start", "#7b61ff"),
                  "kept": ("kept", "#2f9e44"), "discarded": ("discarded", "#9aa5b1")}
PREEMPT_KEPT_COLOUR = "#2f9e44"
PREEMPT_DISCARDED_COLOUR = "#c1c7cd"


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def num(value: Any) -> float | None:
    """A finite number from the report, else None (reports are data from elsewhere)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def fmt(value: Any, digits: int = 3) -> str:
    v = num(value)
    if v is None:
        return "—"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"{v:.{digits}f}"


def _data_value(value: Any) -> str:
    v = num(value)
    if v is None:
        return ""
    return str(value) if isinstance(value, int) else repr(float(value))


# ---------------------------------------------------------------- data access

def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _dicts(value: Any) -> list[dict]:
    """The dicts of a list ([] for anything else: a broken report's "turns": 1 crashed here)."""
    return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []


def turns(report: dict) -> list[dict]:
    return _dicts(report.get("turns"))


def metric_summary(report: dict) -> dict[str, dict[str, Any]]:
    """{metric: {p50, p90, max, n}}: the report's own summary, computed from turns if absent."""
    given = _dict(_dict(report.get("summary")).get("metrics"))
    out = {}
    for metric in METRICS:
        if isinstance(given.get(metric), dict):
            out[metric] = given[metric]
            continue
        values = [v for t in turns(report) if (v := num(_dict(t.get("metrics")).get(metric))) is not None]
        out[metric] = {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
                       "max": max(values) if values else None, "n": len(values)}
    return out


def llm_summary(report: dict) -> dict[str, Any]:
    return _dict(_dict(report.get("summary")).get("llm"))


def tool_calls(turn: dict) -> list[dict]:
    return [c for c in turn.get("tool_calls") or [] if isinstance(c, dict)]


def _spread(values: list[float]) -> dict[str, Any]:
    return {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
            "max": max(values) if values else None, "n": len(values)}


def tools_summary(report: dict) -> dict[str, Any]:
    """summary.tools as pipeline.report writes it; computed from the turns when the file
    has none (and tolerant of odd values there, unlike the writer, which makes them)."""
    given = _dict(_dict(report.get("summary")).get("tools"))
    if given:
        return given
    calls = [c for t in turns(report) for c in tool_calls(t)]
    v2v: dict[bool, list[float]] = {True: [], False: []}
    for t in turns(report):
        if (v := num(_dict(t.get("metrics")).get("voice_to_voice"))) is not None:
            v2v[bool(tool_calls(t))].append(v)
    return {"calls": len(calls), "failed": sum(1 for c in calls if not c.get("ok")),
            "turns": sum(1 for t in turns(report) if tool_calls(t)),
            "fallbacks": sum(1 for t in turns(report) if t.get("tool_fallback")),
            "voice_to_voice": {"with_tools": _spread(v2v[True]), "without_tools": _spread(v2v[False])}}


def uses_tools(report: dict) -> bool:
    return bool(num(tools_summary(report).get("calls"))) or any(tool_calls(t) for t in turns(report))


def preemptive_events(turn: dict) -> list[dict]:
    """The turn's preemptive events (start, llm_start, kept, discarded), as recorded."""
    return [e for e in _dict(turn.get("preemptive")).get("events") or [] if isinstance(e, dict)]


def preemptive_state(turn: dict) -> str | None:
    """"kept", "discarded", or None when no preemptive generation started in the turn."""
    if "preemptive_hit" not in turn:
        return None
    return "kept" if turn.get("preemptive_hit") is True else "discarded"


def discarded_why(turn: dict) -> list[str]:
    return [str(e.get("why")) for e in preemptive_events(turn) if e.get("event") == "discarded"]


def preemptive_summary(report: dict) -> dict[str, Any]:
    """summary.preemptive as pipeline.report writes it; computed from the turns when absent."""
    given = _dict(_dict(report.get("summary")).get("preemptive"))
    return given if given else summarize_preemptive(turns(report))


def uses_preemption(report: dict) -> bool:
    return bool(num(preemptive_summary(report).get("turns"))) or any(
        preemptive_state(t) is not None for t in turns(report))


def has_eot_delay(report: dict) -> bool:
    return any(num(_dict(t.get("metrics")).get(EOT_METRIC)) is not None for t in turns(report))


def eot_summary(report: dict) -> dict[str, Any]:
    given = _dict(_dict(_dict(report.get("summary")).get("metrics")).get(EOT_METRIC))
    if given:
        return given
    return _spread([v for t in turns(report) if (v := num(_dict(t.get("metrics")).get(EOT_METRIC))) is not None])


def _tool_name(call: dict) -> str:
    # None when the model's call could not even be parsed: the row must still say so.
    name = call.get("name")
    return "(unparsed call)" if name is None or name == "" else str(name)


def _tool_json(value: Any) -> str:
    """Arguments / result as the model saw them: raw text stays text, the rest JSON."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= TOOL_TEXT_MAX else text[: TOOL_TEXT_MAX - 1] + "…"


# ---------------------------------------------------------------- text

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _plain(value: Any, width: int | None = None) -> str:
    """Report strings for a terminal: no control characters (no escape sequences)."""
    text = _CONTROL.sub(" ", "" if value is None else str(value))
    if width is not None and len(text) > width:
        text = text[: width - 1] + "…"
    return text


def text_summary(report: dict) -> str:
    models = _dict(report.get("models"))
    lines = [
        f"call {_plain(report.get('call_id'), 40)}  started {_plain(report.get('started_at'), 32)}  "
        f"{fmt(report.get('duration_s'), 1)} s  {len(turns(report))} turns  end: {_plain(report.get('end_reason'), 30)}",
    ]
    if report.get("error"):
        lines.append(f"error: {_plain(report.get('error'), 200)}")
    if any(models.values()):
        lines.append("models: " + ", ".join(f"{k} {_plain(v, 48)}" for k, v in models.items() if v))
    lines.append(f"{'metric (s)':<18}{'p50':>8}{'p90':>8}{'max':>8}{'n':>5}")
    for metric, stats in metric_summary(report).items():
        stats = _dict(stats)
        lines.append(f"{METRIC_LABELS[metric]:<18}" + "".join(f"{fmt(stats.get(s)):>8}" for s in STATS)
                     + f"{fmt(stats.get('n')):>5}")
    llm = llm_summary(report)
    if llm:
        lines.append(
            f"LLM: {fmt(llm.get('tokens'))} tokens in {fmt(llm.get('passes'))} target passes: "
            f"{fmt(llm.get('tokens_per_pass'), 2)} tokens/pass, acceptance {fmt(llm.get('acceptance_rate'), 2)}, "
            f"{fmt(llm.get('tokens_per_s'), 1)} tokens/s"
        )
    if uses_tools(report):
        lines.append(_text_tools(report))
    if uses_preemption(report):
        lines.append(_text_preemptive(report))
    for t in turns(report)[:12]:
        m = _dict(t.get("metrics"))
        flag = " [interrupted]" if t.get("interrupted") else ""
        if tool_calls(t):
            names = ", ".join(_tool_name(c) + ("" if c.get("ok") else " FAILED") for c in tool_calls(t))
            flag += f" [tools: {_plain(names, 60)}]"
        state = preemptive_state(t)
        if state == "kept":
            flag += " [preemptive: kept]"
        elif state == "discarded":
            flag += f" [preemptive: discarded: {_plain(', '.join(discarded_why(t)), 40)}]"
        lines.append(f"  #{_plain(t.get('index'))} v2v {fmt(m.get('voice_to_voice'))}  "
                     f"user: {_plain(t.get('user_text'), 40)!s} -> agent: {_plain(t.get('agent_text'), 40)}{flag}")
    if len(turns(report)) > 12:
        lines.append(f"  ... {len(turns(report)) - 12} more turns")
    return "\n".join(lines)


def _text_tools(report: dict) -> str:
    tools = tools_summary(report)
    v2v = _dict(tools.get("voice_to_voice"))

    def spread(key: str) -> str:
        d = _dict(v2v.get(key))
        return f"{fmt(d.get('p50'))} / {fmt(d.get('p90'))} s (n {fmt(d.get('n'))})"

    return (f"tools: {fmt(tools.get('calls'))} calls, {fmt(tools.get('failed'))} failed, in {fmt(tools.get('turns'))} "
            f"turns, {fmt(tools.get('fallbacks'))} fallbacks; voice to voice p50 / p90 with tools "
            f"{spread('with_tools')}, without {spread('without_tools')}")


def _text_preemptive(report: dict) -> str:
    pre = preemptive_summary(report)
    why = _dict(pre.get("discarded"))
    reasons = ", ".join(f"{_plain(k, 30)} {fmt(v)}" for k, v in why.items()) or "none"
    return (f"preemptive: {fmt(pre.get('starts'))} starts in {fmt(pre.get('turns'))} turns, "
            f"{fmt(pre.get('hits'))} kept (hit rate {fmt(pre.get('hit_rate'), 2)}); discarded: {reasons}")


def text_comparison(reports: list[dict]) -> str:
    """Metric p50 / p90 per report, side by side."""
    names = [_plain(r.get("call_id") or f"#{i}", 16) for i, r in enumerate(reports)]
    lines = [f"{'p50 / p90 (s)':<18}" + "".join(f"{n:>18}" for n in names)]
    summaries = [metric_summary(r) for r in reports]
    for metric in METRICS:
        cells = [f"{fmt(_dict(s[metric]).get('p50'))} / {fmt(_dict(s[metric]).get('p90'))}" for s in summaries]
        lines.append(f"{METRIC_LABELS[metric]:<18}" + "".join(f"{c:>18}" for c in cells))
    for key in ("tokens_per_pass", "acceptance_rate", "tokens_per_s"):
        cells = [fmt(llm_summary(r).get(key), 2) for r in reports]
        lines.append(f"{key:<18}" + "".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


# ---------------------------------------------------------------- SVG

def _nice_step(span: float, target_ticks: int = 6) -> float:
    raw = max(span, 1e-9) / target_ticks
    power = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * power:
            return m * power
    return 10 * power


def _tool_rows(turn: dict) -> list[tuple[int, dict, float, float]]:
    """(index in the turn's tool_calls, call, start, end) for calls with usable times."""
    rows = []
    for k, call in enumerate(tool_calls(turn)):
        a, b = num(call.get("start")), num(call.get("end"))
        if a is not None and b is not None and b >= a:
            rows.append((k, call, a, b))
    return rows


def tool_ms(call: dict) -> str:
    """The time a tool call took, as the page and the terminal show it: the tool's own
    elapsed_ms (a database call can take well under a millisecond, hence two decimals)."""
    return fmt(call.get("elapsed_ms"), 2)


def _tool_title(call: dict, a: float, b: float) -> str:
    spent = f"{tool_ms(call)} ms" if num(call.get("elapsed_ms")) is not None else f"{(b - a) * 1000:.2f} ms"
    title = f"tool {_tool_name(call)}({_tool_json(call.get('arguments'))}): {spent}"
    if not call.get("ok"):
        return f"{title}; FAILED: {call.get('error') or 'no error recorded'}"
    if call.get("action"):
        title += f"; then {call.get('action')}" + (f" ({call.get('reason')})" if call.get("reason") else "")
    return title


def _preempt_marks(turn: dict) -> list[tuple[dict, float]]:
    """(event, t) for the turn's preemptive events with a usable time."""
    return [(e, t) for e in preemptive_events(turn) if (t := num(e.get("t"))) is not None]


def _preempt_attempts(turn: dict) -> list[dict[str, Any]]:
    """Each preemptive start with its LLM start and outcome (kept / discarded and why), in
    the order they happened (a start's events all come before the next start)."""
    attempts: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for e, t in _preempt_marks(turn):
        event = e.get("event")
        if event == "start" or current is None:
            current = {"start": t, "llm": None, "end": None, "outcome": None, "why": None}
            attempts.append(current)
            if event == "start":
                continue
        if event == "llm_start":
            current["llm"] = t
        elif event in ("kept", "discarded"):
            current.update(end=t, outcome=event, why=e.get("why"))
            current = None
    return attempts


def _preempt_title(e: dict, rel: float) -> str:
    event = str(e.get("event"))
    label = PREEMPT_EVENTS.get(event, (event, ""))[0]
    text = f"preemptive {label} at +{rel:.3f} s"
    if event == "discarded":
        text += f": {e.get('why')}"
    elif event == "start" and e.get("audio_s") is not None:
        text += f" (pause {e.get('pause')}, {fmt(e.get('audio_s'), 2)} s of audio)"
    elif event == "kept":
        text += f" ({e.get('groups_ready')} token groups ready{', finished' if e.get('finished') else ''})"
    return text


def waterfall_svg(turn: dict, width: int = 760) -> str:
    timeline = {k: v for k, v in _dict(turn.get("timeline")).items() if num(v) is not None}
    rows = []
    for label, start, ends, colour in SEGMENTS:
        end = next((e for e in ends if e in timeline), None)
        if start in timeline and end is not None and timeline[end] >= timeline[start]:
            rows.append((label, start, end, float(timeline[start]), float(timeline[end]), colour))
    tools = _tool_rows(turn)
    marks = _preempt_marks(turn)
    if not rows and not tools and not marks:
        return '<p class="muted">no timeline for this turn</p>'
    t0 = min([r[3] for r in rows] + [a for _, _, a, _ in tools] + [t for _, t in marks])
    t1 = max([r[4] for r in rows] + [b for _, _, _, b in tools] + [t for _, t in marks])
    span = max(t1 - t0, 0.05)
    label_w, right, top, row_h = 130, 16, 8, 20
    plot_w = width - label_w - right
    # Room under the last row for the voice-to-voice line and its label, then the ticks.
    height = top + row_h * (len(rows) + len(tools) + (1 if marks else 0)) + 36

    def x(t: float) -> float:
        return label_w + (t - t0) / span * plot_w

    parts = [f'<svg class="waterfall" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'xmlns="http://www.w3.org/2000/svg">']
    step = _nice_step(span)
    tick = 0.0
    while tick <= span + 1e-9:
        px = x(t0 + tick)
        parts.append(f'<line x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{height - 22}" class="grid"/>')
        parts.append(f'<text x="{px:.1f}" y="{height - 8}" class="tick" text-anchor="middle">{tick:.2f}s</text>')
        tick += step
    for i, (label, start, end, a, b, colour) in enumerate(rows):
        y = top + i * row_h
        w = max(x(b) - x(a), 1.5)
        parts.append(f'<text x="{label_w - 6}" y="{y + 14}" class="label" text-anchor="end">{esc(label)}</text>')
        parts.append(
            f'<rect x="{x(a):.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" fill="{colour}" '
            f'data-segment="{esc(label)}" data-start="{a!r}" data-end="{b!r}">'
            f'<title>{esc(label)}: {b - a:.3f} s ({esc(start)} → {esc(end)})</title></rect>'
        )
    # One row per tool call, below the stages: the call happens inside "LLM generation"
    # (the turn waits for it before generating again), so it gets its own row to be seen.
    for j, (k, call, a, b) in enumerate(tools):
        y = top + (len(rows) + j) * row_h
        w = max(x(b) - x(a), 1.5)  # a call refused before it ran has no duration: still visible
        ok = bool(call.get("ok"))
        name = _tool_name(call)
        spent = f"{tool_ms(call)} ms" if num(call.get("elapsed_ms")) is not None else f"{(b - a) * 1000:.2f} ms"
        note = spent if ok else f"✗ failed · {spent}"
        short = name if len(name) <= 18 else name[:17] + "…"
        title = esc(_tool_title(call, a, b))
        parts.append(f'<text x="{label_w - 6}" y="{y + 14}" class="label tool-label" text-anchor="end">'
                     f'<title>{title}</title>{esc(short)}</text>')
        parts.append(
            f'<rect x="{x(a):.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" '
            f'fill="{TOOL_OK_COLOUR if ok else TOOL_FAILED_COLOUR}" class="tool-bar {"ok" if ok else "failed"}" '
            f'data-tool="{k}" data-name="{esc(name)}" data-ok="{"true" if ok else "false"}" '
            f'data-elapsed-ms="{_data_value(call.get("elapsed_ms"))}" data-start="{a!r}" data-end="{b!r}">'
            f"<title>{title}</title></rect>"
        )
        # The time beside the bar, inside the plot: left of the bar when it ends near the edge.
        after = x(a) + w + 4
        anchor, tx = ("start", after) if after < width - right - 90 else ("end", x(a) - 4)
        parts.append(f'<text x="{tx:.1f}" y="{y + 14}" class="tool-note {"ok" if ok else "failed"}" '
                     f'text-anchor="{anchor}" data-tool="{k}">{esc(note)}</text>')
    if marks:
        parts.append(_preempt_row(turn, marks, x, top + (len(rows) + len(tools)) * row_h, row_h, label_w, width,
                                  right, height, t0))
    if "last_voiced" in timeline and "first_audio_out" in timeline:
        a, b = float(timeline["last_voiced"]), float(timeline["first_audio_out"])
        y = height - 22
        parts.append(f'<line x1="{x(a):.1f}" y1="{y}" x2="{x(b):.1f}" y2="{y}" class="v2v"/>'
                     f'<text x="{(x(a) + x(b)) / 2:.1f}" y="{y - 3}" class="v2vlabel" text-anchor="middle">'
                     f'voice to voice {b - a:.3f} s</text>')
    parts.append("</svg>")
    return "".join(parts)


def _preempt_row(turn: dict, marks: list[tuple[dict, float]], x: Any, y: float, row_h: int, label_w: int,
                 width: int, right: int, height: int, t0: float) -> str:
    """The preemptive row: a bar per start (to its outcome; green kept, grey discarded),
    a dot at its LLM start, the outcome beside it; and a dashed line across the whole
    waterfall at every preemptive event, so it reads against the turn's stages."""
    parts = [f'<text x="{label_w - 6}" y="{y + 14}" class="label preempt-label" text-anchor="end">preemptive</text>']
    for e, t in marks:
        event = str(e.get("event"))
        colour = PREEMPT_EVENTS.get(event, (event, "#7b8794"))[1]
        why = f' data-why="{esc(e.get("why"))}"' if event == "discarded" else ""
        parts.append(f'<line x1="{x(t):.1f}" y1="4" x2="{x(t):.1f}" y2="{height - 22}" stroke="{colour}" '
                     f'class="preempt-mark {esc(event)}" data-event="{esc(event)}" data-t="{t!r}"{why}>'
                     f'<title>{esc(_preempt_title(e, t - t0))}</title></line>')
    for k, a in enumerate(_preempt_attempts(turn)):
        end = a["end"] if a["end"] is not None else (a["llm"] if a["llm"] is not None else a["start"])
        kept = a["outcome"] == "kept"
        w = max(x(end) - x(a["start"]), 1.5)
        outcome = a["outcome"] or "open"
        note = "kept" if kept else (f"✗ {a['why']}" if a["outcome"] == "discarded" else "no outcome recorded")
        parts.append(f'<rect x="{x(a["start"]):.1f}" y="{y + 5}" width="{w:.1f}" height="{row_h - 10}" '
                     f'fill="{PREEMPT_KEPT_COLOUR if kept else PREEMPT_DISCARDED_COLOUR}" '
                     f'class="preempt-bar {esc(outcome)}" data-attempt="{k}" data-outcome="{esc(outcome)}" '
                     f'data-start="{a["start"]!r}" data-end="{end!r}"><title>preemptive start {k + 1}: '
                     f'{esc(note)}</title></rect>')
        if a["llm"] is not None:
            parts.append(f'<circle cx="{x(a["llm"]):.1f}" cy="{y + row_h / 2:.1f}" r="3.5" class="preempt-llm" '
                         f'data-attempt="{k}"><title>LLM started at +{a["llm"] - t0:.3f} s</title></circle>')
        after = x(a["start"]) + w + 4
        anchor, tx = ("start", after) if after < width - right - 110 else ("end", x(a["start"]) - 4)
        parts.append(f'<text x="{tx:.1f}" y="{y + 14}" class="preempt-note {esc(outcome)}" text-anchor="{anchor}" '
                     f'data-attempt="{k}">{esc(note)}</text>')
    return "".join(parts)


def v2v_plot_svg(report: dict, width: int = 760, height: int = 240) -> str:
    points = [(i, v) for i, t in enumerate(turns(report))
              if (v := num(_dict(t.get("metrics")).get("voice_to_voice"))) is not None]
    if not points:
        return '<p class="muted">no voice-to-voice measurements</p>'
    left, right, top, bottom = 56, 16, 12, 34
    n = max(len(turns(report)) - 1, 1)
    vmax = max(v for _, v in points) * 1.15 or 1.0
    step = _nice_step(vmax, 5)

    def x(i: float) -> float:
        return left + (i / n) * (width - left - right) if len(turns(report)) > 1 else (left + width - right) / 2

    def y(v: float) -> float:
        return top + (1 - v / vmax) * (height - top - bottom)

    parts = [f'<svg id="v2v-plot" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'xmlns="http://www.w3.org/2000/svg">']
    tick = 0.0
    while tick <= vmax + 1e-9:
        parts.append(f'<line x1="{left}" y1="{y(tick):.1f}" x2="{width - right}" y2="{y(tick):.1f}" class="grid"/>'
                     f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" class="tick" text-anchor="end">{tick:.2f}s</text>')
        tick += step
    p50 = num(_dict(metric_summary(report)["voice_to_voice"]).get("p50"))
    if p50 is not None:
        parts.append(f'<line x1="{left}" y1="{y(p50):.1f}" x2="{width - right}" y2="{y(p50):.1f}" class="p50"/>'
                     f'<text x="{width - right}" y="{y(p50) - 4:.1f}" class="tick" text-anchor="end">p50 {p50:.3f}s</text>')
    path = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in points)
    parts.append(f'<polyline points="{path}" class="line"/>')
    for i, v in points:
        t = turns(report)[i]
        parts.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="4" class="point" data-turn="{i}" '
                     f'data-value="{v!r}"><title>turn {esc(t.get("index", i))}: {v:.3f} s</title></circle>')
        parts.append(f'<text x="{x(i):.1f}" y="{height - 14}" class="tick" text-anchor="middle">{esc(t.get("index", i))}</text>')
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 1}" class="tick" text-anchor="middle">turn</text>')
    parts.append("</svg>")
    return "".join(parts)


# ---------------------------------------------------------------- HTML

# A click on a turn (data-seek: its start in the recording) plays the recording from there.
SEEK_LEAD_S = 0.3
SEEK_SCRIPT = ('(function(){var a=document.getElementById("recording");if(!a)return;'
               'document.querySelectorAll(".turn[data-seek]").forEach(function(t){t.classList.add("seekable");'
               't.addEventListener("click",function(){a.currentTime=parseFloat(t.dataset.seek);a.play();});});})();')
SEEK_SCRIPT_SHA256 = base64.b64encode(hashlib.sha256(SEEK_SCRIPT.encode()).digest()).decode()

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1f2933;margin:24px auto;max-width:1040px;padding:0 16px;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #e4e7eb;padding-bottom:4px}
h3{font-size:14px;margin:18px 0 4px}.muted{color:#7b8794}.error{color:#ab091e}
table{border-collapse:collapse;margin:6px 0}th,td{padding:3px 10px;text-align:right;border-bottom:1px solid #eef0f3}
th:first-child,td:first-child{text-align:left}thead th{background:#f5f7fa}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:10px 0}.card{border:1px solid #e4e7eb;border-radius:6px;padding:8px 14px;min-width:120px}
.card .v{font-size:20px;font-weight:600}.card .k{color:#7b8794;font-size:12px}
svg{display:block;max-width:100%;height:auto;background:#fcfcfd}svg .grid{stroke:#e4e7eb;stroke-width:1}
svg text{font:11px system-ui,sans-serif;fill:#3e4c59}svg .v2v{stroke:#1f2933;stroke-width:2}svg .v2vlabel{font-weight:600}
svg .line{fill:none;stroke:#2680c2;stroke-width:2}svg .point{fill:#2680c2}svg .p50{stroke:#e12d39;stroke-dasharray:4 3}
.turn{border:1px solid #e4e7eb;border-radius:6px;padding:8px 12px;margin:12px 0}
.transcript{display:grid;grid-template-columns:1fr 1fr;gap:12px;margin:6px 0}
.transcript div{background:#f5f7fa;border-radius:6px;padding:6px 10px;white-space:pre-wrap;overflow-wrap:anywhere}
.transcript .agent{background:#e6f6ff}.unheard{color:#9aa5b1;text-decoration:line-through}
.badge{display:inline-block;background:#ffe3e3;color:#ab091e;border-radius:4px;padding:0 6px;font-size:12px;margin-left:6px}
pre{background:#f5f7fa;padding:8px;overflow:auto;font-size:12px}
svg .tool-note{font-size:10px}svg .tool-note.failed{fill:#ab091e;font-weight:600}
table.tool-calls{width:100%;table-layout:fixed}table.tool-calls td,table.tool-calls th{text-align:left;vertical-align:top}
table.tool-calls .mono{font:12px ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;overflow-wrap:anywhere}
table.tool-calls td.ms,table.tool-calls th:nth-child(5){text-align:right}table.tool-calls th:nth-child(1){width:6%}
table.tool-calls th:nth-child(2){width:17%}table.tool-calls th:nth-child(3){width:31%}table.tool-calls th:nth-child(5){width:8%}tr.tool-call.failed{background:#fff5f5}tr.tool-call.failed .tool-error{color:#ab091e}
.badge.tool{background:#e3f8ff;color:#0b7285}
.turn.seekable{cursor:pointer}.turn.seekable:hover{background:#f5f7fa}audio#recording{width:100%}
"""
# Only on pages with end-of-turn or preemptive data: older reports keep their page as it was.
TURN_TAKING_CSS = """
svg .preempt-mark{stroke-width:1;stroke-dasharray:3 3;opacity:.8}svg .preempt-llm{fill:#7b61ff}
svg .preempt-note{font-size:10px}svg .preempt-note.kept{fill:#2f9e44;font-weight:600}svg .preempt-label{font-style:italic}
.badge.preempt.kept{background:#ebfbee;color:#2b8a3e}.badge.preempt.discarded{background:#f1f3f5;color:#495057}
p.eot,p.preempt{margin:2px 0;font-size:13px;color:#3e4c59}p.eot .k,p.preempt .k{color:#7b8794}
.stt-skipped{color:#2b8a3e;font-weight:600}
"""


def _metric_cell(attrs: str, value: Any, digits: int = 3) -> str:
    return f'<td {attrs} data-value="{_data_value(value)}">{fmt(value, digits)}</td>'


def _summary_table(report: dict) -> str:
    rows = []
    for metric, stats in metric_summary(report).items():
        stats = _dict(stats)
        cells = "".join(_metric_cell(f'data-metric="{metric}" data-stat="{s}"', stats.get(s)) for s in STATS + ["n"])
        rows.append(f'<tr><th scope="row">{esc(METRIC_LABELS[metric])}</th>{cells}</tr>')
        if metric == "endpoint_delay" and has_eot_delay(report):
            stats = eot_summary(report)
            cells = "".join(_metric_cell(f'data-metric="{EOT_METRIC}" data-stat="{s}"', stats.get(s))
                            for s in STATS + ["n"])
            rows.append(f'<tr><th scope="row">{EOT_LABEL}</th>{cells}</tr>')
    return ('<table class="summary"><thead><tr><th>metric (seconds)</th><th>p50</th><th>p90</th><th>max</th>'
            f'<th>n</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')


def _cards(kind: str, values: dict, labels: dict[str, str], digits: Callable[[str], int] = lambda key: 3) -> str:
    """One card per label: the value (data-<kind>="<key>", its raw value in data-value) over its label."""
    return "".join(
        f'<div class="card"><div class="v" data-{kind}="{key}" data-value="{_data_value(values.get(key))}">'
        f'{fmt(values.get(key), digits(key))}</div><div class="k">{label}</div></div>'
        for key, label in labels.items()
    )


def _llm_cards(report: dict) -> str:
    llm = llm_summary(report)
    if not llm:
        return '<p class="muted">no LLM statistics</p>'
    labels = {"tokens": "tokens", "passes": "target passes", "tokens_per_pass": "tokens per pass",
              "acceptance_rate": "acceptance rate", "tokens_per_s": "tokens / s"}
    cards = _cards("llm", llm, {key: labels[key] for key in LLM_STATS}, lambda key: 2)
    return f'<div class="cards llm">{cards}</div>'


def _tools_section(report: dict) -> str:
    """Counts, and voice to voice for turns with a tool call apart: a tool turn waits for
    the tool and a second generation, so it is judged against its own kind."""
    tools = tools_summary(report)
    labels = {"calls": "tool calls", "failed": "failed", "turns": "turns with tools", "fallbacks": "spoken fallbacks"}
    cards = _cards("tools", tools, labels)
    v2v = _dict(tools.get("voice_to_voice"))
    rows = []
    for key, label in (("with_tools", "turns with a tool call"), ("without_tools", "turns without")):
        stats = _dict(v2v.get(key))
        cells = "".join(_metric_cell(f'data-tools-v2v="{key}" data-stat="{stat}"', stats.get(stat))
                        for stat in STATS + ["n"])
        rows.append(f'<tr><th scope="row">{label}</th>{cells}</tr>')
    return (f'<h2>Tools</h2><div class="cards tools">{cards}</div>'
            '<table class="tools-v2v"><thead><tr><th>voice to voice (seconds)</th><th>p50</th><th>p90</th>'
            f'<th>max</th><th>n</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')


def _preemptive_section(report: dict) -> str:
    """summary.preemptive: turns with a start, starts, kept turns, hit rate, and why the
    discarded ones were dropped."""
    pre = preemptive_summary(report)
    labels = {"turns": "turns with a start", "starts": "starts", "hits": "kept (hits)", "hit_rate": "hit rate"}
    cards = _cards("preemptive", pre, labels, lambda key: 2 if key == "hit_rate" else 3)
    why = _dict(pre.get("discarded"))
    if why:
        rows = "".join(f'<tr data-why="{esc(k)}"><td>{esc(k)}</td><td data-value="{_data_value(v)}">{fmt(v)}</td></tr>'
                       for k, v in sorted(why.items(), key=lambda kv: (-(num(kv[1]) or 0), str(kv[0]))))
        table = (f'<table class="preempt-discarded"><thead><tr><th>discarded because</th><th>starts</th></tr></thead>'
                 f'<tbody>{rows}</tbody></table>')
    else:
        table = '<p class="muted preempt-discarded">no preemptive start was discarded</p>'
    return f'<h2>Preemptive generation</h2><div class="cards preemptive">{cards}</div>{table}'


def _taken_back_section(report: dict) -> str:
    """Turns the caller went on speaking in before their answer was heard (report
    "taken_back", pipeline/stages/take_back.py): not answered, their audio began the next
    turn. What STT heard, what the agent had begun, and when the caller went on."""
    entries = _dicts(report.get("taken_back"))
    if not entries:
        return ""
    rows = "".join(
        f'<tr data-before-turn="{esc(e.get("before_turn"))}"><td>{esc(e.get("before_turn"))}</td>'
        f'<td class="caller">{esc(e.get("user_text"))}</td><td class="agent">{esc(e.get("agent_text"))}</td>'
        f'<td data-value="{_data_value(e.get("agent_audio_s"))}">{fmt(e.get("agent_audio_s"))}</td>'
        f'<td data-value="{_data_value(e.get("resumed_at"))}">{fmt(e.get("resumed_at"))}</td></tr>' for e in entries)
    return ('<h2>Turns taken back</h2><p class="muted">the caller went on before the answer was heard: '
            'not answered; the words begin the turn named</p><table class="taken-back"><thead><tr>'
            '<th>joined to turn</th><th>heard so far</th><th>agent had begun</th><th>agent audio (s)</th>'
            f'<th>caller went on at (s)</th></tr></thead><tbody>{rows}</tbody></table>')


def _tool_table(turn: dict, i: int) -> str:
    calls = tool_calls(turn)
    if not calls:
        return ""
    rows = []
    for k, call in enumerate(calls):
        ok = bool(call.get("ok"))
        name = _tool_name(call)
        if ok:
            outcome = f'<td class="mono tool-result">{esc(_tool_json(call.get("result")))}</td>'
        else:
            outcome = (f'<td class="mono tool-error"><strong>failed:</strong> '
                       f'{esc(call.get("error") or "no error recorded")}</td>')
        action = ""
        if call.get("action"):
            action = f' <span class="badge tool">{esc(call.get("action"))}</span>'
        rows.append(
            f'<tr class="tool-call {"ok" if ok else "failed"}" data-turn="{i}" data-tool="{k}" '
            f'data-name="{esc(name)}" data-ok="{"true" if ok else "false"}">'
            f'<td data-field="round">{esc(call.get("round", ""))}</td>'
            f'<td class="mono"><span class="tool-name">{esc(name)}</span>{action}</td>'
            f'<td class="mono tool-args">{esc(_tool_json(call.get("arguments")))}</td>{outcome}'
            f'<td class="ms" data-field="elapsed_ms" data-value="{_data_value(call.get("elapsed_ms"))}">'
            f'{tool_ms(call)}</td></tr>'
        )
    return (f'<table class="tool-calls" data-turn="{i}"><thead><tr><th>round</th><th>tool</th><th>arguments</th><th>result / error</th><th>ms</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def _turn_metrics(report: dict) -> list[str]:
    """The per-turn table's metric columns: the headline ones, and eot_delay after the
    endpoint delay when the report has it."""
    if not has_eot_delay(report):
        return METRICS
    k = METRICS.index("endpoint_delay") + 1
    return METRICS[:k] + [EOT_METRIC] + METRICS[k:]


def _preempt_cell(turn: dict, i: int) -> str:
    state = preemptive_state(turn)
    value = "" if state is None else ("true" if state == "kept" else "false")
    text = "" if state is None else state
    if state == "discarded":
        text += f" ({', '.join(discarded_why(turn))})"
    return f'<td data-turn="{i}" data-field="preemptive_hit" data-value="{value}">{esc(text)}</td>'


def _turn_table(report: dict) -> str:
    metrics = _turn_metrics(report)
    labels = {**METRIC_LABELS, EOT_METRIC: EOT_LABEL}
    head = "".join(f"<th>{esc(labels[m])}</th>" for m in metrics)
    with_tools = uses_tools(report)
    with_preemption = uses_preemption(report)
    rows = []
    for i, t in enumerate(turns(report)):
        m = _dict(t.get("metrics"))
        llm = _dict(t.get("llm"))
        cells = "".join(_metric_cell(f'data-turn="{i}" data-metric="{metric}"', m.get(metric)) for metric in metrics)
        cells += "".join(_metric_cell(f'data-turn="{i}" data-llm="{key}"', llm.get(key), 2)
                         for key in ("tokens_per_pass", "acceptance_rate"))
        if with_tools:
            calls = tool_calls(t)
            failed = sum(1 for c in calls if not c.get("ok"))
            text = f"{len(calls)}" + (f" ({failed} failed)" if failed else "") if calls else ""
            cells += f'<td data-turn="{i}" data-field="tool_calls" data-value="{len(calls)}">{text}</td>'
        if with_preemption:
            cells += _preempt_cell(t, i)
        rows.append(f'<tr><td>{esc(t.get("index", i))}</td>{cells}</tr>')
    tools_head = "<th>tools</th>" if with_tools else ""
    tools_head += "<th>preemptive</th>" if with_preemption else ""
    return (f'<table class="turns"><thead><tr><th>turn</th>{head}<th>tokens/pass</th><th>acceptance</th>{tools_head}'
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table>')


def _agent_said(turn: dict) -> str:
    said = str(turn.get("agent_text") or "")
    if not turn.get("interrupted"):
        return esc(said)
    heard = str(turn.get("agent_text_heard") or "")
    if said.startswith(heard):
        return f'{esc(heard)}<span class="unheard" title="not heard: interrupted">{esc(said[len(heard):])}</span>'
    return f'{esc(heard)}<br><span class="unheard" title="generated">{esc(said)}</span>'


def _turn_section(report: dict, i: int, turn: dict) -> str:
    flag = '<span class="badge">interrupted</span>' if turn.get("interrupted") else ""
    calls = tool_calls(turn)
    if calls:
        failed = sum(1 for c in calls if not c.get("ok"))
        flag += (f'<span class="badge tool">{len(calls)} tool call{"s" if len(calls) > 1 else ""}'
                 f'{f", {failed} failed" if failed else ""}</span>')
    if turn.get("tool_fallback"):
        flag += '<span class="badge" data-field="tool_fallback">spoke the fallback</span>'
    if turn.get("hold_line"):
        flag += '<span class="badge tool" data-field="hold_line">hold line while the tool ran</span>'
    guarded = _dicts(turn.get("guarded"))
    if guarded:
        # The fact guard held sentences back: what the model said, and why, on hover.
        why = "; ".join(f'"{g.get("sentence")}": {g.get("why")}' for g in guarded)
        flag += (f'<span class="badge" data-field="guarded" title="{esc(why)}">guarded: {len(guarded)} '
                 f'sentence{"s" if len(guarded) > 1 else ""} not said</span>')
    action = _dict(turn.get("action"))
    if action.get("action"):
        reason = f": {action.get('reason')}" if action.get("reason") else ""
        flag += f'<span class="badge tool" data-field="action">{esc(action.get("action"))}{esc(reason)}</span>'
    state = preemptive_state(turn)
    if state == "kept":
        flag += '<span class="badge preempt kept" data-field="preemptive" data-value="kept">preemptive: kept</span>'
    elif state == "discarded":
        why = ", ".join(discarded_why(turn)) or "no reason recorded"
        flag += (f'<span class="badge preempt discarded" data-field="preemptive" data-value="discarded">'
                 f'preemptive: discarded: {esc(why)}</span>')
    v2v = num(_dict(turn.get("metrics")).get("voice_to_voice"))
    v2v_text = f" — voice to voice {v2v:.3f} s" if v2v is not None else ""
    # Where the turn begins in the call's recording (seconds since the call start, as the
    # timeline): a page with the recording seeks there when the turn is clicked.
    seek = num(_dict(turn.get("timeline")).get("speech_start"))
    seek_attr = f' data-seek="{max(0.0, seek - SEEK_LEAD_S):.3f}"' if seek is not None else ""
    return (
        f'<div class="turn" id="turn-{i}"{seek_attr}><h3>Turn {esc(turn.get("index", i))}{esc(v2v_text)}{flag}</h3>'
        f"{_eot_line(turn, i)}{_preempt_line(turn, i)}{_stt_stream_line(turn, i)}"
        f'<div class="transcript"><div class="user" data-role="user">{esc(turn.get("user_text") or "")}</div>'
        f'<div class="agent" data-role="agent">{_agent_said(turn)}</div></div>'
        f"{waterfall_svg(turn)}{_tool_table(turn, i)}</div>"
    )


def _eot_line(turn: dict, i: int) -> str:
    """How the turn's end was decided: reason, the end-of-turn model's probability that the
    turn was complete, and the delay from the last voiced audio to that decision."""
    eot = _dict(turn.get("end_of_turn"))
    delay = _dict(turn.get("metrics")).get(EOT_METRIC)
    if not eot and num(delay) is None:
        return ""
    parts = [f'<span class="k">end of turn:</span> <span data-field="reason">{esc(eot.get("reason") or "—")}</span>']
    if num(eot.get("probability")) is not None:
        parts.append(f'<span class="k">P(complete)</span> <span data-field="probability" '
                     f'data-value="{_data_value(eot.get("probability"))}">{fmt(eot.get("probability"), 2)}</span>')
    if num(delay) is not None:
        parts.append(f'<span class="k">{EOT_METRIC}</span> <span data-field="{EOT_METRIC}" '
                     f'data-value="{_data_value(delay)}">{fmt(delay)} s</span>')
    if num(eot.get("pauses")) is not None and eot.get("pauses") != 1:
        parts.append(f'<span class="k">pauses</span> <span data-field="pauses">{fmt(eot.get("pauses"))}</span>')
    return f'<p class="eot" data-turn="{i}">{" · ".join(parts)}</p>'


def _preempt_line(turn: dict, i: int) -> str:
    """The turn's preemptive generation in words: starts, outcome, and (kept) that STT did
    not run after the endpoint: the turn reused the transcript of the pause."""
    state = preemptive_state(turn)
    if state is None:
        return ""
    starts = _dict(turn.get("preemptive")).get("starts")
    parts = [f'<span class="k">preemptive:</span> <span data-field="starts" data-value="{_data_value(starts)}">'
             f'{fmt(starts)} start{"" if starts == 1 else "s"}</span>']
    why = discarded_why(turn)
    if why:
        parts.append(f"discarded: {esc(', '.join(why))}")
    if state == "kept":
        kept = next((e for e in preemptive_events(turn) if e.get("event") == "kept"), {})
        ready = f" ({fmt(kept.get('groups_ready'))} token groups ready" if kept.get("groups_ready") is not None else ""
        ready += (", finished" if kept.get("finished") else "") + (")" if ready else "")
        parts.append(f"kept{ready}")
        # Kept means the turn's transcript was the pause's (the same audio): no STT after the endpoint.
        parts.append('<span class="stt-skipped" data-field="stt_skipped">STT skipped after the endpoint '
                     '(the pause\'s transcript was reused)</span>')
    return f'<p class="preempt" data-turn="{i}">{" · ".join(parts)}</p>'


def _stt_stream_line(turn: dict, i: int) -> str:
    """Streaming STT (stt.streaming) in the turn: passes while the caller spoke, the stable
    and interim transcripts in order (time from the start of speech), and what was left to
    transcribe after the end of the turn; or why the whole utterance was transcribed."""
    stream = _dict(turn.get("stt_stream"))
    if not stream:
        return ""
    if not stream.get("used"):
        return (f'<p class="stt-stream" data-turn="{i}"><span class="k">streaming STT:</span> '
                f'<span data-field="stt_stream_used" data-value="false">not used: {esc(stream.get("why") or "—")}'
                "</span></p>")
    after = _dict(turn.get("metrics")).get("stt_after_endpoint")
    parts = [f'<span class="k">streaming STT:</span> <span data-field="stt_passes" '
             f'data-value="{_data_value(stream.get("passes"))}">{fmt(stream.get("passes"))} passes</span>',
             f'tail {fmt(stream.get("tail_s"), 2)} s of {fmt(stream.get("utterance_s"), 2)} s transcribed after the end']
    if num(after) is not None:
        parts.append(f'<span class="k">stt_after_endpoint</span> <span data-field="stt_after_endpoint" '
                     f'data-value="{_data_value(after)}">{fmt(after)} s</span>')
    events = [e for e in stream.get("events") or [] if isinstance(e, dict)]
    start = num(_dict(turn.get("timeline")).get("speech_start"))
    items = []
    for e in events:
        at = num(e.get("at"))
        when = f"+{at - start:.2f} s " if at is not None and start is not None else ""
        items.append(f'<li data-kind="{esc(e.get("kind"))}">{esc(when)}<span class="k">{esc(e.get("kind"))}</span> '
                     f"{esc(e.get('text') or '')}</li>")
    listing = f'<ol class="transcripts">{"".join(items)}</ol>' if items else ""
    return f'<p class="stt-stream" data-turn="{i}">{" · ".join(parts)}</p>{listing}'


def _report_section(report: dict, idx: int) -> str:
    models = _dict(report.get("models"))
    model_rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in models.items())
    error = f'<p class="error" id="error-{idx}">error: {esc(report.get("error"))}</p>' if report.get("error") else ""
    config = esc(json.dumps(report.get("config") or {}, indent=2, sort_keys=True, default=str))
    llm = llm_summary(report)
    cards = (
        f'<div class="cards"><div class="card"><div class="v" data-field="duration_s" '
        f'data-value="{_data_value(report.get("duration_s"))}">{fmt(report.get("duration_s"), 1)} s</div>'
        f'<div class="k">duration</div></div>'
        f'<div class="card"><div class="v" data-field="turns" data-value="{len(turns(report))}">{len(turns(report))}</div>'
        f'<div class="k">turns</div></div>'
        f'<div class="card"><div class="v" data-field="v2v_p50" data-value="'
        f'{_data_value(_dict(metric_summary(report)["voice_to_voice"]).get("p50"))}">'
        f'{fmt(_dict(metric_summary(report)["voice_to_voice"]).get("p50"))} s</div><div class="k">voice to voice p50</div></div>'
        f'<div class="card"><div class="v">{fmt(llm.get("tokens_per_pass"), 2)}</div><div class="k">tokens per pass</div></div>'
        f"</div>"
    )
    return (
        f'<section class="report" id="report-{idx}" data-call-id="{esc(report.get("call_id"))}">'
        f'<h1>Call <span class="call-id">{esc(report.get("call_id"))}</span></h1>'
        f'<p class="muted">{esc(report.get("started_at"))} → {esc(report.get("ended_at"))} · end: '
        f'<span class="end-reason">{esc(report.get("end_reason"))}</span></p>{error}{cards}'
        f"<h2>Latency summary</h2>{_summary_table(report)}"
        f"<h2>LLM (speculative decoding)</h2>{_llm_cards(report)}"
        f"{_tools_section(report) if uses_tools(report) else ''}"
        f"{_preemptive_section(report) if uses_preemption(report) else ''}"
        f"{_taken_back_section(report)}"
        f"<h2>Voice to voice over the call</h2>{v2v_plot_svg(report)}"
        f"<h2>Per turn</h2>{_turn_table(report)}"
        f'<h2>Turns: transcript and waterfall</h2>{"".join(_turn_section(report, i, t) for i, t in enumerate(turns(report)))}'
        f'<h2>Models and configuration</h2><table class="models">{model_rows}</table>'
        f"<details><summary>configuration</summary><pre>{config}</pre></details></section>"
    )


def _comparison_table(reports: list[dict]) -> str:
    head = "".join(f'<th data-report="{i}">{esc(r.get("call_id") or f"#{i}")}</th>' for i, r in enumerate(reports))
    summaries = [metric_summary(r) for r in reports]
    rows = []
    for metric in METRICS:
        for stat in ("p50", "p90"):
            cells = "".join(
                _metric_cell(f'data-report="{i}" data-metric="{metric}" data-stat="{stat}"', _dict(s[metric]).get(stat))
                for i, s in enumerate(summaries)
            )
            rows.append(f"<tr><th scope=\"row\">{esc(METRIC_LABELS[metric])} {stat}</th>{cells}</tr>")
    for key in ("tokens_per_pass", "acceptance_rate", "tokens_per_s"):
        cells = "".join(_metric_cell(f'data-report="{i}" data-llm="{key}"', llm_summary(r).get(key), 2)
                        for i, r in enumerate(reports))
        rows.append(f"<tr><th scope=\"row\">{esc(key.replace('_', ' '))}</th>{cells}</tr>")
    if any(uses_tools(r) for r in reports):
        for key, label in (("with_tools", "with tools"), ("without_tools", "without tools")):
            for stat in ("p50", "p90"):
                cells = "".join(
                    _metric_cell(f'data-report="{i}" data-tools-v2v="{key}" data-stat="{stat}"',
                                 _dict(_dict(tools_summary(r).get("voice_to_voice")).get(key)).get(stat))
                    for i, r in enumerate(reports))
                rows.append(f'<tr><th scope="row">voice to voice {label} {stat}</th>{cells}</tr>')
    return (f'<h2>Comparison</h2><table id="comparison"><thead><tr><th>seconds</th>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def _recording_section(url: str) -> str:
    return (f'<section id="recording-section"><h2>Recording</h2><p class="muted">caller left, agent right; '
            f'click a turn to hear it</p><audio id="recording" controls preload="metadata" src="{esc(url)}">'
            f'</audio></section>')


def render_html(reports: dict | Iterable[dict], recording: str | None = None) -> str:
    """One self-contained page: one report, or several with a comparison table first.

    `recording`: the URL of the call's stereo WAV (one report only). The page then plays it,
    and a click on a turn seeks to that turn: the page's one script, allowed by its hash in
    the Content-Security-Policy, so no other script (nor an event handler attribute) can run."""
    reports = [reports] if isinstance(reports, dict) else list(reports)
    if recording is not None and len(reports) != 1:
        raise ValueError("a recording goes with one report")
    if len(reports) == 1:
        title = f"specvoice call {reports[0].get('call_id') or ''}"
    else:
        title = f"specvoice: {len(reports)} calls compared"
    body = _comparison_table(reports) if len(reports) > 1 else ""
    body += "".join(_report_section(r, i) for i, r in enumerate(reports))
    script_src = media_src = ""
    if recording is not None:
        body = _recording_section(recording) + body + f"<script>{SEEK_SCRIPT}</script>"
        script_src = f" script-src 'sha256-{SEEK_SCRIPT_SHA256}';"
        media_src = " media-src 'self' file:;"
    css = CSS
    if any(uses_preemption(r) or has_eot_delay(r) or any(t.get("end_of_turn") for t in turns(r)) for r in reports):
        css += TURN_TAKING_CSS
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        # No scripts, no fetches: even a hostile transcript that escaped escaping could not run.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        f"img-src data:;{script_src}{media_src}\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{css}</style></head><body>{body}</body></html>\n"
    )


def write_html(reports: dict | Iterable[dict], path: str | Path, recording: str | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(reports, recording), encoding="utf-8")
    return path
