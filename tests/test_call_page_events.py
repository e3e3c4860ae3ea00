"""The call page's handling of the call's events, in real headless Chromium, without
models: the page's own files served over HTTP, and the server's messages handed to the
page's own `onServer` in the order a call sends them. What a real call sends is checked
end to end in test_call_page.py; this covers the sequences that a two-minute call cannot
place on demand (a turn taken back: pipeline/stages/take_back.py)."""

from __future__ import annotations

import functools
import http.server
import json
import threading
from pathlib import Path

import pytest

from bench.chromium import CHROMIUM, chromium_blocking, open_page

STATIC = Path(__file__).resolve().parent.parent / "pipeline" / "transports" / "web" / "static"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")


@pytest.fixture
def page_url(tmp_path):
    """call.html and its files at /static/, as the server serves them."""
    (tmp_path / "static").symlink_to(STATIC, target_is_directory=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/static/call.html"
    finally:
        server.shutdown()
        server.server_close()


def event(kind: str, t: float, **data) -> dict:
    return {"type": "event", "kind": kind, "t": t, **data}


TAKEN_BACK = {"before_turn": 0, "user_text": "I would like to book a cleaning for now.",
              "agent_text": "One moment, please.", "agent_audio_s": 1.3, "resumed_at": 5.2,
              "timeline": {}, "end_of_turn": {"reason": "silence", "pauses": 1}}


@pytest.fixture
def browser(tmp_path):
    """Chromium, its profile in the test's folder (pytest removes it once Chromium is gone)."""
    with chromium_blocking(tmp_path / "chromium-profile") as port:
        yield port


async def test_a_turn_taken_back_leaves_the_joined_turn_alone_on_the_page(page_url, browser):
    messages = [
        event("speech_started", 1.0),
        event("end_of_turn", 5.0, reason="silence", probability=None, delay=1.0, pauses=1),
        event("transcript", 5.1, turn=0, text=TAKEN_BACK["user_text"]),
        event("sentence", 5.3, turn=0, text="One moment, please."),
        event("speech_started", 5.4),
        event("turn_taken_back", 5.5, **TAKEN_BACK),
        event("end_of_turn", 7.0, reason="silence", probability=None, delay=0.7, pauses=2),
        event("transcript", 7.01, turn=0, text="I would like to book a cleaning for next Tuesday morning."),
        event("sentence", 7.4, turn=0, text="Tuesday at 10:30 is free."),
        event("heard", 8.9, turn=0, text="Tuesday at 10:30 is free."),
    ]
    async with open_page(browser, page_url) as cdp:
        for m in messages:
            await cdp.evaluate(f"onServer({{data: {json.dumps(json.dumps(m))}}})")
        page = json.loads(await cdp.evaluate("""JSON.stringify({
            items: [...document.querySelectorAll('#transcript li')].map(li => [li.dataset.key, li.textContent.trim()]),
            turns: Object.keys(window.specvoice.turns),
            first: window.specvoice.turns[0] && window.specvoice.turns[0].first,
            boxes: document.querySelectorAll('#turns .turn').length})"""))
        assert cdp.errors() == []
    # One caller line (the joined words) and one agent line (the joined turn's answer only):
    # the hold line the taken-back turn had begun is gone.
    assert page["items"] == [["caller-0", "I would like to book a cleaning for next Tuesday morning."],
                             ["agent-0", "Tuesday at 10:30 is free."]]
    # The turn's provisional figures are the joined turn's: its first sentence 0.39 s after
    # its transcript, not the taken-back turn's 0.2 s.
    assert page["turns"] == ["0"] and page["first"] == pytest.approx(0.39) and page["boxes"] == 1
