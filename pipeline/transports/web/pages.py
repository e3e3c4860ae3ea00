"""The people's pages: the call page, the recent calls, a call's report page and recording.

Reports are the JSON files every call writes under report.dir; a browser call also writes
its stereo recording next to its report (same name, .wav). A call is named in URLs by its
report's file name without .json (already made of safe characters by pipeline.report).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response

if TYPE_CHECKING:
    from pipeline.transports.web.server import Bridge

__all__ = ["call_page", "calls_page", "recent_calls", "report_page", "recording"]

STATIC = Path(__file__).resolve().parent / "static"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,200}$")
# The pages load nothing from elsewhere; the call page's script and worklets are ours.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; "
            "media-src 'self'; img-src 'self' data:; worker-src 'self'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")
NO_STORE = {"Cache-Control": "no-store"}


def _headers(csp: str = PAGE_CSP) -> dict[str, str]:
    return {**NO_STORE, "Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer"}


async def call_page(request: Request) -> Response:
    return HTMLResponse((STATIC / "call.html").read_text(encoding="utf-8"), headers=_headers())


def _report_files(report_dir: Path) -> list[Path]:
    try:
        files = [p for p in report_dir.glob("*.json") if p.is_file() and not p.name.startswith(".")]
    except OSError:
        return []
    return sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)


def _load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _p50(summary: dict, metric: str) -> float | None:
    value = ((summary.get("metrics") or {}).get(metric) or {}).get("p50")
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def recent_calls(report_dir: Path, limit: int) -> list[dict[str, Any]]:
    """The last `limit` calls with their summary figures, newest first."""
    out = []
    for path in _report_files(report_dir)[:limit]:
        data = _load(path)
        if data is None:
            continue
        summary = data.get("summary") or {}
        llm = summary.get("llm") or {}
        out.append({
            "name": path.stem, "call_id": data.get("call_id"), "started_at": data.get("started_at"),
            "duration_s": data.get("duration_s"), "end_reason": data.get("end_reason"),
            "turns": len(data.get("turns") or []), "voice_to_voice_p50": _p50(summary, "voice_to_voice"),
            "first_sentence_p50": _p50(summary, "first_sentence_latency"),
            "tokens_per_pass": llm.get("tokens_per_pass"), "recording": path.with_suffix(".wav").is_file(),
        })
    return out


def _fmt(value: Any, digits: int = 2, unit: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "–"
    return f"{value:.{digits}f}{unit}"


async def calls_page(request: Request) -> Response:
    bridge: Bridge = request.app.state.bridge
    site = bridge.site
    calls = recent_calls(site.report_dir, site.recent_calls) if site is not None else []
    if "application/json" in request.headers.get("accept", ""):
        return JSONResponse({"calls": calls}, headers=NO_STORE)
    esc = html.escape
    rows = "".join(
        f'<tr data-call="{esc(c["name"])}"><td><a href="/calls/{esc(c["name"])}">{esc(str(c["call_id"]))}</a></td>'
        f'<td>{esc(str(c["started_at"] or ""))}</td><td class="n">{_fmt(c["duration_s"], 1, " s")}</td>'
        f'<td class="n">{c["turns"]}</td><td class="n">{_fmt(c["voice_to_voice_p50"], 3, " s")}</td>'
        f'<td class="n">{_fmt(c["first_sentence_p50"], 3, " s")}</td><td class="n">{_fmt(c["tokens_per_pass"])}</td>'
        f'<td>{esc(str(c["end_reason"] or ""))}</td><td>{"▶" if c["recording"] else ""}</td></tr>'
        for c in calls)
    body = (rows or '<tr><td colspan="9">No calls yet.</td></tr>')
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>specvoice: recent calls</title>'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,"><link rel="stylesheet" href="/static/call.css"></head><body><main>'
        '<h1>Recent calls</h1><p><a href="/">Place a call</a> · <a href="/metrics">metrics</a></p>'
        '<table id="calls"><thead><tr><th>call</th><th>started</th><th>duration</th><th>turns</th>'
        '<th>voice to voice p50</th><th>first sentence p50</th><th>tokens/pass</th><th>end</th>'
        f'<th>recording</th></tr></thead><tbody>{body}</tbody></table></main></body></html>'
    )
    return HTMLResponse(page, headers=_headers())


def _report_path(bridge: "Bridge", name: str) -> Path | None:
    site = bridge.site
    if site is None or not _NAME.match(name):
        return None
    folder = site.report_dir.resolve()
    path = (folder / f"{name}.json").resolve()
    return path if path.parent == folder and path.is_file() else None


async def report_page(request: Request) -> Response:
    bridge: Bridge = request.app.state.bridge
    name = request.path_params["name"]
    if name.endswith(".json"):
        path = _report_path(bridge, name[:-5])
        if path is None:
            return PlainTextResponse("no such call\n", 404)
        return FileResponse(path, media_type="application/json", headers=NO_STORE)
    path = _report_path(bridge, name)
    data = _load(path) if path is not None else None
    if data is None:
        return PlainTextResponse("no such call\n", 404)
    recording_url = f"/calls/{name}/recording.wav" if path.with_suffix(".wav").is_file() else None
    render = bridge.site.render_report if bridge.site is not None else None
    if render is None:
        return JSONResponse(data, headers=NO_STORE)
    # The report page sets its own Content-Security-Policy (no scripts but its one, by hash).
    return HTMLResponse(render(data, recording_url), headers={**NO_STORE, "X-Content-Type-Options": "nosniff"})


async def recording(request: Request) -> Response:
    bridge: Bridge = request.app.state.bridge
    path = _report_path(bridge, request.path_params["name"])
    wav = path.with_suffix(".wav") if path is not None else None
    if wav is None or not wav.is_file():
        return PlainTextResponse("no recording for this call\n", 404)
    return FileResponse(wav, media_type="audio/wav", headers=NO_STORE)
