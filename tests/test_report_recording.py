"""A report page with the call's recording (`specvoice report` beside a CALL.wav, and the
report pages of `specvoice serve`): the page plays the WAV, a click on a turn seeks to that
turn, in headless Chromium; the page's one script runs by its hash, nothing else can."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from demo import report_html
from demo.cli import main as cli_main
from test_report_html import CDP, XSS_SCRIPT, chromium, make_report, open_page  # noqa: F401 (chromium: a fixture)


def write_call(tmp_path: Path, seconds: float = 40.0) -> Path:
    from voice.wav import write_wav

    report = make_report()
    report["turns"][0]["user_text"] = XSS_SCRIPT  # a caller's words still never run
    path = tmp_path / "call-0001.json"
    path.write_text(json.dumps(report), encoding="utf-8")
    t = np.arange(int(16000 * seconds)) / 16000
    write_wav(path.with_suffix(".wav"), np.stack([0.2 * np.sin(2 * np.pi * 220 * t), 0.2 * np.sin(2 * np.pi * 330 * t)],
                                                 axis=1).astype(np.float32), 16000)
    return path


def test_report_command_links_the_recording_beside_the_json(tmp_path, capsys):
    path = write_call(tmp_path)
    assert cli_main(["report", str(path)]) == 0
    page = path.with_suffix(".html").read_text(encoding="utf-8")
    assert '<audio id="recording" controls preload="metadata" src="call-0001.wav">' in page
    # Exactly one script, the seek script, allowed by its hash and nothing else.
    scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert scripts == [report_html.SEEK_SCRIPT]
    assert f"script-src 'sha256-{report_html.SEEK_SCRIPT_SHA256}'" in page
    turns = make_report()["turns"]
    seeks = [float(v) for v in re.findall(r'class="turn" id="turn-\d+" data-seek="([0-9.]+)"', page)]
    assert seeks == [max(0.0, round(t["timeline"]["speech_start"] - report_html.SEEK_LEAD_S, 3)) for t in turns]
    # Without a recording the page stays script-free, as before.
    path.with_suffix(".wav").unlink()
    assert cli_main(["report", str(path)]) == 0
    assert "<script" not in path.with_suffix(".html").read_text(encoding="utf-8").lower()


@pytest.mark.timeout(120)
async def test_a_click_on_a_turn_seeks_the_recording_in_chromium(chromium, tmp_path):  # noqa: F811
    path = write_call(tmp_path)
    assert cli_main(["report", str(path)]) == 0
    async with open_page(chromium, path.with_suffix(".html")) as cdp:
        await cdp.call("Runtime.evaluate", awaitPromise=True, expression="""new Promise(r => {
            const a = document.getElementById('recording');
            if (a.readyState >= 1) r(); else a.addEventListener('loadedmetadata', () => r()); })""")
        state = json.loads(await cdp.evaluate("""JSON.stringify({
            duration: document.getElementById('recording').duration,
            seekable: document.querySelectorAll('.turn.seekable').length,
            pwned: window.__pwned === undefined ? null : window.__pwned })"""))
        assert state == {"duration": pytest.approx(40.0, abs=0.05), "seekable": 4, "pwned": None}
        target = await cdp.evaluate("document.querySelector('#turn-2').dataset.seek")
        box = json.loads(await cdp.evaluate("""(() => { const e = document.querySelector('#turn-2 h3');
            e.scrollIntoView(); const r = e.getBoundingClientRect();
            return JSON.stringify({x: r.x + r.width / 2, y: r.y + r.height / 2}); })()"""))
        for kind in ("mousePressed", "mouseReleased"):
            await cdp.call("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left", clickCount=1)
        # The seek lands at once (currentTime is set by the click); playback may move it on.
        now = await cdp.evaluate("document.getElementById('recording').currentTime")
        assert float(target) > 5 and float(target) <= now < float(target) + 5, (target, now)
        assert cdp.errors() == []
