"""The HTML call report: content, escaping (property test) and real headless Chromium.

Chromium is driven through the DevTools protocol over a WebSocket (no selenium): it
loads the page from a file, we read console errors, the DOM and a screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import struct
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.chromium import CDP, CHROMIUM, chromium_blocking  # noqa: F401 (CDP: for test_report_recording)
from bench.chromium import open_page as open_url
from demo import report_html
from demo.cli import main as cli_main

XSS_SCRIPT = "<script>window.__pwned=1;document.title='pwned'</script>"
XSS_IMG = "<img src=x onerror=\"window.__pwned=2;document.title='pwned'\">"


def make_turn(i: int, base: float, user: str, agent: str, *, heard: str | None = None, interrupted=False) -> dict:
    tl = {
        "speech_start": base, "last_voiced": base + 1.2 + 0.1 * i, "end_of_speech": base + 1.7 + 0.1 * i,
        "transcript": base + 1.95 + 0.1 * i, "llm_request": base + 1.96 + 0.1 * i,
        "first_token": base + 2.2 + 0.12 * i, "first_sentence": base + 2.5 + 0.12 * i,
        "tts_first_audio": base + 2.68 + 0.12 * i, "first_audio_out": base + 2.7 + 0.12 * i,
        "llm_done": base + 3.3 + 0.1 * i, "playback_done": base + 5.0,
    }
    if interrupted:
        tl["barge_in"] = base + 3.9
        del tl["playback_done"]
    m = {
        "endpoint_delay": tl["end_of_speech"] - tl["last_voiced"],
        "stt_latency": tl["transcript"] - tl["end_of_speech"],
        "ttft": tl["first_token"] - tl["llm_request"],
        "first_sentence_latency": tl["first_sentence"] - tl["llm_request"],
        "tts_first_audio": tl["tts_first_audio"] - tl["first_sentence"],
        "voice_to_voice": tl["first_audio_out"] - tl["last_voiced"],
    }
    return {
        "index": i, "user_text": user, "agent_text": agent,
        "agent_text_heard": agent if heard is None else heard, "interrupted": interrupted,
        "timeline": tl, "metrics": m,
        "llm": {"new_tokens": 30 + i, "passes": 12, "tokens_per_pass": (30 + i) / 12, "acceptance_rate": 0.61 + 0.01 * i,
                "tokens_per_s": 14.5},
    }


def make_report(call_id: str = "call-0001", user_texts: list[str] | None = None) -> dict:
    users = user_texts or ["What are your hours?", "How much is a cleaning?", "Book me Tuesday.", "Thanks, bye!"]
    agents = ["We are open Monday to Friday 8 to 6.", "A cleaning costs $89.",
              "Tuesday at 10:30 works. Can I have your name?", "Goodbye!"]
    turns = []
    for i, user in enumerate(users):
        interrupted = i == 2
        turns.append(make_turn(i, 6.0 * i, user, agents[i % len(agents)],
                               heard="Tuesday at 10:30 works." if interrupted else None, interrupted=interrupted))
    metrics = {}
    for name in report_html.METRICS:
        values = [t["metrics"][name] for t in turns]
        metrics[name] = {"p50": report_html.percentile(values, 0.5), "p90": report_html.percentile(values, 0.9),
                         "max": max(values), "n": len(values)}
    return {
        "schema": "specvoice.call_report/1", "call_id": call_id, "started_at": "2026-01-01T10:00:00Z",
        "ended_at": "2026-01-01T10:00:25Z", "duration_s": 25.25, "end_reason": "caller_hangup", "error": None,
        "config": {"llm": {"gamma": "auto"}}, "models": {"llm_target": "qwen2.5-coder-1.5b-instruct",
                                                        "llm_draft": "qwen2.5-coder-0.5b-instruct", "drafter": "hybrid",
                                                        "stt": "whisper-base", "tts": "piper-joe-medium"},
        "turns": turns,
        "summary": {"turns": len(turns), "metrics": metrics,
                    "llm": {"tokens": 126, "passes": 48, "tokens_per_pass": 2.625, "acceptance_rate": 0.625,
                            "tokens_per_s": 14.5}},
    }


# ---------------------------------------------------------------- pure rendering

def test_page_is_self_contained_and_carries_the_numbers():
    report = make_report()
    page = report_html.render_html(report)
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:|//)", page)  # nothing fetched from anywhere
    assert "<script" not in page.lower()
    v2v = report["summary"]["metrics"]["voice_to_voice"]
    assert f'<td data-metric="voice_to_voice" data-stat="p50" data-value="{v2v["p50"]!r}">{v2v["p50"]:.3f}</td>' in page
    assert page.count('class="waterfall"') == 4
    assert 'id="v2v-plot"' in page
    assert 'class="unheard"' in page  # the interrupted turn shows what was not heard


def test_summary_fallback_matches_pipeline_report():
    pipeline_report = pytest.importorskip("pipeline.report")
    report = make_report()
    ours = report_html.metric_summary({"turns": report["turns"]})  # computed: no summary in the file
    theirs = pipeline_report.summarize(report["turns"])["metrics"]
    for metric in report_html.METRICS:
        for stat in ("p50", "p90", "max", "n"):
            assert ours[metric][stat] == pytest.approx(theirs[metric][stat], abs=1e-6)
    for values in ([1.0], [3.0, 1.0], [5.0, 1.0, 4.0, 2.0, 3.0]):
        for q in (0.5, 0.9):
            assert report_html.percentile(values, q) == pipeline_report.percentile(values, q)


def test_text_summary_and_comparison():
    a, b = make_report("call-a"), make_report("call-b")
    b["summary"]["llm"]["tokens_per_pass"] = 1.0
    text = report_html.text_summary(a)
    assert "call call-a" in text and "voice to voice" in text and "2.62 tokens/pass" in text
    assert len(text.splitlines()) <= 24  # one screen
    cmp = report_html.text_comparison([a, b])
    assert "call-a" in cmp and "call-b" in cmp and "1.00" in cmp
    evil = make_report(user_texts=["\x1b[2J\x1b]0;owned\x07hello"])
    assert "\x1b" not in report_html.text_summary(evil)  # no terminal escapes from a transcript


def test_report_without_summary_or_with_odd_values_still_renders():
    report = make_report()
    del report["summary"]
    report["turns"][1]["metrics"]["ttft"] = None
    report["turns"][2]["metrics"]["voice_to_voice"] = "fast"
    report["turns"][3]["timeline"] = {"speech_start": float("nan")}
    report["turns"][0]["llm"] = None
    page = report_html.render_html(report)
    summary = report_html.metric_summary(report)
    assert summary["ttft"]["n"] == 3 and summary["voice_to_voice"]["n"] == 3
    assert "no timeline for this turn" in page
    assert report_html.render_html({"turns": []})


def test_cli_writes_html_next_to_the_json(tmp_path, capsys):
    a = tmp_path / "call-a.json"
    b = tmp_path / "call-b.json"
    a.write_text(json.dumps(make_report("call-a")))
    b.write_text(json.dumps(make_report("call-b")))
    assert cli_main(["report", str(a)]) == 0
    assert (tmp_path / "call-a.html").is_file()
    assert "call call-a" in capsys.readouterr().out
    out = tmp_path / "cmp" / "both.html"
    assert cli_main(["report", str(a), str(b), "--html", str(out)]) == 0
    page = out.read_text()
    assert 'id="comparison"' in page and 'id="report-1"' in page
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert cli_main(["report", str(bad)]) == 2


ALLOWED_TAGS = {"html", "head", "meta", "title", "style", "body", "section", "h1", "h2", "h3", "p", "span", "div",
                "table", "thead", "tbody", "tr", "th", "td", "svg", "line", "text", "rect", "title", "polyline",
                "circle", "details", "summary", "pre", "br", "strong"}


class TagCollector(HTMLParser):
    """Tags and attribute names as a browser's tokenizer sees them."""

    def __init__(self):
        super().__init__()
        self.tags, self.attrs = set(), set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attrs.update(name for name, _ in attrs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(), min_size=6, max_size=6),
       st.sampled_from(["<script>", "<SCRIPT src=x>", "</title><script>", "\"><script>", "<img src=x onerror=a()>",
                        "<svg onload=a()>", "]]><script>", "<!--<script>", "&lt;script&gt;", "<scr<script>ipt>"]))
def test_arbitrary_strings_never_produce_markup(strings, attack):
    strings = [s + attack if i % 2 else attack + s for i, s in enumerate(strings)]
    report = make_report(call_id=strings[0], user_texts=[strings[1], strings[2]])
    report["turns"][0]["agent_text"] = strings[3]
    report["turns"][1].update(agent_text=strings[4], agent_text_heard=strings[5], interrupted=True)
    report["end_reason"] = strings[5]
    report["error"] = strings[4]
    report["models"] = {strings[3]: strings[2]}
    report["config"] = {strings[1]: strings[0]}
    report["turns"][0]["index"] = strings[2]
    report["started_at"] = strings[0]
    # Tool calls carry the model's text and the caller's words (a name stored as heard).
    report["turns"][1]["tool_calls"] = [
        {"name": strings[0], "arguments": strings[1], "ok": False, "result": None, "error": strings[2],
         "elapsed_ms": 1.0, "round": strings[3], "start": 7.0, "end": 7.1},
        {"name": strings[3], "arguments": {strings[4]: strings[5]}, "ok": True, "result": {strings[1]: [strings[2]]},
         "error": None, "elapsed_ms": 2.0, "action": strings[4], "reason": strings[5], "round": 1,
         "start": 7.2, "end": 7.3},
    ]
    report["turns"][1]["action"] = {"action": strings[0], "reason": strings[1]}
    report["turns"][1]["tool_fallback"] = True
    # End of turn and preemption (issue 13): reasons and why's are strings from the report.
    report["turns"][0]["end_of_turn"] = {"reason": strings[2], "probability": 0.5, "pauses": strings[3]}
    report["turns"][0]["metrics"]["eot_delay"] = 0.3
    report["turns"][0]["preemptive_hit"] = False
    report["turns"][0]["preemptive"] = {"starts": 1, "events": [
        {"event": strings[4], "t": 1.0}, {"event": "start", "t": 1.1, "pause": strings[5], "audio_s": 1.0},
        {"event": "discarded", "t": 1.3, "why": strings[0]}]}
    report["summary"]["preemptive"] = {"turns": 1, "starts": 1, "hits": 0, "hit_rate": 0.0,
                                       "discarded": {strings[1]: 1}}
    for page in (report_html.render_html(report), report_html.render_html([report, report])):
        assert "<script" not in page.lower()
        tags = {m.lower() for m in re.findall(r"<\s*/?\s*([A-Za-z][A-Za-z0-9-]*)", page)}
        assert tags <= ALLOWED_TAGS, tags - ALLOWED_TAGS
        parsed = TagCollector()
        parsed.feed(page)
        assert parsed.tags <= ALLOWED_TAGS, parsed.tags - ALLOWED_TAGS
        assert not [a for a in parsed.attrs if a.startswith("on")]  # no event handler attributes


# ---------------------------------------------------------------- headless Chromium


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    with chromium_blocking(tmp_path_factory.mktemp("chromium-profile")) as port:
        yield port


@contextlib.asynccontextmanager
async def open_page(port: int, path: Path):
    """The report file at `path` in a new tab, with Log events too."""
    async with open_url(port, path.resolve().as_uri(), load_timeout_s=20) as cdp:
        # Let anything that would run (it must not) run: inline scripts and onload/onerror
        # handlers have run by the load event; a task queued after it runs after anything
        # they queued, and its answer comes after any event they reported.
        await cdp.call("Runtime.evaluate", expression="new Promise(r => setTimeout(r, 0))", awaitPromise=True)
        yield cdp


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) into rows."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            assert depth == 8 and colour in (2, 6) and interlace == 0
            bpp = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], (prev[x - bpp] if x >= bpp else 0)
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i:i + bpp]) for r in rows[::7] for i in range(0, stride, bpp * 7)]


@pytest.mark.timeout(120)
async def test_report_in_headless_chromium(chromium, tmp_path):
    report = make_report()
    path = report_html.write_html(report, tmp_path / "call.html")
    async with open_page(chromium, path) as cdp:
        assert cdp.errors() == []
        dom = await cdp.evaluate("""JSON.stringify({
            cells: [...document.querySelectorAll('td[data-metric][data-stat]')].map(e =>
                [e.dataset.metric, e.dataset.stat, e.dataset.value, e.textContent]),
            llm: Object.fromEntries([...document.querySelectorAll('.llm [data-llm]')].map(e =>
                [e.dataset.llm, [e.dataset.value, e.textContent]])),
            turnV2V: [...document.querySelectorAll('td[data-turn][data-metric="voice_to_voice"]')].map(e => e.dataset.value),
            bars: [...document.querySelectorAll('svg.waterfall rect')].map(r => r.getBoundingClientRect().width),
            points: [...document.querySelectorAll('#v2v-plot circle')].map(c => c.getBoundingClientRect().width),
            user: [...document.querySelectorAll('[data-role=user]')].map(e => e.textContent),
        })""")
        dom = json.loads(dom)
        summary = report["summary"]["metrics"]
        assert len(dom["cells"]) == len(report_html.METRICS) * 4
        for metric, stat, value, text in dom["cells"]:
            expected = summary[metric][stat]
            assert float(value) == expected
            assert text == (str(expected) if stat == "n" else f"{expected:.3f}")
        for key, (value, text) in dom["llm"].items():
            assert float(value) == report["summary"]["llm"][key]
        assert [float(v) for v in dom["turnV2V"]] == [t["metrics"]["voice_to_voice"] for t in report["turns"]]
        assert len(dom["bars"]) >= 4 * 7 and all(w > 0 for w in dom["bars"])
        assert len(dom["points"]) == 4 and all(w > 0 for w in dom["points"])
        assert dom["user"] == [t["user_text"] for t in report["turns"]]

        shot = await cdp.call("Page.captureScreenshot", format="png")
        width, height, pixels = png_pixels(base64.b64decode(shot["data"]))
        assert width > 500 and height > 500
        assert len(set(pixels)) > 20  # text, bars and lines: far from a blank page
        assert cdp.errors() == []


@pytest.mark.timeout(120)
async def test_hostile_transcript_does_not_execute_in_chromium(chromium, tmp_path):
    report = make_report(call_id=XSS_IMG, user_texts=[XSS_SCRIPT, XSS_IMG, "</div></section>" + XSS_SCRIPT])
    report["turns"][0]["agent_text"] = XSS_IMG
    report["turns"][1].update(agent_text="ok " + XSS_SCRIPT, agent_text_heard="ok ", interrupted=True)
    report["models"]["llm_target"] = "\"><svg onload=\"window.__pwned=3\">"
    path = report_html.write_html([report, make_report("second")], tmp_path / "evil.html")
    async with open_page(chromium, path) as cdp:
        state = json.loads(await cdp.evaluate("""JSON.stringify({
            pwned: window.__pwned === undefined ? null : window.__pwned,
            title: document.title,
            scripts: document.scripts.length,
            imgs: document.images.length,
            users: [...document.querySelectorAll('#report-0 [data-role=user]')].map(e => e.textContent),
            agent0: document.querySelector('#report-0 [data-role=agent]').textContent,
            reports: document.querySelectorAll('section.report').length,
        })"""))
        assert state["pwned"] is None
        assert "pwned" not in state["title"]
        assert state["scripts"] == 0 and state["imgs"] == 0
        # The caller's words are shown as text, exactly.
        assert state["users"] == [XSS_SCRIPT, XSS_IMG, "</div></section>" + XSS_SCRIPT]
        assert state["agent0"] == XSS_IMG
        assert state["reports"] == 2  # the hostile text did not break the page structure
        assert cdp.errors() == []


def test_renders_a_report_written_by_pipeline_report(tmp_path):
    """The real writer's output, not just our own fixture, renders with its numbers."""
    report_mod = pytest.importorskip("pipeline.report")
    timeline_mod = pytest.importorskip("pipeline.timeline")
    from pipeline.config import Config

    call = report_mod.CallReport.from_config("call-real", Config())
    t0 = call.t0
    for i in range(3):
        tl = timeline_mod.TurnTimeline()
        base = t0 + 5.0 * i
        for k, dt in (("speech_start", 0.0), ("last_voiced", 1.0), ("end_of_speech", 1.5), ("transcript", 1.7),
                      ("llm_request", 1.71), ("first_token", 1.9 + 0.1 * i), ("first_sentence", 2.2 + 0.1 * i),
                      ("tts_first_audio", 2.4 + 0.1 * i), ("first_audio_out", 2.42 + 0.1 * i),
                      ("llm_done", 2.8 + 0.1 * i), ("playback_done", 4.0)):
            tl.mark(k, base + dt)
        call.add_turn(tl, user_text=f"question {i} <b>", agent_text=f"answer {i}",
                      llm={"new_tokens": 20, "passes": 8, "drafted": 24, "accepted": 12, "total_s": 1.0})
    call.finish("caller_hangup")
    path = report_mod.write_report(call, tmp_path)
    data = report_html.load_report(path)
    page = report_html.render_html(data)
    v2v = data["summary"]["metrics"]["voice_to_voice"]
    assert v2v["n"] == 3
    assert f'data-metric="voice_to_voice" data-stat="p50" data-value="{v2v["p50"]!r}"' in page
    assert page.count('class="waterfall"') == 3 and "question 0 &lt;b&gt;" in page
    assert "call call-real" in report_html.text_summary(data)


# ---------------------------------------------------------------- tool calls (issue 15)

HOSTILE_NAME = "<script>alert(1);window.__pwned=4</script>"
ODD_NAME = "Zoë O'Brien-Ng"
SLOTS = ["Tuesday 9:00 a.m.", "Tuesday 10:30 a.m."]


def tool_call_report(tmp_path: Path) -> dict:
    """A call written by pipeline.report with tool calls run by the real ToolBox on SQLite:
    turn 0 no tool; turn 1 books for a hostile name, fails to book the same slot for
    Zoë (already booked), then checks the slots; turn 2 calls an unknown tool, takes a
    message and transfers. Start/end are fixed offsets (the waterfall is then the same
    on any machine); elapsed_ms is the tool's own measurement, compared as recorded."""
    from pipeline.receptionist.bookings import open_store
    from pipeline.config import Config
    from pipeline.report import CallReport, load_report, write_report
    from pipeline.timeline import TurnTimeline
    from pipeline.receptionist.tools import ToolBox

    call = CallReport.from_config("call-tools", Config())
    t0 = call.t0

    def timeline(base: float, extra: float) -> TurnTimeline:
        tl = TurnTimeline()
        for k, dt in (("speech_start", 0.0), ("last_voiced", 1.0), ("end_of_speech", 1.5), ("transcript", 1.7),
                      ("llm_request", 1.71), ("first_token", 1.9), ("first_sentence", 2.2 + extra),
                      ("tts_first_audio", 2.4 + extra), ("first_audio_out", 2.42 + extra),
                      ("llm_done", 2.8 + extra), ("playback_done", 4.0 + extra)):
            tl.mark(k, t0 + base + dt)
        return tl

    def entry(outcome, round_: int, start: float, end: float) -> dict:
        # The shape pipeline/stages/tools_step.py records: the outcome, its round, monotonic start/end.
        return {**outcome.as_dict(), "round": round_, "start": t0 + start, "end": t0 + end}

    stats = {"new_tokens": 20, "passes": 8, "drafted": 24, "accepted": 12, "total_s": 1.0}
    with open_store(str(tmp_path / "bookings.sqlite"), open_slots=SLOTS) as store:
        box = ToolBox(store, "call-tools")
        call.add_turn(timeline(0.0, 0.0), "What are your hours?", "Eight to six.", llm=stats)
        turn1 = [entry(box.run("book_slot", {"slot": SLOTS[0], "name": HOSTILE_NAME}), 1, 7.0, 7.05),
                 entry(box.run("book_slot", json.dumps({"slot": SLOTS[0], "name": ODD_NAME})), 1, 7.05, 7.1),
                 entry(box.run("check_slots", {"day": "Tuesday"}), 2, 7.3, 7.32)]
        call.add_turn(timeline(5.0, 0.6), "Book Tuesday nine.", "Booked.", llm=stats, tool_calls=turn1)
        turn2 = [entry(box.run("fly_to_the_moon", "{}"), 1, 12.0, 12.0),
                 entry(box.run("take_message", {"name": ODD_NAME, "text": XSS_IMG}), 2, 12.1, 12.2),
                 entry(box.run("transfer_to_human", {"reason": "wants a person"}), 2, 12.2, 12.25)]
        last = call.add_turn(timeline(10.0, 0.9), "Get me a person.", "Transferring you.", llm=stats,
                             tool_calls=turn2)
    last["action"] = {"action": "transfer", "reason": "wants a person"}  # as pipeline/call.py adds it
    call.finish("transfer")
    return load_report(write_report(call, tmp_path))


def test_tool_call_report_fixture_is_what_it_claims(tmp_path):
    """The page tests below lean on these facts; if the tools changed, say so here."""
    report = tool_call_report(tmp_path)
    calls = [[(c["name"], c["ok"]) for c in t.get("tool_calls", [])] for t in report["turns"]]
    assert calls == [[], [("book_slot", True), ("book_slot", False), ("check_slots", True)],
                     [("fly_to_the_moon", False), ("take_message", True), ("transfer_to_human", True)]]
    assert report["turns"][1]["tool_calls"][0]["result"]["name"] == HOSTILE_NAME  # stored as heard
    assert "already booked" in report["turns"][1]["tool_calls"][1]["error"]
    assert report["turns"][1]["tool_calls"][2]["start"] == pytest.approx(5.0 + 7.3 - 5.0)
    tools = report["summary"]["tools"]
    assert (tools["calls"], tools["failed"], tools["turns"]) == (6, 2, 2)
    assert tools["voice_to_voice"]["with_tools"]["n"] == 2 and tools["voice_to_voice"]["without_tools"]["n"] == 1


def test_tool_calls_on_the_page(tmp_path):
    report = tool_call_report(tmp_path)
    page = report_html.render_html(report)
    assert "<script" not in page.lower()
    assert page.count('class="tool-bar ok"') == 4 and page.count('class="tool-bar failed"') == 2
    assert page.count('<tr class="tool-call ') == 6 and page.count('class="tool-calls"') == 2
    assert html_escaped(HOSTILE_NAME) in page and html_escaped(ODD_NAME) in page
    # summary.tools is the writer's; the page shows its numbers, not its own.
    for key in ("with_tools", "without_tools"):
        for stat in ("p50", "p90", "max", "n"):
            value = report["summary"]["tools"]["voice_to_voice"][key][stat]
            assert f'data-tools-v2v="{key}" data-stat="{stat}" data-value="{report_html._data_value(value)}"' in page
    assert 'data-tools="failed" data-value="2"' in page
    # A call the model wrote so badly it could not be parsed (tools_step records name None and
    # the raw text) still gets its row and its red bar.
    report["turns"][1]["tool_calls"].append({"name": None, "arguments": '<tool_call>{"name": book', "ok": False,
                                             "result": None, "error": "bad JSON", "elapsed_ms": 0.0, "round": 3,
                                             "start": 7.4, "end": 7.4})
    page = report_html.render_html(report)
    assert page.count('class="tool-bar failed"') == 3 and 'data-name="(unparsed call)"' in page
    assert "&lt;tool_call&gt;{&quot;name&quot;: book" in page
    # Compared with a call without tools: the comparison has the tool-turn rows for both.
    both = report_html.render_html([report, make_report("plain")])
    assert 'data-report="0" data-tools-v2v="with_tools" data-stat="p50"' in both
    assert 'data-report="1" data-tools-v2v="without_tools" data-stat="p50"' in both
    # A call without tools keeps its page free of tool sections.
    plain = report_html.render_html(make_report())
    assert "<h2>Tools</h2>" not in plain and "tool-bar" not in plain and "<th>tools</th>" not in plain


def html_escaped(text: str) -> str:
    import html

    return html.escape(text, quote=True)


def test_old_report_without_summary_tools_is_summarised_like_the_writer(tmp_path):
    from pipeline.report import summarize_tools

    report = tool_call_report(tmp_path)
    written = report["summary"]["tools"]
    del report["summary"]["tools"]
    assert report_html.tools_summary(report) == summarize_tools(report["turns"]) == written
    assert 'data-tools="calls" data-value="6"' in report_html.render_html(report)


def test_text_summary_has_a_tools_line(tmp_path, capsys):
    report = tool_call_report(tmp_path)
    text = report_html.text_summary(report)
    v2v = report["summary"]["tools"]["voice_to_voice"]
    line = next(line for line in text.splitlines() if line.startswith("tools:"))
    assert "6 calls, 2 failed, in 2 turns" in line
    assert f"with tools {v2v['with_tools']['p50']:.3f} / {v2v['with_tools']['p90']:.3f} s (n 2)" in line
    assert f"without {v2v['without_tools']['p50']:.3f} / {v2v['without_tools']['p90']:.3f} s (n 1)" in line
    assert "[tools: book_slot, book_slot FAILED, check_slots]" in text
    assert len(text.splitlines()) <= 24
    assert not any(line.startswith("tools:") for line in report_html.text_summary(make_report()).splitlines())
    # The command prints it.
    path = tmp_path / "call-tools.json"
    assert path.is_file()
    assert cli_main(["report", str(path), "--no-html"]) == 0
    assert "tools: 6 calls, 2 failed" in capsys.readouterr().out


@pytest.mark.timeout(120)
async def test_tool_calls_in_headless_chromium(chromium, tmp_path):
    report = tool_call_report(tmp_path)
    path = report_html.write_html(report, tmp_path / "tools.html")
    async with open_page(chromium, path) as cdp:
        dom = json.loads(await cdp.evaluate("""JSON.stringify({
            pwned: window.__pwned === undefined ? null : window.__pwned,
            scripts: document.scripts.length, imgs: document.images.length,
            bars: [...document.querySelectorAll('#turn-1 svg.waterfall rect.tool-bar, #turn-2 svg.waterfall rect.tool-bar')]
                .map(r => { const b = r.getBoundingClientRect(); return {
                    turn: r.closest('.turn').id, name: r.dataset.name, ok: r.dataset.ok, ms: r.dataset.elapsedMs,
                    start: +r.dataset.start, end: +r.dataset.end, left: b.left, width: b.width, height: b.height,
                    fill: getComputedStyle(r).fill, title: r.querySelector('title').textContent}; }),
            notes: [...document.querySelectorAll('svg.waterfall text.tool-note')].map(t => t.textContent),
            rows: [...document.querySelectorAll('table.tool-calls tr.tool-call')].map(tr => ({
                turn: tr.dataset.turn, ok: tr.dataset.ok,
                name: tr.querySelector('.tool-name').textContent,
                action: (tr.querySelector('.badge') || {}).textContent || null,
                args: tr.querySelector('.tool-args').textContent,
                outcome: (tr.querySelector('.tool-result') || tr.querySelector('.tool-error')).textContent,
                ms: tr.querySelector('[data-field=elapsed_ms]').textContent,
                bg: getComputedStyle(tr).backgroundColor})),
            v2v: Object.fromEntries([...document.querySelectorAll('td[data-tools-v2v]')].map(e =>
                [e.dataset.toolsV2v + '.' + e.dataset.stat, e.textContent])),
            badges: [...document.querySelectorAll('.turn h3 .badge')].map(e => e.textContent),
        })"""))
        assert cdp.errors() == []

    # Nothing the caller said ran: no script, no image, shown as text.
    assert dom["pwned"] is None and dom["scripts"] == 0 and dom["imgs"] == 0

    calls = [(t["index"], c) for t in report["turns"] for c in t.get("tool_calls", [])]
    assert [(b["turn"], b["name"], b["ok"]) for b in dom["bars"]] == [
        (f"turn-{i}", c["name"], "true" if c["ok"] else "false") for i, c in calls]
    for bar, (_, c) in zip(dom["bars"], calls):
        assert float(bar["ms"]) == c["elapsed_ms"]  # the recorded time, to the last digit
        assert (bar["start"], bar["end"]) == (c["start"], c["end"])
        assert bar["width"] > 0 and bar["height"] > 0  # drawn, even the zero-length refused call
        assert f"{c['elapsed_ms']:.2f} ms" in bar["title"]
        if c["ok"]:
            assert bar["fill"] == "rgb(11, 114, 133)"
        else:  # a failed call is red and its tooltip says why
            assert bar["fill"] == "rgb(214, 69, 69)"
            assert "FAILED: " + c["error"] in bar["title"]
    # On the time axis, in the order they ran: turn 1's bars left to right, widths by duration.
    b0, b1, b2 = dom["bars"][:3]
    assert b0["left"] < b1["left"] < b2["left"]
    assert b0["width"] == pytest.approx(b1["width"], rel=0.05) and b2["width"] < b0["width"]
    assert dom["notes"] == [f"{c['elapsed_ms']:.2f} ms" if c["ok"] else f"✗ failed · {c['elapsed_ms']:.2f} ms"
                            for _, c in calls]

    assert [(r["turn"], r["name"], r["ok"]) for r in dom["rows"]] == [
        (str(i), c["name"], "true" if c["ok"] else "false") for i, c in calls]
    for row, (_, c) in zip(dom["rows"], calls):
        assert row["args"] == json.dumps(c["arguments"], ensure_ascii=False)
        if c["ok"]:
            assert row["outcome"] == json.dumps(c["result"], ensure_ascii=False)
        else:
            assert row["outcome"] == "failed: " + c["error"]
            assert row["bg"] != dom["rows"][0]["bg"]  # failed rows stand out from the ok ones
        assert row["ms"] == f"{c['elapsed_ms']:.2f}"
        assert row["action"] == c["action"]  # transfer_to_human's row says the call is handed over
    # The strange names, exactly as heard, in the arguments and results.
    assert HOSTILE_NAME in dom["rows"][0]["args"] and HOSTILE_NAME in dom["rows"][0]["outcome"]
    assert ODD_NAME in dom["rows"][1]["args"] and ODD_NAME in dom["rows"][4]["args"]
    assert json.loads(dom["rows"][4]["args"])["text"] == XSS_IMG

    v2v = report["summary"]["tools"]["voice_to_voice"]
    for key in ("with_tools", "without_tools"):
        assert dom["v2v"][f"{key}.p50"] == f"{v2v[key]['p50']:.3f}"
        assert dom["v2v"][f"{key}.p90"] == f"{v2v[key]['p90']:.3f}"
        assert dom["v2v"][f"{key}.n"] == str(v2v[key]["n"])
    assert "3 tool calls, 1 failed" in dom["badges"] and "transfer: wants a person" in dom["badges"]


# ---------------------------------------------------------------- end of turn and preemption (issue 13)


def preemptive_report(tmp_path: Path) -> dict:
    """A call written by pipeline.report's own API (CallReport.add_turn with `preemption`,
    the end_of_turn entry pipeline/call.py adds): turn 0 ends on the model's word with no
    preemption; turn 1 starts on a pause, is discarded when the caller speaks on, starts
    again on the next pause and is kept; turn 2 starts once and is discarded because the
    final transcript differed. Event times are fixed offsets from the call start."""
    from pipeline.config import Config
    from pipeline.report import CallReport, load_report, write_report
    from pipeline.timeline import TurnTimeline

    call = CallReport.from_config("call-preempt", Config())
    t0 = call.t0

    def timeline(base: float, stt: float) -> TurnTimeline:
        tl = TurnTimeline()
        for k, dt in (("speech_start", 0.0), ("last_voiced", 2.0), ("end_of_speech", 2.3), ("transcript", 2.3 + stt),
                      ("llm_request", 2.31 + stt), ("first_token", 2.5 + stt), ("first_sentence", 2.7 + stt),
                      ("tts_first_audio", 2.85 + stt), ("first_audio_out", 2.86 + stt), ("llm_done", 3.2 + stt),
                      ("playback_done", 4.5 + stt)):
            tl.mark(k, t0 + base + dt)
        return tl

    def ev(event: str, at: float, **data) -> dict:
        return {"event": event, "t": t0 + at, **data}  # monotonic, as preempt.py logs them

    stats = {"new_tokens": 20, "passes": 8, "drafted": 24, "accepted": 12, "total_s": 1.0}
    ends = [{"reason": "model", "probability": 0.93, "pauses": 1},
            {"reason": "timeout", "probability": 0.08, "pauses": 2},
            {"reason": "model", "probability": 0.71, "pauses": 1}]
    entries = [call.add_turn(timeline(0.0, 0.4), "What are your hours?", "Eight to six.", llm=stats)]
    turn1 = [ev("start", 10.9, pause=1, audio_s=0.9), ev("llm_start", 11.1),
             ev("discarded", 11.2, why="caller_resumed"),
             ev("start", 11.95, pause=2, audio_s=1.7), ev("llm_start", 12.1),
             ev("kept", 12.3, groups_ready=5, finished=True)]
    entries.append(call.add_turn(timeline(10.0, 0.0), "Book a cleaning for next Tuesday.", "Tuesday it is.",
                                 llm=stats, preemption={"hit": True, "starts": 2, "events": turn1}))
    turn2 = [ev("start", 21.9, pause=1, audio_s=1.8), ev("llm_start", 22.05),
             ev("discarded", 22.4, why="transcript_changed")]
    entries.append(call.add_turn(timeline(20.0, 0.5), "Thanks, bye.", "Goodbye!", llm=stats,
                                 preemption={"hit": False, "starts": 1, "events": turn2}))
    for entry, end in zip(entries, ends):
        entry["end_of_turn"] = end  # as pipeline/call.py adds it
    call.finish("caller_hangup")
    return load_report(write_report(call, tmp_path))


def strip_turn_taking(report: dict) -> dict:
    """The same report as an older writer would have written it: no eot/preemptive fields."""
    old = json.loads(json.dumps(report))
    for t in old["turns"]:
        for key in ("preemptive_hit", "preemptive", "end_of_turn"):
            t.pop(key, None)
        t["metrics"].pop("eot_delay", None)
    old["summary"].pop("preemptive", None)
    old["summary"]["metrics"].pop("eot_delay", None)
    return old


def test_turns_taken_back_are_listed_on_the_page(tmp_path):
    """A turn the caller went on in (pipeline/stages/take_back.py), as the real writer
    records it: its own section, with what was heard and begun; none without one."""
    import numpy as np

    from pipeline.config import Config
    from pipeline.events import TurnEnd
    from pipeline.report import CallReport, write_report
    from pipeline.timeline import TurnTimeline
    from pipeline.turn import Turn
    from voice.endpointer import SpeechEnded

    call = CallReport.from_config("call-taken-back", Config())
    t0 = call.t0
    utterance = SpeechEnded(np.zeros(16000, np.float32), t0 + 1.0, t0 + 2.0, t0 + 3.0)
    turn = Turn(index=0, timeline=TurnTimeline.of_utterance(0, utterance), end_of_turn=TurnEnd(utterance, "silence"),
                user_text="I would like to book a cleaning for now. <b>", taken_back_t=t0 + 3.1)
    turn.llm.text, turn.speech.audio_s = "One moment, please.", 0.4
    entry = call.add_taken_back(turn)
    assert entry["before_turn"] == 0 and entry["resumed_at"] == pytest.approx(3.1)
    call.finish("completed")
    data = report_html.load_report(write_report(call, tmp_path))
    assert data["summary"]["taken_back"] == 1 and data["summary"]["turns"] == 0
    page = report_html.render_html(data)
    section = page[page.index("<h2>Turns taken back</h2>"):]
    row = re.search(r'<tr data-before-turn="0">(.*?)</tr>', section).group(1)
    assert "I would like to book a cleaning for now. &lt;b&gt;" in row and "One moment, please." in row
    assert '<td data-value="3.1">' in row and '<td data-value="0.4">' in row
    assert "Turns taken back" not in report_html.render_html(make_report())


def test_preemptive_report_fixture_is_what_it_claims(tmp_path):
    report = preemptive_report(tmp_path)
    assert [t.get("preemptive_hit") for t in report["turns"]] == [None, True, False]
    assert report["summary"]["preemptive"] == {"turns": 2, "starts": 3, "hits": 1, "hit_rate": 0.5,
                                               "discarded": {"caller_resumed": 1, "transcript_changed": 1}}
    assert [t["metrics"]["eot_delay"] for t in report["turns"]] == [pytest.approx(0.3)] * 3
    assert report["turns"][1]["preemptive"]["events"][0]["t"] == pytest.approx(10.9)
    assert report["turns"][1]["metrics"]["stt_latency"] == 0.0  # the kept turn's transcript was the pause's


def test_end_of_turn_and_preemption_on_the_page(tmp_path):
    report = preemptive_report(tmp_path)
    page = report_html.render_html(report)
    # Badges: one kept, one discarded with its reason; none on the turn without a start.
    assert page.count('class="badge preempt kept"') == 1 and page.count('class="badge preempt discarded"') == 1
    assert ">preemptive: discarded: transcript_changed</span>" in page
    turn0 = page[page.index('id="turn-0"'):page.index('id="turn-1"')]
    assert "badge preempt" not in turn0 and "preempt-mark" not in turn0 and 'class="preempt"' not in turn0
    # The end-of-turn decision per turn: reason, probability, eot_delay.
    for i, t in enumerate(report["turns"]):
        line = re.search(rf'<p class="eot" data-turn="{i}">(.*?)</p>', page).group(1)
        assert f'<span data-field="reason">{t["end_of_turn"]["reason"]}</span>' in line
        assert f'data-field="probability" data-value="{t["end_of_turn"]["probability"]!r}"' in line
        assert f'data-field="eot_delay" data-value="{t["metrics"]["eot_delay"]!r}">' \
               f'{t["metrics"]["eot_delay"]:.3f} s' in line
    # The waterfall marks every preemptive event at its time; one bar per start.
    for i, t in enumerate(report["turns"]):
        svg = re.search(rf'id="turn-{i}".*?(<svg class="waterfall".*?</svg>)', page, re.S).group(1)
        marks = re.findall(r'class="preempt-mark [^"]*" data-event="([^"]*)" data-t="([^"]*)"', svg)
        events = (t.get("preemptive") or {}).get("events", [])
        assert [(e, float(v)) for e, v in marks] == [(e["event"], e["t"]) for e in events]
        assert svg.count('class="preempt-bar ') == (t.get("preemptive") or {}).get("starts", 0)
    assert page.count('class="preempt-bar kept"') == 1 and page.count('class="preempt-bar discarded"') == 2
    assert 'data-event="discarded" data-t="11.2" data-why="caller_resumed"' in page
    assert page.count('class="preempt-llm"') == 3
    # STT after the endpoint was skipped only in the kept turn.
    assert page.count('data-field="stt_skipped"') == 1
    assert 'data-field="stt_skipped"' in page[page.index('id="turn-1"'):page.index('id="turn-2"')]
    # The per-turn table: eot_delay after the endpoint delay, and the preemptive outcome.
    head = re.search(r'<table class="turns"><thead><tr>(.*?)</tr>', page).group(1)
    cols = re.findall(r"<th>(.*?)</th>", head)
    assert cols[1:3] == ["endpoint delay", "end-of-turn delay"] and cols[-1] == "preemptive"
    for i, t in enumerate(report["turns"]):
        assert f'<td data-turn="{i}" data-metric="eot_delay" data-value="{t["metrics"]["eot_delay"]!r}">' in page
    assert '<td data-turn="0" data-field="preemptive_hit" data-value=""></td>' in page
    assert '<td data-turn="1" data-field="preemptive_hit" data-value="true">kept</td>' in page
    assert '<td data-turn="2" data-field="preemptive_hit" data-value="false">discarded (transcript_changed)</td>' in page
    # The summary: an eot_delay row, and the preemptive section with the writer's numbers.
    eot = report["summary"]["metrics"]["eot_delay"]
    assert f'data-metric="eot_delay" data-stat="p50" data-value="{eot["p50"]!r}"' in page
    assert "<h2>Preemptive generation</h2>" in page
    for key, value in report["summary"]["preemptive"].items():
        if key != "discarded":
            assert f'data-preemptive="{key}" data-value="{report_html._data_value(value)}"' in page
    assert '<tr data-why="caller_resumed"><td>caller_resumed</td><td data-value="1">1</td></tr>' in page
    # And the terminal summary of `specvoice report`.
    text = report_html.text_summary(report)
    assert "preemptive: 3 starts in 2 turns, 1 kept (hit rate 0.50); discarded: caller_resumed 1, " \
           "transcript_changed 1" in text
    assert "[preemptive: kept]" in text and "[preemptive: discarded: transcript_changed]" in text


def test_a_report_without_the_fields_renders_as_before(tmp_path):
    """Older reports (no end_of_turn, no preemptive fields, no eot_delay) get the page they
    always had: no new column, badge, line, mark, section or style."""
    for old in (make_report(), strip_turn_taking(preemptive_report(tmp_path))):
        page = report_html.render_html(old)
        # (Not the bare words: the configuration shown at the bottom names turn.preemptive.)
        for marker in ("badge preempt", "preempt-mark", "preempt-bar", "preempt-note", 'class="preempt"',
                       'class="eot"', "eot_delay", "end-of-turn delay", "end of turn:", "stt_skipped",
                       "Preemptive generation", 'data-field="preemptive', "data-preemptive"):
            assert marker not in page, marker
        assert f"<style>{report_html.CSS}</style>" in page  # the stylesheet is the one it had
        head = re.search(r'<table class="turns"><thead><tr>(.*?)</tr>', page).group(1)
        assert re.findall(r"<th>(.*?)</th>", head) == ["turn", *report_html.METRIC_LABELS.values(), "tokens/pass",
                                                        "acceptance"]
        assert "preemptive" not in report_html.text_summary(old)
    # Adding the fields back changes the page: the check above is not vacuous.
    assert "preempt-mark" in report_html.render_html(preemptive_report(tmp_path / "again"))
    # A report whose summary lacks `preemptive` (written before the summary had it) still gets it.
    report = preemptive_report(tmp_path / "nosummary")
    written = report["summary"].pop("preemptive")
    assert report_html.preemptive_summary(report) == written
    assert 'data-preemptive="hits" data-value="1"' in report_html.render_html(report)


@pytest.mark.timeout(120)
async def test_preemption_in_headless_chromium(chromium, tmp_path):
    report = preemptive_report(tmp_path)
    path = report_html.write_html([report, make_report("plain")], tmp_path / "preempt.html")
    async with open_page(chromium, path) as cdp:
        dom = json.loads(await cdp.evaluate("""JSON.stringify({
            badges: [...document.querySelectorAll('#report-0 .turn h3 .badge.preempt')].map(e =>
                [e.closest('.turn').id, e.textContent, getComputedStyle(e).backgroundColor]),
            eot: [...document.querySelectorAll('#report-0 p.eot')].map(e => e.textContent),
            skipped: [...document.querySelectorAll('#report-0 [data-field=stt_skipped]')].map(e =>
                [e.closest('.turn').id, e.getBoundingClientRect().width]),
            marks: [...document.querySelectorAll('#report-0 #turn-1 svg line.preempt-mark')].map(l => {
                const b = l.getBoundingClientRect(); return {event: l.dataset.event, t: +l.dataset.t,
                x: b.left, height: b.height, title: l.querySelector('title').textContent}; }),
            bars: [...document.querySelectorAll('#report-0 svg rect.preempt-bar')].map(r => {
                const b = r.getBoundingClientRect(); return {outcome: r.dataset.outcome, width: b.width,
                fill: getComputedStyle(r).fill}; }),
            svg: (() => { const b = document.querySelector('#report-0 #turn-1 svg.waterfall').getBoundingClientRect();
                          return {left: b.left, right: b.right}; })(),
            notes: [...document.querySelectorAll('#report-0 svg text.preempt-note')].map(t => t.textContent),
            cards: Object.fromEntries([...document.querySelectorAll('#report-0 [data-preemptive]')].map(e =>
                [e.dataset.preemptive, e.textContent])),
            eotCells: [...document.querySelectorAll('#report-0 td[data-turn][data-metric=eot_delay]')].map(e =>
                e.textContent),
            plain: {preempt: document.querySelectorAll('#report-1 [class*=preempt]').length,
                    eot: document.querySelectorAll('#report-1 p.eot, #report-1 [data-metric=eot_delay]').length},
        })"""))
        assert cdp.errors() == []
    assert [(b[0], b[1]) for b in dom["badges"]] == [("turn-1", "preemptive: kept"),
                                                   ("turn-2", "preemptive: discarded: transcript_changed")]
    assert dom["badges"][0][2] != dom["badges"][1][2]  # kept and discarded look different
    for text, t in zip(dom["eot"], report["turns"]):
        e = t["end_of_turn"]
        assert text.startswith(f"end of turn: {e['reason']} · P(complete) {e['probability']:.2f} · "
                               f"eot_delay {t['metrics']['eot_delay']:.3f} s")
    assert [s[0] for s in dom["skipped"]] == ["turn-1"] and dom["skipped"][0][1] > 0
    # The marks sit on the time axis in the order of their times, inside the waterfall.
    marks = dom["marks"]
    assert [m["event"] for m in marks] == ["start", "llm_start", "discarded", "start", "llm_start", "kept"]
    assert all(a["x"] < b["x"] for a, b in zip(marks, marks[1:]))
    assert all(dom["svg"]["left"] < m["x"] < dom["svg"]["right"] and m["height"] > 0 for m in marks)
    assert "caller_resumed" in marks[2]["title"] and "5 token groups ready, finished" in marks[5]["title"]
    assert [b["outcome"] for b in dom["bars"]] == ["discarded", "kept", "discarded"]
    assert all(b["width"] > 0 for b in dom["bars"])
    assert dom["bars"][1]["fill"] == "rgb(47, 158, 68)" and dom["bars"][0]["fill"] != dom["bars"][1]["fill"]
    assert dom["notes"] == ["✗ caller_resumed", "kept", "✗ transcript_changed"]
    assert dom["cards"] == {"turns": "2", "starts": "3", "hits": "1", "hit_rate": "0.50"}
    assert dom["eotCells"] == [f"{t['metrics']['eot_delay']:.3f}" for t in report["turns"]]
    assert dom["plain"] == {"preempt": 0, "eot": 0}  # the older report beside it is unchanged
