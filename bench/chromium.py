"""Headless Chromium driven over the DevTools protocol, for benchmarks of the call page:
a fake microphone that reads a WAV file, a real mouse click, JavaScript evaluated in the page.

    async with chromium(wav) as devtools_port:
        async with open_page(devtools_port, url) as page:
            await page.click("#call")
            await page.until("window.specvoice.state === 'in-call'")
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

__all__ = ["CHROMIUM", "Page", "chromium", "open_page"]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--window-size=1100,1300", "--hide-scrollbars",
         "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
         "--autoplay-policy=no-user-gesture-required"]


@contextlib.asynccontextmanager
async def chromium(microphone_wav: Path, loop: bool = False):
    """Chromium whose microphone reads `microphone_wav` (once unless `loop`); yields its DevTools port."""
    if CHROMIUM is None:
        raise RuntimeError("chromium not found (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="specvoice-chromium-") as profile:
        audio = f"--use-file-for-fake-audio-capture={microphone_wav}{'' if loop else '%noloop'}"
        proc = subprocess.Popen([CHROMIUM, *FLAGS, audio, f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not (port_file.is_file() and port_file.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("chromium did not start its DevTools endpoint")
                await asyncio.sleep(0.05)
            yield int(port_file.read_text().split()[0])
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


class Page:
    def __init__(self, ws):
        self.ws, self.next_id, self.events = ws, 0, []

    async def call(self, method: str, **params) -> dict:
        self.next_id += 1
        my_id = self.next_id
        await self.ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.ws.recv())
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    async def evaluate(self, expression: str, await_promise: bool = False):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=await_promise)
        return result["result"].get("value")

    async def until(self, condition: str, timeout_s: float = 300.0) -> None:
        """Until the JS `condition` holds in the page (checked there every 20 ms)."""
        script = (f"new Promise(r => {{ const c = () => {{ try {{ if ({condition}) return r(true); }} catch (e) {{}} "
                  f"setTimeout(c, 20); }}; c(); }})")
        await asyncio.wait_for(self.evaluate(script, await_promise=True), timeout_s)

    async def click(self, selector: str) -> None:
        box = json.loads(await self.evaluate(
            f"JSON.stringify((r => ({{x: r.x + r.width / 2, y: r.y + r.height / 2}}))"
            f"(document.querySelector({json.dumps(selector)}).getBoundingClientRect()))"))
        for kind in ("mousePressed", "mouseReleased"):
            await self.call("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left",
                            clickCount=1)


@contextlib.asynccontextmanager
async def open_page(devtools_port: int, url: str):
    import httpx
    from websockets.asyncio.client import connect

    async with httpx.AsyncClient() as client:
        target = (await client.put(f"http://127.0.0.1:{devtools_port}/json/new?about:blank")).json()
    async with connect(target["webSocketDebuggerUrl"], max_size=None) as ws:
        page = Page(ws)
        for domain in ("Runtime", "Page"):
            await page.call(f"{domain}.enable")
        await page.call("Page.navigate", url=url)
        while not any(e.get("method") == "Page.loadEventFired" for e in page.events):
            page.events.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
        yield page
