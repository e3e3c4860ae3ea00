"""Headless Chromium driven over the DevTools protocol (CDP): the one client that the call-page
benchmark (`specvoice bench web`) and the browser tests (tests/test_report_html.py,
test_report_recording.py, test_call_page.py) share. A fake microphone that reads a WAV file,
a real mouse click, JavaScript evaluated in the page, the page's errors.

    async with chromium(wav) as devtools_port:
        async with open_page(devtools_port, url) as page:
            await page.click("#call")
            await page.until("window.specvoice.state === 'in-call'")

`chromium_blocking(profile)` starts the same browser without an event loop (a module-scoped
pytest fixture). Needs httpx and websockets (imported when a page opens).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["CDP", "CHROMIUM", "ChromiumError", "chromium", "chromium_blocking", "open_page"]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--hide-scrollbars"]
# A microphone that reads a WAV file, granted without asking, and audio that plays unprompted.
MICROPHONE_FLAGS = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
                    "--autoplay-policy=no-user-gesture-required"]
WINDOW = (1100, 1400)


class ChromiumError(RuntimeError):
    """Chromium is missing, exited, or did not open its DevTools endpoint in time."""


@contextlib.contextmanager
def _process(profile: Path, microphone_wav: Path | None, loop: bool, window: tuple[int, int]):
    if CHROMIUM is None:
        raise ChromiumError("chromium not found (apt-get install chromium)")
    flags = [*FLAGS, f"--window-size={window[0]},{window[1]}"]
    if microphone_wav is not None:
        flags += [*MICROPHONE_FLAGS, f"--use-file-for-fake-audio-capture={microphone_wav}{'' if loop else '%noloop'}"]
    proc = subprocess.Popen([CHROMIUM, *flags, f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _devtools_port(profile: Path, proc: subprocess.Popen, deadline: float) -> int | None:
    """The DevTools port once Chromium has written it into the profile; None while it starts."""
    port_file = profile / "DevToolsActivePort"
    if port_file.is_file() and port_file.read_text().strip():
        return int(port_file.read_text().split()[0])
    if proc.poll() is not None or time.monotonic() > deadline:
        raise ChromiumError("chromium did not start its DevTools endpoint")
    return None


@contextlib.asynccontextmanager
async def chromium(microphone_wav: Path | None = None, loop: bool = False, profile: Path | None = None,
                   window: tuple[int, int] = WINDOW, timeout_s: float = 60.0):
    """Chromium whose microphone reads `microphone_wav` (once unless `loop`), its profile in
    `profile` (default: a temporary folder); yields its DevTools port."""
    with contextlib.ExitStack() as stack:
        if profile is None:
            profile = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specvoice-chromium-")))
        proc = stack.enter_context(_process(profile, microphone_wav, loop, window))
        deadline = time.monotonic() + timeout_s
        while (port := _devtools_port(profile, proc, deadline)) is None:
            await asyncio.sleep(0.05)  # waiting for the file Chromium writes when ready
        yield port


@contextlib.contextmanager
def chromium_blocking(profile: Path, window: tuple[int, int] = WINDOW, timeout_s: float = 30.0):
    """`chromium()` without a microphone, for code outside an event loop; yields the DevTools port."""
    with _process(profile, None, False, window) as proc:
        deadline = time.monotonic() + timeout_s
        while (port := _devtools_port(profile, proc, deadline)) is None:
            time.sleep(0.05)
        yield port


class CDP:
    """A minimal DevTools protocol client on one page's WebSocket: commands by id, the events
    that arrive meanwhile kept in `events`. `read_timeout_s` bounds each wait for a command's
    answer (None: no bound)."""

    def __init__(self, ws, read_timeout_s: float | None = 20.0):
        self.ws, self.read_timeout_s, self.next_id, self.events = ws, read_timeout_s, 0, []

    async def _read(self, timeout_s: float | None) -> dict:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout_s))

    async def call(self, method: str, **params) -> dict:
        return await self._call(method, params, self.read_timeout_s)

    async def _call(self, method: str, params: dict, timeout_s: float | None) -> dict:
        self.next_id += 1
        my_id = self.next_id
        await self.ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = await self._read(timeout_s)
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    async def wait_event(self, method: str, timeout: float = 20) -> dict:
        """The first event `method` (taken out of `events`), waiting up to `timeout` s for it."""
        async with asyncio.timeout(timeout):
            while True:
                for ev in self.events:
                    if ev.get("method") == method:
                        self.events.remove(ev)
                        return ev
                self.events.append(await self._read(None))

    async def evaluate(self, expression: str, await_promise: bool = False):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=await_promise)
        return result["result"].get("value")

    async def until(self, condition: str, timeout_s: float = 300.0):
        """Until the JS `condition` holds in the page (the page checks it every 20 ms: the state
        it tests is set by the page's own handlers); returns what the page answered (true).
        One long await inside the page, so no bound per read: only `timeout_s` overall."""
        script = (f"new Promise(r => {{ const c = () => {{ try {{ if ({condition}) return r(true); }} catch (e) {{}} "
                  f"setTimeout(c, 20); }}; c(); }})")
        params = {"expression": script, "awaitPromise": True, "returnByValue": True}
        result = await asyncio.wait_for(self._call("Runtime.evaluate", params, None), timeout_s)
        return result["result"].get("value")

    async def click(self, selector: str) -> None:
        """A real mouse click (a user gesture, as a person's would be) at the element's centre."""
        box = json.loads(await self.evaluate(
            f"JSON.stringify((r => ({{x: r.x + r.width / 2, y: r.y + r.height / 2}}))"
            f"(document.querySelector({json.dumps(selector)}).getBoundingClientRect()))"))
        for kind in ("mousePressed", "mouseReleased"):
            await self.call("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left",
                            clickCount=1)

    def errors(self) -> list[str]:
        """Exceptions, console errors and error log entries the page reported so far."""
        out = []
        for ev in self.events:
            method, p = ev.get("method"), ev.get("params", {})
            if method == "Runtime.exceptionThrown":
                out.append(json.dumps(p.get("exceptionDetails", {}))[:300])
            elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(json.dumps(p.get("args", []))[:300])
            elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(p["entry"].get("text", "")[:300])
        return out


@contextlib.asynccontextmanager
async def open_page(devtools_port: int, url: str, read_timeout_s: float | None = 20.0, load_timeout_s: float = 60.0):
    """A new tab at `url`, once its load event fired; yields its `CDP` client."""
    import httpx
    from websockets.asyncio.client import connect

    async with httpx.AsyncClient() as client:
        target = (await client.put(f"http://127.0.0.1:{devtools_port}/json/new?about:blank")).json()
    async with connect(target["webSocketDebuggerUrl"], max_size=None) as ws:
        page = CDP(ws, read_timeout_s)
        for domain in ("Runtime", "Log", "Page"):
            await page.call(f"{domain}.enable")
        await page.call("Page.navigate", url=url)
        await page.wait_event("Page.loadEventFired", timeout=load_timeout_s)
        yield page
