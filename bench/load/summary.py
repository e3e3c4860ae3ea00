"""What a level of calls came to: per caller and per report, counted into one record per level
(in process: `level_summary`; over serve processes: `summarize_level`), and which levels held."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.load.callers import words


def pct(values: list[float], q: float) -> float | None:
    from pipeline.report import percentile

    return percentile(values, q) if values else None


def level_summary(callers: list, tasks: list, reports: dict[str, dict], wire_calls: list, *, names: list[str],
                  turns: int, peak_mb: float, refused: list, wall_s: float) -> dict[str, Any]:
    """One in-process level: each caller's side (`callers`, their `tasks`) against its call's
    report (`reports` by call id) and the bridge's calls (`wire_calls`); `names[i]` is the
    name caller i gave."""
    from pipeline.timeline import V2V_PARTS

    n = len(callers)
    completed = turns_answered = frames_out = frames_in = mixed = reports_missing = 0
    v2v_server: list[float] = []
    v2v_caller: list[float] = []
    # The spans voice_to_voice is the sum of, to see which stage grows with N.
    parts: dict[str, list[float]] = {part: [] for part in V2V_PARTS}
    name_heard = 0
    failures: list[str] = []
    for i, (caller, task) in enumerate(zip(callers, tasks)):
        result = caller.result
        frames_out += len(result.caller_track) // 160  # one media message per 20 ms
        frames_in += result.media_in
        answered = [t for t in result.turns if t.first_agent_audio_t is not None]
        turns_answered += len(answered)
        v2v_caller += [t.voice_to_voice for t in answered]
        data = reports.get(result.call_sid)
        if data is None:
            reports_missing += 1
            failures.append(f"caller {i}: no report")
            continue
        text_of = lambda key: " ".join(t.get(key) or "" for t in data["turns"])  # noqa: E731
        own = names[i].lower()
        heard = words(text_of("user_text")) | words(text_of("agent_text"))
        others = {m.lower() for m in names if m.lower() != own}
        if heard & others or result.bad_messages:
            mixed += 1
            failures.append(f"caller {i} ({names[i]}): foreign names {sorted(heard & others)} "
                            f"or bad messages {result.bad_messages[:2]}")
        if own in words(text_of("user_text")):
            name_heard += 1
        v2v_server += [t["metrics"]["voice_to_voice"] for t in data["turns"]
                       if t["metrics"].get("voice_to_voice") is not None]
        for t in data["turns"]:
            for part in V2V_PARTS:
                if t["metrics"].get(part) is not None:
                    parts[part].append(t["metrics"][part])
        ok = (task.done() and not task.cancelled() and task.exception() is None
              and len(answered) == len(caller.lines) and len(data["turns"]) == len(caller.lines)
              and data["end_reason"] == "caller_hangup" and not data.get("error"))
        if ok:
            completed += 1
        else:
            exc = task.exception() if task.done() and not task.cancelled() else None
            failures.append(f"caller {i}: {len(answered)}/{len(caller.lines)} answered, report "
                            f"{len(data['turns'])} turns, end {data['end_reason']}, error {data.get('error')}, "
                            f"task {'timeout' if not task.done() or task.cancelled() else exc!r}")
    return {
        "calls": n,
        "completed": completed,
        "turns": n * turns,
        "turns_answered": turns_answered,
        "frames_sent_by_callers": frames_out,
        "frames_received_by_callers": frames_in,
        "frames_sent_by_bridge": sum(c.stats.frames_sent for c in wire_calls),
        "late_frames": sum(c.output.stats.late_frames for c in wire_calls),
        "max_gap_ms": round(max([c.output.stats.max_gap_s for c in wire_calls] or [0.0]) * 1000, 1),
        "inbound_dropped": sum(c.stats.inbound_dropped for c in wire_calls),
        "v2v_p50_s": pct(v2v_server, 0.5),
        "v2v_p95_s": pct(v2v_server, 0.95),
        "v2v_caller_p50_s": pct(v2v_caller, 0.5),
        "v2v_caller_p95_s": pct(v2v_caller, 0.95),
        "v2v_parts_p50_s": {part: pct(values, 0.5) for part, values in parts.items()},
        "v2v_parts_p95_s": {part: pct(values, 0.95) for part, values in parts.items()},
        "peak_rss_mb": round(peak_mb, 1),
        "mixed": mixed,
        "own_name_in_transcript": name_heard,
        "reports_missing": reports_missing,
        "extra_refused": refused,
        "wall_s": round(wall_s, 1),
        "failures": failures,
    }


def judge(levels: list[dict]) -> int | None:
    base = next((lv for lv in levels if lv["calls"] == 1), None)
    limit = 2 * base["v2v_p95_s"] if base and base["v2v_p95_s"] else None
    best = None
    for lv in levels:
        lv["held"] = bool(lv["completed"] == lv["calls"] and lv["mixed"] == 0 and not lv["reports_missing"]
                          and all(x == 503 for x in lv["extra_refused"])
                          and limit is not None and lv["v2v_p95_s"] is not None and lv["v2v_p95_s"] <= limit)
        if lv["held"]:
            best = max(best or 0, lv["calls"])
    return best


def report_index(dirs: list[Path]) -> dict[str, list[tuple[int, dict]]]:
    """call id -> [(folder index, report)] over every report in the folders (recursively)."""
    from pipeline.report import load_report

    found: dict[str, list[tuple[int, dict]]] = {}
    for i, folder in enumerate(dirs):
        for path in sorted(folder.rglob("*.json")) if folder.is_dir() else []:
            try:
                data = load_report(path)
            except Exception:  # noqa: BLE001 - not a call report (or being written): skipped
                continue
            found.setdefault(str(data["call_id"]), []).append((i, data))
    return found


def summarize_level(records: list[dict], reports: dict[str, list[tuple[int, dict]]], n_bridges: int,
                    by_bridge: bool, stop: dict | None) -> dict[str, Any]:
    """Per level: outcomes, reports per call id (exactly one each, in the folder of the bridge
    it connected to when folders are per bridge), mixing, voice-to-voice; per bridge counts."""
    names = [r["name"] for r in records if "name" in r]
    bridges = [{"placed": 0, "completed": 0, "cut": 0, "refused": 0, "connect_failed": 0} for _ in range(n_bridges)]
    lv: dict[str, Any] = {"calls": len(records), "completed": 0, "cut": 0, "refused": 0, "failed": 0,
                          "reports_checked": reports is not None, "reports_missing": 0, "reports_duplicated": 0,
                          "reports_wrong_bridge": 0, "reports_without_end": 0, "mixed": 0,
                          "cut_end_reasons": [], "failures": []}
    v2v_caller: list[float] = []
    v2v_server: list[float] = []
    for r in records:
        for a in r["attempts"]:
            if a["result"] == "connected":
                bridges[a["bridge"]]["placed"] += 1
            elif isinstance(a["result"], int):
                bridges[a["bridge"]]["refused"] += 1
            else:
                bridges[a["bridge"]]["connect_failed"] += 1
        if r["bridge"] is None:
            lv["refused" if r["outcome"] == "refused" else "failed"] += 1
            if r["outcome"] != "refused":
                lv["failures"].append(f"caller {r['caller']}: {r['outcome']}")
            continue
        b = r["bridge"]
        v2v_caller += r["v2v_caller"]
        data = None
        if reports is not None:
            got = reports.get(r["call_sid"], [])
            r["reports"] = len(got)
            if not got:
                lv["reports_missing"] += 1
                lv["failures"].append(f"caller {r['caller']} on bridge {b}: no report ({r['outcome']})")
            elif len(got) > 1:
                lv["reports_duplicated"] += 1
            if by_bridge and any(folder != b for folder, _ in got):
                lv["reports_wrong_bridge"] += 1
            if got:
                data = got[0][1]
                r["end_reason"] = data["end_reason"]
                if data["end_reason"] in (None, "", "unfinished"):
                    lv["reports_without_end"] += 1
                r["report_turns"] = len(data["turns"])
                v2v_server += [t["metrics"]["voice_to_voice"] for t in data["turns"]
                               if t["metrics"].get("voice_to_voice") is not None]
                text = " ".join((t.get("user_text") or "") + " " + (t.get("agent_text") or "") for t in data["turns"])
                others = {m.lower() for m in names if m != r["name"]}
                if words(text) & others or r["bad_messages"]:
                    lv["mixed"] += 1
                    lv["failures"].append(f"caller {r['caller']}: foreign names {sorted(words(text) & others)}")
        if r["outcome"] == "cut":
            lv["cut"] += 1
            bridges[b]["cut"] += 1
            lv["cut_end_reasons"].append(r.get("end_reason"))
        elif (r["outcome"] == "done" and r["answered"] == r["lines"]
              and (data is None or (data["end_reason"] == "caller_hangup" and len(data["turns"]) == r["lines"]))):
            lv["completed"] += 1
            bridges[b]["completed"] += 1
        else:
            lv["failed"] += 1
            lv["failures"].append(f"caller {r['caller']} on bridge {b}: {r['outcome']}, {r.get('answered')}/"
                                  f"{r.get('lines')} answered, end {r.get('end_reason')}, {r.get('error', '')}")
    lv["connected"] = sum(1 for r in records if r["bridge"] is not None)
    # Lost: connected, and no report with an end_reason to show for it.
    lv["lost"] = lv["reports_missing"] + lv["reports_without_end"] if reports is not None else None
    lv["v2v_p50_s"] = pct(v2v_server, 0.5)
    lv["v2v_p95_s"] = pct(v2v_server, 0.95)
    lv["v2v_caller_p50_s"] = pct(v2v_caller, 0.5)
    lv["v2v_caller_p95_s"] = pct(v2v_caller, 0.95)
    lv["bridges"] = bridges
    if stop is not None:
        # Calls dialled after the stop: where they went, and the stopped bridge's failed connects.
        after = [a for r in records for a in r["attempts"] if a["t"] >= stop["t"]]
        lv["after_stop"] = {"placed_on": sorted({a["bridge"] for a in after if a["result"] == "connected"}),
                            "attempts_on_stopped": sum(1 for a in after if a["bridge"] == stop["bridge"]),
                            "placed_on_stopped": sum(1 for a in after if a["bridge"] == stop["bridge"]
                                                     and a["result"] == "connected")}
    lv["callers"] = records
    return lv

